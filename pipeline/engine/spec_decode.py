"""Engine stage: speculative decoding's side of the scheduler (docs/speculative.md).

The worker proposes drafts after each token it samples (``worker.spec``) and sends them with
the step's result; the scheduler keeps them on the request (``Request.spec_token_ids``) and,
at its next decode step, schedules the last known token plus up to ``Request.spec_k`` of them
(``drafts_for``): the worker computes all of them in one forward, keeps the drafts the target
agrees with and samples one more. ``on_verified`` takes the outcome: the rejected drafts'
computed tokens are rolled back by the step's results (``engine.step_results``), and K adapts.

K per request: the drafts it accepted per verify step, averaged (``spec_ema``: each step
weighs half), set how many it drafts next: twice that plus one, capped at the configured K
(a draft position costs far less than a step on a CPU, whose decode reads every weight
whatever the tokens: room to grow is cheap); under ``DORMANT_BELOW`` (nothing accepted for
several steps) the request stops drafting and probes with one draft after 2 decode steps,
then 4, 8... up to ``PROBE_EVERY`` while its probes fail (an accepted probe wakes it): text
that turns repetitive again is drafted for within a few steps, and a workload that never
accepts pays at most one extra token per PROBE_EVERY steps.

What a draft position costs depends on the machine and the model: a decode step that reads
its weights from DRAM computes a few more tokens for free, one whose weights sit in cache (a
small model) pays for each. So the engine also measures it (``StepCost``: the worker's step
time against the tokens it ran, a decayed least-squares line) and drafts position i only while
the share of steps that accept it (``accepted / drafted`` there) is above what a token
costs: the line's slope times the tokens a second the steps produce. Only steps of decodes
and verifies feed the line: a prefill's thousands of tokens are compute-bound, where a few
more tokens of a decode step that reads its weights from DRAM come nearly free. Adding such a position
raises tokens per second; one below it lowers them.

Proposing costs the worker time too (a suffix index's lookups, a draft model's forwards): the
positions worth their price must together gain more than a request's proposal costs
(``StepCost.proposal_price``), else no request drafts (but for a probe step in 32).

Owns / State: the counters (verify steps with drafts, drafted and accepted tokens, by
position), the step cost line and the cap it sets; the per-request K, average and probe
countdown live on Request.
"""
from __future__ import annotations

import math

from pipeline.engine.request import Request

DORMANT_BELOW = 0.2  # accepted drafts per verify step, averaged, under which a request stops drafting
PROBE_EVERY = 32  # decode steps between a dormant request's one-draft probes


COST_DECAY = 0.98  # per step: the cost line follows the last ~50 steps


class StepCost:
    """Step seconds ~ a + b * tokens run, fitted over recent steps (decayed sums)."""

    def __init__(self) -> None:
        self.w = self.x = self.xx = self.y = self.xy = self.out = 0.0
        self.propose_s = self.proposed = 0.0  # the worker's proposals: time and requests

    def add_proposals(self, seconds: float, requests: int) -> None:
        d = COST_DECAY
        self.propose_s = d * self.propose_s + seconds
        self.proposed = d * self.proposed + requests

    def proposal_price(self) -> float:
        """What proposing for one request costs, in tokens produced (its seconds x tokens
        produced a second)."""
        if not self.proposed or self.y <= 0.0:
            return 0.0
        return self.propose_s / self.proposed * self.out / self.y

    def add(self, tokens: int, seconds: float, produced: int) -> None:
        d = COST_DECAY
        self.w = d * self.w + 1.0
        self.x = d * self.x + tokens
        self.xx = d * self.xx + tokens * tokens
        self.y = d * self.y + seconds
        self.xy = d * self.xy + tokens * seconds
        self.out = d * self.out + produced

    def token_price(self) -> float:
        """The share of a produced token one more token run costs (slope x tokens produced
        per second); 0 until the steps ran different token counts."""
        var = self.w * self.xx - self.x * self.x
        if var <= 1e-9 * self.w * self.w or self.y <= 0.0:
            return 0.0
        slope = max((self.w * self.xy - self.x * self.y) / var, 0.0)
        return slope * self.out / self.y


class SpecDecode:
    def __init__(self, num_speculative_tokens: int, cost_aware: bool = True) -> None:
        self.k = num_speculative_tokens
        self.cost_aware = cost_aware
        self.num_drafts = 0  # verify steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens
        self.drafted_per_position = [0] * num_speculative_tokens
        self.cost = StepCost()
        self.cap = num_speculative_tokens  # the draft positions worth their cost
        # cap 0 (not even the first position pays): one step in PROBE_EVERY drafts one
        # position all the same, so its acceptance keeps being measured.
        self.step_cap = num_speculative_tokens
        self._cap_probe = 0

    def begin_step(self) -> None:
        """At the start of a schedule(): this step's cap."""
        if self.cap:
            self.step_cap, self._cap_probe = self.cap, 0
        else:
            self.step_cap = 1 if self._cap_probe == 0 else 0
            # A probe costs a proposal (a draft model's forwards: several tokens' worth), so
            # the dearer proposing is, the rarer the probe: its cost stays ~1/PROBE_EVERY.
            every = PROBE_EVERY * max(1, math.ceil(self.cost.proposal_price()))
            self._cap_probe = (self._cap_probe + 1) % every

    def plan(self, req: Request, room: int, idle: list[str]) -> list[int]:
        """A decode step of ``req``: its drafts (``drafts_for``); its id added to ``idle``
        when it will not verify drafts at its next step (``wants_drafts``)."""
        drafts = self.drafts_for(req, room)
        if not self.wants_drafts(req):
            idle.append(req.req_id)
        return drafts

    def wants_drafts(self, req: Request) -> bool:
        """Whether ``req``, just scheduled, may verify drafts at its next step: the worker
        proposes for it only then (proposing costs the worker's step time)."""
        if self.cap == 0 and self._cap_probe != 0:
            return False
        return req.spec_k > 0 or req.spec_probe <= 1

    def start(self, req: Request) -> None:
        """A new request: two drafts first; K grows with what it keeps (2 x the average + 1:
        all kept, 2 -> 3 -> 5 -> 8 ...), so a request that keeps nothing costs little before it
        goes dormant."""
        req.spec_k = min(self.k, 2)
        req.spec_ema = 1.0
        req.spec_probe = req.spec_backoff = 0
        req.spec_token_ids = []

    def drafts_for(self, req: Request, room: int) -> list[int]:
        """The drafts ``req`` verifies in this decode step: at most its K and ``room`` (the
        tokens the step's budget, max_tokens and max_model_len leave after the one it
        samples anyway)."""
        k = req.spec_k
        if k == 0:  # dormant: a one-draft probe when the countdown runs out
            req.spec_probe -= 1
            if req.spec_probe > 0:
                return []
            k = 1
        n = min(k, self.step_cap, room, len(req.spec_token_ids))
        return req.spec_token_ids[:n] if n > 0 else []

    def observe_step(self, tokens: int, seconds: float, produced: int, propose_s: float = 0.0,
                     proposed: int = 0) -> None:
        """A step ran ``tokens`` in ``seconds`` of the worker (``propose_s`` of them proposing
        drafts for ``proposed`` requests) and produced ``produced`` tokens: refit the cost,
        and the cap with it: the positions whose gain beats the price of a token, if all
        of them together gain more than proposing costs (else none)."""
        if seconds <= 0.0 or tokens <= 0 or not self.cost_aware:
            return
        self.cost.add(tokens, seconds, produced)
        if proposed:
            self.cost.add_proposals(propose_s, proposed)
        price = self.cost.token_price()
        cap, net = 0, 0.0
        # A position's gain: the share of the steps drafting it that kept it (a prior of
        # one in two until it was drafted a few times).
        while cap < self.k and (gain := (self.accepted_per_position[cap] + 1)
                                / (self.drafted_per_position[cap] + 2)) > price:
            net += gain - price
            cap += 1
        self.cap = cap if net > self.cost.proposal_price() else 0

    def on_verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """``req``'s step verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
        if req.spec_k == 0:  # a probe: wake up, or wait twice as long (up to PROBE_EVERY)
            if num_accepted:
                req.spec_ema, req.spec_backoff = float(num_accepted), 0
                req.spec_k = min(self.k, 2 * num_accepted + 1)
            else:
                req.spec_probe = req.spec_backoff = min(PROBE_EVERY, 2 * req.spec_backoff)
            return
        ema = req.spec_ema = 0.5 * req.spec_ema + 0.5 * num_accepted
        if ema >= DORMANT_BELOW:
            req.spec_k = min(self.k, int(2 * ema) + 1)
        else:  # dormant: the first probe soon (text turns repetitive again), then rarer
            req.spec_k = 0
            req.spec_probe = req.spec_backoff = 2

    def stats(self) -> dict[str, int | float | list[int]]:
        """EngineStats fields."""
        n = self.num_drafts
        return {"spec_num_drafts": n, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_mean_acceptance_length": 1.0 + self.num_accepted_tokens / n if n else 0.0,
                "spec_accepted_per_position": list(self.accepted_per_position),
                "spec_drafted_per_position": list(self.drafted_per_position),
                "spec_draft_cap": self.cap, "spec_token_price": round(self.cost.token_price(), 4),
                "spec_proposal_price": round(self.cost.proposal_price(), 4)}
