"""Worker stage: the CPU worker's OpenMP team size, adapted to the cores actually free.

With ``--worker-threads 0`` (the default) the worker starts with one thread per usable core
and keeps the team whose steps run fastest on this machine as it is now. A spinning OpenMP
team is the fastest while every core is free, but when another process (or another stage)
takes a core, one team member waits to be scheduled at every barrier and the step slows
down several times (a batch-32 step on two shared cores went 5x slower than one thread);
passive waiting survives that but costs a quarter to a third of the quiet speed. So
``ThreadGovernor`` keeps libgomp's spinning and watches each step instead:

- windows: ``WINDOW`` steps, or fewer (at least ``MIN_WINDOW``) once they add up to
  ``WINDOW_S``, so slow steps (a big model, a taken core) are judged in a fraction of a second;
- down, at once: over ``STARVED_WINDOWS`` windows of steps in a row (or one that spans
  ``LONG_WINDOW_S``), the process's CPU time
  per wall second per team member (``getrusage``) falls below ``STARVED``: members are
  waiting for a core, so the team shrinks by one;
- probe: every ``probe_s`` (doubling after each probe that lost, up to ``MAX_PROBE_S``) the
  team tries one thread more (only when no more tasks are runnable on the machine than its
  own, ``runnable_tasks``: else no core is free, and it looks again in ``MIN_PROBE_S``), or
  one fewer when at the top (then at most every
  ``MAX_PROBE_S``: a probe down from a full team on a quiet machine only costs, 8 steps at
  ~2/3 the speed, and short runs paid it several times: bench threads had the default at
  0.87-0.90 of 2 threads at batch 32 and prefill), for a window, and keeps the size
  whose median step time per scheduled token was lower (by ``GAIN``); otherwise it goes
  back; a probe whose first steps already run ``PROBE_ABORT`` x slower (its first step alone
  ``PROBE_ABORT_NOW`` x) ends there, lost.
  Only steps of similar size are compared: a probe window is measured against the
  window just before it, and not at all when the median step size moved by more than
  ``SAME_SIZE`` (batch 8 tokens cost less each than batch 1's: a probe across such a change
  would keep whichever size it happened to test second).

An explicit ``--worker-threads N`` (or ``PIPELINE_WORKER_THREADS``) fixes the team: no
governor. Owns: the team size (``torch.set_num_threads``) and the step measurements; the
module keeps the size last applied in the process.
"""
from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable

import torch

STARVED = 0.8  # CPU seconds per wall second per thread below this: members wait for cores
# (measured on 2 vCPUs: 0.88-1.02 with the cores free, 0.58-0.75 with one taken)
# Windows in a row: one starved window can be a hiccup of a shared VM; a taken core is not.
STARVED_WINDOWS = 2
GAIN = 0.97  # a probe's size is kept when its time per token is below this x the old one's
SAME_SIZE = 1.25  # a probe counts only if the median step size stayed within this factor
WINDOW = 8  # steps per measurement window, at most
# ... and a window closes earlier, after MIN_WINDOW steps, once its steps add up to WINDOW_S:
# under a taken core a 0.5B-model step of a full team took 0.15-0.25 s, so 2 windows of 8
# steps held the slow team for 3-4 s of a 6 s run (int8 decode 3.9-7.0 tok/s against 15.9
# for one fixed thread).
WINDOW_S = 0.1
MIN_WINDOW = 2
# A probe whose steps so far take this x the baseline per token ends at once, lost: a probe
# up onto a taken core runs 3-15x slower, and 8 such steps cost seconds.
PROBE_ABORT = 1.3
# ... and after its first step alone when that one runs this x slower: onto a taken core a
# 0.5B step went from 0.05 to 0.38 s, so each probe's second step cost a third of a second.
PROBE_ABORT_NOW = 2.0
# A starved window that spans this long is not a hiccup: it shrinks the team by itself (with
# a taken core the first two 2-step windows held the slow team for 1.5 s).
LONG_WINDOW_S = 0.25
MIN_PROBE_S = 1.0
MAX_PROBE_S = 32.0


# The team size last applied in this process: the OpenMP team is per process, so a governor
# re-applies its own size when another one (several runners in one bench) changed it.
_applied = [0]


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def _cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def runnable_tasks() -> int:
    """Tasks runnable on the machine right now (``/proc/loadavg``'s R of R/T), 0 if unknown."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0


class ThreadGovernor:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic,
                 runnable: Callable[[], int] = runnable_tasks) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self._set = set_threads
        self._clock = clock
        self._runnable = runnable
        self.threads = max_threads
        self._set(max_threads)
        _applied[0] = max_threads
        self.probe_s = MIN_PROBE_S
        self.next_probe = clock() + self.probe_s
        self.full_since = clock()  # since when the team has had every thread
        self._window: list[tuple[float, float, int]] = []  # (wall s, cpu s, tokens) per step
        self._baseline: float | None = None  # s/token of the window before a probe
        self._probe_from: int | None = None  # the size a probe left (None: no probe running)
        self._starved = 0  # consecutive starved windows
        self._baseline_tokens = 0.0
        self._t0 = self._c0 = 0.0
        self.changes = 0

    def begin(self) -> None:
        if _applied[0] != self.threads:  # another governor in this process (benches) moved it
            self._set(self.threads)
            _applied[0] = self.threads
        self._t0, self._c0 = time.perf_counter(), _cpu_seconds()

    def end(self, tokens: int) -> None:
        """After a step that ran ``tokens`` tokens (0: nothing ran; not measured)."""
        if tokens > 0:
            self.record(time.perf_counter() - self._t0, _cpu_seconds() - self._c0, tokens)

    def record(self, wall_s: float, cpu_s: float, tokens: int) -> bool:
        """One step's measurements: its wall time, the process's CPU time in it, its tokens.
        True when the step closed a window (and the team size may have changed)."""
        w = self._window
        w.append((wall_s, cpu_s, tokens))
        done = len(w) >= WINDOW or (len(w) >= MIN_WINDOW and sum(x[0] for x in w) >= WINDOW_S)
        if not done and self._probe_from is not None:
            assert self._baseline is not None
            done = self._per_token() > (PROBE_ABORT if len(w) >= MIN_WINDOW else PROBE_ABORT_NOW) * self._baseline
        if done:
            self._decide()
        return done

    def _per_token(self) -> float:
        return statistics.median(w / t for w, _, t in self._window)

    def _resize(self, n: int) -> None:
        if n == self.max_threads and self.threads != n:
            self.full_since = self._clock()
        self.threads = n
        self._set(n)
        _applied[0] = n
        self.changes += 1

    def _decide(self) -> None:
        wall = sum(w for w, _, _ in self._window)
        cpu = sum(c for _, c, _ in self._window)
        per_token = self._per_token()
        tokens = statistics.median(t for _, _, t in self._window)
        self._window.clear()
        now = self._clock()
        if self._probe_from is not None:  # a probe window just ended: keep it or go back
            assert self._baseline is not None
            if not 1 / SAME_SIZE <= tokens / self._baseline_tokens <= SAME_SIZE:
                # The batch changed under the probe: its time per token says nothing. Go
                # back and try again soon, without counting it either way.
                self._resize(self._probe_from)
                self._probe_from = self._baseline = None
                self.next_probe = now + MIN_PROBE_S
                return
            won = per_token < GAIN * self._baseline
            if not won:
                self._resize(self._probe_from)
            self.probe_s = MIN_PROBE_S if won else min(2 * self.probe_s, MAX_PROBE_S)
            self._probe_from = self._baseline = None
            self.next_probe = now + self.probe_s
            return
        starved = self.threads > 1 and wall > 0 and cpu / (wall * self.threads) < STARVED
        self._starved = self._starved + 1 if starved else 0
        if self._starved >= STARVED_WINDOWS or (starved and wall >= LONG_WINDOW_S):
            self._starved = 0
            self._resize(self.threads - 1)
            self.next_probe = now + self.probe_s
            return
        top = self.threads == self.max_threads
        if now >= self.next_probe and not top and self._runnable() > self.threads:
            # No free core now (more tasks runnable than our team, which this thread is
            # part of): a probe up would only queue behind them, at 3-8x the step time on a
            # 0.5B model. Look again soon, without counting it as a loss.
            self.next_probe = now + MIN_PROBE_S
            return
        if now >= self.next_probe and self.max_threads > 1 and (
                not top or now >= self.full_since + MAX_PROBE_S):
            if top:  # the next probe down from a full team comes MAX_PROBE_S after this one
                self.full_since = now
            self._probe_from, self._baseline = self.threads, per_token
            self._baseline_tokens = tokens
            self._resize(self.threads + 1 if self.threads < self.max_threads else self.threads - 1)
