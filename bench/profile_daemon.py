"""Where a storage daemon's CPU goes per request, phase by phase, in a 12-daemon cluster.

Starts a ``LocalCluster`` of 12 daemons whose Python loop methods are wrapped with
thread-CPU timers (``time.thread_time_ns``; a ``sitecustomize`` put on the daemons'
``PYTHONPATH``, enabled by ``KVCACHE_PROFILE_PHASES``), stores 1,024 blocks of 112 KiB
from one client, then runs 64-block ``load_keys`` (``--op get``) or ``store_keys`` of fresh
keys (``--op put``) for ``--seconds``, stops the cluster and prints node-00's time per
phase and per request. Nested phases overlap (``pump`` contains ``handle``, ``handle``
contains ``store_get``...). With the native data plane on, the GETs it answers never reach
these Python phases: ``--no-native-plane`` shows the Python path, as the eighth pass of
issue 17 measured it (docs/benchmarks.md). A wrapper costs about a microsecond a call.
Kept out of CI.

Usage: python bench/profile_daemon.py [--op get|put] [--seconds S] [--no-native-plane]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SITE = """
import atexit, collections, os, sys
if os.environ.get("KVCACHE_PROFILE_PHASES") and "server" in sys.argv:
    SPENT = collections.Counter(); CALLS = collections.Counter()
    sys.path.insert(0, os.environ["KVCACHE_PROFILE_BENCH"])  # bench/, for _common alone
    from _common import time_calls
    sys.path.pop(0)
    from kvcache import net_loop
    from kvcache.server import handler, loop, segments, store
    for owner, name, phase in [
        (loop.DataServer, "_event", "event"), (loop.DataServer, "_read", "read"),
        (loop.DataServer, "_pump", "pump"), (handler.RequestHandler, "handle", "handle"),
        (handler.RequestHandler, "handle_puts", "handle_puts"),
        (store.ShardStore, "get", "store_get"), (store.ShardStore, "put_many", "put_many"),
        (store.ShardStore, "_write", "write"), (segments.SegmentFiles, "append", "seg_append"),
        (loop.DataServer, "_send", "send"), (net_loop.SendQueue, "flush", "flush"),
        (loop.DataServer, "_maintain", "maintain"), (loop.DataServer, "serve", "serve"),
        (store.ShardStore, "_rows_of", "rows_of"), (store.ShardStore, "_write_fresh", "write_fresh"),
        (store.ShardStore, "_make_room", "make_room"), (store.ShardStore, "_write_usage", "write_usage"),
        (store.ShardStore, "_pin_rooms", "pin_rooms"), (store.ShardStore, "_make_room_for_quota", "quota"),
    ]:
        time_calls(owner, name, phase, SPENT, CALLS)

    def dump():
        out = os.environ["KVCACHE_PROFILE_PHASES"]
        with open(f"{out}/phases.{os.getpid()}", "w") as f:
            for phase, ns in SPENT.items():
                f.write(f"{phase} {ns} {CALLS[phase]}\\n")

    atexit.register(dump)
"""

P = 114_688
N = 1024
B = 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=("get", "put"), default="get")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--no-native-plane", action="store_true")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvcache-phases-"))
    try:
        return _run(args, work)
    finally:  # the cluster's files are gigabytes: never left behind
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    """The profiled run, its files in ``work``; prints the table."""
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(work / "site"), os.environ.get("PYTHONPATH", "")]
    )
    os.environ["KVCACHE_PROFILE_PHASES"] = str(work)
    os.environ["KVCACHE_PROFILE_BENCH"] = str(Path(__file__).resolve().parent)
    if args.no_native_plane:
        os.environ["KVCACHE_SERVER_NATIVE_PLANE"] = "false"
    from kvcache.client import Client
    from kvcache.testing.localcluster import LocalCluster

    cluster = LocalCluster(work / "cluster").start(nodes=12, capacity="4GiB")
    pid0 = cluster.pid(0)
    requests = 0
    try:
        payloads = np.random.default_rng(1).integers(0, 256, (N, P), dtype=np.uint8)
        with Client(cluster.client_config()) as client:
            keys = [os.urandom(16) for _ in range(N)]
            for lo in range(0, N, B):
                client.store_keys(keys[lo : lo + B], payloads[lo : lo + B], payload_len=P)
            out = np.empty((N, P), np.uint8)
            start = time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                if args.op == "put":
                    keys = [os.urandom(16) for _ in range(N)]
                for lo in range(0, N, B):
                    if args.op == "get":
                        client.load_keys(keys[lo : lo + B], payload_len=P, out=out[lo : lo + B])
                    else:
                        client.store_keys(keys[lo : lo + B], payloads[lo : lo + B], payload_len=P)
                    requests += 1
    finally:
        cluster.stop()
    rows = [line.split() for line in (work / f"phases.{pid0}").read_text().splitlines() if line]
    per = max(1, requests)
    print(f"node-00, {args.op.upper()}, {requests} calls of 64 blocks (one request each), "
          f"native plane {'off' if args.no_native_plane else 'on'}")  # fmt: skip
    print("\n| phase | calls | CPU s | µs per call of 64 blocks |\n|---|---:|---:|---:|")
    for phase, ns, calls in sorted(rows, key=lambda r: -int(r[1])):
        print(f"| {phase} | {calls} | {int(ns) / 1e9:.3f} | {int(ns) / 1e3 / per:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
