"""Gateway: serving metrics, for ``stats()`` (``snapshot()``) and Prometheus (``--metrics-port``).

State: one prometheus_client ``CollectorRegistry`` of our own (never the global one, so
several instances can live in one process, e.g. in tests) holding counters, gauges and
histograms; ``snapshot()`` reads them back, so there is one source of truth. The gateway
feeds it: ``observe_result`` for every final answer, ``set_engine_state`` whenever the
engine reports its scheduler/KV state (cumulative counters are turned into increments).
All methods are thread-safe (prometheus_client's metrics are).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from pipeline.messages import RequestResult

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0)


class Metrics:
    def __init__(self, prefix: str = "pipeline") -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
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
        for reason in ("stop", "length", "abort", "error"):
            self.requests_finished.labels(reason)  # export zeros from the start
        self._last: dict[str, int] = {"queries": 0, "hits": 0, "preemptions": 0}
        self._prefix = n
        self._server: Any = None

    def observe_result(self, res: RequestResult) -> None:
        """Account one final answer (call exactly once per request)."""
        self.requests_finished.labels(res.finish_reason).inc()
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

    def set_engine_state(self, *, running: int, waiting: int, kv_blocks_used: int,
                         kv_blocks_cached: int, kv_blocks_total: int, prefix_cache_queries: int,
                         prefix_cache_hits: int, preemptions: int) -> None:
        """The engine's current state; the last three are cumulative since engine start."""
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)
        self.kv_blocks_used.set(kv_blocks_used)
        self.kv_blocks_cached.set(kv_blocks_cached)
        self.kv_blocks_total.set(kv_blocks_total)
        for key, counter, value in (("queries", self.prefix_cache_queries, prefix_cache_queries),
                                    ("hits", self.prefix_cache_hits, prefix_cache_hits),
                                    ("preemptions", self.preemptions, preemptions)):
            # A restarted engine starts from zero again: count from there.
            inc = value - self._last[key] if value >= self._last[key] else value
            counter.inc(inc)
            self._last[key] = value
        self.prefix_cache_hit_rate.set(prefix_cache_hits / prefix_cache_queries if prefix_cache_queries else 0.0)

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
