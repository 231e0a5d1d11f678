"""The "Processed prompts" progress bar of ``LLM.generate`` (vLLM shows the same with tqdm).

Owns its counters and the terminal line it redraws; no dependency beyond the standard library.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class ProgressBar:
    """vLLM's "Processed prompts" bar on stderr: finished/total, elapsed and remaining time,
    requests/s and prompt / output tokens per second. Shown when ``use_tqdm`` is True, or when
    it is None and stderr is a terminal; redrawn at most ten times a second. A callable
    ``use_tqdm`` (vLLM's: a ``tqdm`` class or a partial of one) makes the bar instead, called
    as vLLM calls it; this one then draws nothing."""

    def __init__(self, total: int, use_tqdm: bool | None | Callable[..., Any]) -> None:
        self.bar: Any = None
        if callable(use_tqdm):
            self.bar = use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
            use_tqdm = False
        if use_tqdm is not None and not isinstance(use_tqdm, bool):
            raise TypeError(f"use_tqdm must be True, False, None or a tqdm-like callable, got "
                            f"{type(use_tqdm).__name__}")
        self.out: TextIO = sys.stderr
        self.on = total > 0 and (self.out.isatty() if use_tqdm is None else use_tqdm)
        self.total, self.done, self.tokens_in, self.tokens_out = total, 0, 0, 0
        self.start = self.drawn = time.monotonic()
        if self.on:
            self._draw()

    def update(self, prompt_tokens: int, output_tokens: int) -> None:
        self.done += 1
        self.tokens_in += prompt_tokens
        self.tokens_out += output_tokens
        if self.bar is not None:
            self.bar.update(1)
        if self.on and (self.done == self.total or time.monotonic() - self.drawn >= 0.1):
            self._draw()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.on:
            self.out.write("\n")
            self.out.flush()
            self.on = False

    def _draw(self) -> None:
        self.drawn = now = time.monotonic()
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        filled = 20 * self.done // self.total
        self.out.write(f"\rProcessed prompts: {100 * self.done // self.total:3d}%|{'#' * filled}{' ' * (20 - filled)}| "
                       f"{self.done}/{self.total} [{_clock(elapsed)}<{eta}, {rate:.2f} it/s, "
                       f"in: {self.tokens_in / max(elapsed, 1e-9):.0f} tok/s, "
                       f"out: {self.tokens_out / max(elapsed, 1e-9):.0f} tok/s]")
        self.out.flush()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m:02d}:{s:02d}"
