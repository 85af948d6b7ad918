#!/usr/bin/env bash
# Build kvcache's native helpers (kvcache/native/libkvfast.so) from kvcache/native/kvfast.c.
# Needs gcc and xxHash's header (Debian: libxxhash-dev; XXHASH_INCLUDE points elsewhere).
# The library is self-contained (xxHash is compiled in) and needs only libc at run time,
# so one built here also runs on another x86_64 Linux host with the same or a newer glibc.
set -euo pipefail
cd "$(dirname "$0")/.."
src=kvcache/native/kvfast.c
out=kvcache/native/libkvfast.so
inc=()
[ -n "${XXHASH_INCLUDE:-}" ] && inc=(-I "$XXHASH_INCLUDE")
"${CC:-gcc}" -O3 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fPIC -shared "${inc[@]}" \
  -o "$out.tmp" "$src"
mv "$out.tmp" "$out"
echo "built $out"
