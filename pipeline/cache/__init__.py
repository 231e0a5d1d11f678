"""Cache messager stage: layer-wise KV transfer for prefill/decode disaggregation (seed 000).

Built so far (issue 10, not yet wired into the engine or the worker):
- layout: `KVLayout` (the handshake: block size, dtype, head layout, model hash must match),
  the byte view of a KV pool, block-pair validation and coalescing into contiguous runs
- transfer: the `KVTransfer` interface and `IpcTransfer` (same host: copy into the decode
  instance's shared KV segment, mapped by name)
- tcp: `TcpTransfer` and the decode side's `KVReceiver` (ZMQ, zero-copy frames)
- messager: `Messager.run_step`, the layer loop blocking on the worker's `ipc.layer_signal`
"""
