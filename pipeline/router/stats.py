"""Router: the stats reply, merged from the instances' own stats replies. Owns no state.

Counters, gauges, labelled counters and histograms add up across instances; the ratios are
recomputed from the merged sums (a mean of ratios would weigh an idle instance like a busy
one); ``timestamp`` is the newest; ``kv_tier_group`` (one instance's identity) is dropped.
``instances`` has each instance's routing view (its tier group included).
"""
from __future__ import annotations

from itertools import zip_longest
from typing import Any

# ratio -> (numerator, denominator), both merged sums
RATIOS = {
    "kv_usage": ("kv_blocks_used", "kv_blocks_total"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens"),
    "engine_overhead_share": ("engine_overhead_seconds", "engine_step_seconds"),
}
NEWEST = {"timestamp", "reserve_blocks_per_running"}


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k))
                for k in a.keys() | b.keys()}
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return a + b
    if isinstance(a, list) and isinstance(b, list):  # per-position counts (spec_accepted_per_position)
        return [x + y for x, y in zip_longest(a, b, fillvalue=0)]
    return a


def merge(replies: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in replies:
        r = dict(r)
        # engine_overhead_share is a share of step time: weigh it by that time.
        r["engine_overhead_seconds"] = r.get("engine_overhead_share", 0.0) * r.get("engine_step_seconds", 0.0)
        for k, v in r.items():
            out[k] = max(out[k], v) if k in NEWEST and k in out else _add(out[k], v) if k in out else v
    for ratio, (num, den) in RATIOS.items():
        if den in out:
            out[ratio] = out.get(num, 0) / out[den] if out[den] else 0.0
    if out.get("spec_num_drafts"):  # tokens per verify step, from the merged counts
        out["spec_mean_acceptance_length"] = 1.0 + out["spec_num_accepted_tokens"] / out["spec_num_drafts"]
    out.pop("engine_overhead_seconds", None)
    out.pop("kv_tier_group", None)
    return out
