/* Batched XXH3 hashing (and a receive hashed as it lands), compiled once per instruction set (see scripts/build-native.sh):
 * KV_SUFFIX names this build's functions (_sse2, _avx2), and the -m flags it is compiled
 * with decide xxHash's vector code. kvfast.c picks one at run time. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

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

/* A receive's digest computed on a second thread while the next pieces land: the receiver
 * publishes how many bytes are in (received, with seq bumped as the futex word), the hasher
 * hashes up to there, spins briefly when it has caught up and then sleeps on seq; the
 * receiver wakes it only when it sleeps. On the H200 host hashing on the receiving thread
 * made the receive the slower side of a fetch at the end (the state's last byte arrived
 * ~80 us after the holder's send returned); overlapped, only the last piece's hash is left. */
typedef struct {
    const uint8_t *buf;
    uint64_t len;
    const uint8_t *prefix;
    uint64_t prefix_len;
    _Atomic uint64_t received;
    _Atomic uint32_t seq;
    _Atomic uint32_t sleeping;
    _Atomic uint32_t stop;
    uint8_t digest[16];
} KV_CAT(hash_job, KV_SUFFIX);

#define JOB KV_CAT(hash_job, KV_SUFFIX)
/* States smaller than this are hashed on the receiving thread (a thread costs ~10-20 us). */
#define KV_OVERLAP_MIN (1u << 20)
#define KV_SPIN 64

static void KV_CAT(futex_wait, KV_SUFFIX)(_Atomic uint32_t *word, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void KV_CAT(futex_wake, KV_SUFFIX)(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void *KV_CAT(hash_worker, KV_SUFFIX)(void *arg) {
    JOB *job = arg;
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    if (job->prefix_len) XXH3_128bits_update(&state, job->prefix, (size_t)job->prefix_len);
    uint64_t hashed = 0;
    while (hashed < job->len) {
        uint32_t seq = atomic_load(&job->seq);
        uint64_t in = atomic_load(&job->received);
        if (in > hashed) {
            XXH3_128bits_update(&state, job->buf + hashed, (size_t)(in - hashed));
            hashed = in;
            continue;
        }
        if (atomic_load(&job->stop)) return NULL;
        int spun = 0;
        while (spun < KV_SPIN && atomic_load(&job->seq) == seq && !atomic_load(&job->stop)) {
            __builtin_ia32_pause();
            spun++;
        }
        if (spun < KV_SPIN) continue;
        atomic_store(&job->sleeping, 1);
        if (atomic_load(&job->seq) == seq && !atomic_load(&job->stop))
            KV_CAT(futex_wait, KV_SUFFIX)(&job->seq, seq);
        atomic_store(&job->sleeping, 0);
    }
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&state));
    memcpy(job->digest, c.digest, 16);
    return NULL;
}

static void KV_CAT(publish, KV_SUFFIX)(JOB *job, uint64_t received, int stop) {
    if (stop) atomic_store(&job->stop, 1);
    else atomic_store(&job->received, received);
    atomic_fetch_add(&job->seq, 1);
    if (stop || atomic_load(&job->sleeping)) KV_CAT(futex_wake, KV_SUFFIX)(&job->seq);
}

/* Receive len bytes from the blocking socket fd into buf, at most piece bytes a recv
 * (MSG_WAITALL), and with digest, hash them as they land (still in cache, while the
 * sender sends the next): digest = canonical XXH3-128 of the prefix bytes, then buf. A
 * state of at least KV_OVERLAP_MIN bytes is hashed by a thread of its own while the next
 * pieces land (on the receiving thread when one cannot be started). The socket's
 * SO_RCVTIMEO bounds each recv; the CLOCK_MONOTONIC deadline (seconds) is checked between
 * receives. *got is the bytes received. Returns 0 when all arrived, 1 when the peer closed
 * first, 2 when the deadline passed, or -errno (-EAGAIN: the socket's receive timeout
 * passed). */
int KV_CAT(kv_recv_hashed, KV_SUFFIX)(int fd, uint8_t *buf, uint64_t len, uint64_t piece,
                                      const uint8_t *prefix, uint64_t prefix_len,
                                      double deadline, uint8_t *digest, uint64_t *got) {
    XXH3_state_t state;
    JOB job;
    pthread_t hasher;
    int overlapped = 0;
    if (digest != NULL && len >= KV_OVERLAP_MIN) {
        memset(&job, 0, sizeof job);
        job.buf = buf;
        job.len = len;
        job.prefix = prefix;
        job.prefix_len = prefix_len;
        overlapped = pthread_create(&hasher, NULL, KV_CAT(hash_worker, KV_SUFFIX), &job) == 0;
    }
    if (digest != NULL && !overlapped) {
        XXH3_128bits_reset(&state);
        if (prefix_len) XXH3_128bits_update(&state, prefix, (size_t)prefix_len);
    }
    uint64_t done = 0, hashed = 0;
    int status = 0;
    *got = 0;
    if (piece == 0) piece = len;
    while (done < len) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((double)now.tv_sec + (double)now.tv_nsec * 1e-9 >= deadline) {
            status = 2;
            break;
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
        if (overlapped) {
            KV_CAT(publish, KV_SUFFIX)(&job, done, 0);
        } else if (digest != NULL) {
            XXH3_128bits_update(&state, buf + hashed, (size_t)(done - hashed));
            hashed = done;
        }
    }
    *got = done;
    if (overlapped) {
        if (status != 0) KV_CAT(publish, KV_SUFFIX)(&job, done, 1);
        pthread_join(hasher, NULL);  /* buf must not be read once this call returns */
        if (status == 0) memcpy(digest, job.digest, 16);
    } else if (digest != NULL && status == 0) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&state));
        memcpy(digest, c.digest, 16);
    }
    return status;
}
