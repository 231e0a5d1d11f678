"""Issue 26, the router's share of the KV tier: instances on one tier directory report one
``kv_tier_group``, and a prefix whose instance is busy, full or gone goes to a sibling that
shares its tier (it loads the prefix's blocks) rather than to any instance (it computes them).

The rule on ``MixedPolicy`` with stand-in targets (tier sibling over a non-sibling, affinity
first within MAX_IMBALANCE, without tiers the choices of the policy before tiers, and the
bounds as a property), then the real router over four scripted instances in two tier groups
(``router_fakes``): the counts in its stats reply, the group shown per instance. That an
engine reports its group is tests/gateway/test_e2e_kv_tier.py's.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import ExitStack

from hypothesis import given
from hypothesis import strategies as st
from router_fakes import PROMPT, Cli, FakeInstance, result, run_router, wait_for
from test_router import FakeTarget

from pipeline.frontend import protocol as P
from pipeline.router.policy import BY_AFFINITY, BY_LOAD, BY_TIER, LOW_FREE_SHARE, MAX_IMBALANCE, MixedPolicy
from pipeline.router.stats import merge

KEY = b"prefix"


def ran_on(policy: MixedPolicy, target: FakeTarget) -> None:
    """``target`` ran prefix KEY (the only instance up then)."""
    assert policy.choose([target], KEY) is target


def test_a_tier_sibling_is_chosen_over_a_non_sibling_at_equal_load():
    for order in ((1, 2), (2, 1)):  # whichever round robin would take
        policy = MixedPolicy()
        a, b, c = FakeTarget("a", 0, 0.5, "g"), FakeTarget("b", 0, 0.5, "g"), FakeTarget("c", 0, 0.5, "h")
        ran_on(policy, a)
        for _ in range(3):  # a is gone: b has its tier; then b is the prefix's instance
            targets = [[b, c][i - 1] for i in order]
            assert policy.choose(targets, KEY) is b
        assert policy.affinity[KEY] == ("b", "g")
    # a busier than MAX_IMBALANCE: a sibling within the bound beats a less loaded stranger
    policy = MixedPolicy()
    a, b, c = FakeTarget("a", 0, 0.5, "g"), FakeTarget("b", 0, 0.5, "g"), FakeTarget("c", 0, 0.5, "h")
    ran_on(policy, a)
    a._load, b._load = MAX_IMBALANCE + 1, MAX_IMBALANCE
    assert policy.choose([a, b, c], KEY) is b and policy.by == BY_TIER
    # ... but not one beyond it; a full one is skipped too
    a._load, b._load = MAX_IMBALANCE + 1, MAX_IMBALANCE + 1
    policy.affinity[KEY] = ("a", "g")
    assert policy.choose([a, b, c], KEY) is c and policy.by == BY_LOAD
    assert policy.affinity[KEY] == ("c", "h")  # c ran it: its tier has it now
    policy.affinity[KEY] = ("a", "g")
    a._load, b._load, b._free = 0, 0, LOW_FREE_SHARE / 2
    a._free = LOW_FREE_SHARE / 2
    d = FakeTarget("d", 1, 0.5, "g")
    assert policy.choose([a, b, c, d], KEY) is d and policy.by == BY_TIER


def test_affinity_wins_within_the_imbalance_and_no_group_means_no_sibling():
    policy = MixedPolicy()
    a, b, c = FakeTarget("a", 0, 0.5, "g"), FakeTarget("b", 0, 0.5, "g"), FakeTarget("c", 0, 0.5, "h")
    ran_on(policy, a)
    a._load = MAX_IMBALANCE
    assert policy.choose([c, b, a], KEY) is a and policy.by == BY_AFFINITY
    # an instance without a tier has no siblings, even among others without one
    policy = MixedPolicy()
    x, y, z = FakeTarget("x", 0, 0.5), FakeTarget("y", 1, 0.5), FakeTarget("z", 0, 0.5)
    ran_on(policy, x)
    assert policy.affinity[KEY] == ("x", "")
    assert policy.choose([y, z], KEY) is z and policy.by == BY_LOAD


class PolicyBeforeTiers:
    """``MixedPolicy.choose`` as it was before tier groups: the reference of "unchanged"."""

    def __init__(self) -> None:
        self.affinity: OrderedDict[bytes, str] = OrderedDict()
        self._turn = 0

    def choose(self, targets, key):
        roomy = [t for t in targets if t.free_share() >= LOW_FREE_SHARE] or list(targets)
        loads = [t.load() for t in roomy]
        least = min(loads)
        chosen = None
        if key is not None and (addr := self.affinity.get(key)) is not None:
            chosen = next((t for t, load in zip(roomy, loads) if t.address == addr
                           and load <= least + MAX_IMBALANCE), None)
        if chosen is None:
            ties = [t for t, load in zip(roomy, loads) if load == least]
            self._turn += 1
            chosen = ties[self._turn % len(ties)]
        if key is not None:
            self.affinity[key] = chosen.address
        return chosen


# One request: each of up to four instances (index: its address) up or gone, its load, its
# free share (below LOW_FREE_SHARE: full) and tier group; the prefix key.
INSTANCE = st.one_of(st.none(), st.tuples(st.integers(0, 12), st.sampled_from([0.01, 0.5]),
                                          st.sampled_from(["", "g", "h"])))
STEPS = st.lists(st.tuples(st.lists(INSTANCE, min_size=4, max_size=4), st.sampled_from([None, b"k1", b"k2"])),
                 min_size=1, max_size=30)


def targets_of(instances, tiers: bool = True) -> list[FakeTarget]:
    return [FakeTarget(f"i{n}", load, free, tier if tiers else "")
            for n, inst in enumerate(instances) if inst is not None for load, free, tier in [inst]]


@given(STEPS)
def test_without_tiers_the_choices_are_those_before_tiers(steps):
    policy, before = MixedPolicy(), PolicyBeforeTiers()
    for instances, key in steps:
        targets = targets_of(instances, tiers=False)
        if targets:
            assert policy.choose(targets, key).address == before.choose(targets, key).address
            assert policy.by != BY_TIER


@given(STEPS)
def test_the_choice_is_roomy_within_the_imbalance_and_follows_its_rule(steps):
    policy = MixedPolicy()
    for instances, key in steps:
        targets = targets_of(instances)
        if not targets:
            continue
        known = policy.affinity.get(key) if key is not None else None
        chosen = policy.choose(targets, key)
        roomy = [t for t in targets if t.free_share() >= LOW_FREE_SHARE] or targets
        least = min(t.load() for t in roomy)
        assert chosen in roomy
        assert chosen.load() <= least + (MAX_IMBALANCE if key is not None else 0)
        if policy.by == BY_AFFINITY:
            assert known is not None and chosen.address == known[0]
        elif policy.by == BY_TIER:
            assert known is not None and known[1] and chosen.tier_group() == known[1]
            siblings = [t for t in roomy if t.tier_group() == known[1] and t.load() <= least + MAX_IMBALANCE]
            assert chosen.load() == min(t.load() for t in siblings)
        else:
            assert chosen.load() == least
            assert known is None or not known[1] or not any(
                t.tier_group() == known[1] and t.load() <= least + MAX_IMBALANCE for t in roomy)
        if key is not None:
            assert policy.affinity[key] == (chosen.address, chosen.tier_group())


def test_stats_merge_drops_the_tier_group():
    assert "kv_tier_group" not in merge([{"kv_tier_group": "ab", "running": 1},
                                         {"kv_tier_group": "cd", "running": 2}])


def test_the_router_sends_a_prefix_to_its_instances_tier_sibling_and_counts_why():
    long_prompt = " ".join([PROMPT] * 5)  # past PREFIX_BYTES: it has a prefix key
    with ExitStack() as stack:
        fakes = [FakeInstance("mixed") for _ in range(4)]
        for n, f in enumerate(fakes):
            f.tier_group = "g" if n < 2 else "h"
            stack.callback(f.close)
        router = stack.enter_context(run_router("--instance", *(f.address for f in fakes)))
        cli = Cli(router.args.listen)
        stack.callback(cli.close)

        def views() -> dict:
            return cli.health().detail["instances"]

        wait_for(lambda: all(v["up"] and v["tier_group"] for v in views().values()),
                 "every instance up with its tier group")

        def run(rid: str) -> FakeInstance:
            cli.send(P.Generate(id=rid, prompt=long_prompt, max_tokens=2))
            wait_for(lambda: any(not f.got.empty() for f in fakes), f"{rid} at an instance")
            f = next(f for f in fakes if not f.got.empty())
            g = f.expect(P.Generate)
            f.send(P.Final(result=result(g.id, [7, 8], " a b")))
            while not isinstance(msg := cli.recv(), P.Final):
                pass
            assert msg.result.id == rid and msg.result.error is None
            return f

        first = run("g1")  # by load: all idle
        assert run("g2") is first  # by affinity
        first.status = "starting"
        wait_for(lambda: not views()[first.address]["up"], "the router to take it down")
        sibling = run("g3")
        assert sibling is not first and sibling.tier_group == first.tier_group
        assert run("g4") is sibling  # its instance now
        cli.send(P.Stats(id="s"))
        while not isinstance(st_ := cli.recv(), P.StatsReply):
            pass
        assert st_.stats["router_routed"] == {"affinity": 2, "tier": 1, "load": 1}
        assert "kv_tier_group" not in st_.stats
        assert {a: v["tier_group"] for a, v in st_.stats["instances"].items() if v["up"]} == {
            f.address: f.tier_group for f in fakes if f is not first}
        first.status = "ok"
