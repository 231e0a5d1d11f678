"""Worker stage: the persistent batch. One row per live request: its known tokens, its block
table, its computed-token count and its sampling settings, kept in numpy arrays so a step's
inputs are gathered with vectorised indexing instead of per-token Python.

Owns the rows; the engine's per-step diff (SchedulerOutput) is applied with add/remove/
append_blocks, and the model runner appends each sampled token with append_tokens. The
per-request logits processors (logit_bias, allowed_token_ids, bad words) are kept per row as
numpy arrays, converted once at ``add``.
"""
from __future__ import annotations

import numpy as np

from pipeline.messages import NewRequestData, bytes_to_ids
from pipeline.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 initial_token_capacity: int = 1024) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        r = max_num_reqs
        self.req_ids: list[str | None] = [None] * r
        self.index: dict[str, int] = {}
        self._free = list(range(r - 1, -1, -1))  # pop() hands out the lowest row first
        # Token rows grow on demand: max_model_len can be 128k, most requests are short.
        self.token_ids = np.zeros((r, min(initial_token_capacity, max_model_len + 1)), dtype=np.int32)
        self.num_tokens = np.zeros(r, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(r, dtype=np.int64)
        self.num_computed_tokens = np.zeros(r, dtype=np.int64)
        self.block_table = np.zeros((r, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(r, dtype=np.int64)
        # Sampling settings, one slot per row (vectorised in the sampler).
        self.params: list[SamplingParams | None] = [None] * r
        self.temperature = np.ones(r, dtype=np.float32)
        self.top_p = np.ones(r, dtype=np.float32)
        self.top_k = np.zeros(r, dtype=np.int64)  # 0: disabled
        self.min_p = np.zeros(r, dtype=np.float32)
        self.repetition_penalty = np.ones(r, dtype=np.float32)
        self.presence_penalty = np.zeros(r, dtype=np.float32)
        self.frequency_penalty = np.zeros(r, dtype=np.float32)
        self.seed = np.full(r, -1, dtype=np.int64)  # -1: unseeded
        self.num_logprobs = np.full(r, -1, dtype=np.int64)  # -1: none
        self.num_prompt_logprobs = np.full(r, -1, dtype=np.int64)  # -1: none
        self.num_prompt_logprob_rows = 0  # live rows with num_prompt_logprobs >= 0
        self.min_tokens = np.zeros(r, dtype=np.int64)
        # Logits processors: (token ids, biases), allowed token ids, bad word sequences.
        self.logit_bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * r
        self.allowed_token_ids: list[np.ndarray | None] = [None] * r
        self.bad_words: list[list[list[int]] | None] = [None] * r
        self.has_processors = np.zeros(r, dtype=bool)
        # Live rows that need more than argmax of the raw logits (sampling, penalties,
        # logprobs, min_tokens, logits processors): while there are none the model runner
        # skips the sampler.
        self.needs_sampler = np.zeros(r, dtype=bool)
        self.num_needs_sampler = 0
        self.structured = np.zeros(r, dtype=bool)
        self.num_structured = 0
        # Embedding requests (worker.pooling): prefill only, never sampled.
        self.embed = np.zeros(r, dtype=bool)
        self.num_embed = 0

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.index

    def _ensure_token_capacity(self, n: int) -> None:
        cap = self.token_ids.shape[1]
        if n <= cap:
            return
        # +1: the token sampled after the last position still needs a slot.
        new_cap = min(max(n, 2 * cap), self.max_model_len + 1)
        grown = np.zeros((self.max_num_reqs, new_cap), dtype=np.int32)
        grown[:, :cap] = self.token_ids
        self.token_ids = grown

    def add(self, req: NewRequestData) -> int:
        if req.req_id in self.index:
            raise ValueError(f"request {req.req_id!r} is already in the batch")
        if not self._free:
            raise ValueError(f"batch is full: max_num_seqs={self.max_num_reqs}")
        ids = bytes_to_ids(req.token_ids)
        n = len(ids)
        if n > self.max_model_len:
            raise ValueError(f"request {req.req_id!r}: {n} tokens exceed max_model_len={self.max_model_len}")
        if len(req.block_ids) > self.max_blocks_per_req:
            raise ValueError(f"request {req.req_id!r}: {len(req.block_ids)} blocks exceed "
                             f"max_model_len / block_size = {self.max_blocks_per_req}")
        if not 0 <= req.num_computed_tokens <= n:
            raise ValueError(f"request {req.req_id!r}: num_computed_tokens={req.num_computed_tokens} "
                             f"not in [0, {n}]")
        row = self._free.pop()
        self._ensure_token_capacity(n)
        self.req_ids[row] = req.req_id
        self.index[req.req_id] = row
        self.token_ids[row, :n] = ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        nb = len(req.block_ids)
        self.block_table[row, :nb] = req.block_ids
        self.num_blocks[row] = nb
        sp = req.sampling_params
        self.params[row] = sp
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = max(sp.top_k, 0)
        self.min_p[row] = sp.min_p
        self.repetition_penalty[row] = sp.repetition_penalty
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.seed[row] = -1 if sp.seed is None else sp.seed
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.min_tokens[row] = sp.min_tokens
        plp = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.num_prompt_logprobs[row] = plp
        self.num_prompt_logprob_rows += plp >= 0
        bias = sp.logit_bias
        self.logit_bias[row] = (np.fromiter(bias.keys(), np.int64, len(bias)),
                                np.fromiter(bias.values(), np.float32, len(bias))) if bias else None
        allowed = sp.allowed_token_ids
        self.allowed_token_ids[row] = None if allowed is None else np.asarray(allowed, dtype=np.int64)
        self.bad_words[row] = sp.bad_words_token_ids or None
        procs = bool(bias) or allowed is not None or bool(sp.bad_words_token_ids)
        self.has_processors[row] = procs
        special = procs or not (sp.temperature == 0.0 and sp.repetition_penalty == 1.0
                                and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0
                                and sp.logprobs is None and sp.min_tokens == 0)
        self.needs_sampler[row] = special
        self.num_needs_sampler += special
        # A grammar (structured_outputs) masks the logits on rank 0 before any choice, greedy
        # included; under tensor parallelism the other ranks then take rank 0's tokens.
        self.structured[row] = sp.structured_outputs is not None
        self.num_structured += bool(self.structured[row])
        self.embed[row] = req.embed
        self.num_embed += req.embed
        return row

    def remove(self, req_id: str) -> None:
        """Drop a request; unknown ids are ignored (finished before it was ever scheduled)."""
        row = self.index.pop(req_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.params[row] = None
        self.num_needs_sampler -= bool(self.needs_sampler[row])
        self.needs_sampler[row] = False
        self.num_structured -= bool(self.structured[row])
        self.structured[row] = False
        self.num_embed -= bool(self.embed[row])
        self.embed[row] = False
        self.num_prompt_logprob_rows -= bool(self.num_prompt_logprobs[row] >= 0)
        self.num_prompt_logprobs[row] = -1
        self.logit_bias[row] = self.allowed_token_ids[row] = self.bad_words[row] = None
        self.has_processors[row] = False
        self._free.append(row)

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.index[req_id]
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"request {req_id!r}: {end} blocks exceed max_model_len / block_size "
                             f"= {self.max_blocks_per_req}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (vectorised)."""
        if len(rows) == 0:
            return
        pos = self.num_tokens[rows]
        self._ensure_token_capacity(int(pos.max()) + 1)
        self.token_ids[rows, pos] = tokens
        self.num_tokens[rows] = pos + 1
