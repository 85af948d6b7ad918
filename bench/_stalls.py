"""Availability figures of bench/reliability.py (issue 18): stalls, floods and restarts.

Each function takes a running 12-daemon LocalCluster whose credentials hold the
tenants ``default`` and ``alice``, and returns its figures:

- ``stalled_put_victim_p99_ratio``: alice's load p99 while tenant ``default`` holds
  5 half-sent 256 MiB PUTs on every daemon, over her p99 without them. The loads with
  and without alternate in chunks (the stalled PUTs opened before each such chunk and
  closed after it), so that a hiccup of the host lands in either as likely;
- ``preauth_flood_new_conn_success``: the fraction of new authenticated connections
  that succeed while 1,100 connections that never authenticate are held (and reopened
  as the daemon closes them) on the same daemon;
- ``restarted_node_lost_loads``: loads short of their prompt after a daemon was killed
  (kill -9) and started again, each daemon in turn;
- ``rolling_restart_lost_loads``: loads short of their prompt while every daemon is
  stopped (SIGTERM) and started again, one at a time, under a steady load;
- ``stopped_holders_store_written`` / ``stopped_holders_store_s``: two daemons stopped
  (SIGSTOP: connections up, nothing answered) before the client knows, the fraction of a
  64-block store's blocks written and its seconds (the client's timeout is 5 s); then the
  seconds of a store of 64 blocks whose first half is stored (``stopped_holders_restore_s``)
  and whether everything loads.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
import threading
import time
from typing import Any

import numpy as np

from kvcache.client import Client
from kvcache.server.probe import Probe
from kvcache.testing.localcluster import LocalCluster
from kvcache.wire import Header, Op, make_items, parse_endpoint

P = 114_688
MiB = 1 << 20


def _stored(client: Client, blocks: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(blocks)]
    src = rng.integers(0, 256, (blocks, P), dtype=np.uint8)
    written = client.store_keys(keys, src, payload_len=P).written
    if written != blocks:
        raise RuntimeError(f"store wrote {written} of {blocks} blocks")
    return keys, src


def _load_ok(client: Client, keys: list[bytes], src: np.ndarray, out: np.ndarray) -> bool:
    out[:] = 0
    got = client.load_keys(client.match_keys(keys), payload_len=P, out=out)
    return got.blocks == len(keys) and bool(np.array_equal(out, src))


def _load_times(client: Client, keys: list[bytes], out: np.ndarray, loads: int) -> list[float]:
    times = []
    for _ in range(loads):
        t = time.perf_counter()
        client.load_keys(client.match_keys(keys), payload_len=P, out=out)
        times.append(time.perf_counter() - t)
    return times


def _stall_every_daemon(cluster: LocalCluster, secret: bytes, per_daemon: int = 5) -> list[Probe]:
    """``per_daemon`` PUTs of 256 MiB on every daemon, each sent up to 1,000 bytes of its
    data and left there (their connections stay open until closed)."""
    probes: list[Probe] = []
    try:
        for node in cluster.nodes:
            for _ in range(per_daemon):
                probe = Probe(node.data, tenant="default", secret=secret)
                probes.append(probe)
                items = make_items(Op.PUT, 1, reply=False)
                items["length"] = 256 * MiB
                header = Header(op=Op.PUT, request_id=1, count=1, data_len=256 * MiB)
                probe.send_raw(header.pack() + items.tobytes() + b"\0" * 1000)
    except BaseException:
        for probe in probes:
            probe.close()
        raise
    return probes


def stalled_puts(cluster: LocalCluster, loads: int = 200, chunks: int = 5) -> dict[str, Any]:
    """Alice's ``loads`` loads with stalled PUTs held and ``loads`` without, in ``chunks``
    alternating chunks of each."""
    creds = cluster.credentials()
    attacker = creds.tenant("default")
    assert attacker is not None
    calm_s: list[float] = []
    stalled_s: list[float] = []
    ok = True
    per_chunk = max(1, loads // chunks)
    with Client(cluster.client_config(tenant="alice")) as victim:
        keys, src = _stored(victim, 16, 11)
        out = np.empty_like(src)
        _load_times(victim, keys, out, 10)  # warm up
        for _ in range(chunks):
            calm_s += _load_times(victim, keys, out, per_chunk)
            probes = _stall_every_daemon(cluster, attacker.secret)
            try:
                stalled_s += _load_times(victim, keys, out, per_chunk)
                ok = _load_ok(victim, keys, src, out) and ok
            finally:
                for probe in probes:
                    probe.close()
    calm, stalled = (float(np.percentile(t, 99)) for t in (calm_s, stalled_s))
    return {
        "stalled_put_victim_p99_ms": stalled * 1000,
        "calm_victim_p99_ms": calm * 1000,
        "stalled_put_victim_p99_ratio": stalled / calm,
        "stalled_put_victim_load_whole": int(ok),
        "stalled_put_victim_loads": len(stalled_s),
    }


def preauth_flood(cluster: LocalCluster, held: int = 1100, attempts: int = 200) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, held + 4096)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    node = cluster.nodes[0]
    host, port = parse_endpoint(node.data)
    alice = cluster.credentials().tenant("alice")
    assert alice is not None
    stop = threading.Event()
    flood: list[socket.socket] = []
    reopened = 0

    def open_one() -> socket.socket:
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect((host, port))
        return s

    def keep_flooding() -> None:
        nonlocal reopened
        while not stop.is_set():
            for i, s in enumerate(flood):
                if stop.is_set():
                    return
                try:
                    if s.recv(4096, socket.MSG_DONTWAIT) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno == errno.ENOTCONN:
                        continue
                s.close()
                flood[i] = open_one()
                reopened += 1
            stop.wait(0.01)

    for _ in range(held):
        flood.append(open_one())
    flooder = threading.Thread(target=keep_flooding, daemon=True)
    flooder.start()
    ok = 0
    try:
        for _ in range(attempts):
            try:
                with Probe(node.data, tenant="alice", secret=alice.secret, timeout_s=5.0) as p:
                    p.stats()
                ok += 1
            except Exception:  # any failure counts as not succeeded
                pass
    finally:
        stop.set()
        flooder.join(timeout=10)
        for s in flood:
            s.close()
    return {
        "preauth_flood_new_conn_success": ok / attempts,
        "preauth_flood_held": held,
        "preauth_flood_reopened": reopened,
    }


def restarts(cluster: LocalCluster, loads_per_node: int = 45) -> dict[str, Any]:
    with Client(cluster.client_config(tenant="alice")) as client:
        keys, src = _stored(client, 16, 12)
        out = np.empty_like(src)
        lost = loads = 0
        for i in range(len(cluster.nodes)):
            cluster.kill(i)
            cluster.restart(i)
            for _ in range(loads_per_node):
                loads += 1
                lost += not _load_ok(client, keys, src, out)
        restarted = {"restarted_node_lost_loads": lost, "restarted_node_loads": loads}

        stop = threading.Event()
        rolling = {"loads": 0, "lost": 0}
        stores_failed = 0

        def load_forever() -> None:
            mine = np.empty_like(src)
            while not stop.is_set():
                rolling["loads"] += 1
                rolling["lost"] += not _load_ok(client, keys, src, mine)

        reader = threading.Thread(target=load_forever)
        reader.start()
        try:
            for i in range(len(cluster.nodes)):
                cluster.terminate(i)
                fresh = [os.urandom(16) for _ in range(4)]
                stores_failed += client.store_keys(fresh, src[:4], payload_len=P).written != 4
                cluster.restart(i)
            # At least 500 loads in all: go on loading while the cluster is whole again.
            deadline = time.monotonic() + 120
            while rolling["loads"] < 500 and time.monotonic() < deadline:
                stop.wait(0.1)
        finally:
            stop.set()
            reader.join(timeout=60)
    return {
        **restarted,
        "rolling_restart_lost_loads": rolling["lost"],
        "rolling_restart_loads": rolling["loads"],
        "rolling_restart_lost_stores": stores_failed,
    }


def stopped_holders(cluster: LocalCluster) -> dict[str, Any]:
    """Stores while daemons hang (see the module docstring); each paused daemon is resumed."""
    timeout_s = 5.0
    config = cluster.client_config(tenant="alice", timeout_s=timeout_s)
    out: dict[str, Any] = {"stopped_holders_timeout_s": timeout_s}
    with Client(config) as client:
        _stored(client, 4, 31)  # connections up, as in a client that has been working
        rng = np.random.default_rng(32)
        keys = [rng.bytes(16) for _ in range(64)]
        src = rng.integers(0, 256, (64, P), dtype=np.uint8)
        cluster.pause(3)
        cluster.pause(7)
        try:
            started = time.monotonic()
            written = client.store_keys(keys, src, payload_len=P).written
            out["stopped_holders_store_s"] = time.monotonic() - started
            out["stopped_holders_store_written"] = written / len(keys)
            loaded = _load_ok(client, keys, src, np.empty_like(src))
        finally:
            cluster.resume(3)
            cluster.resume(7)
        again = [rng.bytes(16) for _ in range(64)]
        assert client.store_keys(again[:32], src[:32], payload_len=P).written == 32
        cluster.pause(5)
        cluster.pause(9)
        try:
            started = time.monotonic()
            result = client.store_keys(again, src, payload_len=P)
            out["stopped_holders_restore_s"] = time.monotonic() - started
            loaded = loaded and result.written + result.touched == 64
            loaded = loaded and _load_ok(client, again, src, np.empty_like(src))
        finally:
            cluster.resume(5)
            cluster.resume(9)
    out["stopped_holders_all_loaded"] = int(loaded)
    return out
