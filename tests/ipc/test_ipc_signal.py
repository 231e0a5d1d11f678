"""Layer signal (worker -> cache messager): no publication is ever missed when publisher and
waiter race, later steps satisfy earlier waits, the plain C publisher wakes a parked waiter,
and a dead publisher raises PeerDied, also one that died before its first publish."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ipc_procs import (CTX, NO_RESCUE, signal_c_publisher, signal_create_then_die,
                            signal_dies_after_attach, signal_publisher)

from pipeline.ipc import PeerDied
from pipeline.ipc.instance import Instance, list_entries
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.segment import unlink_segment

ROOT = Path(__file__).resolve().parents[2]


def test_racing_publisher_and_waiter_never_lose_a_wakeup(inst):
    # Ping-pong: each step's first wait races with its publication; no spinning, and parking
    # slices longer than the timeout, so one lost wake-up fails the test with TimeoutError.
    steps, layers = 1500, 4
    sig = LayerSignal.create(inst, "sig", layers, slice_s=NO_RESCUE)
    ack = LayerSignal.create(inst, "ack", 1, slice_s=NO_RESCUE)
    ack.claim_publisher()
    p = CTX.Process(target=signal_publisher, args=(sig.name, ack.name, steps, layers), daemon=True)
    p.start()
    for step in range(steps):
        for layer in range(layers):
            sig.wait(step, layer, timeout=20)
        ack.publish(step, 0)
    p.join(20)
    assert p.exitcode == 0
    assert [sig.published(layer) for layer in range(layers)] == [steps - 1] * layers


def test_c_entry_point_wakes_a_parked_waiter(inst, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the C publisher")
    src = tmp_path / "pub.c"
    src.write_text('#include "shm_atomic.h"\n'
                   "void publish(void *b, int64_t s, int l) { pipeline_signal_publish(b, s, l); }\n")
    lib = tmp_path / "libpub.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{ROOT / 'cython_ext'}", str(src),
                    "-o", str(lib)], check=True)
    steps, layers = 500, 3
    sig = LayerSignal.create(inst, "c", layers, slice_s=NO_RESCUE)
    p = CTX.Process(target=signal_c_publisher, args=(sig.name, str(lib), steps), daemon=True)
    p.start()
    for step in range(steps):
        sig.wait(step, step % layers, timeout=20)
    p.join(20)
    assert p.exitcode == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), max_size=30),
       st.integers(0, 60), st.integers(0, 3))
def test_wait_returns_iff_that_step_or_a_later_one_was_published(pubs, step, layer):
    with Instance() as inst:
        sig = LayerSignal.create(inst, "h", 4)
        last = [-1] * 4
        for s, l in sorted(pubs):
            sig.publish(s, l)
            last[l] = s
        assert [sig.published(k) for k in range(4)] == last
        if last[layer] >= step:
            sig.wait(step, layer, timeout=0)
        else:
            with pytest.raises(TimeoutError, match=f"step {step} layer {layer}"):
                sig.wait(step, layer, timeout=0)
        sig.close()
    assert list_entries(inst.id) == []


def test_bad_arguments_name_the_limit(inst):
    sig = LayerSignal.create(inst, "b", 2)
    with pytest.raises(ValueError, match="layer=2 out of range 0..1"):
        sig.publish(0, 2)
    with pytest.raises(ValueError, match="step=-1"):
        sig.wait(-1, 0)
    with pytest.raises(ValueError, match="num_layers=0"):
        LayerSignal.create(inst, "z", 0)


def test_dead_publisher_raises_peer_died(inst):
    sig = LayerSignal.create(inst, "d", 2)
    p = CTX.Process(target=signal_dies_after_attach, args=(sig.name,), daemon=True)
    p.start()
    p.join(20)
    with pytest.raises(PeerDied, match="publisher"):
        sig.wait(0, 0, timeout=20)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_publisher_dead_before_its_first_publish_raises_peer_died(inst, how):
    # The publisher creates the signal (recording its pid) and dies once the reader parked,
    # without publishing: the reader must see it die, not wait out its timeout.
    parent, child = CTX.Pipe()
    p = CTX.Process(target=signal_create_then_die, args=(inst.id, child, how), daemon=True)
    p.start()
    assert parent.poll(30), "publisher did not report its signal"
    name = parent.recv()
    sig = LayerSignal.attach(name)
    unlink_segment(name)  # its creator dies without cleaning up; the mapping is enough
    try:
        assert sig.publisher_pid() == p.pid
        t0 = time.monotonic()
        with pytest.raises(PeerDied, match=rf"publisher \(pid {p.pid}\) died"):
            sig.wait(0, 0, timeout=20)
        assert time.monotonic() - t0 < 10  # a few park slices, far from the timeout
        assert sig.published(0) == -1
    finally:
        sig.close()
    p.join(20)
    assert p.exitcode == (-signal.SIGKILL if how == "sigkill" else 0)


def test_creator_is_the_publisher_until_one_claims(inst):
    sig = LayerSignal.create(inst, "p", 1)
    assert sig.publisher_pid() == os.getpid()
    p = CTX.Process(target=signal_dies_after_attach, args=(sig.name,), daemon=True)
    p.start()
    p.join(20)
    assert sig.publisher_pid() == p.pid
