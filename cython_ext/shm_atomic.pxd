# cython: language_level=3
"""Cython side of shm_atomic.h, cimported by shmring.pyx and layer_signal.pyx.

Owns: the declarations of the header's layouts, constants and C functions (the header stays
the one written source of the shared layout: no offset or size is repeated here), and
`park_wait`, the one blocking loop every transport wait runs. Compiled into each module that
cimports it (inline functions only, nothing to import at run time).
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t
from cpython.exc cimport PyErr_CheckSignals

cdef extern from "shm_atomic.h" nogil:
    uint64_t PL_RING_MAGIC, PL_DOORBELL_MAGIC, PL_SIGNAL_MAGIC
    uint32_t PL_VERSION
    enum:
        PL_MAX_READERS
        PL_DOORBELL_NAME
        PL_DOORBELL_SIZE
    ctypedef int (*pl_cond_fn)(const void *ctx)
    ctypedef struct pl_parker:
        uint64_t waiting
    ctypedef struct pl_ring_hdr:
        uint64_t magic
        uint32_t version
        uint32_t num_readers
        uint64_t size
        uint64_t data_offset
        char doorbell[PL_DOORBELL_NAME]
    ctypedef struct pl_ring_side:
        uint64_t pos
        uint64_t seq
        int64_t pid
        pl_parker parker
    ctypedef struct pl_ring_shm:
        pl_ring_hdr hdr
        pl_ring_side writer
        pl_ring_side *readers
    ctypedef struct pl_ring:
        pl_ring_shm *shm
        unsigned char *data
        uint64_t size
        uint32_t num_readers
        uint32_t reader
        pl_parker *reader_parker
        uint64_t need
    ctypedef struct pl_ring_set:
        pl_ring **rings
        int n
    ctypedef struct pl_doorbell_shm:
        uint64_t magic
        pl_parker parker
    ctypedef struct pl_signal_shm:
        uint64_t magic
        uint32_t version
        uint32_t num_layers
        int64_t publisher_pid
        pl_parker parker
        uint64_t *seq
    ctypedef struct pl_signal_wait:
        pl_signal_shm *shm
        int layer
        uint64_t target
    int64_t pl_now_ns()
    int pl_parker_init(pl_parker *p)
    int pl_wait_slice(pl_parker *p, pl_cond_fn cond, const void *ctx, int64_t spin_ns, int64_t slice_ns)
    int pl_pid_alive(int64_t pid)
    uint64_t pl_load_acquire(const uint64_t *p)
    uint64_t pl_line_up(uint64_t n)
    uint64_t pl_ring_data_offset(uint32_t num_readers)
    int pl_ring_readable(const void *ctx)
    int pl_ring_writable(const void *ctx)
    int pl_ring_set_any(const void *ctx)
    uint64_t pl_ring_need(const pl_ring *r, uint64_t len)
    void pl_ring_write(pl_ring *r, const void *buf, uint64_t length)
    uint64_t pl_ring_peek(pl_ring *r, uint64_t *length, uint64_t *seq)
    void pl_ring_consume(pl_ring *r, uint64_t length)
    uint64_t pl_signal_size(uint32_t num_layers)
    int pl_signal_ready(const void *ctx)
    void pipeline_signal_publish(void *base, int64_t step, int layer)


# The PeerDied to raise when a peer of `owner` died (naming it), else None. Runs with the GIL.
ctypedef object (*peer_died_fn)(object owner)


cdef inline int park_wait(pl_parker *p, pl_cond_fn cond, const void *ctx, int64_t spin_ns,
                          int64_t slice_ns, object timeout, peer_died_fn peer_died,
                          object owner) except -1:
    """Block until cond(ctx) holds: 1, or 0 once `timeout` seconds (None: never) passed first.

    Each slice spins up to spin_ns (first slice only), then parks on `p` with the eventcount
    handshake for at most slice_ns, with the GIL released. Between slices it runs the process's
    signal handlers (whatever they raise propagates) and raises what peer_died(owner) returns
    unless the condition came true meanwhile (a peer may publish, then exit)."""
    cdef int64_t now = pl_now_ns(), deadline = -1, sl
    cdef int ok
    if timeout is not None:
        deadline = now + <int64_t>(float(timeout) * 1e9)
    while True:
        sl = slice_ns
        if deadline >= 0:
            if deadline - now <= 0:
                return cond(ctx) != 0
            sl = min(sl, deadline - now)
        with nogil:
            ok = pl_wait_slice(p, cond, ctx, spin_ns, sl)
        if ok:
            return 1
        spin_ns = 0
        PyErr_CheckSignals()  # SIGTERM/SIGINT handlers run while we block
        died = peer_died(owner)
        if died is not None and not cond(ctx):
            raise died
        now = pl_now_ns()
