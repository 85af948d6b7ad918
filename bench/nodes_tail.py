"""Latency of a prompt's match + load against N daemons, and what its slowest loads waited for.

Issue 21's fan-out figure (``bench/scale.py --parts nodes``) reports one p99 over 160
loads; this takes more (``--prompts`` 64-block prompts of 112 KiB blocks, matched and
loaded ``--rounds`` times each) and says, per load over ``--slow-ms``, which client
counters moved (rebuilt blocks, hedges, ``landings_cut``). It imports ``kvcache`` from
``PYTHONPATH``, so the same script measures another tree (``PYTHONSAFEPATH=1
PYTHONPATH=TREE``), as the placement-group pass did (``docs/benchmarks.md``). Kept out of CI.

Usage: python bench/nodes_tail.py [--nodes N] [--prompts P] [--rounds R] [--slow-ms MS]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from kvcache.client import Client
from kvcache.keys import Namespace, block_keys
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--slow-ms", type=float, default=30.0, help="loads reported one by one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    space = Namespace(model=f"bench/tail-{args.nodes}", revision="1", layout=REFERENCE_LAYOUT)
    rng = np.random.default_rng(args.nodes)
    tpb, size = REFERENCE_LAYOUT.tokens_per_block, REFERENCE_LAYOUT.payload_bytes
    toks = [rng.integers(0, 50_000, 64 * tpb).astype(np.uint32) for _ in range(args.prompts)]
    payloads = [[payload_for_key(k, size) for k in block_keys(space, t)] for t in toks]
    with tempfile.TemporaryDirectory() as root:
        cluster = LocalCluster(Path(root) / "cluster").start(nodes=args.nodes, capacity="256MiB")
        with cluster, Client(cluster.client_config()) as client:
            client.match_prefix(space, toks[0])  # connections up
            for t, p in zip(toks, payloads, strict=True):
                client.store(space, t, p)
            lat, match_ms, slow = [], [], []
            cpu0 = time.process_time()
            for _ in range(args.rounds):
                for t in toks:
                    t0 = time.perf_counter()
                    match = client.match_prefix(space, t)
                    t1 = time.perf_counter()
                    before = client.counters
                    res = client.load(space, match)
                    t2 = time.perf_counter()
                    if res.blocks != 64:
                        raise RuntimeError(f"loaded {res.blocks} of 64 blocks")
                    lat.append((t2 - t0) * 1000)
                    match_ms.append((t1 - t0) * 1000)
                    if (t2 - t1) * 1000 > args.slow_ms:
                        moved = {k: v - before.get(k, 0) for k, v in client.counters.items()
                                 if v != before.get(k, 0) and k != "blocks_loaded"}  # fmt: skip
                        slow.append({"load_ms": (t2 - t1) * 1000, "counters": moved})
            cpu = time.process_time() - cpu0
            counters = client.counters
    a, m = np.array(lat), np.array(match_ms)
    out = {
        "nodes": args.nodes,
        "loads": len(a),
        "cpu_us_per_block": cpu / len(a) / 64 * 1e6,
        **{f"p{q}_ms": float(np.percentile(a, q)) for q in (50, 90, 99)},
        "max_ms": float(a.max()),
        "match_p50_ms": float(np.percentile(m, 50)),
        "match_p99_ms": float(np.percentile(m, 99)),
        "hedges": counters.get("hedges", 0),
        "landings_cut": counters.get("landings_cut", 0),
        "slow_loads": slow,
    }
    for s in slow:
        print(f"slow load {s['load_ms']:.1f} ms: {s['counters']}")
    print(f"{args.nodes} nodes: {len(a)} match + load of 64 blocks; client "
          f"{out['cpu_us_per_block']:.1f} us a block; p50 {out['p50_ms']:.1f} ms, p90 "
          f"{out['p90_ms']:.1f}, p99 {out['p99_ms']:.1f}, max {out['max_ms']:.1f}; match p50 "
          f"{out['match_p50_ms']:.1f}, p99 {out['match_p99_ms']:.1f}; hedges {out['hedges']}, "
          f"landings cut {out['landings_cut']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
