"""Who runs the client's socket loop: the waiting caller, or the I/O thread (issue 17, item 1).

One 12-daemon LocalCluster, 10 + 2, hedged reads, 112 KiB blocks, ``--calls-blocks`` (64)
blocks a call as in `bench/peers.py`. Two clients in this process, alike but for
``caller_drives``: ``drive`` (the default: a call waiting for its replies runs the loop
itself, and the I/O thread only receives what no caller waits for) and ``thread`` (the
I/O thread receives every reply and hands each batch to the waiting caller, as until
2026-12-03). Their timed loops are interleaved in rounds (drive, thread, then thread,
drive, ...) against the same daemons and blocks, so load from elsewhere on the machine
falls on both alike. Loads are ``load_keys`` of stored keys (every byte checked after
each loop); stores are ``store_keys`` of fresh keys. Per mode and op: GB/s over all its
rounds, the client's CPU-seconds per GB (this process, all threads; the other client is
idle meanwhile), its context switches per call (``getrusage``: the thread hand-offs this
is about) and the daemons' CPU-seconds per GB. ``*_drive_vs_thread``: the ratio of the
two modes, the median over rounds of the per-round ratios.

Usage: python bench/io_model.py [--quick] [--json PATH] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json

from kvcache.client import Client
from kvcache.keys import BlockKey
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.testing.localcluster import LocalCluster

P = REFERENCE_LAYOUT.payload_bytes
MODES = ("drive", "thread")


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall, CPU and context switches of this process, CPU of the daemons, over one loop."""

    def __init__(self, daemons: list[int]) -> None:
        self.daemons = daemons

    def __enter__(self) -> Meter:
        self.t0 = time.perf_counter()
        self.r0 = resource.getrusage(resource.RUSAGE_SELF)
        self.d0 = sum(_proc_cpu(p) for p in self.daemons)
        return self

    def __exit__(self, *exc: object) -> None:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.wall = time.perf_counter() - self.t0
        self.cpu = r1.ru_utime + r1.ru_stime - self.r0.ru_utime - self.r0.ru_stime
        self.switches = r1.ru_nvcsw + r1.ru_nivcsw - self.r0.ru_nvcsw - self.r0.ru_nivcsw
        self.daemon_cpu = sum(_proc_cpu(p) for p in self.daemons) - self.d0


def timed_loop(
    client: Client,
    op: str,
    keys: list[BlockKey],
    blocks: np.ndarray,
    out: np.ndarray,
    per_call: int,
    seconds: float,
    daemons: list[int],
    payload: int = P,
) -> dict[str, float]:
    """Loads (or stores) of ``per_call`` blocks of ``payload`` bytes for ``seconds``: what
    they cost."""
    n = len(keys)
    calls = 0
    with Meter(daemons) as m:
        while calls == 0 or time.perf_counter() - m.t0 < seconds:
            lo = (calls * per_call) % n
            hi = lo + per_call
            if op == "load":
                got = client.load_keys(keys[lo:hi], payload_len=payload, out=out[lo:hi])
                if got.blocks != per_call:
                    raise RuntimeError(f"load_keys loaded {got.blocks} of {per_call} blocks")
            else:
                fresh = [BlockKey(os.urandom(16)) for _ in range(per_call)]
                res = client.store_keys(fresh, blocks[lo:hi], payload_len=payload)
                if res.written != per_call:
                    raise RuntimeError(f"store_keys wrote {res.written} of {per_call} blocks")
            calls += 1
    gb = calls * per_call * payload / 1e9
    return {
        "gb": gb,
        "wall": m.wall,
        "cpu": m.cpu,
        "daemon_cpu": m.daemon_cpu,
        "calls": calls,
        "switches": m.switches,
    }


def main() -> int:
    ap = parser(__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 6)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per timed loop")
    ap.add_argument("--blocks", type=int, default=1024, help="stored blocks (default 1024)")
    ap.add_argument("--call-blocks", type=int, default=64, help="blocks a call (default 64)")
    args = ap.parse_args()
    rounds = args.rounds or (4 if args.quick else 6)
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    n, per_call = args.blocks, args.call_blocks
    if n % per_call:
        ap.error("--blocks must be a multiple of --call-blocks")
    rng = np.random.default_rng(17)
    blocks = rng.integers(0, 256, (n, P), dtype=np.uint8)
    keys = [BlockKey(rng.bytes(16)) for _ in range(n)]
    outs = {mode: np.ones_like(blocks) for mode in MODES}  # touched: no page faults timed
    runs: dict[tuple[str, str], list[dict[str, float]]] = {
        (mode, op): [] for mode in MODES for op in ("load", "store")
    }
    with (
        tempfile.TemporaryDirectory(prefix="kvcache-io-model-") as tmp,
        LocalCluster(Path(tmp)).start(nodes=12, capacity="4GiB") as cluster,
    ):
        daemons = [cluster.pid(i) for i in range(12)]
        clients = {
            mode: Client(cluster.client_config(caller_drives=(mode == "drive"))) for mode in MODES
        }
        try:
            for lo in range(0, n, per_call):
                res = clients["drive"].store_keys(
                    keys[lo : lo + per_call], blocks[lo : lo + per_call], payload_len=P
                )
                if res.written != per_call:
                    raise RuntimeError("the first store came up short")
            for mode in MODES:  # connections opened and warm before timing
                clients[mode].load_keys(keys[:per_call], payload_len=P, out=outs[mode])
            for r in range(rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for op in ("load", "store"):
                    for mode in order:
                        runs[mode, op].append(
                            timed_loop(
                                clients[mode], op, keys, blocks, outs[mode], per_call,
                                seconds, daemons,
                            )
                        )  # fmt: skip
                for mode in MODES:
                    if not np.array_equal(outs[mode], blocks):
                        raise RuntimeError(f"{mode}: a load returned wrong bytes")
            counters = {
                mode: dict(getattr(clients[mode]._core.transport, "counters", {})) for mode in MODES
            }
        finally:
            for client in clients.values():
                client.close()
    figures: dict[str, Any] = {
        "commit": commit(),
        "machine": machine(),
        "blocks": n,
        "call_blocks": per_call,
        "payload_bytes": P,
        "rounds": rounds,
        "seconds": seconds,
        "wrong_bytes": 0,
    }
    rows = []
    for op in ("load", "store"):
        for mode in MODES:
            rs = runs[mode, op]
            gb = sum(x["gb"] for x in rs)
            calls = sum(x["calls"] for x in rs)
            figures[f"{op}_{mode}_gbps"] = gb / sum(x["wall"] for x in rs)
            figures[f"{op}_{mode}_client_cpu_s_per_gb"] = sum(x["cpu"] for x in rs) / gb
            figures[f"{op}_{mode}_daemons_cpu_s_per_gb"] = sum(x["daemon_cpu"] for x in rs) / gb
            figures[f"{op}_{mode}_switches_per_call"] = sum(x["switches"] for x in rs) / calls
            figures[f"{op}_{mode}_client_ms_per_call"] = sum(x["cpu"] for x in rs) / calls * 1e3
            rows.append(
                [
                    op,
                    mode,
                    f"{figures[f'{op}_{mode}_gbps']:.2f}",
                    f"{figures[f'{op}_{mode}_client_cpu_s_per_gb']:.3f}",
                    f"{figures[f'{op}_{mode}_client_ms_per_call']:.2f}",
                    f"{figures[f'{op}_{mode}_switches_per_call']:.1f}",
                    f"{figures[f'{op}_{mode}_daemons_cpu_s_per_gb']:.3f}",
                ]
            )
        pairs = list(zip(runs["drive", op], runs["thread", op], strict=True))
        figures[f"{op}_gbps_drive_vs_thread"] = statistics.median(
            (a["gb"] / a["wall"]) / (b["gb"] / b["wall"]) for a, b in pairs
        )
        figures[f"{op}_client_cpu_drive_vs_thread"] = statistics.median(
            (a["cpu"] / a["gb"]) / (b["cpu"] / b["gb"]) for a, b in pairs
        )
    for mode in MODES:
        for key, value in counters[mode].items():
            figures[f"{mode}_transport_{key}"] = value
    print(
        f"Client I/O model — commit {figures['commit']}, {figures['machine']}\n"
        f"12 daemons, 10+2, {n} blocks of {P} bytes, {per_call} a call, {rounds} interleaved "
        f"rounds of {seconds:g} s per mode and op; every load checked"
    )
    print_table(
        "Caller runs the loop (drive) vs the I/O thread hands replies over (thread)",
        ["op", "mode", "GB/s", "client CPU-s/GB", "client CPU ms/call", "ctx switches/call",
         "daemons CPU-s/GB"],
        rows,
    )  # fmt: skip
    print_table(
        "drive ÷ thread (median of per-round ratios)",
        ["op", "GB/s", "client CPU-s/GB"],
        [
            [op, f"{figures[f'{op}_gbps_drive_vs_thread']:.3f}",
             f"{figures[f'{op}_client_cpu_drive_vs_thread']:.3f}"]
            for op in ("load", "store")
        ],
    )  # fmt: skip
    print(
        f"\nloop turns: drive client {counters['drive'].get('caller_turns', 0)} by callers, "
        f"{counters['drive'].get('io_turns', 0)} by the I/O thread; wrong bytes: 0"
    )
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
