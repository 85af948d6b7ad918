/* kvfast: the per-batch native helpers of kvcache's data path (see kvcache/native/__init__.py).
 *
 * Each function does, for a whole batch, what the Python data path would otherwise do once
 * per shard or per block: hash many buffers, receive a reply's data section into many
 * destinations, send many sections. Buffers are passed as arrays of addresses and lengths;
 * the caller keeps every buffer alive for the call. Plain C with no Python API, loaded
 * through ctypes, which releases the GIL for the call. Hashes come from the xxHash library
 * (header-only use, XXH_INLINE_ALL, in kvfast_hash.c, built for SSE2, AVX2 and AVX-512 and chosen
 * at run time), bit-identical to the Python xxhash package.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* ppoll */
#endif
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#define KV_IOV_MAX 1024
/* Most exchanges in one kv_get_burst (one per node of a load's first asks). */
#define KV_BURST_MAX 4096

int kv_abi_version(void) { return 17; }

/* kvfast_hash.c, built three times: x86-64's baseline (SSE2), AVX2 and AVX-512 kernels. */
void kv_xxh3_64_many_sse2(const uint64_t *, const uint64_t *, size_t, uint64_t *);
void kv_xxh3_128_many_sse2(const uint64_t *, const uint64_t *, size_t, uint8_t *);
void kv_xxh3_64_many_avx2(const uint64_t *, const uint64_t *, size_t, uint64_t *);
void kv_xxh3_128_many_avx2(const uint64_t *, const uint64_t *, size_t, uint8_t *);
void kv_xxh3_64_many_avx512(const uint64_t *, const uint64_t *, size_t, uint64_t *);
void kv_xxh3_128_many_avx512(const uint64_t *, const uint64_t *, size_t, uint8_t *);
#define KV_CHAIN_KEYS_ARGS \
    const uint8_t *, const uint8_t *, size_t, const uint8_t *, size_t, size_t, size_t, size_t, \
        uint8_t *, uint8_t *
void kv_chain_keys_sse2(KV_CHAIN_KEYS_ARGS);
void kv_chain_keys_avx2(KV_CHAIN_KEYS_ARGS);
void kv_chain_keys_avx512(KV_CHAIN_KEYS_ARGS);
#define KV_RECV_HASHED_ARGS \
    int, uint8_t *, uint64_t, uint64_t, const uint8_t *, uint64_t, double, uint8_t *, uint64_t *
int kv_recv_hashed_sse2(KV_RECV_HASHED_ARGS);
int kv_recv_hashed_avx2(KV_RECV_HASHED_ARGS);
int kv_recv_hashed_avx512(KV_RECV_HASHED_ARGS);
#define KV_ENCODE_HASHED_ARGS                                                                 \
    uint64_t, int, int, int, uint64_t, size_t, const uint64_t *, const uint64_t *, uint64_t, \
        uint8_t *, uint64_t *
void kv_encode_hashed_sse2(KV_ENCODE_HASHED_ARGS);
void kv_encode_hashed_avx2(KV_ENCODE_HASHED_ARGS);
void kv_encode_hashed_avx512(KV_ENCODE_HASHED_ARGS);

enum { KERNEL_SSE2, KERNEL_AVX2, KERNEL_AVX512 };

static int kernel(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f")
                     ? KERNEL_AVX512
                     : (__builtin_cpu_supports("avx2") ? KERNEL_AVX2 : KERNEL_SSE2);
    }
    return cached;
}

/* The kernel the hashes run on: "avx512", "avx2" or "sse2" (reported by kvcache.native). */
const char *kv_hash_kernel(void) {
    static const char *names[] = {"sse2", "avx2", "avx512"};
    return names[kernel()];
}

/* out[i] = XXH3-64 of the lens[i] bytes at addrs[i]. */
void kv_xxh3_64_many(const uint64_t *addrs, const uint64_t *lens, size_t n, uint64_t *out) {
    switch (kernel()) {
    case KERNEL_AVX512: kv_xxh3_64_many_avx512(addrs, lens, n, out); break;
    case KERNEL_AVX2: kv_xxh3_64_many_avx2(addrs, lens, n, out); break;
    default: kv_xxh3_64_many_sse2(addrs, lens, n, out);
    }
}

/* out[16 i .. 16 i + 15] = canonical (big-endian) XXH3-128 digest of buffer i, as
 * xxhash.xxh3_128_digest returns it. */
void kv_xxh3_128_many(const uint64_t *addrs, const uint64_t *lens, size_t n, uint8_t *out) {
    switch (kernel()) {
    case KERNEL_AVX512: kv_xxh3_128_many_avx512(addrs, lens, n, out); break;
    case KERNEL_AVX2: kv_xxh3_128_many_avx2(addrs, lens, n, out); break;
    default: kv_xxh3_128_many_sse2(addrs, lens, n, out);
    }
}

/* A prompt's chained block keys (kvfast_hash.c): see kvcache.native.chain_keys. */
void kv_chain_keys(const uint8_t *seed, const uint8_t *tag, size_t tag_len, const uint8_t *raw,
                   size_t step, size_t count, size_t group, size_t tag_bytes, uint8_t *scratch,
                   uint8_t *out) {
    switch (kernel()) {
    case KERNEL_AVX512:
        kv_chain_keys_avx512(seed, tag, tag_len, raw, step, count, group, tag_bytes, scratch, out);
        break;
    case KERNEL_AVX2:
        kv_chain_keys_avx2(seed, tag, tag_len, raw, step, count, group, tag_bytes, scratch, out);
        break;
    default:
        kv_chain_keys_sse2(seed, tag, tag_len, raw, step, count, group, tag_bytes, scratch, out);
    }
}

/* A batch encoded and hashed block by block (kvfast_hash.c, on this CPU's kernel): see
 * kvcache.native.encode_hashed. */
void kv_encode_hashed(uint64_t encode, int length, int k, int outputs, uint64_t tables,
                      size_t count, const uint64_t *rows, const uint64_t *payloads,
                      uint64_t payload_len, uint8_t *payload_hashes, uint64_t *shard_hashes) {
    switch (kernel()) {
    case KERNEL_AVX512:
        kv_encode_hashed_avx512(encode, length, k, outputs, tables, count, rows, payloads,
                                payload_len, payload_hashes, shard_hashes);
        break;
    case KERNEL_AVX2:
        kv_encode_hashed_avx2(encode, length, k, outputs, tables, count, rows, payloads,
                              payload_len, payload_hashes, shard_hashes);
        break;
    default:
        kv_encode_hashed_sse2(encode, length, k, outputs, tables, count, rows, payloads,
                              payload_len, payload_hashes, shard_hashes);
    }
}

/* A state received into buf and hashed as it lands (kvfast_hash.c, on this CPU's kernel). */
int kv_recv_hashed(int fd, uint8_t *buf, uint64_t len, uint64_t piece, const uint8_t *prefix,
                   uint64_t prefix_len, double deadline, uint8_t *digest, uint64_t *got) {
    switch (kernel()) {
    case KERNEL_AVX512:
        return kv_recv_hashed_avx512(fd, buf, len, piece, prefix, prefix_len, deadline, digest,
                                     got);
    case KERNEL_AVX2:
        return kv_recv_hashed_avx2(fd, buf, len, piece, prefix, prefix_len, deadline, digest,
                                   got);
    default:
        return kv_recv_hashed_sse2(fd, buf, len, piece, prefix, prefix_len, deadline, digest,
                                   got);
    }
}

/* Fill iov from segment state[0] at offset state[1]; returns the count. */
static int fill_iov(struct iovec *iov, const uint64_t *addrs, const uint64_t *lens, size_t n,
                    const uint64_t *state) {
    size_t i = (size_t)state[0];
    uint64_t off = state[1];
    int c = 0;
    while (i < n && c < KV_IOV_MAX) {
        if (lens[i] > off) {
            iov[c].iov_base = (void *)(uintptr_t)(addrs[i] + off);
            iov[c].iov_len = (size_t)(lens[i] - off);
            c++;
        }
        off = 0;
        i++;
    }
    return c;
}

/* Move state (segment, offset) forward by got bytes. */
static void advance(const uint64_t *lens, size_t n, uint64_t *state, size_t got) {
    size_t i = (size_t)state[0];
    uint64_t off = state[1];
    while (i < n) {
        uint64_t left = lens[i] - off;
        if (got < left) {
            off += got;
            break;
        }
        got -= (size_t)left;
        off = 0;
        i++;
    }
    state[0] = i;
    state[1] = off;
}

/* The loop both directions share: recvmsg (sending = 0) or sendmsg (sending = 1) over
 * the segments from state = {segment, offset}, until all are done or the socket would
 * block. Returns the bytes moved by this call (>= 0), or -errno (EAGAIN only when nothing
 * at all moved); a receive that sees the peer close sets state[2] = 1. */
static int64_t transfer(int fd, const uint64_t *addrs, const uint64_t *lens, size_t n,
                        uint64_t *state, int sending) {
    struct iovec iov[KV_IOV_MAX];
    int64_t total = 0;
    while ((size_t)state[0] < n) {
        int c = fill_iov(iov, addrs, lens, n, state);
        if (c == 0) {
            state[0] = n;
            break;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)c;
        ssize_t moved = sending ? sendmsg(fd, &msg, MSG_NOSIGNAL) : recvmsg(fd, &msg, 0);
        if (moved < 0) {
            if (errno == EINTR) continue;
            if (total > 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return total;
            return -(int64_t)errno;
        }
        if (moved == 0 && !sending) {
            state[2] = 1;
            return total;
        }
        advance(lens, n, state, (size_t)moved);
        total += moved;
    }
    return total;
}

/* Receive from the non-blocking socket fd into segments (addrs[j], lens[j]), continuing at
 * state = {segment, offset}, until all are full or the socket has nothing more.
 * Returns the bytes received by this call (>= 0); state[2] is set to 1 if the peer closed
 * the stream; a negative value is -errno (EAGAIN only when nothing at all was received). */
int64_t kv_recv_scatter(int fd, const uint64_t *addrs, const uint64_t *lens, size_t n,
                        uint64_t *state) {
    return transfer(fd, addrs, lens, n, state, 0);
}

/* Send segments (addrs[j], lens[j]) on the non-blocking socket fd, continuing at state =
 * {segment, offset}, until all are sent or the socket's buffer is full. Returns the bytes
 * sent by this call (>= 0), or -errno (EAGAIN only when nothing at all was sent). */
int64_t kv_send_gather(int fd, const uint64_t *addrs, const uint64_t *lens, size_t n,
                       uint64_t *state) {
    return transfer(fd, addrs, lens, n, state, 1);
}

/* Where the data section of a GET reply lands (kvcache.client.assembly.LoadAssembly):
 * per item, in item order, the segments its record is received into. An item with a
 * status other than 0 has no record. An item that is not the record asked for (its
 * length is not HEADER + L) or whose block is no longer open goes to scratch, at the next
 * free place of the scratch buffer (scratch_at, filled in order). Otherwise its 104-byte
 * header goes to the headers table and its body to the caller's out buffer (a data shard;
 * the part past the payload's end to the pad) or to the parity scratch. A record of
 * another length for an open block, at least a header long, has its header put in the
 * odd headers table (odd_at, when not 0; what it was stored as, for the load to tell a
 * caller's wrong payload length from damage) and the rest in scratch.
 * geom = {L, payload, k, n, pad_len, header_bytes, out_at, pad_at, parity_at, headers_at,
 * scratch_at, odd_at}. addrs/lens have room for 3 segments per item. Returns the segment
 * count. */
size_t kv_landing_segments(const int64_t *blocks, const int64_t *indices,
                           const uint8_t *statuses, const int64_t *lengths,
                           const uint8_t *live, size_t count, const uint64_t *geom,
                           uint64_t *addrs, uint64_t *lens) {
    const uint64_t L = geom[0], payload = geom[1], k = geom[2], n = geom[3], pad_len = geom[4];
    const uint64_t hb = geom[5], out_at = geom[6], pad_at = geom[7], parity_at = geom[8];
    const uint64_t headers_at = geom[9];
    uint64_t scratch = geom[10];
    const uint64_t odd_at = geom[11];
    const uint64_t m = n - k;
    size_t c = 0;
    for (size_t j = 0; j < count; j++) {
        if (statuses[j] != 0) continue;
        uint64_t size = (uint64_t)lengths[j];
        if (size != hb + L || !live[j]) {
            if (live[j] && odd_at && size >= hb) {
                uint64_t b = (uint64_t)blocks[j], i = (uint64_t)indices[j];
                addrs[c] = odd_at + (b * n + i) * hb;
                lens[c++] = hb;
                size -= hb;
            }
            if (size) {
                addrs[c] = scratch;
                lens[c++] = size;
                scratch += size;
            }
            continue;
        }
        uint64_t b = (uint64_t)blocks[j], i = (uint64_t)indices[j];
        addrs[c] = headers_at + (b * n + i) * hb;
        lens[c++] = hb;
        if (i >= k) {
            addrs[c] = parity_at + (b * m + (i - k)) * L;
            lens[c++] = L;
            continue;
        }
        uint64_t begin = i * L, end = begin + L;
        if (end <= payload) {
            addrs[c] = out_at + b * payload + begin;
            lens[c++] = L;
        } else if (begin >= payload) {
            addrs[c] = pad_at + b * pad_len + (begin - payload);
            lens[c++] = L;
        } else {
            addrs[c] = out_at + b * payload + begin;
            lens[c++] = payload - begin;
            addrs[c] = pad_at + b * pad_len;
            lens[c++] = end - payload;
        }
    }
    return c;
}

/* Are a[0..len) and b[0..len) equal outside [s1, s1 + n1) and [s2, s2 + n2)? */
static int same_but(const uint8_t *a, const uint8_t *b, uint64_t len, uint64_t s1, uint64_t n1,
                    uint64_t s2, uint64_t n2) {
    if (s2 < s1) {
        uint64_t t = s1; s1 = s2; s2 = t;
        t = n1; n1 = n2; n2 = t;
    }
    uint64_t e1 = s1 + n1, e2 = s2 + n2;
    if (e1 > s2) { /* overlapping windows: one window [s1, max(e1, e2)) */
        if (e1 > e2) e2 = e1;
        s2 = e1 = e2;
    }
    return memcmp(a, b, s1) == 0 && memcmp(a + e1, b + e1, s2 - e1) == 0 &&
           memcmp(a + e2, b + e2, len - e2) == 0;
}

/* Per item of a landed GET reply (LoadAssembly.accept): is it exactly the shard asked
 * for? Items of sealed blocks are ignored. NOT_FOUND (status 1) marks not_found; a record
 * of the wrong length is rejected; a record of the right length is accepted (got) when its
 * header's first identity_bytes equal the expected identity, but for the class-length byte
 * (which must be 1..max_class) and, for a block whose stripe is unknown, the 8 stripe-id
 * bytes; else it is rejected. The (blocks, n) tables are row-major; header rows are
 * header_bytes apart, identity rows identity_bytes apart. Returns the accepted count. */
static int accept_one(uint64_t b, uint64_t i, uint8_t status, uint64_t length,
                      const uint8_t *sealed, const uint8_t *unknown, uint8_t *got,
                      uint8_t *rejected, uint8_t *not_found, const uint8_t *header_rows,
                      const uint8_t *identities, const uint64_t *geom) {
    /* geom = {n, record_len, header_bytes, identity_bytes, class_len_at, stripe_at,
     * max_class} */
    const uint64_t n = geom[0], record = geom[1], hb = geom[2], idb = geom[3];
    const uint64_t class_at = geom[4], stripe_at = geom[5], max_class = geom[6];
    if (sealed[b]) return 0;
    uint64_t flat = b * n + i;
    if (status == 1) {
        not_found[flat] = 1;
        return 0;
    }
    if (status != 0) return 0;
    if (length != record) {
        rejected[flat] = 1;
        return 0;
    }
    const uint8_t *have = header_rows + flat * hb, *want = identities + flat * idb;
    int good = have[class_at] >= 1 && have[class_at] <= max_class;
    if (good) {
        good = unknown[b] ? same_but(have, want, idb, class_at, 1, stripe_at, 8)
                          : same_but(have, want, idb, class_at, 1, class_at, 1);
    }
    if (good) {
        got[flat] = 1;
        return 1;
    }
    rejected[flat] = 1;
    return 0;
}

size_t kv_accept_items(const int64_t *blocks, const int64_t *indices, const uint8_t *statuses,
                       const int64_t *lengths, size_t count, const uint8_t *sealed,
                       const uint8_t *unknown, uint8_t *got, uint8_t *rejected,
                       uint8_t *not_found, const uint8_t *header_rows,
                       const uint8_t *identities, const uint64_t *geom, uint8_t *accepted) {
    size_t taken = 0;
    for (size_t j = 0; j < count; j++) {
        accepted[j] = (uint8_t)accept_one((uint64_t)blocks[j], (uint64_t)indices[j],
                                          statuses[j], (uint64_t)lengths[j], sealed, unknown,
                                          got, rejected, not_found, header_rows, identities,
                                          geom);
        taken += accepted[j];
    }
    return taken;
}

/* GET reply items as the wire has them: 8-byte records, status u8 at 0, length u32 LE
 * at 4 (see the daemon's layouts below). */
static inline uint8_t reply_status(const uint8_t *items, size_t j) { return items[8 * j]; }

static inline uint64_t reply_length(const uint8_t *items, size_t j) {
    uint32_t v;
    memcpy(&v, items + 8 * j + 4, 4);
    return (uint64_t)v; /* a little-endian host, as everywhere in this file */
}

/* kv_accept_items over a GET reply's own items (no status and length columns to copy
 * out first). */
size_t kv_accept_get_reply(const uint8_t *items, size_t count, const int64_t *blocks,
                           const int64_t *indices, const uint8_t *sealed,
                           const uint8_t *unknown, uint8_t *got, uint8_t *rejected,
                           uint8_t *not_found, const uint8_t *header_rows,
                           const uint8_t *identities, const uint64_t *geom,
                           uint8_t *accepted) {
    size_t taken = 0;
    for (size_t j = 0; j < count; j++) {
        accepted[j] = (uint8_t)accept_one(
            (uint64_t)blocks[j], (uint64_t)indices[j], reply_status(items, j),
            reply_length(items, j), sealed, unknown, got, rejected, not_found, header_rows,
            identities, geom);
        taken += accepted[j];
    }
    return taken;
}

/* A GET reply's landing in one pass (LoadAssembly.land_reply): the segments of
 * kv_landing_segments for the reply's own items, each OK item's block counted in
 * writing[] (and listed in writes, *nwrites of them), the data section's bytes in *nbytes.
 * When any OK record would go to scratch (a length other than a shard's record, or its
 * block sealed), nothing is written and SIZE_MAX is returned: the caller takes the
 * general path. geom as kv_landing_segments's. */
size_t kv_land_get_reply(const uint8_t *items, size_t count, const int64_t *blocks,
                         const int64_t *indices, const uint8_t *sealed, int64_t *writing,
                         const uint64_t *geom, uint64_t *addrs, uint64_t *lens,
                         int64_t *writes, uint64_t *counts) {
    const uint64_t L = geom[0], payload = geom[1], k = geom[2], n = geom[3], pad_len = geom[4];
    const uint64_t hb = geom[5], out_at = geom[6], pad_at = geom[7], parity_at = geom[8];
    const uint64_t headers_at = geom[9];
    const uint64_t m = n - k;
    for (size_t j = 0; j < count; j++) {
        if (reply_status(items, j) != 0) continue;
        if (reply_length(items, j) != hb + L || sealed[(uint64_t)blocks[j]]) return SIZE_MAX;
    }
    size_t c = 0, w = 0;
    uint64_t total = 0;
    for (size_t j = 0; j < count; j++) {
        if (reply_status(items, j) != 0) continue;
        uint64_t b = (uint64_t)blocks[j], i = (uint64_t)indices[j];
        writing[b]++;
        writes[w++] = (int64_t)b;
        total += hb + L;
        addrs[c] = headers_at + (b * n + i) * hb;
        lens[c++] = hb;
        if (i >= k) {
            addrs[c] = parity_at + (b * m + (i - k)) * L;
            lens[c++] = L;
            continue;
        }
        uint64_t begin = i * L, end = begin + L;
        if (end <= payload) {
            addrs[c] = out_at + b * payload + begin;
            lens[c++] = L;
        } else if (begin >= payload) {
            addrs[c] = pad_at + b * pad_len + (begin - payload);
            lens[c++] = L;
        } else {
            addrs[c] = out_at + b * payload + begin;
            lens[c++] = payload - begin;
            addrs[c] = pad_at + b * pad_len;
            lens[c++] = end - payload;
        }
    }
    counts[0] = w;
    counts[1] = total;
    return c;
}

/* table[idx[j]] += delta for each j (numpy's ufunc.at, without its per-call cost): the
 * blocks a landing writes, counted in and out (LoadAssembly.landed). */
void kv_add_at(int64_t *table, const int64_t *idx, size_t count, int64_t delta) {
    for (size_t j = 0; j < count; j++) table[idx[j]] += delta;
}

/* ISA-L's ec_encode_data, whose address the caller passes (kvcache.erasure loads ISA-L;
 * this library stays free of it). */
typedef void (*kv_ec_encode_fn)(int len, int k, int rows, unsigned char *tables,
                                unsigned char **data, unsigned char **coding);

/* ec_encode_data over `count` blocks, each with its own tables: block i reads the k row
 * pointers at io[i * stride] and writes outputs[i] rows through the pointers after them
 * (none if outputs[i] is 0). A degraded load rebuilds a batch whose blocks lost different
 * shards, so each may have its own decode tables (IsalCodec.reconstruct_rows_many). */
void kv_ec_run_many(uint64_t encode, int length, int k, size_t count, const uint64_t *tables,
                    const uint64_t *io, size_t stride, const int32_t *outputs) {
    kv_ec_encode_fn fn = (kv_ec_encode_fn)(uintptr_t)encode;
    for (size_t i = 0; i < count; i++) {
        if (outputs[i] <= 0) continue;
        unsigned char **rows = (unsigned char **)(uintptr_t)(io + i * stride);
        fn(length, k, outputs[i], (unsigned char *)(uintptr_t)tables[i], rows, rows + k);
    }
}

/* ---------------------------------------------------------------- the daemon's GET
 *
 * Layouts (checked against the dtypes by kvcache.server.get_native at import):
 *   a GET request item, 32 bytes: block key [0, 16), shard index u16 LE at 16, stripe id
 *     wanted u64 LE at 24 (0: any);
 *   a storage key, 26 bytes: tenant [0, 8), block key [8, 24), shard index u16 BE at 24;
 *   a getmulti answer row of the index, 60 bytes: the storage key's first 24 bytes, then
 *     the row (index u16, class u16, size u32, expiry u64, stripe u64, written u32,
 *     segment u32, offset u32; all big-endian), the shard index being the key's last two;
 *   a GET reply item, 8 bytes: status u8 at 0, length u32 LE at 4. */
#define GET_ITEM 32
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire's LE fields are read as host");
#define STORE_KEY 26
#define HIT 56 /* getmulti rows: block key 24 | index row 32 (kvcache/server/records.py) */

static uint64_t be64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return __builtin_bswap64(v);
}

static uint32_t be32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return __builtin_bswap32(v);
}

static uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The storage keys of tenant's GET items, one 26-byte row each, into keys. */
void kv_get_keys(const uint8_t *tenant, const uint8_t *items, size_t n, uint8_t *keys) {
    for (size_t j = 0; j < n; j++) {
        const uint8_t *item = items + j * GET_ITEM;
        uint8_t *key = keys + j * STORE_KEY;
        memcpy(key, tenant, 8);
        memcpy(key + 8, item, 16);
        key[24] = item[17];
        key[25] = item[16];
    }
}

/* The quiet GET (ShardStore._get_quiet): found (found_len bytes of getmulti rows) must hold
 * exactly the n asked storage keys, one row each, in order, every one expiring after
 * quiet_above and of the wanted stripe. Then each reply item's length is its record's size,
 * runs gets (segment, start, end) per run of records that follow each other in one
 * segment, *total the bytes of them all, and the run count is returned; else -1, and
 * nothing is written. */
int64_t kv_get_quiet(const uint8_t *items, const uint8_t *keys, size_t n, const uint8_t *found,
                     size_t found_len, uint64_t quiet_above, uint8_t *reply, uint64_t *runs,
                     uint64_t *total) {
    if (n == 0 || found_len != n * HIT) return -1;
    for (size_t j = 0; j < n; j++) {
        const uint8_t *hit = found + j * HIT, *row = hit + 24;
        const uint8_t *key = keys + j * STORE_KEY;
        if (memcmp(hit, key, 24) != 0 || memcmp(row, key + 24, 2) != 0) return -1;
        if ((uint64_t)be32(row + 8) * 1000u <= quiet_above) return -1; /* expiry: seconds */
        uint64_t want = le64(items + j * GET_ITEM + 24);
        if (want != 0 && want != be64(row + 12)) return -1;
    }
    int64_t m = -1;
    uint64_t sum = 0, seg = 0, end = 0;
    for (size_t j = 0; j < n; j++) {
        const uint8_t *row = found + j * HIT + 24;
        uint32_t size = be32(row + 4);
        uint64_t s = be32(row + 24), off = be32(row + 28);
        memcpy(reply + j * 8 + 4, &size, 4);
        sum += size;
        if (m >= 0 && s == seg && off == end) {
            end = off + size;
            runs[3 * m + 2] = end;
            continue;
        }
        m++;
        seg = s;
        end = off + size;
        runs[3 * m] = s;
        runs[3 * m + 1] = off;
        runs[3 * m + 2] = end;
    }
    *total = sum;
    return m + 1;
}

/* ---------------------------------------------------------------- the daemon's PUT checks
 *
 * kvcache.server.records.check_put over a whole request in one call: the same verdicts, in
 * the same order of precedence, as its numpy columns (a property test holds them equal).
 * Layouts: a PUT request item, 32 bytes: block key [0, 16), shard index u16 LE at 16,
 * length u32 LE at 20, expected stripe u64 LE at 24; a record is the 104-byte shard header
 * (kvcache.shard.HEADER_DTYPE, little-endian) then its body. */
#define PUT_ITEM 32
#define SHARD_HEADER 104
#define SHARD_CHECKED 100
enum { ST_OK = 0, ST_BAD_ITEM = 2, ST_CHECKSUM = 3, ST_WRONG_KEY = 4 };

static uint32_t le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static int name_byte(uint8_t c, int first) {
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) return 1;
    return !first && (c == '_' || c == '-');
}

/* kvcache.shard.header_verdicts(checksum=False) of one header, and its record's length. */
static int put_header_ok(const uint8_t *h, uint64_t length) {
    uint32_t k = h[6], m = h[7], class_len = h[9];
    uint64_t payload_len = le32(h + 12);
    if (memcmp(h, "KVSH", 4) != 0 || h[4] != 1 || h[5] != SHARD_HEADER) return 0;
    if (h[10] != 0 || h[11] != 0 || k < 1 || m > 255 - k || h[8] >= k + m) return 0;
    if (payload_len < 1 || le64(h + 76) < le64(h + 68)) return 0;
    uint64_t per = (payload_len + k - 1) / k;
    uint64_t shard_len = (per + 63) / 64 * 64;
    if (shard_len != le32(h + 16)) return 0;
    if (class_len < 1 || class_len > 15) return 0;
    for (uint32_t c = 0; c < 16; c++) {
        uint8_t b = h[84 + c];
        if (c < class_len ? !name_byte(b, c == 0) : b != 0) return 0;
    }
    return length == SHARD_HEADER + shard_len;
}

/* Status per item into status; for the p-th item that passed, in request order: pos[p] its
 * item, keys[26 p ..] its storage key (tenant's 8 bytes, block key, index u16 BE), cols[5 p
 * ..] its record's offset and length in data, its header's stripe id, the item's expected
 * stripe and the header check, names[16 p ..] its header's class field. Returns the count
 * that passed, or -1 (nothing written) when the items' lengths do not add up to data_len. */
int64_t kv_check_put(const uint8_t *tenant, const uint8_t *items, size_t n, const uint8_t *data,
                     uint64_t data_len, uint8_t *status, uint64_t *pos, uint8_t *keys,
                     uint64_t *cols, uint8_t *names) {
    uint64_t total = 0;
    for (size_t j = 0; j < n; j++) total += le32(items + j * PUT_ITEM + 20);
    if (total != data_len) return -1;
    int64_t passed = 0;
    uint64_t off = 0;
    for (size_t j = 0; j < n; j++) {
        const uint8_t *item = items + j * PUT_ITEM;
        uint64_t length = le32(item + 20), at = off;
        const uint8_t *rec = data + at, *h = rec;
        off += length;
        status[j] = ST_BAD_ITEM;
        if (length < SHARD_HEADER || !put_header_ok(h, length)) continue;
        uint64_t addr[2] = {(uint64_t)(uintptr_t)rec, (uint64_t)(uintptr_t)(rec + SHARD_HEADER)};
        uint64_t lens[2] = {SHARD_CHECKED, length - SHARD_HEADER}, sums[2];
        kv_xxh3_64_many(addr, lens, 2, sums);
        if ((uint32_t)sums[0] != le32(h + 100)) continue;
        if (sums[1] != le64(h + 60)) {
            status[j] = ST_CHECKSUM;
            continue;
        }
        uint16_t index = (uint16_t)(item[16] | (item[17] << 8));
        if (memcmp(item, h + 28, 16) != 0 || index != h[8]) {
            status[j] = ST_WRONG_KEY;
            continue;
        }
        status[j] = ST_OK;
        pos[passed] = j;
        uint8_t *key = keys + passed * STORE_KEY;
        memcpy(key, tenant, 8);
        memcpy(key + 8, item, 16);
        key[24] = item[17];
        key[25] = item[16];
        uint64_t *col = cols + 5 * passed;
        col[0] = at;
        col[1] = length;
        col[2] = le64(h + 20);
        col[3] = le64(item + 24);
        col[4] = le32(h + 100);
        memcpy(names + 16 * passed, h + 84, 16);
        passed++;
    }
    return passed;
}

/* ---------------------------------------------------------------- the client's GET burst
 *
 * A load's first GETs, one per node, sent and received in one call on the caller's thread
 * (kvcache.client.transport.TcpTransport.burst): what the Python transport does per
 * exchange (build and send the request, read the reply's header and items, land its data
 * with kv_land_get_reply, receive it) with no Python step per exchange. Each exchange runs
 * on an idle connection of its own until its reply is whole, or it stops at the first thing
 * the burst does not handle alone, its state left for the Python transport to go on from:
 * a reply that is not the expected shape (another status, op, count, id or flag: Python
 * reads and judges the header), item lengths that do not add up, or a landing
 * kv_land_get_reply declines (a record for scratch). A closed or failed connection ends its
 * exchange FAILED; the deadline ends the call with the rest where they are. */
enum {
    BURST_SEND = 0,
    BURST_HEAD = 1,
    BURST_ITEMS = 2,
    BURST_DATA = 3,
    BURST_DONE = 4,
    BURST_STOP_HEADER = 5,  /* the header is in, not the expected one: Python's from here */
    BURST_STOP_LANDING = 6, /* header and items in, no native landing: Python's from here */
    BURST_FAILED = -1,
};
#define BURST_HDR 48
#define BURST_REPLY_ITEM 8

/* One exchange (kvcache.native.BURST_DTYPE): inputs, then progress. */
typedef struct {
    int64_t fd;
    uint64_t req_addr[2], req_len[2]; /* the request: header and items */
    uint64_t expect_id, count;        /* its request id, items asked */
    uint64_t blocks_at, indices_at;   /* the shards asked: int64 blocks and indices */
    uint64_t header_at, items_at;     /* where the reply's header (48) and items go */
    uint64_t table_at, cap;           /* the landing buffer (see land_get_reply), 3*count */
    uint64_t sent, got, used;         /* request bytes sent; of the section being read */
    int64_t state, error;             /* BURST_*; errno (FAILED) */
    uint64_t item_flags;              /* DONE: the reply items' flag bytes, OR-ed */
    /* A plain exchange (table_at 0: a HAS, say): its reply has up to `count` items of
     * reply_item bytes each and no data section, and is read, not landed. reply_count: how
     * many items its header announced. */
    uint64_t reply_item, reply_count;
    /* The request's data section (a PUT's), sent after header and items: a Segments table
     * of kvcache.native (addresses, lengths, then its {segment, offset, closed} state, which
     * the send advances), with room for data_cap segments of which data_count are used;
     * data_at 0: none. */
    uint64_t data_at, data_cap, data_count;
} kv_burst_ex;

/* The assembly a burst lands in: kv_land_get_reply's tables, then kv_accept_get_reply's
 * (sealed, unknown, got, rejected, not_found, header rows, identities, geometry). */
typedef struct {
    const uint8_t *sealed;
    int64_t *writing;
    const uint64_t *land_geom;
    const uint8_t *unknown;
    uint8_t *got, *rejected, *not_found;
    const uint8_t *header_rows, *identities;
    const uint64_t *accept_geom;
} kv_burst_target;

/* A reply landed whole: its verdicts (after the landing buffer's counts, a byte per item)
 * and its blocks no longer counted as being written. */
size_t kv_burst_ex_size(void) { return sizeof(kv_burst_ex); }

static void burst_done(kv_burst_ex *x, const kv_burst_target *t) {
    uint64_t *table = (uint64_t *)(uintptr_t)x->table_at;
    int64_t *writes = (int64_t *)(table + 2 * x->cap + 3);
    uint64_t *counts = (uint64_t *)(writes + x->count);
    uint8_t *accepted = (uint8_t *)(counts + 2);
    const int64_t *blocks = (const int64_t *)(uintptr_t)x->blocks_at;
    const int64_t *indices = (const int64_t *)(uintptr_t)x->indices_at;
    kv_accept_get_reply((const uint8_t *)(uintptr_t)x->items_at, x->count, blocks, indices,
                        t->sealed, t->unknown, t->got, t->rejected, t->not_found,
                        t->header_rows, t->identities, t->accept_geom, accepted);
    kv_add_at(t->writing, writes, counts[0], -1);
    const uint8_t *items = (const uint8_t *)(uintptr_t)x->items_at;
    uint8_t flags = 0;
    for (uint64_t j = 0; j < x->count; j++) flags |= items[j * BURST_REPLY_ITEM + 1];
    x->item_flags = flags;
    x->state = BURST_DONE;
}

/* Whether h is the reply expected: of the request's op, OK, this request's id; a GET's with
 * one item per item asked and at most max_data bytes of data, a plain exchange's with at most
 * `count` items and no data. Anything else is the Python transport's to read. */
static int burst_header_ok(const kv_burst_ex *x, const uint8_t *h, uint64_t max_data) {
    uint16_t flags, status;
    uint32_t count, ttl;
    uint64_t id, data_len;
    memcpy(&flags, h + 4, 2);
    memcpy(&status, h + 6, 2);
    memcpy(&id, h + 8, 8);
    memcpy(&count, h + 16, 4);
    memcpy(&ttl, h + 20, 4);
    memcpy(&data_len, h + 24, 8);
    static const uint8_t no_class[16] = {0};
    uint8_t op = ((const uint8_t *)(uintptr_t)x->req_addr[0])[3];
    int plain = x->table_at == 0;
    int sized = plain ? (count <= x->count && data_len == 0)
                      : (op == 2 /* GET */ && count == x->count && data_len <= max_data);
    return h[0] == 'K' && h[1] == 'V' && h[2] == 2 && h[3] == op && flags == 1 &&
           status == 0 && id == x->expect_id && sized && ttl == 0 &&
           memcmp(h + 32, no_class, 16) == 0;
}

/* Read as far as the socket allows. Returns 1 while the exchange waits for more bytes. */
static int burst_recv(kv_burst_ex *x, const kv_burst_target *t, uint64_t max_data) {
    int fd = (int)x->fd;
    for (;;) {
        if (x->state == BURST_HEAD || x->state == BURST_ITEMS) {
            int head = x->state == BURST_HEAD;
            uint8_t *buf = (uint8_t *)(uintptr_t)(head ? x->header_at : x->items_at);
            uint64_t want = head                ? BURST_HDR
                            : x->table_at == 0 ? x->reply_count * x->reply_item
                                               : x->count * BURST_REPLY_ITEM;
            ssize_t r = recv(fd, buf + x->got, want - x->got, MSG_DONTWAIT);
            if (r == 0) {
                x->state = BURST_FAILED;
                x->error = ECONNRESET;
                return 0;
            }
            if (r < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
                x->error = errno;
                x->state = BURST_FAILED;
                return 0;
            }
            x->got += (uint64_t)r;
            if (x->got < want) continue;
            if (head) {
                if (!burst_header_ok(x, buf, max_data)) {
                    x->state = BURST_STOP_HEADER;
                    return 0;
                }
                uint32_t count;
                memcpy(&count, buf + 16, 4);
                x->reply_count = count;
                x->state = BURST_ITEMS;
                x->got = 0;
                if (x->table_at == 0 && count == 0) {
                    x->state = BURST_DONE; /* a plain reply of no items: nothing more */
                    return 0;
                }
                continue;
            }
            if (x->table_at == 0) {
                x->state = BURST_DONE; /* a plain reply's items are in: the caller reads them */
                return 0;
            }
            /* Items in: their lengths must add up to the data section, and land. */
            const uint8_t *items = buf;
            uint64_t data_len, total = 0;
            memcpy(&data_len, (uint8_t *)(uintptr_t)x->header_at + 24, 8);
            for (uint64_t j = 0; j < x->count; j++) total += reply_length(items, j);
            if (total != data_len) {
                x->state = BURST_STOP_LANDING;
                return 0;
            }
            uint64_t *table = (uint64_t *)(uintptr_t)x->table_at;
            uint64_t cap = x->cap;
            int64_t *writes = (int64_t *)(table + 2 * cap + 3);
            uint64_t *counts = (uint64_t *)(writes + x->count);
            size_t used = kv_land_get_reply(
                items, x->count, (const int64_t *)(uintptr_t)x->blocks_at,
                (const int64_t *)(uintptr_t)x->indices_at, t->sealed, t->writing, t->land_geom,
                table, table + cap, writes, counts);
            if (used == SIZE_MAX) {
                x->state = BURST_STOP_LANDING;
                return 0;
            }
            if (counts[1] != data_len) {
                /* Bytes the landing does not place (a non-OK item with a length): undo its
                 * counts, and the Python transport judges the reply. */
                kv_add_at(t->writing, writes, counts[0], -1);
                x->state = BURST_STOP_LANDING;
                return 0;
            }
            x->used = used;
            x->got = 0;
            if (!data_len) {
                burst_done(x, t);
                return 0;
            }
            x->state = BURST_DATA;
            continue;
        }
        if (x->state == BURST_DATA) {
            uint64_t *table = (uint64_t *)(uintptr_t)x->table_at;
            uint64_t *state = table + 2 * x->cap;
            int64_t r = transfer(fd, table, table + x->cap, x->used, state, 0);
            if (r < 0) {
                if (r == -EAGAIN || r == -EWOULDBLOCK) return 1;
                x->error = -r;
                x->state = BURST_FAILED;
                return 0;
            }
            if (state[2]) {
                x->error = ECONNRESET;
                x->state = BURST_FAILED;
                return 0;
            }
            if (state[0] >= x->used) {
                burst_done(x, t);
                return 0;
            }
            return 1;
        }
        return 0;
    }
}

static int burst_send(kv_burst_ex *x) {
    uint64_t total = x->req_len[0] + x->req_len[1];
    while (x->sent < total) {
        struct iovec iov[2];
        int c = 0;
        uint64_t skip = x->sent;
        for (int j = 0; j < 2; j++) {
            if (skip >= x->req_len[j]) {
                skip -= x->req_len[j];
                continue;
            }
            iov[c].iov_base = (void *)(uintptr_t)(x->req_addr[j] + skip);
            iov[c].iov_len = (size_t)(x->req_len[j] - skip);
            skip = 0;
            c++;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)c;
        ssize_t r = sendmsg((int)x->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
            x->error = errno;
            x->state = BURST_FAILED;
            return 0;
        }
        x->sent += (uint64_t)r;
    }
    if (x->data_at) {
        uint64_t *table = (uint64_t *)(uintptr_t)x->data_at;
        uint64_t *state = table + 2 * x->data_cap;
        int64_t r = transfer((int)x->fd, table, table + x->data_cap, x->data_count, state, 1);
        if (r < 0 && r != -EAGAIN && r != -EWOULDBLOCK) {
            x->error = -r;
            x->state = BURST_FAILED;
            return 0;
        }
        if (state[0] < x->data_count) return 1; /* the socket's buffer is full */
    }
    x->state = BURST_HEAD;
    x->got = 0;
    return 0;
}

static int64_t burst_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Run the n exchanges until each is DONE, stopped or FAILED, or timeout_ms passed, or (need
 * given) every block lo + j, j < count, has need[j] shards accepted, or wake_fd (>= 0) is
 * readable; landing in (and accepting into) the assembly t; a reply's data section is at
 * most max_data. A DONE reply is landed, its verdicts in its landing buffer, its blocks no
 * longer counted as being written. Returns how many are still under way (their state says
 * where each stands), or -errno when poll failed. */
/* Whether every block b in [lo, lo + count) has need[b - lo] shards accepted (the load's
 * round would find its chunks complete: stragglers are then its business, as a hedge's late
 * answers are). */
static int burst_enough(const kv_burst_target *t, uint64_t lo, const uint8_t *need,
                        uint64_t count) {
    uint64_t width = t->accept_geom[0];
    for (uint64_t j = 0; j < count; j++) {
        const uint8_t *row = t->got + (lo + j) * width;
        uint64_t have = 0;
        for (uint64_t i = 0; i < width; i++) have += row[i];
        if (have < need[j]) return 0;
    }
    return 1;
}

/* min_left > 0: once no more than min_left exchanges are under way, wait for them only a
 * quarter of the time the burst took to get there (at least BURST_GRACE_US): a node that
 * went silent is then the caller's round's business (it may not need that node's answer),
 * while answers sent with the others still come in here. */
#define BURST_GRACE_US 200

int64_t kv_get_burst(kv_burst_ex *ex, size_t n, const kv_burst_target *t, int64_t timeout_ms,
                     uint64_t max_data, uint64_t lo, const uint8_t *need, uint64_t count,
                     int wake_fd, uint64_t min_left) {
    struct pollfd fds[KV_BURST_MAX + 1];
    int where[KV_BURST_MAX];
    uint8_t ready[KV_BURST_MAX]; /* worth a syscall: polled ready (or not polled yet) */
    if (n > KV_BURST_MAX) return -EINVAL;
    if (timeout_ms > 3600000) timeout_ms = 3600000;
    int64_t started = burst_now_us();
    int64_t deadline = started + (timeout_ms > 0 ? timeout_ms : 0) * 1000;
    int graced = 0;
    memset(ready, 1, n);
    for (;;) {
        int nf = 0;
        for (size_t j = 0; j < n; j++) {
            kv_burst_ex *x = &ex[j];
            if (x->state == BURST_SEND) {
                if (ready[j]) burst_send(x);
                if (x->state == BURST_SEND) {
                    fds[nf] = (struct pollfd){.fd = (int)x->fd, .events = POLLOUT};
                    where[nf++] = (int)j;
                    continue;
                }
                ready[j] = 0; /* sent: its reply is not there yet */
            }
            if (x->state == BURST_HEAD || x->state == BURST_ITEMS || x->state == BURST_DATA) {
                if (!ready[j] || burst_recv(x, t, max_data)) {
                    fds[nf] = (struct pollfd){.fd = (int)x->fd, .events = POLLIN};
                    where[nf++] = (int)j;
                }
            }
        }
        if (!nf) return 0;
        if (need && burst_enough(t, lo, need, count)) return nf; /* enough: the rest later */
        int64_t now = burst_now_us();
        /* The grace starts once some exchange is over (a burst of no more than min_left
         * would otherwise give up before any reply could come). */
        if (min_left && (uint64_t)nf <= min_left && (size_t)nf < n && !graced) {
            int64_t grace = (now - started) / 4;
            if (grace < BURST_GRACE_US) grace = BURST_GRACE_US;
            if (now + grace < deadline) deadline = now + grace;
            graced = 1;
        }
        int64_t left_us = deadline - now;
        if (left_us <= 0) return nf;
        /* The transport's wake socket too: another thread posted work for the loop (a
         * submit, a watchdog's reset), which the loop takes as soon as this returns. */
        int polled = nf;
        if (wake_fd >= 0) fds[polled++] = (struct pollfd){.fd = wake_fd, .events = POLLIN};
        struct timespec wait = {.tv_sec = left_us / 1000000, .tv_nsec = (left_us % 1000000) * 1000};
        int r = ppoll(fds, (nfds_t)polled, &wait, NULL);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) return nf;
        if (polled > nf && fds[nf].revents) return nf;
        for (int f = 0; f < nf; f++) ready[where[f]] = fds[f].revents != 0;
    }
}
