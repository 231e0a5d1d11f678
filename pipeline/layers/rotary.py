"""Layers: rotary position embedding (RoPE), neox style, as one table per model.

Owns the cos/sin tables over every usable position (float32, recomputed on the model's
device by ``reset``). The inverse frequencies (with the checkpoint's scaling variant) come
from the model config (``models.config.rope_inv_freq``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a cos/sin table over every usable position.

    Tables are stored full-width as ``cos = [c, c]`` and ``sin = [-s, s]`` so that
    ``x * cos + roll(x, D/2) * sin`` is rotate-half RoPE in four ops."""

    def __init__(self, head_dim: int, max_positions: int,
                 inv_freq: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        # Called by reset(), not here: models are built on the meta device.
        self.inv_freq, self.head_dim, self.max_positions = inv_freq, head_dim, max_positions
        half = head_dim // 2
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(max_positions, 2 * half), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, 2 * half), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the float32 tables on the buffers' device (after ``to_empty``)."""
        if self.cos.is_meta:
            return
        dev = self.cos.device
        inv_freq = self.inv_freq().to(dev)
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device=dev)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        self.cos, self.sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)
        return torch.addcmul(x * cos, rotated, sin)
