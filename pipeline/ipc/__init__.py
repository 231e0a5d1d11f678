"""Transport: shared-memory rings, broadcast ring, layer signal, naming and lifetime.

Owns nothing itself; re-exports the transport errors. Modules:
- segment: create (exclusive, 0600, space reserved) / attach / unlink one segment by name, and
  the exit/SIGTERM hooks that unlink this process's names (`create_segment`, `attach_segment`)
- instance: `Instance` (per-instance name prefix, owner record, cleanup on exit/SIGTERM;
  `Instance.view(id)` for the instance's other processes), `unlink_instance`
- sweep: `sweep_stale` (unlink the names of dead instances, orphan grace)
- ring: `Ring` (SPSC), `Doorbell` and `wait_any` (one reader blocking on several rings)
- broadcast: `BroadcastRing` (engine -> TP workers, the writer waits for the slowest reader)
- layer_signal: `LayerSignal` (worker -> cache messager, per-layer "KV written")
- cuda_ipc: a CUDA allocation shared across processes (`export_pool`, `open_flat`; the KV
  cache of prefill/decode instances on CUDA), torch imported lazily
- codec: msgspec msgpack encode/decode, token ids as raw little-endian int32 bytes
- errors: `PeerDied`, `ShmSpaceError`
- curve: the ZMQ CURVE keys every channel between processes and hosts uses (client, router,
  KV transfer, TP step plans) and `pipeline keys`
Hot paths: pipeline._ext.shmring and pipeline._ext.layer_signal (cython_ext/).
"""
from pipeline.ipc.errors import PeerDied, ShmSpaceError

__all__ = ["PeerDied", "ShmSpaceError"]
