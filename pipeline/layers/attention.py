"""Layers: what paged attention needs for one step (the batch's attention metadata).

Built by the worker's model runner from the step's slot mapping and block tables; read by
every attention call of the step. Owns no state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeline.layers.flash_prefill import FlashPrefill


@dataclass(slots=True)
class AttentionMetadata:
    """What paged attention needs for one step (all tensors on the model's device)."""
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, M] int32
    prefill: FlashPrefill | None = None  # CUDA: the sequences whose attention runs on tensor cores
