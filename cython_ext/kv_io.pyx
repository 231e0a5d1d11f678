# cython: language_level=3, boundscheck=False, wraparound=False
"""Hot path of the KV disk tier (pipeline/cache/kv_tier): a block's rows to and from a file.

Owns no state. A block of a KV pool is ``pool[:, :, block_id, :]``: ``2 * num_layers`` rows
of ``block_bytes`` each, strided in the pool and contiguous in the file.
``pwrite_rows`` writes them with one pwritev (gathered straight out of the pool);
``copy_rows`` scatters a block read whole into a staging buffer into the pool, checksumming
each row while it is in cache and copying it with streaming stores (a direct preadv into the
pool's 2 * num_layers strided rows measured slower: docs/kv_tier.md); ``row_checksums``
gives each row's checksum. All release the GIL.

The checksum is CRC-32C (Castagnoli) over four stripes of the row, combined: with one
stream the crc32 instruction is latency bound (~3 cycles per 8 bytes, about the speed of a
page-cache read), four independent streams reach its throughput (8 bytes a cycle), so
verifying costs a fraction of the read (docs/kv_tier.md, docs/benchmarks.md). Stripes: the
row's first ``3 * q`` bytes in three stripes of ``q = (n // 32) * 8`` bytes, the fourth
stripe is the rest; the value is the CRC-32C of the four stripe CRCs as little-endian u32.
``crc32c`` (one stream, exposed for the tests' known vectors) and a table fallback where
SSE4.2 is absent compute the same values.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from posix.types cimport off_t
from libc.errno cimport errno
from libc.string cimport memcpy, strerror

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t preadv(int fd, const iovec *iov, int iovcnt, off_t offset)
    ssize_t pwritev(int fd, const iovec *iov, int iovcnt, off_t offset)

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE4_2__)
    #include <nmmintrin.h>
    #endif
    static uint32_t kvio_table[256];
    static int kvio_table_ready = 0;
    static void kvio_init_table(void) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            kvio_table[i] = c;
        }
        kvio_table_ready = 1;
    }
    /* Raw (no pre/post inversion) CRC-32C update. */
    static inline uint32_t kvio_crc_u8(uint32_t c, uint8_t b) {
    #if defined(__SSE4_2__)
        return _mm_crc32_u8(c, b);
    #else
        return kvio_table[(c ^ b) & 0xFF] ^ (c >> 8);
    #endif
    }
    static inline uint32_t kvio_crc_u64(uint32_t c, const uint8_t *p) {
    #if defined(__SSE4_2__)
        uint64_t v; memcpy(&v, p, 8);
        return (uint32_t)_mm_crc32_u64(c, v);
    #else
        for (int i = 0; i < 8; i++) c = kvio_crc_u8(c, p[i]);
        return c;
    #endif
    }
    static uint32_t kvio_crc_run(uint32_t c, const uint8_t *p, size_t n) {
        while (n >= 8) { c = kvio_crc_u64(c, p); p += 8; n -= 8; }
        while (n--) c = kvio_crc_u8(c, *p++);
        return c;
    }
    #if defined(__AVX512F__)
    #include <immintrin.h>
    #endif
    /* Copy into the pool with streaming stores (the destination is overwritten whole: not
       read for ownership first, and the loaded KV does not evict the cache); the unaligned
       head and tail of the destination by memcpy. */
    static void kvio_copy_nt(uint8_t *d, const uint8_t *s, size_t n) {
    #if defined(__AVX512F__)
        size_t head = (size_t)(-(uintptr_t)d & 63);
        if (n >= head + 64) {
            memcpy(d, s, head);
            d += head; s += head; n -= head;
            size_t body = n & ~(size_t)63;
            for (size_t i = 0; i < body; i += 64)
                _mm512_stream_si512((__m512i *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
            d += body; s += body; n -= body;
        }
    #endif
        memcpy(d, s, n);
    }
    static void kvio_fence(void) {
    #if defined(__AVX512F__)
        _mm_sfence();
    #endif
    }
    static uint32_t kvio_crc32c(const uint8_t *p, size_t n) {
        return ~kvio_crc_run(0xFFFFFFFFu, p, n);
    }
    static uint32_t kvio_crc32c_x4(const uint8_t *p, size_t n) {
        size_t q = (n / 32) * 8;
        const uint8_t *p0 = p, *p1 = p + q, *p2 = p + 2 * q, *p3 = p + 3 * q;
        uint32_t c0 = 0xFFFFFFFFu, c1 = c0, c2 = c0, c3 = c0;
        for (size_t i = 0; i < q; i += 8) {  /* four independent dependency chains */
            c0 = kvio_crc_u64(c0, p0 + i); c1 = kvio_crc_u64(c1, p1 + i);
            c2 = kvio_crc_u64(c2, p2 + i); c3 = kvio_crc_u64(c3, p3 + i);
        }
        c3 = kvio_crc_run(c3, p + 4 * q, n - 4 * q);
        uint8_t le[16];
        uint32_t cs[4] = {~c0, ~c1, ~c2, ~c3};
        for (int j = 0; j < 4; j++)
            for (int b = 0; b < 4; b++) le[4 * j + b] = (uint8_t)(cs[j] >> (8 * b));
        return kvio_crc32c(le, 16);
    }
    """
    void kvio_init_table() nogil
    void kvio_copy_nt(uint8_t *d, const uint8_t *s, size_t n) nogil
    void kvio_fence() nogil
    uint32_t kvio_crc32c(const uint8_t *p, size_t n) nogil
    uint32_t kvio_crc32c_x4(const uint8_t *p, size_t n) nogil

kvio_init_table()

# Linux's IOV_MAX: a block with more rows is moved in several calls.
DEF IOV_MAX = 1024


cdef int _check_rows(Py_ssize_t inner_stride) except -1:
    # Rows are strided in the pool (layer, K/V), each row itself must be contiguous.
    if inner_stride != 1:
        raise ValueError(f"a block's rows must each be contiguous (inner stride {inner_stride})")
    return 0


def crc32c(const uint8_t[::1] data) -> int:
    """Plain CRC-32C of ``data`` (one stream; the tests' reference)."""
    cdef uint32_t c
    with nogil:
        c = kvio_crc32c(&data[0] if data.shape[0] else NULL, <size_t>data.shape[0])
    return c


def checksum(const uint8_t[::1] data) -> int:
    """The tier's checksum of one contiguous row (CRC-32C over four stripes)."""
    cdef uint32_t c
    with nogil:
        c = kvio_crc32c_x4(&data[0] if data.shape[0] else NULL, <size_t>data.shape[0])
    return c


def row_checksums(const uint8_t[:, :, :] rows, uint32_t[::1] out) -> None:
    """``out[l * 2 + k] = checksum(rows[l, k])`` for a block's ``[layers, 2, block_bytes]``."""
    cdef Py_ssize_t nl = rows.shape[0], nk = rows.shape[1], n = rows.shape[2], l, k
    _check_rows(rows.strides[2])
    if out.shape[0] != nl * nk:
        raise ValueError(f"row_checksums: out has {out.shape[0]} slots for {nl * nk} rows")
    if n == 0 or nl * nk == 0:
        out[:] = 0
        return
    with nogil:
        for l in range(nl):
            for k in range(nk):
                out[l * nk + k] = kvio_crc32c_x4(&rows[l, k, 0], <size_t>n)


def copy_rows(const uint8_t[::1] src, uint8_t[:, :, :] dst, uint32_t[::1] out) -> None:
    """Scatter ``src`` (a block's rows, contiguous as in the file) into ``dst`` (the block in
    the pool, ``[layers, 2, block_bytes]``), ``out[r]`` each row's checksum on the way: the
    row is checksummed while it sits in cache from the read, then copied once."""
    cdef Py_ssize_t nl = dst.shape[0], nk = dst.shape[1], n = dst.shape[2], l, k, r
    _check_rows(dst.strides[2])
    if src.shape[0] != nl * nk * n or out.shape[0] != nl * nk:
        raise ValueError(f"copy_rows: {src.shape[0]} bytes and {out.shape[0]} checksum slots "
                         f"for {nl * nk} rows of {n} bytes")
    if n == 0 or nl * nk == 0:
        out[:] = 0
        return
    with nogil:
        for l in range(nl):
            for k in range(nk):
                r = l * nk + k
                out[r] = kvio_crc32c_x4(&src[r * n], <size_t>n)
                kvio_copy_nt(&dst[l, k, 0], &src[r * n], <size_t>n)
        kvio_fence()


cdef Py_ssize_t _rows_io(int fd, uint8_t *base, Py_ssize_t nl, Py_ssize_t nk, Py_ssize_t s0,
                         Py_ssize_t s1, size_t n, off_t off, bint write) noexcept nogil:
    # Returns the bytes moved, or -1 on a system error (errno is set).
    cdef iovec iov[IOV_MAX]
    cdef Py_ssize_t total = 0, cnt = 0, want = 0, l, k
    cdef ssize_t got
    for l in range(nl):
        for k in range(nk):
            iov[cnt].iov_base = base + l * s0 + k * s1
            iov[cnt].iov_len = n
            cnt += 1
            want += n
            if cnt == IOV_MAX or (l == nl - 1 and k == nk - 1):
                got = pwritev(fd, iov, cnt, off) if write else preadv(fd, iov, cnt, off)
                if got < 0:
                    return -1
                total += got
                if got != want:  # short: end of file (a truncated file), or a full disk
                    return total
                off += got
                cnt = 0
                want = 0
    return total


def pwrite_rows(int fd, Py_ssize_t offset, const uint8_t[:, :, :] rows not None) -> int:
    """Write a block's rows to ``fd`` at ``offset`` contiguously; the bytes written."""
    cdef Py_ssize_t got
    _check_rows(rows.strides[2])
    if rows.shape[0] * rows.shape[1] * rows.shape[2] == 0:
        return 0
    with nogil:
        got = _rows_io(fd, <uint8_t *>&rows[0, 0, 0], rows.shape[0], rows.shape[1],
                       rows.strides[0], rows.strides[1], <size_t>rows.shape[2],
                       <off_t>offset, True)
    if got < 0:
        raise OSError(errno, "pwritev: " + strerror(errno).decode())
    return got
