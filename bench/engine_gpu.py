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
5. CPU-seconds per GB of the client process and of the daemons (all of them), and,
   with ``--scaling``, how load throughput grows with 1, 2, 4 client processes.

Usage: python bench/engine_gpu.py [--quick] [--json PATH] [--tiny] [--scaling]
(``--tiny``: a few MiB and a 2-layer model on whatever device exists, to check the
script on a CPU machine. ``scripts/engine-gpu.sh`` runs it on the GPU machine.)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json

from kvcache.client import Client
from kvcache.client.localcluster import LocalCluster
from kvcache.engine import PagedKVAdapter
from kvcache.keys import Namespace

LAYERS, KV_HEADS, HEAD, PAGE_TOKENS = 32, 8, 128, 16
GIB = 1 << 30


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
    """CPU seconds of this process and of the client's I/O worker processes."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    workers = process_cpu(client.io_pids) if client is not None else 0.0
    return r.ru_utime + r.ru_stime + workers


def host_cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs: time a VM's CPUs were ready but not run."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def process_cpu(pids: list[int]) -> float:
    """User + system seconds of processes (the daemons) from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def timed_store(
    client: Client,
    space: Namespace,
    tokens: np.ndarray,
    payloads: np.ndarray,
    daemons: list[int],
) -> dict[str, float]:
    """GB/s and CPU-s/GB (client, daemons) of one store; every block must be written."""
    c0, d0, t0 = cpu_seconds(client), process_cpu(daemons), time.perf_counter()
    result = client.store(space, tokens, payloads)
    seconds = time.perf_counter() - t0
    c1, d1 = cpu_seconds(client), process_cpu(daemons)
    assert result.failed == 0, result
    gb = payloads.nbytes / 1e9
    return {"gbps": gb / seconds, "client_cpu": (c1 - c0) / gb, "daemon_cpu": (d1 - d0) / gb}


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


def scaling(
    cluster: LocalCluster, space: Namespace, tokens: np.ndarray, blocks: int
) -> list[dict[str, float]]:
    """Aggregate load GB/s with N independent client processes loading the same blocks."""
    worker = Path(__file__).resolve().parent / "_load_worker.py"
    rows = []
    for procs in (1, 2, 4, 8):
        spec = json.dumps(
            {
                "client_file": str(cluster.client_file),
                "namespace": {"model": space.model, "revision": space.revision},
                "layout": {
                    "tokens_per_block": space.layout.tokens_per_block,
                    "bytes_per_token": space.layout.bytes_per_token,
                    "layers_in_block": space.layout.layers_in_block,
                },
                "tokens": tokens[: blocks * PAGE_TOKENS].tolist(),
                "repeat": 3,
            }
        )
        started = time.perf_counter()
        runs = [
            subprocess.Popen(
                [sys.executable, str(worker)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            for _ in range(procs)
        ]
        outs = [json.loads(p.communicate(spec.encode())[0]) for p in runs]
        wall = time.perf_counter() - started
        gb = sum(o["gb"] for o in outs)
        busy = max(o["seconds"] for o in outs)
        cpu = sum(o["cpu_s"] for o in outs)
        rows.append(
            {"processes": procs, "gbps": gb / busy, "cpu_s_per_gb": cpu / gb, "wall_s": wall}
        )
        print(f"scaling: {procs} client process(es): {gb / busy:.2f} GB/s", flush=True)
    return rows


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--tiny", action="store_true", help="a few MiB, to check the script on a CPU")
    p.add_argument("--scaling", action="store_true", help="also load with 1-8 client processes")
    p.add_argument("--nodes", type=int, default=12)
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
        recompute_s = recompute_baseline(device, token_sizes, args.tiny, args.quick)
        for tokens, secs in recompute_s.items():
            figures[f"recompute_s_{tokens // 1000}k"] = secs
            figures[f"recompute_tok_per_s_{tokens // 1000}k"] = tokens / secs

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
        capacity = int(1.5 * stored_blocks * page_bytes * 1.25 / args.nodes) + (256 << 20)
        with LocalCluster(Path(tmp)).start(nodes=args.nodes, capacity=str(capacity)) as cluster:
            daemons = [cluster.pid(i) for i in range(args.nodes)]
            with (
                Client(
                    cluster.client_config(timeout_s=30.0, io_processes=args.io_processes)
                ) as client,
                Client(cluster.client_config(timeout_s=30.0)) as solo,
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
                print(f"store 4 GiB, the client's first (cold): {cold['gbps']:.2f} GB/s, client "
                      f"{cold['client_cpu']:.2f} CPU-s/GB, daemons {cold['daemon_cpu']:.2f}",
                      flush=True)  # fmt: skip
                # The timed store: gather + store of the prompt's first 4 GiB.
                sync(device)
                c0, d0, t0 = cpu_seconds(client), process_cpu(daemons), time.perf_counter()
                adapter.gather(src[:e2e_blocks, None], out=host_out[:e2e_blocks]).synchronize()
                t_gather = time.perf_counter() - t0
                stored = client.store(space, tokens, host_out[:e2e_blocks].numpy())
                t_store = time.perf_counter() - t0
                c1, d1 = cpu_seconds(client), process_cpu(daemons)
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
                figures["client_cpu_s_per_gb_store"] = (c1 - c0) / gb4
                figures["daemon_cpu_s_per_gb_put"] = (d1 - d0) / gb4
                figures["e2e_store_written_4gib"] = stored.written
                print(f"store 4 GiB: {gb4 / t_store:.2f} GB/s (gather {t_gather * 1000:.0f} ms), "
                      f"client {(c1 - c0) / gb4:.2f} CPU-s/GB, daemons {(d1 - d0) / gb4:.2f}",
                      flush=True)  # fmt: skip
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
                solo_times = [single.run(e2e_blocks, dst, scatter=False)[1] for _ in range(repeat)]
                figures["e2e_load_gbps_4gib_one_process"] = gb4 / float(np.median(solo_times))
                # Load without scatter: the store's read figure (match + load into pinned).
                loader.run(e2e_blocks, dst, scatter=False)  # warm-up
                times, cpus, dcpus = [], [], []
                for _ in range(repeat):
                    c0, d0 = cpu_seconds(client), process_cpu(daemons)
                    got, secs, t_match = loader.run(e2e_blocks, dst, scatter=False)
                    cpus.append(cpu_seconds(client) - c0)
                    dcpus.append(process_cpu(daemons) - d0)
                    times.append(secs)
                    assert got == e2e_blocks, got
                figures["e2e_load_gbps_4gib"] = gb4 / float(np.median(times))
                figures["client_cpu_s_per_gb_load"] = float(np.median(cpus)) / gb4
                figures["daemon_cpu_s_per_gb_get"] = float(np.median(dcpus)) / gb4
                figures["e2e_load_match_ms_4gib"] = t_match * 1000
                print(f"load 4 GiB: {figures['e2e_load_gbps_4gib']:.2f} GB/s, client "
                      f"{figures['client_cpu_s_per_gb_load']:.2f} CPU-s/GB, daemons "
                      f"{figures['daemon_cpu_s_per_gb_get']:.2f}", flush=True)  # fmt: skip
                # Load vs recompute: match + load + scatter, per prompt length.
                for n_tokens in token_sizes:
                    blocks = n_tokens // PAGE_TOKENS
                    tag = f"{n_tokens // 1000}k"
                    samples = []
                    for _ in range(repeat):
                        got, secs, _m = loader.run(blocks, dst, scatter=True)
                        assert got == blocks, (got, blocks)
                        samples.append(secs)
                    secs = float(np.median(samples))
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
                                      f"{gb / secs:.2f}", f"{ratio:.2f}x", str(ok)])  # fmt: skip
                    print(f"{tag}: load+scatter {secs * 1000:.0f} ms ({gb / secs:.2f} GB/s) vs "
                          f"recompute {rec * 1000:.0f} ms: {ratio:.2f}x, bit-equal {ok}", flush=True)  # fmt: skip
                if args.scaling:
                    figures["scaling"] = scaling(cluster, space, tokens, e2e_blocks // 2)
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
                        t_load = float(np.median(
                            [alt.run(e2e_blocks, dst, scatter=False)[1] for _ in range(repeat)]
                        ))  # fmt: skip
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
                        "load_gbps_4gib": gb4 / t_load,
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
    print_table(
        f"Through a local {args.nodes}-daemon cluster (10+2 RS, loopback), 4 GiB, "
        f"{args.io_processes} I/O processes x {args.connections_per_node} connections per node",
        ["figure", "value"],
        [
            ["store (gather + encode + quorum PUT)", f"{figures['e2e_store_gbps_4gib']:.2f} GB/s"],
            ["the client's first store (cold, no gather)", f"{figures['e2e_store_gbps_4gib_cold']:.2f} GB/s"],
            ["load (match + GET + verify into pinned memory)", f"{figures['e2e_load_gbps_4gib']:.2f} GB/s"],
            ["load, one client process (no I/O pool)", f"{figures['e2e_load_gbps_4gib_one_process']:.2f} GB/s"],
            ["client CPU-s per GB, load / store", f"{figures['client_cpu_s_per_gb_load']:.2f} / {figures['client_cpu_s_per_gb_store']:.2f}"],
            ["daemon CPU-s per GB (all 12), GET / PUT", f"{figures['daemon_cpu_s_per_gb_get']:.2f} / {figures['daemon_cpu_s_per_gb_put']:.2f}"],
            ["the same for the cold store: client / daemons", f"{figures['client_cpu_s_per_gb_store_cold']:.2f} / {figures['daemon_cpu_s_per_gb_put_cold']:.2f}"],
        ],
    )  # fmt: skip
    print_table(
        "Load (match + load + scatter into pages, pipelined) vs recompute (bf16 prefill, 8B shape)",
        ["prompt", "KV GB", "recompute", "load+scatter", "GB/s", "recompute / load", "bit-equal"],
        load_rows,
    )
    if figures["sweep"]:
        print_table(
            "Client settings (I/O processes x connections per node), same run",
            ["setting", "load 4 GiB GB/s", "32K load vs recompute", "store 2 GiB GB/s"],
            [
                [f"{r['io_processes']}x{r['connections_per_node']}", f"{r['load_gbps_4gib']:.2f}",
                 f"{r['load_vs_recompute_32k']:.2f}x", f"{r['store_gbps_2gib']:.2f}"]
                for r in figures["sweep"]
            ],
        )  # fmt: skip
    if args.scaling:
        print_table(
            "Load throughput by client processes (same daemons, same blocks)",
            ["processes", "aggregate GB/s", "client CPU-s/GB"],
            [[str(r["processes"]), f"{r['gbps']:.2f}", f"{r['cpu_s_per_gb']:.2f}"]
             for r in figures["scaling"]],
        )  # fmt: skip
    steal1, total1 = host_cpu_times()
    # Other tenants of a shared host show up here; runs with much steal are slower throughout.
    figures["host_cpu_steal_fraction"] = (steal1 - steal0) / max(1, total1 - total0)
    print(f"host CPU steal during the run: {figures['host_cpu_steal_fraction']:.1%}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
