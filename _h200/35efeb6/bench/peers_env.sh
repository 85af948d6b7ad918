#!/usr/bin/env bash
# Create (or reuse) the separate virtual environments in which bench/peers.py runs the other
# open-source KV-cache stores it compares kvcache with:
#
#   mooncake  mooncake-transfer-engine-non-cuda (Mooncake Store: mooncake_master,
#             mooncake_client and the MooncakeDistributedStore Python client), over TCP
#   lmcache   lmcache (its standalone `python -m lmcache.v1.server` and the remote
#             connector client), on a CPU-only torch
#
# Each lives in its own venv under ${KVCACHE_PEERS_DIR:-~/.cache/kvcache/peers}/<name>, never
# in the project's .venv: LMCache pulls torch, transformers and pins of its own (numpy<=2.2.6,
# protobuf<7, setuptools<81). Idempotent and fast when done: a stamp file in each venv records
# what was installed, and a rerun only redoes a venv whose stamp differs.
#
# Debian's libibverbs1 is installed if missing: Mooncake's store.so links against it even when
# only the TCP transport is used.
#
# Torch: LMCache imports torch but this benchmark uses no GPU, so the venv gets the CPU build
# torch==2.13.0+cpu. pip finds that wheel through PIP_FIND_LINKS (here /opt/wheels); PyPI has
# no "+cpu" build, so where no such wheel is on disk the install fails instead of pulling the
# multi-GB CUDA torch. Set KVCACHE_PEERS_TORCH to another requirement to override.
#
# Usage: bash bench/peers_env.sh [mooncake] [lmcache]    (default: both)
# Prints one line per peer, "<name> <python path>", or "<name> FAILED" (exit status 1 then;
# the other peer is still set up).
set -uo pipefail

root="${KVCACHE_PEERS_DIR:-$HOME/.cache/kvcache/peers}"
MOONCAKE_REQ="mooncake-transfer-engine-non-cuda==0.3.13.post1"
LMCACHE_REQ="lmcache==0.5.6"
TORCH_REQ="${KVCACHE_PEERS_TORCH:-torch==2.13.0+cpu}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(mooncake lmcache)

stamped() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

ensure_ibverbs() {
  if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    return 0
  fi
  echo "installing Debian's libibverbs1 (needed by Mooncake's store.so)" >&2
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get install -y -q libibverbs1 >&2 \
    || { $sudo apt-get update -q >&2 && $sudo apt-get install -y -q libibverbs1 >&2; }
}

new_venv() {  # new_venv DIR STAMP WANT: (re)create DIR unless its stamp says WANT
  local venv="$1" stamp="$2" want="$3"
  if [ -x "$venv/bin/python" ] && stamped "$stamp" "$want"; then
    return 1
  fi
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2 || return 2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2 || return 2
  return 0
}

setup_mooncake() {
  local venv="$root/mooncake" want="$MOONCAKE_REQ;v1"
  local stamp="$venv/.kvcache-peer-stamp"
  ensure_ibverbs || return 1
  new_venv "$venv" "$stamp" "$want"
  case $? in
    1) ;;  # up to date
    0)
      echo "building $venv ($MOONCAKE_REQ, ~50 MB download)" >&2
      "$venv/bin/python" -m pip install -q "$MOONCAKE_REQ" numpy >&2 || return 1
      "$venv/bin/python" -c "from mooncake.store import MooncakeDistributedStore" >&2 || return 1
      echo "$want" >"$stamp"
      ;;
    *) return 1 ;;
  esac
  echo "$venv/bin/python"
}

setup_lmcache() {
  local venv="$root/lmcache" want="$LMCACHE_REQ;$TORCH_REQ;v1"
  local stamp="$venv/.kvcache-peer-stamp"
  new_venv "$venv" "$stamp" "$want"
  case $? in
    1) ;;
    0)
      echo "building $venv ($TORCH_REQ, then $LMCACHE_REQ; ~1 GB on disk)" >&2
      "$venv/bin/python" -m pip install -q --only-binary :all: "$TORCH_REQ" >&2 || {
        echo "no wheel for $TORCH_REQ (expected on disk via PIP_FIND_LINKS); not pulling a" \
          "CUDA torch from PyPI. Set KVCACHE_PEERS_TORCH to override." >&2
        return 1
      }
      # Keep the torch just installed: a constraint makes pip fail rather than replace it.
      local torch_ver
      torch_ver="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')" || return 1
      echo "torch==$torch_ver" >"$venv/constraints.txt"
      PIP_CONSTRAINT="$venv/constraints.txt" \
        "$venv/bin/python" -m pip install -q "$LMCACHE_REQ" >&2 || return 1
      "$venv/bin/python" -c "import lmcache.v1.server, torch; print('torch', torch.__version__)" \
        >&2 || return 1
      echo "$want" >"$stamp"
      ;;
    *) return 1 ;;
  esac
  echo "$venv/bin/python"
}

status=0
for peer in "${peers[@]}"; do
  case "$peer" in
    mooncake | lmcache) ;;
    *)
      echo "unknown peer: $peer (mooncake, lmcache)" >&2
      status=2
      continue
      ;;
  esac
  if py="$("setup_$peer")"; then
    echo "$peer $py"
  else
    echo "$peer FAILED"
    status=1
  fi
done
exit $status
