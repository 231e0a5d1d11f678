"""Worker stage: embeddings. An embedding request (``NewRequestData.embed``) runs its prompt
through the same varlen forward as every other request and samples nothing; once its prefill
is done its final hidden states (after the model's final norm, before lm_head) are pooled
into one vector: the last prompt token's (``last``) or the mean over the prompt (``mean``),
then L2-normalised, as vLLM's embed default.

A prompt may run in several chunks (chunked prefill): ``mean`` keeps the running float32 sum
of each request's rows across its chunks; ``last`` needs only the final chunk's last row.
``mean`` needs every prompt position computed here, so the engine gives such requests no
prefix-cache hit (``engine.admission``); ``last`` may take one, the last token is always
computed. Computed before the batch's num_computed_tokens advance (where each chunk starts).

Owns / State: the running sums of the ``mean`` requests in flight (dropped when a request
leaves the batch, restarted when a chunk starts at position 0: a resumed request recomputes).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.messages.step import Pooled
from pipeline.models.llama import CausalLM
from pipeline.worker.input_batch import InputBatch

POOLING_TYPES = ("last", "mean")


def normalize(v: torch.Tensor) -> torch.Tensor:
    """L2-normalised float32 (a zero vector stays zero)."""
    v = v.float()
    return v / v.norm().clamp_min(1e-12)


class Pooler:
    def __init__(self, pooling: str) -> None:
        if pooling not in POOLING_TYPES:
            raise ValueError(f"--pooling must be one of {', '.join(POOLING_TYPES)}, got {pooling!r}")
        self.pooling = pooling
        self.sums: dict[str, torch.Tensor] = {}  # req_id -> sum of its normed rows so far

    def forget(self, req_id: str) -> None:
        self.sums.pop(req_id, None)

    def pool(self, model: CausalLM, b: InputBatch, hidden: torch.Tensor, rows: np.ndarray,
             num_scheduled: np.ndarray) -> list[Pooled]:
        """For the embedding rows among ``rows`` (each scheduled ``num_scheduled`` tokens, their
        final hidden states in ``hidden`` in that order): the vectors of those whose prompt is
        now computed."""
        want = np.nonzero(b.embed[rows])[0]
        ends = np.cumsum(num_scheduled)
        out: list[Pooled] = []
        for i in want.tolist():
            row = int(rows[i])
            rid = b.req_ids[row]
            assert rid is not None  # a scheduled row is live
            n, end = int(num_scheduled[i]), int(ends[i])
            start = int(b.num_computed_tokens[row])
            done = start + n >= int(b.num_prompt_tokens[row])
            if self.pooling == "last":
                if done:
                    out.append(Pooled(rid, _bytes(normalize(model.final_norm(hidden[end - 1:end])[0]))))
                continue
            chunk = model.final_norm(hidden[end - n:end]).float().sum(0)
            total = chunk if start == 0 or rid not in self.sums else self.sums[rid] + chunk
            if not done:
                self.sums[rid] = total
                continue
            self.sums.pop(rid, None)
            out.append(Pooled(rid, _bytes(normalize(total / int(b.num_prompt_tokens[row])))))
        return out


def _bytes(v: torch.Tensor) -> bytes:
    return v.detach().to("cpu", torch.float32).numpy().astype("<f4").tobytes()

