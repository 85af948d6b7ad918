"""Cluster benchmark: the kvcache client against 12 local daemons vs Redis on the same blocks.

One client process, 112 KiB blocks, everything on loopback. Prints, from one run:
- GET and PUT throughput of kvcache (10+2 Reed–Solomon, hedged 11-of-12 reads, loads into a
  preallocated buffer as an engine does) against the strongest Python Redis client measured
  here (redis-server started here), with every Redis client's figures and the C client
  ``redis-benchmark`` as a cross-check;
- CPU seconds per GB: the client (this process plus any I/O worker processes) and the 12
  daemons summed, over the timed rounds;
- p99 load latency with one daemon SIGSTOPped vs healthy;
- load throughput with two daemons dead vs healthy;
- match_prefix time for a 77K-token prompt;
- a sweep of client settings (chunk_bytes, window, connections_per_node, io_processes).

Fairness: kvcache and every Redis client run in the same rounds, in rotating order, while both
the daemons and redis-server are up (each idle while the other is measured); the figure of
each is its best round. Redis SETs write keys DELeted just before, as kvcache stores write a
fresh namespace and delete it after the round (not FLUSHALL: Redis 7 then hands its memory
back to the kernel, and the next SETs pay page faults for it). Every client runs with the
glibc malloc settings of kvcache.memtune, for the same reason. The headline uses the client
as a user configures it: the library defaults, or the settings named with ``--client``
(applied to every client of the run, the sweep's included); the sweep only reports.

Usage: python bench/cluster.py [--quick] [--json PATH] [--client KEY=VALUE ...] [--no-sweep]
                               [--plot PNG]

``--plot`` draws the CDFs of the match + load latencies, healthy against one daemon
SIGSTOPped (the p99 figures above come from the same two lists).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json

from kvcache.client import Client, ClientConfig
from kvcache.keys import Namespace, block_keys
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.memtune import tune_malloc
from kvcache.testing.localcluster import LocalCluster, free_ports
from kvcache.workload import payload_for_key

P = REFERENCE_LAYOUT.payload_bytes
TPB = REFERENCE_LAYOUT.tokens_per_block
NODES = 12
Array = npt.NDArray[np.uint8]

#: Client settings tried for loads and stores (on top of the run's own ``--client`` settings).
SWEEP: list[tuple[str, dict[str, int]]] = [
    ("as configured", {}),
    ("chunk_bytes=8MiB", {"chunk_bytes": 8 << 20}),
    ("chunk_bytes=16MiB", {"chunk_bytes": 16 << 20}),
    ("window=2", {"window": 2}),
    ("window=8", {"window": 8}),
    ("connections_per_node=1", {"connections_per_node": 1}),
    ("connections_per_node=4", {"connections_per_node": 4}),
    ("io_processes=1", {"io_processes": 1}),
    ("io_processes=2", {"io_processes": 2}),
]


# ---------------------------------------------------------------------- CPU accounting


def proc_cpu(pids: Sequence[int]) -> float:
    """User + system seconds of processes (all their threads), from /proc/PID/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            # The command name may contain spaces: fields follow its closing parenthesis.
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass  # gone (a killed daemon): it uses no more CPU
    return total / tick


def self_cpu() -> float:
    """User + system seconds of this process (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclasses.dataclass
class Series:
    """Timed rounds of one operation: seconds per round, CPU over all rounds, bytes per round."""

    nbytes: int
    seconds: list[float] = dataclasses.field(default_factory=list)
    client_cpu: float = 0.0
    server_cpu: float = 0.0

    @contextmanager
    def timed(self, client_pids: Sequence[int], server_pids: Sequence[int]) -> Iterator[None]:
        """Time one round; add the CPU the client side (this process and ``client_pids``)
        and the server side (``server_pids``) spent in it."""
        c0, s0 = self_cpu() + proc_cpu(client_pids), proc_cpu(server_pids)
        t = time.perf_counter()
        yield
        self.seconds.append(time.perf_counter() - t)
        self.client_cpu += self_cpu() + proc_cpu(client_pids) - c0
        self.server_cpu += proc_cpu(server_pids) - s0

    @property
    def best(self) -> float:
        """GB/s of the best round."""
        return self.nbytes / min(self.seconds) / 1e9 if self.seconds else float("nan")

    @property
    def median(self) -> float:
        """GB/s of the median round."""
        return self.nbytes / float(np.median(self.seconds)) / 1e9 if self.seconds else float("nan")

    def cpu_per_gb(self, side: str) -> float:
        """CPU seconds per GB moved over all rounds, client or server side."""
        gb = self.nbytes * len(self.seconds) / 1e9
        return (self.client_cpu if side == "client" else self.server_cpu) / gb if gb else 0.0


# ---------------------------------------------------------------------- Redis


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found: run scripts/install.sh (apt-get install redis-server)")
    (port,) = free_ports(1)
    # io-threads stays 1: Redis hands writes to I/O threads only with at least 2 clients per
    # thread pending, so a one-connection client never uses them (measured: no change).
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
    r.close()
    return proc, port


class RedisPy:
    """redis-py, pipelined (``transaction=False``): ``batch`` commands per ``execute()``."""

    def __init__(
        self,
        port: int,
        names: list[bytes],
        src: Array,
        *,
        hiredis: bool,
        read_size: int,
        batch: int,
    ) -> None:
        import redis
        from redis._parsers import _HiredisParser, _RESP2Parser

        pool = redis.ConnectionPool(
            host="127.0.0.1",
            port=port,
            parser_class=_HiredisParser if hiredis else _RESP2Parser,
            socket_read_size=read_size,
        )
        self.r = redis.Redis(connection_pool=pool)
        self.names, self.src, self.batch = names, src, batch

    def set_all(self) -> None:
        names, src, batch = self.names, self.src, self.batch
        for s in range(0, len(names), batch):
            pipe = self.r.pipeline(transaction=False)
            for i in range(s, min(len(names), s + batch)):
                pipe.set(names[i], src[i].data)
            pipe.execute()

    def get_all(self) -> None:
        names, batch = self.names, self.batch
        got = 0
        for s in range(0, len(names), batch):
            pipe = self.r.pipeline(transaction=False)
            for n in names[s : s + batch]:
                pipe.get(n)
            got += sum(len(v) for v in pipe.execute())
        assert got == self.src.nbytes, (got, self.src.nbytes)

    def wrong_bytes(self) -> int:
        wrong = 0
        for n, row in zip(self.names, self.src, strict=True):
            value = self.r.get(n)
            got = np.frombuffer(value if isinstance(value, bytes) else b"", np.uint8)
            wrong += row.nbytes if got.shape != row.shape else int(np.count_nonzero(got != row))
        return wrong

    def close(self) -> None:
        self.r.close()
        self.r.connection_pool.disconnect()


class RawResp:
    """RESP over a plain socket, the least a Python client can do per byte: a pipeline of
    ``batch`` SETs is one gathered ``sendmsg`` from the caller's rows; a pipeline of GETs is
    one ``sendall`` of the commands and one ``recvmsg_into(MSG_WAITALL)`` that lands every
    value straight in a preallocated array (replies parsed by checking the fixed framing,
    ``$<len>\\r\\n``...``\\r\\n``, which an unexpected reply fails). No bytes object per
    value, no copy in Python: what kvcache's transport does for its own protocol."""

    def __init__(self, port: int, names: list[bytes], src: Array, out: Array, batch: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.names, self.src, self.out, self.batch = names, src, out, batch
        row = src.shape[1]
        self.head = b"$%d\r\n" % row
        self.gets = [
            b"".join(
                b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in names[s : s + batch]
            )
            for s in range(0, len(names), batch)
        ]
        self.sets = [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(n), n, row) for n in names]

    def set_all(self) -> None:
        names, batch = self.names, self.batch
        for s in range(0, len(names), batch):
            rows = range(s, min(len(names), s + batch))
            views: list[memoryview] = []
            for i in rows:
                views += [memoryview(self.sets[i]), self.src[i].data, memoryview(b"\r\n")]
            send_all(self.sock, views)
            ok = bytearray(5 * len(rows))
            recv_scatter(self.sock, [memoryview(ok)])
            if ok != b"+OK\r\n" * len(rows):
                raise RuntimeError(f"unexpected SET replies: {bytes(ok[:40])!r}")

    def get_all(self) -> None:
        head, h = self.head, len(self.head)
        for chunk, s in enumerate(range(0, len(self.names), self.batch)):
            rows = range(s, min(len(self.names), s + self.batch))
            self.sock.sendall(self.gets[chunk])
            frame = bytearray((h + 2) * len(rows))
            fv = memoryview(frame)
            views: list[memoryview] = []
            for j, i in enumerate(rows):
                at = j * (h + 2)
                views += [fv[at : at + h], self.out[i].data, fv[at + h : at + h + 2]]
            recv_scatter(self.sock, views)
            if frame != (head + b"\r\n") * len(rows):
                raise RuntimeError("unexpected GET reply (missing key?)")

    def wrong_bytes(self) -> int:
        self.get_all()
        return int(np.count_nonzero(self.out != self.src))

    def close(self) -> None:
        self.sock.close()


def send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Every byte of ``views``, gathered (Linux takes at most 1024 buffers per call)."""
    pending = [v for v in views if v.nbytes]
    while pending:
        sent = sock.sendmsg(pending[:1024])
        while sent:
            if sent >= pending[0].nbytes:
                sent -= pending.pop(0).nbytes
            else:
                pending[0] = pending[0][sent:]
                sent = 0


def recv_scatter(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every buffer of ``views`` in order (one syscall per 1024 buffers when it can)."""
    pending = [v for v in views if v.nbytes]
    while pending:
        batch = pending[:1024]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("redis-server closed the connection")
        del pending[: len(batch)]
        for i, view in enumerate(batch):
            if got < view.nbytes:
                pending[:0] = [view[got:], *batch[i + 1 :]]
                break
            got -= view.nbytes


def redis_benchmark(port: int, test: str, pipeline: int, requests: int, keyspace: int) -> float:
    """GB/s of the C client ``redis-benchmark`` (one connection) for ``test`` (get or set),
    with random keys ``key:%012d`` below ``keyspace``; NaN without the program."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return float("nan")
    cmd = [exe, "-h", "127.0.0.1", "-p", str(port), "-d", str(P), "-P", str(pipeline), "-c", "1",
           "-r", str(keyspace), "-n", str(requests), "-t", test, "--csv"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    for line in text.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0] == test.upper():
            return float(cells[1]) * P / 1e9
    raise RuntimeError(f"redis-benchmark printed no {test.upper()} figure: {text!r}")


# ---------------------------------------------------------------------- kvcache


def prompt(blocks: int, seed: int) -> npt.NDArray[np.uint32]:
    return np.random.default_rng(seed).integers(0, 100_000, blocks * TPB).astype(np.uint32)


def client_settings(items: list[str]) -> dict[str, Any]:
    """``--client KEY=VALUE`` items as ClientConfig overrides (sizes may say KiB/MiB/GiB)."""
    fields = {f.name: f for f in dataclasses.fields(ClientConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            sys.exit(f"--client {item!r}: expected KEY=VALUE with KEY a ClientConfig field")
        default = fields[key].default
        if isinstance(default, bool):
            out[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            scale = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
            unit = next((u for u in scale if value.endswith(u)), "")
            out[key] = int(value.removesuffix(unit) or "0", 0) * scale.get(unit, 1)
        elif isinstance(default, float) or default is None:
            out[key] = float(value)
        else:
            out[key] = value
    return out


def describe(settings: dict[str, Any]) -> str:
    def size(v: Any) -> str:
        return (
            f"{v >> 20}MiB" if isinstance(v, int) and v >= 1 << 20 and not v % (1 << 20) else str(v)
        )

    return ", ".join(f"{k}={size(v)}" for k, v in settings.items()) or "library defaults"


class KvBench:
    """One client with its buffers: timed loads of the stored prompt and stores of it."""

    def __init__(
        self, cluster: LocalCluster, settings: dict[str, Any], tokens: Any, src: Array
    ) -> None:
        self.client = Client(cluster.client_config(**settings))
        self.daemons = [cluster.pid(i) for i in range(NODES)]
        blocks = src.shape[0]
        # Buffers the way an engine has them: allocated once, through the client (shared
        # memory with an I/O pool), touched before any timing.
        self.src = self.client.alloc_buffer(blocks, P)
        self.src[:] = src
        self.out = self.client.alloc_buffer(blocks, P)
        self.out.fill(0)
        self.tokens = tokens
        self.get = Series(src.nbytes)
        self.get_match = Series(src.nbytes)
        self.put = Series(src.nbytes)
        self.stores = 0

    def pids(self) -> list[int]:
        return self.client.io_pids

    def load(self, space: Namespace, series: Series | None, with_match: bool = False) -> None:
        client, blocks = self.client, self.src.shape[0]
        if series is None or not with_match:
            match = client.match_prefix(space, self.tokens)
        if series is None:
            res = client.load(space, match, out=self.out)
        else:
            with series.timed(self.pids(), self.daemons):
                if with_match:
                    match = client.match_prefix(space, self.tokens)
                res = client.load(space, match, out=self.out)
        assert res.blocks == blocks, (res.blocks, blocks)

    def store(self, tag: str, series: Series | None) -> None:
        """Store the prompt under a fresh namespace (nothing skipped as present), then delete
        it again, outside the timing, so every round starts from the same daemons."""
        self.stores += 1
        fresh = Namespace(model=f"put-{tag}-{self.stores}", revision="1", layout=REFERENCE_LAYOUT)
        if series is None:
            res = self.client.store(fresh, self.tokens, self.src)
        else:
            with series.timed(self.pids(), self.daemons):
                res = self.client.store(fresh, self.tokens, self.src)
        assert res.written == self.src.shape[0], res
        self.client.delete(fresh, self.tokens)

    def wrong_bytes(self) -> int:
        return int(np.count_nonzero(self.out != self.src))

    def close(self) -> None:
        self.client.close()


def rotated(items: list[Any], by: int) -> list[Any]:
    by %= max(1, len(items))
    return items[by:] + items[:by]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


# ---------------------------------------------------------------------- main


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a ClientConfig setting for every client of the run (repeatable), e.g. window=2",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the client-settings sweep")
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="write load-latency CDFs (healthy vs stopped)"
    )
    args = p.parse_args()
    settings = client_settings(args.client)
    blocks = 1024
    rounds = 11 if args.quick else 15
    sweep_rounds = 6 if args.quick else 11
    latency_loads = 200 if args.quick else 400
    rb_batch_default, rb_batch_tuned, raw_batch = 64, 16, 32
    started = time.monotonic()
    total = blocks * P
    # Every client of the run, Redis's too, gets the glibc malloc settings a kvcache Client
    # applies to its process anyway: without them each large reply's buffer is handed back
    # to the kernel and faulted in again (measured: 2-3x fewer GB/s for redis-py).
    tune_malloc()
    figures: dict[str, Any] = {
        "commit": commit(),
        "machine": machine(),
        "blocks": blocks,
        "rounds": rounds,
        "client_settings": describe(settings),
    }
    space = Namespace(model="bench", revision="1", layout=REFERENCE_LAYOUT)
    tokens = prompt(blocks, 1)
    src = np.stack([payload_for_key(k, P) for k in block_keys(space, tokens)])
    # redis-benchmark's key names (``-r``), so that its GETs read these very blocks.
    names = [b"key:%012d" % i for i in range(blocks)]

    with tempfile.TemporaryDirectory(prefix="kvcache-bench-") as tmp_s:
        tmp = Path(tmp_s)
        redis_proc, port = start_redis(tmp)
        import redis

        admin = redis.Redis(host="127.0.0.1", port=port)
        try:
            with LocalCluster(tmp / "cluster").start(nodes=NODES, capacity="4GiB") as cluster:
                kv = KvBench(cluster, settings, tokens, src)
                kv.client.store(space, tokens, kv.src)
                raw_out = np.zeros_like(src)
                rclients: dict[str, Any] = {
                    "redis-py": RedisPy(
                        port, names, src, hiredis=False, read_size=65536, batch=rb_batch_default
                    ),
                    "redis-py+hiredis": RedisPy(
                        port, names, src, hiredis=True, read_size=65536, batch=rb_batch_default
                    ),
                    "redis-py+hiredis, tuned": RedisPy(
                        port, names, src, hiredis=True, read_size=1 << 20, batch=rb_batch_tuned
                    ),
                    "raw RESP socket": RawResp(port, names, src, raw_out, raw_batch),
                }
                rget = {name: Series(total) for name in rclients}
                rset = {name: Series(total) for name in rclients}
                c_runs: dict[int, list[tuple[float, float]]] = {64: [], 16: []}
                server = [redis_proc.pid]

                def redis_round(name: str, timed: bool) -> None:
                    c = rclients[name]
                    admin.delete(*names)
                    if not timed:
                        c.set_all()
                        c.get_all()
                        return
                    with rset[name].timed([], server):
                        c.set_all()
                    with rget[name].timed([], server):
                        c.get_all()

                def c_round() -> None:
                    # GETs of our blocks (redis-benchmark's key names, filled untimed); SETs
                    # to the same key space after a DEL (about half of them overwrites).
                    for depth, runs in c_runs.items():
                        admin.delete(*names)
                        rclients["raw RESP socket"].set_all()
                        get = redis_benchmark(port, "get", depth, 8 * blocks, blocks)
                        admin.delete(*names)
                        put = redis_benchmark(port, "set", depth, 2 * blocks, blocks)
                        runs.append((get, put))

                def kv_round(timed: bool) -> None:
                    kv.load(space, kv.get if timed else None)
                    kv.load(space, kv.get_match if timed else None, with_match=True)
                    kv.store("main", kv.put if timed else None)

                # Warm-up (connections, buffers, caches) of every contender, then the rounds.
                for name in rclients:
                    redis_round(name, timed=False)
                kv_round(timed=False)
                steps: list[Callable[[], None]] = [partial(kv_round, True), c_round]
                steps += [partial(redis_round, name, True) for name in rclients]
                for r in range(rounds):
                    for step in rotated(steps, r):
                        step()
                wrong = kv.wrong_bytes()
                admin.delete(*names)
                rclients["raw RESP socket"].set_all()
                redis_wrong = {name: c.wrong_bytes() for name, c in rclients.items()}
                for c in rclients.values():
                    c.close()
                admin.flushall()
                print(f"# throughput rounds done at {time.monotonic() - started:.0f} s", flush=True)

                # match_prefix for a 77K-token prompt (150 blocks of 512 tokens), healthy.
                long_tokens = (
                    tokens[:77_000] if blocks * TPB >= 77_000 else np.resize(tokens, 77_000)
                )
                kv.client.match_prefix(space, long_tokens)
                match_ms = 1000 * min(
                    _timed(lambda: kv.client.match_prefix(space, long_tokens)) for _ in range(20)
                )

                sweep = run_sweep(cluster, settings, tokens, src, space, sweep_rounds, args)
                print(f"# sweep done at {time.monotonic() - started:.0f} s", flush=True)

                # Latency: match + load of 64-block prompts, healthy vs one daemon paused.
                short = [prompt(64, 100 + i) for i in range(8)]
                for sp in short:
                    kv.client.store(space, sp, kv.src[:64])
                lat_out = kv.client.alloc_buffer(64, P)
                lat_out.fill(0)

                def latencies(count: int) -> list[float]:
                    out = []
                    for i in range(count):
                        sp = short[i % len(short)]
                        t = time.perf_counter()
                        m = kv.client.match_prefix(space, sp)
                        got = kv.client.load(space, m, out=lat_out)
                        out.append((time.perf_counter() - t) * 1000)
                        assert got.blocks == 64, got.blocks
                        # Which loads ran after the client had marked the paused node down.
                        marked.append(bool(kv.client.core.health.down_nodes()))
                    return out

                marked: list[bool] = []

                latencies(16)
                healthy_lat = latencies(latency_loads)
                before = dict(kv.client.counters)
                cluster.pause(5)
                try:
                    marked.clear()
                    stopped_lat = latencies(latency_loads)
                    stopped_marked = list(marked)
                finally:
                    cluster.resume(5)
                after = kv.client.counters
                stopped_counters = {k: v - before.get(k, 0) for k, v in after.items()}

                # Throughput with two daemons dead vs healthy, measured back to back: first
                # the paused daemon is used again, then healthy rounds, the kills, and as many
                # rounds again (the first loads after the kills discover them).
                deadline = time.monotonic() + 30
                while kv.client.core.health.down_nodes() and time.monotonic() < deadline:
                    kv.load(space, None)
                    time.sleep(0.1)
                healthy = Series(total)
                for _ in range(rounds):
                    kv.load(space, healthy)
                cluster.kill(0)
                cluster.kill(1)
                kv.load(space, None)
                kv.load(space, None)
                dead = Series(total)
                for _ in range(rounds):
                    kv.load(space, dead)
                wrong += kv.wrong_bytes()
                match_dead_ms = 1000 * min(
                    _timed(lambda: kv.client.match_prefix(space, long_tokens)) for _ in range(10)
                )
                kv.close()
        finally:
            admin.close()
            redis_proc.terminate()
            redis_proc.wait(timeout=10)

    report(
        figures,
        args=args,
        blocks=blocks,
        rounds=rounds,
        kv=kv,
        rget=rget,
        rset=rset,
        c_runs=c_runs,
        redis_wrong=redis_wrong,
        wrong=wrong,
        healthy_lat=healthy_lat,
        stopped_lat=stopped_lat,
        stopped_marked=stopped_marked,
        dead=dead,
        healthy=healthy,
        match_ms=match_ms,
        match_dead_ms=match_dead_ms,
        sweep=sweep,
        counters=stopped_counters,
        batches=(rb_batch_default, rb_batch_tuned, raw_batch),
    )
    if args.plot is not None:
        plot_latencies(args.plot, healthy_lat, stopped_lat, figures["commit"])
    print(f"\n(run took {time.monotonic() - started:.0f} s)")


def plot_latencies(path: Path, healthy: list[float], stopped: list[float], sha: str) -> None:
    """CDFs of match + load latency of 64-block prompts, healthy vs one daemon stopped."""
    from kvcache.plots import latency_cdf_figure, write_png

    fig = latency_cdf_figure(
        {"healthy": healthy, "1 daemon SIGSTOPped": stopped},
        title=f"match + load of 64-block prompts, 12 daemons ({sha}, {machine()})",
    )
    write_png(fig, path)
    print(f"plot written to {path}")


def run_sweep(
    cluster: LocalCluster,
    settings: dict[str, Any],
    tokens: Any,
    src: Array,
    space: Namespace,
    rounds: int,
    args: Any,
) -> dict[str, KvBench]:
    """Each setting of SWEEP on top of the run's settings, its own client, rounds rotating."""
    if args.no_sweep:
        return {}
    benches = {name: KvBench(cluster, {**settings, **extra}, tokens, src) for name, extra in SWEEP}
    try:
        names = list(benches)
        for b in benches.values():
            b.load(space, None)
            b.store("sweep", None)
        for r in range(rounds):
            for name in rotated(names, r):
                b = benches[name]
                b.load(space, b.get)
                b.store("sweep", b.put)
    finally:
        for b in benches.values():
            b.close()
    return benches


def report(figures: dict[str, Any], **m: Any) -> None:
    args, blocks, rounds = m["args"], m["blocks"], m["rounds"]
    kv: KvBench = m["kv"]
    nan = float("nan")
    rget: dict[str, Series] = m["rget"]
    rset: dict[str, Series] = m["rset"]
    c_runs: dict[int, list[tuple[float, float]]] = m["c_runs"]
    sweep: dict[str, KvBench] = m["sweep"]
    dead: Series = m["dead"]
    kv_get, kv_put, kv_get_match = kv.get.best, kv.put.best, kv.get_match.best
    best_get_name = max(rget, key=lambda n: rget[n].best)
    best_set_name = max(rset, key=lambda n: rset[n].best)
    best_get, best_set = rget[best_get_name].best, rset[best_set_name].best
    plain_get, plain_set = rget["redis-py"].best, rset["redis-py"].best
    c_best = {
        depth: (max((g for g, _ in runs), default=nan), max((s for _, s in runs), default=nan))
        for depth, runs in c_runs.items()
    }
    c_get = max((g for g, _ in c_best.values()), default=nan)
    c_set = max((s for _, s in c_best.values()), default=nan)
    healthy_lat, stopped_lat = m["healthy_lat"], m["stopped_lat"]
    p99_h, p99_s = percentile(healthy_lat, 99), percentile(stopped_lat, 99)
    marked = np.array(m["stopped_marked"], bool)
    lat = np.array(stopped_lat)
    before_mark = lat[~marked] if (~marked).any() else np.array([nan])
    after_mark = lat[marked] if marked.any() else np.array([nan])
    dead_gbps, healthy_gbps = dead.best, m["healthy"].best
    tags = {
        "redis-py": "plain",
        "redis-py+hiredis": "hiredis_default",
        "redis-py+hiredis, tuned": "hiredis_tuned",
        "raw RESP socket": "raw_socket",
    }
    for name, tag in tags.items():
        figures[f"redis_get_gbps_{tag}"] = rget[name].best
        figures[f"redis_set_gbps_{tag}"] = rset[name].best
        figures[f"get_vs_redis_{tag}"] = kv_get / rget[name].best
        figures[f"put_vs_redis_{tag}"] = kv_put / rset[name].best
    figures.update(
        {
            "kvcache_get_gbps": kv_get,
            "kvcache_get_median_gbps": kv.get.median,
            "kvcache_get_with_match_gbps": kv_get_match,
            "kvcache_put_gbps": kv_put,
            "kvcache_put_median_gbps": kv.put.median,
            # The baseline: the strongest Python Redis client of this run, GET and SET apart.
            "redis_get_gbps_best_python": best_get,
            "redis_get_best_python_client": best_get_name,
            "redis_set_gbps_best_python": best_set,
            "redis_set_best_python_client": best_set_name,
            "redis_get_gbps": best_get,
            "redis_set_gbps": best_set,
            "get_vs_redis_hiredis": kv_get / best_get,
            "get_vs_redis": kv_get / best_get,
            "get_with_match_vs_redis": kv_get_match / best_get,
            "put_vs_redis": kv_put / best_set,
            "redis_benchmark_get_gbps": c_get,
            "redis_benchmark_set_gbps": c_set,
            "redis_benchmark_p64_get_gbps": c_best[64][0],
            "redis_benchmark_p64_set_gbps": c_best[64][1],
            "redis_benchmark_p16_get_gbps": c_best[16][0],
            "redis_benchmark_p16_set_gbps": c_best[16][1],
            "client_cpu_s_per_gb_load": kv.get.cpu_per_gb("client"),
            "client_cpu_s_per_gb_store": kv.put.cpu_per_gb("client"),
            "daemon_cpu_s_per_gb_get": kv.get.cpu_per_gb("server"),
            "daemon_cpu_s_per_gb_put": kv.put.cpu_per_gb("server"),
            "redis_client_cpu_s_per_gb_get": rget[best_get_name].cpu_per_gb("client"),
            "redis_client_cpu_s_per_gb_set": rset[best_set_name].cpu_per_gb("client"),
            "redis_server_cpu_s_per_gb_get": rget[best_get_name].cpu_per_gb("server"),
            "redis_server_cpu_s_per_gb_set": rset[best_set_name].cpu_per_gb("server"),
            "load_p50_healthy_ms": percentile(healthy_lat, 50),
            "load_p99_healthy_ms": p99_h,
            "load_p50_stopped_ms": percentile(stopped_lat, 50),
            "load_p99_stopped_ms": p99_s,
            "p99_stopped_vs_healthy": p99_s / p99_h,
            "stopped_loads_before_marked_down": int((~marked).sum()),
            "load_p99_stopped_before_marked_down_ms": float(np.percentile(before_mark, 99)),
            "load_p99_stopped_after_marked_down_ms": float(np.percentile(after_mark, 99)),
            "stopped_hedges": m["counters"].get("hedges", 0),
            "stopped_blocks_rebuilt": m["counters"].get("blocks_rebuilt", 0),
            "stopped_blocks_loaded": m["counters"].get("blocks_loaded", 0),
            "get_2dead_gbps": dead_gbps,
            "get_healthy_before_kill_gbps": healthy_gbps,
            "throughput_2dead_vs_healthy": dead_gbps / healthy_gbps,
            "throughput_2dead_vs_headline": dead_gbps / kv_get,
            "match_prefix_77k_ms": m["match_ms"],
            "match_prefix_77k_2dead_ms": m["match_dead_ms"],
            "wrong_bytes": m["wrong"],
            "redis_wrong_bytes": sum(m["redis_wrong"].values()),
        }
    )
    for name, b in sweep.items():
        tag = name.replace("=", "_").replace(" ", "_")
        figures[f"sweep_{tag}_get_gbps"] = b.get.best
        figures[f"sweep_{tag}_put_gbps"] = b.put.best
        figures[f"sweep_{tag}_client_cpu_s_per_gb_load"] = b.get.cpu_per_gb("client")
        figures[f"sweep_{tag}_client_cpu_s_per_gb_store"] = b.put.cpu_per_gb("client")
    if sweep:
        figures["sweep_best_load"] = max(sweep, key=lambda n: sweep[n].get.median)
        figures["sweep_best_store"] = max(sweep, key=lambda n: sweep[n].put.median)

    def ok(value: float, target: float, above: bool) -> str:
        good = value >= target if above else value <= target
        return ("met" if good else "MISSED") + f" ({'>=' if above else '<='} {target:g})"

    d, t, raw = m["batches"]
    print(f"kvcache cluster benchmark — commit {figures['commit']}, {figures['machine']}")
    print(
        f"{blocks} blocks of {P} bytes ({blocks * P / 1e6:.0f} MB), {NODES} daemons, 10+2 RS; "
        f"best of {rounds} rounds, kvcache and Redis interleaved; client: "
        f"{figures['client_settings']}"
    )
    print_table(
        "Throughput vs Redis (same blocks, same rounds; Redis = best Python client of the run)",
        ["operation", "kvcache GB/s", "Redis GB/s", "Redis client", "ratio", "figure", "target"],
        [
            ["GET / load of a matched prefix", f"{kv_get:.2f}", f"{best_get:.2f}", best_get_name,
             f"{kv_get / best_get:.2f}x", "get_vs_redis_hiredis", ok(kv_get / best_get, 1.5, True)],
            ["GET / match_prefix + load", f"{kv_get_match:.2f}", f"{best_get:.2f}", best_get_name,
             f"{kv_get_match / best_get:.2f}x", "get_with_match_vs_redis", "(reported)"],
            ["PUT / store", f"{kv_put:.2f}", f"{best_set:.2f}", best_set_name,
             f"{kv_put / best_set:.2f}x", "put_vs_redis", ok(kv_put / best_set, 1.0, True)],
            ["GET vs plain redis-py (old baseline)", f"{kv_get:.2f}", f"{plain_get:.2f}",
             "redis-py", f"{kv_get / plain_get:.2f}x", "get_vs_redis_plain", "(reported)"],
            ["PUT vs plain redis-py (old baseline)", f"{kv_put:.2f}", f"{plain_set:.2f}",
             "redis-py", f"{kv_put / plain_set:.2f}x", "put_vs_redis_plain", "(reported)"],
        ],
    )  # fmt: skip
    print_table(
        f"CPU seconds per GB over the timed rounds (client: this process"
        f"{' + I/O workers' if kv.client.io_pids else ''}; servers: the {NODES} daemons "
        "summed / redis-server)",
        ["", "kvcache client", "target", "kvcache daemons", "Redis client", "redis-server"],
        [
            ["GET / load", f"{figures['client_cpu_s_per_gb_load']:.2f}",
             ok(figures["client_cpu_s_per_gb_load"], 0.35, False),
             f"{figures['daemon_cpu_s_per_gb_get']:.2f}",
             f"{figures['redis_client_cpu_s_per_gb_get']:.2f}",
             f"{figures['redis_server_cpu_s_per_gb_get']:.2f}"],
            ["PUT / store", f"{figures['client_cpu_s_per_gb_store']:.2f}",
             ok(figures["client_cpu_s_per_gb_store"], 0.6, False),
             f"{figures['daemon_cpu_s_per_gb_put']:.2f}",
             f"{figures['redis_client_cpu_s_per_gb_set']:.2f}",
             f"{figures['redis_server_cpu_s_per_gb_set']:.2f}"],
        ],
    )  # fmt: skip
    print_table(
        "Degraded vs healthy (same run)",
        ["case", "healthy", "degraded", "ratio", "target"],
        [
            [f"p99 load latency, 1 daemon SIGSTOPped ({len(healthy_lat)} match+loads of 64 blocks)",
             f"{p99_h:.1f} ms", f"{p99_s:.1f} ms", f"{p99_s / p99_h:.2f}x",
             ok(p99_s / p99_h, 1.2, False)],
            [f"p99 of the {int((~marked).sum())} loads before the client marked it down "
             f"(timeout_s) / of the {int(marked.sum())} after",
             f"{p99_h:.1f} ms", f"{figures['load_p99_stopped_before_marked_down_ms']:.1f} / "
             f"{figures['load_p99_stopped_after_marked_down_ms']:.1f} ms",
             f"{figures['load_p99_stopped_before_marked_down_ms'] / p99_h:.2f}x / "
             f"{figures['load_p99_stopped_after_marked_down_ms'] / p99_h:.2f}x", "(reported)"],
            ["p50 of the same", f"{figures['load_p50_healthy_ms']:.1f} ms",
             f"{figures['load_p50_stopped_ms']:.1f} ms",
             f"{figures['load_p50_stopped_ms'] / figures['load_p50_healthy_ms']:.2f}x",
             "(reported)"],
            [f"load throughput, 2 daemons dead (best of {rounds} loads each, back to back)",
             f"{healthy_gbps:.2f} GB/s", f"{dead_gbps:.2f} GB/s",
             f"{dead_gbps / healthy_gbps:.2f}x", ok(dead_gbps / healthy_gbps, 0.8, True)],
            ["the same vs the headline load (best of the throughput rounds)",
             f"{kv_get:.2f} GB/s", f"{dead_gbps:.2f} GB/s", f"{dead_gbps / kv_get:.2f}x",
             "(reported)"],
        ],
    )  # fmt: skip
    print_table(
        "Prefix match",
        ["case", "time", "target"],
        [
            ["match_prefix, 77K-token prompt (150 blocks)", f"{m['match_ms']:.2f} ms",
             ok(m["match_ms"], 5.0, False)],
            ["the same, 2 daemons dead", f"{m['match_dead_ms']:.2f} ms", "(reported)"],
        ],
    )  # fmt: skip
    rows = []
    for name in rget:
        g, s = rget[name], rset[name]
        rows.append(
            [name, f"{g.best:.2f} ({g.median:.2f})", f"{s.best:.2f} ({s.median:.2f})",
             f"{g.cpu_per_gb('client'):.2f} / {s.cpu_per_gb('client'):.2f}",
             f"{g.cpu_per_gb('server'):.2f} / {s.cpu_per_gb('server'):.2f}",
             f"{kv_get / g.best:.2f}x", f"{kv_put / s.best:.2f}x"]
        )  # fmt: skip
    for depth, (cg, cs) in c_best.items():
        rows.append(
            [f"redis-benchmark -P {depth} (C client)", f"{cg:.2f}", f"{cs:.2f}", "-", "-",
             f"{kv_get / cg:.2f}x", f"{kv_put / cs:.2f}x"]
        )  # fmt: skip
    rows.append(
        ["C client ceiling (best of the above)", f"{c_get:.2f}", f"{c_set:.2f}", "-", "-",
         f"{kv_get / c_get:.2f}x", f"{kv_put / c_set:.2f}x"]
    )  # fmt: skip
    print_table(
        "Redis clients, GB/s best (median) of the same rounds",
        ["client", "GET GB/s", "SET GB/s", "client CPU s/GB get/set", "server CPU s/GB get/set",
         "kvcache GET / this", "kvcache PUT / this"],
        rows,
    )  # fmt: skip
    print(
        f"\nredis-py: pure-Python parser, 64 KiB socket reads, {d} commands per pipeline (the "
        f"old baseline); redis-py+hiredis: the same with hiredis; tuned: hiredis, 1 MiB socket "
        f"reads, {t} per pipeline; raw RESP socket: {raw} per pipeline, one sendmsg / one "
        f"recvmsg_into per pipeline into a preallocated array; redis-benchmark: -c 1 -d {P}, "
        f"GETs of the same blocks (-r {blocks} -n {8 * blocks}), SETs "
        f"(-r {blocks} -n {2 * blocks}: about half overwrites). All pipelines "
        "transaction=False; SETs of keys DELeted just before (untimed), as kvcache stores a "
        "namespace deleted after the previous round; glibc malloc tuned for this process "
        "(kvcache.memtune) before any client ran."
    )
    if sweep:
        srows = []
        for name, b in sweep.items():
            srows.append(
                [name, f"{b.get.best:.2f} ({b.get.median:.2f})",
                 f"{b.put.best:.2f} ({b.put.median:.2f})",
                 f"{b.get.cpu_per_gb('client'):.2f}", f"{b.put.cpu_per_gb('client'):.2f}",
                 f"{b.get.cpu_per_gb('server'):.2f}", f"{b.put.cpu_per_gb('server'):.2f}"]
            )  # fmt: skip
        n = len(next(iter(sweep.values())).get.seconds)
        print_table(
            f"Client settings for loads and stores (each on top of: "
            f"{figures['client_settings']}; best (median) of {n} rounds, rotating order)",
            ["setting", "load GB/s", "store GB/s", "client CPU s/GB load", "client CPU s/GB store",
             "daemon CPU s/GB get", "daemon CPU s/GB put"],
            srows,
        )  # fmt: skip
        print(
            f"\nbest by median: loads {figures['sweep_best_load']}, "
            f"stores {figures['sweep_best_store']} (reported only; the headline above uses "
            f"{figures['client_settings']})"
        )
    print(f"\nwrong bytes: {m['wrong']} (Redis clients: {figures['redis_wrong_bytes']})")
    targets = [
        ("get_vs_redis_hiredis", ">=", 1.5, "kvcache GET / best Python Redis GET"),
        ("put_vs_redis", ">=", 1.0, "kvcache PUT / best Python Redis SET"),
        ("client_cpu_s_per_gb_load", "<=", 0.35, "client CPU s/GB, loads"),
        ("client_cpu_s_per_gb_store", "<=", 0.6, "client CPU s/GB, stores"),
        ("p99_stopped_vs_healthy", "<=", 1.2, "p99 load latency, 1 daemon stopped / healthy"),
        ("throughput_2dead_vs_healthy", ">=", 0.8, "load GB/s, 2 daemons dead / healthy"),
        ("match_prefix_77k_ms", "<=", 5.0, "match_prefix of 77K tokens, ms"),
        ("wrong_bytes", "<=", 0, "wrong bytes returned"),
    ]
    met = {
        name: figures[name] >= goal if op == ">=" else figures[name] <= goal
        for name, op, goal, _ in targets
    }
    figures["targets_met"] = sum(met.values())
    figures["targets_missed"] = ", ".join(n for n, ok_ in met.items() if not ok_)
    print_table(
        f"Targets: {sum(met.values())} of {len(targets)} met",
        ["figure", "what", "value", "target", ""],
        [
            [name, what, f"{figures[name]:.3g}", f"{op} {goal:g}", "met" if met[name] else "MISSED"]
            for name, op, goal, what in targets
        ],
    )
    write_json(args.json, figures)


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
