#!/usr/bin/env bash
# Create (or reuse) the separate virtual environment in which the SGLang tier runs kvcache's
# HiCache backend through SGLang's own classes: sglang 0.5.23 from PyPI, without its GPU
# serving stack, plus what its HiCache storage interface, dynamic backend loader and
# host-pool classes import (scripts/sglang-requirements.txt, pinned, --no-deps), plus
# kvcache itself (editable, no dependencies moved).
#
# Where it stops on a CPU machine: `pip install sglang==0.5.23` whole cannot work here (it
# needs flashinfer, deep-gemm, flash-attn-4, cuda-python, ... built for CUDA 13 and a GPU
# to do anything). The host-pool package imports sglang.srt.configs (every model's
# config), one of which needs torchvision; PyPI's torchvision is built against PyPI's
# CUDA torch, so the venv takes SGLang's pinned torch 2.14.1 (CUDA build, ~3 GB with the
# NVIDIA libraries it loads at import; no GPU is used). Nothing of SGLang's scheduler,
# radix cache or model runner is built: they need the GPU kernels.
#
#   KVCACHE_SGLANG_VENV   where the venv lives (default: .sglang-venv in the repository root)
# Idempotent: a stamp records what was installed. Prints the venv's python as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

SGLANG_VERSION="0.5.23"
venv="${KVCACHE_SGLANG_VENV:-$repo/.sglang-venv}"
py="$venv/bin/python"
stamp="$venv/.kvcache-sglang-stamp"
want="sglang==$SGLANG_VERSION;$(sha256sum scripts/sglang-requirements.txt | cut -c1-16);v1"
repo_stamp="$venv/.kvcache-repo-stamp"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1

stamped() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

if ! { [ -x "$py" ] && stamped "$stamp" "$want"; }; then
  echo "building the SGLang test venv in $venv (sglang==$SGLANG_VERSION, ~6 GB with CUDA torch)" >&2
  [ -x "$py" ] || python3 -m venv "$venv"
  rm -f "$stamp" "$repo_stamp"
  "$py" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" >&2
  "$py" -m pip install -q --no-deps -r scripts/sglang-requirements.txt >&2
  echo "$want" >"$stamp"
fi

if ! stamped "$repo_stamp" "$repo"; then
  "$py" -m pip install -q --no-deps -e "$repo" >&2
  "$py" - >&2 <<'PY'
import warnings
warnings.filterwarnings("ignore")
import sglang, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
import kvcache.engine.sglang_backend as b
assert issubclass(b.KVCacheStorage, HiCacheStorage)
print(f"sglang {sglang.__version__}, torch {torch.__version__}")
PY
  echo "$repo" >"$repo_stamp"
fi
echo "$py"
