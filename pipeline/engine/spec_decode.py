"""Engine stage: speculative decoding's side of the scheduler (docs/speculative.md).

The worker proposes drafts after each token it samples (``worker.spec``) and sends them with
the step's result; the scheduler keeps them on the request (``Request.spec_token_ids``) and,
at its next decode step, schedules the last known token plus up to ``Request.spec_k`` of them
(``drafts_for``): the worker computes all of them in one forward, keeps the drafts the target
agrees with and samples one more. ``on_verified`` takes the outcome: the rejected drafts'
computed tokens are rolled back by the step's results (``engine.step_results``), and K adapts.

K per request: an acceptance average (``spec_ema``, per drafted token, halved each step) sets
how many drafts are worth their compute: about 1 / (1 - p) for a per-token acceptance p,
capped at the configured K; under ``DORMANT_BELOW`` the request stops drafting and probes
with one draft every ``PROBE_EVERY`` decode steps, so a workload that never accepts pays at
most one extra token per PROBE_EVERY steps.

Owns / State: the counters (verify steps with drafts, drafted and accepted tokens, accepted
drafts by position); the per-request K, average and probe countdown live on Request.
"""
from __future__ import annotations

from pipeline.engine.request import Request

DORMANT_BELOW = 0.25  # per-draft acceptance average under which a request stops drafting
PROBE_EVERY = 32  # decode steps between a dormant request's one-draft probes


class SpecDecode:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.num_drafts = 0  # verify steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def start(self, req: Request) -> None:
        """A request's first run (or a rerun after preemption): K from the top."""
        req.spec_k = self.k
        req.spec_ema = 1.0
        req.spec_probe = 0
        req.spec_token_ids = []

    def drafts_for(self, req: Request, room: int) -> list[int]:
        """The drafts ``req`` verifies in this decode step: at most its K and ``room`` (the
        tokens the step's budget, max_tokens and max_model_len leave after the one it
        samples anyway)."""
        k = req.spec_k
        if k == 0:  # dormant: one draft every PROBE_EVERY steps
            req.spec_probe += 1
            if req.spec_probe < PROBE_EVERY:
                return []
            req.spec_probe = 0
            k = 1
        n = min(k, room, len(req.spec_token_ids))
        return req.spec_token_ids[:n] if n > 0 else []

    def on_verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """``req``'s step verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        ema = req.spec_ema = 0.5 * req.spec_ema + 0.5 * (num_accepted / num_drafts)
        if ema < DORMANT_BELOW:
            req.spec_k = 0
        else:
            req.spec_k = max(1, min(self.k, round(1.0 / max(1.0 - ema, 1e-3))))

    def stats(self) -> dict[str, int | float | list[int]]:
        """EngineStats fields."""
        n = self.num_drafts
        return {"spec_num_drafts": n, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_mean_acceptance_length": 1.0 + self.num_accepted_tokens / n if n else 0.0,
                "spec_accepted_per_position": list(self.accepted_per_position)}
