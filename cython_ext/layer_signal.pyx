# cython: language_level=3
"""Transport hot path of the per-layer "KV written" signal (model worker -> cache messager).

Owns `SignalView`: one process's view of a layer-signal segment (shm_atomic.h's
pl_signal_shm: per-layer sequence numbers, the publisher's pid, one reader parker) mapped in a
pipeline._ext.shmring `Segment`, whose buffer it holds while open so the mapping cannot go
away under it. Owns no naming or lifetime (pipeline/ipc/layer_signal.py and instance.py do).
Publishing is a release store plus a post only when the reader is parked; waiting is
shm_atomic.pxd's `park_wait`, with the GIL released while parked.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from posix.unistd cimport getpid

from shm_atomic cimport (PL_SIGNAL_MAGIC, PL_VERSION, park_wait, pipeline_signal_publish,
                         pl_load_acquire, pl_parker_init, pl_pid_alive, pl_signal_ready,
                         pl_signal_shm, pl_signal_size, pl_signal_wait)

from pipeline._ext.shmring import Segment
from pipeline.ipc.errors import PeerDied


cdef int _map(object seg, Py_buffer *buf) except -1:
    # A closed segment refuses the export with "segment NAME is closed", as before.
    if not isinstance(seg, Segment):
        raise TypeError(f"a layer signal lives in a Segment, got {type(seg).__name__}")
    return PyObject_GetBuffer(seg, buf, PyBUF_WRITABLE)


cdef class SignalView:
    """Per-layer sequence numbers with one parked reader (worker -> cache messager)."""
    cdef object seg
    cdef Py_buffer buf  # held from __init__ to close()
    cdef pl_signal_shm *shm  # NULL when closed
    cdef int claimed
    cdef public int64_t spin_ns
    cdef public int64_t slice_ns

    @staticmethod
    def size_for(uint32_t num_layers) -> int:
        return pl_signal_size(num_layers)

    @staticmethod
    def layout(seg, uint32_t num_layers):
        """Initialise a fresh segment; this process is recorded as the publisher until another
        process claims the signal, so a reader sees it die even before it ever publishes."""
        cdef Py_buffer b
        _map(seg, &b)
        cdef pl_signal_shm *shm = <pl_signal_shm *>b.buf
        try:
            if <uint64_t>b.len < pl_signal_size(num_layers):
                raise ValueError(f"segment {seg.name} too small for {num_layers} layers")
            memset(b.buf, 0, pl_signal_size(num_layers))
            if pl_parker_init(&shm.parker) != 0:
                raise OSError("sem_init failed for a layer signal")
            shm.num_layers = num_layers
            shm.publisher_pid = getpid()
            shm.version = PL_VERSION
            shm.magic = PL_SIGNAL_MAGIC  # last: attachers check it
        finally:
            PyBuffer_Release(&b)

    def __init__(self, seg, double spin_us=0.0, double slice_s=0.05):
        if self.shm != NULL:
            raise ValueError(f"layer signal {self.seg.name} is already open")
        _map(seg, &self.buf)
        cdef pl_signal_shm *shm = <pl_signal_shm *>self.buf.buf
        if (<size_t>self.buf.len < sizeof(pl_signal_shm) or shm.magic != PL_SIGNAL_MAGIC
                or shm.version != PL_VERSION):
            PyBuffer_Release(&self.buf)
            raise ValueError(f"{seg.name} is not a pipeline layer signal (bad magic or version)")
        self.seg, self.shm = seg, shm
        self.spin_ns = <int64_t>(spin_us * 1000)
        self.slice_ns = <int64_t>(slice_s * 1e9)

    @property
    def name(self) -> str:
        return self.seg.name

    cdef inline _open(self):
        if self.shm == NULL:
            raise ValueError(f"segment {self.seg.name} is closed")

    @property
    def num_layers(self) -> int:
        self._open()
        return self.shm.num_layers

    @property
    def address(self) -> int:
        """Base address in this process, for C code such as the CUDA signal callback."""
        self._open()
        return <Py_ssize_t>self.shm

    def publisher_pid(self) -> int:
        """The pid recorded as the publisher (the creator's until a publisher claims)."""
        self._open()
        return self.shm.publisher_pid

    def reader_parked(self) -> bool:
        """Whether the reader is (about to be) blocked on its semaphore: for diagnostics."""
        self._open()
        return pl_load_acquire(&self.shm.parker.waiting) != 0

    def claim_publisher(self) -> None:
        self._open()
        self.shm.publisher_pid = getpid()
        self.claimed = 1

    cdef _check_layer(self, int64_t step, int layer):
        if self.shm == NULL:
            raise ValueError(f"layer signal {self.seg.name} is closed")
        if not 0 <= layer < <int>self.shm.num_layers:
            raise ValueError(f"layer={layer} out of range 0..{self.shm.num_layers - 1}")
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")

    def publish(self, int64_t step, int layer) -> None:
        self._check_layer(step, layer)
        if not self.claimed:
            self.claim_publisher()
        pipeline_signal_publish(self.shm, step, layer)

    def published(self, int layer) -> int:
        """The last step published for `layer`, or -1. Never blocks."""
        self._check_layer(0, layer)
        return <int64_t>pl_load_acquire(&self.shm.seq[layer]) - 1

    def wait(self, int64_t step, int layer, timeout=None) -> None:
        self._check_layer(step, layer)
        cdef pl_signal_wait w
        w.shm, w.layer, w.target = self.shm, layer, <uint64_t>step + 1
        if pl_signal_ready(&w):
            return
        if not park_wait(&self.shm.parker, pl_signal_ready, &w, self.spin_ns, self.slice_ns,
                         timeout, _publisher_died, self):
            raise TimeoutError(f"layer signal {self.seg.name}: step {step} layer {layer} "
                               f"not published within {timeout} s")

    def close(self) -> None:
        """Release the segment's buffer and unmap it (the name stays until its owner unlinks)."""
        if self.shm != NULL:
            self.shm = NULL
            PyBuffer_Release(&self.buf)
        if self.seg is not None:
            self.seg.close()

    def __dealloc__(self):
        if self.shm != NULL:
            PyBuffer_Release(&self.buf)


cdef object _publisher_died(object view):
    cdef SignalView s = <SignalView>view
    cdef int64_t pid = s.shm.publisher_pid
    if pl_pid_alive(pid):
        return None
    return PeerDied(f"layer signal {s.seg.name}: publisher (pid {pid}) died", name=s.seg.name)
