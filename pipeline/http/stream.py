"""Server-sent events for ``stream: true``: the deltas of a body's engine requests (one per
prompt) as OpenAI chunks, each as soon as the daemon sends it, then a finish chunk per
choice, the usage chunk when ``stream_options.include_usage``, and ``data: [DONE]``.

Owns one streamed response: a pump task per engine request feeds one queue the response
reads; when the client disconnects (or the response ends early) the pumps are cancelled,
which aborts their engine requests on the daemon. The status line waits for each engine
request's first answer, so a refused one (a prompt over max_model_len...) is a 400 as
without streaming; one that fails later ends the stream with an ``error`` event (OpenAI's
error object), then ``[DONE]``: the status line went out with the first chunk.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from pipeline.chat_parse import AnswerParser, ChatParsing
from pipeline.http import openai_convert as C
from pipeline.http import openai_response as R
from pipeline.http.openai_api import ChatCompletionRequest, CompletionRequest
from pipeline.messages import RequestDelta, RequestResult

if TYPE_CHECKING:
    from pipeline.http.app import HttpState

DONE = b"data: [DONE]\n\n"
# Deltas one streamed response may hold unsent. They pile up only while the client does not
# read (its socket buffers and uvicorn's 64 KiB are full); beyond this the response is ended
# (its engine requests aborted, the connection closed) rather than its output kept here.
MAX_QUEUED = 4096
_encode = msgspec.json.Encoder().encode
log = logging.getLogger("pipeline.http")


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class _Chunks:
    """Builds the chunks of one response (chat or text completion)."""

    def __init__(self, body: CompletionRequest | ChatCompletionRequest, rid: str, created: int,
                 state: HttpState, text: R.TokenText, parsing: ChatParsing | None = None) -> None:
        self.chat = isinstance(body, ChatCompletionRequest)
        self.n = body.n
        self.text = text
        self.parsing = parsing if parsing is not None and parsing.active else None
        self.parsers: dict[int, AnswerParser] = {}  # choice index -> its parser (chat, parsing)
        self.usage = bool(body.stream_options and body.stream_options.include_usage)
        self.head: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": state.model, "system_fingerprint": state.fingerprint}

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        obj: dict[str, Any] = self.head | {"choices": choices}
        if self.usage:
            obj["usage"] = None
        return _event(obj)

    def opening(self) -> bytes | None:
        if not self.chat:
            return None
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(self.n)])

    def delta(self, prompt: int, d: RequestDelta) -> bytes | None:
        if not d.text and not d.logprobs:
            return None
        index = prompt * self.n + d.index
        if self.chat:
            delta: dict[str, Any] = {"content": d.text}
            if self.parsing is not None:
                delta = self._parser(index).feed(d.text)
                if not delta and not d.logprobs:
                    return None  # held back (a tag may be starting)
            return self.chunk([{"index": index, "delta": delta,
                                "logprobs": R.chat_logprobs(d.logprobs, self.text), "finish_reason": None}])
        return self.chunk([{"index": index, "text": d.text,
                            "logprobs": R.completion_logprobs(d.logprobs, self.text), "finish_reason": None}])

    def finish(self, prompt: int, res: RequestResult) -> bytes:
        choices, held = [], []
        for c in R.completions_of(res):
            index = prompt * self.n + c.index
            choice: dict[str, Any] = {"index": index, "logprobs": None,
                                      "finish_reason": R.finish_reason(c), "stop_reason": c.stop_reason}
            if self.chat:
                choice["delta"] = {}
                if self.parsing is not None:  # what the parsers held, then the finish
                    parser = self._parser(index)
                    if rest := parser.finish():
                        held.append({"index": index, "delta": rest, "logprobs": None, "finish_reason": None})
                    choice["finish_reason"] = parser.finish_reason(choice["finish_reason"])
            else:
                choice["text"] = ""
            choices.append(choice)
        return (self.chunk(held) if held else b"") + self.chunk(choices)

    def _parser(self, index: int) -> AnswerParser:
        if (p := self.parsers.get(index)) is None:
            assert self.parsing is not None
            p = self.parsers[index] = self.parsing.answer()
        return p

    def usage_chunk(self, results: list[RequestResult]) -> bytes:
        return _event(self.head | {"choices": [], "usage": R.usage(results)})


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (its body was read: the next message the server
    hands the app is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _pump(i: int, it: AsyncIterator[RequestDelta | RequestResult], q: asyncio.Queue,
                overflow: asyncio.Event) -> None:
    try:
        async for item in it:
            q.put_nowait((i, item))
            if q.qsize() > MAX_QUEUED:  # the client does not read: stop, aborting on the daemon
                overflow.set()
                await it.aclose()  # type: ignore[attr-defined]  # AsyncClient.stream's finally aborts
                return
    except Exception as exc:  # noqa: BLE001 -- the response reports it; the others go on
        q.put_nowait((i, exc))


class _Streams:
    """The engine requests of one streamed response: their pumps, the disconnect watcher and
    the queue they all feed (None: the client is gone)."""

    def __init__(self, request: Request, state: HttpState, reqs: list[dict[str, Any]]) -> None:
        self.q: asyncio.Queue = asyncio.Queue()
        self.overflow = asyncio.Event()
        self.pumps = [asyncio.ensure_future(_pump(i, state.client.stream(timeout=None, **f), self.q,
                                                  self.overflow)) for i, f in enumerate(reqs)]
        self.gone = asyncio.ensure_future(disconnected(request))
        self.gone.add_done_callback(lambda _: self.q.put_nowait(None))

    async def first_items(self) -> list[tuple[int, Any]]:
        """Everything up to each request's first answer (its first token, or its refusal):
        an ApiError if one was refused (so the status says so, as without streaming) or the
        client left meanwhile."""
        early: list[tuple[int, Any]] = []
        waiting = set(range(len(self.pumps)))
        while waiting:
            got = await self.q.get()
            if got is None:
                raise C.ApiError(499, "the client disconnected", code="client_disconnected")
            i, item = got
            if isinstance(item, Exception):
                raise C.from_error(item.error) if hasattr(item, "error") else C.ApiError(500, str(item))
            if isinstance(item, RequestResult) and item.finish_reason == "error" and item.error is not None:
                raise C.from_error(item.error)
            early.append(got)
            waiting.discard(i)
        return early

    async def close(self) -> None:
        self.gone.cancel()
        for p in self.pumps:
            p.cancel()  # aborts the engine requests still running
        await asyncio.gather(*self.pumps, return_exceptions=True)


async def _events(streams: _Streams, early: list[tuple[int, Any]], chunks: _Chunks) -> AsyncIterator[bytes]:
    results: list[RequestResult | None] = [None] * len(streams.pumps)
    try:
        if (first := chunks.opening()) is not None:
            yield first
        left = len(streams.pumps)
        while left:
            got = early.pop(0) if early else await streams.q.get()
            if got is None:
                return  # the client is gone: the finally aborts what still runs
            i, item = got
            if isinstance(item, RequestDelta):
                if (ev := chunks.delta(i, item)) is not None:
                    yield ev
                continue
            left -= 1
            if isinstance(item, Exception):
                err = C.from_error(item.error) if hasattr(item, "error") else C.ApiError(500, str(item))
                yield _event(err.body())
                break
            results[i] = item
            if item.finish_reason == "error" and item.error is not None:
                yield _event(C.from_error(item.error).body())
                break
            yield chunks.finish(i, item)
        else:
            if chunks.usage:
                yield chunks.usage_chunk([r for r in results if r is not None])
        yield DONE
    finally:
        await streams.close()


async def sse_response(request: Request, state: HttpState, reqs: list[dict[str, Any]],
                       body: CompletionRequest | ChatCompletionRequest, rid: str, created: int,
                       text: R.TokenText, parsing: ChatParsing | None = None) -> StreamingResponse:
    """The stream, once every engine request has answered once: a refused one makes the
    whole response its error status (the status line has not gone out yet)."""
    streams = _Streams(request, state, reqs)
    try:
        early = await streams.first_items()
    except BaseException:
        await streams.close()
        raise
    chunks = _Chunks(body, rid, created, state, text, parsing)
    return EventStream(streams, _events(streams, early, chunks), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class EventStream(StreamingResponse):
    """Starlette's StreamingResponse without its per-response task group and disconnect
    listener: the events end by themselves when the client goes (``_Streams`` watches the
    disconnect from the start, before the response exists), and a send after it is a no-op.
    When the client stops reading (``MAX_QUEUED``), the response is dropped unfinished (the
    send it waits in is cancelled): uvicorn then closes the connection."""

    def __init__(self, streams: _Streams, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.ensure_future(self.stream_response(send))
        full = asyncio.ensure_future(self.streams.overflow.wait())
        try:
            await asyncio.wait((task, full), return_when=asyncio.FIRST_COMPLETED)
        finally:
            full.cancel()
        if task.done():
            task.result()
            return
        log.warning("HTTP front end: a streaming client read nothing while %d events queued; its "
                    "request was aborted and its connection closed", MAX_QUEUED)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.body_iterator.aclose()  # type: ignore[attr-defined]  # its finally aborts the rest
