# cython: language_level=3
"""Transport hot path (every stage): mapped segments, ring views and doorbells.

Owns `Segment` (a mapping; other extension modules use it through the buffer protocol),
`RingView` (one end of an SPSC or broadcast ring), doorbells and `wait_any`. Owns no naming or
lifetime policy (pipeline/ipc/segment.py and instance.py do) and no layer signal
(layer_signal.pyx does): it maps a file descriptor, lays out or checks a segment, and moves
bytes with the GIL released around waits and large copies. Layouts, counters and the park slice
are shm_atomic.h's; every blocking wait is shm_atomic.pxd's `park_wait`.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.errno cimport errno
from libc.string cimport memcpy, memset, strerror, strncpy
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from posix.unistd cimport getpid

from shm_atomic cimport (PL_DOORBELL_MAGIC, PL_DOORBELL_NAME, PL_DOORBELL_SIZE, PL_MAX_READERS,
                         PL_RING_MAGIC, PL_VERSION, park_wait, pl_cond_fn, pl_doorbell_shm,
                         pl_line_up, pl_load_acquire, pl_now_ns, pl_parker, pl_parker_init,
                         pl_pid_alive, pl_ring, pl_ring_consume, pl_ring_data_offset, pl_ring_hdr,
                         pl_ring_need, pl_ring_peek, pl_ring_readable, pl_ring_set, pl_ring_set_any,
                         pl_ring_shm, pl_ring_writable, pl_ring_write)

from pipeline.ipc.errors import PeerDied

cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int PROT_READ, PROT_WRITE, MAP_SHARED, MAP_POPULATE
    void *MAP_FAILED

# Below this size a copy is cheaper than dropping and re-taking the GIL.
cdef enum:
    NOGIL_COPY = 16384
cdef enum:
    RING_DATA_SLACK = 64  # record header + alignment: keeps a capacity/2 message always placeable

DATA_SLACK = RING_DATA_SLACK
DOORBELL_SIZE = PL_DOORBELL_SIZE  # bytes of a doorbell segment
MAX_READERS = PL_MAX_READERS  # readers of one (broadcast) ring


cdef class Segment:
    """A shared-memory mapping (MAP_SHARED | MAP_POPULATE) that unmaps on close() (refused while
    buffers of it are exported, e.g. to a layer signal view)."""
    cdef void *base
    cdef readonly Py_ssize_t size
    cdef readonly str name
    cdef int exports

    @staticmethod
    def map(int fd, Py_ssize_t size, str name):
        cdef Segment s = Segment.__new__(Segment)
        cdef void *p = mmap(NULL, <size_t>size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, f"mmap of {name} ({size} bytes) failed: {strerror(errno)}")
        s.base, s.size, s.name = p, size, name
        return s

    @property
    def address(self) -> int:
        """Base address in this process, for C code such as the CUDA signal callback."""
        self._check()
        return <Py_ssize_t>self.base

    @property
    def closed(self) -> bool:
        return self.base == NULL

    cdef _check(self):
        if self.base == NULL:
            raise ValueError(f"segment {self.name} is closed")

    def close(self) -> None:
        if self.exports:
            raise BufferError(f"segment {self.name} still has {self.exports} exported buffers")
        if self.base != NULL:
            munmap(self.base, <size_t>self.size)
            self.base = NULL

    def __getbuffer__(self, Py_buffer *view, int flags):
        self._check()
        PyBuffer_FillInfo(view, self, self.base, self.size, 0, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1

    def __dealloc__(self):
        if self.base != NULL and self.exports == 0:
            munmap(self.base, <size_t>self.size)


cdef enum:
    SPIN_PROBE_EVERY = 32


cdef inline int64_t _spin_for(int64_t cur, int *skipped, int64_t budget) noexcept nogil:
    # Spinning turned off by _adapt_spin is retried now and then: the load may have gone.
    if cur == 0 and budget > 0:
        skipped[0] += 1
        if skipped[0] >= SPIN_PROBE_EVERY:
            skipped[0] = 0
            return budget // 4
    return cur


cdef inline void _adapt_spin(int64_t *cur, int64_t budget, int64_t spun, int64_t waited) noexcept nogil:
    # Keep spinning while the spin is what ends the waits. On a box whose cores are busy a
    # spinning waiter steals the CPU its peer needs and loses to parking: waits that end only
    # after parking halve the spin down to nothing.
    if spun > 0 and waited <= spun:
        cur[0] = min(budget, max(cur[0], spun) * 2)
    elif cur[0] > budget // 16:
        cur[0] = cur[0] // 2
    else:
        cur[0] = 0


cdef class RingView:
    """One process's end of a ring: the writer, or reader `reader_index` of 1..N readers."""
    cdef Segment seg
    cdef Segment bell
    cdef pl_ring r
    cdef readonly int is_writer
    cdef int claimed
    cdef public int64_t spin_ns
    cdef public int64_t slice_ns
    cdef public bint adaptive_spin
    cdef int64_t spin_cur
    cdef int spin_skipped

    @staticmethod
    def segment_size(uint32_t num_readers, uint64_t capacity) -> int:
        return pl_line_up(pl_ring_data_offset(num_readers)) + capacity + RING_DATA_SLACK

    @staticmethod
    def doorbell_of(Segment seg) -> str:
        seg._check()
        cdef pl_ring_shm *shm = <pl_ring_shm *>seg.base
        if <size_t>seg.size < sizeof(pl_ring_hdr) or shm.hdr.magic != PL_RING_MAGIC:
            raise ValueError(f"{seg.name} is not a pipeline ring (bad magic)")
        return (<bytes>shm.hdr.doorbell).decode()

    @staticmethod
    def layout(Segment seg, uint32_t num_readers, uint64_t capacity, str doorbell):
        """Initialise a fresh segment as a ring of `capacity` bytes with num_readers readers."""
        seg._check()
        cdef pl_ring_shm *shm = <pl_ring_shm *>seg.base
        cdef uint64_t off = pl_line_up(pl_ring_data_offset(num_readers))
        cdef bytes bname = doorbell.encode()
        if num_readers < 1 or num_readers > PL_MAX_READERS:
            raise ValueError(f"num_readers={num_readers} must be within 1..{PL_MAX_READERS}")
        if len(bname) >= PL_DOORBELL_NAME:
            raise ValueError(f"doorbell name {doorbell!r} longer than {PL_DOORBELL_NAME - 1} bytes")
        if capacity % 64 or <uint64_t>seg.size < off + capacity + RING_DATA_SLACK:
            raise ValueError(f"segment {seg.name} too small for a ring of {capacity} bytes")
        memset(seg.base, 0, off)
        if pl_parker_init(&shm.writer.parker) != 0:
            raise OSError("sem_init failed for the writer parker")
        for i in range(num_readers):
            if pl_parker_init(&shm.readers[i].parker) != 0:
                raise OSError("sem_init failed for a reader parker")
        strncpy(shm.hdr.doorbell, bname, PL_DOORBELL_NAME - 1)
        shm.hdr.num_readers = num_readers
        shm.hdr.size = capacity + RING_DATA_SLACK
        shm.hdr.data_offset = off
        shm.hdr.version = PL_VERSION
        shm.hdr.magic = PL_RING_MAGIC  # last: attachers check it

    def __init__(self, Segment seg, bint writer, int reader_index=0, Segment bell=None,
                 double spin_us=20.0, double slice_s=0.05):
        seg._check()
        cdef pl_ring_shm *shm = <pl_ring_shm *>seg.base
        cdef pl_doorbell_shm *db
        if shm.hdr.magic != PL_RING_MAGIC or shm.hdr.version != PL_VERSION:
            raise ValueError(f"{seg.name} is not a pipeline ring (bad magic or version)")
        if <uint64_t>seg.size < shm.hdr.data_offset + shm.hdr.size:
            raise ValueError(f"{seg.name} is shorter than its ring header says")
        if not 0 <= reader_index < <int>shm.hdr.num_readers:
            raise ValueError(f"reader_index={reader_index} out of range 0..{shm.hdr.num_readers - 1}")
        self.seg, self.bell, self.is_writer = seg, bell, writer
        self.r.shm = shm
        self.r.data = <unsigned char *>seg.base + shm.hdr.data_offset
        self.r.size = shm.hdr.size
        self.r.num_readers = shm.hdr.num_readers
        self.r.reader = reader_index
        self.r.reader_parker = NULL
        if bell is not None:
            bell._check()
            db = <pl_doorbell_shm *>bell.base
            if <size_t>bell.size < sizeof(pl_doorbell_shm) or db.magic != PL_DOORBELL_MAGIC:
                raise ValueError(f"{bell.name} is not a pipeline doorbell")
            self.r.reader_parker = &db.parker
        elif not writer:
            self.r.reader_parker = &shm.readers[reader_index].parker
        self.spin_ns = self.spin_cur = <int64_t>(spin_us * 1000)
        self.slice_ns = <int64_t>(slice_s * 1e9)
        self.adaptive_spin = True

    @property
    def name(self) -> str:
        return self.seg.name

    @property
    def spin_now_ns(self) -> int:
        """The spin budget the next wait will use (adapted from recent waits)."""
        return self.spin_cur if self.adaptive_spin else self.spin_ns

    @property
    def doorbell_name(self) -> str:
        self._live()
        return (<bytes>self.r.shm.hdr.doorbell).decode()

    @property
    def max_message(self) -> int:
        return (self.r.size - RING_DATA_SLACK) // 2

    @property
    def capacity(self) -> int:
        return self.r.size - RING_DATA_SLACK

    @property
    def num_readers(self) -> int:
        return self.r.num_readers

    def writer_pid(self) -> int:
        self._live()
        return self.r.shm.writer.pid

    def reader_pid(self, int i=0) -> int:
        self._reader_ok(i)
        return self.r.shm.readers[i].pid

    def reader_parked(self, int i=0) -> bool:
        """Whether reader i is (about to be) blocked on its semaphore: for diagnostics."""
        self._reader_ok(i)
        cdef pl_parker *p = &self.r.shm.readers[i].parker
        if i == <int>self.r.reader and self.r.reader_parker != NULL:
            p = self.r.reader_parker
        return pl_load_acquire(&p.waiting) != 0

    def writer_parked(self) -> bool:
        self._live()
        return pl_load_acquire(&self.r.shm.writer.parker.waiting) != 0

    cdef inline _live(self):
        if self.seg.base == NULL:
            raise ValueError(f"ring {self.seg.name} is closed")

    cdef _reader_ok(self, int i):
        self._live()
        if not 0 <= i < <int>self.r.num_readers:
            raise ValueError(f"reader index {i} out of range 0..{self.r.num_readers - 1}")

    cdef inline _ready(self):
        self._live()
        if not self.claimed:
            self.claim()

    def claim(self) -> None:
        """Record this process as the writer or as reader `reader_index` (done on first use)."""
        self._live()
        if self.is_writer:
            self.r.shm.writer.pid = getpid()
        else:
            self.r.shm.readers[self.r.reader].pid = getpid()
        self.claimed = 1

    cdef object _dead_peer(self):
        cdef int64_t pid
        if self.is_writer:
            for i in range(self.r.num_readers):
                pid = self.r.shm.readers[i].pid
                if not pl_pid_alive(pid):
                    return f"reader {i} (pid {pid})"
        else:
            pid = self.r.shm.writer.pid
            if not pl_pid_alive(pid):
                return f"writer (pid {pid})"
        return None

    cdef inline int64_t _spin_start(self) noexcept:
        if self.adaptive_spin:
            return _spin_for(self.spin_cur, &self.spin_skipped, self.spin_ns)
        return self.spin_ns

    cdef inline void _spin_end(self, int64_t spun, int64_t start) noexcept:
        if self.adaptive_spin:
            _adapt_spin(&self.spin_cur, self.spin_ns, spun, pl_now_ns() - start)

    cdef _wait(self, object timeout, bint writing):
        cdef int64_t start = pl_now_ns(), spin = self._spin_start()
        cdef pl_parker *p = &self.r.shm.writer.parker if writing else self.r.reader_parker
        cdef pl_cond_fn cond = pl_ring_writable if writing else pl_ring_readable
        if not park_wait(p, cond, &self.r, spin, self.slice_ns, timeout, _ring_peer_died, self):
            raise TimeoutError(f"ring {self.seg.name}: {'no space' if writing else 'no message'} "
                               f"within {timeout} s")
        self._spin_end(spin, start)

    def send(self, data, timeout=None) -> None:
        """Append one message; blocks (spin, then park) while the ring is full."""
        if not self.is_writer:
            raise ValueError(f"ring {self.seg.name}: this end is a reader")
        self._ready()
        cdef Py_buffer view
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            if <uint64_t>view.len > (self.r.size - RING_DATA_SLACK) // 2:
                raise ValueError(f"message of {view.len} bytes exceeds the limit of "
                                 f"{(self.r.size - RING_DATA_SLACK) // 2} bytes (capacity/2) of ring {self.seg.name}")
            self.r.need = pl_ring_need(&self.r, view.len)
            if not pl_ring_writable(&self.r):
                self._wait(timeout, True)
            if view.len >= NOGIL_COPY:
                with nogil:
                    pl_ring_write(&self.r, view.buf, view.len)
            else:
                pl_ring_write(&self.r, view.buf, view.len)
        finally:
            PyBuffer_Release(&view)

    cdef bytes _take(self):
        cdef uint64_t n, seq
        cdef uint64_t off = pl_ring_peek(&self.r, &n, &seq)
        cdef uint64_t want = self.r.shm.readers[self.r.reader].seq
        if seq != want:
            raise RuntimeError(f"ring {self.seg.name} corrupted: record seq {seq}, expected {want}")
        cdef bytes out = PyBytes_FromStringAndSize(NULL, n)
        cdef char *dst = PyBytes_AS_STRING(out)
        cdef const unsigned char *src = self.r.data + off
        if n >= NOGIL_COPY:
            with nogil:
                memcpy(dst, src, n)
        else:
            memcpy(dst, src, n)
        pl_ring_consume(&self.r, n)
        return out

    def recv(self, timeout=None) -> bytes:
        """Take the next message; blocks (spin, then park) while the ring is empty."""
        if self.is_writer:
            raise ValueError(f"ring {self.seg.name}: this end is the writer")
        self._ready()
        if not pl_ring_readable(&self.r):
            self._wait(timeout, False)
        return self._take()

    def try_recv(self):
        """The next message, or None when the ring is empty. Never blocks."""
        if self.is_writer:
            raise ValueError(f"ring {self.seg.name}: this end is the writer")
        self._ready()
        if not pl_ring_readable(&self.r):
            return None
        return self._take()

    def readable(self) -> bool:
        return self.seg.base != NULL and pl_ring_readable(&self.r) != 0

    def close(self) -> None:
        """Unmap this process's view (the name stays until its instance cleans up)."""
        if self.seg is not None:
            self.seg.close()
        if self.bell is not None:
            self.bell.close()


cdef object _ring_peer_died(object view):
    cdef RingView v = <RingView>view
    who = v._dead_peer()
    return None if who is None else PeerDied(f"ring {v.seg.name}: {who} died", name=v.seg.name)


cdef object _rings_peer_died(object views):
    for v in <list>views:
        died = _ring_peer_died(v)
        if died is not None:
            return died
    return None


def layout_doorbell(Segment seg) -> None:
    seg._check()
    if <size_t>seg.size < sizeof(pl_doorbell_shm):
        raise ValueError(f"segment {seg.name} too small for a doorbell")
    memset(seg.base, 0, sizeof(pl_doorbell_shm))
    if pl_parker_init(&(<pl_doorbell_shm *>seg.base).parker) != 0:
        raise OSError("sem_init failed for a doorbell")
    (<pl_doorbell_shm *>seg.base).magic = PL_DOORBELL_MAGIC


def wait_any(list views, object timeout) -> list:
    """Indices of the reader views that hold a message, blocking until one does.

    Every view must be a reader of a ring whose reader parker is the same doorbell segment, so
    one park covers all of them; writers post that doorbell. Spins with the first view's budget."""
    cdef int n = len(views), i
    cdef RingView v
    cdef pl_ring *ptrs[256]
    cdef pl_ring_set s
    cdef int64_t start, spin
    cdef RingView first
    if n == 0 or n > 256:
        raise ValueError(f"wait_any needs 1..256 rings, got {n}")
    for i in range(n):
        v = views[i]
        if v.is_writer or v.seg.base == NULL:
            raise ValueError(f"ring {v.seg.name}: wait_any needs open reader ends")
        v._ready()
        ptrs[i] = &v.r
    first = views[0]
    s.rings, s.n = ptrs, n
    if n > 1:
        for i in range(n):
            v = views[i]
            if v.bell is None or v.doorbell_name != first.doorbell_name:
                raise ValueError(f"wait_any over several rings needs one shared doorbell; "
                                 f"ring {v.seg.name} has {v.doorbell_name or 'none'}")
    start, spin = pl_now_ns(), first._spin_start()
    if not pl_ring_set_any(&s):
        if not park_wait(first.r.reader_parker, pl_ring_set_any, &s, spin, first.slice_ns, timeout,
                         _rings_peer_died, views):
            raise TimeoutError(f"no message on {n} rings within {timeout} s")
        first._spin_end(spin, start)
    return [i for i in range(n) if pl_ring_readable(ptrs[i])]
