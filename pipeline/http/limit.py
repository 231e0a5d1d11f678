"""ASGI middleware in front of every route: the API key, then the body's size and time.

Owns no state beyond one request's byte count. A request is judged on its headers first:
without the key (``Authorization: Bearer KEY``; every route but OPEN_PATHS) it gets 401 at
once, its body never read, so a client without the key costs the headers and nothing
more. Then a body over ``MAX_BODY_BYTES`` gets 413, whether the client declared its length
or sends it chunked, and one not in within ``BODY_TIMEOUT_S`` gets 408 (a client trickling
its body holds a connection and a buffer; the header time-out is ``conn``'s).

The limit is pipe mode's line limit: room for a maximal prompt (4 MiB of UTF-8) in any JSON
escaping; the daemon's byte limits (README.md "Limits") apply after parsing (``body``).
"""
from __future__ import annotations

import asyncio
import hmac
from typing import Any

import msgspec

from pipeline.messages.requests import MAX_PROMPT_BYTES

MAX_BODY_BYTES = 8 * MAX_PROMPT_BYTES
BODY_TIMEOUT_S = 60.0
# Answered without the key, as vLLM's: load balancers probe /health and /ping; /version.
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
Scope = dict[str, Any]


def _error(message: str, type_: str, code: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})


def key_ok(headers: list[tuple[bytes, bytes]], api_key: bytes) -> bool:
    given = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, key = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), api_key)


class BodyLimit:
    """Checks the key, reads the whole body (the app would anyway), then replays it to the
    app; the messages after it (the disconnect) come from the server as they arrive."""

    def __init__(self, app: Any, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS and not key_ok(headers, self.api_key):
            await _refuse(send, 401, _error("invalid API key: send `Authorization: Bearer KEY` with the "
                                            "server's --api-key", "authentication_error", "invalid_api_key"))
            return
        declared = dict(headers).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            await _refuse(send, 413, _too_large(declared.decode()))
            return
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                body = await _read(receive)
        except TimeoutError:
            await _refuse(send, 408, _error(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                                            "invalid_request_error", "request_timeout"))
            return
        if body is None:
            return  # the client left before sending its body
        if isinstance(body, int):
            await _refuse(send, 413, _too_large(f"more than {MAX_BODY_BYTES}"))
            return
        replay: list[dict] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


async def _read(receive: Any) -> bytes | int | None:
    """The body; its size so far once over the limit; None if the client left."""
    chunks, seen = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk = msg.get("body", b"")
        seen += len(chunk)
        if seen > MAX_BODY_BYTES:
            return seen
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _too_large(size: str) -> bytes:
    return _error(f"request body of {size} bytes exceeds the limit of {MAX_BODY_BYTES} bytes",
                  "invalid_request_error", "request_too_large")


async def _refuse(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
