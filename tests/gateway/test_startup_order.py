"""Start-up order (issue 12): the gateway starts every stage at once, and the engine and the
tokenizer get the worker's ModelInfo over their control pipes when worker0 reports ready; the
CPU KV cache is reserved up front but mapped page by page at first touch.

Real stage processes (the in-process Gateway and `pipeline run`) on a tiny checkpoint. The
order is asserted by what the gateway itself sees when worker0 reports (every other stage
process already running, the engine and the tokenizer not ready), not by timing.
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
import uuid

import pytest
import torch
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, make_tiny_model, shm_entries

from pipeline.config import EngineConfig
from pipeline.gateway.gateway import Gateway
from pipeline.messages import GatewayRequest, RequestResult
from pipeline.runtime.lifecycle import Stage, StartupError
from pipeline.sampling_params import SamplingParams
from pipeline.worker.kv_cache import KVCache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


def config(model, **kw) -> EngineConfig:
    fields = dict(model=str(model), device="cpu", dtype="float32", max_num_seqs=32,
                  max_model_len=256, num_blocks=256, instance_id=f"t{uuid.uuid4().hex[:8]}")
    return EngineConfig.of(**(fields | kw))


def _maps_torch(pid: int | None) -> bool:
    """Whether process ``pid`` has torch's library mapped (has imported torch)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch_cpu" in line for line in f)


class WatchedGateway(Gateway):
    """The real Gateway, noting, as each stage reports ready (in order), which stage
    processes were running."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw, log=lambda m: None)
        self.reports: list[tuple[str, dict[str, bool]]] = []

    def _on_ready(self, stage: Stage) -> None:
        self.reports.append((stage.spec.name, {s.spec.name: s.process.is_alive()
                                               for s in self.stages}))
        super()._on_ready(stage)


def test_every_stage_runs_before_the_worker_is_ready_and_gets_its_model_info(model):
    done = threading.Event()
    answers: list = []

    def on_output(out) -> None:
        answers.append(out)
        if isinstance(out, RequestResult):
            done.set()

    cfg = config(model)
    gw = WatchedGateway(cfg, on_output)
    try:
        info = gw.start(timeout_s=120)
        names = [name for name, _ in gw.reports]
        assert sorted(names) == ["engine", "output", "tokenizer", "worker0"]
        # Every other stage process was already running when worker0 reported ready; the
        # engine and the tokenizer report only after it: they wait for its ModelInfo.
        at_worker = dict(gw.reports)["worker0"]
        assert at_worker == {"worker0": True, "engine": True, "tokenizer": True, "output": True}
        assert names.index("engine") > names.index("worker0") < names.index("tokenizer")
        # ... and were built from it: the engine's block table is the worker's KV cache.
        assert info.kv.num_blocks == 256 and info.max_model_len == 256
        # Only the worker imports torch (the others start beside it on the same cores).
        assert {s.spec.name: _maps_torch(s.process.pid) for s in gw.stages} == {
            "worker0": True, "engine": False, "tokenizer": False, "output": False}
        # ... and, woken, do not preempt it (SCHED_BATCH); the worker keeps the default policy.
        assert {s.spec.name: os.sched_getscheduler(s.process.pid) for s in gw.stages} == {
            "worker0": os.SCHED_OTHER, "engine": os.SCHED_BATCH, "tokenizer": os.SCHED_BATCH,
            "output": os.SCHED_BATCH}
        assert gw.submit(GatewayRequest(req_id="r0", prompt="hello there",
                                        sampling_params=SamplingParams(max_tokens=3, ignore_eos=True)))
        assert done.wait(60), answers
        final = answers[-1]
        assert final.error is None and final.finish_reason == "length", final
        assert final.usage.completion_tokens == 3
        assert shm_entries(cfg.instance_id)  # the instance's rings and KV cache exist
    finally:
        gw.close()
    assert all(s.process.exitcode is not None for s in gw.stages)
    assert shm_entries(cfg.instance_id) == []


def test_worker_failing_at_start_up_is_named_and_the_started_stages_are_stopped(model):
    cfg = config(model, num_blocks=1)  # cannot hold one sequence of max_model_len 256
    gw = WatchedGateway(cfg, lambda out: None)
    with pytest.raises(StartupError, match=r"^worker0 failed to start: ValueError: KV cache of 1 "
                                           r"blocks x 16 tokens cannot hold one sequence"):
        gw.start(timeout_s=120)
    # The other stages had been started with the worker; start() stopped them all.
    assert sorted(s.spec.name for s in gw.stages) == ["engine", "output", "tokenizer", "worker0"]
    assert all(s.process.exitcode is not None for s in gw.stages)
    assert gw.reports == [] or [name for name, _ in gw.reports] == ["output"]
    assert shm_entries(cfg.instance_id) == []


def test_pipe_mode_names_the_worker_that_failed_at_start_up(model):
    p = subprocess.Popen([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS, "--num-blocks", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env())
    try:
        out, err = p.communicate("hello\n", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = [line for line in err.splitlines() if line.startswith("pipeline run:")]
    assert p.returncode == 2 and out == "", err
    assert len(lines) == 1 and re.match(r"pipeline run: cannot start: worker0 failed to start: "
                                        r"ValueError: KV cache of 1 blocks", lines[0]), err
    assert shm_entries(f"{p.pid:x}") == []  # the instance is named after the gateway's pid


def _rss_shmem() -> int:
    """Bytes of shared memory mapped into this process (RssShmem of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_cpu_kv_cache_is_reserved_up_front_but_mapped_at_first_touch():
    size = 128 << 20
    rss = _rss_shmem()
    kv = KVCache(num_layers=2, num_blocks=size // (2 * 2 * 16 * 2 * 64 * 4), block_size=16,
                 num_kv_heads=2, head_dim=64, dtype=torch.float32, device=torch.device("cpu"),
                 instance_id=f"t{uuid.uuid4().hex[:8]}")
    try:
        assert kv.layout.total_bytes == size
        # Reserved: the segment's pages are allocated in /dev/shm (a full /dev/shm fails here,
        # not later as SIGBUS) ...
        assert kv.shm_name is not None
        assert os.stat(f"/dev/shm/{kv.shm_name[1:]}").st_blocks * 512 >= size
        # ... but not mapped yet: no page-table work at start-up.
        assert _rss_shmem() - rss < 8 << 20
        kv.k_caches[0][:8].fill_(1.0)  # the first blocks a request writes
        assert 0 < _rss_shmem() - rss < 8 << 20
        kv.buffer.fill_(2.0)  # every page
        assert _rss_shmem() - rss >= size - (4 << 20)
        assert float(kv.v_caches[1].sum()) == 2.0 * kv.v_caches[1].numel()
    finally:
        kv.close()
    assert kv.shm_name is not None and not os.path.exists(f"/dev/shm/{kv.shm_name[1:]}")
