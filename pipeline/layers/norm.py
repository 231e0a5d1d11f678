"""Layers: RMSNorm (Llama's), with the rounding of transformers for half types.

Owns its weight. On CPU float32 the decoders call ``ops_fused.rms_norm`` directly (with the
residual add fused in); this module is the per-op path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)  # loaded later
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # transformers normalises in float32 and casts back before the weight multiply.
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
