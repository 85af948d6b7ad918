"""Engine adapter benchmark: paged KV on an accelerator ↔ pinned host ↔ a kvcache cluster.

Paged caches in vLLM's layout, Llama-3-8B-like (32 layers, 8 KV heads, head 128,
bf16, 16-token pages): per layer a tensor [num_pages, kv_heads, page_tokens,
2*head]. For each size moved (1 GiB, 4 GiB):

- gather pages → pinned host payloads vs a raw torch copy of the same bytes
  device → pinned (``gather_vs_raw``);
- scatter pinned payloads → other pages vs a raw pinned → device copy
  (``scatter_vs_raw``);
- end to end: gather → store into a local 12-daemon kvcache cluster on this
  machine's loopback → load → scatter into other page ids, every page checked
  bit for bit, with the time of each stage.

Usage: python bench/engine_gpu.py [--quick] [--json PATH] [--sizes-gib 1,4] [--tiny]
(--tiny: a few MiB on whatever device exists, to check the script on a CPU machine.)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json

from kvcache.client import Client, ClientConfig
from kvcache.client.localcluster import LocalCluster
from kvcache.engine import PagedKVAdapter
from kvcache.keys import Namespace

LAYERS, KV_HEADS, HEAD, PAGE_TOKENS = 32, 8, 128, 16


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize()


def timed(fn: Any, device: torch.device, repeat: int) -> float:
    """Median wall time of ``fn`` (synchronised), after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def make_caches(num_pages: int, device: torch.device, heads: int, head: int) -> list[torch.Tensor]:
    caches = []
    gen = torch.Generator(device=device).manual_seed(0)
    for _ in range(LAYERS):
        raw = torch.randint(
            -(2**15), 2**15, (num_pages, heads, PAGE_TOKENS, 2 * head),
            dtype=torch.int16, device=device, generator=gen,
        )  # fmt: skip
        caches.append(raw.view(torch.bfloat16))
    return caches


def pages_equal(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Bit equality (random bits include NaN patterns, so compare the raw 16-bit words)."""
    return all(
        torch.equal(
            c.view(torch.int16).index_select(0, src), c.view(torch.int16).index_select(0, dst)
        )
        for c in caches
    )


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--sizes-gib", default="1,4", help="GiB moved per measurement (default 1,4)")
    p.add_argument("--tiny", action="store_true", help="a few MiB, to check the script on a CPU")
    p.add_argument("--nodes", type=int, default=12)
    p.add_argument(
        "--e2e-max-gib", type=float, default=4.0, help="largest size sent through the store"
    )
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, head = (KV_HEADS, HEAD) if not args.tiny else (2, 32)
    page_bytes = LAYERS * heads * PAGE_TOKENS * 2 * head * 2
    sizes = (
        [8 << 20] if args.tiny else [int(float(s) * (1 << 30)) for s in args.sizes_gib.split(",")]
    )
    if args.quick and not args.tiny:
        sizes = sizes[:1]
    repeat = 3 if args.quick or args.tiny else 7
    max_pages = max(sizes) // page_bytes
    num_pages = 2 * max_pages + 64
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"{LAYERS} layers x [{num_pages}, {heads}, {PAGE_TOKENS}, {2 * head}] bf16, "
          f"page {page_bytes / 2**20:.2f} MiB across layers", flush=True)  # fmt: skip
    caches = make_caches(num_pages, device, heads, head)
    adapter = PagedKVAdapter(caches, page_tokens=PAGE_TOKENS, pages_per_block=1)
    assert adapter.payload_bytes == page_bytes
    figures: dict[str, Any] = {"commit": commit(), "machine": machine(), "device": str(device)}
    if device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name()
    rows: list[list[str]] = []
    e2e_rows: list[list[str]] = []
    gen = torch.Generator().manual_seed(1)
    for size in sizes:
        n = size // page_bytes
        tag = f"{size / 2**30:g}gib"
        perm = torch.randperm(num_pages, generator=gen)
        src, dst = perm[:n].sort().values, perm[n : 2 * n]
        rows.append(copy_figures(adapter, caches, src, dst, tag, figures, device, repeat))
        if size <= args.e2e_max_gib * (1 << 30):
            e2e_rows.append(
                end_to_end(adapter, caches, src, num_pages, n, tag, figures, args.nodes, device)
            )
    # Headline ratios: the worst over the sizes moved.
    figures["gather_vs_raw"] = min(v for k, v in figures.items() if k.startswith("gather_vs_raw_"))
    figures["scatter_vs_raw"] = min(
        v for k, v in figures.items() if k.startswith("scatter_vs_raw_")
    )
    print(
        f"\nkvcache engine adapter benchmark — commit {figures['commit']}, {figures.get('gpu', device)}, {figures['machine']}"
    )
    print_table(
        "Gather / scatter vs raw device<->pinned copies of the same bytes (same run, median)",
        [
            "moved",
            "gather GB/s",
            "raw D2H GB/s",
            "gather/raw",
            "scatter GB/s",
            "raw H2D GB/s",
            "scatter/raw",
            "bit-equal",
        ],
        rows,
    )
    if e2e_rows:
        print_table(
            f"End to end through a local {args.nodes}-daemon cluster (10+2 RS, loopback): where the time goes",
            [
                "moved",
                "gather",
                "store (encode+PUT)",
                "match+load (GET+verify)",
                "scatter",
                "total GB/s",
                "bit-equal",
            ],
            e2e_rows,
        )
    write_json(args.json, figures)


def copy_figures(
    adapter: PagedKVAdapter,
    caches: list[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    tag: str,
    figures: dict[str, Any],
    device: torch.device,
    repeat: int,
) -> list[str]:
    """Gather and scatter of pages vs raw copies of the same bytes, and bit equality."""
    n = len(src)
    page_bytes = adapter.payload_bytes
    host = adapter.alloc_host(n)
    raw_dev = torch.empty(n * page_bytes, dtype=torch.uint8, device=device)
    host_flat = host.view(-1)
    t_gather = timed(lambda: adapter.gather(src[:, None], out=host).synchronize(), device, repeat)
    t_raw_d2h = timed(lambda: host_flat.copy_(raw_dev, non_blocking=True), device, repeat)
    adapter.gather(src[:, None], out=host).synchronize()
    t_scatter = timed(lambda: adapter.scatter(host, dst[:, None]).synchronize(), device, repeat)
    t_raw_h2d = timed(lambda: raw_dev.copy_(host_flat, non_blocking=True), device, repeat)
    ok = pages_equal(caches, src.to(device), dst.to(device))
    gb = n * page_bytes / 1e9
    figures.update(
        {
            f"gather_gbps_{tag}": gb / t_gather,
            f"raw_d2h_gbps_{tag}": gb / t_raw_d2h,
            f"scatter_gbps_{tag}": gb / t_scatter,
            f"raw_h2d_gbps_{tag}": gb / t_raw_h2d,
            f"gather_vs_raw_{tag}": t_raw_d2h / t_gather,
            f"scatter_vs_raw_{tag}": t_raw_h2d / t_scatter,
            f"bit_equal_{tag}": ok,
        }
    )
    print(f"{tag}: gather {gb / t_gather:.1f} GB/s (raw {gb / t_raw_d2h:.1f}), "
          f"scatter {gb / t_scatter:.1f} GB/s (raw {gb / t_raw_h2d:.1f}), bit-equal {ok}", flush=True)  # fmt: skip
    return [tag, f"{gb / t_gather:.1f}", f"{gb / t_raw_d2h:.1f}", f"{t_raw_d2h / t_gather:.2f}x",
            f"{gb / t_scatter:.1f}", f"{gb / t_raw_h2d:.1f}", f"{t_raw_h2d / t_scatter:.2f}x", str(ok)]  # fmt: skip


def end_to_end(
    adapter: PagedKVAdapter,
    caches: list[torch.Tensor],
    src: torch.Tensor,
    num_pages: int,
    n: int,
    tag: str,
    figures: dict[str, Any],
    nodes: int,
    device: torch.device,
) -> list[str]:
    """gather → store → load → scatter into fresh pages, each stage timed once."""
    gb = n * adapter.payload_bytes / 1e9
    space = Namespace(model="bench/llama-3-8b-like", revision="1", layout=adapter.kv_layout())
    tokens = np.random.default_rng(2).integers(0, 128_000, n * PAGE_TOKENS).astype(np.uint32)
    free = torch.ones(num_pages, dtype=torch.bool)
    free[src] = False
    candidates = torch.nonzero(free).view(-1)
    dst = candidates[
        torch.randperm(len(candidates), generator=torch.Generator().manual_seed(3))[:n]
    ]
    host_out = adapter.alloc_host(n)
    host_in = adapter.alloc_host(n)
    with tempfile.TemporaryDirectory(prefix="kvcache-gpu-") as tmp:
        capacity = f"{int(2.5 * n * adapter.payload_bytes / nodes) + (256 << 20)}"
        env_cap = os.environ.get("KVCACHE_BENCH_CAPACITY", capacity)
        with LocalCluster(Path(tmp)).start(nodes=nodes, capacity=env_cap) as cluster:
            config = ClientConfig(
                cluster_file=cluster.cluster_file, timeout_s=30.0, max_batch_blocks=64
            )
            with Client(config) as client:
                sync(device)
                t0 = time.perf_counter()
                adapter.gather(src[:, None], out=host_out).synchronize()
                t1 = time.perf_counter()
                stored = client.store(space, tokens, host_out.numpy())
                t2 = time.perf_counter()
                match = client.match_prefix(space, tokens)
                loaded = client.load(space, match, out=host_in.numpy())
                t3 = time.perf_counter()
                adapter.scatter(host_in[: loaded.blocks], dst[: loaded.blocks, None]).synchronize()
                t4 = time.perf_counter()
    ok = (
        stored.written == n
        and loaded.blocks == n
        and pages_equal(caches, src.to(device), dst.to(device))
    )
    stages = {"gather": t1 - t0, "store": t2 - t1, "load": t3 - t2, "scatter": t4 - t3}
    total = t4 - t0
    for name, secs in stages.items():
        figures[f"e2e_{name}_gbps_{tag}"] = gb / secs
    figures[f"e2e_total_gbps_{tag}"] = gb / total
    figures[f"e2e_bit_equal_{tag}"] = ok
    return (
        [tag]
        + [f"{secs * 1000:.0f} ms ({gb / secs:.2f} GB/s)" for secs in stages.values()]
        + [f"{gb / total:.2f}", str(ok)]
    )


if __name__ == "__main__":
    main()
