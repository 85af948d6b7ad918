"""cProfile of one client's 64-block ``load_keys`` against 12 local daemons (112 KiB blocks).

Where the client's time goes on the cost-per-byte path (issue 17), on any host: it starts
a ``LocalCluster`` of 12 daemons, stores ``--blocks`` random blocks, loads them for
``--seconds`` unprofiled (GB/s and the client's CPU-s/GB), then again under cProfile, and
prints the profile sorted by own time and by cumulative time. cProfile's own cost shows in
the second line's figures; compare shares, not absolutes. Kept out of CI.

``--stages`` instead times the loads unprofiled and prints, per 64-block call, the
process's user and system CPU (``getrusage``) and the thread CPU spent inside a few
functions of the data path (``time.thread_time_ns`` around each call: a wrapper adds
about a microsecond a call, so small stages read slightly high). Nested stages overlap:
``receive`` contains ``recv_scatter`` and ``landing``.

``--kill N`` kills N daemons after the stores, so the loads take the degraded path (every
block that lost a data shard is rebuilt). ``--pause N`` stops N more (SIGSTOP) for the
loads, and resumes them at the end: holders that hold requests without answering until the
client's timeout marks them down. ``--no-out`` has each load allocate its own buffer (the
client's default) instead of loading into one kept array. ``--stages`` also prints the
calls' wall p50 and p99 and the CPU-s/GB of the daemons still running.

Usage: python bench/profile_load.py [--seconds S] [--blocks N] [--top N] [--stages]
       [--kill N] [--pause N] [--no-out] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import os
import pstats
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import processes_cpu_s, time_calls

from kvcache.client import Client
from kvcache.keys import BlockKey
from kvcache.testing.localcluster import LocalCluster

#: Bytes of one block: DeepSeek V4.1 Flash's prefix-cacheable group, 128 tokens.
PAYLOAD = 114_688
#: Blocks a call, as bench/peers.py asks.
BATCH = 64


#: Thread CPU nanoseconds inside each timed stage (and the count of load_keys calls).
STAGES: collections.Counter[str] = collections.Counter()


def install_stage_timers() -> None:
    """Wrap the data path's main stages with thread-CPU timers (``--stages``)."""
    from kvcache import native
    from kvcache.client import assembly, client, driver, loading, rounds, transport

    for owner, name, stage in (
        (native, "recv_scatter", "recv_scatter"),
        (native, "xxh3_128_many", "payload_hash"),
        (transport.TcpTransport, "_receive", "receive"),
        (transport.TcpTransport, "_flush", "send"),
        (driver.GetExchange, "landing", "landing"),
        (driver.Pump, "submit", "submit"),
        (rounds.LoadRound, "on_outcomes", "round_on_reply"),
        (loading, "_accept", "accept"),
        (assembly.LoadAssembly, "verify_arrays", "verify"),
        (rounds, "plan_reads", "plan"),
        (loading, "LoadAssembly", "assembly_setup"),
    ):
        time_calls(owner, name, stage, STAGES)
    original = client.Client.load_keys

    @functools.wraps(original)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        STAGES["load_keys_calls"] += 1
        return original(self, *args, **kwargs)

    client.Client.load_keys = counted  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="each timed loop")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks stored and loaded")
    parser.add_argument("--top", type=int, default=45, help="rows of each profile table")
    parser.add_argument("--stages", action="store_true", help="per-call stage times instead")
    parser.add_argument(
        "--kill", type=int, default=0, metavar="N",
        help="kill N daemons after the stores (the degraded load's path)",
    )  # fmt: skip
    parser.add_argument(
        "--pause", type=int, default=0, metavar="N",
        help="SIGSTOP N daemons (after any killed) for the loads: a stopped holder",
    )  # fmt: skip
    parser.add_argument(
        "--no-out", action="store_true",
        help="loads allocate their own buffers (the client's default) instead of reusing one",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="--stages: write its figures as JSON")
    parser.add_argument("--nodes", type=int, default=12, help="daemons (12: one per shard)")
    args = parser.parse_args()
    if args.stages:
        install_stage_timers()
    n = args.blocks - args.blocks % BATCH
    blocks = np.random.default_rng(1).integers(0, 256, (n, PAYLOAD), np.uint8)
    out = np.empty_like(blocks)
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(Path(tmp) / "cluster").start(nodes=args.nodes, capacity="2GiB") as cluster,
        Client(cluster.client_config()) as client,
    ):
        keys = [BlockKey(os.urandom(16)) for _ in range(n)]
        for lo in range(0, n, BATCH):
            client.store_keys(keys[lo : lo + BATCH], blocks[lo : lo + BATCH], payload_len=PAYLOAD)
        for node in range(args.kill):
            cluster.kill(node)
        paused = list(range(args.kill, args.kill + args.pause))
        for node in paused:
            cluster.pause(node)
        running = [cluster.pid(i) for i in range(args.kill + args.pause, args.nodes)]
        call_s: list[float] = []

        def loop(seconds: float) -> tuple[float, float]:
            start, cpu, moved = time.monotonic(), time.process_time(), 0
            while time.monotonic() - start < seconds:
                for lo in range(0, n, BATCH):
                    began = time.perf_counter()
                    got = client.load_keys(
                        keys[lo : lo + BATCH],
                        payload_len=PAYLOAD,
                        out=None if args.no_out else out[lo : lo + BATCH],
                    )
                    call_s.append(time.perf_counter() - began)
                    if got.blocks != BATCH:
                        raise SystemExit(f"loaded {got.blocks} of {BATCH} blocks")
                    if args.no_out:
                        out[lo : lo + BATCH] = np.stack(got.payloads)
                moved += n * PAYLOAD
            gb = moved / 1e9
            return gb / (time.monotonic() - start), (time.process_time() - cpu) / gb

        try:
            if args.stages:
                loop(1.0)  # warm
                STAGES.clear()
                before = resource.getrusage(resource.RUSAGE_SELF)
                calls_before = STAGES["load_keys_calls"]
                call_s.clear()
                daemons_before = processes_cpu_s(running)
                gbps, cpu = loop(args.seconds)
                daemon_cpu = (processes_cpu_s(running) - daemons_before) / (
                    len(call_s) * BATCH * PAYLOAD / 1e9
                )
                after = resource.getrusage(resource.RUSAGE_SELF)
                calls = STAGES.pop("load_keys_calls") - calls_before
                user_ms = (after.ru_utime - before.ru_utime) / calls * 1e3
                system_ms = (after.ru_stime - before.ru_stime) / calls * 1e3
                print(
                    f"GB/s {gbps:.3f}, client CPU-s/GB {cpu:.3f}, {calls} calls of {BATCH} blocks"
                )
                p50, p99 = (float(np.percentile(call_s, q)) * 1e3 for q in (50, 99))
                print(f"per call: user {user_ms:.2f} ms, system {system_ms:.2f} ms; wall p50 "
                      f"{p50:.2f} ms, p99 {p99:.2f} ms; daemons' CPU-s/GB {daemon_cpu:.3f}")  # fmt: skip
                for name, ns in sorted(STAGES.items(), key=lambda kv: -kv[1]):
                    print(f"  {name:<16} {ns / calls / 1e3:8.0f} us a call")
                if not np.array_equal(out, blocks):
                    raise SystemExit("wrong bytes")
                if args.json:
                    figures = {
                        "load_gbps": gbps, "client_cpu_s_per_gb": cpu, "killed": args.kill,
                        "paused": args.pause, "no_out": args.no_out,
                        "daemon_cpu_s_per_gb": daemon_cpu, "call_p50_ms": p50, "call_p99_ms": p99,
                        "user_ms_per_call": user_ms, "system_ms_per_call": system_ms,
                        **{f"{k}_us_per_call": v / calls / 1e3 for k, v in STAGES.items()},
                    }  # fmt: skip
                    args.json.write_text(json.dumps(figures, indent=1) + "\n")
                return
            gbps, cpu = loop(args.seconds)
            print(f"plain:    GB/s {gbps:.3f}, client CPU-s/GB {cpu:.3f}")
            profile = cProfile.Profile()
            profile.enable()
            gbps, cpu = loop(args.seconds)
            print(f"profiled: GB/s {gbps:.3f}, client CPU-s/GB {cpu:.3f}")
            profile.disable()
            if not np.array_equal(out, blocks):
                raise SystemExit("wrong bytes")
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(args.top)

        finally:
            for node in paused:  # a stopped daemon would not stop with the cluster
                cluster.resume(node)


if __name__ == "__main__":
    main()
