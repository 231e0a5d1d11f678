"""Worker stage: one step's model inputs, from the persistent batch and the step's plan.

Flattens the scheduled requests into the varlen batch the model consumes (token ids,
positions, slot mapping, cumulative query lengths, sequence lengths, block tables) and picks
the tokens to sample; a decode step that a captured CUDA graph serves is staged into that
graph's buffers instead (worker/cuda_graphs.py). Owns nothing: it reads the InputBatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.layers.attention import AttentionMetadata
from pipeline.layers.flash_prefill import plan
from pipeline.messages import SchedulerOutput
from pipeline.worker.cuda_graphs import DecodeGraphs
from pipeline.worker.input_batch import InputBatch


@dataclass(slots=True)
class StepInputs:
    """One step's flattened batch, as the model consumes it."""
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    rows: np.ndarray  # [B] persistent-batch rows, in batch order
    num_scheduled: np.ndarray  # [B]
    logits_indices: torch.Tensor  # [S] token index of each sampled request's last token
    sample_batch_idx: np.ndarray  # [S] index into rows of each sampled request
    graph_size: int = 0  # >0: a decode step staged for the CUDA graph of that batch size


def prepare_inputs(b: InputBatch, sched: SchedulerOutput, device: torch.device,
                   graphs: DecodeGraphs | None = None, flash: bool = False) -> StepInputs:
    """The step's flattened inputs. A decode step (one token per request) of at most
    ``graphs.max_batch`` requests without prompt logprobs is staged into those CUDA graphs.
    ``flash``: the step's long query runs go to the tensor-core prefill (layers/flash_prefill)."""
    bs = b.block_size
    index = b.index
    rows = np.fromiter((index[r] for r in sched.num_scheduled_tokens), dtype=np.int64,
                       count=len(sched.num_scheduled_tokens))
    n = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))
    start = b.num_computed_tokens[rows]
    seq_lens = start + n
    # Cheap vectorised guards: a bad plan would otherwise sample garbage or write K/V
    # into another request's blocks.
    bad = np.nonzero((n <= 0) | (seq_lens > b.num_tokens[rows])
                     | (seq_lens > b.num_blocks[rows] * bs))[0]
    if len(bad):
        i, r = int(bad[0]), int(rows[bad[0]])
        raise ValueError(
            f"step {sched.step_id}: request {b.req_ids[r]!r} scheduled {int(n[i])} tokens up to "
            f"token {int(seq_lens[i])}; it has {int(b.num_tokens[r])} known tokens and "
            f"{int(b.num_blocks[r])} blocks of {bs}")
    num_seqs = len(rows)
    decode = int(n.sum()) == num_seqs
    if decode:
        # Decode-only step (one token each): no per-token expansion needed.
        cu = np.arange(num_seqs + 1, dtype=np.int32)
        positions, tok_rows = start, rows
    else:
        cu = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(n, out=cu[1:])
        seq_of_tok = np.repeat(np.arange(num_seqs), n)
        positions = start[seq_of_tok] + np.arange(int(cu[-1])) - cu[:-1][seq_of_tok]
        tok_rows = rows[seq_of_tok]
    input_ids = b.token_ids[tok_rows, positions].astype(np.int64)
    slots = b.block_table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
    done = seq_lens >= b.num_tokens[rows]
    if b.num_embed:  # an embedding request is pooled (worker.pooling), never sampled
        done &= ~b.embed[rows]
    sample_idx = np.nonzero(done)[0]
    if (graphs is not None and decode and num_seqs <= graphs.max_batch and not b.num_prompt_logprob_rows
            and not b.num_embed):
        size, ids_t, pos_t, meta = graphs.stage(input_ids, positions, slots,
                                                seq_lens.astype(np.int32), b.block_table[rows])
        return StepInputs(input_ids=ids_t, positions=pos_t, meta=meta, rows=rows, num_scheduled=n,
                          logits_indices=torch.from_numpy(sample_idx).to(device, non_blocking=True),
                          sample_batch_idx=sample_idx, graph_size=size)
    max_blocks = int(-(-int(seq_lens.max()) // bs))
    block_tables = np.ascontiguousarray(b.block_table[rows, :max_blocks])
    # Every array already has the dtype the model wants, so on CPU each tensor is a
    # zero-copy view of it.
    if device.type == "cpu":
        t = torch.from_numpy
    else:
        dev = device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device=dev, non_blocking=True)

    meta = AttentionMetadata(slot_mapping=t(slots), cu_seqlens_q=t(cu),
                             seq_lens=t(seq_lens.astype(np.int32)), block_tables=t(block_tables),
                             prefill=plan(n, seq_lens, block_tables, bs, t) if flash and not decode else None)
    return StepInputs(input_ids=t(input_ids), positions=t(positions), meta=meta, rows=rows,
                      num_scheduled=n, logits_indices=t(cu[1:][sample_idx].astype(np.int64) - 1),
                      sample_batch_idx=sample_idx)
