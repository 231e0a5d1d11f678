"""Transport: a CUDA allocation shared between processes of one host (CUDA IPC), the GPU
counterpart of a shared-memory segment.

Owns `CudaIpcHandle` (what a process exports of a contiguous CUDA tensor: torch's CUDA IPC
handle of its storage, its producer's ref counter and the event that orders the export after
the producer's writes, encoded as msgpack, never pickled: a peer's handle may arrive over the
network, and unpickling it could run anything), `export_pool` (the owner's side: the worker's
KV cache), `decode_handle` (checks a blob without touching CUDA) and `open_flat` (maps an
exported allocation as a flat uint8 tensor in another process). The exporting GPU is named by
its UUID and found again by UUID: two processes may number the host's GPUs differently
(CUDA_VISIBLE_DEVICES). torch is imported lazily: importing this module touches neither torch
nor CUDA. Holds no state: the exporter keeps its tensor alive as long as the handle is used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

if TYPE_CHECKING:
    import torch

MAX_CUDA_IPC = 4096  # bytes of an encoded handle (torch's are ~300)
_HANDLE_BYTES = 1024  # bytes of one of its CUDA / ref-counter / event handles
_REBUILD_ARGS = 15  # torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments


class CudaIpcHandle(msgspec.Struct, array_like=True, frozen=True):
    """A contiguous uint8 tensor of `nbytes` on the GPU `gpu_uuid`, as torch's
    `reduce_tensor` describes it (the storage's IPC handle, its producer's ref counter and the
    event that orders the export after the producer's writes)."""
    gpu_uuid: Annotated[str, Meta(min_length=1, max_length=128)]
    nbytes: Annotated[int, Meta(ge=1)]
    tensor_offset: Annotated[int, Meta(ge=0)]  # elements (bytes) into the storage
    storage_handle: Annotated[bytes, Meta(min_length=1, max_length=_HANDLE_BYTES)]
    storage_size_bytes: Annotated[int, Meta(ge=1)]
    storage_offset_bytes: Annotated[int, Meta(ge=0)]  # of the storage in its CUDA allocation
    ref_counter_handle: Annotated[bytes, Meta(max_length=_HANDLE_BYTES)]
    ref_counter_offset: Annotated[int, Meta(ge=0)]
    event_handle: Annotated[bytes, Meta(max_length=_HANDLE_BYTES)] | None
    event_sync_required: bool

    def __post_init__(self) -> None:
        if self.tensor_offset + self.nbytes > self.storage_size_bytes:
            raise ValueError(f"CUDA IPC handle: bytes {self.tensor_offset}..{self.tensor_offset + self.nbytes - 1} "
                             f"outside its storage of {self.storage_size_bytes} bytes")


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(CudaIpcHandle)


def gpu_uuid(index: int) -> str:
    """The UUID of this process's GPU `index`, the same text in every process of the host."""
    import torch
    u = torch.cuda.get_device_properties(index).uuid
    raw = getattr(u, "bytes", None)  # torch's _CUuuid: 16 raw bytes (its str() is their hex too)
    text = "GPU-" + bytes(raw).hex() if raw is not None else str(u)
    if not text or " object at 0x" in text:  # a repr would differ between processes
        raise RuntimeError(f"cannot read the UUID of GPU {index} (torch gives {text!r})")
    return text


def device_of_uuid(uuid: str) -> int:
    """This process's index of the GPU `uuid`; LookupError if it does not see that GPU."""
    import torch
    seen = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise LookupError(f"GPU {uuid} is not visible to this process (it sees "
                          f"{seen or 'no GPU'}; check CUDA_VISIBLE_DEVICES)")
    return seen.index(uuid)


def export_pool(buffer: torch.Tensor) -> bytes:
    """The CUDA IPC handle of the contiguous CUDA tensor `buffer` (all its bytes), as bytes
    for `ModelInfo.kv_cuda_ipc`. The caller keeps `buffer` alive as long as the handle is
    used: a peer that opens it after `buffer` is freed maps freed memory."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor
    if not buffer.is_cuda or not buffer.is_contiguous():
        raise ValueError(f"export_pool: the KV buffer must be a contiguous CUDA tensor, got "
                         f"{buffer.device} contiguous={buffer.is_contiguous()}")
    flat = buffer.detach().reshape(-1).view(torch.uint8)
    fn, args = reduce_tensor(flat)
    # The positional layout of torch's args is not an API: a torch that changed it is refused
    # here, at the worker's start, not by a peer mapping the wrong bytes.
    if fn is not rebuild_cuda_tensor or len(args) != _REBUILD_ARGS:
        raise RuntimeError(f"export_pool: torch {torch.__version__} reduces a CUDA tensor to "
                           f"{getattr(fn, '__name__', fn)} with {len(args)} arguments; this module "
                           f"knows rebuild_cuda_tensor with {_REBUILD_ARGS}")
    (_, size, stride, t_off, _, dtype, device, handle, st_bytes, st_off, _, rc_handle,
     rc_off, ev_handle, ev_sync) = args
    if tuple(size) != (flat.numel(),) or tuple(stride) != (1,) or dtype != torch.uint8:
        raise RuntimeError(f"export_pool: unexpected reduction of a flat uint8 tensor: size={size} "
                           f"stride={stride} dtype={dtype}")
    h = CudaIpcHandle(gpu_uuid(device), flat.numel(), t_off, handle, st_bytes, st_off,
                      rc_handle, rc_off, ev_handle, bool(ev_sync))
    return _enc.encode(h)


def decode_handle(blob: bytes) -> CudaIpcHandle:
    """The handle in `blob`; ValueError naming what is wrong. Touches no CUDA."""
    if not 0 < len(blob) <= MAX_CUDA_IPC:
        raise ValueError(f"CUDA IPC handle of {len(blob)} bytes must be 1..{MAX_CUDA_IPC}")
    try:
        return _dec.decode(blob)
    except msgspec.DecodeError as e:  # ValidationError is one; __post_init__'s ValueError too
        raise ValueError(f"malformed CUDA IPC handle: {e}") from None


def open_flat(h: CudaIpcHandle) -> torch.Tensor:
    """The exported allocation as a flat uint8 tensor on this process's device of the
    exporter's GPU. LookupError if that GPU is not visible here; RuntimeError from CUDA if the
    handle cannot be opened (its owner exited, or this is the exporting process)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    device = device_of_uuid(h.gpu_uuid)
    return rebuild_cuda_tensor(torch.Tensor, (h.nbytes,), (1,), h.tensor_offset,
                               torch.storage.TypedStorage, torch.uint8, device, h.storage_handle,
                               h.storage_size_bytes, h.storage_offset_bytes, False,
                               h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
                               h.event_sync_required)
