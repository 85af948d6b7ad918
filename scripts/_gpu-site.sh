# Sourced by the scripts that run on the lent GPU host (engine-gpu.sh, peers-gpu.sh,
# profile-gpu.sh), from the repo root: installs kvcache's carried wheels (.whl/*.whl) into
# /tmp/kvcache-site and sets the environment every run there needs. kvcache's native
# helpers are built here by scripts/build-native.sh and carried in .whl/lib (the GPU host
# has no xxHash headers; the library needs only libc); they are required, so a run never
# silently measures the Python fall-back.
site=/tmp/kvcache-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$site:$(pwd)"
export LD_LIBRARY_PATH="$(pwd)/.whl/lib:${LD_LIBRARY_PATH:-}"
export KVCACHE_NATIVE=require KVCACHE_NATIVE_LIBRARY="$(pwd)/.whl/lib/libkvfast.so"
# The daemons' native data plane, and the LMDB it links (beside it: rpath $ORIGIN).
export KVCACHE_SERVE_LIBRARY="$(pwd)/.whl/lib/libkvserve.so"
export OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1
# The commit the carried wheel was built from (scripts/gpu-prepare.sh), unless given.
if [ -z "${KVCACHE_COMMIT:-}" ] && [ -f .whl/COMMIT ]; then
  export KVCACHE_COMMIT="$(cat .whl/COMMIT)"
fi
