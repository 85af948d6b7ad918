"""Where a full node's PUT spends its CPU, in process: a ShardStore at steady state, by phase.

A ``ShardStore`` of ``--capacity-mib`` (64) is filled and then takes ``--puts`` more PUTs
of 128 new shards each (11,624-byte records: one shard of each of 128 blocks of 112 KiB,
as one node of twelve gets them; block keys are hashes, so a batch's index rows land on
random pages), running its maintenance after each PUT as the daemon
does, so every PUT evicts about as much as it writes. The store's clock is a fake one that
steps a second every 20 PUTs (a node holding well under a second of PUTs, as
``bench/server.py``'s does). Thread CPU (``time.thread_time_ns``) is summed per store
method over the steady PUTs only; nested phases overlap (``put_many`` contains ``_write``,
which contains ``append``). ``--no-writemap`` opens LMDB without ``writemap``, as the
daemon did before it was on by default (``lmdb_writemap``; docs/benchmarks.md, sixteenth
pass of issue 17).
No sockets and no daemon: what it shows is the store's own cost, the part of
``put_vs_raw_zmq`` that is not the wire. Kept out of CI.

Usage: python bench/steady_put.py [--puts N] [--capacity-mib M] [--no-writemap] [--json PATH]
"""

from __future__ import annotations

import collections
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import commit, machine, parser, print_table, time_calls, write_json

from kvcache.credentials import tenant_id
from kvcache.server import segments, store
from kvcache.server.probe import fake_shard
from kvcache.wire import Op, make_items

BODY = 11_520
SHARDS = 128
TENANT = tenant_id("default")
PHASES = [
    (store.ShardStore, "put_many"),
    (store.ShardStore, "_write"),
    (segments.SegmentFiles, "append"),
    (store.ShardStore, "_rows_of"),
    (store.ShardStore, "_write_usage"),
    (store.ShardStore, "_delete_head"),
    (store.ShardStore, "_count_removed"),
    (store.ShardStore, "drain_after_crossing"),
    (store.ShardStore, "maintain"),
    (store.ShardStore, "reclaim"),
]


class Clock:
    """A settable wall clock (seconds), for the store's clock and its monotonic one."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def batch(i: int, body: bytes) -> tuple[np.ndarray, memoryview]:
    """PUT items and data: shard ``b % 12`` of blocks ``i * 128 + b``, whose keys are hashes
    (as block keys are: a batch's rows land on random index pages, not on neighbours)."""
    keys = [
        hashlib.blake2b((i * SHARDS + b).to_bytes(8, "big"), digest_size=16).digest()
        for b in range(SHARDS)
    ]
    items = make_items(Op.PUT, SHARDS, reply=False)
    items["key"] = keys
    items["index"] = [b % 12 for b in range(SHARDS)]
    records = [
        fake_shard(k, b % 12, body, traffic_class="chat", stripe_id=7) for b, k in enumerate(keys)
    ]
    items["length"] = [len(r) for r in records]
    return items, memoryview(b"".join(records))


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--puts", type=int, default=1400, help="PUTs in all (the fill included)")
    p.add_argument("--capacity-mib", type=int, default=64)
    p.add_argument("--no-writemap", action="store_true", help="LMDB without writemap")
    args = p.parse_args()
    capacity = args.capacity_mib << 20
    body = os.urandom(BODY)
    fill = capacity // (SHARDS * (BODY + 104)) + 20
    if args.puts <= fill:
        p.error(f"--puts must exceed the {fill} PUTs that fill the node")
    batches = [batch(i, body) for i in range(args.puts)]
    clock = Clock()
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVCACHE_BENCH_DIR")) as tmp:
        node = store.ShardStore(
            Path(tmp) / "db",
            capacity_bytes=capacity,
            clock=clock,
            monotonic=clock,
            # Passed only when asked, so that an older tree (PYTHONPATH) runs as it is.
            **({"writemap": False} if args.no_writemap else {}),
        )

        def put(i: int) -> None:
            items, data = batches[i]
            assert not node.put(TENANT, items, data)["status"].any()
            node.drain_after_crossing()
            while node.maintain():
                pass
            if i % 20 == 0:
                clock.now += 1

        writemap = bool(node._lmdb.env.flags()["writemap"])
        for i in range(fill):
            put(i)
        for owner, name in PHASES:
            time_calls(owner, name, name, spent, calls)
        start = time.thread_time()
        for i in range(fill, args.puts):
            put(i)
        cpu = time.thread_time() - start
        steady = args.puts - fill
        counters = dict(node.counters)
        node.close()
    per_put_us = cpu / steady * 1e6
    gbps = steady * SHARDS * (BODY + 104) / cpu / 1e9
    print(
        f"steady-state PUT in process — commit {commit()}, {machine()}, "
        f"writemap {'on' if writemap else 'off'}: {steady} PUTs of {SHARDS} shards, "
        f"{per_put_us:.0f} µs of CPU a PUT ({gbps:.2f} GB/s a core); evicted "
        f"{counters['evicted_shards']}, segments reused {counters['segments_reused']}"
    )
    print_table(
        "thread CPU by phase, per steady PUT (nested phases overlap)",
        ["phase", "calls", "µs a PUT", "µs a call"],
        [
            [name, str(calls[name]), f"{spent[name] / 1e3 / steady:.0f}",
             f"{spent[name] / 1e3 / calls[name]:.0f}"]
            for name, _ in sorted(spent.items(), key=lambda kv: -kv[1])
        ],
    )  # fmt: skip
    figures: dict[str, Any] = {
        "commit": commit(),
        "machine": machine(),
        "writemap": writemap,
        "steady_puts": steady,
        "put_cpu_us": per_put_us,
        "gbps_per_core": gbps,
        "evicted_shards": counters["evicted_shards"],
        "segments_reused": counters["segments_reused"],
    }
    for name in spent:
        figures[f"{name.strip('_')}_us_per_put"] = spent[name] / 1e3 / steady
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
