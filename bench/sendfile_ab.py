"""How a daemon sends a GET reply's records: ``sendfile`` from the segment file, or
``sendmsg`` from its mapping (issue 17, item 2).

Two 12-daemon LocalClusters, 10 + 2, hedged reads, alike but for the daemons'
``--sendfile-min``: ``sendfile`` (the default, 64 KiB: runs of records that long go out
with ``sendfile``, no copy through the daemon and no page faults on the mapping) and
``mmap`` (``--sendfile-min 0``: every reply is sent from the mapping, as until
2026-12-03). The same blocks are stored in both; then ``load_keys`` of ``--call-blocks``
blocks a call, in rounds interleaved between the two clusters (sendfile, mmap, then
mmap, sendfile, ...), every byte checked after each loop. Per mode, for each block size
(``--payload-bytes``, default the reference 112 KiB and a Llama-8B-shaped 2 MiB): GB/s,
the daemons' CPU-seconds per GB (all 12 processes) and the client's.
``*_sendfile_vs_mmap``: the median over rounds of the per-round ratios.

Usage: python bench/sendfile_ab.py [--quick] [--json PATH] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json
from io_model import timed_loop

from kvcache.client import Client
from kvcache.keys import BlockKey
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.testing.localcluster import LocalCluster

MODES = {"sendfile": (), "mmap": ("--sendfile-min", "0")}
LLAMA_BLOCK = 2 << 20


def run_shape(payload: int, n: int, per_call: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Both modes at one block size: the figures, keyed ``<mode>_<figure>``."""
    rng = np.random.default_rng(payload)
    blocks = rng.integers(0, 256, (n, payload), dtype=np.uint8)
    keys = [BlockKey(rng.bytes(16)) for _ in range(n)]
    outs = {mode: np.ones_like(blocks) for mode in MODES}  # touched: no page faults timed
    capacity = f"{max(256 << 20, 2 * n * payload // 10)}"
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with ExitStack() as stack:
        clients: dict[str, Client] = {}
        daemons: dict[str, list[int]] = {}
        for mode, flags in MODES.items():
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvcache-{mode}-"))
            cluster = stack.enter_context(
                LocalCluster(Path(tmp)).start(nodes=12, capacity=capacity, extra_args=flags)
            )
            daemons[mode] = [cluster.pid(i) for i in range(12)]
            clients[mode] = client = Client(cluster.client_config())
            stack.callback(client.close)
            for lo in range(0, n, per_call):
                res = client.store_keys(
                    keys[lo : lo + per_call], blocks[lo : lo + per_call], payload_len=payload
                )
                if res.written != per_call:
                    raise RuntimeError(f"{mode}: the first store came up short")
            client.load_keys(keys[:per_call], payload_len=payload, out=outs[mode])
        for r in range(rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                runs[mode].append(
                    timed_loop(
                        clients[mode], "load", keys, blocks, outs[mode], per_call, seconds,
                        daemons[mode], payload,
                    )
                )  # fmt: skip
                if not np.array_equal(outs[mode], blocks):
                    raise RuntimeError(f"{mode}: a load returned wrong bytes")
    figures: dict[str, Any] = {}
    for mode, rs in runs.items():
        gb = sum(x["gb"] for x in rs)
        figures[f"{mode}_gbps"] = gb / sum(x["wall"] for x in rs)
        figures[f"{mode}_daemons_cpu_s_per_gb"] = sum(x["daemon_cpu"] for x in rs) / gb
        figures[f"{mode}_client_cpu_s_per_gb"] = sum(x["cpu"] for x in rs) / gb
    pairs = list(zip(runs["sendfile"], runs["mmap"], strict=True))
    figures["gbps_sendfile_vs_mmap"] = statistics.median(
        (a["gb"] / a["wall"]) / (b["gb"] / b["wall"]) for a, b in pairs
    )
    figures["daemons_cpu_sendfile_vs_mmap"] = statistics.median(
        (a["daemon_cpu"] / a["gb"]) / (b["daemon_cpu"] / b["gb"]) for a, b in pairs
    )
    return figures


def main() -> int:
    ap = parser(__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 6)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per timed loop")
    ap.add_argument(
        "--payload-bytes",
        type=int,
        action="append",
        help=f"block sizes (default {REFERENCE_LAYOUT.payload_bytes} and {LLAMA_BLOCK})",
    )
    ap.add_argument("--call-blocks", type=int, default=64, help="blocks a call (default 64)")
    args = ap.parse_args()
    rounds = args.rounds or (4 if args.quick else 6)
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    shapes = args.payload_bytes or [REFERENCE_LAYOUT.payload_bytes, LLAMA_BLOCK]
    per_call = args.call_blocks
    figures: dict[str, Any] = {
        "commit": commit(),
        "machine": machine(),
        "call_blocks": per_call,
        "rounds": rounds,
        "seconds": seconds,
        "wrong_bytes": 0,
    }
    rows = []
    for payload in shapes:
        # about 128 MiB of blocks per shape, at least 4 calls' worth
        n = max(4 * per_call, (128 << 20) // payload // per_call * per_call)
        got = run_shape(payload, n, per_call, rounds, seconds)
        for key, value in got.items():
            figures[f"b{payload}_{key}"] = value
        for mode in MODES:
            rows.append(
                [
                    f"{payload:,}",
                    mode,
                    f"{got[f'{mode}_gbps']:.2f}",
                    f"{got[f'{mode}_daemons_cpu_s_per_gb']:.3f}",
                    f"{got[f'{mode}_client_cpu_s_per_gb']:.3f}",
                ]
            )
        rows.append(
            [
                f"{payload:,}",
                "**sendfile ÷ mmap**",
                f"{got['gbps_sendfile_vs_mmap']:.3f}",
                f"{got['daemons_cpu_sendfile_vs_mmap']:.3f}",
                "",
            ]
        )
    print(f"GET replies: sendfile vs the mapping — commit {figures['commit']}, {machine()}")
    print(
        f"12 daemons per cluster, 10+2, {per_call} blocks a call, {rounds} interleaved rounds "
        f"of {seconds:g} s per mode; every load checked; ratios are medians of per-round ratios"
    )
    print_table(
        "Loads through 12 daemons sending with sendfile vs from the mapping",
        ["block bytes", "mode", "load GB/s", "daemons CPU-s/GB", "client CPU-s/GB"],
        rows,
    )
    print("wrong bytes: 0")
    if args.json:
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
