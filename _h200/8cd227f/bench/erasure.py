"""Benchmark of the erasure codecs against numpy memcpy of the same bytes.

    python bench/erasure.py [--quick] [--json PATH]

Payloads are 112 KiB (114688 bytes), k = 10, m = 2. For each available backend it
times encode of 1 block and of a 64-block batch, and rebuilding 1 and 2 lost data
shards of a 64-block batch; in the same run it times ``np.copyto`` of the same
payload bytes into a preallocated array, alternating codec and memcpy samples so
that load from elsewhere on a shared machine hits both. Every figure is payload
bytes / time, from the best of many samples (each ≥ a few ms of calls; medians
are in the JSON too), and every ratio is memcpy time / codec time over the same
bytes (> 1: faster than copying them).

Two cache regimes are reported:

* **hot** (the headline): the same batch over and over — it stays in L2/L3, as a
  batch does when it is encoded right after being assembled, or rebuilt right
  after its shards arrived;
* **cold**: every sample takes the next batch from a pool larger than the last
  level cache, so reads come from DRAM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

try:
    import kvcache.erasure  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache.erasure import Backend, ErasureParams, alloc_stripes, get_codec, isal_available

PAYLOAD = 114688  # 112 KiB
BLOCKS = 64
COLD_POOL_BYTES = 128 << 20  # well past a 32 MiB L3
LOST_1 = (3,)
LOST_2 = (3, 7)

Stripes = npt.NDArray[np.uint8]
Result = dict[str, float | int | str]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _sample(fn: Callable[[], object], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def _inner(fn: Callable[[], object], min_sample_s: float) -> int:
    fn()  # warm up: caches, lazily built tables
    return max(1, int(min_sample_s / max(_sample(fn, 1), 1e-7)))


@dataclass(frozen=True)
class Pair:
    """Seconds per call of a codec operation and of memcpy of the same bytes."""

    best: float
    best_memcpy: float
    median: float
    median_memcpy: float

    @classmethod
    def of(cls, ours: list[float], theirs: list[float]) -> Pair:
        return cls(min(ours), min(theirs), statistics.median(ours), statistics.median(theirs))


def compare(
    fn: Callable[[], object],
    reference: Callable[[], object],
    samples: int,
    min_sample_s: float,
) -> Pair:
    """Time ``fn`` and ``reference`` alternately, ``samples`` samples each.

    Alternating keeps the ratio honest on a shared machine: a burst of load from
    elsewhere slows both sides of a pair, not just one figure.
    """
    inner_fn, inner_ref = _inner(fn, min_sample_s), _inner(reference, min_sample_s)
    ours, theirs = [], []
    for _ in range(samples):
        theirs.append(_sample(reference, inner_ref))
        ours.append(_sample(fn, inner_fn))
    return Pair.of(ours, theirs)


def compare_cold(
    fns: list[Callable[[], object]], references: list[Callable[[], object]], samples: int
) -> Pair:
    """Like :func:`compare`, one call per sample, each on the next batch of a large pool."""
    for f in fns + references:
        f()
    ours, theirs = [], []
    for i in range(samples):
        theirs.append(_sample(references[i % len(references)], 1))
        ours.append(_sample(fns[(i + len(fns) // 2) % len(fns)], 1))
    return Pair.of(ours, theirs)


def record(results: Result, prefix: str, nbytes: int, pair: Pair) -> None:
    """Store GB/s (best and median) of both sides and their ratios under ``prefix``."""
    results[f"{prefix}_gbps"] = nbytes / pair.best / 1e9
    results[f"{prefix}_memcpy_gbps"] = nbytes / pair.best_memcpy / 1e9
    results[f"{prefix}_vs_memcpy"] = pair.best_memcpy / pair.best
    results[f"{prefix}_median_gbps"] = nbytes / pair.median / 1e9
    results[f"{prefix}_median_memcpy_gbps"] = nbytes / pair.median_memcpy / 1e9
    results[f"{prefix}_median_vs_memcpy"] = pair.median_memcpy / pair.median


def random_batch(params: ErasureParams, blocks: int, seed: int) -> Stripes:
    stripes = alloc_stripes(params, blocks, params.shard_len(PAYLOAD))
    rng = np.random.default_rng(seed)
    flat = stripes.reshape(blocks, -1)
    flat[:, :PAYLOAD] = rng.integers(0, 256, (blocks, PAYLOAD), dtype=np.uint8)
    return stripes


def present_without(params: ErasureParams, lost: tuple[int, ...]) -> list[int]:
    return [i for i in range(params.n) if i not in lost]


def bench_backend(
    backend: Backend,
    stripes: Stripes,
    pool: list[Stripes],
    pool_dst: list[Stripes],
    samples: int,
    min_sample_s: float,
    cold_samples: int,
    results: Result,
) -> None:
    """Time one backend; record GB/s and ratios against memcpy sampled alongside."""
    codec = get_codec(ErasureParams(), backend)
    params = codec.params
    k = params.k
    name = backend.value
    copy_dst = np.empty((stripes.shape[0], k, stripes.shape[2]), dtype=np.uint8)
    batch_bytes = stripes.shape[0] * PAYLOAD
    one = stripes[:1]
    lost1, lost2 = present_without(params, LOST_1), present_without(params, LOST_2)
    codec.encode(stripes)
    cases: dict[str, tuple[Callable[[], object], Callable[[], object], int]] = {
        "encode1": (
            lambda: codec.encode(one),
            lambda: np.copyto(copy_dst[0], one[0, :k]),
            PAYLOAD,
        ),
        "encode": (
            lambda: codec.encode(stripes),
            lambda: np.copyto(copy_dst, stripes[:, :k]),
            batch_bytes,
        ),
        "decode1": (
            lambda: codec.reconstruct(stripes, lost1),
            lambda: np.copyto(copy_dst, stripes[:, :k]),
            batch_bytes,
        ),
        "decode2": (
            lambda: codec.reconstruct(stripes, lost2),
            lambda: np.copyto(copy_dst, stripes[:, :k]),
            batch_bytes,
        ),
    }
    for label, (fn, reference, nbytes) in cases.items():
        record(results, f"{name}_{label}", nbytes, compare(fn, reference, samples, min_sample_s))

    for batch in pool:
        codec.encode(batch)
    copies: list[Callable[[], object]] = [
        lambda s=s, d=d: np.copyto(d, s[:, :k])  # type: ignore[misc]
        for s, d in zip(pool, pool_dst, strict=True)
    ]
    cold: dict[str, list[Callable[[], object]]] = {
        "encode": [lambda s=s: codec.encode(s) for s in pool],  # type: ignore[misc]
        "decode2": [lambda s=s: codec.reconstruct(s, lost2) for s in pool],  # type: ignore[misc]
    }
    for label, fns in cold.items():
        record(
            results, f"cold_{name}_{label}", batch_bytes, compare_cold(fns, copies, cold_samples)
        )


def run(quick: bool) -> Result:
    params = ErasureParams()
    results: Result = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}",
        "numpy": np.__version__,
        "payload_bytes": PAYLOAD,
        "blocks": BLOCKS,
        "k": params.k,
        "m": params.m,
        "shard_len": params.shard_len(PAYLOAD),
    }
    samples, min_sample_s = (41, 0.002) if quick else (201, 0.003)
    cold_samples = 61 if quick else 301
    stripes = random_batch(params, BLOCKS, seed=1)
    pool_size = max(2, COLD_POOL_BYTES // stripes.nbytes)
    pool = [random_batch(params, BLOCKS, seed=100 + i) for i in range(pool_size)]
    pool_dst = [np.empty((BLOCKS, params.k, stripes.shape[2]), np.uint8) for _ in pool]
    backends = [Backend.ISAL, Backend.NUMPY] if isal_available() else [Backend.NUMPY]
    for backend in backends:
        bench_backend(
            backend, stripes, pool, pool_dst, samples, min_sample_s, cold_samples, results
        )
    # Summary memcpy figures: the median over cases of the memcpy paired with each case.
    for summary, suffix in (
        ("memcpy_gbps", ("encode", "decode1", "decode2")),
        ("memcpy1_gbps", ("encode1",)),
        ("cold_memcpy_gbps", ()),
    ):
        prefix = "cold_" if summary.startswith("cold") else ""
        figures = [
            float(value)
            for key, value in results.items()
            if key.startswith(prefix)
            and key.endswith("_memcpy_gbps")
            and "_median_" not in key
            and key != summary
            and (not suffix or any(key.endswith(f"_{s}_memcpy_gbps") for s in suffix))
            and (prefix or not key.startswith("cold_"))
        ]
        results[summary] = statistics.median(figures)
    return results


ROWS = [
    ("encode1", "encode, 1 block"),
    ("encode", f"encode, {BLOCKS} blocks"),
    ("decode1", f"rebuild 1 lost data shard, {BLOCKS} blocks"),
    ("decode2", f"rebuild 2 lost data shards, {BLOCKS} blocks"),
]


def table(results: Result) -> str:
    """The figures as a markdown table (plus a header line naming the machine)."""
    lines = [
        f"Machine: {results['machine']}; numpy {results['numpy']}; payload {PAYLOAD} B, "
        f"k={results['k']}, m={results['m']}, shard {results['shard_len']} B, "
        f"batches of {BLOCKS} blocks",
        "",
        "| backend | operation | GB/s | memcpy GB/s | × memcpy | × memcpy (median) "
        "| cold GB/s | cold memcpy GB/s | cold × memcpy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for backend in (Backend.ISAL, Backend.NUMPY):
        name = backend.value
        for key, label in ROWS:
            hot = f"{name}_{key}"
            if f"{hot}_gbps" not in results:
                continue
            row = [
                name,
                label,
                f"{results[f'{hot}_gbps']:.2f}",
                f"{results[f'{hot}_memcpy_gbps']:.1f}",
                f"**{results[f'{hot}_vs_memcpy']:.2f}**",
                f"{results[f'{hot}_median_vs_memcpy']:.2f}",
            ]
            cold = f"cold_{name}_{key}"
            if f"{cold}_gbps" in results:
                row += [
                    f"{results[f'{cold}_gbps']:.2f}",
                    f"{results[f'{cold}_memcpy_gbps']:.1f}",
                    f"{results[f'{cold}_vs_memcpy']:.2f}",
                ]
            else:
                row += ["", "", ""]
            lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        f"memcpy, median over the cases: {results['memcpy_gbps']:.1f} GB/s hot, "
        f"{results['cold_memcpy_gbps']:.1f} GB/s cold; 1 block: "
        f"{results['memcpy1_gbps']:.1f} GB/s.",
        "",
        "GB/s = payload bytes / best sample time. memcpy = np.copyto of the same payload bytes "
        "into a preallocated array, sampled alternately with each case; × memcpy = memcpy "
        "time / codec time (> 1: faster than copying the bytes), from the best samples, and "
        "from the medians. Hot: one batch reused, in cache; cold: each sample on the next "
        "batch of a pool larger than L3.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (< 60 s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    args = parser.parse_args(argv)
    if not isal_available():
        print("note: libisal.so.2 not loadable; only the numpy backend is measured")
    results = run(args.quick)
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
