/* Batched XXH3 hashing, compiled once per instruction set (see scripts/build-native.sh):
 * KV_SUFFIX names this build's functions (_sse2, _avx2), and the -m flags it is compiled
 * with decide xxHash's vector code. kvfast.c picks one at run time. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

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
