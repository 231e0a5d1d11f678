"""The HTTP front end's process (``python -m pipeline.http.process``): uvicorn (httptools,
with uvloop where installed) serving ``app.build_app`` on the listening socket the
daemon bound and handed down, as a client of the daemon over a private ipc socket.

Started and stopped by the daemon (``http.launcher``), never by a user. It reads its ``HttpSpec``
(JSON) on stdin, writes one byte on the ready pipe once it serves, dies with the daemon
(PR_SET_PDEATHSIG) and ignores SIGTERM/SIGINT: systemd and Ctrl-C reach the whole process
group, and a front end that closed its port then would turn the daemon's drain (503 for new
requests while the old ones finish) into refused connections. The daemon stops it with
SIGUSR1 after the drain. Owns the event loop, the uvicorn server and its ``AsyncClient``.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Generator

import msgspec

from pipeline.http.launcher import STOP_SIGNAL, HttpSpec
from pipeline.ipc.prctl import PR_SET_PDEATHSIG, name_process, prctl


def _die_with_parent() -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:
        return asyncio.new_event_loop


async def serve(spec: HttpSpec) -> None:
    import uvicorn

    from pipeline.chat_parse import ChatParsers
    from pipeline.client import AsyncClient
    from pipeline.http.app import HttpState, build_app
    from pipeline.http.conn import HEAD_TIMEOUT_S, GuardedProtocol, raise_fd_limit
    from pipeline.tokenizer.tokenizer import Tokenizer, max_token_text_bytes

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield  # the daemon decides when this process stops (see the module docstring)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            try:
                if self.started:
                    os.write(spec.ready_fd, b"1")
            except OSError:
                pass  # a restart: the daemon does not wait for this one
            finally:
                os.close(spec.ready_fd)

    client = AsyncClient(spec.endpoint, timeout=None)
    tokenizer = Tokenizer(spec.model_path, chat_template=spec.chat_template)
    state = HttpState(client=client, tokenizer=tokenizer,
                      model=spec.model, model_path=spec.model_path, max_model_len=spec.max_model_len,
                      fingerprint=spec.fingerprint, api_key=spec.api_key, created=int(time.time()),
                      answer_limit=spec.answer_limit, token_text_bytes=max_token_text_bytes(tokenizer.tok),
                      chat_parsers=ChatParsers(spec.tool_call_parser, spec.enable_auto_tool_choice,
                                               spec.reasoning_parser),
                      hidden_size=spec.hidden_size)
    raise_fd_limit()
    # GuardedProtocol: the connection cap and the head time-out (http.conn).
    config = uvicorn.Config(build_app(state), http=GuardedProtocol, lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=HEAD_TIMEOUT_S)
    server = Server(config)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(STOP_SIGNAL, lambda: setattr(server, "should_exit", True))

    try:
        await server.serve(sockets=[socket.socket(fileno=spec.fd)])
    finally:
        await client.close()


def main() -> int:
    _die_with_parent()
    name_process("http")
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=HttpSpec)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
