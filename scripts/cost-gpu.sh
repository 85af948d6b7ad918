#!/usr/bin/env bash
# Issue 17's measurement pass on the lent H200 machine, in one device call (at most 600 s):
#   ab      bench/server.py --quick --no-tls --baseline scratch/base (the daemon, before/after)
#           and bench/client_ab.py --quick --baseline scratch/base-client (the client)
#   client  bench/client_ab.py --quick --baseline scratch/base-client, with 12 daemons and
#           with 48 (the client alone, before/after, and its fan-out: issue 21), then
#           bench/scale.py --quick --parts nodes (48 against 12 daemons)
#   store   bench/page_cache.py (what the host's page cache charges a write), bench/native.py
#           --quick (the store's encode and hashes block by block against three passes) and
#           bench/client_ab.py --quick --ops store --baseline scratch/base-client
#   daemon  bench/server.py --quick --no-tls --baseline scratch/base (the daemon alone,
#           before/after) and bench/profile_daemon.py --op put (where a PUT's CPU goes, by phase)
#   peers   scripts/peers-gpu.sh lmcache, RUNS=1 (kvcache beside LMCache, a full run)
#   pool    bench/pool_cost.py for DeepSeek V4.1's 112 KiB blocks and Llama's 2 MiB ones, with
#           0, 4, 8 and 12 I/O processes: what the client's I/O pool costs per block
#   pool-ab  the same for scratch/base-client and then this tree, for each shape, in turn in
#           one call: the pool's cost per block before/after ($OUT/pool_cost_{base,new}_*)
#   engine  scripts/engine-gpu.sh --io-processes 12 --connections-per-node 1, RUNS=1
#   dsv41   bench/engine_gpu.py --quick --no-recompute with 12, 8 and 4 I/O processes: the
#           DeepSeek-V4.1 load by pool size, and the match's share of it
#   engine-ab  the same headline for scratch/base (its tree and scratch/whl-base's wheels and
#           libraries) and then for this tree, one run each on one host: the engine's
#           before/after ($OUT/base_1, $OUT/new_2). The daemons and the benchmark import
#           the tree's kvcache, so the base run swaps the tree's kvcache/ for scratch/base's.
#           AB_ORDER="new base" runs this tree first; "base new new base" runs each twice.
#   nodes-ab  bench/scale.py --parts nodes (12, then 48 daemons) for scratch/base and this
#           tree in turn, twice: the client's cost by cluster size before/after (issue 21)
#   degraded  bench/profile_load.py --stages, healthy and with 2 of 12 daemons killed, for
#           this tree and then for scratch/base (its own native libraries): the degraded
#           load's cost before/after, on the host's cores
# PARTS picks and orders them (default "ab peers engine"); every part writes to $OUT
# (default bench/results), and a part that fails is reported while the others still run.
#
# Beforehand, on this machine (all git-ignored):
#   .whl                 kvcache's wheels and libraries, as for scripts/engine-gpu.sh
#   scratch/base         the daemon's baseline:  git archive COMMIT kvcache | tar -x -C scratch/base
#   scratch/whl-base     engine-ab's baseline wheels: .whl as gpu-prepare.sh fills it, with
#                        the base's kvcache wheel, its libkvfast.so / libkvserve.so and COMMIT
#   scratch/base-client  the client's baseline, the same way
#                        (each with its own kvcache/native/libkvfast.so when its ABI differs:
#                        build it with that commit's scripts/build-native.sh)
#   .peer-wheels/lmcache bash scripts/peers-gpu.sh prepare lmcache
# then run  command="bash scripts/cost-gpu.sh" (the figures name the commit the wheel was
#           built from, .whl/COMMIT; KVCACHE_COMMIT=<sha> overrides it)
#           carry=[".whl", "scratch/base", "scratch/base-client", ".peer-wheels/lmcache"]
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
# in_tree TREE CMD...: run CMD with this tree's kvcache (TREE=new) or with scratch/base's
# tree and its own native libraries (TREE=base), for the parts that compare the two.
in_tree() {
  local tree="$1" base
  shift
  base="$(pwd)/scratch/base"
  if [ "$tree" = base ]; then
    PYTHONSAFEPATH=1 PYTHONPATH="$base${PYTHONPATH:+:$PYTHONPATH}" \
      KVCACHE_NATIVE_LIBRARY="$base/kvcache/native/libkvfast.so" \
      KVCACHE_SERVE_LIBRARY="$base/kvcache/native/libkvserve.so" "$@"
  else
    "$@"
  fi
}

status=0
for part in ${PARTS:-ab peers engine}; do
  echo "=== part $part ($(date -u +%H:%M:%S)) ==="
  case "$part" in
    ab)
      bash scripts/bench-gpu.sh "bench/server.py --quick --no-tls --baseline scratch/base" \
        "bench/client_ab.py --quick --baseline scratch/base-client" || status=1
      ;;
    client)
      bash scripts/bench-gpu.sh "bench/client_ab.py --quick --baseline scratch/base-client" \
        "bench/client_ab.py --quick --nodes 48 --baseline scratch/base-client" \
        "bench/scale.py --quick --parts nodes" || status=1
      ;;
    store)
      bash scripts/bench-gpu.sh "bench/page_cache.py" "bench/native.py --quick" \
        "bench/client_ab.py --quick --ops store --baseline scratch/base-client" || status=1
      ;;
    daemon)
      bash scripts/bench-gpu.sh "bench/server.py --quick --no-tls --baseline scratch/base" \
        || status=1
      (
        source scripts/_gpu-site.sh
        python3 bench/profile_daemon.py --op put --seconds 15 >"$OUT/profile_daemon_put.txt" 2>&1 \
          || echo "FAILED: bench/profile_daemon.py --op put"
        tail -n 14 "$OUT/profile_daemon_put.txt"
      ) || status=1
      ;;
    peers) RUNS=1 bash scripts/peers-gpu.sh lmcache 2>&1 | tail -n 25 || status=1 ;;
    pool)
      bash scripts/bench-gpu.sh "bench/pool_cost.py --shape dsv41 --processes 0,4,8,12" \
        "bench/pool_cost.py --shape llama --processes 0,4,8,12" || status=1
      ;;
    pool-ab)
      (
        source scripts/_gpu-site.sh
        root="$(pwd)"; out="$(cd "$OUT" && pwd)"
        for shape in llama dsv41; do
          for side in base new; do
            # The base runs in its own directory: `python -m` (the I/O workers, the daemons)
            # puts the working directory first on sys.path.
            dir="$root"; pp="$PYTHONPATH"
            [ "$side" = base ] && dir="$root/scratch/base-client" && pp="$dir:$PYTHONPATH"
            (cd "$dir" && PYTHONPATH="$pp" python3 "$root/bench/pool_cost.py" --shape "$shape" \
              --processes 0,4,12 --json "$out/pool_cost_${side}_$shape.json") \
              >"$out/pool_cost_${side}_$shape.txt" 2>&1 || echo "FAILED: pool_cost $side $shape"
            echo "--- $side $shape"; tail -n 4 "$out/pool_cost_${side}_$shape.txt"
          done
        done
      ) || status=1
      ;;
    engine)
      RUNS=1 bash scripts/engine-gpu.sh --io-processes 12 --connections-per-node 1 2>&1 \
        | tail -n 40 || status=1
      ;;
    dsv41)
      # The engine benchmark (--quick: 3 repeats, the headline's sizes) with 12, 8 and 4 I/O
      # processes: the DeepSeek-V4.1 load's GB/s and client cores by pool size, and how much of
      # it is the match (dsv41_match_*); the Llama figures come along.
      (
        source scripts/_gpu-site.sh
        n=0
        for procs in ${DSV41_PROCS:-12 8 4}; do  # in this order (DSV41_PROCS="4 12 4": order effects)
          n=$((n + 1)); stem="$OUT/dsv41_run${n}_io$procs"
          python3 bench/engine_gpu.py --quick --no-recompute --io-processes "$procs" \
            --connections-per-node 1 --json "$stem.json" >"$stem.txt" 2>&1 \
            || echo "FAILED: $procs I/O processes"
          echo "--- run $n: $procs I/O processes"
          grep -E "^(DSV41|store 4|load 4)" "$stem.txt"
        done
      ) || status=1
      ;;
    engine-ab)
      headline() {
        mkdir -p "$1"
        OUT="$1" RUNS=1 bash scripts/engine-gpu.sh --io-processes 12 --connections-per-node 1 \
          2>&1 | grep -E '^\| `(e2e_|load_vs|dsv41|client_c|daemon_cpu)' || echo "FAILED: $1"
        # What the client did besides the healthy path (hedges, redirected shards, errors).
        python3 -c 'import json, sys; c = json.load(open(sys.argv[1])).get("client_counters", {})
print("counters:", {k: v for k, v in sorted(c.items()) if v and not k.startswith("blocks_")})' \
          "$1/engine_gpu_run1.json" 2>/dev/null || true
      }
      if [ ! -d scratch/base/kvcache ] || [ ! -d scratch/whl-base ]; then
        echo "engine-ab needs scratch/base and scratch/whl-base carried" >&2
        status=1
      else
        # AB_ORDER (default "base new") picks the order, a tree may come more than once
        # (its runs go to $OUT/<tree>_<n>): a run pays for the page cache and writeback
        # the one before it left, so each run starts after a sync and the ratio is taken
        # over both orders.
        n=0
        for tree in ${AB_ORDER:-base new}; do
          n=$((n + 1))
          sync
          if [ "$tree" = base ]; then
            mv .whl .whl-new && mv scratch/whl-base .whl && mv kvcache kvcache-new \
              && cp -r scratch/base/kvcache kvcache && rm -rf /tmp/kvcache-site
            echo "== base ($(cat .whl/COMMIT 2>/dev/null))"
            headline "$OUT/base_$n"
            rm -rf kvcache && mv kvcache-new kvcache && mv .whl scratch/whl-base \
              && mv .whl-new .whl && rm -rf /tmp/kvcache-site
          else
            echo "== new ($(cat .whl/COMMIT 2>/dev/null))"
            headline "$OUT/new_$n"
          fi
        done
      fi
      ;;
    nodes-ab)
      # Issue 21's client cost by cluster size (bench/scale.py --parts nodes: 12, then 48
      # daemons) for scratch/base (its own native libraries) and this tree in turn, twice:
      # placement groups before/after, on a host whose cores the 48 daemons do not crowd.
      (
        source scripts/_gpu-site.sh
        for i in 1 2; do
          for tree in base new; do
            stem="$OUT/scale_nodes_${tree}_$i"
            run=(python3 bench/scale.py --parts nodes --json "$stem.json")
            in_tree "$tree" "${run[@]}" >"$stem.txt" 2>&1 || echo "(targets missed or failed: $stem.txt)"
            echo "$tree $i: $(grep -E '_48_vs_12|^\| (load_cpu|store_cpu|load64_p99)' "$stem.txt" | tr -s ' ' | tr '\n' ' ')"
          done
        done
      ) || status=1
      ;;
    degraded)
      (
        source scripts/_gpu-site.sh
        for tree in new base; do
          for kill in 0 2; do
            stem="$OUT/profile_load_${tree}_kill$kill"
            run=(python3 bench/profile_load.py --stages --seconds 4 --kill "$kill" --json "$stem.json")
            in_tree "$tree" "${run[@]}" >"$stem.txt" 2>&1 || echo "FAILED: $stem"
            echo "$tree, $kill killed: $(head -n 1 "$stem.txt" | grep -v marked; grep "GB/s" "$stem.txt")"
          done
        done
      ) || status=1
      ;;
    *) echo "unknown part: $part (ab, client, store, daemon, peers, pool, pool-ab, dsv41, engine, engine-ab, nodes-ab, degraded)" >&2; status=2 ;;
  esac
done
exit "$status"
