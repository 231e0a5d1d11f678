"""Small pieces of streaming text handling shared by the tool-call parsers.

- ``ContentFilter``: the content around the calls (the outside text joined as written),
  streamed so that the concatenation of what it lets out depends only on the text, never on
  where the deltas split it. Whitespace is held until it is known what it touches: the
  whitespace that starts the content after a call, or ends it before a call, is dropped, and
  content that is whitespace only is never sent (the non-streamed content is then None).
- ``find_marker``: where a marker starts in a buffer, or where a partial marker at its end
  could start (text to hold back until the next delta decides it).

Owns / State: ``ContentFilter`` holds the pending whitespace and whether the last thing seen
was a call.
"""
from __future__ import annotations


class ContentFilter:
    def __init__(self) -> None:
        self._held = ""  # trailing whitespace not yet known to be content
        self._started = False  # some non-whitespace content was sent
        self._call_before = False  # a call came before any content
        self._call_since = False  # a call came after the last content sent

    def text(self, s: str) -> str:
        """The next content; returns what may be sent now."""
        s = self._held + s
        body = s.rstrip()
        self._held = s[len(body):]
        if not body:
            return ""
        if not self._started and self._call_before:
            body = body.lstrip()  # the whitespace between the first call and the content
        self._started, self._call_since = True, False
        return body

    def call(self) -> None:
        self._call_before = self._call_before or not self._started
        self._call_since = True

    def finish(self) -> str:
        """The output ended: the whitespace that ends the content, unless a call came after it."""
        out = self._held if self._started and not self._call_since else ""
        self._held = ""
        return out


def find_marker(buf: str, marker: str) -> tuple[int, bool]:
    """(index, True) of the first ``marker`` in ``buf``; else (index, False) of the longest
    suffix of ``buf`` that is a proper prefix of ``marker`` (len(buf) when none)."""
    i = buf.find(marker)
    if i >= 0:
        return i, True
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-k:]):
            return len(buf) - k, False
    return len(buf), False


def starts(buf: str, marker: str) -> bool | None:
    """Does ``buf`` start with ``marker``? None while ``buf`` is a proper prefix of it (undecided)."""
    if buf.startswith(marker):
        return True
    return None if marker.startswith(buf) else False
