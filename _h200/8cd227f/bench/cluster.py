"""Cluster benchmark: the kvcache client against 12 local daemons vs Redis on the same blocks.

One client process, 112 KiB blocks. Prints, from one run:
- GET and PUT throughput of kvcache (10+2 Reed–Solomon, hedged 11-of-12 reads)
  against Redis (redis-server started here on loopback, redis-py pipelined);
- p99 load latency with one daemon SIGSTOPped vs healthy;
- load throughput with two daemons dead vs healthy;
- match_prefix time for a 77K-token prompt.

Usage: python bench/cluster.py [--quick] [--json PATH]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json

from kvcache.client import Client, ClientConfig
from kvcache.client.localcluster import LocalCluster, free_ports
from kvcache.keys import Namespace, block_keys
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.workload import payload_for_key

P = REFERENCE_LAYOUT.payload_bytes
TPB = REFERENCE_LAYOUT.tokens_per_block


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found: run scripts/install.sh (apt-get install redis-server)")
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp), "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            r.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("redis-server did not start")
            time.sleep(0.05)
    return proc, port


def redis_parsers() -> dict[str, object]:
    """redis-py's response parsers available here: pure Python, and hiredis if installed."""
    from redis._parsers import _HiredisParser, _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    parsers: dict[str, object] = {"redis-py": _RESP2Parser}
    if HIREDIS_AVAILABLE:
        parsers["redis-py+hiredis"] = _HiredisParser
    return parsers


def bench_redis(
    port: int, payloads: list[np.ndarray], rounds: int, batch: int, parser: object
) -> tuple[float, float]:
    import redis

    pool = redis.ConnectionPool(host="127.0.0.1", port=port, parser_class=parser)
    r = redis.Redis(connection_pool=pool)
    names = [f"blk:{i}".encode() for i in range(len(payloads))]
    blobs = [p.tobytes() for p in payloads]
    total = sum(len(b) for b in blobs)
    set_t = get_t = float("inf")
    for _ in range(rounds):
        r.flushall()
        t = time.perf_counter()
        for s in range(0, len(blobs), batch):
            pipe = r.pipeline(transaction=False)
            for n, b in zip(names[s : s + batch], blobs[s : s + batch], strict=True):
                pipe.set(n, b)
            pipe.execute()
        set_t = min(set_t, time.perf_counter() - t)
        t = time.perf_counter()
        got = 0
        for s in range(0, len(blobs), batch):
            pipe = r.pipeline(transaction=False)
            for n in names[s : s + batch]:
                pipe.get(n)
            got += sum(len(v) for v in pipe.execute())
        get_t = min(get_t, time.perf_counter() - t)
        assert got == total
    r.flushall()
    return total / get_t / 1e9, total / set_t / 1e9


def prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, blocks * TPB).astype(np.uint32)


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    blocks = 256 if args.quick else 1024
    rounds = 3 if args.quick else 5
    latency_loads = 40 if args.quick else 150
    batch = 64
    figures: dict[str, float | str] = {"commit": commit(), "machine": machine(), "blocks": blocks}
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-") as tmp_s:
        tmp = Path(tmp_s)
        space = Namespace(model="bench", revision="1", layout=REFERENCE_LAYOUT)
        tokens = prompt(blocks, 1)
        keys = block_keys(space, tokens)
        payloads = [payload_for_key(k, P) for k in keys]
        total = blocks * P

        redis_proc, port = start_redis(tmp)
        redis_runs: dict[str, tuple[float, float]] = {}
        try:
            # The headline baseline is what `pip install redis` gives (redis-py's own
            # parser); redis-py with hiredis, a stronger client, is measured and shown too.
            for name, parser_class in redis_parsers().items():
                redis_runs[name] = bench_redis(port, payloads, rounds, batch, parser_class)
            redis_get, redis_set = redis_runs["redis-py"]
        finally:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)

        with LocalCluster(tmp / "cluster").start(nodes=12, capacity="4GiB") as cluster:
            config = ClientConfig(cluster_file=cluster.cluster_file, timeout_s=2.0)
            with Client(config) as client:
                # PUT: fresh namespaces so nothing is skipped as already stored.
                put_t = float("inf")
                for r in range(rounds):
                    fresh = Namespace(model=f"bench-put-{r}", revision="1", layout=REFERENCE_LAYOUT)
                    fresh_payloads = [payload_for_key(k, P) for k in block_keys(fresh, tokens)]
                    t = time.perf_counter()
                    res = client.store(fresh, tokens, fresh_payloads)
                    put_t = min(put_t, time.perf_counter() - t)
                    assert res.written == blocks, res
                client.store(space, tokens, payloads)

                def load_all(with_match: bool = False) -> float:
                    """A GET of every block: the load of a matched prefix (optionally with
                    the match, the HAS round Redis has no counterpart of, in the time)."""
                    t = time.perf_counter()
                    match = client.match_prefix(space, tokens)
                    if not with_match:
                        t = time.perf_counter()
                    res = client.load(space, match)
                    elapsed = time.perf_counter() - t
                    assert res.blocks == blocks, (res.blocks, blocks)
                    return elapsed

                load_all()
                get_t = min(load_all() for _ in range(rounds))
                get_match_t = min(load_all(with_match=True) for _ in range(rounds))
                # Check the bytes once, outside the timing.
                res = client.load_prefix(space, tokens)
                wrong = sum(
                    int(np.count_nonzero(a != b))
                    for a, b in zip(res.payloads, payloads, strict=True)
                )

                # Latency: match + load of 64-block prompts, healthy vs one daemon paused.
                short = [prompt(64, 100 + i) for i in range(8)]
                for sp in short:
                    client.store(space, sp, [payload_for_key(k, P) for k in block_keys(space, sp)])

                def latencies(count: int) -> np.ndarray:
                    out = []
                    for i in range(count):
                        sp = short[i % len(short)]
                        t = time.perf_counter()
                        m = client.match_prefix(space, sp)
                        got = client.load(space, m)
                        out.append(time.perf_counter() - t)
                        assert got.blocks == 64, got.blocks
                    return np.array(out) * 1000

                healthy_lat = latencies(latency_loads)
                cluster.pause(5)
                try:
                    stopped_lat = latencies(latency_loads)
                finally:
                    cluster.resume(5)
                cluster.kill(0)
                cluster.kill(1)
                load_all()  # the first call discovers the dead nodes
                dead_t = min(load_all() for _ in range(rounds))

                # match_prefix for a 77K-token prompt (150 blocks of 512 tokens).
                long_tokens = (
                    tokens[:77_000] if blocks * TPB >= 77_000 else np.resize(tokens, 77_000)
                )
                client.match_prefix(space, long_tokens)
                match_ms = (
                    min(_timed(lambda: client.match_prefix(space, long_tokens)) for _ in range(10))
                    * 1000
                )

    kv_get = total / get_t / 1e9
    kv_get_match = total / get_match_t / 1e9
    kv_put = total / put_t / 1e9
    dead_gbps = total / dead_t / 1e9
    p99_h, p99_s = float(np.percentile(healthy_lat, 99)), float(np.percentile(stopped_lat, 99))
    for name, (g, s) in redis_runs.items():
        tag = name.replace("redis-py+", "").replace("redis-py", "plain")
        figures[f"redis_get_gbps_{tag}"] = g
        figures[f"redis_set_gbps_{tag}"] = s
        figures[f"get_vs_redis_{tag}"] = kv_get / g
        figures[f"put_vs_redis_{tag}"] = kv_put / s
    figures.update(
        {
            "kvcache_get_gbps": kv_get,
            "kvcache_put_gbps": kv_put,
            "redis_get_gbps": redis_get,
            "redis_set_gbps": redis_set,
            "get_vs_redis": kv_get / redis_get,
            "kvcache_get_with_match_gbps": kv_get_match,
            "get_with_match_vs_redis": kv_get_match / redis_get,
            "put_vs_redis": kv_put / redis_set,
            "load_p50_healthy_ms": float(np.percentile(healthy_lat, 50)),
            "load_p99_healthy_ms": p99_h,
            "load_p50_stopped_ms": float(np.percentile(stopped_lat, 50)),
            "load_p99_stopped_ms": p99_s,
            "p99_stopped_vs_healthy": p99_s / p99_h,
            "get_2dead_gbps": dead_gbps,
            "throughput_2dead_vs_healthy": dead_gbps / kv_get,
            "match_prefix_77k_ms": match_ms,
            "wrong_bytes": wrong,
        }
    )
    print(f"kvcache cluster benchmark — commit {figures['commit']}, {figures['machine']}")
    print(
        f"{blocks} blocks of {P} bytes ({total / 1e6:.0f} MB), 12 daemons, 10+2 RS, best of {rounds}"
    )
    print_table(
        "Throughput vs Redis (same blocks, same run)",
        ["operation", "kvcache GB/s", "Redis GB/s", "ratio", "target"],
        [
            [
                "GET / load of a matched prefix",
                f"{kv_get:.2f}",
                f"{redis_get:.2f}",
                f"{kv_get / redis_get:.2f}x",
                ">= 1.0x",
            ],
            [
                "GET / match_prefix + load",
                f"{kv_get_match:.2f}",
                f"{redis_get:.2f}",
                f"{kv_get_match / redis_get:.2f}x",
                "(reported)",
            ],
            [
                "PUT / store",
                f"{kv_put:.2f}",
                f"{redis_set:.2f}",
                f"{kv_put / redis_set:.2f}x",
                ">= 1.0x",
            ],
        ],
    )
    print_table(
        "Degraded vs healthy (same run)",
        ["case", "healthy", "degraded", "ratio", "target"],
        [
            ["p99 load latency, 1 daemon SIGSTOPped (64-block loads)", f"{p99_h:.1f} ms", f"{p99_s:.1f} ms", f"{p99_s / p99_h:.2f}x", "<= 1.2x"],
            ["load throughput, 2 daemons dead", f"{kv_get:.2f} GB/s", f"{dead_gbps:.2f} GB/s", f"{dead_gbps / kv_get:.2f}x", ">= 0.8x"],
        ],
    )  # fmt: skip
    print_table(
        "Prefix match",
        ["case", "time", "target"],
        [["match_prefix, 77K-token prompt (150 blocks)", f"{match_ms:.2f} ms", "<= 5 ms"]],
    )
    print_table(
        "Redis by redis-py parser (plain redis-py is the baseline above)",
        ["client", "GET GB/s", "SET GB/s", "kvcache GET / this", "kvcache PUT / this"],
        [
            [name, f"{g:.2f}", f"{s:.2f}", f"{kv_get / g:.2f}x", f"{kv_put / s:.2f}x"]
            for name, (g, s) in redis_runs.items()
        ],
    )
    print(f"\nwrong bytes: {wrong}")
    write_json(args.json, figures)


def _timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
