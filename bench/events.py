"""What the event stream costs the store: PUT throughput with events off and on, A/B.

Two local clusters of 12 daemons on loopback, identical but for ``--events-listen``: cluster
B publishes every stored and removed shard, and a ``kvcache events --follow --admin``
process (on this machine, so it competes for the same cores: a conservative figure) reads
every event of every daemon. One client stores the same prompt (``--blocks`` 112 KiB blocks)
under a fresh namespace and deletes it again (removal events too), alternating A and B
round by round, so both see the same machine. Prints each side's best and median store
throughput and B / A (the target is >= 0.95: issue 20, the event path costs <= 5 %), and
the 12 daemons' CPU seconds per GB on each side (the steadier figure on a loaded machine).

Usage: python bench/events.py [--quick] [--json PATH] [--rounds N] [--blocks N]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, processes_cpu_s, write_json

from kvcache.client import Client
from kvcache.keys import Namespace
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.memtune import tune_malloc
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=0, help="rounds per side (default 12, quick 6)")
    p.add_argument("--blocks", type=int, default=0, help="blocks per store (default 512)")
    p.add_argument(
        "--aa",
        action="store_true",
        help="A/A: cluster B without events and no follower (the noise floor)",
    )
    p.add_argument(
        "--swap",
        action="store_true",
        help="start the events cluster first (checks the order of start-up)",
    )
    p.add_argument("--no-follower", action="store_true",
                   help="events on, but no subscriber (what publishing alone costs)")  # fmt: skip
    args = p.parse_args()
    rounds = args.rounds or (6 if args.quick else 12)
    blocks = args.blocks or (256 if args.quick else 512)
    tune_malloc()
    layout = REFERENCE_LAYOUT
    tokens = np.arange(blocks * layout.tokens_per_block, dtype=np.uint32)
    src = np.stack([payload_for_key(bytes([i % 256]) * 16, layout.payload_bytes)
                    for i in range(blocks)])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        events = () if args.aa else ("--events-listen", "tcp://127.0.0.1:0")
        if args.swap:
            on = LocalCluster(root / "on").start(nodes=12, capacity="4GiB", extra_args=events)
        off = LocalCluster(root / "off").start(nodes=12, capacity="4GiB")
        if not args.swap:
            on = LocalCluster(root / "on").start(nodes=12, capacity="4GiB", extra_args=events)
        follow = [
            sys.executable,
            "-m",
            "kvcache.cli",
            "events",
            "--follow",
            "--admin",
            "--cluster-file",
            str(on.cluster_file),
            "--credentials",
            str(on.credentials_file),
        ]
        follower = subprocess.Popen(
            follow
            if not (args.aa or args.no_follower)
            else [sys.executable, "-c", "import time; time.sleep(3600)"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        lines = _Counter(follower)
        try:
            deadline = time.monotonic() + 60
            while not (args.aa or args.no_follower) and any(
                _stats(n.admin)["events"]["subscriptions"] < 1 for n in on.nodes
            ):
                if time.monotonic() > deadline or follower.poll() is not None:
                    raise RuntimeError("the follower did not subscribe to every daemon")
                time.sleep(0.2)  # waiting for another process's subscriptions
            clients = {"off": Client(off.client_config()), "on": Client(on.client_config())}
            pids = {"off": [off.pid(i) for i in range(12)], "on": [on.pid(i) for i in range(12)]}
            times: dict[str, list[float]] = {"off": [], "on": []}
            cpu: dict[str, float] = {"off": 0.0, "on": 0.0}
            follower_cpu = processes_cpu_s([follower.pid])
            for r in range(rounds + 1):
                for side in ("off", "on") if r % 2 else ("on", "off"):
                    client = clients[side]
                    ns = Namespace(model=f"ev-{side}-{r}", revision="1", layout=layout)
                    used = processes_cpu_s(pids[side])
                    start = time.perf_counter()
                    res = client.store(ns, tokens, src)
                    elapsed = time.perf_counter() - start
                    assert res.written == blocks, res
                    client.delete(ns, tokens)
                    if r:  # round 0 warms both up
                        times[side].append(elapsed)
                        cpu[side] += processes_cpu_s(pids[side]) - used
            for client in clients.values():
                client.close()
            follower_cpu = processes_cpu_s([follower.pid]) - follower_cpu
            side_b = [_stats(n.admin).get("events", {}) for n in on.nodes]
            dropped = sum(e.get("dropped", 0) for e in side_b)
            published = sum(e.get("events", 0) for e in side_b)
        finally:
            follower.terminate()
            follower.wait(10)
            lines.join()
            off.stop()
            on.stop()
    gb = src.nbytes / 1e9
    best = {s: gb / min(t) for s, t in times.items()}
    median = {s: gb / statistics.median(t) for s, t in times.items()}
    figures = {
        "events_off_put_gbps_best": round(best["off"], 3),
        "events_on_put_gbps_best": round(best["on"], 3),
        "events_off_put_gbps_median": round(median["off"], 3),
        "events_on_put_gbps_median": round(median["on"], 3),
        "events_put_ratio_best": round(best["on"] / best["off"], 3),
        "events_put_ratio_median": round(median["on"] / median["off"], 3),
        # CPU seconds of the 12 daemons per GB stored (and deleted), over the timed rounds:
        # what the event path costs the daemons, less sensitive to a loaded machine.
        "events_off_daemon_cpu_s_per_gb": round(cpu["off"] / (gb * rounds), 3),
        "events_on_daemon_cpu_s_per_gb": round(cpu["on"] / (gb * rounds), 3),
        "events_daemon_cpu_ratio": round(cpu["on"] / cpu["off"], 3),
        "follower_cpu_s_per_gb": round(follower_cpu / (gb * rounds), 3),
        "events_published": published,
        "events_dropped": dropped,
        "events_lines_followed": lines.count,
        "rounds": rounds,
        "blocks": blocks,
        "aa": args.aa,
        "no_follower": args.no_follower,
        "swap": args.swap,
        "commit": commit(),
        "machine": machine(),
    }
    print_table("event stream cost (store + delete, 12 daemons, 112 KiB blocks)",
                ["figure", "value"], [[k, str(v)] for k, v in figures.items()])  # fmt: skip
    write_json(args.json, figures)
    return 0


class _Counter:
    """Counts the follower's lines on a thread (so its pipe never fills)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        import threading

        self.count = 0
        self._proc = proc
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._proc.stdout is not None
        for _ in self._proc.stdout:
            self.count += 1

    def join(self) -> None:
        self._thread.join(10)


def _stats(admin: str) -> dict[str, Any]:
    with urllib.request.urlopen(admin + "/stats", timeout=10) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


if __name__ == "__main__":
    sys.exit(main())
