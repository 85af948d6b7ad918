#!/usr/bin/env bash
# Build kvcache's native code from kvcache/native/*.c:
#   libkvfast.so   the data path's per-batch helpers (client and daemon). Needs gcc and
#                  xxHash's header (Debian: libxxhash-dev; XXHASH_INCLUDE points elsewhere).
#                  Self-contained (xxHash is compiled in): it needs only libc at run time,
#                  so one built here also runs on another x86_64 Linux host with the same or
#                  a newer glibc.
#   libkvserve.so  the daemon's native data plane (kvcache/server/native_plane.py). Links
#                  LMDB (Debian: liblmdb-dev); it finds liblmdb.so.0 beside itself first
#                  (rpath $ORIGIN), so a host without LMDB gets the one copied there here.
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

serve=$dir/libkvserve.so
"$cc" "${flags[@]}" -shared -o "$serve.tmp" "$dir/kvserve.c" -llmdb -Wl,-rpath,'$ORIGIN'
mv "$serve.tmp" "$serve"
# The LMDB it links, beside it, for hosts that have none (the GPU host gets this directory).
lmdb=$(ldd "$serve" | awk '/liblmdb\.so/ {print $3}')
if [ -n "$lmdb" ] && [ "$(dirname "$(readlink -f "$lmdb")")" != "$(readlink -f "$dir")" ]; then
  cp -L "$lmdb" "$dir/"
fi
echo "built $serve"
