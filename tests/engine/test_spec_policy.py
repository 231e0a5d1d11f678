"""Speculative decoding's drafting policy (engine/spec_decode.py), driven directly on
``SpecDecode`` with synthetic step times (no timing, no model): a proposer that never agrees
(the random draft's floor) costs under 3 % from a cold start on, whatever its proposals
cost; the cold start drafts one position until the engine measured more; the worker is asked
for no more drafts than the request may verify; a proposer that always agrees still reaches
K within a few dozen steps.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeline.engine.request import Request
from pipeline.engine.spec_cost import StepCost
from pipeline.engine.spec_decode import PROBE_SHARE, SLOW_START, SpecDecode
from pipeline.sampling_params import SamplingParams

BASE = 1e-3  # seconds of a one-token decode step


def simulate(spec: SpecDecode, steps: int, accept: Callable[[int], int], forward_tokens: float,
             token_price: float, prompt: int = 12) -> dict[str, float]:
    """One request at batch 1, as the scheduler and the worker drive SpecDecode: a prefill
    step, then ``steps`` decode steps. Each step's proposal runs one draft forward per draft
    asked (``forward_tokens`` one-token steps' time each), a step of n tokens takes
    BASE x (1 + token_price x (n - 1)); ``accept(d)``: the drafts kept of d. Returns the
    output tok/s on over off (1 / BASE), drafts verified and proposals run."""
    req = Request("r", list(range(prompt)), SamplingParams(max_tokens=steps + 2))
    spec.start(req)
    secs = produced = proposals = forwards = 0.0
    asked = 0  # drafts the worker proposed after the previous step
    for step in range(steps + 1):
        spec.begin_step()
        drafts = spec.drafts_for(req, 100) if step else []
        idle: list[str] = []
        fewer: dict[str, int] = {}
        spec.want([req], idle, fewer)  # scheduled: then the step's result
        kept = accept(len(drafts)) if drafts else 0
        if drafts:
            spec.on_verified(req, len(drafts), kept)
        n_asked = 0 if idle else fewer.get(req.req_id, spec.k)
        propose_s = BASE * forward_tokens * n_asked
        step_s = BASE * (1 + token_price * len(drafts)) + propose_s
        spec.observe_step(prompt if step == 0 else 1 + len(drafts), step_s, 1 + kept, propose_s,
                          1 if n_asked else 0, decode=step > 0, asked=n_asked, drafts=len(drafts))
        req.spec_token_ids = [7] * n_asked  # the proposer's drafts: as many as asked
        secs += step_s
        produced += 1 + kept
        proposals += bool(n_asked)
        forwards += n_asked
        asked = n_asked
    del asked
    return {"ratio": produced / secs * BASE, "drafted": spec.num_draft_tokens, "proposals": proposals,
            "forwards": forwards}


@pytest.mark.parametrize("forward_tokens", [0.3, 1.0, 3.0])
def test_a_draft_that_never_agrees_costs_under_3_percent_from_a_cold_start(forward_tokens):
    """The random draft's floor: from a fresh engine (nothing measured), a proposer that never
    agrees, its forward as dear as 0.3 to 3 target steps."""
    spec = SpecDecode(4)
    got = simulate(spec, 2000, lambda d: 0, forward_tokens, 0.3)
    assert got["ratio"] >= 0.97, got
    assert spec.cap == 0
    # Cold: the request drafts one position (not K) until the proposal's price is known.
    assert spec.drafted_per_position[1:] == [0, 0, 0]


def test_the_first_proposals_price_gates_the_next():
    spec = SpecDecode(4)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100))
    spec.start(req)
    spec.begin_step()
    assert spec.step_cap == 1  # nothing measured: one position
    idle: list[str] = []
    fewer: dict[str, int] = {}
    spec.want([req], idle, fewer)
    assert idle == [] and fewer == {"r": 1}  # the worker proposes one draft, not K
    # The prefill step: its proposal took four steps' time (a prefill does not feed the
    # token line, its proposal is priced all the same).
    spec.observe_step(3, 5 * BASE, 1, 4 * BASE, 1, decode=False)
    assert spec.cap == 1  # no decode step yet: no tokens a second to price it in
    spec.observe_step(1, BASE, 1)  # one decode step: a proposal costs ~4 tokens
    assert spec.cost.proposal_price() > 3 and spec.cap == 0
    spec.begin_step()
    assert spec.step_cap == 0
    idle, fewer = [], {}
    spec.want([req], idle, fewer)
    assert idle == ["r"]  # the worker proposes nothing for it


def test_probe_steps_are_spaced_by_their_price():
    spec = SpecDecode(4)
    spec.observe_step(1, BASE, 1, 5 * BASE, 1)  # proposals cost 5 tokens
    spec.observe_step(2, 1.2 * BASE, 1, drafts=1)
    assert spec.cap == 0
    every = spec.probe_every()
    assert every >= spec.cost.proposal_price() / PROBE_SHARE
    caps = []
    for _ in range(3 * every):
        spec.begin_step()
        caps.append(spec.step_cap)
    assert caps[0] == 0 and sum(caps) == 3  # one probe step per ``every``, not at once


def test_a_dormant_request_asks_for_nothing_until_its_probe():
    spec = SpecDecode(4, cost_aware=False)  # the per-request rule alone
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000))
    spec.start(req)
    asked: list[int] = []
    for step in range(200):
        spec.begin_step()
        req.spec_token_ids = [7] * (asked[-1] if asked else 0)  # the worker's proposal
        drafts = spec.drafts_for(req, 100) if step else []  # step 0: the prefill
        idle: list[str] = []
        fewer: dict[str, int] = {}
        spec.want([req], idle, fewer)  # scheduled: then the step's result
        asked.append(0 if idle else fewer.get("r", spec.k))
        if drafts:
            spec.on_verified(req, len(drafts), 0)
    assert req.spec_k == 0
    # A dormant request asks for one draft (its probe) after 2, 4, 8, 16, then 32 steps, and
    # none while its probe is verified (it mostly fails): every draft asked for is verified
    # but the one asked as it went dormant.
    assert asked[:6] == [2, 2, 2, 1, 1, 0] and max(asked[6:]) == 1
    assert sum(asked) - asked[-1] - spec.num_draft_tokens == 2
    assert sum(1 for a in asked if a) <= 5 + 4 + 200 // 32


def test_a_draft_that_always_agrees_reaches_k_within_a_few_dozen_steps():
    spec = SpecDecode(6)
    got = simulate(spec, 200, lambda d: d, 0.05, 0.05)
    assert spec.cap == 6
    assert spec.drafted_per_position[5] >= 200 - 6 * (SLOW_START + 3)  # K drafted nearly from the start
    assert got["ratio"] > 3.5  # 7 tokens a step at ~1.6 steps' time (ideal ~4.3)


def test_cost_rule_off_drafts_k_from_the_start():
    spec = SpecDecode(4, cost_aware=False)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100))
    spec.start(req)
    spec.begin_step()
    assert spec.step_cap == 4
    req.spec_token_ids = [7] * 4
    assert len(spec.drafts_for(req, 100)) == 2  # the request's own K: two first


def test_proposals_are_priced_per_request_and_per_draft():
    """A draft model's proposal: a catch-up per request, a forward per draft; told apart
    once proposals asked different draft counts (one count only: all of it per request)."""
    cost = StepCost()
    cost.add(1, BASE, 1)  # a token a BASE: prices in BASEs
    cost.add_proposals(1.2 * BASE, 1, 1)
    cost.add_proposals(2.4 * BASE, 2, 2)
    assert cost.prices() == pytest.approx((1.2, 0.0))  # collinear: per request
    cost.add_proposals(4.2 * BASE, 1, 4)
    cost.add_proposals(2 * 2.2 * BASE, 2, 4)
    assert cost.prices() == pytest.approx((0.2, 1.0))


def verify(spec: SpecDecode, steps: int, hits: int) -> None:
    """``steps`` verify steps of one draft, the first ``hits`` of them kept."""
    req = Request("v", [1, 2, 3], SamplingParams(max_tokens=1000))
    spec.start(req)
    for i in range(steps):
        spec.on_verified(req, 1, int(i < hits))


def test_a_failing_first_position_keeps_the_cap_shut():
    """Even when noise makes a token look free (one token size seen: price 0): positions
    never drafted count for no more than the first, measured to fail (not their prior of
    1/2), and a draft model's forward is priced per draft."""
    spec = SpecDecode(4)
    verify(spec, 20, 1)
    spec.cost.add(1, BASE, 1)
    spec.cost.add_proposals(0.5 * BASE, 1, 4)  # cheap, per request (n-gram-like)
    spec.observe_step(1, BASE, 1)
    assert spec.cost.token_price() == 0.0
    assert spec.cap == 0  # 4 x ~2/16 < 0.5; priors would say 2/16 + 3 x 1/2
    draft = SpecDecode(4)
    verify(draft, 5, 1)  # one lucky hit in five
    draft.cost.add(1, BASE, 1)
    draft.cost.add_proposals(1.2 * BASE, 1, 1)  # a catch-up and a forward ...
    draft.cost.add_proposals(2.2 * BASE, 1, 2)  # ... and one more forward per draft
    draft.observe_step(1, BASE, 1)
    assert draft.cost.prices() == pytest.approx((0.2, 1.0), abs=0.01)
    assert draft.cap == 0  # a position gains 2/7 at most, costs a forward


def test_a_descheduled_step_does_not_price_a_token():
    """A shared machine: one step of a one-token decode took 20 steps' time (the process was
    descheduled). It counts as twice the predicted step at most: the price stays near the
    truth (0.25 of a token per token) instead of jumping."""
    cost = StepCost()
    for i in range(40):
        n = 1 + (i % 4 == 0)
        cost.add(n, BASE * (1 + 0.25 * (n - 1)), 1, n - 1)
    assert cost.token_price() == pytest.approx(0.25, abs=0.02)
    cost.add(2, 20 * BASE, 1, 1)
    assert cost.token_price() < 0.4  # unclamped: 2.0 for the next ~10 drafts' steps


def test_text_that_turns_repetitive_reopens_drafting_within_a_few_probes():
    """The keep shares the cap follows are decayed (the last ~10 drafts of a position): after
    a long history of failures, a handful of kept probes reopen it."""
    spec = SpecDecode(4)
    spec.cost.add(1, BASE, 1)
    spec.cost.add(2, 1.3 * BASE, 1, 1)  # a token costs 0.3
    spec.cost.add_proposals(0.1 * BASE, 1, 1)
    verify(spec, 200, 10)
    spec.observe_step(1, BASE, 1)
    assert spec.cap == 0
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000))
    spec.start(req)
    probes = 0
    while spec.cap == 0:
        spec.on_verified(req, 1, 1)  # a kept probe
        spec.observe_step(2, 1.3 * BASE, 2, drafts=1)
        probes += 1
    assert probes <= 8


def test_the_price_of_a_token_follows_the_steps_of_the_moment():
    """Drafts rare (probe steps only) while plain steps get faster (caches warming): each
    verify step is priced against the plain steps just before it, so the price stays the
    extra token's, where a line fitted over old slow steps drifted up."""
    cost = StepCost()
    step = 2.0 * BASE
    for i in range(600):
        step = max(BASE, step * 0.995)  # warming up
        if i % 50 == 49:
            cost.add(2, step + 0.3 * BASE, 1, 1)
        else:
            cost.add(1, step, 1)
    assert cost.token_price() == pytest.approx(0.3, abs=0.05)


def test_a_verify_step_is_priced_per_request_and_per_draft():
    """A verify step leaves the one-token decode path (a cost per request whatever its
    drafts) and runs its drafts (a cost each): told apart once steps verified different
    draft counts, so deep drafts are not charged the first one's fixed part."""
    cost = StepCost()
    for i in range(30):
        cost.add(1, BASE, 1)
        d = 1 + 3 * (i % 2)
        cost.add(1 + d, BASE * (1.5 + 0.1 * d), 1, d, 1)
    assert cost.verify.fit() == pytest.approx((0.5 * BASE, 0.1 * BASE))  # seconds
