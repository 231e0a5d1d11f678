"""ASGI middleware: a request body over ``MAX_BODY_BYTES`` gets 413 (OpenAI's error object)
before the app reads it, whether the client declared its length or sends it chunked. Owns
no state beyond one request's byte count.

The limit is pipe mode's line limit: room for a maximal prompt (4 MiB of UTF-8) in any JSON
escaping; the daemon's byte limits (README.md "Limits") apply after parsing.
"""
from __future__ import annotations

from typing import Any

import msgspec

from pipeline.messages.requests import MAX_PROMPT_BYTES

MAX_BODY_BYTES = 8 * MAX_PROMPT_BYTES
Scope = dict[str, Any]


def _too_large(size: str) -> bytes:
    return msgspec.json.encode({"error": {
        "message": f"request body of {size} bytes exceeds the limit of {MAX_BODY_BYTES} bytes",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}})


class BodyLimit:
    """Reads the whole body first (the app would anyway), then replays it to the app; the
    messages after it (the disconnect) come from the server as they arrive."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            await self._refuse(send, declared.decode())
            return
        chunks, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > MAX_BODY_BYTES:
                await self._refuse(send, f"more than {MAX_BODY_BYTES}")
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        replay: list[dict] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    @staticmethod
    async def _refuse(send: Any, size: str) -> None:
        body = _too_large(size)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
