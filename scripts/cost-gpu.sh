#!/usr/bin/env bash
# Issue 17's measurement pass on the lent H200 machine, in one device call (at most 600 s):
#   ab      bench/server.py --quick --no-tls --baseline scratch/base (the daemon, before/after)
#           and bench/client_ab.py --quick --baseline scratch/base-client (the client)
#   peers   scripts/peers-gpu.sh lmcache, RUNS=1 (kvcache beside LMCache, a full run)
#   engine  scripts/engine-gpu.sh --io-processes 12 --connections-per-node 1, RUNS=1
# PARTS picks and orders them (default "ab peers engine"); every part writes to $OUT
# (default bench/results), and a part that fails is reported while the others still run.
#
# Beforehand, on this machine (all git-ignored):
#   .whl                 kvcache's wheels and libraries, as for scripts/engine-gpu.sh
#   scratch/base         the daemon's baseline:  git archive COMMIT kvcache | tar -x -C scratch/base
#   scratch/base-client  the client's baseline, the same way
#                        (each with its own kvcache/native/libkvfast.so when its ABI differs:
#                        build it with that commit's scripts/build-native.sh)
#   .peer-wheels/lmcache bash scripts/peers-gpu.sh prepare lmcache
# then run  command="KVCACHE_COMMIT=<sha> bash scripts/cost-gpu.sh"
#           carry=[".whl", "scratch/base", "scratch/base-client", ".peer-wheels/lmcache"]
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
status=0
for part in ${PARTS:-ab peers engine}; do
  echo "=== part $part ($(date -u +%H:%M:%S)) ==="
  case "$part" in
    ab)
      bash scripts/bench-gpu.sh "bench/server.py --quick --no-tls --baseline scratch/base" \
        "bench/client_ab.py --quick --baseline scratch/base-client" || status=1
      ;;
    peers) RUNS=1 bash scripts/peers-gpu.sh lmcache 2>&1 | tail -n 25 || status=1 ;;
    engine)
      RUNS=1 bash scripts/engine-gpu.sh --io-processes 12 --connections-per-node 1 2>&1 \
        | tail -n 40 || status=1
      ;;
    *) echo "unknown part: $part (ab, peers, engine)" >&2; status=2 ;;
  esac
done
exit "$status"
