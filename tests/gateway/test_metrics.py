"""Metrics: results and engine state land in counters/gauges/histograms; snapshot() and the
Prometheus text (served over HTTP from our own registry) agree; the engine state and the
in-flight count are read from their sources at every scrape; refusals are counted by code."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pipeline.gateway.metrics import Metrics
from pipeline.messages import EngineStats, RequestResult, Timings, Usage, error_result


def result(reason: str, ttft: float | None, itl: list[float], prompt: int, out: int, cached: int) -> RequestResult:
    return RequestResult(id="x", text="", token_ids=[0] * out, finish_reason=reason,
                         usage=Usage(prompt, out, cached),
                         timings=Timings(arrival_time=1.0, ttft=ttft, queue_time=0.001, e2e=1.5, itl=itl))


def test_snapshot_counts_results_and_engine_state():
    m = Metrics()
    m.observe_result(result("stop", 0.05, [0.01, 0.02], prompt=10, out=3, cached=4))
    m.observe_result(result("abort", None, [], prompt=5, out=0, cached=0))
    m.set_engine_state(EngineStats(running=2, waiting=3, kv_blocks_used=40, kv_blocks_cached=7,
                                   kv_blocks_total=100, prefix_cache_queried_tokens=100,
                                   prefix_cache_hit_tokens=25, num_preemptions=1))
    m.set_engine_state(EngineStats(running=1, waiting=0, kv_blocks_used=10, kv_blocks_cached=30,
                                   kv_blocks_total=100, prefix_cache_queried_tokens=200,
                                   prefix_cache_hit_tokens=100, num_preemptions=3))
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


def test_speculative_decoding_counters_follow_the_engine():
    m = Metrics()
    m.set_engine_state(EngineStats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=7,
                                   spec_accepted_per_position=[4, 2, 1]))
    m.set_engine_state(EngineStats(spec_num_drafts=6, spec_num_draft_tokens=18, spec_num_accepted_tokens=9,
                                   spec_accepted_per_position=[5, 3, 1]))
    s = m.snapshot()
    assert (s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"],
            s["spec_decode_num_accepted_tokens"]) == (6.0, 18.0, 9.0)
    assert s["spec_decode_num_accepted_tokens_per_pos"] == {"0": 5.0, "1": 3.0, "2": 1.0}


def test_engine_restart_counts_from_zero():
    m = Metrics()
    m.set_engine_state(EngineStats(num_preemptions=5))
    m.set_engine_state(EngineStats(num_preemptions=2))  # a new engine: 2 more, not -3
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


def scrape(port: int) -> dict[tuple[str, str], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, next(iter(s.labels.values()), "")): s.value
            for f in text_string_to_metric_families(body) for s in f.samples}


def test_engine_state_and_inflight_are_read_at_every_scrape():
    """Before: the daemon copied the engine's snapshot into the gauges once a second, so a
    scrape could show a state up to a second older than the engine's latest snapshot."""
    latest = [EngineStats()]  # not published yet: timestamp 0
    inflight = [0]
    m = Metrics(engine_state=lambda: latest[0], inflight=lambda: inflight[0])
    port = m.serve(0)
    try:
        assert scrape(port)[("pipeline_num_requests_running", "")] == 0
        for i in range(1, 4):
            latest[0] = EngineStats(running=i, waiting=2 * i, kv_blocks_used=3 * i, kv_blocks_total=64,
                                    num_preemptions=i, timestamp=float(i))
            inflight[0] = 5 * i
            got = scrape(port)
            assert got[("pipeline_num_requests_running", "")] == i
            assert got[("pipeline_num_requests_waiting", "")] == 2 * i
            assert got[("pipeline_kv_blocks_used", "")] == 3 * i
            assert got[("pipeline_requests_inflight", "")] == 5 * i
            assert got[("pipeline_num_preemptions_total", "")] == i  # counted once per snapshot
        assert m.snapshot()["num_preemptions"] == 3  # a second read of one snapshot adds nothing
    finally:
        m.close()


def test_refusals_counted_by_code():
    m = Metrics()
    m.observe_result(error_result("a", "invalid_request", "field `temperature`: ..."))  # tokenizer
    m.observe_result(error_result("b", "invalid_request", "field `prompt`: too large"))  # gateway
    m.observe_result(error_result("c", "stage_died", "stage worker0 died"))  # a failure, not a refusal
    m.observe_result(error_result("d", "draining", "the server is draining"))
    m.reject("duplicate_id")  # refused with an error of its own, no final
    m.malformed_frames.inc()
    m.clients_dropped.inc()
    s = m.snapshot()
    assert s["requests_rejected"] == {"invalid_request": 2.0, "unsupported_version": 0.0,
                                      "duplicate_id": 1.0, "draining": 1.0, "unavailable": 0.0}
    assert s["requests_finished"]["error"] == 4.0
    assert (s["malformed_frames"], s["clients_dropped"], s["requests_inflight"]) == (1.0, 1.0, 0.0)
