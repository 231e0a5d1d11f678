"""Naming and lifetime: per-instance names, 0600 + exclusive creation, cleanup on exit and
SIGTERM, views of an instance owning only what they create, `Instance.join` (a view of a live
owner, else this process owns the id), sweeping dead instances, a clear error when /dev/shm is
too small, and the C header compiling as C11 and C++17 (the CUDA callback includes it) with
its documented layout."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import posix_ipc
import pytest
from ipc_procs import CTX, make_instance_and_wait, view_segment_and_wait

from pipeline.ipc import ShmSpaceError
from pipeline.ipc.instance import Instance, list_entries, read_owner, unlink_instance
from pipeline.ipc.ring import Ring
from pipeline.ipc.segment import create_segment, shm_free_bytes, unlink_segment
from pipeline.ipc.sweep import sweep_stale

ROOT = Path(__file__).resolve().parents[2]


def _spawn_instance(leak: bool):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=make_instance_and_wait, args=(child, leak), daemon=True)
    p.start()
    assert parent.poll(30), "child did not report its instance"
    return p, parent.recv()


def test_names_modes_and_cleanup():
    inst = Instance("t-names")
    seg = inst.create_segment("a", 10_000)
    ring = Ring.create(inst, "r", 4096)
    sem = inst.create_semaphore("s")
    entries = list_entries("t-names")
    assert entries == ["pipeline.t-names.a", "pipeline.t-names.owner", "pipeline.t-names.r",
                       "sem.pipeline.t-names.s"]
    for e in entries:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{e}").st_mode) == 0o600
    assert seg.size == 10_000 and ring.name == "/pipeline.t-names.r"
    with pytest.raises(posix_ipc.ExistentialError):
        inst.create_segment("a", 4096)  # O_CREX: never silently reuse a name
    inst.cleanup()
    assert list_entries("t-names") == []
    # Mappings outlive their names: a running stage keeps working during shutdown.
    memoryview(seg)[:3] = b"abc"
    assert bytes(memoryview(seg)[:3]) == b"abc"
    seg.close()
    sem.close()


def test_bad_names_are_rejected():
    with pytest.raises(ValueError, match="instance_id='a.b'"):
        Instance("a.b")
    with Instance() as inst:
        with pytest.raises(ValueError, match="what='x/y'"):
            inst.create_segment("x/y", 64)
    assert list_entries(inst.id) == []


def test_too_small_shm_says_asked_and_free():
    with Instance() as inst:
        asked = shm_free_bytes() + (1 << 40)
        with pytest.raises(ShmSpaceError, match=rf"asked {asked} bytes, /dev/shm has \d+ bytes free"):
            inst.create_segment("huge", asked)
        assert list_entries(inst.id) == [f"pipeline.{inst.id}.owner"]
    assert list_entries(inst.id) == []


def test_sigterm_leaves_nothing_behind():
    p, iid = _spawn_instance(leak=False)
    assert len(list_entries(iid)) == 7
    ring = Ring.attach(f"/pipeline.{iid}.r", "writer", claim=False)
    deadline = time.monotonic() + 30
    while not ring.reader_parked() and time.monotonic() < deadline:
        pass  # until the child blocks in recv(): its handler must run from there
    assert ring.reader_parked()
    ring.close()
    os.kill(p.pid, signal.SIGTERM)
    p.join(20)
    assert p.exitcode == -signal.SIGTERM  # still dies by the signal, after cleaning up
    assert list_entries(iid) == []


def test_sweep_stale_removes_only_dead_instances():
    with Instance() as live:
        Ring.create(live, "mine", 4096)
        p, iid = _spawn_instance(leak=True)
        p.join(20)
        assert len(list_entries(iid)) == 7
        removed = sweep_stale()
        assert set(list_entries(iid)) == set() and len(set(removed) & {f"sem.pipeline.{iid}.sem"}) == 1
        assert len(list_entries(live.id)) == 2  # the live instance is untouched
    assert list_entries(live.id) == []


@pytest.mark.parametrize("compiler,std,ext", [("gcc", "c11", "c"), ("g++", "c++17", "cpp")])
def test_header_compiles_as_c_and_cxx_with_documented_layout(tmp_path, compiler, std, ext):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    src = tmp_path / f"t.{ext}"
    src.write_text(
        '#include "shm_atomic.h"\n#include <stddef.h>\n'
        "#ifdef __cplusplus\n#define SA static_assert\n#else\n#define SA _Static_assert\n#endif\n"
        'SA(offsetof(pl_ring_shm, writer) == 256, "writer line");\n'
        'SA(offsetof(pl_ring_shm, writer.parker) == 320, "writer parker");\n'
        'SA(offsetof(pl_ring_shm, readers) == 384 && sizeof(pl_ring_side) == 128, "readers");\n'
        'SA(offsetof(pl_signal_shm, parker) == 64 && offsetof(pl_signal_shm, seq) == 128, "signal");\n'
        'SA(offsetof(pl_signal_shm, publisher_pid) == 16, "signal publisher pid");\n'
        'SA(offsetof(pl_doorbell_shm, parker) == 64 && PL_DOORBELL_SIZE == 128, "doorbell");\n'
        'SA(PL_LINE == 64, "line");\n'
        'SA(sizeof(pl_parker) == 64, "parker");\n'
        "int main(void) { pipeline_signal_publish((void *)0, -1, 0); return 0; }\n".replace(
            "pipeline_signal_publish((void *)0, -1, 0)", "(void)pipeline_signal_publish"))
    subprocess.run([compiler, f"-std={std}", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                    f"-I{ROOT / 'cython_ext'}", str(src)], check=True)


def test_orphans_without_owner_record():
    # A default id names its creator: debris of a dead creator goes, a live one's stays.
    name = f"/pipeline.{os.getpid()}-abc.x"
    seg = create_segment(name, 4096)
    sweep_stale()
    assert list_entries(f"{os.getpid()}-abc") == [f"pipeline.{os.getpid()}-abc.x"]
    unlink_segment(name)
    seg.close()
    assert list_entries(f"{os.getpid()}-abc") == []


def test_view_names_like_its_instance_and_owns_only_what_it_creates():
    with pytest.raises(ValueError, match="instance_id"):
        Instance.view("")
    with Instance() as inst:
        view = Instance.view(inst.id)
        assert view.name("kv.1") == inst.name("kv.1") == f"/pipeline.{inst.id}.kv.1"
        assert list_entries(inst.id) == [f"pipeline.{inst.id}.owner"]  # no second owner record
        seg = view.create_segment("kv", 4096)
        assert stat.S_IMODE(os.stat(f"/dev/shm/pipeline.{inst.id}.kv").st_mode) == 0o600
        with pytest.raises(ValueError, match="owner"):
            view.create_semaphore("s")
        view.cleanup()
        assert list_entries(inst.id) == [f"pipeline.{inst.id}.owner"]
        seg.close()
        seg = view.create_segment("kv", 4096)
        inst.cleanup()  # the owner leaves the view's segment alone; unlink_instance sweeps it
        assert list_entries(inst.id) == [f"pipeline.{inst.id}.kv"]
        assert unlink_instance(inst.id) == [f"pipeline.{inst.id}.kv"]
        unlink_segment(seg.name)  # forget it: nothing left for this process's exit hook
        seg.close()
    assert list_entries(inst.id) == []


def test_view_segment_is_unlinked_by_its_creator_on_sigterm(inst):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=view_segment_and_wait, args=(inst.id, child), daemon=True)
    p.start()
    assert parent.poll(30) and parent.recv() == "ready"
    assert list_entries(inst.id) == [f"pipeline.{inst.id}.kv.1", f"pipeline.{inst.id}.owner"]
    os.kill(p.pid, signal.SIGTERM)
    p.join(20)
    assert p.exitcode == -signal.SIGTERM
    assert list_entries(inst.id) == [f"pipeline.{inst.id}.owner"]  # the owner's is untouched


def test_join_views_a_live_owner_and_owns_an_id_nobody_owns():
    with Instance() as inst:
        view = Instance.join(inst.id)
        assert not view.owner
        assert list_entries(inst.id) == [f"pipeline.{inst.id}.owner"]  # no second record
    iid = f"{os.getpid()}-join"
    own = Instance.join(iid)
    try:
        assert own.owner and read_owner(iid)[0] == os.getpid()
        own.create_segment("kv", 4096).close()
        assert list_entries(iid) == [f"pipeline.{iid}.kv", f"pipeline.{iid}.owner"]
        assert not set(sweep_stale()) & set(list_entries(iid))  # its owner lives
    finally:
        own.cleanup()
    assert list_entries(iid) == []


def test_join_takes_over_an_id_whose_owner_died():
    p, iid = _spawn_instance(leak=True)
    p.join(20)
    assert len(list_entries(iid)) == 7  # the dead owner's record and names
    inst = Instance.join(iid)
    try:
        assert inst.owner and read_owner(iid)[0] == os.getpid()
        assert list_entries(iid) == [f"pipeline.{iid}.owner"]
    finally:
        inst.cleanup()
    assert list_entries(iid) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's entries needs root")
def test_sweep_leaves_other_users_instances_alone():
    # Another user's names cannot be read nor unlinked by us (0600, sticky /dev/shm): a sweep
    # must pass them by, even when their owner is dead, instead of failing on them.
    p, iid = _spawn_instance(leak=True)
    p.join(20)
    entries = list_entries(iid)
    for e in entries:
        os.chown(f"/dev/shm/{e}", 65534, 65534)
    try:
        assert not set(sweep_stale()) & set(entries)
        assert list_entries(iid) == entries
    finally:
        for e in entries:
            os.chown(f"/dev/shm/{e}", 0, 0)
    assert set(entries) <= set(sweep_stale())
