"""Storage-daemon throughput against raw pyzmq on the same machine, in the same run.

One client, batched. A batch is ``--batch`` shards of 11,520-byte bodies
(112 KiB blocks cut in 10, rounded to 64) plus their 104-byte headers.

* raw_*: a DEALER/ROUTER pair moving the same bytes (a ROUTER subprocess that
  answers GETs with a ready-made frame of the batch's size and PUTs with 1 byte).
* get/put: a real ``kvcache server`` subprocess (LMDB, retention, checks); the
  client encodes every request and decodes and checks every reply.
  ``put`` is measured in steady state: the node is full and evicts as it
  writes, so LMDB reuses its freed pages; ``put_fresh`` is the first fill, where
  every page is new to the file (bounded by the file system's append speed).
* hmac_*: the same through a daemon with ``data_auth`` (HMAC-SHA256 both ways),
  window 1 only.

Every figure is measured per *window*: the number of requests the client keeps
in flight on its one socket (``_w1``: strict request/reply; ``_w2``: two, as a
cluster client with several operations outstanding per node has). Raw and
daemon are always compared at the same window, and their timed rounds are
interleaved in chunks (raw, daemon, raw, daemon, ...) so that load from other
processes on the machine falls on both alike. The headline ratios
``get_vs_raw_zmq`` and ``put_vs_raw_zmq`` are the window-1 ones.

The raw peer and the daemon run with the malloc and BLAS settings of
``kvcache.client.localcluster.DAEMON_ENV``, as deployed daemons do; the client
process applies the same malloc settings (``tune_malloc``), like the real client.

Usage: ``python bench/server.py [--quick] [--json PATH] [--windows 1,2] [--no-hmac]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import zmq

from kvcache.client.localcluster import DAEMON_ENV
from kvcache.memtune import tune_malloc
from kvcache.server.probe import fake_shard
from kvcache.wire import Frame, Header, Limits, Op, Status, decode, encode, make_items

BODY = 11_520
RECORD = BODY + 104
TOKEN = "bench-token-0123456789"
#: Timed rounds are split in this many chunks, alternating raw and daemon.
CHUNKS = 4

Batch = tuple[np.ndarray, bytes, np.ndarray]


def raw_server(port_file: str, reply_bytes: int) -> None:
    """The baseline peer: answer any 1-frame request with ``reply_bytes``, any other with 1 byte."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file).write_text(str(port))
    payload = zmq.Frame(os.urandom(reply_bytes))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"quit":
            sock.send_multipart([frames[0], b"bye"])
            return
        reply = payload if len(frames) == 2 else b"k"
        sock.send_multipart([frames[0], reply], copy=False)


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r} did not start")
        time.sleep(0.02)
    return path.read_text()


def _env() -> dict[str, str]:
    return {**os.environ, **DAEMON_ENV}


def _dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.setsockopt(zmq.MAXMSGSIZE, Limits().max_frame_bytes)
    sock.connect(endpoint)
    return sock


def start_daemon(root: Path, capacity: int, *, token: bool) -> tuple[subprocess.Popen[bytes], str]:
    config = root / "node.toml"
    lines = ["[server]", 'node_id = "bench"', f"capacity_bytes = {capacity}", 'sync = "periodic"']
    if token:
        lines += [f'token = "{TOKEN}"', "data_auth = true"]
    config.write_text("\n".join(lines) + "\n")
    ready = root / "ready.json"
    cmd = [sys.executable, "-m", "kvcache.cli", "--log-level", "WARNING", "server"]
    cmd += ["--config", str(config), "--data-dir", str(root / "data")]
    cmd += ["--listen", "tcp://127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
    cmd += ["--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, env=_env())
    return proc, json.loads(_wait_file(ready, proc))["data"]


def make_batches(count: int, batch: int, seed: int) -> list[Batch]:
    """(PUT items, PUT data, GET items) for ``count`` batches of fresh keys."""
    rng = np.random.default_rng(seed)
    body = rng.integers(0, 256, BODY, dtype=np.uint8).tobytes()
    out = []
    for _ in range(count):
        keys = [rng.bytes(16) for _ in range(batch // 12 + 1)]
        shards = [(keys[n // 12], n % 12) for n in range(batch)]
        records = [fake_shard(k, i, body, traffic_class="chat") for k, i in shards]
        put = make_items(Op.PUT, batch, reply=False)
        put["key"] = [k for k, _ in shards]
        put["index"] = [i for _, i in shards]
        put["length"] = RECORD
        get = make_items(Op.GET, batch, reply=False)
        get["key"] = put["key"]
        get["index"] = put["index"]
        out.append((put, b"".join(records), get))
    return out


class Timing:
    """Elapsed time and per-request latencies summed over the chunks of one figure."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rounds = 0
        self.latencies: list[float] = []

    def gbps(self, batch_bytes: int) -> float:
        return self.rounds * batch_bytes / self.seconds / 1e9

    def pct_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1e3)


def pipelined(
    send: Callable[[int], None],
    recv: Callable[[int], None],
    rounds: range,
    window: int,
    timing: Timing | None = None,
) -> None:
    """Requests ``rounds`` with up to ``window`` in flight on one socket (replies come in order)."""
    timing = timing if timing is not None else Timing()
    in_flight: collections.deque[tuple[int, float]] = collections.deque()
    start = time.perf_counter()
    for i in rounds:
        if len(in_flight) == window:
            j, sent = in_flight.popleft()
            recv(j)
            timing.latencies.append(time.perf_counter() - sent)
        in_flight.append((i, time.perf_counter()))
        send(i)
    while in_flight:
        j, sent = in_flight.popleft()
        recv(j)
        timing.latencies.append(time.perf_counter() - sent)
    timing.seconds += time.perf_counter() - start
    timing.rounds += len(rounds)


class RawPeer:
    """The raw DEALER/ROUTER baseline: a subprocess peer and this process's socket."""

    def __init__(self, ctx: zmq.Context[Any], tmp: Path, batch_bytes: int) -> None:
        port_file = tmp / "raw-port"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-server", str(port_file), str(batch_bytes)],
            env=_env(),
        )
        self.sock = _dealer(ctx, f"tcp://127.0.0.1:{_wait_file(port_file, self.proc)}")
        self.payload = zmq.Frame(os.urandom(batch_bytes))
        self.small = b"x" * 64
        for _ in range(10):
            self.get_send(0)
            self.recv(0)
            self.put_send(0)
            self.recv(0)

    def get_send(self, _: int) -> None:
        self.sock.send(b"g")

    def put_send(self, _: int) -> None:
        self.sock.send_multipart([self.small, self.small, self.payload], copy=False)

    def recv(self, _: int) -> None:
        self.sock.recv(copy=False)

    def close(self) -> None:
        self.sock.send(b"quit")
        self.sock.recv()
        self.sock.close()
        self.proc.wait(10)


class DaemonClient:
    """Encodes requests and decodes and checks replies, like a real client does."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, *, token: bytes | None) -> None:
        self.sock = _dealer(ctx, endpoint)
        self.token = token
        self.ids = iter(range(1, 1 << 62))
        self.sent: collections.deque[tuple[Op, int]] = collections.deque()

    def send(self, op: Op, items: np.ndarray, data: bytes = b"") -> None:
        request_id = next(self.ids)
        header = Header(op=op, request_id=request_id, count=len(items))
        self.sock.send_multipart(encode(header, items, data, token=self.token), copy=False)
        self.sent.append((op, request_id))

    def recv(self) -> None:
        op, request_id = self.sent.popleft()
        frames = cast(list[Frame], self.sock.recv_multipart(copy=False))  # zmq.Frame: buffers
        reply = decode(frames, token=self.token)
        if reply.header.request_id != request_id or reply.header.status != Status.OK:
            raise RuntimeError(
                f"{op.name}#{request_id} failed: {reply.header.status!r} {reply.error_text()}"
            )
        if reply.items["status"].any():
            raise RuntimeError(f"{op.name}#{request_id}: items failed {reply.items['status']}")

    def close(self) -> None:
        self.sock.close()


def interleaved(
    raw: Callable[[range, Timing], None],
    daemon: Callable[[range, Timing], None],
    raw_rounds: int,
    daemon_rounds: int,
) -> tuple[Timing, Timing]:
    """Run raw and daemon rounds in alternating chunks; their summed timings."""
    raw_t, daemon_t = Timing(), Timing()
    for c in range(CHUNKS):
        raw(range(raw_rounds * c // CHUNKS, raw_rounds * (c + 1) // CHUNKS), raw_t)
        daemon(range(daemon_rounds * c // CHUNKS, daemon_rounds * (c + 1) // CHUNKS), daemon_t)
    return raw_t, daemon_t


def bench_window(
    ctx: zmq.Context[Any],
    raw: RawPeer,
    batches: list[Batch],
    capacity: int,
    get_rounds: int,
    window: int,
    *,
    token: bool = False,
    prefix: str = "",
) -> dict[str, float]:
    """Fresh fill, steady PUT and GET through one new daemon at ``window``, raw alongside."""
    sfx = f"_w{window}"
    batch_bytes = len(batches[0][1])
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVCACHE_BENCH_DIR")) as tmp:
        proc, endpoint = start_daemon(Path(tmp), capacity, token=token)
        client = DaemonClient(ctx, endpoint, token=TOKEN.encode() if token else None)
        try:
            fill = max(1, capacity // batch_bytes)  # batches that fill the node once
            fresh_rounds = min(fill, len(batches))
            steady_rounds = len(batches) - fresh_rounds

            def put_send(i: int) -> None:
                items, data, _ = batches[i % len(batches)]
                client.send(Op.PUT, items, data)

            def recv(_: int) -> None:
                client.recv()

            fresh = Timing()
            pipelined(put_send, recv, range(fresh_rounds), window, fresh)

            def daemon_put(r: range, t: Timing) -> None:
                steady = range(fresh_rounds + r.start, fresh_rounds + r.stop)
                pipelined(put_send, recv, steady, window, t)

            def raw_put(r: range, t: Timing) -> None:
                pipelined(raw.put_send, raw.recv, r, window, t)

            raw_put_t, put_t = interleaved(raw_put, daemon_put, steady_rounds, steady_rounds)

            resident = batches[-max(1, fill // 2) :]

            def get_send(i: int) -> None:
                client.send(Op.GET, resident[i % len(resident)][2])

            pipelined(get_send, recv, range(5), window)

            def daemon_get(r: range, t: Timing) -> None:
                pipelined(get_send, recv, r, window, t)

            def raw_get(r: range, t: Timing) -> None:
                pipelined(raw.get_send, raw.recv, r, window, t)

            raw_get_t, get_t = interleaved(raw_get, daemon_get, get_rounds, get_rounds)
        finally:
            client.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    out = {
        f"raw_get_gbps{sfx}": raw_get_t.gbps(batch_bytes),
        f"raw_put_gbps{sfx}": raw_put_t.gbps(batch_bytes),
        f"{prefix}get_gbps{sfx}": get_t.gbps(batch_bytes),
        f"{prefix}get_p50_ms{sfx}": get_t.pct_ms(50),
        f"{prefix}get_p99_ms{sfx}": get_t.pct_ms(99),
        f"{prefix}put_fresh_gbps{sfx}": fresh.gbps(batch_bytes),
        f"{prefix}put_gbps{sfx}": put_t.gbps(batch_bytes),
        f"{prefix}put_p50_ms{sfx}": put_t.pct_ms(50),
        f"{prefix}put_p99_ms{sfx}": put_t.pct_ms(99),
    }
    if prefix:  # the raw figures belong to the plain run of this window
        out = {k: v for k, v in out.items() if not k.startswith("raw_")}
    else:
        out[f"get_vs_raw_zmq{sfx}"] = get_t.gbps(batch_bytes) / raw_get_t.gbps(batch_bytes)
        out[f"put_vs_raw_zmq{sfx}"] = put_t.gbps(batch_bytes) / raw_put_t.gbps(batch_bytes)
        out[f"put_fresh_vs_raw_zmq{sfx}"] = fresh.gbps(batch_bytes) / raw_put_t.gbps(batch_bytes)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (well under 60 s)")
    parser.add_argument("--json", type=Path, help="write every figure as a flat JSON object")
    parser.add_argument("--batch", type=int, default=128, help="shards per request")
    parser.add_argument(
        "--windows", default="1,2", help="requests in flight per socket, comma-separated"
    )
    parser.add_argument("--no-hmac", action="store_true", help="skip the data_auth daemon")
    parser.add_argument("--raw-server", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        raw_server(args.raw_server[0], int(args.raw_server[1]))
        return 0
    tune_malloc()  # what the real client does; the same for raw and daemon rounds
    windows = [int(w) for w in args.windows.split(",")]
    capacity = (128 << 20) if args.quick else (512 << 20)
    batch_bytes = args.batch * RECORD
    fill = capacity // batch_bytes
    batches = make_batches(int(fill * 2.5), args.batch, seed=1)
    rounds = 300 if args.quick else 1500
    figures: dict[str, float] = {"batch_shards": args.batch, "batch_bytes": batch_bytes}
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        raw = RawPeer(ctx, Path(tmp), batch_bytes)
        try:
            for window in windows:
                figures |= bench_window(ctx, raw, batches, capacity, rounds, window)
            if not args.no_hmac and 1 in windows:
                hmac_batches = batches[: int(fill * 1.5)]
                figures |= bench_window(
                    ctx, raw, hmac_batches, capacity, rounds // 2, 1, token=True, prefix="hmac_"
                )
                figures["get_hmac_vs_plain"] = figures["hmac_get_gbps_w1"] / figures["get_gbps_w1"]
                figures["put_hmac_vs_plain"] = figures["hmac_put_gbps_w1"] / figures["put_gbps_w1"]
        finally:
            raw.close()
    ctx.term()
    if 1 in windows:
        figures["get_vs_raw_zmq"] = figures["get_vs_raw_zmq_w1"]
        figures["put_vs_raw_zmq"] = figures["put_vs_raw_zmq_w1"]
        figures["put_fresh_vs_raw_zmq"] = figures["put_fresh_vs_raw_zmq_w1"]
    width = max(map(len, figures))
    for name, value in figures.items():
        print(
            f"{name:<{width}}  {value:.3f}"
            if isinstance(value, float)
            else f"{name:<{width}}  {value}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
