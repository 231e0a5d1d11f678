"""Worker stage: speculative decoding's verify step (docs/speculative.md).

A request the engine scheduled with drafts runs its last known token and the drafts in one
forward (``stage``: the drafts are written after its known tokens and count as known for the
step). The logits of its last position are sampled as every request's are, with the drafts
taken as its output so far; ``verify`` then draws a token at each earlier position p from the
target's distribution given the drafts before p (the sampler's metadata built with the
request's tokens cut there: penalties, min_tokens, seeds by output position, logprobs) and
keeps the drafts up to the first one that differs from its draw, plus that draw (or, all
accepted, the last position's). For drafts that are tokens, not distributions (n-gram,
suffix, a draft model drafting greedily), that is rejection sampling exactly: a draft d is
kept with the target's probability of d, and after a rejection the token is a draw from the
target with d excluded, so the output is distributed as the target's; greedy keeps the
drafts equal to the argmax. A seeded request draws each output position with the seed of
that position, so its tokens are the same with speculation as without.

Owns / State: the proposer (rank 0 proposes; the engine sends the drafts to every rank: an
n-gram or suffix index, or the draft model, worker.spec.draft) and the rows staged for the
current step with their drafts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.layers.ops_fused import argmax
from pipeline.messages import TokenLogprobs, bytes_to_ids, ids_to_bytes
from pipeline.spec_config import SpeculativeConfig
from pipeline.worker.input_batch import InputBatch
from pipeline.worker.sampler import Sampler, build_metadata
from pipeline.worker.spec.draft import DraftModel
from pipeline.worker.spec.proposer import Proposer, make_proposer


@dataclass(slots=True)
class Verified:
    """A step's tokens per sampled row (batch order): flat, with their counts."""
    tokens: list[int]
    counts: list[int]
    logprobs: list[TokenLogprobs | None] | None


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, proposes: bool) -> None:
        self.k = cfg.num_speculative_tokens
        suffix = {"max_tree_depth": cfg.suffix_decoding_max_tree_depth,
                  "max_cached_requests": cfg.suffix_decoding_max_cached_requests,
                  "max_spec_factor": cfg.suffix_decoding_max_spec_factor,
                  "min_token_prob": cfg.suffix_decoding_min_token_prob} if cfg.method == "suffix" else {}
        self.proposer: Proposer | None = make_proposer(
            cfg.method, num_speculative_tokens=cfg.num_speculative_tokens,
            prompt_lookup_min=cfg.prompt_lookup_min, prompt_lookup_max=cfg.prompt_lookup_max,
            **suffix) if proposes and cfg.method != "draft_model" else None
        self.staged: dict[int, np.ndarray] = {}  # row -> its drafts in this step
        self.draft: DraftModel | None = None  # draft_model: attached once the pool is sized

    def attach_draft(self, draft: DraftModel) -> None:
        self.draft = draft

    # -- the batch's requests ------------------------------------------------------------
    def finished(self, b: InputBatch, req_id: str) -> None:
        """``req_id`` leaves the batch having ended (its output may teach a suffix index)."""
        row = b.index.get(req_id)
        if self.proposer is not None and row is not None:
            self.proposer.finished(req_id, b.token_ids[row, :b.num_tokens[row]], int(b.num_prompt_tokens[row]))
        self.removed(req_id)

    def removed(self, req_id: str) -> None:
        if self.proposer is not None:
            self.proposer.remove(req_id)
        if self.draft is not None:
            self.draft.remove(req_id)

    def stage(self, b: InputBatch, spec_token_ids: dict[str, bytes]) -> None:
        """Write each scheduled request's drafts after its known tokens (known for this step)."""
        self.staged = {}
        for rid, raw in spec_token_ids.items():
            row = b.index[rid]
            drafts = bytes_to_ids(raw)
            n = int(b.num_tokens[row])
            if n + len(drafts) > b.max_model_len:
                raise ValueError(f"request {rid!r}: {len(drafts)} drafts after {n} tokens exceed "
                                 f"max_model_len={b.max_model_len}")
            b._ensure_token_capacity(n + len(drafts) + 1)
            b.token_ids[row, n:n + len(drafts)] = drafts
            b.num_tokens[row] = n + len(drafts)
            self.staged[row] = drafts

    # -- the step ------------------------------------------------------------------------
    def positions(self, sample_rows: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The flat token indices whose logits verify the drafts, draft position p of every
        row that has one, p ascending; and per p the sampled-row indices they belong to.
        ``ends``: each sampled row's last token index in the step's flat batch."""
        staged = self.staged
        if len(sample_rows) == 1:  # batch 1, the common case: no per-position arrays
            n = len(staged.get(int(sample_rows[0]), ()))
            one = np.zeros(1, np.int64)
            return np.arange(int(ends[0]) - n, int(ends[0]), dtype=np.int64), [one] * n
        d = np.array([len(staged.get(r, ())) for r in sample_rows.tolist()], np.int64)
        idx, by_pos = [], []
        for p in range(int(d.max())):
            who = np.nonzero(d > p)[0]
            by_pos.append(who)
            idx.append(ends[who] - d[who] + p)
        return np.concatenate(idx), by_pos

    def verify(self, b: InputBatch, sample_rows: np.ndarray, last: torch.Tensor,
               last_lps: list[TokenLogprobs | None] | None, logits: torch.Tensor,
               by_pos: list[np.ndarray], sampler: Sampler | None, vocab_size: int,
               eos: list[int], device: torch.device) -> tuple[torch.Tensor, list[TokenLogprobs | None] | None]:
        """The draws at the draft positions (``logits``, in ``positions``' order), flat in
        that order, and their logprobs (None: none asked). ``sampler`` None: argmax."""
        if sampler is None:
            return argmax(logits), None
        out: list[torch.Tensor] = []
        lps: list[TokenLogprobs | None] = []
        i = 0
        base = b.num_tokens[sample_rows].copy()
        try:
            for p, who in enumerate(by_pos):
                rows = sample_rows[who]
                # The request's tokens as if the drafts before p were its output so far.
                b.num_tokens[rows] = base[who] - np.fromiter(
                    (len(self.staged[int(r)]) - p for r in rows), np.int64, len(rows))
                md = build_metadata(b, rows, vocab_size, eos, device)
                toks, lp = sampler(logits[i:i + len(rows)], md)
                out.append(toks)
                lps += lp if lp is not None else [None] * len(rows)
                i += len(rows)
        finally:
            b.num_tokens[sample_rows] = base
        any_lp = any(x is not None for x in lps)
        return torch.cat(out), (lps if any_lp else None)

    def accept(self, b: InputBatch, sample_rows: np.ndarray, last: np.ndarray,
               last_lps: list[TokenLogprobs | None] | None, draws: np.ndarray,
               draw_lps: list[TokenLogprobs | None] | None, by_pos: list[np.ndarray]) -> Verified:
        """Keep each row's drafts up to the first its draw differs from, then that draw (or
        the last position's): appended to the batch (its rejected drafts dropped)."""
        n = len(sample_rows)
        if not self.staged:  # no drafts in this step: one token each, as plain decoding
            b.append_tokens(sample_rows, last)
            return Verified(last.tolist(), [1] * n, last_lps)
        at: list[dict[int, int]] = [{} for _ in range(n)]  # row -> {position: flat draw index}
        j = 0
        for p, who in enumerate(by_pos):
            for w in who.tolist():
                at[w][p] = j
                j += 1
        tokens: list[int] = []
        counts: list[int] = []
        lps: list[TokenLogprobs | None] | None = [] if (last_lps is not None or draw_lps is not None) else None
        for w in range(n):
            row = int(sample_rows[w])
            drafts = self.staged.get(row)
            mine = at[w]
            kept = 0
            if drafts is not None:
                while kept < len(drafts) and int(draws[mine[kept]]) == int(drafts[kept]):
                    kept += 1
                b.num_tokens[row] -= len(drafts) - kept  # rejected drafts leave the row
                b.num_computed_tokens[row] -= len(drafts) - kept
            final = int(last[w]) if drafts is None or kept == len(drafts) else int(draws[mine[kept]])
            toks = [int(t) for t in drafts[:kept]] + [final] if drafts is not None else [final]
            tokens += toks
            counts.append(len(toks))
            if lps is not None:
                for p in range(len(toks) - 1):
                    lps.append(draw_lps[mine[p]] if draw_lps is not None else None)
                lps.append((last_lps[w] if last_lps is not None else None) if drafts is None or kept == len(drafts)
                           else (draw_lps[mine[kept]] if draw_lps is not None else None))
            n_tok = int(b.num_tokens[row])
            b._ensure_token_capacity(n_tok + 1)
            b.token_ids[row, n_tok] = final
            b.num_tokens[row] = n_tok + 1
        self.staged = {}
        return Verified(tokens, counts, lps)

    def propose(self, b: InputBatch, sample_rows: np.ndarray, idle: list[str],
                grammar: Callable[[str, list[int]], int] | None = None,
                fewer: dict[str, int] | None = None) -> tuple[dict[str, bytes], int, int]:
        """Drafts for each sampled row's next step (rank 0; none for ``idle``: the engine
        will not verify drafts for them then; ``fewer``: req_id -> at most that many, K for
        the others), for how many requests it proposed and how many drafts it was asked in
        all. A row with a grammar keeps the drafts ``grammar`` allows
        (StructuredBatch.check_drafts)."""
        out: dict[str, bytes] = {}
        if self.proposer is None and self.draft is None:
            return out, 0, 0
        skip, fewer = set(idle), fewer or {}
        rows = [r for r in sample_rows.tolist() if b.req_ids[r] not in skip and b.num_tokens[r] < b.max_model_len]
        if not rows:
            return out, 0, 0
        ks = [fewer.get(b.req_ids[r] or "", self.k) for r in rows]
        if self.draft is not None:
            found = self.draft.propose(b, rows, ks)
        else:
            assert self.proposer is not None
            found = {r: self.proposer.propose(b.req_ids[r], b.token_ids[r, :b.num_tokens[r]],
                                              int(b.num_prompt_tokens[r]), k) for r, k in zip(rows, ks)}
        for r, drafts in found.items():
            rid = b.req_ids[r]
            assert rid is not None  # a live row
            if drafts and b.structured[r]:
                drafts = drafts[:grammar(rid, drafts)] if grammar is not None else []
            if drafts:
                out[rid] = ids_to_bytes(drafts)
        return out, len(rows), sum(ks)
