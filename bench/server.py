"""Storage-daemon throughput against raw pyzmq on the same machine, in the same run.

One client, batched, request/reply. A batch is ``--batch`` shards of 11,520-byte
bodies (112 KiB blocks cut in 10, rounded to 64) plus their 104-byte headers.

* raw_*: a DEALER/ROUTER pair moving the same bytes (a ROUTER subprocess that
  answers GETs with a ready-made frame of the batch's size and PUTs with 1 byte).
* get/put: a real ``kvcache server`` subprocess (LMDB, retention, checks).
  ``put`` is measured in steady state: the node is full and evicts as it
  writes, so LMDB reuses its freed pages; ``put_fresh`` is the first fill, where
  every page is new to the file (bounded by the file system's append speed).
* *_hmac: the same through a daemon with ``data_auth`` (HMAC-SHA256 both ways).

Usage: ``python bench/server.py [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvcache.server.probe import Probe, fake_shard
from kvcache.wire import Op, Status, make_items

BODY = 11_520
RECORD = BODY + 104
TOKEN = "bench-token-0123456789"


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
            raise RuntimeError(f"{proc.args} did not start")
        time.sleep(0.02)
    return path.read_text()


def _env() -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1"}


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


def make_batches(count: int, batch: int, seed: int) -> list[tuple[np.ndarray, bytes, np.ndarray]]:
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


def timed(fn: Any, rounds: int) -> tuple[float, list[float]]:
    lat = []
    start = time.perf_counter()
    for i in range(rounds):
        t = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - start, lat


def bench_raw(batch_bytes: int, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-server", str(port_file), str(batch_bytes)], env=_env()
        )
        port = _wait_file(port_file, proc)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        payload = zmq.Frame(os.urandom(batch_bytes))
        small = b"x" * 64

        def get(_: int) -> None:
            sock.send(b"g")
            sock.recv(copy=False)

        def put(_: int) -> None:
            sock.send_multipart([small, small, payload], copy=False)
            sock.recv(copy=False)

        for _ in range(10):
            get(0)
            put(0)
        get_s, _ = timed(get, rounds)
        put_s, _ = timed(put, rounds)
        sock.send(b"quit")
        sock.recv()
        sock.close()
        ctx.term()
        proc.wait(10)
    return {
        "raw_get_gbps": rounds * batch_bytes / get_s / 1e9,
        "raw_put_gbps": rounds * batch_bytes / put_s / 1e9,
    }


def bench_daemon(
    batches: list[tuple[np.ndarray, bytes, np.ndarray]],
    capacity: int,
    get_rounds: int,
    *,
    token: bool,
    prefix: str,
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVCACHE_BENCH_DIR")) as tmp:
        proc, endpoint = start_daemon(Path(tmp), capacity, token=token)
        try:
            probe = Probe(endpoint, token=TOKEN.encode() if token else None, timeout_s=60)
            batch_bytes = len(batches[0][1])
            fill = max(1, capacity // batch_bytes)  # batches that fill the node once

            def put(i: int) -> None:
                items, data, _ = batches[i % len(batches)]
                reply = probe.request(Op.PUT, items, data)
                if reply.header.status != Status.OK or reply.items["status"].any():
                    raise RuntimeError(f"PUT failed: {reply.header.status} {reply.error_text()}")

            fresh_rounds = min(fill, len(batches))
            fresh_s, _ = timed(put, fresh_rounds)
            steady_rounds = len(batches) - fresh_rounds
            steady_s, put_lat = timed(lambda i: put(i + fresh_rounds), steady_rounds)
            resident = batches[-max(1, fill // 2) :]

            def get(i: int) -> None:
                _, _, items = resident[i % len(resident)]
                reply = probe.request(Op.GET, items)
                if reply.header.status != Status.OK or reply.items["status"].any():
                    raise RuntimeError(f"GET failed: {reply.header.status}")

            for i in range(5):
                get(i)
            get_s, get_lat = timed(get, get_rounds)
            probe.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    out = {
        f"{prefix}get_gbps": get_rounds * batch_bytes / get_s / 1e9,
        f"{prefix}get_p50_ms": float(np.percentile(get_lat, 50) * 1e3),
        f"{prefix}get_p99_ms": float(np.percentile(get_lat, 99) * 1e3),
        f"{prefix}put_fresh_gbps": fresh_rounds * batch_bytes / fresh_s / 1e9,
    }
    if steady_rounds:
        out[f"{prefix}put_gbps"] = steady_rounds * batch_bytes / steady_s / 1e9
        out[f"{prefix}put_p50_ms"] = float(np.percentile(put_lat, 50) * 1e3)
        out[f"{prefix}put_p99_ms"] = float(np.percentile(put_lat, 99) * 1e3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (well under 60 s)")
    parser.add_argument("--json", type=Path, help="write every figure as a flat JSON object")
    parser.add_argument("--batch", type=int, default=128, help="shards per request")
    parser.add_argument("--raw-server", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        raw_server(args.raw_server[0], int(args.raw_server[1]))
        return 0
    capacity = (128 << 20) if args.quick else (512 << 20)
    batch_bytes = args.batch * RECORD
    fill = capacity // batch_bytes
    batches = make_batches(int(fill * 2.5), args.batch, seed=1)
    rounds = 300 if args.quick else 1500
    figures: dict[str, float] = {"batch_shards": args.batch, "batch_bytes": batch_bytes}
    figures |= bench_raw(batch_bytes, rounds)
    figures |= bench_daemon(batches, capacity, rounds, token=False, prefix="")
    hmac_batches = batches[: int(fill * 1.5)]
    figures |= bench_daemon(hmac_batches, capacity, rounds // 2, token=True, prefix="hmac_")
    figures["get_vs_raw_zmq"] = figures["get_gbps"] / figures["raw_get_gbps"]
    figures["put_vs_raw_zmq"] = figures["put_gbps"] / figures["raw_put_gbps"]
    figures["put_fresh_vs_raw_zmq"] = figures["put_fresh_gbps"] / figures["raw_put_gbps"]
    figures["get_hmac_vs_plain"] = figures["hmac_get_gbps"] / figures["get_gbps"]
    figures["put_hmac_vs_plain"] = figures["hmac_put_gbps"] / figures["put_gbps"]
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
