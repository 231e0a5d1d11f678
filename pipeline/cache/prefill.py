"""Cache messager, prefill side: `PrefillMessager` ships this instance's KV to decode
instances (prefill/decode disaggregation, seed 000).

It reads ``kv_plans`` (engine -> messager). A ``TransferPlan`` is shipped layer by layer as
the worker publishes each layer on the ``layers`` LayerSignal (blocking waits, no polling), to
every decode peer of the plan at once over a cached `KVLink` per peer (ipc when allowed and
possible, else tcp), and answered with exactly one ``TransferReport`` on ``kv_reports``: a
failing peer fails only its own sends (its link is dropped and made anew next time), a dead
worker or a layer time-out the whole step. A ``KVFinish`` becomes a done message to its peer
(after that link's blocks: ring order and ZMQ order), carrying the error instead of the token
when that request's transfer to that peer had failed; a peer that cannot be reached is logged
and skipped (the decode side times the request out). A malformed message is logged and
skipped; nothing waits on a dead peer beyond ``config.kv_transfer_timeout`` (a handshake, at
most CONNECT_TIMEOUT_S). With ``config.curve_keys`` every link is a CURVE client.
The worker's pool is read from shared memory (``spec.model.kv_segment``, CPU) or mapped by
CUDA IPC (``spec.model.kv_cuda_ipc``, `cuda_ipc.open_pool`); on CUDA it ships only by CUDA
IPC into decode pools on CUDA on this host (config.kv_transfer "tcp" is refused at start: tcp
from GPU memory is not built).

With a KV tier beside it (``cache.role_tier``) a ``TierPlan`` on kv_plans goes to
``on_other`` (the tier's thread) and both write kv_reports under ``report_lock``.

State: the ring ends, the layer signal, the local pool's mapping, the links (`LinkCache`) and,
per (peer, remote request) whose transfer failed, why (bounded, for its KVFinish).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from pipeline.cache.cuda_ipc import open_pool
from pipeline.cache.link import MODES, KVLink, LinkCache, check_peer_endpoint
from pipeline.cache.messager import Messager
from pipeline.cache.stage_spec import model_of, need_rings
from pipeline.cache.tcp import MAX_REQ_ID
from pipeline.cache.transfer import KVTransferError
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.segment import attach_segment
from pipeline.messages.kv import KVFinish, TransferPlan, TransferReport, bytes_to_pairs
from pipeline.runtime import rings
from pipeline.runtime.process import log
from pipeline.runtime.spec import StageSpec

CONNECT_TIMEOUT_S = 5.0  # a handshake's reply (capped by config.kv_transfer_timeout)
MAX_LINKS = 64  # decode peers with an open link
RETRY_S = 2.0  # a peer whose connect failed is refused this long (one time-out, not one a step)
MAX_FAILED = 4096  # remembered failed transfers awaiting their KVFinish
MAX_WHY = 512  # characters of one request's failure in a TransferReport


class PrefillMessager:
    def __init__(self, spec: StageSpec) -> None:
        m = model_of(spec)
        cfg = spec.config
        if cfg.kv_transfer_config.kv_transfer not in MODES:
            raise ValueError(f"cache messager: config.kv_transfer={cfg.kv_transfer_config.kv_transfer!r} "
                             f"must be one of {MODES}")
        need_rings(spec, "kv_plans", "kv_reports", "layers")  # layers: the worker's LayerSignal
        self.spec, self.layout = spec, m.kv
        self.timeout_s = cfg.kv_transfer_config.kv_transfer_timeout
        if m.kv_cuda_ipc and cfg.kv_transfer_config.kv_transfer == "tcp":
            raise ValueError("cache messager: config.kv_transfer='tcp' with the KV cache on CUDA: "
                             "sending blocks from GPU memory over tcp is not built (use auto or ipc: "
                             "CUDA IPC to decode instances on CUDA on this host)")
        self.signal = LayerSignal.attach(spec.rings["layers"])
        self.seg = None
        self.pool: object = None  # what the links read: the segment (CPU) or the CUDA view
        try:
            if self.signal.num_layers != self.layout.num_layers:
                raise ValueError(f"cache messager: layer signal {self.signal.name} has "
                                 f"{self.signal.num_layers} layers, the KV cache {self.layout.num_layers}")
            if m.kv_segment is not None:
                self.seg = attach_segment(m.kv_segment)
                self.layout.pool(self.seg)  # its size matches the layout, or LayoutMismatch now
                self.pool = self.seg
            else:
                self.pool = open_pool(m.kv_cuda_ipc, self.layout)  # size checked the same way
            self.plans = rings.attach(spec, "kv_plans")  # engine -> messager
            self.reports = rings.attach(spec, "kv_reports", "writer")  # messager -> engine
        except BaseException:
            self.signal.close()
            self.pool = None
            if self.seg is not None:
                self.seg.close()
            raise
        pool, layout, mode, local = self.pool, self.layout, cfg.kv_transfer_config.kv_transfer, m.kv_segment or ""
        connect_s = min(CONNECT_TIMEOUT_S, self.timeout_s)
        self.links = LinkCache(lambda peer: KVLink(
            pool, layout, peer, mode, timeout_s=self.timeout_s, connect_timeout_s=connect_s,
            local_segment=local, curve_keys=cfg.curve_keys), MAX_LINKS, RETRY_S)
        self.messager = Messager(self.signal, layer_timeout_s=self.timeout_s,
                                 num_layers=layout.num_layers)
        self.failed: OrderedDict[tuple[str, str], str] = OrderedDict()  # (peer, remote id) -> why
        # A KV tier's thread beside this loop (cache.role_tier): where its plans go, and the
        # lock that keeps kv_reports single-producer.
        self.on_other: Callable[[Any], None] | None = None
        self.report_lock = threading.Lock()

    def send_report(self, rep: Any) -> None:
        """A report to the engine (kv_reports), from this loop or the tier's thread."""
        with self.report_lock:
            self.reports.send(rep)

    # ---- the loop ----
    def run_forever(self) -> None:
        while True:
            self.handle_next(self.spec.ring_timeout_s)

    def handle_next(self, timeout: float | None) -> bool:
        """Handle one message of kv_plans (False: none within `timeout`). PeerDied if the
        engine died (or the report cannot reach it)."""
        try:
            msg = self.plans.recv(timeout)
        except TimeoutError:
            return False
        except (ValueError, msgspec.MsgspecError) as e:
            log(self.spec, f"rejected a malformed message on kv_plans: {e}")
            return True
        if isinstance(msg, TransferPlan):
            rep = self.transfer(msg)
            try:
                self.send_report(rep)
            except ValueError:  # over the ring's limit: the reasons shortened, never dropped
                rep.failed = {rid: why[:64] for rid, why in rep.failed.items()}
                self.send_report(rep)
        elif isinstance(msg, KVFinish):
            try:
                self.finish(msg)
            except Exception as e:  # noqa: BLE001 - one bad message must not end the stage
                log(self.spec, f"KVFinish of {msg.req_id!r} dropped: {type(e).__name__}: {e}")
        elif self.on_other is not None:
            self.on_other(msg)
        return True

    # ---- TransferPlan ----
    def transfer(self, plan: TransferPlan) -> TransferReport:
        """Ship the plan; exactly one report, naming every send that did not arrive."""
        try:
            rep = self._transfer(plan)
        except Exception as e:  # noqa: BLE001 - still one report, every send failed
            log(self.spec, f"step {plan.step_id}: transfer failed: {type(e).__name__}: {e}")
            rep = TransferReport(plan.step_id, dict.fromkeys(
                (s.req_id for s in plan.sends), f"cache messager: {type(e).__name__}: {e}"), 0)
        for s in plan.sends:
            why = rep.failed.get(s.req_id)
            if why is not None:
                self._remember(s.peer, s.remote_req_id, why)
        rep.failed = {rid: why[:MAX_WHY] for rid, why in rep.failed.items()}
        return rep

    def _transfer(self, plan: TransferPlan) -> TransferReport:
        failed: dict[str, str] = {}
        groups: dict[str, dict[str, object]] = {}  # peer -> req id -> pairs
        peer_of: dict[str, str] = {}
        for s in plan.sends:
            if s.req_id in peer_of or s.req_id in failed:
                failed[s.req_id] = "bad transfer plan: request listed twice in one step"
                if s.req_id in peer_of:
                    groups[peer_of.pop(s.req_id)].pop(s.req_id)
                continue
            try:
                check_peer_endpoint(s.peer)
                if not 0 < len(s.remote_req_id) <= MAX_REQ_ID:
                    raise ValueError(f"remote_req_id of {len(s.remote_req_id)} characters must be "
                                     f"1..{MAX_REQ_ID}")
                if len(s.pairs) % 8:
                    raise ValueError(f"pairs of {len(s.pairs)} bytes are not whole (local, remote) "
                                     f"int32 pairs")
            except ValueError as e:
                failed[s.req_id] = f"bad transfer plan: {e}"
                continue
            peer_of[s.req_id] = s.peer
            groups.setdefault(s.peer, {})[s.req_id] = bytes_to_pairs(s.pairs)
        peers = {}
        for peer, reqs in groups.items():
            if not reqs:
                continue
            try:
                peers[peer] = (self.links.get(peer), reqs)
            except Exception as e:  # noqa: BLE001 - that peer's sends fail, the others go on
                why = f"KV peer {peer}: {type(e).__name__}: {e}"
                log(self.spec, f"step {plan.step_id}: {why}")
                failed.update(dict.fromkeys(reqs, why))
        rep = self.messager.run_peers(plan.step_id, peers)
        for peer, why in rep.peers_failed.items():
            log(self.spec, f"step {plan.step_id}: KV peer {peer} failed, link dropped: {why}")
            self.links.drop(peer)
        failed.update(rep.failed)
        return TransferReport(plan.step_id, failed, rep.bytes)

    def _remember(self, peer: str, remote_req_id: str, why: str) -> None:
        self.failed[(peer, remote_req_id)] = why
        self.failed.move_to_end((peer, remote_req_id))
        while len(self.failed) > MAX_FAILED:
            self.failed.popitem(last=False)

    # ---- KVFinish ----
    def finish(self, f: KVFinish) -> None:
        """The done message to the peer: the token, or why the request failed (the engine's
        error, else this link's failed transfer of it). Unreachable peer: logged, dropped."""
        why = self.failed.pop((f.peer, f.remote_req_id), "")
        error = f.error or why
        if not error and f.token < 0:
            error = "the prefill instance finished without a first token"
        try:
            link = self.links.get(f.peer)
        except Exception as e:  # noqa: BLE001 - the decode side times the request out
            log(self.spec, f"KVFinish of {f.req_id!r}: peer {f.peer} unreachable, done message "
                           f"for {f.remote_req_id!r} dropped: {type(e).__name__}: {e}")
            return
        try:
            link.send_done(f.remote_req_id, f.token, error)
        except KVTransferError as e:
            log(self.spec, f"KVFinish of {f.req_id!r}: done message to {f.peer} lost, link "
                           f"dropped: {e}")
            self.links.drop(f.peer)

    def close(self) -> None:
        self.links.close()
        for ch in (self.plans, self.reports):
            ch.close()
        self.signal.close()
        self.pool = None  # the CUDA view pins the worker's mapping
        if self.seg is not None:
            try:
                self.seg.close()
            except BufferError:  # a zero-copy frame still queued in ZMQ: the process exits anyway
                pass
