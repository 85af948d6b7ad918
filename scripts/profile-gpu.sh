#!/usr/bin/env bash
# Where the engine path's CPU goes on the lent GPU host, in one call: bench/engine_gpu.py
# (--quick, no recompute baseline) under `py-spy record --subprocesses`, so the benchmark
# process, its I/O worker processes and the 12 daemons are all sampled; then
# bench/_pyspy_table.py sums the samples by role (main, io, daemon) into self and inclusive
# tables. Carry .whl as for scripts/engine-gpu.sh (it holds the py-spy wheel too).
# Writes $OUT/profile_gpu.txt (the tables and the benchmark's output) and the raw samples
# as $OUT/profile_gpu_raw.txt. Extra arguments go to bench/engine_gpu.py. BENCH, if set, is
# another benchmark's command line to profile instead (e.g. "bench/pool_cost.py
# --processes 8"); PROFILE_NAME (default profile_gpu) names the files.
# SPY_FLAGS (default "--subprocesses --nonblocking") replaces py-spy's sampling flags: e.g.
# "--idle --nonblocking" samples the benchmark process alone, waiting threads included (where a
# call's wall time goes, not only its CPU).
# Usage: [RATE=100] [BENCH="bench/x.py flags"] [SPY_FLAGS=...] bash scripts/profile-gpu.sh [engine_gpu flags]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu-site.sh
out="${OUT:-bench/results}"
mkdir -p "$out"
spy="$site/bin/py-spy"
[ -x "$spy" ] || { echo "no py-spy in .whl: pip download py-spy (see docs/benchmarks.md)" >&2; exit 1; }
name="${PROFILE_NAME:-profile_gpu}"
if [ -n "${BENCH:-}" ]; then
  read -r -a cmd <<<"$BENCH"
else
  cmd=(bench/engine_gpu.py --quick --no-recompute "$@")
fi
read -r -a spy_flags <<<"${SPY_FLAGS:---subprocesses --nonblocking}"
"$spy" record "${spy_flags[@]}" --format raw --rate "${RATE:-100}" \
  -o "$out/${name}_raw.txt" -- python3 "${cmd[@]}" --json "$out/$name.json" \
  2>&1 | tee "$out/$name.txt"
python3 bench/_pyspy_table.py "$out/${name}_raw.txt" --top 40 | tee -a "$out/$name.txt"
