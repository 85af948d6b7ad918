"""Stores with and without a HAS round first, interleaved against the same daemons.

One 12-daemon LocalCluster, 10 + 2, 112 KiB blocks. Two clients in this process, one with
``ask_before_store = true`` (every store asks the holders what they have first, as stores
did until 2026-12) and one with the default (PUTs at once; only blocks a holder answers
CONFLICT for take the HAS path). Each round, each client stores ``--blocks`` fresh blocks
(a store after a miss, the common case) in ``store_keys`` calls of 64, in alternating
order. GB/s, the client's CPU-s/GB (this process, all threads) and the daemons' (from
/proc) per round; medians over the rounds after the first (warm-up), and the ratio of
the default to asking first.

Usage: python bench/store_ab.py [--quick] [--json PATH] [--rounds N] [--blocks N]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, processes_cpu_s, write_json

from kvcache.client import Client
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.testing.localcluster import LocalCluster

P = REFERENCE_LAYOUT.payload_bytes
CALL = 64


def _round(client: Client, blocks: np.ndarray, pids: list[int]) -> dict[str, float]:
    keys = [os.urandom(16) for _ in range(len(blocks))]
    c0, d0, t0 = os.times(), processes_cpu_s(pids), time.perf_counter()
    for lo in range(0, len(blocks), CALL):
        done = client.store_keys(keys[lo : lo + CALL], blocks[lo : lo + CALL], payload_len=P)
        if done.written != len(keys[lo : lo + CALL]):
            raise RuntimeError(f"stored {done.written} of {len(keys[lo : lo + CALL])} blocks")
    wall, c1, d1 = time.perf_counter() - t0, os.times(), processes_cpu_s(pids)
    gb = len(blocks) * P / 1e9
    return {
        "gbps": gb / wall,
        "client_cpu_s_per_gb": (c1.user + c1.system - c0.user - c0.system) / gb,
        "daemon_cpu_s_per_gb": (d1 - d0) / gb,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--blocks", type=int, default=0)
    args = p.parse_args()
    rounds = args.rounds or (4 if args.quick else 8)
    count = args.blocks or (256 if args.quick else 512)
    blocks = np.random.default_rng(17).integers(0, 256, (count, P), dtype=np.uint8)
    samples: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(Path(tmp) / "cluster").start(nodes=12, capacity="2GiB") as cluster,
    ):
        pids = [cluster.pid(i) for i in range(12)]
        clients = {ask: Client(cluster.client_config(ask_before_store=ask)) for ask in samples}
        try:
            for r in range(rounds):
                for ask in (True, False) if r % 2 == 0 else (False, True):
                    result = _round(clients[ask], blocks, pids)
                    if r:
                        samples[ask].append(result)
                    print(f"# round {r + 1} ask_before_store={ask}: {result}", flush=True)
        finally:
            for client in clients.values():
                client.close()
    med = {
        ask: {k: statistics.median(s[k] for s in samples[ask]) for k in samples[ask][0]}
        for ask in samples
    }
    figures: dict[str, Any] = {}
    for ask, tag in ((True, "ask_first"), (False, "put_first")):
        for k, v in med[ask].items():
            figures[f"store_{k}_{tag}"] = v
    for k in med[True]:
        figures[f"store_{k}_put_first_vs_ask_first"] = med[False][k] / med[True][k]
    print_table(
        f"stores of new blocks, medians of {rounds - 1} interleaved rounds of {count} blocks "
        f"({machine()}; {commit()})",
        ["store", "GB/s", "client CPU-s/GB", "daemons CPU-s/GB"],
        [
            [name, f"{med[ask]['gbps']:.3f}", f"{med[ask]['client_cpu_s_per_gb']:.2f}",
             f"{med[ask]['daemon_cpu_s_per_gb']:.2f}"]
            for ask, name in ((True, "HAS first (ask_before_store)"), (False, "PUTs at once"))
        ]
        + [[
            "PUTs at once ÷ HAS first",
            f"{figures['store_gbps_put_first_vs_ask_first']:.2f}x",
            f"{figures['store_client_cpu_s_per_gb_put_first_vs_ask_first']:.2f}x",
            f"{figures['store_daemon_cpu_s_per_gb_put_first_vs_ask_first']:.2f}x",
        ]],
    )  # fmt: skip
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
