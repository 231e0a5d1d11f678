"""Worker stage: a speculative decoding step's part of the model runner (docs/speculative.md):
the grammar's masks of the rows verifying drafts, then the verify itself (draws at the draft
positions, under tensor parallelism rank 0's broadcast, the drafts kept, the matchers
advanced, the next drafts proposed and timed). Functions over the runner; owns nothing.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.messages import ModelRunnerOutput, TokenLogprobs
from pipeline.worker.input_batch import InputBatch
from pipeline.worker.spec.verify import SpecDecoder
from pipeline.worker.structured import StructuredBatch

if TYPE_CHECKING:
    from pipeline.worker.model_runner import ModelRunner


def mask_drafts(so: StructuredBatch | None, spec: SpecDecoder | None, b: InputBatch, both: torch.Tensor,
                sample_rows: np.ndarray, by_pos: list[np.ndarray]) -> None:
    """The grammar's masks of the rows verifying drafts: at each draft position and the
    last (``both``: the last positions' logits, then the draft positions', p-major)."""
    assert so is not None and spec is not None
    offsets = np.cumsum([len(sample_rows)] + [len(w) for w in by_pos])
    for w, r in enumerate(sample_rows.tolist()):
        drafts = spec.staged.get(r)
        rid = b.req_ids[r]
        if drafts is None or rid is None or not so.has(rid):
            continue
        rows = [int(offsets[p] + np.searchsorted(by_pos[p], w)) for p in range(len(drafts))] + [w]
        so.mask_rows(both, rows, so.draft_masks(rid, drafts.tolist()))


def verify_step(runner: ModelRunner, step_id: int, last: torch.Tensor, last_lps: list[TokenLogprobs | None] | None,
                sample_rows: np.ndarray, logits: torch.Tensor | None, by_pos: list[np.ndarray],
                prompt_lps: list) -> ModelRunnerOutput:
    """Draws at the draft positions (``logits``, None: no drafts), the drafts kept, the next
    drafts proposed (worker.spec.verify); ``last``: the last positions' tokens."""
    spec, b, tp = runner.spec, runner.batch, runner.tp
    assert spec is not None
    so = runner.structured
    if logits is None:  # no drafts in this step (most steps where drafts do not pay): plain decoding's path
        if tp is not None and (b.num_needs_sampler or b.num_structured):
            last = tp.broadcast(last.to(torch.int64), 0)
        toks = last.cpu().numpy()
        b.append_tokens(sample_rows, toks)
        tokens = toks.tolist()
        if so is not None and len(so):
            so.accept([b.req_ids[r] for r in sample_rows.tolist()], tokens)
        t0 = time.perf_counter()
        drafts, proposed, asked = spec.propose(b, sample_rows, runner.spec_idle,
                                               so.check_drafts if so is not None else None, runner.spec_fewer)
        return ModelRunnerOutput(step_id=step_id, req_ids=[b.req_ids[r] for r in sample_rows.tolist()],
                                 sampled_token_ids=tokens, logprobs=last_lps or [], prompt_logprobs=prompt_lps,
                                 draft_token_ids=drafts, propose_s=time.perf_counter() - t0 if proposed else 0.0,
                                 num_proposed=proposed, num_drafts_asked=asked)
    draw_lps = None
    sampler = runner.sampler if b.num_needs_sampler and (tp is None or runner.rank == 0) else None
    if sampler is None and b.num_needs_sampler:  # rank > 0: rank 0's draws arrive below
        draws = torch.empty(len(logits), dtype=torch.int64, device=runner.device)
    else:
        draws, draw_lps = spec.verify(b, sample_rows, last, last_lps, logits, by_pos, sampler,
                                      runner.vocab_size, runner.eos_token_ids, runner.device)
    if tp is not None and (b.num_needs_sampler or b.num_structured):
        both = tp.broadcast(torch.cat([last.to(torch.int64), draws.to(torch.int64)]), 0)
        last, draws = both[:len(sample_rows)], both[len(sample_rows):]
    v = spec.accept(b, sample_rows, last.cpu().numpy(), last_lps, draws.cpu().numpy(), draw_lps, by_pos)
    if so is not None and len(so):
        ends = np.cumsum(v.counts)
        so.accept_many([b.req_ids[r] for r in sample_rows.tolist()],
                       [v.tokens[e - c:e] for e, c in zip(ends.tolist(), v.counts)])
    t0 = time.perf_counter()
    drafts, proposed, asked = spec.propose(b, sample_rows, runner.spec_idle,
                                           so.check_drafts if so is not None else None, runner.spec_fewer)
    return ModelRunnerOutput(step_id=step_id, req_ids=[b.req_ids[r] for r in sample_rows.tolist()],
                             sampled_token_ids=v.tokens, logprobs=v.logprobs or [],
                             prompt_logprobs=prompt_lps, num_sampled=v.counts, draft_token_ids=drafts,
                             propose_s=time.perf_counter() - t0, num_proposed=proposed, num_drafts_asked=asked)
