#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the lent GPU host needs to run kvcache, then carry it
# (carry=[".whl", ...]) to scripts/engine-gpu.sh, bench-gpu.sh, peers-gpu.sh or cost-gpu.sh:
#   .whl/kvcache-*.whl        this tree, as a wheel (installed with --no-deps there)
#   .whl/lmdb-*, xxhash-*, msgspec-*, pyzmq-*  cp312 manylinux wheels the host lacks (it has no
#                             network; the daemons import msgspec and zmq for the event stream)
#   .whl/COMMIT               the commit the wheel was built from (KVCACHE_COMMIT there)
#   .whl/lib/                 libkvfast.so, libkvserve.so and the liblmdb.so.0 it links, built
#                             here by scripts/build-native.sh; libisal.so.2 from Debian
# Usage: bash scripts/gpu-prepare.sh   (after scripts/install.sh; needs PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/lib
rm -f .whl/kvcache-*.whl
.venv/bin/python -m pip wheel -q --no-deps -w .whl .
.venv/bin/python -m pip download -q lmdb xxhash msgspec pyzmq --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .whl
bash scripts/build-native.sh
cp -L kvcache/native/libkvfast.so kvcache/native/libkvserve.so kvcache/native/liblmdb.so.0 \
  .whl/lib/
cp -L /usr/lib/x86_64-linux-gnu/libisal.so.2 .whl/lib/
# The commit the wheel was built from, for the figures' JSON there (the device's copy of the
# tree may carry a stale .git): scripts/_gpu-site.sh exports it as KVCACHE_COMMIT.
commit="$(git rev-parse --short HEAD)"
git diff --quiet HEAD -- kvcache || commit="$commit+dirty"
echo "$commit" > .whl/COMMIT
du -sh .whl
ls .whl .whl/lib
