"""Async scheduling (engine.inflight) with the deterministic FakeWorker: the engine schedules
step N+1 before step N's result is processed, running requests ahead on the tokens their
steps in flight sample, as the engine stage does in the mixed role.

The FakeWorker keeps its own copy of each request and appends its own sampled tokens, as the
real worker does, and simulates the paged KV cache (``check_kv=True``): a slot written for
the wrong sequence, or a block reused while a step in flight still writes it, fails inside
it. Async outputs must equal the synchronous engine's token for token (preemption forced by
small pools, EOS, stop tokens, max_tokens, stop-string aborts, n > 1, prompt logprobs), and a
token computed ahead of a request's end must never come out, be counted or be hashed.
"""
from __future__ import annotations

import time
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_workload import expected

from pipeline.config import EngineConfig
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.kv_cache_manager import KVCacheManager
from pipeline.engine.request import Request
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput, ids_to_bytes
from pipeline.messages.engine_outputs import child_id
from pipeline.sampling_params import SamplingParams

EOS = 0
VOCAB = 24
MAX_LEN = 64
KEY = b"async"


class Driver:
    """Scheduler + FakeWorker stepped like EngineLoop: "sync" (schedule, run, update) or
    "async" (at most two steps out; the oldest result is processed once two are out, or when
    nothing new could be sent). ``stop_after``: request id -> abort it as a stop string once
    it has that many tokens (the token processor's stop-string abort of one completion,
    driven by what came out)."""

    def __init__(self, mode: str, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                 budget: int = 32, threshold: int = 0, caching: bool = True) -> None:
        cfg = EngineConfig.of(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=threshold, enable_prefix_caching=caching)
        self.mode = mode
        self.sched = Scheduler(cfg, num_blocks, block_size, MAX_LEN, hash_key=KEY,
                               async_scheduling=mode == "async")
        self.worker = FakeWorker(num_blocks, block_size, MAX_LEN, VOCAB, [EOS], check_kv=True)
        self.pending: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], str] = {}
        self.prompt_lps: dict[tuple[str, int], list[float]] = {}
        self.stop_after: dict[str, int] = {}
        self.n: dict[str, int] = {}
        self.ran_ahead = 0  # requests scheduled while in flight
        self.steps = 0

    def add(self, rid: str, prompt: list[int], **sp) -> None:
        sp.setdefault("max_tokens", 8)
        params = SamplingParams(**sp)
        self.sched.add_request(EngineRequest(rid, ids_to_bytes(prompt), params, time.time(), [EOS]))
        self.n[rid] = params.n
        for k in range(params.n):
            self.tokens[(rid, k)] = []

    def record(self, outs: list[EngineOutput]) -> None:
        for o in outs:
            key = (o.req_id, o.index)
            assert key not in self.finish, f"{key}: output after its end"
            self.tokens[key] += o.new_token_ids
            if o.prompt_logprobs:
                self.prompt_lps.setdefault(key, []).extend(lp.logprob for lp in o.prompt_logprobs)
            if o.finish_reason is not None:
                self.finish[key] = o.finish_reason
        for (rid, k), toks in self.tokens.items():
            if (rid, k) not in self.finish and len(toks) >= self.stop_after.get(rid, 1 << 30):
                self.record(self.sched.abort_requests([child_id(rid, k, self.n[rid])], reason="stop"))

    def step(self) -> None:
        s = self.sched
        if self.mode == "sync":
            so = s.schedule()
            self.record(s.update_from_output(so, self.worker.execute(so)))
        else:
            sent = False
            if len(self.pending) < 2 and s.has_unfinished_requests():
                out_of_date = {rid for so, _ in self.pending for rid in so.num_scheduled_tokens}
                so = s.schedule()
                self.ran_ahead += len(out_of_date & so.num_scheduled_tokens.keys())
                if so.num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                    # The worker runs steps in the order they are sent: running it now is
                    # the same as running it once the step before is done.
                    self.pending.append((so, self.worker.execute(so)))
                    sent = True
            if self.pending and (len(self.pending) == 2 or not sent):
                self.record(s.update_from_output(*self.pending.popleft()))
        assert s.check_invariants() == []
        self.steps += 1

    def run(self, max_steps: int = 3000) -> None:
        while self.sched.has_unfinished_requests() or self.pending:
            self.step()
            assert self.steps < max_steps, "engine did not converge"
        st_ = self.sched.stats()
        assert st_.running == st_.waiting == st_.kv_blocks_used == 0
        # Nothing computed ahead was counted.
        assert st_.generation_tokens == sum(map(len, self.tokens.values()))


def reference(worker: FakeWorker, prompt: list[int], sp: SamplingParams) -> tuple[list[int], str]:
    return expected(worker, prompt, sp, MAX_LEN)


def test_decode_runs_ahead_of_its_result():
    d = Driver("async")
    s, w = d.sched, d.worker
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4
    d.add("a", prompt, max_tokens=6, ignore_eos=True)
    so1 = s.schedule()
    r1 = w.execute(so1)
    so2 = s.schedule()  # step 1's result not processed yet
    # "a" decodes the token step 1 samples (the worker appended it itself): the engine says
    # where the worker's own count is, and gave it the slot for position 8 (a third block).
    assert so2.num_scheduled_tokens == {"a": 1}
    [c] = so2.cached_reqs
    assert c.num_computed_tokens == 8 and len(c.new_block_ids) == 1
    a = s.requests["a"]
    assert a.inflight_steps == [1, 2] and a.num_placeholders == 2 and len(a.all_token_ids) == 8
    r2 = w.execute(so2)
    d.record(s.update_from_output(so1, r1))
    d.record(s.update_from_output(so2, r2))
    assert d.tokens[("a", 0)] == r1.sampled_token_ids + r2.sampled_token_ids
    assert a.num_computed_tokens == 9 and a.inflight_steps == [] and a.num_placeholders == 0
    d.run()
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    assert d.tokens[("a", 0)] == reference(w, prompt, sp)[0]


def _prompt_ending_in_eos(worker: FakeWorker, block_size: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output hits EOS with prompt + output filling whole blocks, so
    the step run ahead computes the EOS token's slot, the last of a block."""
    for seed in range(1, 5000):
        prompt = [1 + (seed * 7 + i * 3) % (VOCAB - 1) for i in range(5)]
        out = reference(worker, prompt, SamplingParams(max_tokens=30))
        if out[1] == "stop" and 2 <= len(out[0]) and (len(prompt) + len(out[0])) % block_size == 0:
            return prompt, out[0]
    raise AssertionError("no such prompt")


def test_token_computed_ahead_of_eos_is_dropped_and_never_hashed():
    d = Driver("async", block_size=4)
    prompt, want = _prompt_ending_in_eos(d.worker, 4)
    d.add("e", prompt, max_tokens=30)
    d.run()
    assert d.tokens[("e", 0)] == want and d.finish[("e", 0)] == "stop"
    # The worker did compute one token past EOS (never streamed, never counted).
    assert d.sched.stats().stale_results_dropped == 1
    assert d.worker.num_steps == len(want) + 1
    # Cached: the full blocks of computed real tokens, and nothing else (the EOS token's KV,
    # computed ahead, is in no cached block: its step's result was stale).
    real = Request("x", prompt + want, SamplingParams())
    kv = KVCacheManager(8, 4, True, KEY)
    kv.hash_new_blocks(real)
    n_computed = len(prompt) + len(want) - 1
    assert set(d.sched.kv.pool.cached) == set(real.block_hashes[:n_computed // 4])


def test_a_token_that_ends_by_length_is_not_run_ahead():
    d = Driver("async", block_size=4)
    d.add("a", [1, 2, 3], max_tokens=2, ignore_eos=True)  # 4 KV slots at most: one block
    while d.sched.has_unfinished_requests() or d.pending:
        d.step()
        req = d.sched.requests.get("a")
        assert req is None or len(req.blocks) == 1
    assert len(d.tokens[("a", 0)]) == 2 and d.sched.stats().stale_results_dropped == 0
    assert d.worker.num_steps == 2 and d.ran_ahead == 1


def test_abort_with_two_steps_in_flight():
    d = Driver("async")
    s, w = d.sched, d.worker
    d.add("a", [1, 2, 3, 4], max_tokens=20, ignore_eos=True)
    so1 = s.schedule()
    r1 = w.execute(so1)
    so2 = s.schedule()
    r2 = w.execute(so2)
    d.record(s.update_from_output(so1, r1))
    so3 = s.schedule()
    r3 = w.execute(so3)
    assert s.requests["a"].inflight_steps == [2, 3] and len(w.seqs["a"].tokens) == 4 + 3
    [o] = s.abort_requests(["a"])
    assert o.finish_reason == "abort" and o.new_token_ids == []
    assert s.stats().kv_blocks_used == 0 and s.check_invariants() == []
    # Both results are stale: nothing comes out, nothing is cached past the one token back.
    assert s.update_from_output(so2, r2) == [] and s.update_from_output(so3, r3) == []
    assert s.stats().stale_results_dropped == 2 and s.stats().generation_tokens == 1
    assert len(s.kv.pool.cached) == 1  # the prompt's block, computed in step 1
    so4 = s.schedule()
    assert so4.finished_req_ids == ["a"] and not so4.num_scheduled_tokens
    w.execute(so4)
    assert w.seqs == {}


def test_preempted_while_running_ahead_gives_the_reference_outputs():
    d = Driver("async", num_blocks=10, block_size=4, budget=16)
    prompts = {f"r{i}": [1 + i, 2, 3, 4, 5 + i][: 3 + i % 3] for i in range(5)}
    sp = SamplingParams(max_tokens=18, ignore_eos=True)
    for rid, p in prompts.items():
        d.add(rid, p, max_tokens=18, ignore_eos=True)
    d.run()
    stats = d.sched.stats()
    assert stats.num_preemptions > 0 and stats.stale_results_dropped > 0 and d.ran_ahead > 0
    for rid, p in prompts.items():
        assert d.tokens[(rid, 0)] == reference(d.worker, p, sp)[0]


@st.composite
def request_specs(draw):
    prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=14))
    max_tokens = draw(st.integers(1, 16))
    return {
        "prompt": prompt,
        "sp": dict(max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
                   ignore_eos=draw(st.booleans()),
                   stop_token_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=2)),
                   n=draw(st.sampled_from([1, 1, 1, 2])),
                   prompt_logprobs=draw(st.sampled_from([None, None, 0]))),
        "arrive": draw(st.integers(0, 8)),
        "stop_after": draw(st.none() | st.integers(1, 10)),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_specs(), min_size=1, max_size=8), num_blocks=st.integers(8, 24),
       block_size=st.sampled_from([2, 4]), max_num_seqs=st.integers(1, 6),
       budget=st.integers(4, 24), threshold=st.sampled_from([0, 3]), caching=st.booleans())
def test_async_equals_sync_token_for_token(specs, num_blocks, block_size, max_num_seqs, budget,
                                           threshold, caching):
    runs = {}
    for mode in ("sync", "async"):
        d = Driver(mode, num_blocks, block_size, max_num_seqs, budget, threshold, caching)
        accepted = []
        step = 0
        while True:
            for i, spec in enumerate(specs):
                if spec["arrive"] == step:
                    need = -(-(len(spec["prompt"]) + spec["sp"]["max_tokens"] - 1) // block_size)
                    if need > num_blocks:
                        continue  # refused at add_request (test_scheduler_workload checks that)
                    d.add(f"r{i}", spec["prompt"], **spec["sp"])
                    if spec["stop_after"] is not None:
                        d.stop_after[f"r{i}"] = spec["stop_after"]
                    accepted.append(i)
            if step > 8 and not (d.sched.has_unfinished_requests() or d.pending):
                break
            if d.sched.has_unfinished_requests() or d.pending:
                d.step()
            step += 1
            assert step < 3000, "engine hung"
        d.run()
        runs[mode] = d
        for i in accepted:
            spec = specs[i]
            want, reason = reference(d.worker, spec["prompt"], SamplingParams(**spec["sp"]))
            k = spec["stop_after"]
            if k is not None and k < len(want):
                want, reason = want[:k], "stop"
            for c in range(spec["sp"]["n"]):
                assert d.tokens[(f"r{i}", c)] == want and d.finish[(f"r{i}", c)] == reason
    sync, asyn = runs["sync"], runs["async"]
    assert asyn.tokens == sync.tokens and asyn.finish == sync.finish
    assert asyn.prompt_lps == sync.prompt_lps
