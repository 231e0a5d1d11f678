"""Transport: the per-layer "KV written" signal (model worker -> cache messager).

Owns `LayerSignal`: creating one under an `Instance` (owning or a view) and attaching one by
name; the hot path is pipeline._ext.layer_signal (cython_ext/layer_signal.pyx).
State: one small segment with a sequence number per layer (1 + last step published), the
publisher's pid (the creator's from `create` on, a publisher's once it claims or first
publishes) and one parker for the single reader. `publish` is a release store plus a post only
when the reader is parked; on CUDA the same publication is made without Python by the C
function `pipeline_signal_publish(base, step, layer)` (cython_ext/shm_atomic.h) from a host
function launched after the layer's KV write, given `LayerSignal.address`. `wait` blocks on
the semaphore, never sleeps in a polling loop, and raises PeerDied if the publisher died,
even one that died before its first publish.
"""
from __future__ import annotations

from pipeline._ext.layer_signal import SignalView
from pipeline.ipc.instance import Instance
from pipeline.ipc.ring import DEFAULT_SLICE_S
from pipeline.ipc.segment import attach_segment

MAX_LAYERS = 4096


class LayerSignal(SignalView):
    """publish(step, layer); wait(step, layer, timeout) returns once that layer of that step,
    or of a later one, was published; published(layer) -> last step or -1.

    One publisher, publishing steps in increasing order, and one waiting process: the parker
    has a single waiter slot (a second waiter still returns, up to slice_s late)."""

    @classmethod
    def create(cls, instance: Instance, what: str, num_layers: int, spin_us: float = 0.0,
               slice_s: float = DEFAULT_SLICE_S) -> LayerSignal:
        if not 1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers={num_layers} must be within 1..{MAX_LAYERS}")
        seg = instance.create_segment(what, SignalView.size_for(num_layers))
        SignalView.layout(seg, num_layers)  # records this process as the publisher
        return cls(seg, spin_us, slice_s)

    @classmethod
    def attach(cls, name: str, spin_us: float = 0.0,
               slice_s: float = DEFAULT_SLICE_S) -> LayerSignal:
        return cls(attach_segment(name), spin_us, slice_s)

    def __repr__(self) -> str:
        return f"LayerSignal({self.name!r}, layers={self.num_layers})"
