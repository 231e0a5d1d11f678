"""Gateway: serving metrics, for ``stats()`` (``snapshot()``) and Prometheus (``--metrics-port``).

State: one prometheus_client ``CollectorRegistry`` of our own (never the global one, so
several instances can live in one process, e.g. in tests) holding counters, gauges and
histograms; ``snapshot()`` reads them back, so there is one source of truth. The gateway
feeds it: ``observe_result`` for every final answer, ``reject`` for a generate refused
without one, and the daemon's counters (received, malformed, dropped clients). The engine
state (running, waiting, KV blocks, prefix cache, preemptions) and the in-flight count are
pulled from their sources at every collection (a scrape or ``snapshot()``), so they are as
fresh as the engine's last stats snapshot (it publishes a few per second); cumulative engine
counters are turned into increments.
All methods are thread-safe (prometheus_client's metrics are; the engine refresh holds a lock).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from pipeline.messages import EngineStats, RequestResult

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0)
# Error codes of requests refused before they ran (the rest of the errors are failures).
REJECTION_CODES = ("invalid_request", "unsupported_version", "duplicate_id", "draining", "unavailable")


class _OnCollect:
    """Registered first in the registry, so ``refresh`` runs before any metric is read."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        self.refresh = refresh

    def describe(self) -> list:
        return []  # no metrics of its own (and no collect() at registration)

    def collect(self) -> list:
        self.refresh()
        return []


class Metrics:
    def __init__(self, prefix: str = "pipeline", *, engine_state: Callable[[], EngineStats] | None = None,
                 inflight: Callable[[], int] | None = None) -> None:
        """``engine_state``: the engine's latest stats snapshot; ``inflight``: requests accepted
        and not yet answered. Both are read at every collection."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._engine_state = engine_state
        self._lock = threading.Lock()  # one engine refresh at a time (concurrent scrapes)
        r.register(_OnCollect(self._refresh))
        n = f"{prefix}_"
        self.requests_running = Gauge(n + "num_requests_running", "Requests in the running batch", registry=r)
        self.requests_waiting = Gauge(n + "num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_blocks_used = Gauge(n + "kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.kv_blocks_cached = Gauge(n + "kv_blocks_cached", "Free KV blocks still holding a cached prefix",
                                      registry=r)
        self.kv_blocks_total = Gauge(n + "kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.prefix_cache_hit_rate = Gauge(n + "prefix_cache_hit_rate",
                                           "Prefix cache hits / queries (tokens), since start",
                                           registry=r)
        self.prefix_cache_queries = Counter(n + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter(n + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.preemptions = Counter(n + "num_preemptions", "Requests preempted (recompute)", registry=r)
        # Cached prompt tokens by where they came from (pool: the prefix cache; disk: the KV
        # tier's files, --kv-offload-dir), and the tier's traffic.
        self.cached_by_source = Counter(n + "kv_cached_tokens", "Prompt tokens not computed, by source "
                                        "(pool: prefix cache, disk: KV tier)", ["source"], registry=r)
        self.tier_counters = {
            field: Counter(n + name, doc, registry=r) for field, name, doc in (
                ("kv_tier_load_bytes", "kv_tier_load_bytes", "Bytes loaded from the KV tier"),
                ("kv_tier_load_seconds", "kv_tier_load_seconds", "Time the cache messager spent loading"),
                ("kv_tier_save_bytes", "kv_tier_save_bytes", "Bytes written to the KV tier"),
                ("kv_tier_save_seconds", "kv_tier_save_seconds", "Time the cache messager spent saving"),
                ("kv_tier_load_waits", "kv_tier_load_waits", "Requests that waited for a KV tier load"),
                ("kv_tier_load_wait_seconds", "kv_tier_load_wait_seconds",
                 "Time requests waited for KV tier loads, in all"),
                ("kv_tier_failed_blocks", "kv_tier_failed_blocks",
                 "KV tier blocks that failed their load (corrupt, gone): computed again"))}
        self.tier_hit_rate = Gauge(n + "kv_tier_hit_rate", "KV tier hits / prompt tokens looked up, "
                                   "since start", registry=r)
        # Speculative decoding (--speculative-config), vLLM's names.
        self.spec_counters = {
            field: Counter(n + name, doc, registry=r) for field, name, doc in (
                ("spec_num_drafts", "spec_decode_num_drafts", "Verify steps that carried drafts"),
                ("spec_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified"),
                ("spec_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted"))}
        self.spec_per_pos = Counter(n + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft", ["position"], registry=r)
        self.prompt_tokens = Counter(n + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(n + "generation_tokens", "Generated tokens of finished requests", registry=r)
        self.cached_tokens = Counter(n + "cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.requests_finished = Counter(n + "requests_finished", "Finished requests by finish reason",
                                         ["finish_reason"], registry=r)
        self.ttft = Histogram(n + "time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(n + "inter_token_latency_seconds", "Gap between output tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(n + "e2e_request_latency_seconds", "Arrival to final answer",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(n + "request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.requests_received = Counter(n + "requests_received", "Generate requests received over ZMQ",
                                         registry=r)
        self.requests_rejected = Counter(n + "requests_rejected", "Requests refused before they ran, by "
                                         "error code (invalid_request: failed validation)", ["code"],
                                         registry=r)
        self.malformed_frames = Counter(n + "malformed_frames", "Client frames that could not be decoded "
                                        "(each one answered with an error)", registry=r)
        self.clients_dropped = Counter(n + "clients_dropped", "Clients gone (bye or connection lost) with "
                                       "requests in flight, which were aborted", registry=r)
        self.requests_inflight = Gauge(n + "requests_inflight", "Requests accepted and not yet answered",
                                       registry=r)
        if inflight is not None:
            self.requests_inflight.set_function(inflight)
        for reason in ("stop", "length", "abort", "error"):
            self.requests_finished.labels(reason)  # export zeros from the start
        for code in REJECTION_CODES:
            self.requests_rejected.labels(code)
        self._last: dict[str, float] = {}
        self._last_snapshot = 0.0  # timestamp of the engine snapshot last applied
        self._prefix = n
        self._server: Any = None

    def observe_result(self, res: RequestResult) -> None:
        """Account one final answer (call exactly once per request)."""
        self.requests_finished.labels(res.finish_reason).inc()
        if res.finish_reason == "error" and res.error is not None and res.error.code in REJECTION_CODES:
            self.requests_rejected.labels(res.error.code).inc()
        u, t = res.usage, res.timings
        self.prompt_tokens.inc(u.prompt_tokens)
        self.generation_tokens.inc(u.completion_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        if t.ttft is not None:
            self.ttft.observe(t.ttft)
        if t.queue_time is not None:
            self.queue_time.observe(t.queue_time)
        if t.e2e is not None:
            self.e2e.observe(t.e2e)
        for gap in t.itl:
            self.itl.observe(gap)

    def reject(self, code: str) -> None:
        """A generate refused without a final answer of its own (``duplicate_id``)."""
        self.requests_rejected.labels(code).inc()

    def _refresh(self) -> None:
        if self._engine_state is None:
            return
        with self._lock:
            e = self._engine_state()
            if e.timestamp and e.timestamp != self._last_snapshot:  # published, and not applied yet
                self._last_snapshot = e.timestamp
                self.set_engine_state(e)

    def set_engine_state(self, e: EngineStats) -> None:
        """The engine's current state; its prefix-cache and preemption counts are cumulative
        since the engine started."""
        self.requests_running.set(e.running)
        self.requests_waiting.set(e.waiting)
        self.kv_blocks_used.set(e.kv_blocks_used)
        self.kv_blocks_cached.set(e.kv_blocks_cached)
        self.kv_blocks_total.set(e.kv_blocks_total)
        counts: list[tuple[str, Any, float]] = [
            ("queries", self.prefix_cache_queries, e.prefix_cache_queried_tokens),
            ("hits", self.prefix_cache_hits, e.prefix_cache_hit_tokens),
            ("preemptions", self.preemptions, e.num_preemptions),
            ("pool", self.cached_by_source.labels("pool"), e.prefix_cache_hit_tokens),
            ("disk", self.cached_by_source.labels("disk"), e.kv_tier_loaded_tokens)]
        counts += [(f, c, getattr(e, f)) for f, c in self.tier_counters.items()]
        counts += [(f, c, getattr(e, f)) for f, c in self.spec_counters.items()]
        counts += [(f"spec_pos{i}", self.spec_per_pos.labels(str(i)), v)
                   for i, v in enumerate(e.spec_accepted_per_position)]
        for key, counter, value in counts:
            # A restarted engine starts from zero again: count from there.
            last = self._last.get(key, 0)
            counter.inc(value - last if value >= last else value)
            self._last[key] = value
        queried = e.prefix_cache_queried_tokens
        self.prefix_cache_hit_rate.set(e.prefix_cache_hit_tokens / queried if queried else 0.0)
        self.tier_hit_rate.set(e.kv_tier_loaded_tokens / queried if queried else 0.0)

    def snapshot(self) -> dict[str, Any]:
        """Plain dict (msgpack/JSON-able): name (without prefix) -> value; labelled metrics
        -> {label value: value}; histograms -> {count, sum, buckets: {le: cumulative count}}."""
        out: dict[str, Any] = {}
        for fam in self.registry.collect():
            name = fam.name.removeprefix(self._prefix)
            if fam.type == "histogram":
                h: dict[str, Any] = {"count": 0, "sum": 0.0, "buckets": {}}
                for s in fam.samples:
                    if s.name.endswith("_bucket"):
                        h["buckets"][s.labels["le"]] = int(s.value)
                    elif s.name.endswith("_count"):
                        h["count"] = int(s.value)
                    elif s.name.endswith("_sum"):
                        h["sum"] = s.value
                out[name] = h
                continue
            values = [s for s in fam.samples if not s.name.endswith("_created")]
            if any(s.labels for s in values):
                out[name] = {next(iter(s.labels.values())): s.value for s in values}
            elif values:
                out[name] = values[0].value
        return out

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP on a daemon thread; returns the bound port (port 0: any)."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
