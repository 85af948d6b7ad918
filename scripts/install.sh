#!/usr/bin/env bash
# Install kvcache and everything its tests and benchmarks need, on Debian as root.
# Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
# chromium + chromium-driver: the status page's browser test (tests/test_dashboard_browser.py);
# systemd: systemd-analyze verifies deploy/kvcache-server.service (tests/test_deploy.py);
# etcd-server: membership (`kvcache up --etcd`, tests/test_membership_*.py start their own etcd);
# iproute2: the multi-host test's network namespaces (tests/test_multihost.py).
# gcc + libxxhash-dev + liblmdb-dev: kvcache/native's helpers and the daemon's native data
# plane (scripts/build-native.sh, below).
for pkg in gcc libxxhash-dev liblmdb-dev libisal2 redis-server chromium chromium-driver systemd etcd-server iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing system packages: ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
# The redis-server package may start a system-wide server; the project starts its own.
# etcd-server likewise: kvcache starts its own etcd processes.
if command -v systemctl >/dev/null 2>&1; then
  systemctl disable --now redis-server >/dev/null 2>&1 || true
  systemctl disable --now etcd >/dev/null 2>&1 || true
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# CPU torch for the engine adapter's tests: this machine kind keeps the 2.13.0 CPU wheel on disk
# (PIP_FIND_LINKS); a bare `torch` requirement would pull a multi-GB CUDA build from PyPI.
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q 'torch==2.13.0'
.venv/bin/python -m pip install -q -e '.[dev,engine,plot]'
# The data path's batched hashing and scatter/gather I/O (kvcache/native/libkvfast.so).
bash scripts/build-native.sh
echo "kvcache installed in $(pwd)/.venv"
