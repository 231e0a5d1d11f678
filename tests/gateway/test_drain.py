"""The drain race: once the daemon reports "draining", no request is accepted.

SIGTERM used to set only the serve loop's stop flag; the gateway stopped accepting when the
drain thread started, at the end of that loop turn, so a frame handled in between was
accepted and served although health already said "draining". This drives a real gateway
(real stage processes) through exactly that turn, in one thread, with no timing involved:
the stop request, a health reply, then a generate frame before the turn ends.
"""
from __future__ import annotations

import argparse
import queue
import time

import pytest
from e2e_helpers import make_tiny_model, shm_entries

from pipeline.engine_args import config_from_args
from pipeline.frontend import protocol as P
from pipeline.gateway import serve
from pipeline.gateway.serve_args import check_args
from pipeline.gateway.systemd import Notifier
from pipeline.messages import RequestResult


@pytest.fixture
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")
    p = argparse.ArgumentParser()
    serve.add_args(p)
    args = p.parse_args(["--model", str(model), "--device", "cpu", "--max-model-len", "256",
                         "--worker-threads", "1"])
    s = serve.Server(check_args(args), config_from_args(args), Notifier.from_env())
    s.gw.start(timeout_s=300)
    yield s
    s.close()
    assert shm_entries(s.config.instance_id) == []


def final(server: serve.Server, rid: str, timeout: float = 60.0) -> RequestResult:
    deadline = time.monotonic() + timeout
    while True:
        out = server.answers.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(out, RequestResult) and out.id == rid:
            return out


def generate(server: serve.Server, rid: str) -> None:
    frame = P.encode(P.Generate(id=rid, prompt="the for statement", max_tokens=4, temperature=0))
    server._handle_frame(b"client", frame)


def test_no_request_is_accepted_once_draining_is_reported(server):
    generate(server, "early")  # in flight when the stop comes: it must still finish
    early = server.sessions.internal_id(b"client", "early")
    server.request_stop()  # what the SIGTERM handler runs
    assert server.status() == "draining"
    generate(server, "late")  # same loop turn: the drain thread has not started
    late = server.answers.get_nowait()  # refused at once, before any stage saw it
    assert isinstance(late, RequestResult) and late.error is not None, late
    assert late.error.code == "draining" and "draining" in late.error.message
    assert server.gw.drain(60.0) == 0  # nothing had to be aborted
    done = final(server, early)
    assert done.finish_reason == "length" and len(done.token_ids) == 4, done
    with pytest.raises(queue.Empty):
        server.answers.get_nowait()  # and nothing else was answered: "late" never ran
