/* Transport hot path shared by every stage: 8-byte counters in POSIX shared memory, the
 * eventcount park/wake helper, the byte ring (SPSC and one-writer/N-reader broadcast) and the
 * per-layer signal. The one written source of every shared-memory layout below: Cython
 * declares it in cython_ext/shm_atomic.pxd (used, GIL released, by shmring.pyx and
 * layer_signal.pyx), the CUDA host-function callback (cuda_ops/, C++) includes it directly, so
 * it is plain C that also compiles as C++: GCC __atomic builtins instead of C11 <stdatomic.h>,
 * which C++ before C++23 lacks.
 *
 * Ordering rules. A counter (ring head/tail, layer sequence) is only ever written with a
 * release store after the bytes it covers, and read with an acquire load before those bytes.
 * A waiter parks with the eventcount handshake:
 *     waiter:    drain stale posts; waiting = 1; FULL FENCE; re-check condition; sem wait
 *     publisher: publish counter (release); FULL FENCE; if waiting: waiting = 0, sem post
 * Either the waiter's re-check sees the publication or the publisher sees the flag, so no
 * wake-up is lost. Semaphores are process-shared unnamed semaphores living inside the
 * segment (sem_init pshared=1): nothing else to name, track or unlink.
 *
 * Shared-memory layouts (little-endian, every line 64 bytes):
 *
 * Ring segment (PL_RING_MAGIC), readers = 1 for SPSC, N for broadcast:
 *   0     pl_ring_hdr: magic u64, version u32, num_readers u32, size u64 (data bytes),
 *         data_offset u64, doorbell[192] (name of an external reader-0 parker or "")
 *   256   writer line: head u64 (bytes ever published), seq u64, pid i64
 *   320   writer parker (the writer parks here when the ring is full)
 *   384 + 128*i  reader i line: tail u64 (bytes ever consumed), seq u64, pid i64
 *   448 + 128*i  reader i parker (reader i parks here when the ring is empty)
 *   data_offset  data[size]: records, each 16-byte aligned:
 *         len u32 (0xFFFFFFFF = wrap marker: skip to offset 0), flags u32, seq u64, payload
 *
 * Doorbell segment (PL_DOORBELL_MAGIC, pl_doorbell_shm, PL_DOORBELL_SIZE bytes): magic u64 at
 * 0, parker at 64. Several rings with the same reader point their reader-0 parker at one
 * doorbell so the reader blocks on all of them.
 *
 * Layer signal segment (PL_SIGNAL_MAGIC):
 *   0     magic u64, version u32, num_layers u32
 *   16    publisher pid i64: written by the creator when it lays the segment out (before the
 *         magic), so a waiting reader sees the publisher die even before its first publish;
 *         a publisher in another process overwrites it when it claims the signal (at the
 *         latest on its first publish). 0 (never written) means "no publisher to check".
 *   64    reader parker
 *   128   seq[num_layers] u64: 1 + the last step whose layer was published, 0 = never
 *
 * PL_VERSION changes whenever any of these layouts does.
 */
#ifndef PIPELINE_SHM_ATOMIC_H
#define PIPELINE_SHM_ATOMIC_H

#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* kill, O_CLOEXEC, clock_gettime under strict -std=c11 */
#endif

#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define PL_RING_MAGIC 0x31474e4952504950ULL     /* "PIPRING1" */
#define PL_DOORBELL_MAGIC 0x314c4c4542504950ULL /* "PIPBELL1" */
#define PL_SIGNAL_MAGIC 0x314c474953504950ULL   /* "PIPSIGL1" */
#define PL_VERSION 1u
#define PL_MAX_READERS 64
#define PL_WRAP 0xFFFFFFFFu
#define PL_REC_HDR 16u
#define PL_DOORBELL_NAME 192
#define PL_LINE 64u /* every shared line; ring data starts on a line */

/* sem_clockwait (glibc >= 2.30, GNU) parks against CLOCK_MONOTONIC: immune to clock steps. */
#if defined(_GNU_SOURCE) && defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define PL_HAVE_CLOCKWAIT 1
#else
#define PL_HAVE_CLOCKWAIT 0
#endif

/* ---- atomics ------------------------------------------------------------------------- */
static inline uint64_t pl_load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint64_t pl_load_relaxed(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void pl_store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void pl_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline void pl_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int64_t pl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- eventcount parker ------------------------------------------------------------------ */
typedef struct {
    uint64_t waiting; /* 1 while the single waiter may be blocked in sem wait */
    uint64_t _pad0;
    sem_t sem;
    char _pad1[64 - 16 - sizeof(sem_t)];
} pl_parker;

static inline int pl_parker_init(pl_parker *p)
{
    __atomic_store_n(&p->waiting, 0, __ATOMIC_RELAXED);
    return sem_init(&p->sem, 1, 0);
}

/* Publisher side, called after the release store that made the condition true. */
static inline void pl_parker_wake(pl_parker *p)
{
    pl_fence();
    if (__atomic_load_n(&p->waiting, __ATOMIC_RELAXED) &&
        __atomic_exchange_n(&p->waiting, 0, __ATOMIC_ACQ_REL))
        sem_post(&p->sem);
}

/* Waiter side: announce, then the caller re-checks before pl_parker_sleep. Posts left over
 * from an earlier round are drained first: every one of them belongs to a publication that
 * the caller's re-check will see anyway. */
static inline void pl_parker_prepare(pl_parker *p)
{
    while (sem_trywait(&p->sem) == 0) {
    }
    __atomic_store_n(&p->waiting, 1, __ATOMIC_SEQ_CST);
    pl_fence();
}

static inline void pl_parker_cancel(pl_parker *p) { __atomic_store_n(&p->waiting, 0, __ATOMIC_SEQ_CST); }

static inline void pl_parker_sleep(pl_parker *p, int64_t timeout_ns)
{
    struct timespec ts;
#if PL_HAVE_CLOCKWAIT
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    clock_gettime(CLOCK_REALTIME, &ts);
#endif
    int64_t ns = ts.tv_nsec + (timeout_ns > 0 ? timeout_ns : 0);
    ts.tv_sec += ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    /* EINTR ends the slice early on purpose: the caller runs the process's signal handlers. */
#if PL_HAVE_CLOCKWAIT
    sem_clockwait(&p->sem, CLOCK_MONOTONIC, &ts);
#else
    sem_timedwait(&p->sem, &ts);
#endif
}

/* One wait slice: test, spin up to spin_ns, then park up to slice_ns. Returns 1 when cond
 * holds, 0 when the slice ran out or a signal arrived (the caller runs signal handlers,
 * checks peer liveness and its deadline). */
typedef int (*pl_cond_fn)(const void *ctx);

static inline int pl_wait_slice(pl_parker *p, pl_cond_fn cond, const void *ctx, int64_t spin_ns,
                                int64_t slice_ns)
{
    if (cond(ctx))
        return 1;
    if (spin_ns > 0) {
        int64_t until = pl_now_ns() + spin_ns;
        for (unsigned i = 1;; i++) {
            pl_cpu_relax();
            if (cond(ctx))
                return 1;
            if ((i & 15) == 0 && pl_now_ns() >= until)
                break;
        }
    }
    pl_parker_prepare(p);
    if (cond(ctx)) {
        pl_parker_cancel(p);
        return 1;
    }
    pl_parker_sleep(p, slice_ns);
    pl_parker_cancel(p);
    return cond(ctx);
}

/* Liveness of a peer recorded by pid: gone, or a zombie nobody reaped yet, is dead. */
static inline int pl_pid_alive(int64_t pid)
{
    if (pid <= 0)
        return 1; /* no peer attached yet: nothing to check */
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH)
        return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = 0;
    const char *rp = strrchr(buf, ')');
    if (rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'))
        return 0;
    return 1;
}

/* ---- ring ---------------------------------------------------------------------------- */
typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t num_readers;
    uint64_t size;
    uint64_t data_offset;
    char _pad[32];
    char doorbell[PL_DOORBELL_NAME];
} pl_ring_hdr;

typedef struct {
    uint64_t pos; /* head for the writer, tail for a reader */
    uint64_t seq;
    int64_t pid;
    char _pad[40];
    pl_parker parker;
} pl_ring_side;

typedef struct {
    pl_ring_hdr hdr;   /* 0 */
    pl_ring_side writer; /* 256 */
    pl_ring_side readers[]; /* 384 + 128*i */
} pl_ring_shm;

typedef struct {
    pl_ring_shm *shm;
    unsigned char *data;
    uint64_t size;
    uint32_t num_readers;
    uint32_t reader; /* this view's reader index (readers only) */
    pl_parker *reader_parker; /* readers[reader].parker or the doorbell's */
    uint64_t need; /* bytes the writer waits for */
} pl_ring;

static inline uint64_t pl_ring_data_offset(uint32_t num_readers)
{
    return sizeof(pl_ring_shm) + (uint64_t)num_readers * sizeof(pl_ring_side);
}

static inline uint64_t pl_line_up(uint64_t n) { return (n + PL_LINE - 1) & ~(uint64_t)(PL_LINE - 1); }

static inline uint64_t pl_rec_size(uint64_t len) { return (PL_REC_HDR + len + 15u) & ~(uint64_t)15u; }

static inline int pl_ring_readable(const void *ctx)
{
    const pl_ring *r = (const pl_ring *)ctx;
    return pl_load_acquire(&r->shm->writer.pos) != pl_load_relaxed(&r->shm->readers[r->reader].pos);
}

static inline uint64_t pl_ring_min_tail(const pl_ring *r)
{
    uint64_t m = pl_load_acquire(&r->shm->readers[0].pos);
    for (uint32_t i = 1; i < r->num_readers; i++) {
        uint64_t t = pl_load_acquire(&r->shm->readers[i].pos);
        if (t < m)
            m = t;
    }
    return m;
}

static inline int pl_ring_writable(const void *ctx)
{
    const pl_ring *r = (const pl_ring *)ctx;
    return r->size - (pl_load_relaxed(&r->shm->writer.pos) - pl_ring_min_tail(r)) >= r->need;
}

/* Bytes the writer needs free for a payload of len: the record, plus the unusable end of the
 * buffer when the record does not fit before it. */
static inline uint64_t pl_ring_need(const pl_ring *r, uint64_t len)
{
    uint64_t rec = pl_rec_size(len), pos = pl_load_relaxed(&r->shm->writer.pos) % r->size;
    return r->size - pos >= rec ? rec : (r->size - pos) + rec;
}

/* Writer: caller ensured pl_ring_writable for pl_ring_need(len). */
static inline void pl_ring_write(pl_ring *r, const void *buf, uint64_t len)
{
    uint64_t head = pl_load_relaxed(&r->shm->writer.pos), rec = pl_rec_size(len);
    uint64_t pos = head % r->size;
    if (r->size - pos < rec) {
        uint32_t wrap = PL_WRAP;
        memcpy(r->data + pos, &wrap, 4);
        head += r->size - pos;
        pos = 0;
    }
    uint32_t len32 = (uint32_t)len, flags = 0;
    uint64_t seq = r->shm->writer.seq++;
    memcpy(r->data + pos, &len32, 4);
    memcpy(r->data + pos + 4, &flags, 4);
    memcpy(r->data + pos + 8, &seq, 8);
    memcpy(r->data + pos + PL_REC_HDR, buf, len);
    pl_store_release(&r->shm->writer.pos, head + rec);
    pl_fence();
    for (uint32_t i = 0; i < r->num_readers; i++) {
        pl_parker *p = (i == r->reader && r->reader_parker) ? r->reader_parker : &r->shm->readers[i].parker;
        if (__atomic_load_n(&p->waiting, __ATOMIC_RELAXED) &&
            __atomic_exchange_n(&p->waiting, 0, __ATOMIC_ACQ_REL))
            sem_post(&p->sem);
    }
}

/* Reader: locate the next record (caller ensured pl_ring_readable). Skips a wrap marker.
 * Returns the payload offset in data, stores its length and the record's sequence number. */
static inline uint64_t pl_ring_peek(pl_ring *r, uint64_t *len, uint64_t *seq)
{
    pl_ring_side *me = &r->shm->readers[r->reader];
    uint64_t tail = pl_load_relaxed(&me->pos), pos = tail % r->size;
    uint32_t len32;
    memcpy(&len32, r->data + pos, 4);
    if (len32 == PL_WRAP) {
        tail += r->size - pos;
        pl_store_release(&me->pos, tail); /* no wake: the writer only waits for whole records */
        pos = 0;
        memcpy(&len32, r->data, 4);
    }
    memcpy(seq, r->data + pos + 8, 8);
    *len = len32;
    return pos + PL_REC_HDR;
}

/* Reader: release the record just copied out, and wake the writer if it parked. */
static inline void pl_ring_consume(pl_ring *r, uint64_t len)
{
    pl_ring_side *me = &r->shm->readers[r->reader];
    me->seq++;
    pl_store_release(&me->pos, pl_load_relaxed(&me->pos) + pl_rec_size(len));
    pl_parker_wake(&r->shm->writer.parker);
}

/* ---- wait on several rings sharing one doorbell --------------------------------------- */
typedef struct {
    uint64_t magic;
    char _pad[56];
    pl_parker parker; /* 64 */
} pl_doorbell_shm;

#define PL_DOORBELL_SIZE sizeof(pl_doorbell_shm)

typedef struct {
    pl_ring **rings;
    int n;
} pl_ring_set;

static inline int pl_ring_set_any(const void *ctx)
{
    const pl_ring_set *s = (const pl_ring_set *)ctx;
    for (int i = 0; i < s->n; i++)
        if (pl_ring_readable(s->rings[i]))
            return 1;
    return 0;
}

/* ---- layer signal -------------------------------------------------------------------- */
typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t num_layers;
    int64_t publisher_pid;
    char _pad[40];
    pl_parker parker; /* 64 */
    uint64_t seq[];   /* 128 */
} pl_signal_shm;

typedef struct {
    pl_signal_shm *shm;
    int layer;
    uint64_t target;
} pl_signal_wait;

static inline uint64_t pl_signal_size(uint32_t num_layers)
{
    return sizeof(pl_signal_shm) + (uint64_t)num_layers * sizeof(uint64_t);
}

static inline int pl_signal_ready(const void *ctx)
{
    const pl_signal_wait *w = (const pl_signal_wait *)ctx;
    return pl_load_acquire(&w->shm->seq[w->layer]) >= w->target;
}

/* Publish "layer `layer` of step `step` is written" and post only if the reader is parked.
 * Plain C, no Python: the CUDA host-function callback calls it with the segment's base. */
static inline void pipeline_signal_publish(void *base, int64_t step, int layer)
{
    pl_signal_shm *s = (pl_signal_shm *)base;
    if (layer < 0 || (uint32_t)layer >= s->num_layers || step < 0)
        return;
    pl_store_release(&s->seq[layer], (uint64_t)step + 1);
    pl_parker_wake(&s->parker);
}

#endif /* PIPELINE_SHM_ATOMIC_H */
