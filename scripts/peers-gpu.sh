#!/usr/bin/env bash
# bench/peers.py on the lent H200 machine: kvcache beside one peer (Mooncake Store or the
# LMCache server), everything from carried files (that machine has no network).
#
# One peer per call: a call carries at most 64 MiB, and Mooncake's wheel alone is 46 MB
# (LMCache's 18 MB with the few dependencies the H200 image lacks).
#
# 1. Here, on a machine with PyPI, in the repo root (both folders are git-ignored):
#      bash scripts/peers-gpu.sh prepare mooncake    # .peer-wheels/mooncake: wheel + lib/
#      bash scripts/peers-gpu.sh prepare lmcache     # .peer-wheels/lmcache: wheels
#    and kvcache's own wheels in .whl/ as for scripts/engine-gpu.sh (docs/benchmarks.md,
#    "Engine on a GPU"). `prepare` runs `pip download --no-deps --only-binary=:all:` for
#    CPython 3.12 manylinux x86_64 (the H200 image's python3), and for Mooncake copies the
#    shared libraries its store.so and binaries load that are not part of a base system
#    (libibverbs, libnl, libnuma, libcurl and its less common dependencies) from this
#    machine into .peer-wheels/mooncake/lib.
# 2. Then, with the device tool:
#      run  command="bash scripts/peers-gpu.sh mooncake"  carry=[".whl", ".peer-wheels/mooncake"]
#      run  command="bash scripts/peers-gpu.sh lmcache"   carry=[".whl", ".peer-wheels/lmcache"]
#    Extra arguments go to bench/peers.py (--quick for a short run). RUNS (default 3)
#    invocations, each running kvcache and then the peer; bench/_runs.py writes their
#    medians and ranges to $OUT/peers_<peer>.json (each run: peers_<peer>_run<N>.json),
#    all output in $OUT/peers_<peer>.txt ($OUT defaults to bench/results).
#
# On the device: kvcache's wheels go to /tmp/kvcache-site (PYTHONPATH, with the tree for
# kvcache itself); the peer's wheels to /tmp/kvcache-peers/<peer>/site with --no-deps,
# so the image's own torch, numpy, aiohttp... serve as its dependencies. bench/peers.py
# finds the peer through KVCACHE_PEERS_DIR=/tmp/kvcache-peers: <peer>/bin/python there is
# a small wrapper running the image's python3 with the peer's site first on PYTHONPATH,
# and for Mooncake bin/mooncake_master and bin/mooncake_client wrap its console scripts.
# A carried library is used only where the host lacks it (ldd says "not found"). LMCache
# runs with CUDA_VISIBLE_DEVICES= : its server and client are used on the CPU, as here, so
# its CUDA extension (built for another torch) is never loaded.
set -euo pipefail
cd "$(dirname "$0")/.."

MOONCAKE_REQ="mooncake-transfer-engine-non-cuda==0.3.13.post1"
# LMCache and, with --no-deps, the packages its server and protocol import that the H200
# image lacks (the image has torch, numpy, psutil, prometheus_client, sortedcontainers,
# py-cpuinfo, pyyaml, grpcio, aiohttp, msgpack...). protobuf is carried so that
# opentelemetry-proto gets the major version it was generated for.
LMCACHE_REQS=(
  lmcache==0.5.6 cachetools==8.0.2 nvtx==0.2.17 importlib_metadata==8.7.1 zipp==4.1.2
  opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0 opentelemetry-proto==1.40.0
  opentelemetry-semantic-conventions==0.61b0 opentelemetry-exporter-otlp==1.40.0
  opentelemetry-exporter-otlp-proto-common==1.40.0 opentelemetry-exporter-otlp-proto-grpc==1.40.0
  opentelemetry-exporter-otlp-proto-http==1.40.0 opentelemetry-exporter-prometheus==0.61b0
  googleapis-common-protos==1.76.0 protobuf==6.33.6
)
# Libraries of Mooncake's native parts a bare image may lack; glibc, libstdc++, OpenSSL,
# GnuTLS, zlib and zstd are left to the host.
MOONCAKE_LIBS=(
  libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200 libnuma.so.1 libcurl.so.4
  libnghttp2.so.14 librtmp.so.1 libssh2.so.1 libpsl.so.5 libldap-2.5.so.0 liblber-2.5.so.0
  libsasl2.so.2 libbrotlidec.so.1 libbrotlicommon.so.1 libgssapi_krb5.so.2 libkrb5.so.3
  libk5crypto.so.3 libkrb5support.so.0 libcom_err.so.2 libkeyutils.so.1 libidn2.so.0
)

download() {  # download DIR REQ...
  local dir="$1"
  shift
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$dir" "$@"
}

prepare() {
  local peer="$1" dir=".peer-wheels/$1"
  rm -rf "$dir"
  mkdir -p "$dir"
  case "$peer" in
    mooncake)
      download "$dir" "$MOONCAKE_REQ"
      mkdir -p "$dir/lib"
      for lib in "${MOONCAKE_LIBS[@]}"; do
        path="$(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ && !n++ {print $NF}')"
        [ -n "$path" ] || { echo "$lib not found here (apt-get install the package)" >&2; exit 1; }
        cp -L "$path" "$dir/lib/$lib"
      done
      ;;
    lmcache) download "$dir" "${LMCACHE_REQS[@]}" ;;
    *) echo "unknown peer: $peer (mooncake, lmcache)" >&2; exit 2 ;;
  esac
  du -sh "$dir" .whl 2>/dev/null || true
  echo "carry: [\".whl\", \"$dir\"]"
}

wrap() {  # wrap PATH SITE LIBDIR COMMAND...: a script running COMMAND with the peer's paths
  local path="$1" site="$2" libdir="$3"
  shift 3
  {
    echo '#!/bin/sh'
    echo "export PYTHONPATH=\"$site\${PYTHONPATH:+:\$PYTHONPATH}\""
    echo "export LD_LIBRARY_PATH=\"$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
    [ "$peer" != lmcache ] || echo 'export CUDA_VISIBLE_DEVICES='
    echo "exec $* \"\$@\""
  } >"$path"
  chmod +x "$path"
}

missing_libs() {  # missing_libs LIBDIR FILE...: link carried libraries the host lacks
  local libdir="$1" carried="$2"
  shift 2
  for _ in 1 2 3 4 5; do
    local absent
    absent="$(LD_LIBRARY_PATH="$libdir" ldd "$@" 2>/dev/null | awk '/not found/ {print $1}' | sort -u)"
    [ -n "$absent" ] || return 0
    for lib in $absent; do
      if [ -e "$carried/$lib" ]; then
        ln -sf "$(realpath "$carried/$lib")" "$libdir/$lib"
        echo "using the carried $lib" >&2
      else
        echo "the host lacks $lib and it was not carried" >&2
        return 1
      fi
    done
  done
}

if [ "${1:-}" = prepare ]; then
  shift
  peers=("$@")
  [ ${#peers[@]} -gt 0 ] || peers=(mooncake lmcache)
  for peer in "${peers[@]}"; do prepare "$peer"; done
  exit 0
fi

peer="${1:?usage: bash scripts/peers-gpu.sh mooncake|lmcache [bench/peers.py flags], or prepare PEER}"
shift
carried=".peer-wheels/$peer"
[ -d "$carried" ] || { echo "$carried is missing: bash scripts/peers-gpu.sh prepare $peer, then carry it" >&2; exit 1; }
py="$(command -v python3)"
py="$(realpath -s "$py")"
source scripts/_gpu-site.sh
export KVCACHE_PEERS_DIR=/tmp/kvcache-peers
root="$KVCACHE_PEERS_DIR/$peer"
rm -rf "$root"
mkdir -p "$root/bin" "$root/lib"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/site" "$carried"/*.whl
wrap "$root/bin/python" "$root/site" "$root/lib" "$py"
case "$peer" in
  mooncake)
    pkg="$root/site/mooncake"
    chmod +x "$pkg/mooncake_master" "$pkg/mooncake_client"
    missing_libs "$root/lib" "$carried/lib" "$pkg/store.so" "$pkg/engine.so" "$pkg/mooncake_master" "$pkg/mooncake_client"
    for cmd in mooncake_master mooncake_client; do
      wrap "$root/bin/$cmd" "$root/site" "$root/lib" "$py" "$root/site/bin/$cmd"
    done
    "$root/bin/python" -c "from mooncake.store import MooncakeDistributedStore; print('mooncake store: ok')"
    ;;
  lmcache)
    "$root/bin/python" -c "import lmcache.v1.server, lmcache.v1.protocol, torch; print('lmcache: ok, torch', torch.__version__)"
    ;;
esac
nproc
python3 -c 'import kvcache.erasure as e, lmdb; print("kvcache erasure backend", e.get_codec().backend)'
out="${OUT:-bench/results}"
mkdir -p "$out"
runs="${RUNS:-3}"
log="$out/peers_$peer.txt"
: >"$log"
done_runs=()
for i in $(seq 1 "$runs"); do
  echo "=== run $i of $runs ===" | tee -a "$log"
  json="$out/peers_${peer}_run$i.json"
  rm -f "$json"
  python3 bench/peers.py --only kvcache --only "$peer" --json "$json" "$@" 2>&1 | tee -a "$log" || true
  [ -f "$json" ] && done_runs+=("$json")
done
[ ${#done_runs[@]} -gt 0 ] || { echo "no run finished" >&2; exit 1; }
keys=""
for sys in kvcache "$peer"; do
  for fig in get_gbps put_gbps cpu_s_per_gb_get cpu_s_per_gb_put client_cpu_s_per_gb_get \
    server_cpu_s_per_gb_get client_cpu_s_per_gb_put server_cpu_s_per_gb_put; do
    keys+="${sys}_$fig,"
  done
done
keys+="${peer}_get_vs_kvcache,${peer}_put_vs_kvcache"
python3 bench/_runs.py --json "$out/peers_$peer.json" --keys "$keys" \
  --title "kvcache and $peer side by side: median and range" "${done_runs[@]}" 2>&1 | tee -a "$log"
