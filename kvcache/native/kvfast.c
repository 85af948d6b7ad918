/* kvfast: the per-batch native helpers of kvcache's data path (see kvcache/native/__init__.py).
 *
 * Each function does, for a whole batch, what the Python data path would otherwise do once
 * per shard or per block: hash many buffers, receive a reply's data section into many
 * destinations, send many sections. Buffers are passed as arrays of addresses and lengths;
 * the caller keeps every buffer alive for the call. Plain C with no Python API, loaded
 * through ctypes, which releases the GIL for the call. Hashes come from the xxHash library
 * (header-only use, XXH_INLINE_ALL), bit-identical to the Python xxhash package.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#define KV_IOV_MAX 1024

int kv_abi_version(void) { return 1; }

/* out[i] = XXH3-64 of the lens[i] bytes at addrs[i]. */
void kv_xxh3_64_many(const uint64_t *addrs, const uint64_t *lens, size_t n, uint64_t *out) {
    for (size_t i = 0; i < n; i++) {
        out[i] = XXH3_64bits((const void *)(uintptr_t)addrs[i], (size_t)lens[i]);
    }
}

/* out[16 i .. 16 i + 15] = canonical (big-endian) XXH3-128 digest of buffer i, as
 * xxhash.xxh3_128_digest returns it. */
void kv_xxh3_128_many(const uint64_t *addrs, const uint64_t *lens, size_t n, uint8_t *out) {
    for (size_t i = 0; i < n; i++) {
        XXH128_hash_t h = XXH3_128bits((const void *)(uintptr_t)addrs[i], (size_t)lens[i]);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, h);
        memcpy(out + 16 * i, c.digest, 16);
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

/* Receive from the non-blocking socket fd into segments (addrs[j], lens[j]), continuing at
 * state = {segment, offset}, until all are full or the socket has nothing more.
 * Returns the bytes received by this call (>= 0); state[2] is set to 1 if the peer closed
 * the stream; a negative value is -errno (EAGAIN only when nothing at all was received). */
int64_t kv_recv_scatter(int fd, const uint64_t *addrs, const uint64_t *lens, size_t n,
                        uint64_t *state) {
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
        ssize_t got = recvmsg(fd, &msg, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (total > 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return total;
            return -(int64_t)errno;
        }
        if (got == 0) {
            state[2] = 1;
            return total;
        }
        advance(lens, n, state, (size_t)got);
        total += got;
    }
    return total;
}

/* Send segments (addrs[j], lens[j]) on the non-blocking socket fd, continuing at state =
 * {segment, offset}, until all are sent or the socket's buffer is full. Returns the bytes
 * sent by this call (>= 0), or -errno (EAGAIN only when nothing at all was sent). */
int64_t kv_send_gather(int fd, const uint64_t *addrs, const uint64_t *lens, size_t n,
                       uint64_t *state) {
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
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            if (total > 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return total;
            return -(int64_t)errno;
        }
        advance(lens, n, state, (size_t)sent);
        total += sent;
    }
    return total;
}
