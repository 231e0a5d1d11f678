"""Router: which instance runs a request.

Owns / State (``MixedPolicy``): the prefix-affinity table (a bounded LRU map from a prompt's
prefix key to the address and KV tier group of the instance that last ran that prefix) and a
round-robin cursor that breaks ties. ``PoolPolicy`` (disaggregated pools): a ``MixedPolicy``
for the prefill pool and a round-robin cursor for the decode pool. A policy sees instances
only through ``Target`` (address, live load, free KV blocks, tier group). Pure: no socket,
no clock; ``choose`` names the rule that picked (``by``) for the router's counts.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import msgspec

from pipeline.frontend import protocol as P

# A prompt shorter than this has no prefix worth a cache hit: it goes to the least loaded.
PREFIX_BYTES = 256
# Token-id prompts: the first block of ids (the engine's default block size).
PREFIX_TOKENS = 16
# Prefer the instance that holds a prefix while its load is at most this many requests
# above the least loaded one's.
MAX_IMBALANCE = 4
MAX_KEYS = 1 << 16
# An instance with less than this share of its KV blocks free is full: used only if all are.
LOW_FREE_SHARE = 0.05


class Target(Protocol):
    address: str

    def load(self) -> int: ...

    def free_share(self) -> float: ...

    def tier_group(self) -> str:
        """Equal for instances that read the same KV tier files; "" for none (or unknown)."""
        ...


# What picked an instance (``MixedPolicy.by``, the router's ``router_routed`` counts): the
# prefix's own instance, a sibling sharing its KV tier, or the load alone.
BY_AFFINITY, BY_TIER, BY_LOAD = "affinity", "tier", "load"
RULES = (BY_AFFINITY, BY_TIER, BY_LOAD)


def prefix_key(req: P.Generate) -> bytes | None:
    """The hash of the request's first PREFIX_BYTES of prompt (or messages, or the first
    block of token ids) and its cache salt; None when the prompt is shorter than that."""
    if req.prompt_token_ids is not None:
        if len(req.prompt_token_ids) < PREFIX_TOKENS:
            return None
        head = msgspec.msgpack.encode(req.prompt_token_ids[:PREFIX_TOKENS])
    else:
        text = (req.prompt.encode("utf-8", "surrogatepass") if req.prompt is not None
                else msgspec.msgpack.encode(req.messages))
        if len(text) < PREFIX_BYTES:
            return None
        head = text[:PREFIX_BYTES]
    salt = (req.cache_salt or "").encode("utf-8", "surrogatepass")
    return hashlib.blake2b(head + b"\0" + salt, digest_size=16).digest()


class MixedPolicy:
    """Mixed replicas (data parallel): least loaded, cache-aware within MAX_IMBALANCE.

    A prefix goes back to the instance that last ran it while that one's load is at most
    MAX_IMBALANCE above the least loaded's (its pool likely holds the prefix). When it is
    busier than that, full or gone, a sibling that shares its KV tier (same non-empty tier
    group: it loads the prefix's blocks, ~50x cheaper than computing them) within the same
    bound is next, the least loaded of them; else the least loaded of all. Ties round robin."""

    def __init__(self, max_imbalance: int = MAX_IMBALANCE, max_keys: int = MAX_KEYS) -> None:
        self.max_imbalance = max_imbalance
        self.max_keys = max_keys
        # prefix key -> (address, tier group) of the instance that last ran it: the group
        # outlives the instance (its siblings still have the prefix in their tier).
        self.affinity: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self.by = BY_LOAD  # the rule of the last choice (RULES)
        self._turn = 0

    def choose(self, targets: Sequence[Target], key: bytes | None) -> Target:
        """One of ``targets`` (non-empty: the instances that are up) for a request."""
        roomy = [t for t in targets if t.free_share() >= LOW_FREE_SHARE] or list(targets)
        loads = [t.load() for t in roomy]
        least = min(loads)
        near = [(t, load) for t, load in zip(roomy, loads, strict=True)
                if load <= least + self.max_imbalance]
        chosen: Target | None = None
        if key is not None and (known := self.affinity.get(key)) is not None:
            addr, group = known
            chosen = next((t for t, _ in near if t.address == addr), None)
            self.by = BY_AFFINITY
            if chosen is None and group:
                chosen = self._least([(t, load) for t, load in near if t.tier_group() == group])
                self.by = BY_TIER
        if chosen is None:
            chosen = self._least(near)
            self.by = BY_LOAD
        assert chosen is not None
        if key is not None:
            self.affinity[key] = (chosen.address, chosen.tier_group())
            self.affinity.move_to_end(key)
            if len(self.affinity) > self.max_keys:
                self.affinity.popitem(last=False)
        return chosen

    def _least(self, loaded: list[tuple[Target, int]]) -> Target | None:
        """The least loaded of ``loaded`` (round robin among equals); None if it is empty."""
        if not loaded:
            return None
        least = min(load for _, load in loaded)
        ties = [t for t, load in loaded if load == least]
        self._turn += 1
        return ties[self._turn % len(ties)]


class PoolPolicy:
    """Disaggregated pools. Prefill: as ``MixedPolicy`` (least loaded, cache-aware: its prefix
    cache saves compute). Decode: least loaded, then the most free KV (a decode instance holds
    every running request's KV to the end), then round robin."""

    def __init__(self, max_imbalance: int = MAX_IMBALANCE, max_keys: int = MAX_KEYS) -> None:
        self.prefill = MixedPolicy(max_imbalance, max_keys)
        self._turn = 0

    def choose_prefill(self, targets: Sequence[Target], key: bytes | None) -> Target:
        return self.prefill.choose(targets, key)

    def choose_decode(self, targets: Sequence[Target]) -> Target:
        roomy = [t for t in targets if t.free_share() >= LOW_FREE_SHARE] or list(targets)
        ranks = [(t.load(), -t.free_share()) for t in roomy]
        best = min(ranks)
        ties = [t for t, rank in zip(roomy, ranks, strict=True) if rank == best]
        self._turn += 1
        return ties[self._turn % len(ties)]
