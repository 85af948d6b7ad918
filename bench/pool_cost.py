"""What the client's I/O pool costs per block: match + load (and store) by pool size.

Issue 17 asks for a GPU fed at its rate on few client cores. On the 16-core GPU host the
DeepSeek-V4.1-shaped load (112 KiB blocks) ran at 1.25 client CPU-s/GB with 12 I/O
processes, against about 0.27 for the same blocks on the 2-core VM's single client
process. This benchmark separates the pool from the host: one 12-daemon ``LocalCluster``
(10 + 2), and for each pool size (``--processes``, 0 = no pool: the calling process moves
the bytes) a client of that size that stores ``--prompts`` prompts of ``--prompt-blocks``
blocks into its own namespace, then matches and loads them ``--rounds`` times into one
buffer from ``Client.alloc_buffer`` (shared memory with a pool), as ``bench/engine_gpu.py``'s
DSV41 part does, without a GPU. Every load is checked byte for byte.

Per pool size: load GB/s, the client's cores busy (its CPU-seconds, all its processes, over
the wall seconds), client µs of CPU per block and CPU-s per GB, the daemons' CPU-s per GB,
and the same for the store. ``--shape llama`` uses 2 MiB blocks (Llama-3-8B, 16 tokens a
block) instead of DeepSeek V4.1 Flash's 114,688 bytes.

Usage: python bench/pool_cost.py [--quick] [--shape dsv41|llama] [--processes 0,4,8,12]
[--prompt-blocks N] [--prompts N] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load_worker import process_cpu, self_cpu

from kvcache.client import Client
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster

SHAPES = {
    # DeepSeek V4.1 Flash's prefix-cacheable group: 896 bytes a token, 128 tokens a block.
    "dsv41": KVLayout(
        tokens_per_block=128, bytes_per_token=896, dtype=DType.BFLOAT16, layers_in_block=1
    ),
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes a token, 16 tokens a block.
    "llama": KVLayout(
        tokens_per_block=16, bytes_per_token=131072, dtype=DType.BFLOAT16, layers_in_block=32
    ),
}


def commit() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def one_size(
    cluster: LocalCluster,
    daemons: list[int],
    layout: KVLayout,
    processes: int,
    prompts: int,
    prompt_blocks: int,
    rounds: int,
) -> dict[str, float]:
    """Store then match + load ``prompts`` prompts with a client of ``processes`` I/O
    processes; its figures."""
    space = Namespace(model=f"bench/pool-{processes}", revision="1", layout=layout)
    rng = np.random.default_rng(processes)
    size = layout.payload_bytes
    tokens = [
        rng.integers(0, 128_000, prompt_blocks * layout.tokens_per_block).astype(np.uint32)
        for _ in range(prompts)
    ]
    blocks = prompts * prompt_blocks
    with Client(cluster.client_config(io_processes=processes, connections_per_node=1)) as client:
        src = client.alloc_buffer(blocks, size)
        src[:] = rng.integers(0, 256, src.shape, dtype=np.uint8)
        dst = client.alloc_buffer(blocks, size)
        pids = list(getattr(client, "io_pids", []))

        def cpu() -> tuple[float, float, float]:
            return self_cpu() + process_cpu(pids), process_cpu(daemons), time.perf_counter()

        c0, d0, t0 = cpu()
        for j, t in enumerate(tokens):
            done = client.store(space, t, src[j * prompt_blocks : (j + 1) * prompt_blocks])
            if done.failed:
                raise SystemExit(f"{processes} processes: {done.failed} blocks not stored")
        c1, d1, t1 = cpu()

        def load_all() -> None:
            for j, t in enumerate(tokens):
                match = client.match_prefix(space, t)
                out = dst[j * prompt_blocks : (j + 1) * prompt_blocks]
                got = client.load(space, match, out=out).blocks
                if got != prompt_blocks:
                    raise SystemExit(f"{processes} processes: loaded {got} of {prompt_blocks}")

        load_all()  # warm-up: connections, the pool's first requests
        dst.fill(0)
        c2, d2, t2 = cpu()
        for _ in range(rounds):
            load_all()
        c3, d3, t3 = cpu()
        if not np.array_equal(dst, src):
            raise SystemExit(f"{processes} processes: loaded bytes differ from stored ones")
    gb_store, gb_load = blocks * size / 1e9, rounds * blocks * size / 1e9
    return {
        "processes": processes,
        "load_gbps": gb_load / (t3 - t2),
        "load_client_cores_busy": (c3 - c2) / (t3 - t2),
        "load_client_us_per_block": (c3 - c2) / (rounds * blocks) * 1e6,
        "load_client_cpu_s_per_gb": (c3 - c2) / gb_load,
        "load_daemon_cpu_s_per_gb": (d3 - d2) / gb_load,
        "store_gbps": gb_store / (t1 - t0),
        "store_client_cores_busy": (c1 - c0) / (t1 - t0),
        "store_client_cpu_s_per_gb": (c1 - c0) / gb_store,
        "store_daemon_cpu_s_per_gb": (d1 - d0) / gb_store,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small prompts, one round")
    p.add_argument("--shape", choices=sorted(SHAPES), default="dsv41")
    p.add_argument("--processes", default="0,2,4", help="pool sizes, e.g. 0,4,8,12")
    p.add_argument("--prompt-blocks", type=int, default=0, help="blocks a prompt")
    p.add_argument("--prompts", type=int, default=0, help="prompts stored and loaded")
    p.add_argument("--rounds", type=int, default=0, help="timed loads of every prompt")
    p.add_argument("--capacity", default="4GiB", help="each daemon's capacity")
    p.add_argument("--json", type=Path, help="write the figures as JSON")
    args = p.parse_args()
    layout = SHAPES[args.shape]
    big = args.shape == "llama"
    prompt_blocks = args.prompt_blocks or (64 if args.quick else (512 if big else 4096))
    prompts = args.prompts or (2 if args.quick else (2 if big else 4))
    rounds = args.rounds or (1 if args.quick else 3)
    sizes = [int(x) for x in args.processes.split(",") if x.strip()]
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(Path(tmp) / "cluster").start(nodes=12, capacity=args.capacity) as c,
    ):
        daemons = [c.pid(i) for i in range(12)]
        for n in sizes:
            rows.append(one_size(c, daemons, layout, n, prompts, prompt_blocks, rounds))

    figures: dict[str, Any] = {
        "commit": commit(),
        "cores": os.cpu_count(),
        "shape": args.shape,
        "block_bytes": layout.payload_bytes,
        "prompt_blocks": prompt_blocks,
        "prompts": prompts,
        "rounds": rounds,
        "rows": rows,
    }
    print(f"### I/O pool cost, {args.shape} blocks of {layout.payload_bytes} B, {prompts} "
          f"prompts of {prompt_blocks} blocks, {rounds} timed rounds, 12 daemons, "
          f"{os.cpu_count()} cores ({figures['commit']})\n")  # fmt: skip
    print("| I/O processes | load GB/s | client cores busy | client µs/block | client CPU-s/GB "
          "| daemons CPU-s/GB | store GB/s | store client cores | store client CPU-s/GB |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['processes']} | {r['load_gbps']:.2f} | {r['load_client_cores_busy']:.2f} "
              f"| {r['load_client_us_per_block']:.1f} | {r['load_client_cpu_s_per_gb']:.3f} "
              f"| {r['load_daemon_cpu_s_per_gb']:.3f} | {r['store_gbps']:.2f} "
              f"| {r['store_client_cores_busy']:.2f} | {r['store_client_cpu_s_per_gb']:.3f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
