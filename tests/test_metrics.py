"""Metrics: results and engine state land in counters/gauges/histograms; snapshot() and the
Prometheus text (served over HTTP from our own registry) agree."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pipeline.gateway.metrics import Metrics
from pipeline.messages import RequestResult, Timings, Usage


def result(reason: str, ttft: float | None, itl: list[float], prompt: int, out: int, cached: int) -> RequestResult:
    return RequestResult(id="x", text="", token_ids=[0] * out, finish_reason=reason,
                         usage=Usage(prompt, out, cached),
                         timings=Timings(arrival_time=1.0, ttft=ttft, queue_time=0.001, e2e=1.5, itl=itl))


def test_snapshot_counts_results_and_engine_state():
    m = Metrics()
    m.observe_result(result("stop", 0.05, [0.01, 0.02], prompt=10, out=3, cached=4))
    m.observe_result(result("abort", None, [], prompt=5, out=0, cached=0))
    m.set_engine_state(running=2, waiting=3, kv_blocks_used=40, kv_blocks_cached=7, kv_blocks_total=100,
                       prefix_cache_queries=100, prefix_cache_hits=25, preemptions=1)
    m.set_engine_state(running=1, waiting=0, kv_blocks_used=10, kv_blocks_cached=30, kv_blocks_total=100,
                       prefix_cache_queries=200, prefix_cache_hits=100, preemptions=3)
    s = m.snapshot()
    assert s["requests_finished"] == {"stop": 1.0, "length": 0.0, "abort": 1.0, "error": 0.0}
    assert (s["prompt_tokens"], s["generation_tokens"], s["cached_prompt_tokens"]) == (15.0, 3.0, 4.0)
    assert (s["num_requests_running"], s["num_requests_waiting"]) == (1.0, 0.0)
    assert (s["kv_blocks_used"], s["kv_blocks_cached"], s["kv_blocks_total"]) == (10.0, 30.0, 100.0)
    assert s["prefix_cache_hit_rate"] == 0.5 and s["prefix_cache_hits"] == 100.0
    assert s["num_preemptions"] == 3.0
    ttft = s["time_to_first_token_seconds"]
    assert ttft["count"] == 1 and ttft["buckets"]["0.04"] == 0 and ttft["buckets"]["0.06"] == 1
    assert s["inter_token_latency_seconds"]["count"] == 2
    assert abs(s["inter_token_latency_seconds"]["sum"] - 0.03) < 1e-12


def test_engine_restart_counts_from_zero():
    m = Metrics()
    kw = dict(running=0, waiting=0, kv_blocks_used=0, kv_blocks_cached=0, kv_blocks_total=1,
              prefix_cache_queries=0, prefix_cache_hits=0)
    m.set_engine_state(preemptions=5, **kw)
    m.set_engine_state(preemptions=2, **kw)  # a new engine: 2 more, not -3
    assert m.snapshot()["num_preemptions"] == 7.0


def test_prometheus_text_over_http_uses_own_registry():
    a, b = Metrics(), Metrics()  # two instances in one process: no duplicate-name clash
    a.observe_result(result("length", 0.2, [0.05], prompt=7, out=2, cached=0))
    port = a.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        a.close()
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    assert fams["pipeline_generation_tokens"].samples[0].value == 2.0
    assert fams["pipeline_time_to_first_token_seconds"].type == "histogram"
    assert "python_gc_objects_collected" not in body  # not the global registry
    assert b.snapshot()["generation_tokens"] == 0.0
