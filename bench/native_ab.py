"""The client with and without kvcache.native, interleaved against the same daemons.

One 12-daemon LocalCluster, 10 + 2, 112 KiB blocks (1,024 of them, 64 blocks a call is not
used: one load or store is the whole prompt, as `bench/cluster.py`'s are). Each round runs
a client process with the native helpers and one with ``KVCACHE_NATIVE=0`` (the Python
path), in alternating order, each loading the stored prompt (match outside the timing) and
storing it under a fresh namespace for ``--seconds``; every load is checked byte for byte.
A process's CPU (all its threads) over the GB it moved is its CPU-s/GB. Medians over the
rounds; ratios are native / Python.

Usage: python bench/native_ab.py [--quick] [--json PATH] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json

from kvcache.client import Client
from kvcache.keys import Namespace
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.memtune import tune_malloc
from kvcache.testing.localcluster import LocalCluster

BLOCKS = 1024
P = REFERENCE_LAYOUT.payload_bytes
SPACE = Namespace(model="bench/native-ab", revision="1", layout=REFERENCE_LAYOUT)


def _prompt() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(17)
    tokens = rng.integers(0, 100_000, BLOCKS * REFERENCE_LAYOUT.tokens_per_block)
    payloads = rng.integers(0, 256, (BLOCKS, P), dtype=np.uint8)
    return tokens.astype(np.uint32), payloads


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(root: Path, op: str, seconds: float) -> dict[str, float]:
    """One client process: ``op`` repeated for ``seconds``; GB/s and CPU-s/GB."""
    tune_malloc()
    tokens, payloads = _prompt()
    cluster = LocalCluster.attach(root)
    with Client(cluster.client_config()) as client:
        src = client.alloc_buffer(BLOCKS, P)
        src[:] = payloads
        out = client.alloc_buffer(BLOCKS, P)
        moved = spent = busy = 0.0
        deadline = time.monotonic() + seconds
        count = 0
        while time.monotonic() < deadline or count < 2:
            count += 1
            if op == "load":
                match = client.match_prefix(SPACE, tokens)
                out.fill(0)
                cpu, wall = _cpu(), time.perf_counter()
                got = client.load(SPACE, match, out=out).blocks
                busy += time.perf_counter() - wall
                spent += _cpu() - cpu
                if got != BLOCKS or not np.array_equal(out, src):
                    raise SystemExit(f"load returned {got} blocks or wrong bytes")
            else:
                fresh = Namespace(
                    model=f"bench/native-ab-{os.getpid()}-{count}",
                    revision="1",
                    layout=REFERENCE_LAYOUT,
                )
                cpu, wall = _cpu(), time.perf_counter()
                written = client.store(fresh, tokens, src).written
                busy += time.perf_counter() - wall
                spent += _cpu() - cpu
                if written != BLOCKS:
                    raise SystemExit(f"store wrote {written} of {BLOCKS} blocks")
                client.delete(fresh, tokens)
            moved += src.nbytes / 1e9
    return {"gbps": moved / busy, "cpu_s_per_gb": spent / moved}


def run_child(root: Path, op: str, seconds: float, native: bool) -> dict[str, float]:
    env = {**os.environ, "KVCACHE_NATIVE": "1" if native else "0"}
    if not native:
        env.pop("KVCACHE_NATIVE_LIBRARY", None)
    done = subprocess.run(
        [sys.executable, __file__, "--child", op, "--root", str(root), "--seconds", str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{op} child (native={native}) failed: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--child", choices=["load", "store"])
    p.add_argument("--root", type=Path)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.root, args.child, args.seconds)))
        return
    rounds = args.rounds or (3 if args.quick else 5)
    seconds = args.seconds or (6.0 if args.quick else 12.0)
    samples: dict[tuple[str, bool], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cluster"
        with LocalCluster(root).start(nodes=12, capacity="4GiB") as cluster:
            tokens, payloads = _prompt()
            with Client(cluster.client_config()) as client:
                assert client.store(SPACE, tokens, payloads).written == BLOCKS
            for r in range(rounds):
                order = [True, False] if r % 2 == 0 else [False, True]
                for op in ("load", "store"):
                    for native in order:
                        result = run_child(root, op, seconds, native)
                        samples.setdefault((op, native), []).append(result)
                        print(f"# round {r + 1} {op} native={native}: {result}", flush=True)
    figures: dict[str, Any] = {}
    rows = []
    for op in ("load", "store"):
        med = {
            native: {
                k: statistics.median(s[k] for s in samples[(op, native)])
                for k in ("gbps", "cpu_s_per_gb")
            }
            for native in (True, False)
        }
        for native, tag in ((True, "native"), (False, "python")):
            figures[f"{op}_gbps_{tag}"] = med[native]["gbps"]
            figures[f"client_cpu_s_per_gb_{op}_{tag}"] = med[native]["cpu_s_per_gb"]
        figures[f"{op}_cpu_native_vs_python"] = (
            med[True]["cpu_s_per_gb"] / med[False]["cpu_s_per_gb"]
        )
        figures[f"{op}_gbps_native_vs_python"] = med[True]["gbps"] / med[False]["gbps"]
        rows.append(
            [
                op,
                f"{med[False]['gbps']:.2f}",
                f"{med[True]['gbps']:.2f}",
                f"{med[False]['cpu_s_per_gb']:.2f}",
                f"{med[True]['cpu_s_per_gb']:.2f}",
                f"{figures[f'{op}_cpu_native_vs_python']:.2f}x",
            ]
        )
    print_table(
        f"client with and without kvcache.native, medians of {rounds} interleaved rounds "
        f"({machine()}; {commit()})",
        ["op", "Python GB/s", "native GB/s", "Python CPU-s/GB", "native CPU-s/GB", "CPU ratio"],
        rows,
    )
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
