"""Worker stage: the grammars of the constrained requests in the batch (structured outputs).

Rank 0 alone (it samples) keeps, per request with ``structured_outputs``, an xgrammar matcher
over the request's output so far. A request's grammar arrives compiled (the tokenizer stage
compiled it under a time budget, ``NewRequestData.grammar``) and loads in a thread pool as
soon as the request joins the batch (milliseconds, while its prefill runs): no compile ever
holds up a step, so no other rank waits on one. A request without it (the in-process LLM,
which compiled it in ``validate`` into the compiler's cache) compiles there, and a resumed
request (preempted, or a new row) rebuilds its matcher by accepting
the output tokens it arrives with. Each step, the bitmasks of the rows about to be sampled are
filled (``start_masks``; in the pool while the forward runs when a core is left over: where
the forward's team holds every core, a pool thread stalls it more than filling first costs,
measured with bench structured), applied to their logits before any
sampling or logprob (``apply_masks``), and each sampled token then advances its matcher
(``accept``). A matcher that accepted a stop token only allows the stop tokens (a step the
engine scheduled ahead of the request's end), as does one whose request sampled a token
outside its grammar (possible only when nothing allowed could be sampled, e.g. ``min_tokens``
banning the stop token of a finished answer).

Owns: the matchers, the pool and the step's bitmask.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.sampling_params.structured import StructuredOutputsParams
from pipeline.structured_outputs import Grammars

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


class _Finished:
    """A matcher that only lets the stop tokens through."""

    def is_terminated(self) -> bool:
        return True


class StructuredBatch:
    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self._grammars: Future[Grammars] | None = None  # xgrammar loads on first use (~2 s)
        self._matchers: dict[str, Future] = {}
        self._masks: Future[tuple[torch.Tensor, list[int]]] | None = None
        self._batch: xgrammar.BatchGrammarMatcher | None = None  # made in the pool on first use
        self._cores = len(os.sched_getaffinity(0))
        # The bitmask row of a finished answer: the stop tokens only (int32 words); every
        # token for a model without stop tokens (it then runs to max_tokens unconstrained).
        words = [0] * -(-vocab_size // 32) if stop_token_ids else [(1 << 32) - 1] * -(-vocab_size // 32)
        for t in stop_token_ids:
            words[t // 32] |= 1 << (t % 32)
        self._stop_row = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                      dtype=torch.int32)

    def __len__(self) -> int:
        return len(self._matchers)

    def _load(self) -> Grammars:
        return Grammars(self.model_dir, self.vocab_size, self.stop_token_ids)

    def _grammars_future(self) -> Future[Grammars]:
        if self._grammars is None:
            self._grammars = self._pool.submit(self._load)
        return self._grammars

    def validate(self, so: StructuredOutputsParams) -> None:
        """Compile ``so`` now (GrammarError naming the field if xgrammar refuses it); the
        request's own compile is then a cache hit."""
        self._grammars_future().result().compile(so)

    @property
    def compiles(self) -> int:
        """Compile calls this worker made (none for requests that arrived compiled)."""
        return self._grammars.result().compiles if self._grammars is not None else 0

    def add(self, req_id: str, so: StructuredOutputsParams, output: list[int],
            compiled: bytes | None = None) -> None:
        """Start loading ``req_id``'s grammar (``compiled``, else compiling ``so``) and
        replaying its ``output`` tokens."""
        grammars = self._grammars_future()

        def build():
            g = grammars.result()
            m = g.matcher(g.load(compiled, so) if compiled is not None else g.compile(so))
            for t in output:
                if not m.accept_token(t):  # it had left its grammar before (see accept)
                    logger.warning("request %s: resumed output token %d is outside its grammar; "
                                   "it may only stop now", req_id, t)
                    return _Finished()
            return m
        self._matchers[req_id] = self._pool.submit(build)

    def remove(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def start_masks(self, req_ids: list[str | None]) -> None:
        """Fill, in the pool, the bitmask of every constrained request among the step's
        sampled rows ``req_ids`` (in logits-row order)."""
        rows = [(i, self._matchers[r]) for i, r in enumerate(req_ids) if r in self._matchers]
        if not rows:
            self._masks = None
            return
        if self._cores > torch.get_num_threads():
            self._masks = self._pool.submit(self._fill, rows, len(req_ids))  # on a spare core
        else:  # every core runs the forward's team: a pool thread would only stall it
            done: Future = Future()
            done.set_result(self._fill(rows, len(req_ids)))
            self._masks = done

    def _fill(self, rows: list[tuple[int, Future]], n: int) -> tuple[torch.Tensor, list[int]]:
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
        live, where = [], []
        for i, fut in rows:
            m = fut.result()
            if m.is_terminated():  # only a stop token may follow a finished answer
                bitmask[i] = self._stop_row
            else:
                live.append(m)
                where.append(i)
        if live:  # one C++ call for the batch, on this (pool) thread
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=1)
            self._batch.batch_fill_next_token_bitmask(live, bitmask, where)
        return bitmask, [i for i, _ in rows]

    def apply_masks(self, logits: torch.Tensor) -> None:
        """Mask (in place) the logits rows whose bitmask ``start_masks`` filled: -inf where
        the bit is clear. (Bits unpacked with numpy and one ``where``: xgrammar's CPU kernel
        takes ~6 ns a logit, this ~1.)"""
        if self._masks is None:
            return
        bitmask, rows = self._masks.result()
        self._masks = None
        n, vocab = logits.shape
        every = len(rows) == n  # every sampled row has a grammar: no gather and scatter
        words = (bitmask if every else bitmask[rows]).numpy().view(np.uint8)
        banned = ~torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little", count=vocab).view(bool))
        if every:
            logits.masked_fill_(banned.to(logits.device), float("-inf"))
            return
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(banned.to(logits.device),
                                                                            float("-inf")))

    def accept(self, req_ids: list[str | None], tokens: list[int]) -> None:
        import xgrammar as xgr
        live, toks, ids = [], [], []  # the requests whose answer is still open
        for r, t in zip(req_ids, tokens, strict=True):
            fut = self._matchers.get(r) if r is not None else None
            if r is not None and fut is not None and not (m := fut.result()).is_terminated():
                live.append(m)
                toks.append(t)
                ids.append(r)
        if not live:
            return
        for r, t, ok in zip(ids, toks, xgr.BatchGrammarMatcher.batch_accept_token(live, toks), strict=True):
            if not ok:
                # Only when no allowed token could be sampled (min_tokens banning the stop
                # token of a finished answer): the answer cannot continue validly, so from
                # now on only the stop tokens are allowed.
                logger.warning("request %s: token %d is outside its grammar; it may only stop now", r, t)
                self._matchers[r] = self._pool.submit(_Finished)

    # -- speculative decoding (worker.spec.verify) ----------------------------------------
    def has(self, req_id: str | None) -> bool:
        return req_id in self._matchers

    def check_drafts(self, req_id: str, drafts: list[int]) -> int:
        """How many leading ``drafts`` ``req_id``'s grammar allows (the matcher is left as
        it was)."""
        m = self._matchers[req_id].result()
        n = 0
        if not m.is_terminated():
            for t in drafts:
                if not m.accept_token(t):
                    break
                n += 1
            if n:
                m.rollback(n)
        return n

    def draft_masks(self, req_id: str, drafts: list[int]) -> torch.Tensor:
        """``req_id``'s bitmasks at each draft position and after the last draft
        (``len(drafts) + 1`` rows): its grammar advanced over the drafts, then rolled back."""
        import xgrammar as xgr
        m = self._matchers[req_id].result()
        bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        n = 0
        for p in range(len(drafts) + 1):
            if m.is_terminated():
                bitmask[p] = self._stop_row
            else:
                m.fill_next_token_bitmask(bitmask, p)
            if p < len(drafts):
                if m.is_terminated() or not m.accept_token(drafts[p]):
                    bitmask[p + 1:] = self._stop_row  # check_drafts let only allowed drafts through
                    break
                n += 1
        if n:
            m.rollback(n)
        return bitmask

    def mask_rows(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """-inf (in place) where ``bitmask``'s row j bans a token of ``logits[rows[j]]``."""
        words = bitmask.numpy().view(np.uint8)
        banned = ~torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little",
                                                 count=logits.shape[1]).view(bool))
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(banned.to(logits.device),
                                                                            float("-inf")))

    def accept_many(self, req_ids: list[str | None], tokens: list[list[int]]) -> None:
        """Each request's tokens of a verify step (kept drafts, then one), in order."""
        width = max((len(t) for t in tokens), default=0)
        for j in range(width):
            pairs = [(r, t[j]) for r, t in zip(req_ids, tokens, strict=True) if len(t) > j]
            self.accept([r for r, _ in pairs], [t for _, t in pairs])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._matchers.clear()
