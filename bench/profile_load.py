"""cProfile of one client's 64-block ``load_keys`` against 12 local daemons (112 KiB blocks).

Where the client's time goes on the cost-per-byte path (issue 17), on any host: it starts
a ``LocalCluster`` of 12 daemons, stores ``--blocks`` random blocks, loads them for
``--seconds`` unprofiled (GB/s and the client's CPU-s/GB), then again under cProfile, and
prints the profile sorted by own time and by cumulative time. cProfile's own cost shows in
the second line's figures; compare shares, not absolutes. Kept out of CI.

Usage: python bench/profile_load.py [--seconds S] [--blocks N] [--top N]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np

from kvcache.client import Client
from kvcache.keys import BlockKey
from kvcache.testing.localcluster import LocalCluster

#: Bytes of one block: DeepSeek V4.1 Flash's prefix-cacheable group, 128 tokens.
PAYLOAD = 114_688
#: Blocks a call, as bench/peers.py asks.
BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="each timed loop")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks stored and loaded")
    parser.add_argument("--top", type=int, default=45, help="rows of each profile table")
    args = parser.parse_args()
    n = args.blocks - args.blocks % BATCH
    blocks = np.random.default_rng(1).integers(0, 256, (n, PAYLOAD), np.uint8)
    out = np.empty_like(blocks)
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(Path(tmp) / "cluster").start(nodes=12, capacity="2GiB") as cluster,
        Client(cluster.client_config()) as client,
    ):
        keys = [BlockKey(os.urandom(16)) for _ in range(n)]
        for lo in range(0, n, BATCH):
            client.store_keys(keys[lo : lo + BATCH], blocks[lo : lo + BATCH], payload_len=PAYLOAD)

        def loop(seconds: float) -> tuple[float, float]:
            start, cpu, moved = time.monotonic(), time.process_time(), 0
            while time.monotonic() - start < seconds:
                for lo in range(0, n, BATCH):
                    got = client.load_keys(
                        keys[lo : lo + BATCH], payload_len=PAYLOAD, out=out[lo : lo + BATCH]
                    )
                    if got.blocks != BATCH:
                        raise SystemExit(f"loaded {got.blocks} of {BATCH} blocks")
                moved += n * PAYLOAD
            gb = moved / 1e9
            return gb / (time.monotonic() - start), (time.process_time() - cpu) / gb

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


if __name__ == "__main__":
    main()
