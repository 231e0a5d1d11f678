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
small model) pays for each. So the engine also measures it (``StepCost``: the worker's steps
that verified drafts against those of as many requests without, just before) and drafts
position i only while
the share of steps that accept it (``accepted / drafted`` there) is above what a token
costs (engine.spec_cost): its seconds times the tokens a second the steps produce, plus
what proposing one more draft costs. Only steps of decodes
and verifies feed the line: a prefill's thousands of tokens are compute-bound, where a few
more tokens of a decode step that reads its weights from DRAM come nearly free. Adding such a position
raises tokens per second; one below it lowers them.

Proposing costs the worker time too, per request (a suffix index's lookups, a draft model's
catch-up) and per draft (a draft model's forward): the positions worth their price, the
latter included, must together gain more than a request's proposal costs
(``StepCost.prices``, measured from the first proposal on, a prefill step's too),
else no request drafts but in a probe step, spaced so that probing costs about 1 % of the
steps. A position's gain is taken as at most the one before's (a draft is kept only after
the one before it was), so positions never drafted do not lend their prior to a proposer
whose first position is measured to fail.

Cold start: before anything is measured the cap is one position, and a position joins the cap
only once the one before it was drafted ``SLOW_START`` times, so a proposer that never agrees
pays for one draft a request until its price is known, not for K. The worker is told how
many drafts each request may verify next (``want``): it proposes no more (a draft model's
forward per draft), and none for a request that will not verify drafts, a dormant one's
included; a draft model catches its KV up lazily when such a request drafts again.

Owns / State: the counters (verify steps with drafts, drafted and accepted tokens, by
position), the step cost line and the cap it sets; the per-request K, average and probe
countdown live on Request.
"""
from __future__ import annotations

import math

from pipeline.engine.request import Request
from pipeline.engine.spec_cost import StepCost

DORMANT_BELOW = 0.2  # accepted drafts per verify step, averaged, under which a request stops drafting
PROBE_EVERY = 32  # decode steps between a dormant request's one-draft probes
PROBE_SHARE = 0.01  # cap 0: the share of its step time the engine's probe steps may cost
SLOW_START = 4  # times position i is drafted before position i + 1 may be
REFIT_EVERY = 8  # cap 0: steps between refits when no draft was verified nor proposed
KEEP_DECAY = 0.9  # per draft at a position: its keep share follows its last ~10 drafts


class SpecDecode:
    def __init__(self, num_speculative_tokens: int, cost_aware: bool = True) -> None:
        self.k = num_speculative_tokens
        self.cost_aware = cost_aware
        self.num_drafts = 0  # verify steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens
        self.drafted_per_position = [0] * num_speculative_tokens
        # The same, decayed per draft at each position: the keep shares the cap follows, so
        # text that turns repetitive (an agent's later steps) reopens drafting within a few
        # probes however long the history that said otherwise.
        self._kept = [0.0] * num_speculative_tokens
        self._tried = [0.0] * num_speculative_tokens
        self.cost = StepCost()
        # The draft positions worth their cost: one until the engine has measured more (the
        # cost rule off: always K).
        self.cap = 1 if cost_aware else num_speculative_tokens
        # cap 0 (not even the first position pays): one step in probe_every() drafts one
        # position all the same, so its acceptance keeps being measured.
        self.step_cap = self.cap
        self._cap_probe = 1
        self._every = PROBE_EVERY  # probe_every(), refitted with the cap
        self._stale = 0  # steps observed since the cap was refitted
        self._dirty = False  # drafts verified since

    def begin_step(self) -> None:
        """At the start of a schedule(): this step's cap."""
        if self.cap:  # should the cap drop to 0, its first probe comes probe_every() steps on
            self.step_cap, self._cap_probe = self.cap, 1
        else:
            self.step_cap = 1 if self._cap_probe == 0 else 0
            self._cap_probe = (self._cap_probe + 1) % self._every

    def probe_every(self) -> int:
        """Steps between probe steps while no position pays: a probe costs each request a
        proposal (a draft model's forward: several tokens' worth) and a token run, so the
        dearer they are, the rarer the probe: its cost stays ~PROBE_SHARE of the steps."""
        return self._every

    def next_k(self, req: Request) -> int:
        """How many drafts ``req``, just scheduled, may verify at its next step (0: none):
        the worker proposes that many for it (proposing costs the worker's step time)."""
        if self.cap == 0:
            if self._cap_probe != 0:
                return 0
            cap = 1  # the next step is a probe step
        else:
            cap = self.cap
        if req.spec_k > 0:
            return min(req.spec_k, cap)
        return 1 if req.spec_probe <= 1 else 0  # dormant: its probe's one draft

    def wants_drafts(self, req: Request) -> bool:
        return self.next_k(req) > 0

    def want(self, reqs: list[Request], idle: list[str], fewer: dict[str, int]) -> None:
        """The step's scheduled requests: those that will not verify drafts at their next
        step into ``idle``, those that may verify fewer than K into ``fewer`` (req_id ->
        how many): what the worker proposes after this step (SchedulerOutput)."""
        for req in reqs:
            k = self.next_k(req)
            if k == 0:
                idle.append(req.req_id)
            elif k < self.k:
                fewer[req.req_id] = k

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
            n = min(1, self.step_cap, room, len(req.spec_token_ids))
            if n:  # no proposal until its verdict (on_verified): a dormant request's probe mostly fails
                req.spec_probe = 2
            return req.spec_token_ids[:n]
        n = min(k, self.step_cap, room, len(req.spec_token_ids))
        return req.spec_token_ids[:n] if n > 0 else []

    def observe_step(self, tokens: int, seconds: float, produced: int, propose_s: float = 0.0,
                     proposed: int = 0, decode: bool = True, asked: int = 0, drafts: int = 0,
                     verifying: int = 0) -> None:
        """A step ran ``tokens`` in ``seconds`` of the worker (``propose_s`` of them proposing
        ``asked`` drafts for ``proposed`` requests; ``drafts`` of its tokens were drafts
        ``verifying`` requests verified) and produced ``produced`` tokens: refit
        the cost, and the cap with it: the positions whose gain beats the price of a token
        and of a draft, if all of them together gain more than proposing for a request
        costs (else none). Only decode and verify steps (``decode``) feed the line; every
        step's proposals are priced."""
        if not self.cost_aware:
            return
        # The line prices the forward (its seconds without the proposals, priced apart) in
        # tokens of a step that proposes nothing: what decoding without drafts produces.
        if decode and seconds > propose_s and tokens > 0:
            self.cost.add(tokens, seconds - propose_s, produced, drafts, verifying)
        if proposed:
            self.cost.add_proposals(propose_s, proposed, asked)
        # Cap 0 and nothing drafted nor proposed since (the steady state of drafts that do
        # not pay): only the prices drift, slowly; a refit every few steps follows them.
        self._stale += 1
        if not (self.cap or proposed or self._dirty or self._stale >= REFIT_EVERY):
            return
        self._stale, self._dirty = 0, False
        proposal, price = self.cost.prices()  # per request (verify and propose), per draft
        drafted, cap, reach, net, gain = self.drafted_per_position, 0, 0, 0.0, 1.0
        kept, tried = self._kept, self._tried
        # A position's gain: the share of its recent drafts kept (a prior of one in two
        # until it was drafted a few times), at most the gain of the one before (a
        # draft is kept only after the one before it was). The positions that pay together
        # must beat a proposal's price; of them, drafted are those up to the first whose
        # previous position was drafted fewer than SLOW_START times (no evidence yet).
        while cap < self.k and (gain := min(gain, (kept[cap] + 1) / (tried[cap] + 2))) > price:
            net += gain - price
            if reach == cap and (cap == 0 or drafted[cap - 1] >= SLOW_START):
                reach += 1
            cap += 1
        self.cap = reach if net > proposal else 0
        if not self.cap:
            self._every = max(PROBE_EVERY, math.ceil((price + proposal) / PROBE_SHARE))

    def on_verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """``req``'s step verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        self.num_drafts += 1
        self._dirty = True
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        kept, tried, d = self._kept, self._tried, KEEP_DECAY
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
            tried[i] = d * tried[i] + 1.0
            kept[i] = d * kept[i] + (i < num_accepted)
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
