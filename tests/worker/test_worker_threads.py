"""The CPU worker's adaptive OpenMP team (worker/threads.py): the policy on fed measurements,
and for real: a team of every core shrinks when a spinning process takes a core and grows
back once it is gone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pipeline.worker import threads as T
from pipeline.worker.device import worker_threads
from pipeline.worker.threads import ThreadGovernor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(gov: ThreadGovernor, per_token_s: float, busy: float = 1.0, tokens: int = 4) -> int:
    """One window of steps at ``per_token_s`` each, the team ``busy`` of its CPU time; returns
    how many steps it took to close."""
    for n in range(1, T.WINDOW + 1):
        wall = per_token_s * tokens
        if gov.record(wall, wall * gov.threads * busy, tokens):
            return n
    raise AssertionError(f"no window closed after {T.WINDOW} steps")


def make(n: int = 4) -> tuple[ThreadGovernor, Clock, list[int]]:
    sizes: list[int] = []
    clock = Clock()
    return ThreadGovernor(n, sizes.append, clock, runnable=lambda: 0), clock, sizes


def test_starts_with_every_core_and_shrinks_at_once_when_starved():
    gov, clock, sizes = make(4)
    assert sizes == [4] and gov.threads == 4
    feed(gov, 1e-3, busy=0.9)  # fine: no change before the probe is due
    assert gov.threads == 4
    feed(gov, 5e-3, busy=0.3)  # members wait for cores: one window may be a hiccup
    assert gov.threads == 4
    feed(gov, 1e-3, busy=0.95)  # and was: the count starts again
    feed(gov, 5e-3, busy=0.3)
    assert gov.threads == 4
    feed(gov, 5e-3, busy=0.3)  # two in a row: a core is taken
    assert gov.threads == 3
    for _ in range(3 * T.STARVED_WINDOWS):
        feed(gov, 5e-3, busy=0.3)
    assert gov.threads == 1 and sizes == [4, 3, 2, 1]  # never below one


def test_probe_keeps_a_faster_size_and_backs_off_after_a_slower_one():
    gov, clock, sizes = make(2)
    for _ in range(T.STARVED_WINDOWS):
        feed(gov, 5e-3, busy=0.3)
    assert gov.threads == 1
    clock.now += T.MIN_PROBE_S
    feed(gov, 2e-3)  # at 1 thread; the probe is due: try 2
    assert gov.threads == 2
    feed(gov, 4e-3)  # 2 threads are slower: back to 1, next probe twice as late
    assert gov.threads == 1 and gov.probe_s == 2 * T.MIN_PROBE_S
    clock.now += T.MIN_PROBE_S
    feed(gov, 2e-3)
    assert gov.threads == 1  # not due yet
    clock.now += T.MIN_PROBE_S
    feed(gov, 2e-3)
    assert gov.threads == 2
    feed(gov, 1e-3)  # faster: kept, probing interval reset
    assert gov.threads == 2 and gov.probe_s == T.MIN_PROBE_S
    # At the top, the probe tries one fewer, but only MAX_PROBE_S after the team was full;
    # a loss keeps the full team.
    clock.now += T.MIN_PROBE_S
    feed(gov, 1e-3)
    assert gov.threads == 2
    clock.now += T.MAX_PROBE_S
    feed(gov, 1e-3)
    assert gov.threads == 1
    feed(gov, 1.5e-3)
    assert gov.threads == 2 and gov.probe_s == 2 * T.MIN_PROBE_S


def test_a_probe_across_a_change_of_batch_size_is_not_counted():
    gov, clock, _ = make(2)
    clock.now += T.MAX_PROBE_S
    feed(gov, 4e-3, tokens=1)  # batch 1; the probe (1 thread) starts
    assert gov.threads == 1
    feed(gov, 1e-3, tokens=32)  # batch 32 now: cheaper per token, but not because of 1 thread
    assert gov.threads == 2 and gov.probe_s == T.MIN_PROBE_S
    clock.now += T.MAX_PROBE_S
    feed(gov, 1e-3, tokens=32)
    assert gov.threads == 1  # tried again, on steps of one size
    feed(gov, 2e-3, tokens=32)
    assert gov.threads == 2 and gov.probe_s == 2 * T.MIN_PROBE_S


def test_backoff_is_capped():
    gov, clock, _ = make(2)
    for _ in range(12):
        clock.now += T.MAX_PROBE_S
        feed(gov, 1e-3)  # probe down to 1
        feed(gov, 2e-3)  # loses
    assert gov.threads == 2 and gov.probe_s == T.MAX_PROBE_S


def test_a_full_team_probes_down_only_every_max_probe_s():
    gov, clock, sizes = make(2)
    for _ in range(5):  # a quiet machine: many probe intervals, no probe down yet
        clock.now += T.MIN_PROBE_S
        feed(gov, 1e-3)
    assert sizes == [2] and clock.now < T.MAX_PROBE_S
    clock.now = T.MAX_PROBE_S
    feed(gov, 1e-3)
    assert gov.threads == 1  # now it tries
    feed(gov, 2e-3)
    assert gov.threads == 2
    clock.now += 2 * T.MIN_PROBE_S  # the next try is MAX_PROBE_S away, whatever probe_s says
    feed(gov, 1e-3)
    assert gov.threads == 2


def test_slow_steps_close_a_window_early_so_a_taken_core_shrinks_the_team_in_2_to_4_steps():
    """A 0.5B model's step on a taken core: 0.2-0.4 s. Windows of MIN_WINDOW steps once they
    span WINDOW_S, and one starved window that spans LONG_WINDOW_S is enough: the slow team
    runs 2 steps, not 16 (seconds of a short run)."""
    gov, _, sizes = make(2)
    slow = 0.05  # s per token, 4 tokens a step
    assert slow * 4 * T.MIN_WINDOW >= T.LONG_WINDOW_S
    assert feed(gov, slow, busy=0.6) == T.MIN_WINDOW
    assert sizes == [2, 1]
    # Shorter slow windows (above WINDOW_S, below LONG_WINDOW_S) take two in a row.
    gov, _, sizes = make(2)
    mid = 0.015
    assert T.WINDOW_S <= mid * 4 * T.MIN_WINDOW < T.LONG_WINDOW_S
    assert feed(gov, mid, busy=0.6) == T.MIN_WINDOW
    assert sizes == [2]
    assert feed(gov, mid, busy=0.6) == T.MIN_WINDOW
    assert sizes == [2, 1]
    # Fast steps still fill whole windows (a quiet batch-1 step of a small model: ~1 ms).
    assert feed(gov, 1e-4) == T.WINDOW


def test_a_probe_onto_a_taken_core_ends_after_its_first_steps():
    gov, clock, sizes = make(2)
    for _ in range(T.STARVED_WINDOWS):
        feed(gov, 5e-3, busy=0.3)
    assert gov.threads == 1
    clock.now += T.MIN_PROBE_S
    feed(gov, 2e-3)  # the baseline window at 1 thread; the probe (2 threads) starts
    assert gov.threads == 2
    # 3x slower per token: the probe ends after its first step, lost, backed off.
    assert 3 > T.PROBE_ABORT_NOW
    assert feed(gov, 6e-3) == 1
    assert gov.threads == 1 and gov.probe_s == 2 * T.MIN_PROBE_S
    # 1.6x slower (between PROBE_ABORT and PROBE_ABORT_NOW): after MIN_WINDOW steps.
    clock.now += 2 * T.MIN_PROBE_S
    feed(gov, 2e-3)
    assert gov.threads == 2 and T.PROBE_ABORT < 1.6 < T.PROBE_ABORT_NOW
    assert feed(gov, 2e-3 * 1.6) == T.MIN_WINDOW
    assert gov.threads == 1 and gov.probe_s == 4 * T.MIN_PROBE_S
    # A probe only a little slower (below PROBE_ABORT) runs its whole window before losing.
    clock.now += 4 * T.MIN_PROBE_S
    feed(gov, 2e-3)
    assert gov.threads == 2
    assert feed(gov, 2e-3 * (1 + T.PROBE_ABORT) / 2) == T.WINDOW
    assert gov.threads == 1 and sizes == [2, 1, 2, 1, 2, 1, 2, 1]


def test_no_probe_up_while_no_core_is_free():
    busy = [3]  # tasks runnable on the machine: our thread and two others
    sizes: list[int] = []
    clock = Clock()
    gov = ThreadGovernor(2, sizes.append, clock, runnable=lambda: busy[0])
    for _ in range(T.STARVED_WINDOWS):
        feed(gov, 5e-3, busy=0.3)
    assert gov.threads == 1
    for _ in range(3):  # due probes skipped, retried every MIN_PROBE_S, no back-off counted
        clock.now += T.MIN_PROBE_S
        feed(gov, 2e-3)
        assert gov.threads == 1 and gov.probe_s == T.MIN_PROBE_S
        assert gov.next_probe == clock.now + T.MIN_PROBE_S
    busy[0] = 1  # only our own thread: a core is free
    clock.now += T.MIN_PROBE_S
    feed(gov, 2e-3)
    assert gov.threads == 2 and sizes == [2, 1, 2]
    assert 0 <= T.runnable_tasks()


def test_explicit_threads_fix_the_team(monkeypatch):
    monkeypatch.delenv("PIPELINE_WORKER_THREADS", raising=False)
    assert worker_threads(0) == 0  # adaptive
    assert worker_threads(3) == 3
    monkeypatch.setenv("PIPELINE_WORKER_THREADS", "2")
    assert worker_threads(0) == 2
    with pytest.raises(ValueError, match="worker_threads must be >= 0"):
        worker_threads(-1)


HOG = "import os\nos.sched_setaffinity(0, {%d})\nwhile True: pass\n"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_busy_core_shrinks_the_team_and_a_free_one_grows_it_back():
    """Real OpenMP work (torch matmuls) on every core of this process's affinity; a spinning
    process pinned to one of them starves a team member until the governor drops it."""
    cores = sorted(os.sched_getaffinity(0))
    gov = ThreadGovernor(len(cores))
    a, b = torch.randn(384, 384), torch.randn(384, 2048)

    def steps(n: int) -> None:
        for _ in range(n):
            gov.begin()
            for _ in range(8):
                torch.mm(a, b)
            gov.end(8)

    try:
        steps(3 * T.WINDOW)
        quiet = gov.threads
        if quiet < len(cores):  # other work already holds a core: nothing left to show
            pytest.skip(f"the machine is busy (load {os.getloadavg()[0]:.1f}): the team "
                        f"already shrank to {quiet} of {len(cores)}")
        hog = subprocess.Popen([sys.executable, "-c", HOG % cores[-1]])
        try:
            for _ in range(40):
                steps(T.WINDOW)
                if gov.threads < quiet:
                    break
            assert gov.threads < quiet, "a starved team member went unnoticed"
        finally:
            hog.kill()
            hog.wait()
        # Once the core is free, a probe finds the bigger team faster and keeps it.
        gov.next_probe = 0.0
        for _ in range(40):
            steps(T.WINDOW)
            if gov.threads == len(cores):
                break
        assert gov.threads == len(cores)
    finally:
        torch.set_num_threads(len(cores))
