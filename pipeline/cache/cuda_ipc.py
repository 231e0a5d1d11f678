"""Cache messager stage: KV blocks copied between two CUDA pools of one host (CUDA IPC).

Owns `open_pool` (an exported KV pool, `ipc.cuda_ipc`, mapped as the uint8 view
`[num_layers, 2 (K, V), num_blocks, block_bytes]`, its size checked against the KVLayout like
`KVLayout.pool`) and `CudaIpcTransfer`, a `KVTransfer` that copies each contiguous run of
blocks of a layer (K, then V: one copy each) from the local CUDA pool straight into the
decode instance's, on a dedicated CUDA stream; `flush` waits for it. torch is imported
lazily: importing this module touches neither torch nor CUDA.
State: CudaIpcTransfer: the two pool views and its stream.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.cache.transfer import KVTransfer, KVTransferError, runs
from pipeline.ipc.cuda_ipc import decode_handle, open_flat
from pipeline.messages.kv_layout import KVLayout, LayoutMismatch

if TYPE_CHECKING:
    import torch


def open_pool(blob: bytes, layout: KVLayout) -> torch.Tensor:
    """uint8 view `[num_layers, 2, num_blocks, block_bytes]` of the pool exported in `blob`
    (`ipc.cuda_ipc.export_pool`), mapped on this process's device of the exporter's GPU.
    LayoutMismatch if its size is not the layout's (checked before mapping); ValueError for a
    malformed blob; LookupError / RuntimeError as `ipc.cuda_ipc.open_flat`."""
    h = decode_handle(blob)
    if h.nbytes != layout.total_bytes:
        raise LayoutMismatch(f"CUDA KV pool is {h.nbytes} bytes, its layout says "
                             f"{layout.total_bytes} ({layout})")
    flat = open_flat(h)
    return flat.view(layout.num_layers, 2, layout.num_blocks, layout.block_bytes)


class CudaIpcTransfer(KVTransfer):
    """Same host, both pools on CUDA: copy into the decode instance's pool, opened from its
    `remote_blob` (its worker's export, from the handshake). `local_pool`: this instance's
    pool as `open_pool` returns it. Copies are queued on this transfer's own stream (on the
    local pool's GPU; a peer GPU is written by a peer copy) and `flush` waits for them."""

    def __init__(self, local_pool: torch.Tensor, local: KVLayout, remote_blob: bytes,
                 remote: KVLayout) -> None:
        import torch
        local.check_peer(remote)
        want = (local.num_layers, 2, local.num_blocks, local.block_bytes)
        if not local_pool.is_cuda or tuple(local_pool.shape) != want or local_pool.dtype != torch.uint8:
            raise LayoutMismatch(f"local CUDA KV pool is {local_pool.dtype} {tuple(local_pool.shape)} "
                                 f"on {local_pool.device}, its layout says uint8 {want} on CUDA")
        self.local, self.remote = local, remote
        self._src: Any = local_pool
        self._dst: Any = open_pool(remote_blob, remote)
        self._stream: Any = torch.cuda.Stream(device=local_pool.device)
        self.device = local_pool.device

    def send_layer(self, layer: int, pairs: object) -> int:
        import torch
        if self._src is None or self._dst is None:
            raise KVTransferError("CUDA IPC transfer is closed")
        arr = self.check(layer, pairs)
        src, dst = self._src[layer], self._dst[layer]
        try:
            with torch.cuda.stream(self._stream):
                for lo, ro, n in runs(arr):
                    for kv in (0, 1):  # each a contiguous slab: one (peer) memcpy
                        dst[kv, ro:ro + n].copy_(src[kv, lo:lo + n], non_blocking=True)
        except RuntimeError as e:  # a CUDA error: this peer fails, the step's report says why
            raise KVTransferError(f"CUDA IPC copy of layer {layer} failed: {e}") from e
        return 2 * len(arr) * self.local.block_bytes

    def flush(self) -> None:
        if self._stream is None:
            raise KVTransferError("CUDA IPC transfer is closed")
        try:
            self._stream.synchronize()
        except RuntimeError as e:
            raise KVTransferError(f"CUDA IPC copies failed: {e}") from e

    def close(self) -> None:
        if self._stream is not None:
            try:  # copies still queued must not outlive the mapping they write
                self._stream.synchronize()
            except RuntimeError:
                pass
        self._src = self._dst = self._stream = None  # the views pin the peer's mapping
