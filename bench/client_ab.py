"""The client of this tree against the client of another, interleaved against the same daemons.

Before/after figures for a client hot-path change, taken in one run (issue 17). One
``LocalCluster`` of this tree (12 daemons; ``--nodes 48`` for issue 21's fan-out), 10 + 2,
1,024 blocks of 114,688 bytes (DeepSeek V4.1 Flash's prefix-cacheable block), moved in
calls of 64 blocks as ``bench/peers.py`` moves them:
``load_keys`` of stored keys (no HAS round) and ``store_keys`` of fresh ones.

Two client processes stay up through the run: ``new`` imports ``kvcache`` from this tree,
``base`` from ``--baseline TREE`` (``git archive COMMIT kvcache | tar -x -C TREE``, with its own
``kvcache/native/libkvfast.so`` built there if its ABI differs). They take turns in chunks of
``--seconds`` (new, base, then base, new, ...), so load from the rest of the machine falls on
both alike. Per chunk a process reports the bytes it moved, its wall time inside the calls and
its CPU (all its threads, ``getrusage``); the daemons' CPU over the chunk comes from
``/proc/PID/stat``. Every load is checked byte for byte.

Figures: ``new_vs_base_*`` is the median over chunk pairs of new ÷ base (GB/s, client
CPU-s/GB, daemon CPU-s/GB), with quartiles; absolute figures are totals over the chunks.

Usage: python bench/client_ab.py --baseline TREE [--quick] [--json PATH] [--chunks N]
[--seconds S] [--nodes N] [--ops load,store] [--warm-host-gb G]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, processes_cpu_s, warm_host, write_json

#: Bytes of one block: DeepSeek V4.1 Flash's prefix-cacheable group, 128 tokens.
PAYLOAD = 114_688
#: Blocks a call, as bench/peers.py asks.
BATCH = 64
BLOCKS = 1024
OPS = ("load", "store")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------- worker side


def worker(root: Path) -> None:
    """One client process: answers ``load S`` / ``store S`` lines on stdin with one JSON line."""
    from kvcache.client import Client
    from kvcache.keys import BlockKey
    from kvcache.memtune import tune_malloc
    from kvcache.testing.localcluster import LocalCluster

    tune_malloc()
    rng = np.random.default_rng(23)
    blocks = rng.integers(0, 256, (BLOCKS, PAYLOAD), np.uint8)
    keys = [BlockKey(os.urandom(16)) for _ in range(BLOCKS)]
    cluster = LocalCluster.attach(root)
    with Client(cluster.client_config()) as client:
        src = client.alloc_buffer(BLOCKS, PAYLOAD)
        src[:] = blocks
        out = client.alloc_buffer(BLOCKS, PAYLOAD)
        for lo in range(0, BLOCKS, BATCH):
            client.store_keys(keys[lo : lo + BATCH], src[lo : lo + BATCH], payload_len=PAYLOAD)
        print(json.dumps({"ready": os.getpid()}), flush=True)
        for line in sys.stdin:
            op, seconds = line.split()
            moved = busy = spent = 0.0
            deadline = time.monotonic() + float(seconds)
            while time.monotonic() < deadline:
                if op == "load":
                    out.fill(0)
                    cpu, wall = _cpu(), time.perf_counter()
                    for lo in range(0, BLOCKS, BATCH):
                        got = client.load_keys(
                            keys[lo : lo + BATCH], payload_len=PAYLOAD, out=out[lo : lo + BATCH]
                        )
                        if got.blocks != BATCH:
                            raise SystemExit(f"loaded {got.blocks} of {BATCH} blocks")
                    busy += time.perf_counter() - wall
                    spent += _cpu() - cpu
                    if not np.array_equal(out, src):
                        raise SystemExit("wrong bytes")
                else:
                    fresh = [BlockKey(os.urandom(16)) for _ in range(BLOCKS)]
                    cpu, wall = _cpu(), time.perf_counter()
                    for lo in range(0, BLOCKS, BATCH):
                        put = client.store_keys(
                            fresh[lo : lo + BATCH], src[lo : lo + BATCH], payload_len=PAYLOAD
                        )
                        if put.written != BATCH:
                            raise SystemExit(f"stored {put.written} of {BATCH} blocks")
                    busy += time.perf_counter() - wall
                    spent += _cpu() - cpu
                moved += src.nbytes / 1e9
            print(json.dumps({"gb": moved, "busy_s": busy, "cpu_s": spent}), flush=True)


# ---------------------------------------------------------------------------- parent side


class Worker:
    """A worker process of one source tree, commanded line by line."""

    def __init__(self, name: str, root: Path, tree: Path | None, log: IO[str]) -> None:
        self.name = name
        env = dict(os.environ)
        if tree is not None:  # another tree's client: its code first, its own native library
            path = [str(tree.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]
            env |= {"PYTHONPATH": os.pathsep.join(path), "PYTHONSAFEPATH": "1"}
            own = tree / "kvcache" / "native" / "libkvfast.so"
            if own.exists():
                env["KVCACHE_NATIVE_LIBRARY"] = str(own.resolve())
            else:
                env.pop("KVCACHE_NATIVE_LIBRARY", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", "--root", str(root)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name} client exited (code {self.proc.wait()}); see its log")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, op: str, seconds: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{op} {seconds}\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def main() -> None:
    from kvcache.testing.localcluster import LocalCluster

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="the other tree (its kvcache/ package)")
    p.add_argument("--chunks", type=int, default=0, help="chunks per side and op")
    p.add_argument("--seconds", type=float, default=0.0, help="seconds of one chunk")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=12, help="daemons (12: one per shard)")
    p.add_argument("--ops", default=",".join(OPS), help="which of load,store to run")
    p.add_argument(
        "--warm-host-gb", type=float, default=0.0,
        help="touch this much host memory first (a fresh VM's first touch of a page is slow)",
    )  # fmt: skip
    args = p.parse_args()
    if args.worker:
        worker(args.root)
        return
    print(warm_host(args.warm_host_gb), flush=True)
    if args.baseline is None or not (args.baseline / "kvcache" / "__init__.py").exists():
        p.error("--baseline TREE must name a tree with a kvcache/ package")
    ops = [op for op in args.ops.split(",") if op]
    if not ops or set(ops) - set(OPS):
        p.error(f"--ops takes some of {','.join(OPS)}")
    if args.nodes < 12:
        p.error("--nodes must be at least 12 (one node per shard of 10 + 2)")
    chunks = args.chunks or (6 if args.quick else 12)
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cluster"
        log_path = Path(tmp) / "workers.log"
        with (
            LocalCluster(root).start(nodes=args.nodes, capacity="4GiB") as cluster,
            open(log_path, "w") as log,
        ):
            daemons = [cluster.pid(i) for i in range(args.nodes)]
            workers: dict[str, Worker] = {}
            try:
                workers["new"] = Worker("new", root, None, log)
                workers["base"] = Worker("base", root, args.baseline, log)
                for c in range(chunks):
                    order = ["new", "base"] if c % 2 == 0 else ["base", "new"]
                    for op in ops:
                        for name in order:
                            before = processes_cpu_s(daemons)
                            got = workers[name].run(op, seconds)
                            got["daemon_cpu_s"] = processes_cpu_s(daemons) - before
                            samples.setdefault((op, name), []).append(got)
            except SystemExit:
                log.flush()
                sys.stderr.write(log_path.read_text()[-4000:])
                raise
            finally:
                for w in workers.values():
                    w.close()
    figures: dict[str, Any] = {"commit": commit(), "machine": machine(), "chunks": chunks,
                               "chunk_s": seconds, "baseline": str(args.baseline),
                               "nodes": args.nodes}  # fmt: skip
    rows = []
    for op in ops:
        per: dict[str, dict[str, list[float]]] = {}
        for name in ("new", "base"):
            s = samples[(op, name)]
            per[name] = {
                "gbps": [x["gb"] / x["busy_s"] for x in s],
                "client": [x["cpu_s"] / x["gb"] for x in s],
                "daemons": [x["daemon_cpu_s"] / x["gb"] for x in s],
            }
            gb = sum(x["gb"] for x in s)
            figures[f"{name}_{op}_gbps"] = gb / sum(x["busy_s"] for x in s)
            figures[f"{name}_client_cpu_s_per_gb_{op}"] = sum(x["cpu_s"] for x in s) / gb
            figures[f"{name}_daemon_cpu_s_per_gb_{op}"] = sum(x["daemon_cpu_s"] for x in s) / gb
        cells = [op]
        for what in ("gbps", "client", "daemons"):
            ratios = [a / b for a, b in zip(per["new"][what], per["base"][what], strict=True)]
            q1, med, q3 = _quartiles(ratios)
            tag = {"gbps": "gbps", "client": "client_cpu", "daemons": "daemon_cpu"}[what]
            figures[f"new_vs_base_{op}_{tag}"] = med
            figures[f"new_vs_base_{op}_{tag}_q1"] = q1
            figures[f"new_vs_base_{op}_{tag}_q3"] = q3
            cells.append(f"{med:.3f} [{q1:.3f}–{q3:.3f}]")
        cells[1:1] = [
            f"{figures[f'base_{op}_gbps']:.2f} → {figures[f'new_{op}_gbps']:.2f}",
            f"{figures[f'base_client_cpu_s_per_gb_{op}']:.3f} → "
            f"{figures[f'new_client_cpu_s_per_gb_{op}']:.3f}",
        ]
        rows.append(cells)
    print_table(
        f"client of this tree (new) vs {args.baseline} (base), {args.nodes} daemons, {chunks} "
        f"interleaved chunks of {seconds:g} s per side ({machine()}; {commit()})",
        [
            "op",
            "GB/s base → new",
            "client CPU-s/GB base → new",
            "GB/s new ÷ base",
            "client CPU new ÷ base",
            "daemon CPU new ÷ base",
        ],
        rows,
    )
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
