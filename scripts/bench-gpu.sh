#!/usr/bin/env bash
# Run CPU-side benchmarks on the lent GPU host in one call: each argument is one benchmark
# command line (a bench/ script and its flags, quoted), run in turn with the carried wheels
# (.whl, as scripts/engine-gpu.sh needs them) and the native helpers required. Each writes
# its JSON and its output to $OUT (default bench/results) as NAME[-N].json / .txt, NAME the
# script's; a failed one is reported and the rest still run.
# Usage: KVCACHE_COMMIT=<sha> bash scripts/bench-gpu.sh "bench/swa.py" "bench/events.py --aa"
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu-site.sh
out="${OUT:-bench/results}"
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)" || true
status=0
for line in "$@"; do
  read -r -a argv <<<"$line"
  name="$(basename "${argv[0]}" .py)"
  n=1
  while [ -e "$out/$name$([ "$n" -gt 1 ] && echo "-$n").json" ]; do n=$((n + 1)); done
  stem="$out/$name$([ "$n" -gt 1 ] && echo "-$n")"
  echo "=== $line -> $stem.json ==="
  if ! python3 "${argv[@]}" --json "$stem.json" >"$stem.txt" 2>&1; then
    echo "FAILED: $line (tail of $stem.txt below)"
    status=1
  fi
  tail -n 40 "$stem.txt"
done
exit "$status"
