"""Cache messager stage: layer-wise KV transfer for prefill/decode disaggregation (seed 000).

- transfer: the `KVTransfer` interface, block-pair validation and coalescing into contiguous
  runs, and `IpcTransfer` (same host: copy into the decode instance's shared KV segment,
  mapped by name). The pools' layout, the handshake both ends compare, is
  `messages.kv_layout.KVLayout`
- tcp: `TcpTransfer` and the decode side's `KVReceiver` (ZMQ, zero-copy frames; handshake
  with the receiver's segment and host identity; done messages)
- link: `KVLink` (one decode peer: ipc or tcp data, ZMQ control) and `LinkCache` (bounded LRU)
- messager: `Messager.run_peers` / `run_step`, the layer loop blocking on the worker's
  `ipc.layer_signal`
- stage_spec: what a messager needs of its StageSpec (the worker's exported pool, its rings)
- prefill: `PrefillMessager`, plans shipped layer by layer to the decode peers, KVFinish
  as done messages
- decode: `DecodeMessager`, the receiver's done messages as KVReady for the engine
- stage: the stage process, `run(spec, ready)`: the prefill or decode loop, by role
"""
