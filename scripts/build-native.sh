#!/usr/bin/env bash
# Build kvcache's native helpers (kvcache/native/libkvfast.so) from kvcache/native/*.c.
# Needs gcc and xxHash's header (Debian: libxxhash-dev; XXHASH_INCLUDE points elsewhere).
# The library is self-contained (xxHash is compiled in) and needs only libc at run time,
# so one built here also runs on another x86_64 Linux host with the same or a newer glibc.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=kvcache/native
out=$dir/libkvfast.so
inc=()
[ -n "${XXHASH_INCLUDE:-}" ] && inc=(-I "$XXHASH_INCLUDE")
cc="${CC:-gcc}"
flags=(-O3 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fPIC "${inc[@]}")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# The hash kernels three times: x86-64's baseline (SSE2), AVX2 and AVX-512, picked at run time
# by kvfast.c from what the CPU supports.
"$cc" "${flags[@]}" -DKV_SUFFIX=_sse2 -c "$dir/kvfast_hash.c" -o "$tmp/hash_sse2.o"
"$cc" "${flags[@]}" -DKV_SUFFIX=_avx2 -mavx2 -c "$dir/kvfast_hash.c" -o "$tmp/hash_avx2.o"
"$cc" "${flags[@]}" -DKV_SUFFIX=_avx512 -mavx512f -c "$dir/kvfast_hash.c" -o "$tmp/hash_avx512.o"
"$cc" "${flags[@]}" -c "$dir/kvfast.c" -o "$tmp/kvfast.o"
"$cc" -shared -o "$out.tmp" "$tmp"/*.o
mv "$out.tmp" "$out"
echo "built $out"
