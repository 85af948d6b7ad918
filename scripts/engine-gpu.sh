#!/usr/bin/env bash
# The whole GPU measurement of the engine path in one call, on the lent H200 machine (its
# python3 has torch + CUDA, numpy, xxhash and aiohttp; nothing can be downloaded there).
# Beforehand, on a machine with PyPI, fill .whl/ with the cp312 wheel of lmdb and .whl/lib
# with libisal.so.2 (docs/benchmarks.md, "Engine on a GPU", says how); carry .whl.
# The benchmark runs RUNS times (default 3), each a fresh process with its own cluster;
# bench/_runs.py then writes engine_gpu.json with the median of each figure as the figure,
# plus <figure>_runs (each run's value) and <figure>_range, and prints the headline table.
# Each run's own JSON is kept as engine_gpu_run<N>.json, all output in engine_gpu.txt.
# Usage: [RUNS=3] [WARM_HOST_GB=64] bash scripts/engine-gpu.sh [bench/engine_gpu.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu-site.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc; free -g | head -2
python3 -c 'import torch, numpy, xxhash, aiohttp, lmdb, kvcache.erasure as e; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "numpy", numpy.__version__, "xxhash", xxhash.VERSION, "lmdb", lmdb.__version__, "erasure backend", e.get_codec().backend)'
# A host in service has used its RAM before; this one may have just booted, and a VM's
# lazily backed RAM costs more on first use (the daemons' page cache included). Touch
# WARM_HOST_GB of it first, in parallel (0 skips this), and print what first use cost.
python3 - "${WARM_HOST_GB:-64}" <<'PY'
import multiprocessing as mp, sys, time
import numpy as np
def touch(gb: float) -> float:
    t = time.perf_counter(); a = np.ones(int(gb * 2**30), np.uint8); dt = time.perf_counter() - t
    del a
    return dt / (gb * 2**30 / 1e9)
total = float(sys.argv[1])
if total > 0:
    with mp.Pool(16) as pool:
        for attempt in (1, 2):
            t = time.perf_counter()
            costs = pool.map(touch, [total / 16] * 16)
            print(f"touching {total:.0f} GiB of host memory, pass {attempt}: "
                  f"{max(costs):.3f} s/GB per process, {time.perf_counter() - t:.1f} s")
PY
out="${OUT:-bench/results}"
mkdir -p "$out"
runs="${RUNS:-3}"
: >"$out/engine_gpu.txt"
done_runs=()
for i in $(seq 1 "$runs"); do
  echo "=== run $i of $runs ===" | tee -a "$out/engine_gpu.txt"
  rm -f "$out/engine_gpu_run$i.json"
  if python3 bench/engine_gpu.py --json "$out/engine_gpu_run$i.json" "$@" 2>&1 \
    | tee -a "$out/engine_gpu.txt"; then
    done_runs+=("$out/engine_gpu_run$i.json")
  else
    echo "run $i failed (its output is above); the others are still combined" \
      | tee -a "$out/engine_gpu.txt"
  fi
done
[ ${#done_runs[@]} -gt 0 ] || { echo "no run finished" >&2; exit 1; }
headline=e2e_load_gbps_4gib,client_cores_busy_load_4gib,e2e_store_gbps_4gib
headline+=,client_cores_busy_store_4gib,e2e_store_gbps_4gib_cold,e2e_load_gbps_4gib_one_process
headline+=,load_vs_recompute_8k,load_vs_recompute_32k,load_vs_recompute_77k
headline+=,dsv41_load_gbps,dsv41_blocks_per_s,dsv41_client_cores_busy,dsv41_store_gbps
headline+=,dsv41_overlapped_load_gbps,dsv41_overlapped_client_cores_busy
headline+=,client_cpu_s_per_gb_load,client_cpu_s_per_gb_store
headline+=,daemon_cpu_s_per_gb_get,daemon_cpu_s_per_gb_put,gather_vs_raw,scatter_vs_raw
python3 bench/_runs.py --json "$out/engine_gpu.json" --keys "$headline" \
  --title "Engine on a GPU: median and range" "${done_runs[@]}" 2>&1 | tee -a "$out/engine_gpu.txt"
[ ${#done_runs[@]} -eq "$runs" ] || exit 1
