"""Token processor stage: stop strings, matched across token boundaries, never streamed.

State per request: the stop strings and the held-back tail, i.e. the longest suffix of the
text seen so far that is a proper prefix of some stop string (at most max_len - 1 chars).
That tail is not released to the client until it can no longer start a stop string, so a
stop string never reaches a client even when it arrives split over several tokens.

Each ``feed`` scans only the held tail plus the new text, so the total work is linear in
the output length (times the number of stop strings), never a rescan of the whole text.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Feed text deltas; get back what may be streamed and whether a stop string matched.

    ``include_stop_str_in_output``: on a hit the stop string is part of the output (vLLM's
    option of that name); otherwise the output ends right before it.
    """

    __slots__ = ("stops", "include", "max_len", "_last_chars", "_tail", "stopped_on")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops: tuple[str, ...] = tuple(s for s in stop if s)
        self.include = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._last_chars = tuple({s[-1] for s in self.stops})
        self._tail = ""
        self.stopped_on: str | None = None

    @property
    def held(self) -> str:
        """Text not yet released (a possible beginning of a stop string)."""
        return self._tail

    def feed(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """Return (text safe to send now, the stop string hit or None).

        ``check=False`` (fewer than ``min_tokens`` generated) releases everything and
        matches nothing. After a hit, the request is over: further feeds are an error.
        """
        if self.stopped_on is not None:
            raise RuntimeError("StopChecker fed after a stop string matched")
        if not self.stops or not check:
            out, self._tail = self._tail + delta, ""
            return out, None
        if not delta:
            return "", None
        buf = self._tail + delta
        # The held tail cannot contain a whole stop string (it would have matched), so any
        # hit ends in the new text. The hit that completes first wins (ties: the longer one),
        # which makes the result independent of how the text was split into deltas.
        hit_at, hit_end, hit = -1, -1, None
        # A hit ends in the new text, so it needs a stop string's last char there.
        for s in self.stops if any(c in delta for c in self._last_chars) else ():
            i = buf.find(s)
            if i >= 0 and (hit is None or i + len(s) < hit_end or (i + len(s) == hit_end and i < hit_at)):
                hit_at, hit_end, hit = i, i + len(s), s
        if hit is not None:
            self.stopped_on = hit
            self._tail = ""
            return buf[: hit_at + len(hit)] if self.include else buf[:hit_at], hit
        keep = self._partial_suffix(buf)
        self._tail = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """The request finished for another reason: the held tail is plain text after all."""
        out, self._tail = self._tail, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            n = min(len(s) - 1, len(buf))
            if n <= best:
                continue
            start = len(buf) - n
            # Candidate starts are occurrences of the stop's first char in the last n chars;
            # the first one that works is the longest.
            j = buf.find(s[0], start)
            while j >= 0 and len(buf) - j > best:
                if s.startswith(buf[j:]):
                    best = len(buf) - j
                    break
                j = buf.find(s[0], j + 1)
        return best
