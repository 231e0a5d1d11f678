"""Worker stage: the logprobs of the prompt tokens a step's prefill chunks predict (a request's
``prompt_logprobs``). Position p's logits give token p + 1; computed before the batch's
num_computed_tokens advance, in slices of PROMPT_LOGPROBS_ROWS rows so a long chunk never
holds rows x vocab floats at once. Owns no state.
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.messages import TokenLogprobs
from pipeline.messages.step import PromptLogprobs
from pipeline.models.llama import CausalLM
from pipeline.worker.input_batch import InputBatch

# Prompt positions whose logits (rows x vocab floats) are computed at once.
PROMPT_LOGPROBS_ROWS = 256


def prompt_logprobs(model: CausalLM, b: InputBatch, hidden: torch.Tensor, rows: np.ndarray,
                    num_scheduled: np.ndarray, device: torch.device) -> list[PromptLogprobs]:
    """For the batch rows ``rows`` (each scheduled ``num_scheduled`` tokens, their final hidden
    states in ``hidden`` in that order) that ask for prompt logprobs."""
    want = np.nonzero(b.num_prompt_logprobs[rows] >= 0)[0]
    offsets = np.concatenate(([0], np.cumsum(num_scheduled)))
    out: list[PromptLogprobs] = []
    for i in want.tolist():
        row = int(rows[i])
        start = int(b.num_computed_tokens[row])
        end = min(start + int(num_scheduled[i]), int(b.num_prompt_tokens[row]) - 1)
        if end <= start:
            continue  # the chunk predicts no prompt token (a 1-token prompt, or decoding)
        k = int(b.num_prompt_logprobs[row])
        targets = torch.from_numpy(b.token_ids[row, start + 1:end + 1].astype(np.int64)).to(device)
        lps: list[TokenLogprobs] = []
        for c in range(0, end - start, PROMPT_LOGPROBS_ROWS):
            m = min(PROMPT_LOGPROBS_ROWS, end - start - c)
            first = int(offsets[i]) + c
            logprobs = torch.log_softmax(model.compute_logits(hidden[first:first + m]), dim=-1)
            tgt = targets[c:c + m]
            chosen = logprobs.gather(1, tgt[:, None])[:, 0].tolist()
            top_vals: list[list[float]] = [[] for _ in range(m)]
            top_ids: list[list[int]] = [[] for _ in range(m)]
            if k > 0:
                vals, ids = logprobs.topk(k, dim=-1)
                top_vals, top_ids = vals.tolist(), ids.tolist()
            lps += map(TokenLogprobs, tgt.tolist(), chosen, top_ids, top_vals)
        rid = b.req_ids[row]
        assert rid is not None  # a scheduled row is live
        out.append(PromptLogprobs(rid, start + 1, lps))
    return out
