"""Engine benchmark on an accelerator: is loading a cached prefix faster than recomputing it?

Paged caches in vLLM's layout, Llama-3-8B-shaped KV (32 layers, 8 KV heads, head 128,
bf16, 16-token pages, so 128 KiB per token and one 2 MiB kvcache block per page), and
a local 12-daemon kvcache cluster on this host's loopback. In one run:

1. **Recompute baseline** (``bench/recompute.py``): a Llama-3-8B-shaped bf16 prefill in
   torch with random weights at 8K, 32K and 77K tokens.
2. **Adapter copies**: gather pages → pinned host and scatter back, against raw
   device↔pinned copies of the same bytes (``gather_vs_raw``, ``scatter_vs_raw``).
3. **Store**: gather the pages of a 77K-token prompt and store them (10 + 2 RS, quorum
   writes); ``e2e_store_gbps_4gib`` is the first 4 GiB (gather + store), the client's
   second store: its first, of another prompt's 4 GiB into the empty cluster, warms it
   up as a worker's stores all day do, and is ``e2e_store_gbps_4gib_cold``.
4. **Load**: match + load (straight into pinned memory) + scatter into other pages, the
   scatter of each verified chunk starting while the next chunks are on the wire.
   ``e2e_load_gbps_4gib`` is match + load of 4 GiB; ``load_vs_recompute_{8k,32k,77k}``
   is the recompute time divided by match + load + scatter of the same tokens' KV.
   Every page is checked bit for bit.
5. **DeepSeek-V4.1 shape** (``dsv41_*``): 112 KiB blocks of 128 tokens x 896 bytes (what
   vLLM declares for DeepSeek V4.1 Flash's prefix-cacheable group), a prompt of
   ``--dsv41-gib`` (2 GiB: 18,725 blocks) as prompts of ``--dsv41-prompt-blocks`` (4,096)
   blocks, stored, then matched + loaded into pinned memory one prompt after another;
   every byte checked. (One match may ask a daemon for at most 16,384 keys today.)
6. **DeepSeek-V4.1 state restore** (``bench/_dsv41_restore.py``): the time to restore a
   2,801,664-byte SWA state into the sliding-window groups' pages of a BLHNC pool on the
   device (``dsv41_restore_ms``; with the fetch from a peer tier over loopback first,
   ``dsv41_fetch_restore_ms``), against the time vLLM would spend replaying 128 tokens
   without it: ``replay_128_ms_est`` = 128 / the recompute baseline's prefill rate at its
   shortest prompt (a lower bound, see that module), and ``prefill_128_ms`` measured;
   ``dsv41_replay_vs_restore`` = ``replay_128_ms_est`` / ``dsv41_fetch_restore_ms``.
   ``--restore-only`` runs just this part (and the 8K recompute it needs).
7. CPU: next to every throughput, the client's *cores busy* (CPU-seconds / wall seconds
   of the timed phase) and CPU-seconds per GB, of the client and of the daemons. The
   client is this process (``getrusage(RUSAGE_SELF)``: all its threads, torch's too) plus
   its I/O worker processes (``Client.io_pids``, ``/proc/<pid>/stat`` utime + stime); the
   daemons are the 12 LocalCluster pids, from ``/proc`` the same way. With ``--scaling``,
   load throughput of 1, 2, 4, 8, 12 separate client processes started together and
   released at once (``bench/_load_worker.py``: the aggregate over the interval in which
   all of them were loading).

Usage: python bench/engine_gpu.py [--quick] [--json PATH] [--tiny] [--scaling] [--restore-only]
(``--tiny``: a few MiB and a 2-layer model on whatever device exists, to check the
script on a CPU machine. ``scripts/engine-gpu.sh`` runs it on the GPU machine, 3 times,
and reports the median and range of each figure.)
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json
from _load_worker import process_cpu, run_together, self_cpu

from kvcache.client import Client
from kvcache.engine import PagedKVAdapter
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster

LAYERS, KV_HEADS, HEAD, PAGE_TOKENS = 32, 8, 128, 16
GIB = 1 << 30
#: DeepSeek V4.1 Flash's prefix-cacheable group in vLLM 0.32: 114,688 bytes per block.
DSV41_LAYOUT = KVLayout(
    tokens_per_block=128, bytes_per_token=896, dtype=DType.BFLOAT16, layers_in_block=1
)


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


def cpu_seconds(client: Client | None = None) -> float:
    """CPU seconds of this process (all threads) and of the client's I/O worker processes."""
    return self_cpu() + (process_cpu(client.io_pids) if client is not None else 0.0)


@dataclass(frozen=True)
class Usage:
    """CPU seconds of the client (all its processes) and of the daemons, at a wall time."""

    client: float
    daemons: float
    wall: float

    @staticmethod
    def now(client: Client, daemons: list[int]) -> Usage:
        return Usage(cpu_seconds(client), process_cpu(daemons), time.perf_counter())

    def since(self, start: Usage, gb: float) -> dict[str, float]:
        """CPU-s per GB (client, daemons) and cores busy (CPU-s / wall s) from ``start``."""
        wall = self.wall - start.wall
        client, daemons = self.client - start.client, self.daemons - start.daemons
        return {
            "client_cpu": client / gb,
            "daemon_cpu": daemons / gb,
            "client_busy": client / wall,
            "daemon_busy": daemons / wall,
        }


def host_cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs: time a VM's CPUs were ready but not run."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def timed_store(
    client: Client,
    space: Namespace,
    tokens: np.ndarray,
    payloads: np.ndarray,
    daemons: list[int],
) -> dict[str, float]:
    """GB/s, CPU-s/GB and cores busy of one store; every block must be written."""
    start = Usage.now(client, daemons)
    result = client.store(space, tokens, payloads)
    end = Usage.now(client, daemons)
    assert result.failed == 0, result
    gb = payloads.nbytes / 1e9
    return {"gbps": gb / (end.wall - start.wall), **end.since(start, gb)}


def recompute_baseline(
    device: torch.device, token_sizes: list[int], tiny: bool, quick: bool
) -> dict[int, float]:
    """Seconds to prefill each token count (median), Llama-3-8B shape."""
    import recompute

    shape = recompute.LlamaShape.tiny() if tiny else recompute.LLAMA3_8B
    model = recompute.build_model(shape, device)
    out: dict[int, float] = {}
    try:
        for tokens in token_sizes:
            row = recompute.measure_prefill(
                shape, tokens, device, model=model, repeat=2 if quick else 3
            )
            out[tokens] = float(row["seconds"])
            print(
                f"recompute {tokens} tokens: {row['seconds'] * 1000:.0f} ms "
                f"({row['tokens_per_s']:.0f} tok/s, {row.get('tflops', 0):.0f} TFLOP/s)",
                flush=True,
            )
    finally:
        model.release()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


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
    return [tag, f"{gb / t_gather:.1f}", f"{gb / t_raw_d2h:.1f}", f"{t_raw_d2h / t_gather:.2f}x",
            f"{gb / t_scatter:.1f}", f"{gb / t_raw_h2d:.1f}", f"{t_raw_h2d / t_scatter:.2f}x", str(ok)]  # fmt: skip


class Loader:
    """match + load + scatter of the first ``blocks`` blocks of the stored prompt."""

    def __init__(
        self,
        client: Client,
        adapter: PagedKVAdapter,
        space: Namespace,
        tokens: np.ndarray,
        host: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.client, self.adapter, self.space = client, adapter, space
        self.tokens, self.host, self.device = tokens, host, device

    def run(self, blocks: int, dst: torch.Tensor, *, scatter: bool) -> tuple[int, float, float]:
        """(blocks loaded, seconds for match + load (+ scatter), seconds for match alone)."""
        tokens = self.tokens[: blocks * PAGE_TOKENS]
        out = self.host[:blocks].numpy()
        handles = []

        def ready(first: int, stop: int) -> None:
            if scatter:
                ids = dst[first:stop, None]
                handles.append(self.adapter.scatter(self.host[first:stop], ids))

        sync(self.device)
        t0 = time.perf_counter()
        match = self.client.match_prefix(self.space, tokens)
        t_match = time.perf_counter() - t0
        result = self.client.load(self.space, match, out=out, on_ready=ready)
        for handle in handles:
            handle.synchronize()
        elapsed = time.perf_counter() - t0
        return result.blocks, elapsed, t_match


def timed_loads(
    loader: Loader,
    client: Client,
    daemons: list[int],
    blocks: int,
    dst: torch.Tensor,
    repeat: int,
    gb: float,
) -> dict[str, float]:
    """Median GB/s, CPU-s/GB and cores busy of ``repeat`` match + load calls (no scatter)."""
    times, spent, match_ms = [], [], 0.0
    for _ in range(repeat):
        start = Usage.now(client, daemons)
        got, secs, t_match = loader.run(blocks, dst, scatter=False)
        spent.append(Usage.now(client, daemons).since(start, gb))
        assert got == blocks, (got, blocks)
        times.append(secs)
        match_ms = t_match * 1000
    out = {k: float(np.median([s[k] for s in spent])) for k in spent[0]}
    return {"gbps": gb / float(np.median(times)), "match_ms": match_ms, **out}


def dsv41_block_count(gib: float, tiny: bool) -> int:
    """Blocks of the DeepSeek-V4.1-shaped prompt: at least ``gib`` GiB (8 MiB with --tiny)."""
    want = (8 << 20) if tiny and gib > 0 else int(gib * GIB)
    return -(-want // DSV41_LAYOUT.payload_bytes)


def pin(array: np.ndarray, device: torch.device) -> None:
    """Page-lock a host array for DMA (CUDA only), as an engine pins its staging buffer."""
    if device.type == "cuda" and array.nbytes:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(array.ctypes.data, array.nbytes, 0)
        assert int(err) == 0, f"cudaHostRegister failed: {err}"


def unpin(array: np.ndarray, device: torch.device) -> None:
    if device.type == "cuda" and array.nbytes:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        cudart.cudaHostUnregister(array.ctypes.data)


def dsv41(
    client: Client,
    daemons: list[int],
    blocks: int,
    repeat: int,
    device: torch.device,
    prompt_blocks: int,
) -> dict[str, Any]:
    """Store, then match + load into pinned memory, ``blocks`` DeepSeek-V4.1-shaped 112 KiB
    blocks: GB/s, blocks/s, CPU-s/GB and the client's cores busy.

    The blocks form prompts of at most ``prompt_blocks`` blocks each (each its own tokens),
    stored one after another and then matched + loaded one after another, each into its
    slice of one pinned buffer; the figures are over all of them. (A match of more than the
    daemons' ``max_items``, 16,384 keys by default, finds nothing today: kept below it.)
    ``dsv41_overlapped_*``: the same loads with each prompt's match made on a second thread
    while the prompt before it loads, as an engine matches its next requests (vLLM's
    scheduler) while its workers load the last ones.
    """
    layout = DSV41_LAYOUT
    space = Namespace(model="bench/deepseek-v4.1-like", revision="1", layout=layout)
    rng = np.random.default_rng(41)
    bounds = [(lo, min(lo + prompt_blocks, blocks)) for lo in range(0, blocks, prompt_blocks)]
    prompts = [
        rng.integers(0, 128_000, (hi - lo) * layout.tokens_per_block).astype(np.uint32)
        for lo, hi in bounds
    ]
    src = client.alloc_buffer(blocks, layout.payload_bytes)
    src[:] = rng.integers(0, 256, src.shape, dtype=np.uint8)
    dst = client.alloc_buffer(blocks, layout.payload_bytes)
    pin(dst, device)
    gb = blocks * layout.payload_bytes / 1e9

    matching = {"wall": 0.0, "client": 0.0}

    def load_all() -> int:
        got = 0
        for (lo, hi), tokens in zip(bounds, prompts, strict=True):
            before = Usage.now(client, daemons)
            match = client.match_prefix(space, tokens)
            after = Usage.now(client, daemons)
            matching["wall"] += after.wall - before.wall
            matching["client"] += after.client - before.client
            got += client.load(space, match, out=dst[lo:hi]).blocks
        return got

    def load_overlapped(matcher: concurrent.futures.ThreadPoolExecutor) -> int:
        got = 0
        ahead = matcher.submit(client.match_prefix, space, prompts[0])
        for i, (lo, hi) in enumerate(bounds):
            match = ahead.result()
            if i + 1 < len(bounds):
                ahead = matcher.submit(client.match_prefix, space, prompts[i + 1])
            got += client.load(space, match, out=dst[lo:hi]).blocks
        return got

    try:
        start = Usage.now(client, daemons)
        for (lo, hi), tokens in zip(bounds, prompts, strict=True):
            result = client.store(space, tokens, src[lo:hi])
            assert result.failed == 0, result
        end = Usage.now(client, daemons)
        store = {"gbps": gb / (end.wall - start.wall), **end.since(start, gb)}
        dst.fill(0)
        load_all()  # warm-up
        times, spent, equal = [], [], True
        matching.update(wall=0.0, client=0.0)  # the timed loads' matches only
        for _ in range(repeat):
            dst.fill(0)
            start = Usage.now(client, daemons)
            got = load_all()
            end = Usage.now(client, daemons)
            assert got == blocks, (got, blocks)
            times.append(end.wall - start.wall)
            spent.append(end.since(start, gb))
            equal = equal and bool(np.array_equal(dst, src))
        over_times, over_spent = [], []
        with concurrent.futures.ThreadPoolExecutor(1) as matcher:
            for _ in range(repeat):
                dst.fill(0)
                start = Usage.now(client, daemons)
                got = load_overlapped(matcher)
                end = Usage.now(client, daemons)
                assert got == blocks, (got, blocks)
                over_times.append(end.wall - start.wall)
                over_spent.append(end.since(start, gb))
                equal = equal and bool(np.array_equal(dst, src))
    finally:
        unpin(dst, device)
    load = {k: float(np.median([s[k] for s in spent])) for k in spent[0]}
    secs = float(np.median(times))
    out = {
        "dsv41_blocks": blocks,
        "dsv41_prompts": len(bounds),
        "dsv41_block_bytes": layout.payload_bytes,
        "dsv41_load_gbps": gb / secs,
        "dsv41_blocks_per_s": blocks / secs,
        "dsv41_client_cores_busy": load["client_busy"],
        "dsv41_client_cpu_s_per_gb_load": load["client_cpu"],
        "dsv41_daemon_cpu_s_per_gb_get": load["daemon_cpu"],
        "dsv41_store_gbps": store["gbps"],
        "dsv41_client_cores_busy_store": store["client_busy"],
        "dsv41_client_cpu_s_per_gb_store": store["client_cpu"],
        "dsv41_daemon_cpu_s_per_gb_put": store["daemon_cpu"],
        "dsv41_load_bit_equal": equal,
        # The matches inside the timed loads: their share of the wall time, and of the
        # client's CPU (the HAS round runs in the calling process; the loads in the pool).
        "dsv41_match_ms_per_prompt": 1000 * matching["wall"] / (repeat * len(bounds)),
        "dsv41_match_share_wall": matching["wall"] / sum(times),
        "dsv41_match_share_client_cpu": matching["client"]
        / (sum(s["client_cpu"] for s in spent) * gb),
        "dsv41_overlapped_load_gbps": gb / float(np.median(over_times)),
        "dsv41_overlapped_client_cores_busy": float(
            np.median([s["client_busy"] for s in over_spent])
        ),
        "dsv41_overlapped_client_cpu_s_per_gb_load": float(
            np.median([s["client_cpu"] for s in over_spent])
        ),
    }
    print(f"DSV41 shape, {blocks} blocks of {layout.payload_bytes} B ({gb:.2f} GB) in "
          f"{len(bounds)} prompts: load "
          f"{out['dsv41_load_gbps']:.2f} GB/s ({out['dsv41_blocks_per_s']:.0f} blocks/s, "
          f"{load['client_busy']:.1f} client cores busy; the matches "
          f"{out['dsv41_match_ms_per_prompt']:.1f} ms a prompt, "
          f"{100 * out['dsv41_match_share_wall']:.0f} % of the wall time and "
          f"{100 * out['dsv41_match_share_client_cpu']:.0f} % of the client's CPU), store "
          f"{store['gbps']:.2f} GB/s ({store['client_busy']:.1f} cores busy); each match "
          f"made while the prompt before loads: {out['dsv41_overlapped_load_gbps']:.2f} GB/s "
          f"({out['dsv41_overlapped_client_cores_busy']:.1f} client cores busy)", flush=True)  # fmt: skip
    return out


def dsv41_restore(
    device: torch.device, recompute_s: dict[int, float], tokens: int, tiny: bool, repeat: int
) -> dict[str, Any]:
    """A V4.1 state restored into the SWA groups' pages, against a 128-token replay."""
    from _dsv41_restore import replay_figures, restore_figures

    out = restore_figures(device, max(repeat, 10), tiny=tiny)
    rate = tokens / recompute_s[tokens] if tokens in recompute_s else None
    out |= replay_figures(device, rate, tiny=tiny, repeat=repeat)
    est = out.get("replay_128_ms_est")
    out["dsv41_replay_vs_restore"] = (
        est / out["dsv41_fetch_restore_ms"] if est is not None else float("nan")
    )
    print_table(
        "DeepSeek V4.1: restoring the SWA state vs replaying 128 tokens (median)",
        ["path", "ms"],
        [
            ["restore 2,801,664 B into the SWA groups' pages", f"{out['dsv41_restore_ms']:.3f}"],
            ["fetch from a peer (loopback) + restore", f"{out['dsv41_fetch_restore_ms']:.3f}"],
            [f"replay 128 tokens, est. at the {tokens}-token prefill rate", f"{est or float('nan'):.3f}"],
            ["a 128-token prefill, measured", f"{out['prefill_128_ms']:.3f}"],
            ["replay est. / (fetch + restore)", f"{out['dsv41_replay_vs_restore']:.2f}x"],
            ["restored bytes equal", str(out["dsv41_restore_bit_equal"])],
        ],
    )  # fmt: skip
    return out


def scaling(
    cluster: LocalCluster,
    space: Namespace,
    tokens: np.ndarray,
    blocks: int,
    *,
    counts: tuple[int, ...],
    seconds: float,
    connections_per_node: int,
) -> list[dict[str, float]]:
    """Aggregate load GB/s of N separate client processes (no I/O pool each) loading the
    same ``blocks`` blocks, started together and released at once (``_load_worker``)."""
    spec = {
        "client_file": str(cluster.client_file),
        "namespace": {"model": space.model, "revision": space.revision},
        "layout": {
            "tokens_per_block": space.layout.tokens_per_block,
            "bytes_per_token": space.layout.bytes_per_token,
            "layers_in_block": space.layout.layers_in_block,
        },
        "tokens": tokens[: blocks * space.layout.tokens_per_block].tolist(),
        "seconds": seconds,
        "overrides": {
            "timeout_s": 30.0,
            "io_processes": 0,
            "connections_per_node": connections_per_node,
        },
    }
    rows = []
    for procs in counts:
        row = run_together(spec, procs)
        rows.append(row)
        print(f"scaling: {procs} client process(es) together: {row['gbps']:.2f} GB/s over "
              f"{row['interval_s']:.2f} s (first loads {row['start_spread_s'] * 1000:.0f} ms "
              f"apart), {row['client_cores_busy']:.1f} cores busy", flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--tiny", action="store_true", help="a few MiB, to check the script on a CPU")
    p.add_argument(
        "--scaling", action="store_true", help="also load with 1-12 client processes together"
    )
    p.add_argument(
        "--scaling-seconds", type=float, default=4.0, help="each --scaling setting's loading time"
    )
    p.add_argument(
        "--dsv41-gib",
        type=float,
        default=2.0,
        help="GiB of the DeepSeek-V4.1-shaped prompt (112 KiB blocks) to store and load; 0 skips",
    )
    p.add_argument(
        "--dsv41-prompt-blocks",
        type=int,
        default=4096,
        help="blocks per DSV41 prompt (one match + load each; default 4096, 512 Ki tokens)",
    )
    p.add_argument("--nodes", type=int, default=12)
    p.add_argument(
        "--restore-only",
        action="store_true",
        help="only the DeepSeek-V4.1 state restore against a 128-token replay",
    )
    p.add_argument("--no-recompute", action="store_true", help="skip the recompute baseline")
    p.add_argument(
        "--io-processes", type=int, default=8, help="client I/O worker processes (default 8)"
    )
    p.add_argument(
        "--connections-per-node",
        type=int,
        default=2,
        help="connections from each client process to each daemon (default 2)",
    )
    p.add_argument(
        "--sweep",
        default="",
        help="also measure other client settings, e.g. 8x1,12x1 (I/O processes x connections "
        "per node): 4 GiB load, 32K load+scatter and a 2 GiB store each",
    )
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, head = (KV_HEADS, HEAD) if not args.tiny else (2, 32)
    page_bytes = LAYERS * heads * PAGE_TOKENS * 2 * head * 2
    token_sizes = [256, 1024, 2048] if args.tiny else [8192, 32768, 77000]
    e2e_bytes = (4 << 20) if args.tiny else 4 * GIB
    repeat = 3 if (args.quick or args.tiny) else 5
    figures: dict[str, Any] = {"commit": commit(), "machine": machine(), "device": str(device)}
    steal0, total0 = host_cpu_times()
    if device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name()
    shm = os.statvfs("/dev/shm")
    print(f"/dev/shm free: {shm.f_bavail * shm.f_frsize / 1e9:.1f} GB", flush=True)
    print(f"device {device} ({figures.get('gpu', 'cpu')}), page {page_bytes / 2**20:.2f} MiB "
          f"across {LAYERS} layers, {figures['machine']}", flush=True)  # fmt: skip

    recompute_s: dict[int, float] = {}
    if not args.no_recompute:
        sizes = token_sizes[:1] if args.restore_only else token_sizes
        recompute_s = recompute_baseline(device, sizes, args.tiny, args.quick)
        for n_tokens, secs in recompute_s.items():
            figures[f"recompute_s_{n_tokens // 1000}k"] = secs
            figures[f"recompute_tok_per_s_{n_tokens // 1000}k"] = n_tokens / secs
    figures |= dsv41_restore(device, recompute_s, token_sizes[0], args.tiny, repeat)
    if args.restore_only:
        write_json(args.json, figures)
        return

    max_blocks = -(-max(token_sizes) // PAGE_TOKENS)
    e2e_blocks = e2e_bytes // page_bytes
    num_pages = 2 * max_blocks + 64
    caches = make_caches(num_pages, device, heads, head)
    adapter = PagedKVAdapter(caches, page_tokens=PAGE_TOKENS, pages_per_block=1)
    assert adapter.payload_bytes == page_bytes
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_pages, generator=gen)
    src, dst = perm[:max_blocks], perm[max_blocks : 2 * max_blocks]
    copy_rows = [
        copy_figures(adapter, caches, src[:e2e_blocks], dst[:e2e_blocks], "4gib", figures, device, repeat)
    ]  # fmt: skip

    space = Namespace(model="bench/llama-3-8b-like", revision="1", layout=adapter.kv_layout())
    tokens = (
        np.random.default_rng(2).integers(0, 128_000, max_blocks * PAGE_TOKENS).astype(np.uint32)
    )
    load_rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="kvcache-gpu-") as tmp:
        sweep = [tuple(int(x) for x in item.split("x")) for item in args.sweep.split(",") if item]
        stored_blocks = max_blocks + len(sweep) * (e2e_blocks // 2)
        stored_blocks += e2e_blocks  # the warm-up store
        dsv41_blocks = dsv41_block_count(args.dsv41_gib, args.tiny)
        stored_bytes = stored_blocks * page_bytes + dsv41_blocks * DSV41_LAYOUT.payload_bytes
        capacity = int(1.5 * stored_bytes * 1.25 / args.nodes) + (256 << 20)
        with LocalCluster(Path(tmp)).start(nodes=args.nodes, capacity=str(capacity)) as cluster:
            daemons = [cluster.pid(i) for i in range(args.nodes)]
            settings = {"timeout_s": 30.0, "connections_per_node": args.connections_per_node}
            with (
                Client(cluster.client_config(io_processes=args.io_processes, **settings)) as client,
                Client(cluster.client_config(io_processes=0, **settings)) as solo,
            ):
                figures["io_processes"] = args.io_processes
                figures["connections_per_node"] = args.connections_per_node
                # Host buffers the pool's workers write and read directly, pinned for DMA.
                host_out = adapter.pin_host(client.alloc_buffer(max_blocks, page_bytes))
                host_in = adapter.pin_host(client.alloc_buffer(max_blocks, page_bytes))
                # Store. An inference worker's client stores all day, so the headline store
                # is the second one of this client: the first, of another prompt's 4 GiB into
                # the empty cluster, warms the I/O processes, their connections and the
                # daemons, and is reported as the `_cold` figure.
                warm_space = Namespace(model="bench/warm-up", revision="1", layout=space.layout)
                adapter.gather(src[:e2e_blocks, None], out=host_out[:e2e_blocks]).synchronize()
                cold = timed_store(
                    client, warm_space, tokens, host_out[:e2e_blocks].numpy(), daemons
                )
                figures["e2e_store_gbps_4gib_cold"] = cold["gbps"]
                figures["client_cpu_s_per_gb_store_cold"] = cold["client_cpu"]
                figures["daemon_cpu_s_per_gb_put_cold"] = cold["daemon_cpu"]
                figures["client_cores_busy_store_4gib_cold"] = cold["client_busy"]
                print(f"store 4 GiB, the client's first (cold): {cold['gbps']:.2f} GB/s, client "
                      f"{cold['client_cpu']:.2f} CPU-s/GB ({cold['client_busy']:.1f} cores busy), "
                      f"daemons {cold['daemon_cpu']:.2f}", flush=True)  # fmt: skip
                # The timed store: gather + store of the prompt's first 4 GiB.
                sync(device)
                start = Usage.now(client, daemons)
                adapter.gather(src[:e2e_blocks, None], out=host_out[:e2e_blocks]).synchronize()
                t_gather = time.perf_counter() - start.wall
                stored = client.store(space, tokens, host_out[:e2e_blocks].numpy())
                end = Usage.now(client, daemons)
                t_store = end.wall - start.wall
                gb4 = e2e_blocks * page_bytes / 1e9
                probe_blocks = min(64, e2e_blocks)
                probe = adapter.gather(src[:probe_blocks, None])
                probe.synchronize()
                reference = probe.host
                figures["gather_into_shared_equal"] = torch.equal(
                    reference, host_out[:probe_blocks]
                )
                figures["e2e_store_gbps_4gib"] = gb4 / t_store
                figures["e2e_store_only_gbps_4gib"] = gb4 / (t_store - t_gather)
                spent = end.since(start, gb4)
                figures["client_cpu_s_per_gb_store"] = spent["client_cpu"]
                figures["daemon_cpu_s_per_gb_put"] = spent["daemon_cpu"]
                figures["client_cores_busy_store_4gib"] = spent["client_busy"]
                figures["daemon_cores_busy_put_4gib"] = spent["daemon_busy"]
                figures["e2e_store_written_4gib"] = stored.written
                print(f"store 4 GiB: {gb4 / t_store:.2f} GB/s (gather {t_gather * 1000:.0f} ms), "
                      f"client {spent['client_cpu']:.2f} CPU-s/GB ({spent['client_busy']:.1f} "
                      f"cores busy), daemons {spent['daemon_cpu']:.2f}", flush=True)  # fmt: skip
                if max_blocks > e2e_blocks:
                    adapter.gather(src[e2e_blocks:, None], out=host_out[e2e_blocks:]).synchronize()
                    rest = client.store(
                        space, tokens, host_out[e2e_blocks:].numpy(), first_block=e2e_blocks
                    )
                    assert rest.failed == 0, rest
                loader = Loader(client, adapter, space, tokens, host_in, device)
                # One client process, no pool: the figure the pool is measured against.
                single = Loader(solo, adapter, space, tokens, host_in, device)
                single.run(e2e_blocks, dst, scatter=False)
                solo_load = timed_loads(single, solo, daemons, e2e_blocks, dst, repeat, gb4)
                figures["e2e_load_gbps_4gib_one_process"] = solo_load["gbps"]
                figures["client_cores_busy_load_4gib_one_process"] = solo_load["client_busy"]
                # Load without scatter: the store's read figure (match + load into pinned).
                loader.run(e2e_blocks, dst, scatter=False)  # warm-up
                load = timed_loads(loader, client, daemons, e2e_blocks, dst, repeat, gb4)
                figures["e2e_load_gbps_4gib"] = load["gbps"]
                figures["client_cpu_s_per_gb_load"] = load["client_cpu"]
                figures["daemon_cpu_s_per_gb_get"] = load["daemon_cpu"]
                figures["client_cores_busy_load_4gib"] = load["client_busy"]
                figures["daemon_cores_busy_get_4gib"] = load["daemon_busy"]
                figures["e2e_load_match_ms_4gib"] = load["match_ms"]
                print(f"load 4 GiB: {load['gbps']:.2f} GB/s, client {load['client_cpu']:.2f} "
                      f"CPU-s/GB ({load['client_busy']:.1f} cores busy), daemons "
                      f"{load['daemon_cpu']:.2f}", flush=True)  # fmt: skip
                # Load vs recompute: match + load + scatter, per prompt length.
                for n_tokens in token_sizes:
                    blocks = n_tokens // PAGE_TOKENS
                    tag = f"{n_tokens // 1000}k"
                    samples, busy_runs = [], []
                    for _ in range(repeat):
                        start = Usage.now(client, daemons)
                        got, secs, _m = loader.run(blocks, dst, scatter=True)
                        spent = Usage.now(client, daemons).since(start, 1.0)
                        busy_runs.append(spent["client_busy"])
                        assert got == blocks, (got, blocks)
                        samples.append(secs)
                    secs = float(np.median(samples))
                    figures[f"client_cores_busy_load_scatter_{tag}"] = float(np.median(busy_runs))
                    ok = pages_equal(caches, src[:blocks].to(device), dst[:blocks].to(device))
                    host_ok = torch.equal(host_in[:blocks], host_out[:blocks])
                    figures[f"load_host_equal_{tag}"] = host_ok
                    if not ok:
                        print(f"{tag}: pages differ; loaded host bytes equal the stored ones: "
                              f"{host_ok}; host pinned: {host_in.is_pinned()}", flush=True)  # fmt: skip
                    gb = blocks * page_bytes / 1e9
                    figures[f"load_scatter_s_{tag}"] = secs
                    figures[f"load_scatter_gbps_{tag}"] = gb / secs
                    figures[f"load_bit_equal_{tag}"] = ok
                    ratio = (
                        recompute_s[n_tokens] / secs if n_tokens in recompute_s else float("nan")
                    )
                    figures[f"load_vs_recompute_{tag}"] = ratio
                    rec = recompute_s.get(n_tokens, float("nan"))
                    load_rows.append([tag, f"{gb:.2f}", f"{rec * 1000:.0f} ms", f"{secs * 1000:.0f} ms",
                                      f"{gb / secs:.2f}", f"{float(np.median(busy_runs)):.1f}",
                                      f"{ratio:.2f}x", str(ok)])  # fmt: skip
                    print(f"{tag}: load+scatter {secs * 1000:.0f} ms ({gb / secs:.2f} GB/s) vs "
                          f"recompute {rec * 1000:.0f} ms: {ratio:.2f}x, bit-equal {ok}", flush=True)  # fmt: skip
                if dsv41_blocks:
                    prompt_blocks = 32 if args.tiny else args.dsv41_prompt_blocks
                    figures.update(
                        dsv41(client, daemons, dsv41_blocks, repeat, device, prompt_blocks)
                    )
                if args.scaling:
                    figures["scaling"] = scaling(
                        cluster, space, tokens, max(1, e2e_blocks // 4),
                        counts=(1, 2) if args.tiny else (1, 2, 4, 8, 12),
                        seconds=1.0 if args.tiny else args.scaling_seconds,
                        connections_per_node=args.connections_per_node,
                    )  # fmt: skip
                sweep_rows = []
                for procs, conns in sweep:
                    settings = {"io_processes": procs, "connections_per_node": conns}
                    with Client(cluster.client_config(timeout_s=30.0, **settings)) as other:
                        n32 = 32768 // PAGE_TOKENS
                        alt_host = adapter.pin_host(
                            other.alloc_buffer(max(e2e_blocks, n32), page_bytes)
                        )
                        alt = Loader(other, adapter, space, tokens, alt_host, device)
                        alt.run(e2e_blocks, dst, scatter=False)
                        alt_load = timed_loads(alt, other, daemons, e2e_blocks, dst, repeat, gb4)
                        t_32 = float(np.median(
                            [alt.run(n32, dst, scatter=True)[1] for _ in range(repeat)]
                        ))  # fmt: skip
                        half = e2e_blocks // 2
                        other_space = Namespace(
                            model=f"bench/sweep-{procs}x{conns}", revision="1", layout=space.layout
                        )
                        buf = other.alloc_buffer(half, page_bytes)
                        buf[:] = host_out[:half].numpy()
                        t0 = time.perf_counter()
                        other.store(other_space, tokens, buf)
                        t_store = time.perf_counter() - t0
                        adapter.unpin_host(alt_host)
                    gb_half = half * page_bytes / 1e9
                    row = {
                        "io_processes": procs,
                        "connections_per_node": conns,
                        "load_gbps_4gib": alt_load["gbps"],
                        "client_cores_busy_load_4gib": alt_load["client_busy"],
                        "load_vs_recompute_32k": recompute_s.get(32768, float("nan")) / t_32,
                        "store_gbps_2gib": gb_half / t_store,
                    }
                    sweep_rows.append(row)
                    print(f"sweep {procs}x{conns}: load {row['load_gbps_4gib']:.2f} GB/s, 32k "
                          f"{row['load_vs_recompute_32k']:.2f}x, store {row['store_gbps_2gib']:.2f} GB/s",
                          flush=True)  # fmt: skip
                figures["sweep"] = sweep_rows
                figures["client_counters"] = client.counters
                adapter.unpin_host(host_out)
                adapter.unpin_host(host_in)
    figures["gather_vs_raw"] = figures["gather_vs_raw_4gib"]
    figures["scatter_vs_raw"] = figures["scatter_vs_raw_4gib"]
    print(f"\nkvcache engine benchmark — commit {figures['commit']}, {figures.get('gpu', device)}, "
          f"{figures['machine']}")  # fmt: skip
    print_table(
        "Gather / scatter vs raw device<->pinned copies of the same bytes (same run, median)",
        ["moved", "gather GB/s", "raw D2H GB/s", "gather/raw", "scatter GB/s", "raw H2D GB/s",
         "scatter/raw", "bit-equal"],
        copy_rows,
    )  # fmt: skip
    f = figures

    def busy(key: str) -> str:
        return f"{f[key]:.1f}" if key in f else "-"

    print_table(
        f"Through a local {args.nodes}-daemon cluster (10+2 RS, loopback), 4 GiB, "
        f"{args.io_processes} I/O processes x {args.connections_per_node} connections per node",
        ["figure", "GB/s", "client cores busy", "client / daemons CPU-s per GB"],
        [
            ["store (gather + encode + quorum PUT)", f"{f['e2e_store_gbps_4gib']:.2f}", busy("client_cores_busy_store_4gib"),
             f"{f['client_cpu_s_per_gb_store']:.2f} / {f['daemon_cpu_s_per_gb_put']:.2f}"],
            ["the client's first store (cold, no gather)", f"{f['e2e_store_gbps_4gib_cold']:.2f}", busy("client_cores_busy_store_4gib_cold"),
             f"{f['client_cpu_s_per_gb_store_cold']:.2f} / {f['daemon_cpu_s_per_gb_put_cold']:.2f}"],
            ["load (match + GET + verify into pinned memory)", f"{f['e2e_load_gbps_4gib']:.2f}", busy("client_cores_busy_load_4gib"),
             f"{f['client_cpu_s_per_gb_load']:.2f} / {f['daemon_cpu_s_per_gb_get']:.2f}"],
            ["load, one client process (no I/O pool)", f"{f['e2e_load_gbps_4gib_one_process']:.2f}", busy("client_cores_busy_load_4gib_one_process"), "-"],
        ] + ([
            [f"DSV41 shape: load {f['dsv41_blocks']} blocks of 112 KiB ({f['dsv41_blocks_per_s']:.0f} blocks/s)",
             f"{f['dsv41_load_gbps']:.2f}", busy("dsv41_client_cores_busy"),
             f"{f['dsv41_client_cpu_s_per_gb_load']:.2f} / {f['dsv41_daemon_cpu_s_per_gb_get']:.2f}"],
            ["DSV41 shape: the same, each match made while the prompt before loads",
             f"{f['dsv41_overlapped_load_gbps']:.2f}", busy("dsv41_overlapped_client_cores_busy"),
             f"{f['dsv41_overlapped_client_cpu_s_per_gb_load']:.2f} / -"],
            ["DSV41 shape: store (first, no gather)", f"{f['dsv41_store_gbps']:.2f}", busy("dsv41_client_cores_busy_store"),
             f"{f['dsv41_client_cpu_s_per_gb_store']:.2f} / {f['dsv41_daemon_cpu_s_per_gb_put']:.2f}"],
        ] if "dsv41_load_gbps" in f else []),
    )  # fmt: skip
    print_table(
        "Load (match + load + scatter into pages, pipelined) vs recompute (bf16 prefill, 8B shape)",
        [
            "prompt",
            "KV GB",
            "recompute",
            "load+scatter",
            "GB/s",
            "client cores busy",
            "recompute / load",
            "bit-equal",
        ],
        load_rows,
    )
    if figures["sweep"]:
        print_table(
            "Client settings (I/O processes x connections per node), same run",
            ["setting", "load 4 GiB GB/s", "client cores busy", "32K load vs recompute",
             "store 2 GiB GB/s"],
            [
                [f"{r['io_processes']}x{r['connections_per_node']}", f"{r['load_gbps_4gib']:.2f}",
                 f"{r['client_cores_busy_load_4gib']:.1f}", f"{r['load_vs_recompute_32k']:.2f}x",
                 f"{r['store_gbps_2gib']:.2f}"]
                for r in figures["sweep"]
            ],
        )  # fmt: skip
    if args.scaling:
        print_table(
            "Load throughput by client processes started together (same daemons, same blocks;"
            " aggregate over the interval all were loading)",
            ["processes", "aggregate GB/s", "client cores busy", "client CPU-s/GB",
             "interval s", "first loads apart (ms)"],
            [[str(r["processes"]), f"{r['gbps']:.2f}", f"{r['client_cores_busy']:.1f}",
              f"{r['cpu_s_per_gb']:.2f}", f"{r['interval_s']:.2f}",
              f"{r['start_spread_s'] * 1000:.0f}"]
             for r in figures["scaling"]],
        )  # fmt: skip
    steal1, total1 = host_cpu_times()
    # Other tenants of a shared host show up here; runs with much steal are slower throughout.
    figures["host_cpu_steal_fraction"] = (steal1 - steal0) / max(1, total1 - total0)
    print(f"host CPU steal during the run: {figures['host_cpu_steal_fraction']:.1%}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
