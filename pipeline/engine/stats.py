"""Engine stage: the scheduler's counters and gauges as one ``EngineStats`` snapshot.

Owns / State: nothing; read-only over the scheduler, its KV cache manager and connector.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.messages import EngineStats

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler


def scheduler_stats(sched: Scheduler) -> EngineStats:
    kv, conn = sched.kv, sched.connector
    pool = kv.pool
    return EngineStats(
        # Requests queued for a reservation wait for blocks too.
        running=len(sched.running), waiting=len(sched.waiting) + (conn.num_waiting if conn else 0),
        kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used_blocks,
        kv_blocks_cached=len(pool.cached), kv_blocks_cached_evictable=pool.num_cached_free,
        kv_blocks_free=pool.num_free_blocks - pool.num_cached_free,
        kv_usage=pool.num_used_blocks / pool.num_blocks,
        prefix_cache_hit_rate=kv.hit_rate,
        prefix_cache_queried_tokens=kv.num_queried_tokens,
        prefix_cache_hit_tokens=kv.num_hit_tokens,
        num_preemptions=sched.num_preemptions, num_evictions=pool.num_evictions,
        prompt_tokens=sched.num_prompt_tokens, computed_tokens=sched.results.num_computed_tokens,
        generation_tokens=sched.results.num_generated_tokens,
        stale_results_dropped=sched.results.num_stale_results,
        reserve_blocks_per_running=sched.admission.reserve_per_running,
        **(sched.spec.stats() if sched.spec else {}),  # type: ignore[arg-type]
        **(conn.stats() if conn else {}))  # type: ignore[arg-type]
