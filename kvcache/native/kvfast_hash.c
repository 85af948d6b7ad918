/* Batched XXH3 hashing (and a receive hashed as it lands), compiled once per instruction set (see scripts/build-native.sh):
 * KV_SUFFIX names this build's functions (_sse2, _avx2), and the -m flags it is compiled
 * with decide xxHash's vector code. kvfast.c picks one at run time. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>

#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)

void KV_CAT(kv_xxh3_64_many, KV_SUFFIX)(const uint64_t *addrs, const uint64_t *lens, size_t n,
                                        uint64_t *out) {
    for (size_t i = 0; i < n; i++) {
        out[i] = XXH3_64bits((const void *)(uintptr_t)addrs[i], (size_t)lens[i]);
    }
}

void KV_CAT(kv_xxh3_128_many, KV_SUFFIX)(const uint64_t *addrs, const uint64_t *lens, size_t n,
                                         uint8_t *out) {
    for (size_t i = 0; i < n; i++) {
        XXH128_hash_t h = XXH3_128bits((const void *)(uintptr_t)addrs[i], (size_t)lens[i]);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, h);
        memcpy(out + 16 * i, c.digest, 16);
    }
}

/* A prompt's block keys, chained: h i = canonical XXH3-128 of tag ++ key i-1 ++ block i,
 * key -1 being seed (16 bytes), block i the step bytes at raw + i step. Key i is h i, but
 * where i is not a multiple of group its first tag_bytes bytes are key i-1's (the placement
 * tag a group of blocks shares: docs/spec/hashing.md); as kvcache.keys.block_keys
 * computes them one xxhash call a block. scratch holds tag_len + 16 + step bytes.
 * out[16 i .. 16 i + 15] = key i. */
void KV_CAT(kv_chain_keys, KV_SUFFIX)(const uint8_t *seed, const uint8_t *tag, size_t tag_len,
                                      const uint8_t *raw, size_t step, size_t count,
                                      size_t group, size_t tag_bytes, uint8_t *scratch,
                                      uint8_t *out) {
    memcpy(scratch, tag, tag_len);
    const uint8_t *parent = seed;
    if (tag_bytes > 16) tag_bytes = 16;
    for (size_t i = 0; i < count; i++) {
        memcpy(scratch + tag_len, parent, 16);
        memcpy(scratch + tag_len + 16, raw + i * step, step);
        XXH128_hash_t h = XXH3_128bits(scratch, tag_len + 16 + step);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, h);
        memcpy(out + 16 * i, c.digest, 16);
        if (group > 1 && i % group != 0) memcpy(out + 16 * i, parent, tag_bytes);
        parent = out + 16 * i;
    }
}

/* Receive len bytes from the blocking socket fd into buf, at most piece bytes a recv
 * (MSG_WAITALL), and with digest, hash each piece as soon as it is in (still in cache,
 * while the sender sends the next): digest = canonical XXH3-128 of the prefix bytes, then
 * buf. The socket's SO_RCVTIMEO bounds each recv, and is armed again (to 1.05 x the time
 * left) before a recv whenever it exceeds 1.1 x the time left to the CLOCK_MONOTONIC
 * deadline (seconds): a holder trickling a piece per timeout otherwise kept a fetch up to
 * twice its deadline. *got is the bytes received. Returns 0 when all arrived,
 * 1 when the peer closed first, 2 when the deadline passed, or -errno (-EAGAIN: the
 * socket's receive timeout passed). */
int KV_CAT(kv_recv_hashed, KV_SUFFIX)(int fd, uint8_t *buf, uint64_t len, uint64_t piece,
                                      const uint8_t *prefix, uint64_t prefix_len,
                                      double deadline, uint8_t *digest, uint64_t *got) {
    XXH3_state_t state;
    if (digest != NULL) {
        XXH3_128bits_reset(&state);
        if (prefix_len) XXH3_128bits_update(&state, prefix, (size_t)prefix_len);
    }
    uint64_t done = 0, hashed = 0;
    int status = 0;
    *got = 0;
    if (piece == 0) piece = len;
    struct timeval bound;
    socklen_t bound_len = sizeof bound;
    double armed = 0.0; /* seconds one recv may block (0: without end) */
    if (getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, &bound_len) == 0)
        armed = (double)bound.tv_sec + (double)bound.tv_usec * 1e-6;
    while (done < len) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double left = deadline - ((double)now.tv_sec + (double)now.tv_nsec * 1e-9);
        if (left <= 0) {
            status = 2;
            break;
        }
        if (armed <= 0.0 || armed > left * 1.1) {
            double arm = left * 1.05;
            bound.tv_sec = (time_t)arm;
            bound.tv_usec = (suseconds_t)((arm - (double)bound.tv_sec) * 1e6);
            if (bound.tv_sec == 0 && bound.tv_usec == 0) bound.tv_usec = 1;
            if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound) != 0) {
                status = -errno;
                break;
            }
            armed = arm;
        }
        uint64_t want = len - done < piece ? len - done : piece;
        ssize_t n = recv(fd, buf + done, (size_t)want, MSG_WAITALL);
        if (n < 0) {
            if (errno == EINTR) continue;
            status = -errno;
            break;
        }
        if (n == 0) {
            status = 1;
            break;
        }
        done += (uint64_t)n;
        if (digest != NULL) {
            XXH3_128bits_update(&state, buf + hashed, (size_t)(done - hashed));
            hashed = done;
        }
    }
    *got = done;
    if (digest != NULL && status == 0) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&state));
        memcpy(digest, c.digest, 16);
    }
    return status;
}

/* ec_encode_data's signature (ISA-L): len, k, rows, tables, data rows, coding rows. */
typedef void (*kv_encode_fn)(int, int, int, unsigned char *, unsigned char **, unsigned char **);

/* Encode and hash count blocks one block at a time, so that each block's bytes are read from
 * memory once and hashed while they are in the core's cache: block i's XXH3-128 of its
 * payload_len payload bytes at payloads[i] (canonical, into payload_hashes + 16 i), then its
 * parity (encode(length, k, outputs, tables, rows + n i, rows + n i + k), n = k + outputs),
 * then the XXH3-64 of each of its n rows of length bytes (into shard_hashes + n i). The
 * three passes over a whole batch read every byte from memory three times. */
void KV_CAT(kv_encode_hashed, KV_SUFFIX)(uint64_t encode, int length, int k, int outputs,
                                         uint64_t tables, size_t count, const uint64_t *rows,
                                         const uint64_t *payloads, uint64_t payload_len,
                                         uint8_t *payload_hashes, uint64_t *shard_hashes) {
    kv_encode_fn fn = (kv_encode_fn)(uintptr_t)encode;
    size_t n = (size_t)k + (size_t)outputs;
    for (size_t i = 0; i < count; i++) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(
            &c, XXH3_128bits((const void *)(uintptr_t)payloads[i], (size_t)payload_len));
        memcpy(payload_hashes + 16 * i, c.digest, 16);
        unsigned char **row = (unsigned char **)(uintptr_t)(rows + n * i);
        if (outputs > 0) fn(length, k, outputs, (unsigned char *)(uintptr_t)tables, row, row + k);
        for (size_t j = 0; j < n; j++) {
            shard_hashes[n * i + j] = XXH3_64bits(row[j], (size_t)length);
        }
    }
}
