"""Where DeepSeek V4.1's SWA fetch spends its time, against a raw socket transfer: a probe.

``bench/swa.py`` gives the figure (``swa_fetch_dsv41_vs_raw``); this says where the
difference goes. One peer process serves V4.1's 2,801,664-byte state three ways: the raw
server of ``bench/swa.py`` (one request byte, ``sendall``), the worker's ``PeerServer``,
and a blocking thread per connection that answers with ``PeerServer.answer`` (what the
selector loop costs). This process times, alternating in chunks of 20:

* ``raw``: ``bench/swa.py``'s raw transfer;
* ``raw_hashed``: the raw server, received with ``native.recv_hashed`` in the fetch's
  pieces (what the digest costs the receiver), and ``raw_hashed_512k`` in 512 KiB pieces;
* ``fetch``: ``TcpPeerTransport.fetch`` into the caller's buffer, against ``PeerServer``;
* ``fetch_blocking_server``: the same fetch against the thread-per-connection server.

For each ``fetch`` it also records a timeline: stamps on CLOCK_MONOTONIC (shared by both
processes) taken by wrappers around the client's and the peer's own functions (the client's
connection checkout, bound, request, request send, reply header and data; the peer's
selector wake-up, request handling and send), and prints each phase's median. The wrappers
cost a little themselves, so the fetch here runs a few microseconds slower than in
``bench/swa.py``.

Usage: python bench/swa_timeline.py [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import swa
from _common import commit, machine, print_table, write_json
from swa import DSV41, DSV41_STATE_BYTES, INCARNATION, blob, key

from kvcache import native
from kvcache.credentials import TenantCredentials
from kvcache.session import AUTH_BYTES, ServerHandshake
from kvcache.swa_local import SwaStore, TcpPeerTransport, Wanted, state_digest
from kvcache.swa_local import fetch as fetch_module
from kvcache.swa_local import server as server_module
from kvcache.swa_local.state import STATE_DIGEST_TAG
from kvcache.wire import Limits, MessageReader

ns = time.monotonic_ns

#: Client phases (stamp, stamp) and their names, in order.
CLIENT_PHASES = (
    ("start", "checkout0", "fetch() to connection checkout"),
    ("checkout0", "checkout1", "connection checkout"),
    ("checkout1", "bound0", "checkout to bound"),
    ("bound0", "bound1", "arming the deadline bound"),
    ("bound1", "request0", "bound to request"),
    ("request0", "request1", "building the request"),
    ("request1", "send0", "request to its send"),
    ("send0", "send1", "sending the request"),
    ("header", "data0", "reply header to data receive"),
    ("data0", "end", "data received and hashed"),
)
#: Peer phases, from its stamps.
PEER_PHASES = (
    ("wake", "_read0", "selector wake-up to read"),
    ("_read0", "_answer_whole_get0", "receiving the request"),
    ("_answer_whole_get0", "_answer_get0", "checking its header"),
    ("_answer_get0", "_answer_get1", "looking the state up, building the reply"),
    ("_answer_get1", "send", "reply to its send"),
)


def _serve_blocking(listener: socket.socket, server: server_module.PeerServer) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_blocking_conn, args=(conn, server), daemon=True).start()


def _blocking_conn(conn: socket.socket, server: server_module.PeerServer) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    handshake = ServerHandshake(lambda name: server.tenant if name == server.tenant.name else None)
    conn.sendall(handshake.hello())
    auth = b""
    while len(auth) < AUTH_BYTES:
        auth += conn.recv(AUTH_BYTES - len(auth))
    conn.sendall(handshake.answer(auth)[0])
    reader = MessageReader(limits=Limits())
    while True:
        message = reader.next_message()
        if message is None:
            got = conn.recv_into(reader.recv_buffer())
            if not got:
                return
            reader.commit(got)
            continue
        conn.sendmsg([memoryview(frame).cast("B") for frame in server.answer(message)])


def _stamped(stamps: list[tuple[str, int]], name: str, fn: Callable[..., Any]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stamps.append((name + "0", ns()))
        result = fn(*args, **kwargs)
        stamps.append((name + "1", ns()))
        return result

    return wrapper


def peer_main() -> None:
    """Serve the state three ways; on stdin EOF, write the stamps and quit."""
    secret = bytes.fromhex(os.environ["KVCACHE_BENCH_SECRET"])
    store = SwaStore(max_bytes=2 * DSV41_STATE_BYTES)
    store.put(key(DSV41), blob(DSV41))
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=swa.raw_serve, args=(raw, blob(DSV41)), daemon=True).start()
    tenant = TenantCredentials(name="default", secret=secret)
    server = server_module.PeerServer(store, tenant=tenant, incarnation=INCARNATION)
    stamps: list[tuple[str, int]] = []
    selector = server._selector
    select = selector.select

    def stamped_select(timeout: float | None = None) -> Any:
        ready = select(timeout)
        if any(k.data is not None for k, _ in ready):  # a connection's event
            stamps.append(("wake", ns()))
        return ready

    selector.select = stamped_select  # type: ignore[method-assign]
    flush = server_module.SendQueue.flush

    def stamped_flush(self: server_module.SendQueue, sock: socket.socket) -> int:
        started = ns()
        sent = flush(self, sock)
        if sent:
            stamps.append(("send", started))
            stamps.append(("sent", ns()))
        return sent

    server_module.SendQueue.flush = stamped_flush  # type: ignore[method-assign]
    for name in ("_read", "_answer_whole_get", "_answer_get"):
        setattr(server, name, _stamped(stamps, name, getattr(server, name)))
    endpoint = server.start()
    blocking = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve_blocking, args=(blocking, server), daemon=True).start()
    print(endpoint, raw.getsockname()[1], blocking.getsockname()[1], flush=True)
    sys.stdin.read()
    Path(os.environ["KVCACHE_BENCH_STAMPS"]).write_text(json.dumps(stamps))
    os._exit(0)


def main() -> None:
    if sys.argv[1:] == ["--peer"]:
        peer_main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15, help="chunks of 20 per path")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    secret = secrets.token_bytes(32)
    stamp_file = Path(f"/tmp/kvcache-swa-timeline-{os.getpid()}.json")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--peer"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "KVCACHE_BENCH_SECRET": secret.hex(),
            "KVCACHE_BENCH_STAMPS": str(stamp_file),
        },
    )
    assert proc.stdin is not None and proc.stdout is not None
    endpoint, raw_port, blocking_port = proc.stdout.readline().split()
    raw = socket.create_connection(("127.0.0.1", int(raw_port)))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(DSV41_STATE_BYTES))
    digest = state_digest(blob(DSV41))

    def raw_get() -> None:
        raw.sendall(b"g")
        got = 0
        while got < DSV41_STATE_BYTES:
            got += raw.recv_into(buf[got:])

    def raw_hashed(piece: int) -> Callable[[], None]:
        def run() -> None:
            raw.sendall(b"g")
            status, _, got = native.recv_hashed(
                raw.fileno(), buf, piece=piece, deadline=time.monotonic() + 5,
                prefix=STATE_DIGEST_TAG,
            )  # fmt: skip
            assert status == native.RECV_DONE and got == digest

        return run

    transport = TcpPeerTransport(tenant="default", secret=secret, connections_per_peer=1)
    blocking = TcpPeerTransport(tenant="default", secret=secret, connections_per_peer=1)
    want = [Wanted(key(DSV41), INCARNATION, digest)]
    dest = [memoryview(bytearray(DSV41_STATE_BYTES))]
    client: list[tuple[str, int]] = []
    timelines: list[dict[str, int]] = []
    # Stamps around the client's own steps (the transport looks these names up per call).
    transport._checkout = _stamped(client, "checkout", transport._checkout)  # type: ignore[method-assign]
    fetch_module.get_request = _stamped(client, "request", fetch_module.get_request)
    fetch_module._Bound = _stamped(client, "bound", fetch_module._Bound)  # type: ignore[misc]
    recv_some, recv_hashed = fetch_module._recv_some, fetch_module._recv_hashed

    def stamped_recv_some(*a: Any) -> int:
        got: int = recv_some(*a)
        client.append(("header", ns()))
        return got

    def stamped_recv_hashed(*a: Any) -> bytes:
        client.append(("data0", ns()))
        digest: bytes = recv_hashed(*a)
        return digest

    fetch_module._recv_some, fetch_module._recv_hashed = stamped_recv_some, stamped_recv_hashed
    sendall = socket.socket.sendall

    def stamped_sendall(self: socket.socket, data: Any, *a: Any) -> None:
        client.append(("send0", ns()))
        sendall(self, data, *a)
        client.append(("send1", ns()))

    socket.socket.sendall = stamped_sendall  # type: ignore[method-assign]

    def fetch() -> None:
        client.clear()
        client.append(("start", ns()))
        assert transport.fetch(endpoint, want, deadline=time.monotonic() + 10, out=dest)[0]
        client.append(("end", ns()))
        timelines.append(dict(client))

    def fetch_blocking() -> None:
        ep = f"tcp://127.0.0.1:{blocking_port}"
        assert blocking.fetch(ep, want, deadline=time.monotonic() + 10, out=dest)[0]

    paths = {
        "raw": raw_get,
        "raw_hashed": raw_hashed(fetch_module._PIECE),
        "raw_hashed_512k": raw_hashed(512 << 10),
        "fetch": fetch,
        "fetch_blocking_server": fetch_blocking,
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu = dict.fromkeys(paths, 0)
    for _ in range(5):
        for run in paths.values():
            run()
    timelines.clear()
    begin = ns()
    for _ in range(args.rounds):
        for name, run in paths.items():
            cpu0 = time.process_time_ns()
            for _ in range(20):
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
            cpu[name] += time.process_time_ns() - cpu0
    raw.sendall(b"q")
    proc.stdin.close()
    proc.wait(30)
    peer = [(n, t) for n, t in json.loads(stamp_file.read_text()) if t >= begin]
    stamp_file.unlink()
    phases: dict[str, list[float]] = {}

    def add(name: str, value_ns: int) -> None:
        phases.setdefault(name, []).append(value_ns / 1e3)

    for c in timelines:
        inside = [(n, t) for n, t in peer if c["start"] <= t <= c["end"]]
        first: dict[str, int] = {}
        for n, t in inside:
            first.setdefault(n, t)
        sent = next((t for n, t in peer if n == "sent" and t >= c["start"]), None)
        if "wake" not in first or "send" not in first or sent is None:
            continue
        for a, b, label in CLIENT_PHASES:
            add(f"client: {label}", c[b] - c[a])
        add("request sent to the peer's wake-up", first["wake"] - c["send1"])
        for a, b, label in PEER_PHASES:
            if a in first and b in first:
                add(f"peer: {label}", first[b] - first[a])
        add("peer: sending the reply (one sendmsg)", sent - first["send"])
        add("peer's send start to the client's reply header", c["header"] - first["send"])
        add("peer's send end to the client's last byte", c["end"] - sent)
    figures: dict[str, Any] = {
        "commit": commit(),
        "machine": machine(),
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "client_cpu_us": {name: cpu[name] / len(times[name]) / 1e3 for name in paths},
        "phase_median_us": {name: statistics.median(v) for name, v in phases.items()},
        "timelines": len(next(iter(phases.values()), [])),
    }
    med = figures["median_ms"]
    print(f"# bench/swa_timeline.py at {figures['commit']} on {figures['machine']}")
    print_table(
        "V4.1's state, by path",
        ["path", "median ms", "raw / path", "client CPU us"],
        [
            [n, f"{med[n]:.3f}", f"{med['raw'] / med[n]:.2f}", f"{figures['client_cpu_us'][n]:.0f}"]
            for n in paths
        ],
    )
    print_table(
        f"The fetch's timeline (medians of {figures['timelines']} fetches)",
        ["phase", "us"],
        [[n, f"{v:.1f}"] for n, v in figures["phase_median_us"].items()],
    )
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
