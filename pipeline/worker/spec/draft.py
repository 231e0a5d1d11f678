"""Worker stage: the ``draft_model`` proposer (docs/speculative.md): a small model with the
target's tokenizer, run by rank 0 beside the target, drafting greedily.

Its KV lives in a cache of its own with as many blocks as the target's pool, indexed by the
same block table: a request's draft KV for position p sits in the block the target's KV for
p does, so the engine's one block table (and its lookahead: it allocates K slots past each
sampling step's tokens for the draft to write into) serves both, and a block freed by the
engine is free for both. The draft's KV of a request is valid up to ``computed`` (positions
it ran with the request's actual tokens); each proposal first runs the request's tokens from
there (its prompt at the first one: a prefix the target found cached may have no draft KV),
the last one included, then feeds back its own argmax K - 1 times. A draft's KV past the
last known token is speculative: the next proposal reruns from the last known position.

Drafting greedily makes a draft a token, not a distribution, which the verify step's
rejection rule takes exactly (worker.spec.verify).

Memory: the pool is sized for both (``draft_kv_bytes_per_block`` is added to the target's
bytes per block before ``--kv-cache-memory`` or the default budget is divided into blocks,
worker.kv_sizing), so the two caches together stay within the budget.

Owns / State: the draft model's weights and KV tensors, ``computed`` per request.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

from pipeline.config import EngineConfig
from pipeline.layers import ops
from pipeline.layers.attention import AttentionMetadata
from pipeline.layers.ops_fused import argmax
from pipeline.models.config import load_model_config
from pipeline.models.llama import CausalLM
from pipeline.models.loader import load_weights
from pipeline.worker.device import resolve_dtype, weight_plan
from pipeline.worker.input_batch import InputBatch


def draft_kv_bytes_per_block(config: EngineConfig, model_dir: str, block_size: int, device: torch.device) -> int:
    """The draft model's KV bytes for one block of the pool (all its layers, K and V), read
    from its config before it is loaded: what each block costs beside the target's."""
    mc = load_model_config(model_dir)
    dtype = resolve_dtype(config.model_config.dtype, mc.torch_dtype, device, ops.backend(device) is not None)
    item = torch.empty(0, dtype=dtype).element_size()
    return mc.num_layers * 2 * block_size * mc.num_kv_heads * mc.head_dim * item


class DraftModel:
    def __init__(self, config: EngineConfig, model_dir: str, device: torch.device, num_blocks: int,
                 block_size: int, max_model_len: int, vocab_size: int) -> None:
        t0 = time.perf_counter()
        mc = load_model_config(model_dir)
        if mc.vocab_size > vocab_size:
            raise ValueError(f"--speculative-config model {model_dir}: its vocabulary ({mc.vocab_size}) "
                             f"is larger than the target's ({vocab_size}): not the same tokenizer")
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(f"--speculative-config model {model_dir}: max_position_embeddings="
                             f"{mc.max_position_embeddings} is below the target's max_model_len={max_model_len}")
        self.device, self.block_size = device, block_size
        have_ops = ops.backend(device) is not None
        dtype = resolve_dtype(config.model_config.dtype, mc.torch_dtype, device, have_ops)
        plan = weight_plan(model_dir, dtype, "none", config.model_config.quantization_group_size, device,
                           have_ops)
        with torch.device("meta"):
            model = CausalLM(mc, max_model_len)
        load_weights(model, model_dir, plan)
        model.tp = None
        self.model = model.eval()
        shape = (mc.num_layers, 2, num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(mc.num_layers)]
        self.computed: dict[str, int] = {}
        self.kv_bytes = self.kv.numel() * self.kv.element_size()
        print(f"draft model: {mc.architecture} {model_dir}, {dtype}, KV {self.kv_bytes / 2**20:.1f} MiB "
              f"({num_blocks} blocks, counted in the KV budget), loaded in {time.perf_counter() - t0:.2f}s",
              file=sys.stderr, flush=True)

    def remove(self, req_id: str) -> None:
        self.computed.pop(req_id, None)

    def _forward(self, b: InputBatch, rows: list[int], starts: list[int], ids: list[np.ndarray]) -> np.ndarray:
        """Run ``ids[i]`` at positions ``starts[i]``... of each row; the argmax after each."""
        n = np.array([len(x) for x in ids], np.int64)
        start = np.array(starts, np.int64)
        r = np.array(rows, np.int64)
        cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(n, out=cu[1:])
        seq = np.repeat(np.arange(len(rows)), n)
        positions = start[seq] + np.arange(int(cu[-1])) - cu[:-1][seq]
        bs = self.block_size
        slots = b.block_table[r[seq], positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (start + n).astype(np.int32)
        tables = np.ascontiguousarray(b.block_table[r, :int(-(-int(seq_lens.max()) // bs))])
        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        # The metadata outside inference mode (the ops cache their checks keyed on tensor
        # version counters, which inference tensors lack), the forward inside.
        with torch.inference_mode(False):
            meta = AttentionMetadata(slot_mapping=t(slots), cu_seqlens_q=t(cu), seq_lens=t(seq_lens),
                                     block_tables=t(tables))
            inp, pos = t(np.concatenate(ids).astype(np.int64)), t(positions)
            last = torch.from_numpy(cu[1:].astype(np.int64) - 1).to(dev)
        with torch.inference_mode():
            hidden = self.model(inp, pos, meta, self.layers)
            return argmax(self.model.compute_logits(hidden.index_select(0, last))).cpu().numpy()

    def propose(self, b: InputBatch, rows: list[int], want: list[int]) -> dict[int, list[int]]:
        """Up to ``want[i]`` greedy drafts for each of ``rows`` (row -> drafts), within the
        slots its blocks give and max_model_len."""
        bs = self.block_size
        live, starts, ids, ks = [], [], [], []
        for r, k in zip(rows, want):
            rid = b.req_ids[r]
            assert rid is not None  # a live row
            n = int(b.num_tokens[r])
            room = min(int(b.num_blocks[r]) * bs, b.max_model_len) - n + 1  # KV slots up to n + k - 2
            if room < 1:
                continue
            start = min(self.computed.get(rid, 0), n - 1)
            live.append(r)
            starts.append(start)
            ids.append(b.token_ids[r, start:n])
            ks.append(min(k, room))
            self.computed[rid] = n  # positions below n run with the request's own tokens
        out: dict[int, list[int]] = {r: [] for r in live}
        if not live:
            return out
        tok = self._forward(b, live, starts, ids)
        pos = [s + len(x) for s, x in zip(starts, ids)]
        for j in range(max(ks)):
            for i in range(len(live)):
                if ks[i] > j:
                    out[live[i]].append(int(tok[i]))
            more = [i for i in range(len(live)) if ks[i] > j + 1]
            if not more:
                break
            # Each draft in turn at the next position (its KV slot is the engine's lookahead).
            nxt = self._forward(b, [live[i] for i in more], [pos[i] for i in more],
                                [np.array([tok[i]], np.int32) for i in more])
            for i, t in zip(more, nxt):
                tok[i] = t
                pos[i] += 1
        return out
