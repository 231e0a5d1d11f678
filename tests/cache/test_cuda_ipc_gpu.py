"""CUDA IPC KV transfer (pipeline/cache/cuda_ipc.py and its cuda path in tcp / link).

On a GPU (skipped without CUDA): a second process (spawn) allocates a KV-shaped CUDA tensor and
exports it with `export_pool`; this process opens it with `open_pool` and a `CudaIpcTransfer`
(also through a `KVLink` whose receiver passes the handle on, as a decode messager does)
copies exactly the given blocks from its own CUDA pool, or from a pool another process
exported (the prefill messager's case), into it; the owner then reads its tensor back. A pool
of another size or a layout that differs is refused before any copy.
Everywhere (no GPU needed): handle validation, a receiver whose pool is on CUDA refusing data
messages while taking done messages, and the link refusing every pairing that is not
cuda to cuda on one host, each saying why."""
from __future__ import annotations

import multiprocessing
import threading

import msgspec
import numpy as np
import pytest
import torch
from conftest import cuda_skip_reason

from pipeline.cache.cuda_ipc import CudaIpcTransfer, open_pool
from pipeline.cache.link import KVLink
from pipeline.cache.tcp import TcpTransfer
from pipeline.cache.tcp_receiver import KVReceiver
from pipeline.cache.transfer import KVTransferError
from pipeline.ipc.cuda_ipc import CudaIpcHandle, decode_handle
from pipeline.messages.kv_layout import KVLayout, LayoutMismatch

gpu = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
SPAWN = multiprocessing.get_context("spawn")  # CUDA in the children: never forked
WAIT = 120  # seconds a test waits on a child before calling it hung (first CUDA init is slow)
LAYOUT = KVLayout(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8,
                  dtype="float16", model_hash="tiny-0")
REMOTE = KVLayout(**{**{f: getattr(LAYOUT, f) for f in LAYOUT.__struct_fields__}, "num_blocks": 12})
SHAPE = (REMOTE.num_layers, 2, REMOTE.num_blocks, REMOTE.block_bytes)


def _with(layout: KVLayout, **changes) -> KVLayout:
    return KVLayout(**{**{f: getattr(layout, f) for f in layout.__struct_fields__}, **changes})


def _handle_blob(**changes) -> bytes:
    """A well-formed handle (as a peer would send it); opening it is never attempted."""
    h = dict(gpu_uuid="GPU-00000000-0000-0000-0000-000000000000", nbytes=64, tensor_offset=0,
             storage_handle=b"\x01" * 64, storage_size_bytes=64, storage_offset_bytes=0,
             ref_counter_handle=b"/torch_1_1", ref_counter_offset=0, event_handle=b"\x02" * 64,
             event_sync_required=True)
    return msgspec.msgpack.encode(CudaIpcHandle(**{**h, **changes}))


# ---- child process: owns a CUDA KV pool, exports it, reads it back on request ----------------
def owner(layout: KVLayout, seed: int, conn) -> None:
    from pipeline.ipc.cuda_ipc import export_pool
    dtype = getattr(torch, layout.dtype)
    # KV-shaped and typed as the worker allocates it; filled with random bytes (seed < 0: zeros).
    shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)
    buf = torch.zeros(shape, dtype=dtype, device="cuda")
    if seed >= 0:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=g)
        buf.view(-1).view(torch.uint8).copy_(raw.cuda())
    torch.cuda.synchronize()
    conn.send(export_pool(buf))
    while True:
        cmd = conn.recv()
        if cmd == "read":
            torch.cuda.synchronize()
            conn.send_bytes(buf.view(-1).view(torch.uint8).cpu().numpy().tobytes())
        elif cmd == "stop":
            del buf  # after the opener dropped its mapping (the test closes it first)
            conn.send("stopped")
            return


class Owner:
    def __init__(self, layout: KVLayout, seed: int = -1) -> None:
        self.layout = layout
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=owner, args=(layout, seed, child), daemon=True)
        self.proc.start()
        assert self.conn.poll(WAIT), "owner process did not export its pool"
        self.blob: bytes = self.conn.recv()

    def pool(self) -> np.ndarray:
        self.conn.send("read")
        assert self.conn.poll(WAIT), "owner process did not answer 'read'"
        return np.frombuffer(self.conn.recv_bytes(), np.uint8).reshape(
            self.layout.num_layers, 2, self.layout.num_blocks, self.layout.block_bytes)

    def stop(self) -> None:
        self.conn.send("stop")
        assert self.conn.poll(WAIT) and self.conn.recv() == "stopped"
        self.proc.join(WAIT)
        assert self.proc.exitcode == 0


@pytest.fixture
def dst():
    o = Owner(REMOTE)
    yield o
    o.stop()


def _local_pool(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYOUT.num_layers, 2, LAYOUT.num_blocks, LAYOUT.block_bytes),
                         dtype=torch.uint8, generator=g).cuda()


# Runs of several lengths (1, 3, 2), out of order, and a lone block: K and V of each.
PAIRS = [(5, 0), (6, 1), (7, 2), (0, 9), (12, 4), (13, 5), (15, 11)]


def _expected(src: np.ndarray, layers: list[int], pairs) -> np.ndarray:
    want = np.zeros(SHAPE, np.uint8)
    for layer in layers:
        for lo, ro in pairs:
            want[layer, :, ro] = src[layer, :, lo]
    return want


# ---- on a GPU ----------------------------------------------------------------------------------
@gpu
def test_copies_exactly_the_given_blocks_into_another_processs_cuda_pool(dst):
    src = _local_pool()
    t = CudaIpcTransfer(src, LAYOUT, dst.blob, REMOTE)
    try:
        n = t.send_layer(0, PAIRS) + t.send_layer(2, PAIRS[:3])
        t.flush()
    finally:
        t.close()
    assert n == 2 * (len(PAIRS) + 3) * LAYOUT.block_bytes
    want = _expected(src.cpu().numpy(), [0], PAIRS)
    want[2] = _expected(src.cpu().numpy(), [2], PAIRS[:3])[2]
    np.testing.assert_array_equal(dst.pool(), want)


@gpu
def test_the_prefill_messagers_case_both_pools_exported_by_other_processes(dst):
    src_owner = Owner(LAYOUT, seed=3)
    try:
        src = open_pool(src_owner.blob, LAYOUT)
        assert src.shape == (LAYOUT.num_layers, 2, LAYOUT.num_blocks, LAYOUT.block_bytes)
        t = CudaIpcTransfer(src, LAYOUT, dst.blob, REMOTE)
        for layer in range(LAYOUT.num_layers):
            t.send_layer(layer, PAIRS)
        t.flush()
        t.close()
        del src
        want = _expected(src_owner.pool(), list(range(LAYOUT.num_layers)), PAIRS)
        np.testing.assert_array_equal(dst.pool(), want)
    finally:
        src_owner.stop()


@gpu
def test_a_link_to_a_cuda_receiver_on_this_host_copies_by_cuda_ipc_and_sends_done(dst):
    done = []
    got = threading.Event()
    rx = KVReceiver(None, REMOTE, cuda_ipc=dst.blob,
                    on_done=lambda rid, tok, err: (done.append((rid, tok, err)), got.set()))
    src = _local_pool()
    link = KVLink(src, LAYOUT, rx.endpoint, "auto", timeout_s=10)
    try:
        assert link.kind == "cuda_ipc"
        link.send_layer(1, PAIRS)
        link.flush()  # stream synchronized and the receiver's round trip
        link.send_done("r1", 42)
        assert got.wait(WAIT)
    finally:
        link.close()
        rx.close()
    assert done == [("r1", 42, "")] and rx.rejected == 0
    np.testing.assert_array_equal(dst.pool()[1], _expected(src.cpu().numpy(), [1], PAIRS)[1])


@gpu
def test_a_pool_of_another_size_or_layout_is_refused_before_any_copy(dst):
    with pytest.raises(LayoutMismatch, match=f"is {REMOTE.total_bytes} bytes"):
        open_pool(dst.blob, LAYOUT)  # 16 blocks expected, 12 exported
    with pytest.raises(LayoutMismatch, match="head_dim: local=8 remote=16"):
        CudaIpcTransfer(_local_pool(), LAYOUT, dst.blob, _with(REMOTE, head_dim=16))
    with pytest.raises(LayoutMismatch, match="local CUDA KV pool is"):
        CudaIpcTransfer(_local_pool()[:, :, :8], LAYOUT, dst.blob, REMOTE)
    np.testing.assert_array_equal(dst.pool(), np.zeros(SHAPE, np.uint8))


@gpu
def test_block_ids_out_of_range_are_refused_naming_the_limit(dst):
    t = CudaIpcTransfer(_local_pool(), LAYOUT, dst.blob, REMOTE)
    try:
        with pytest.raises(ValueError, match="remote block 12 out of range 0..11"):
            t.send_layer(0, [(0, 12)])
        with pytest.raises(ValueError, match="layer=3 out of range 0..2"):
            t.send_layer(3, [(0, 0)])
        t.flush()
    finally:
        t.close()
    with pytest.raises(KVTransferError, match="closed"):
        t.send_layer(0, [(0, 0)])


# ---- everywhere: the protocol around the handle ------------------------------------------------
def test_a_handle_round_trips_and_bad_ones_are_refused_naming_the_field():
    assert decode_handle(_handle_blob()).nbytes == 64
    with pytest.raises(ValueError, match="must be 1..4096"):
        decode_handle(b"")
    with pytest.raises(ValueError, match="must be 1..4096"):
        decode_handle(b"\x00" * 5000)
    with pytest.raises(ValueError, match="malformed CUDA IPC handle"):
        decode_handle(b"\x93\x01\x02\x03")
    with pytest.raises(ValueError, match="outside its storage of 64 bytes"):
        decode_handle(_handle_blob(tensor_offset=8))
    with pytest.raises(ValueError, match=r"malformed CUDA IPC handle: Expected `int` >= 1 - at `\$\[1\]`"):
        decode_handle(_handle_blob(nbytes=0))


def test_a_handle_of_another_size_is_refused_before_touching_cuda():
    with pytest.raises(LayoutMismatch, match="CUDA KV pool is 64 bytes"):
        open_pool(_handle_blob(), LAYOUT)


def test_a_receiver_without_a_pool_needs_a_handle():
    with pytest.raises(ValueError, match="no pool and no cuda_ipc"):
        KVReceiver(None, REMOTE)


@pytest.fixture
def cuda_rx():
    """A decode receiver whose pool is on CUDA (only its handle, never opened here)."""
    done: list = []
    got = threading.Event()
    rx = KVReceiver(None, REMOTE, cuda_ipc=_handle_blob(),
                    on_done=lambda rid, tok, err: (done.append((rid, tok, err)), got.set()))
    rx.got, rx.done_msgs = got, done  # type: ignore[attr-defined]
    yield rx
    rx.close()


def test_a_cuda_receiver_rejects_data_and_takes_done_messages(cuda_rx):
    pool = bytearray(LAYOUT.total_bytes)
    t = TcpTransfer(pool, LAYOUT, cuda_rx.endpoint)
    try:
        assert t.peer.cuda_ipc == _handle_blob() and t.peer.segment == ""
        t.send_layer(0, [(0, 0)])
        with pytest.raises(KVTransferError, match="rejected 1: data message, but this receiver's "
                                                  "KV pool is on CUDA"):
            t.flush()
        t.send_done("r7", 3)
        assert cuda_rx.got.wait(WAIT)
    finally:
        t.close()
    assert cuda_rx.done_msgs == [("r7", 3, "")]


def test_a_host_memory_prefill_is_refused_by_a_cuda_decode(cuda_rx):
    for mode in ("auto", "ipc", "tcp"):
        with pytest.raises(KVTransferError, match="its KV pool is on CUDA and takes blocks only by "
                                                  "CUDA IPC"):
            KVLink(bytearray(LAYOUT.total_bytes), LAYOUT, cuda_rx.endpoint, mode)


class OnCuda:
    """Stands in for a CUDA pool where the link refuses before reading it."""
    is_cuda = True


def test_a_cuda_prefill_refuses_every_peer_but_cuda_on_this_host(cuda_rx):
    with pytest.raises(KVTransferError, match="kv_transfer=tcp .* GPU memory over tcp is not built"):
        KVLink(OnCuda(), LAYOUT, cuda_rx.endpoint, "tcp")
    with pytest.raises(KVTransferError, match="CUDA IPC impossible: it runs on another host"):
        KVLink(OnCuda(), LAYOUT, cuda_rx.endpoint, "auto", host="h2")
    cpu_rx = KVReceiver(bytearray(REMOTE.total_bytes), REMOTE, segment="pipeline.x.kv")
    try:
        with pytest.raises(KVTransferError, match="CUDA IPC impossible: its KV pool is not on CUDA"):
            KVLink(OnCuda(), LAYOUT, cpu_rx.endpoint, "auto")
    finally:
        cpu_rx.close()
    assert cuda_rx.rejected == 0


def test_control_only_tcp_refuses_blocks_but_flushes_and_sends_done(cuda_rx):
    t = TcpTransfer(None, LAYOUT, cuda_rx.endpoint)
    try:
        with pytest.raises(KVTransferError, match="GPU memory over tcp is not built"):
            t.send_layer(0, [(0, 0)])
        t.flush()
        t.send_done("r9", error="prefill failed")
        assert cuda_rx.got.wait(WAIT)
    finally:
        t.close()
    assert cuda_rx.done_msgs == [("r9", -1, "prefill failed")]
    with pytest.raises(KVTransferError, match="closed"):
        t.flush()
