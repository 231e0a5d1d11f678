"""Cache messager, decode side: `DecodeMessager` takes a prefill instance's KV in
(prefill/decode disaggregation, seed 000).

A `KVReceiver` over this instance's KV pool at ``config.kv_listen``; its thread (the only
producer of ``kv_ready``) turns each done message into ``KVReady``. The main thread only
blocks, waking every ``spec.ring_timeout_s`` to see that the engine (the ring's reader) lives;
it exits with PeerDied if the engine or the receiver thread's ring send found it dead.
With ``config.curve_keys`` the receiver is a CURVE server (only the deployment's prefill
instances get in); without, ``EngineConfig.check`` refused a kv_listen beyond loopback. The
pool is this instance's shared-memory segment (CPU); on CUDA nothing is mapped here: the
receiver tells peers the pool's CUDA IPC handle and takes only done messages.

State: the ring end, the pool's mapping and the receiver.
"""
from __future__ import annotations

from pipeline.cache.stage_spec import model_of, need_rings
from pipeline.cache.tcp import MAX_TOKEN
from pipeline.cache.tcp_receiver import KVReceiver
from pipeline.ipc.errors import PeerDied
from pipeline.ipc.instance import pid_alive
from pipeline.ipc.segment import attach_segment
from pipeline.messages.kv import KVReady
from pipeline.runtime import rings
from pipeline.runtime.spec import StageSpec


class DecodeMessager:
    def __init__(self, spec: StageSpec) -> None:
        m = model_of(spec)
        if not spec.config.kv_transfer_config.kv_listen:
            raise ValueError("cache messager (decode): config.kv_listen is empty (the gateway "
                             "resolves it to the tcp:// or ipc:// endpoint to listen on)")
        need_rings(spec, "kv_ready")
        self.spec, self.layout = spec, m.kv
        self.rx: KVReceiver | None = None
        self.ready_ch = rings.attach(spec, "kv_ready", "writer")  # messager -> engine
        # On CUDA nothing is mapped here: peers copy into the pool by the handle we pass on.
        self.seg = attach_segment(m.kv_segment) if m.kv_segment is not None else None
        try:
            self.rx = KVReceiver(self.seg, self.layout, spec.config.kv_transfer_config.kv_listen,
                                 segment=m.kv_segment or "",
                                 on_done=self._on_done, cuda_ipc=m.kv_cuda_ipc,
                                 curve_keys=spec.config.curve_keys,
                                 max_token=m.vocab_size - 1 if m.vocab_size > 0 else MAX_TOKEN)
        except BaseException:
            if self.seg is not None:
                self.seg.close()
            self.ready_ch.close()
            raise
        self.endpoint = self.rx.endpoint

    def _on_done(self, req_id: str, token: int, error: str) -> None:
        """On the receiver thread (kv_ready's only producer). Back-pressure from a full ring
        waits, re-checking every ring_timeout_s whether this stage is stopping."""
        msg = KVReady(req_id=req_id, token=-1 if error else token, error=error)
        while True:
            try:
                self.ready_ch.send(msg, timeout=self.spec.ring_timeout_s)
                return
            except TimeoutError:
                if self.rx is None or self.rx.stopping:
                    raise

    def engine_alive(self) -> None:
        """PeerDied if the engine (kv_ready's reader) attached and died."""
        ring = self.ready_ch.ring
        pid = ring.reader_pid()
        if pid > 0 and not pid_alive(pid):
            raise PeerDied(f"ring {ring.name}: reader (pid {pid}) died", name=ring.name)

    def run_forever(self) -> None:
        assert self.rx is not None
        while not self.rx.wait(self.spec.ring_timeout_s):
            self.engine_alive()
        raise self.rx.error or RuntimeError("KV receiver thread ended")

    def close(self) -> None:
        if self.rx is not None:
            self.rx.close()
        self.ready_ch.close()
        if self.seg is not None:
            self.seg.close()
