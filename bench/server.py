"""Storage-daemon throughput against raw pyzmq and raw TCP on the same machine, in one run.

One client, batched. A batch is ``--batch`` shards of 11,520-byte bodies
(112 KiB blocks cut in 10, rounded to 64) plus their 104-byte headers, framed
as :mod:`kvcache.wire` messages (48-byte header, 32-byte items, the records).
Four peers move the same bytes, in the same run:

* ``raw_zmq``: a pyzmq DEALER/ROUTER pair (a ROUTER subprocess that answers a
  GET request with one ready-made frame of the GET reply's size, a PUT with
  176 bytes): what the issue asking for these figures compares against.
* ``raw_tcp``: a plain-socket subprocess reading requests with ``recv_into``
  (``MSG_WAITALL``) and answering with ``sendmsg`` of a ready-made GET reply or
  a small PUT reply, the daemon's I/O style without the daemon's work: the
  ceiling of the data path as it now is (TCP, no zmq).
* daemon (no prefix): a real ``kvcache server`` subprocess (LMDB, retention,
  checks, session handshake) driven through :class:`kvcache.server.probe.Probe`:
  every request is encoded, sent with gathered writes (``sendmsg`` straight
  from the batch, as the cluster client's transport does) and every reply is
  read with ``Probe.recv_message`` and checked (request id, status, every item).
  ``put`` is steady state: the node is full and evicts as it writes, so LMDB
  reuses freed pages; ``put_fresh`` is the first fill, every page new to the file.
* ``tls``: the same daemon with a TLS certificate (``tls_cert``/``tls_key``), the
  Probe with a TLS context. The issue asked what zmq CURVE encryption costs;
  the data path left zmq for plain TCP, so TLS is the encryption it offers and
  ``curve_get_vs_plain`` reports ``tls_get_vs_plain``.

Every figure is measured per *window*: the requests the client keeps in flight
on its one connection (``_w1``: strict request/reply; ``_w2``: two, as a
cluster client with several operations outstanding per node has). All peers
are compared at the same window, and their timed rounds are interleaved in
chunks (raw_zmq, raw_tcp, daemon, tls, then rotated) so that load from other
processes on the machine falls on all alike. GB/s and latencies are totals
over the chunks; a ratio (``get_vs_raw_zmq``, ``tls_get_vs_plain``, ...) is the
median over chunks of the two peers' rates within the chunk (``_q1``/``_q3``:
quartiles), so a burst of load that hits one chunk does not set it.
Unsuffixed headline figures are the window-1 ones. ``*_cpu_s_per_gb_*``: user
+ system CPU of the serving process (``/proc/PID/stat``, all threads) during
its own timed chunks, per GB moved; ``client_cpu_*`` the same for this process.

The raw peers and the daemons run with the malloc and BLAS settings of
``kvcache.testing.localcluster.DAEMON_ENV``, as deployed daemons do; the client
process applies the same malloc settings (``tune_malloc``), like the real client.

``--baseline TREE`` adds a fifth peer, ``base``: the daemon of another source
tree (``git archive COMMIT kvcache | tar -x -C TREE``), in the same interleaved
rounds, for before/after figures taken in one run (``get_vs_base``,
``put_vs_base``, ``base_*``).

Usage: ``python bench/server.py [--quick] [--json PATH] [--windows 1,2] [--no-tls]
[--baseline TREE]``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import commit, machine, print_table, write_json
from server_fixtures import DaemonProcess

from kvcache.memtune import tune_malloc
from kvcache.net import client_tls_context
from kvcache.server.probe import Probe
from kvcache.shard import ShardHeader, new_stripe_id, payload_hash, shard_hash
from kvcache.testing.localcluster import DAEMON_ENV
from kvcache.wire import (
    FLAG_REPLY,
    HEADER_BYTES,
    Frame,
    Header,
    Op,
    Status,
    encode,
    items_nbytes,
    make_items,
)

BODY = 11_520
RECORD = BODY + 104
CLASS = "chat"
CURVE_NOTE = (
    "curve_get_vs_plain = tls_get_vs_plain: the data path is plain TCP now, not zmq, "
    "so TLS is the encryption it offers in place of CURVE"
)
_TICK = os.sysconf("SC_CLK_TCK")
_IOV_MAX = 1024
#: Where count and data length sit in a wire header (see kvcache.wire._HEADER).
_COUNT = struct.Struct("<I")
_DATA_LEN = struct.Struct("<Q")

Items = npt.NDArray[np.void]


# ---------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch: PUT items and records, GET items, and the raw peers' pre-encoded requests."""

    put_items: Items
    data: bytes
    get_items: Items
    raw_put: list[Frame]
    raw_get: list[Frame]


def make_batches(count: int, batch: int, seed: int) -> list[Batch]:
    """``count`` batches of fresh keys: 12 shards per key, one stripe per key, valid records."""
    rng = np.random.default_rng(seed)
    body = rng.integers(0, 256, BODY, dtype=np.uint8).tobytes()
    s_hash, p_hash = shard_hash(body), payload_hash(body)
    out = []
    for _ in range(count):
        keys = [(rng.bytes(16), new_stripe_id()) for _ in range(batch // 12 + 1)]
        shards = [(keys[n // 12], n % 12) for n in range(batch)]
        records = [
            ShardHeader(
                block_key=key,  # type: ignore[arg-type]
                stripe_id=stripe,
                shard_index=index,
                k=10,
                m=2,
                payload_len=10 * BODY,
                shard_hash=s_hash,
                payload_hash=p_hash,
                traffic_class=CLASS,
                created_ms=0,
                expiry_ms=0,
            ).pack()
            + body
            for (key, stripe), index in shards
        ]
        put = make_items(Op.PUT, batch, reply=False)
        put["key"] = [k for (k, _), _ in shards]
        put["index"] = [i for _, i in shards]
        put["length"] = RECORD
        get = make_items(Op.GET, batch, reply=False)
        get["key"] = put["key"]
        get["index"] = put["index"]
        data = b"".join(records)
        out.append(
            Batch(
                put,
                data,
                get,
                encode(Header(op=Op.PUT, request_id=0, count=batch), put, data),
                encode(Header(op=Op.GET, request_id=0, count=batch, traffic_class=CLASS), get),
            )
        )
    return out


def reply_sections(batch: int, op: Op) -> list[Frame]:
    """A well-formed reply of the daemon's size: GET with ``batch`` records, PUT all OK."""
    items = make_items(op, batch, reply=True)
    data = b""
    if op is Op.GET:
        items["length"] = RECORD
        data = os.urandom(batch * RECORD)
    return encode(Header(op=op, request_id=0, count=batch, flags=FLAG_REPLY), items, data)


# ---------------------------------------------------------------------- socket helpers


def _flat(frames: Sequence[Frame]) -> list[memoryview]:
    out = []
    for frame in frames:
        view = memoryview(frame)
        if view.nbytes:
            out.append(view if view.ndim == 1 and view.format == "B" else view.cast("B"))
    return out


def send_all(sock: socket.socket, frames: Sequence[Frame]) -> None:
    """Every byte of ``frames``: gathered ``sendmsg`` (TLS sockets: section by section)."""
    pending = _flat(frames)
    if isinstance(sock, ssl.SSLSocket):
        for view in pending:
            sock.sendall(view)
        return
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        while sent:
            head = pending[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                pending.pop(0)
            else:
                pending[0] = head[sent:]
                sent = 0


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` (``MSG_WAITALL``); EOFError when the peer closes first."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError("peer closed the connection")
        got += n


def _body_len(head: memoryview | bytearray, *, reply: bool) -> int:
    """Bytes of items and data after a wire header (no checks: raw peers only)."""
    op = Op(head[3])
    count = _COUNT.unpack_from(head, 16)[0]
    return int(items_nbytes(op, count, reply=reply) + _DATA_LEN.unpack_from(head, 24)[0])


def _buffers(sock: socket.socket, size: int = 4 << 20) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, size)


# ---------------------------------------------------------------------- raw peers (subprocesses)


def raw_zmq_server(port_file: str, batch: int) -> None:
    """ROUTER: a 2-section request (GET) gets the GET reply's bytes, a 3-section one (PUT) 176."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file).write_text(str(port))
    get_reply = zmq.Frame(b"".join(bytes(f) for f in reply_sections(batch, Op.GET)))
    put_reply = b"".join(bytes(f) for f in reply_sections(batch, Op.PUT))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"quit":
            sock.send_multipart([frames[0], b"bye"])
            return
        reply = get_reply if len(frames) == 3 else put_reply
        sock.send_multipart([frames[0], reply], copy=False)


def raw_tcp_server(port_file: str, batch: int) -> None:
    """Blocking plain socket, one connection at a time: read a wire request, send a reply."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    Path(port_file).write_text(str(listener.getsockname()[1]))
    replies = {Op.GET: reply_sections(batch, Op.GET), Op.PUT: reply_sections(batch, Op.PUT)}
    head = bytearray(HEADER_BYTES)
    body = bytearray(items_nbytes(Op.PUT, batch, reply=False) + batch * RECORD + (1 << 20))
    while True:
        conn, _ = listener.accept()
        _buffers(conn)
        try:
            while True:
                recv_exact(conn, memoryview(head))
                if head[:4] == b"quit":
                    conn.sendall(b"bye")
                    return
                size = _body_len(head, reply=False)
                if size > len(body):
                    body = bytearray(size)
                recv_exact(conn, memoryview(body)[:size])
                send_all(conn, replies[Op(head[3])])
        except (EOFError, OSError):
            conn.close()


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r} did not start")
        time.sleep(0.02)
    return path.read_text()


def _spawn(flag: str, port_file: Path, batch: int) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, flag, str(port_file), str(batch)],
        env={**os.environ, **DAEMON_ENV},
    )
    return proc, int(_wait_file(port_file, proc))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all threads (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


# ---------------------------------------------------------------------- peers (client side)


class Peer(Protocol):
    """What a timed round needs of a peer: send a request, receive the next reply."""

    name: str
    pid: int

    def send_put(self, i: int) -> None: ...
    def send_get(self, i: int) -> None: ...
    def recv(self) -> None: ...


class RawZmq:
    """The pyzmq baseline: this process's DEALER, the ROUTER subprocess."""

    name = "raw_zmq"

    def __init__(self, ctx: zmq.Context[Any], tmp: Path, work: Workload) -> None:
        self.proc, port = _spawn("--raw-zmq-server", tmp / "zmq-port", work.batch)
        self.pid = self.proc.pid
        self.work = work
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send_put(self, i: int) -> None:
        self.sock.send_multipart(self.work.put_batch(i).raw_put, copy=False)

    def send_get(self, i: int) -> None:
        self.sock.send_multipart(self.work.get_batch(i).raw_get[:2], copy=False)

    def recv(self) -> None:
        self.sock.recv(copy=False)

    def close(self) -> None:
        self.sock.send(b"quit")
        self.sock.recv()
        self.sock.close()
        self.proc.wait(10)


class RawTcp:
    """The plain-socket baseline: a blocking socket here, the raw TCP subprocess there."""

    name = "raw_tcp"

    def __init__(self, tmp: Path, work: Workload) -> None:
        self.proc, port = _spawn("--raw-tcp-server", tmp / "tcp-port", work.batch)
        self.pid = self.proc.pid
        self.work = work
        self.sock = socket.create_connection(("127.0.0.1", port))
        _buffers(self.sock)
        self.head = bytearray(HEADER_BYTES)
        self.body = bytearray(items_nbytes(Op.GET, work.batch, reply=True) + work.batch_bytes)

    def send_put(self, i: int) -> None:
        send_all(self.sock, self.work.put_batch(i).raw_put)

    def send_get(self, i: int) -> None:
        send_all(self.sock, self.work.get_batch(i).raw_get)

    def recv(self) -> None:
        recv_exact(self.sock, memoryview(self.head))
        recv_exact(self.sock, memoryview(self.body)[: _body_len(self.head, reply=True)])

    def close(self) -> None:
        self.sock.sendall(b"quit".ljust(HEADER_BYTES, b"\0"))
        self.sock.recv(3)
        self.sock.close()
        self.proc.wait(10)


class DaemonPeer:
    """A ``kvcache server`` subprocess and a Probe to it; every reply is checked."""

    def __init__(
        self,
        name: str,
        root: Path,
        work: Workload,
        capacity: int,
        tls: tuple[Path, Path] | None = None,
        source: Path | None = None,
    ) -> None:
        self.name = name
        self.work = work
        server: dict[str, Any] = {
            "node_id": f"bench-{name}",
            "capacity_bytes": capacity,
            "sync": "periodic",
        }
        if tls is not None:
            server |= {"tls_cert": str(tls[0]), "tls_key": str(tls[1])}
        root.mkdir(parents=True, exist_ok=True)
        env = dict(DAEMON_ENV)
        if source is not None:  # another build's daemon: its tree first, not the cwd
            # Its tree before the rest of the path (which may hold the dependencies, as on
            # the GPU host, where they live in a PYTHONPATH directory, not a venv).
            path = [str(source), *filter(None, [os.environ.get("PYTHONPATH")])]
            env |= {"PYTHONPATH": os.pathsep.join(path), "PYTHONSAFEPATH": "1"}
            # Its own native library (another ABI), where it has one built beside its code.
            own = Path(source) / "kvcache" / "native" / "libkvfast.so"
            if own.exists():
                env["KVCACHE_NATIVE_LIBRARY"] = str(own.resolve())
            # And its own data plane (the GPU host's environment names this tree's).
            plane = own.with_name("libkvserve.so")
            if plane.exists():
                env["KVCACHE_SERVE_LIBRARY"] = str(plane.resolve())
        self.daemon = DaemonProcess(root, server=server, env=env).start()
        assert self.daemon.proc is not None
        self.pid = self.daemon.proc.pid
        entry = self.daemon.credentials.tenant("default")
        assert entry is not None
        context = client_tls_context(tls[0]) if tls is not None else None
        try:
            self.probe = Probe(
                self.daemon.data, tenant="default", secret=entry.secret, timeout_s=60, tls=context
            )
        except BaseException:  # a daemon that refuses the handshake is not left running
            self.daemon.stop()
            raise
        self.ids = itertools.count(1)
        self.sent: collections.deque[tuple[Op, int]] = collections.deque()

    def _send(self, op: Op, items: Items, data: Frame = b"") -> None:
        request_id = next(self.ids)
        cls = CLASS if op is Op.GET else ""
        header = Header(op=op, request_id=request_id, count=len(items), traffic_class=cls)
        send_all(self.probe.sock, encode(header, items, data))
        self.sent.append((op, request_id))

    def send_put(self, i: int) -> None:
        batch = self.work.put_batch(i)
        self._send(Op.PUT, batch.put_items, batch.data)

    def send_get(self, i: int) -> None:
        self._send(Op.GET, self.work.get_batch(i).get_items)

    def recv(self) -> None:
        op, request_id = self.sent.popleft()
        reply = self.probe.recv_message(60)
        if reply is None:
            raise RuntimeError(f"{self.name}: no reply to {op.name}#{request_id}")
        header = reply.header
        if header.status != Status.OK or header.request_id != request_id or header.op != op:
            raise RuntimeError(
                f"{self.name}: {op.name}#{request_id} failed: {header.op.name}"
                f"#{header.request_id} {header.status!r} {reply.error_text()}"
            )
        if len(reply.items) != self.work.batch or reply.items["status"].any():
            raise RuntimeError(f"{self.name}: {op.name}#{request_id}: {reply.items['status']}")

    def close(self) -> None:
        self.probe.close()
        self.daemon.stop()


# ---------------------------------------------------------------------- timing


class Workload:
    """Batches and which of them a PUT or GET round ``i`` uses.

    PUT round ``i`` writes batch ``i mod len(batches)``; with a batch for every
    round (as ``main`` makes them), every steady-state PUT stores new shards. GET
    rounds read ``resident``, batches written last (set once the PUTs are done).
    """

    def __init__(self, batches: list[Batch], batch: int) -> None:
        self.batches = batches
        self.batch = batch
        self.batch_bytes = batch * RECORD
        self.resident = list(range(len(batches)))

    def put_batch(self, i: int) -> Batch:
        return self.batches[i % len(self.batches)]

    def get_batch(self, i: int) -> Batch:
        return self.batches[self.resident[i % len(self.resident)]]


@dataclass
class Timing:
    """Elapsed time, latencies and CPU summed over the chunks of one figure, and each chunk's
    rate (rounds per second)."""

    seconds: float = 0.0
    rounds: int = 0
    latencies: list[float] = field(default_factory=list)
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    rates: list[float] = field(default_factory=list)

    def gbps(self, batch_bytes: int) -> float:
        return self.rounds * batch_bytes / self.seconds / 1e9

    def pct_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1e3)

    def cpu_per_gb(self, batch_bytes: int) -> tuple[float, float]:
        gb = self.rounds * batch_bytes / 1e9
        return self.server_cpu / gb, self.client_cpu / gb


def pipelined(
    send: Callable[[int], None], recv: Callable[[], None], rounds: range, window: int, t: Timing
) -> None:
    """Requests ``rounds`` with up to ``window`` in flight on one connection (replies in order)."""
    in_flight: collections.deque[float] = collections.deque()
    clock = time.perf_counter
    start = clock()
    for i in rounds:
        if len(in_flight) == window:
            recv()
            t.latencies.append(clock() - in_flight.popleft())
        in_flight.append(clock())
        send(i)
    while in_flight:
        recv()
        t.latencies.append(clock() - in_flight.popleft())
    elapsed = clock() - start
    t.seconds += elapsed
    t.rounds += len(rounds)
    t.rates.append(len(rounds) / elapsed)


def interleaved(
    peers: Sequence[Peer], op: Op, rounds: range, window: int, chunks: int
) -> dict[str, Timing]:
    """Every peer runs ``rounds`` of ``op``, in ``chunks`` alternating (rotated) chunks."""
    timings = {p.name: Timing() for p in peers}
    n = len(rounds)
    chunks = max(1, min(chunks, n // 8))  # at least 8 rounds a chunk
    for c in range(chunks):
        part = rounds[n * c // chunks : n * (c + 1) // chunks]
        for k in range(len(peers)):
            peer = peers[(c + k) % len(peers)]
            t = timings[peer.name]
            send = peer.send_put if op is Op.PUT else peer.send_get
            server0, client0 = cpu_seconds(peer.pid), time.process_time()
            pipelined(send, peer.recv, part, window, t)
            t.server_cpu += cpu_seconds(peer.pid) - server0
            t.client_cpu += time.process_time() - client0
    return timings


def ratio(a: Timing, b: Timing) -> tuple[float, float, float]:
    """Median and quartiles over chunks of a's rate / b's rate in the same chunk."""
    per_chunk = np.array(a.rates) / np.array(b.rates)
    q1, med, q3 = np.percentile(per_chunk, [25, 50, 75])
    return float(med), float(q1), float(q3)


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (as tests/test_tls.py makes one)."""
    cert, key = directory / "data.crt", directory / "data.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    key.chmod(0o600)
    return cert, key


@dataclass(frozen=True, slots=True)
class Plan:
    """How much of everything one window runs."""

    capacity: int
    fill: int
    steady: int
    get_rounds: int
    chunks: int


def bench_window(
    raw: Sequence[Peer],
    work: Workload,
    plan: Plan,
    window: int,
    tmp: Path,
    tls: tuple[Path, Path] | None,
    baseline: Path | None = None,
) -> dict[str, float]:
    """First fill, steady PUT and GET through new daemons at ``window``, raw peers alongside."""
    sfx = f"_w{window}"
    daemons: list[DaemonPeer] = []
    try:
        daemons.append(DaemonPeer("daemon", tmp / f"plain{sfx}", work, plan.capacity))
        if baseline is not None:
            base = DaemonPeer("base", tmp / f"base{sfx}", work, plan.capacity, None, baseline)
            daemons.append(base)
        if tls is not None:
            daemons.append(DaemonPeer("tls", tmp / f"tls{sfx}", work, plan.capacity, tls))
        peers: list[Peer] = [*raw, *daemons]
        fresh = interleaved(peers, Op.PUT, range(plan.fill), window, plan.chunks)
        steady_rounds = range(plan.fill, plan.fill + plan.steady)
        steady = interleaved(peers, Op.PUT, steady_rounds, window, plan.chunks)
        last = steady_rounds[-1]
        recent = range(last - max(1, plan.fill // 2) + 1, last + 1)
        work.resident = [i % len(work.batches) for i in recent]
        # Expiries are whole seconds, and shards of one expiry are evicted in key order, not
        # in the order written (docs/spec/retention.md): this node holds well under a second
        # of PUTs, so the churn left holes in every batch. The batches GET reads are written
        # again (untimed) in a wall-clock second of their own, so eviction takes the churn's.
        time.sleep(1.01 - time.time() % 1.0)
        for d in daemons:
            pipelined(d.send_put, d.recv, recent, window, Timing())
        for peer in peers:  # warm the read path (and these records' pages)
            pipelined(peer.send_get, peer.recv, range(8), window, Timing())
        get = interleaved(peers, Op.GET, range(plan.get_rounds), window, plan.chunks)
        evicted = {d.name: d.daemon.stats()["gc"].get("evicted_shards", 0) for d in daemons}
    finally:
        for d in daemons:
            d.close()
            # Deleted now, their dirty pages are dropped, not written back during later rounds.
            shutil.rmtree(d.daemon.root, ignore_errors=True)
    bb = work.batch_bytes
    out: dict[str, float] = {}
    for name, t_get in get.items():
        prefix = "" if name == "daemon" else f"{name}_"
        t_put, t_fresh = steady[name], fresh[name]
        out[f"{prefix}get_gbps{sfx}"] = t_get.gbps(bb)
        out[f"{prefix}put_gbps{sfx}"] = t_put.gbps(bb)
        out[f"{prefix}get_p50_ms{sfx}"] = t_get.pct_ms(50)
        out[f"{prefix}get_p99_ms{sfx}"] = t_get.pct_ms(99)
        out[f"{prefix}put_p50_ms{sfx}"] = t_put.pct_ms(50)
        out[f"{prefix}put_p99_ms{sfx}"] = t_put.pct_ms(99)
        if name in ("daemon", "tls", "base"):
            out[f"{prefix}put_fresh_gbps{sfx}"] = t_fresh.gbps(bb)
        else:  # the raw PUT rounds interleaved with the first fill
            out[f"{prefix}put_during_fill_gbps{sfx}"] = t_fresh.gbps(bb)
        if name in evicted:  # steady state: the PUTs made the node evict
            out[f"{prefix}evicted_shards{sfx}"] = evicted[name]
        server = "daemon" if name in ("daemon", "tls", "base") else "server"
        for op, t in (("get", t_get), ("put", t_put)):
            server_cpu, client_cpu = t.cpu_per_gb(bb)
            out[f"{prefix}{server}_cpu_s_per_gb_{op}{sfx}"] = server_cpu
            out[f"{prefix}client_cpu_s_per_gb_{op}{sfx}"] = client_cpu
    ratios = {
        "get_vs_raw_zmq": (get["daemon"], get["raw_zmq"]),
        "put_vs_raw_zmq": (steady["daemon"], steady["raw_zmq"]),
        "get_vs_raw_tcp": (get["daemon"], get["raw_tcp"]),
        "put_vs_raw_tcp": (steady["daemon"], steady["raw_tcp"]),
        "put_fresh_vs_raw_zmq": (fresh["daemon"], fresh["raw_zmq"]),
    }
    if baseline is not None:
        ratios["get_vs_base"] = (get["daemon"], get["base"])
        ratios["put_vs_base"] = (steady["daemon"], steady["base"])
        ratios["put_fresh_vs_base"] = (fresh["daemon"], fresh["base"])
        ratios["base_get_vs_raw_zmq"] = (get["base"], get["raw_zmq"])
        ratios["base_put_vs_raw_zmq"] = (steady["base"], steady["raw_zmq"])
    if tls is not None:
        ratios["tls_get_vs_plain"] = (get["tls"], get["daemon"])
        ratios["tls_put_vs_plain"] = (steady["tls"], steady["daemon"])
    for name, (a, b) in ratios.items():
        med, q1, q3 = ratio(a, b)
        out[f"{name}{sfx}"], out[f"{name}_q1{sfx}"], out[f"{name}_q3{sfx}"] = med, q1, q3
    if tls is not None:
        out[f"curve_get_vs_plain{sfx}"] = out[f"tls_get_vs_plain{sfx}"]
    return out


# ---------------------------------------------------------------------- report


def report(figures: dict[str, Any], windows: list[int]) -> None:
    """Markdown tables of the figures."""

    def f(key: str, fmt: str = "{:.2f}") -> str:
        value = figures.get(key)
        return "—" if value is None else fmt.format(value)

    names = [
        ("raw_zmq", "raw_zmq_"),
        ("raw_tcp", "raw_tcp_"),
        ("daemon", ""),
        ("daemon+TLS", "tls_"),
    ]
    rows = []
    for w in windows:
        for label, p in names:
            rows.append(
                [
                    str(w),
                    label,
                    f(f"{p}get_gbps_w{w}"),
                    f(f"{p}get_p50_ms_w{w}") + " / " + f(f"{p}get_p99_ms_w{w}"),
                    f(f"{p}put_gbps_w{w}"),
                    f(f"{p}put_p50_ms_w{w}") + " / " + f(f"{p}put_p99_ms_w{w}"),
                    f(f"{p}put_fresh_gbps_w{w}")
                    if p in ("", "tls_")
                    else f(f"{p}put_during_fill_gbps_w{w}") + " (raw)",
                ]
            )
    print_table(
        f"Throughput (GB/s) and latency (ms), batch of {figures['batch_shards']} shards "
        f"({figures['batch_bytes']:,} bytes)",
        ["window", "peer", "GET GB/s", "GET p50 / p99", "PUT GB/s", "PUT p50 / p99", "first fill"],
        rows,
    )
    rows = []
    for w in windows:
        for label, p, server in [
            ("raw_zmq", "raw_zmq_", "server"),
            ("raw_tcp", "raw_tcp_", "server"),
            ("daemon", "", "daemon"),
            ("daemon+TLS", "tls_", "daemon"),
        ]:
            rows.append(
                [
                    str(w),
                    label,
                    f(f"{p}{server}_cpu_s_per_gb_get_w{w}", "{:.3f}"),
                    f(f"{p}{server}_cpu_s_per_gb_put_w{w}", "{:.3f}"),
                    f(f"{p}client_cpu_s_per_gb_get_w{w}", "{:.3f}"),
                    f(f"{p}client_cpu_s_per_gb_put_w{w}", "{:.3f}"),
                ]
            )
    print_table(
        "CPU seconds per GB moved (server process: all threads; client: this process)",
        ["window", "peer", "server GET", "server PUT", "client GET", "client PUT"],
        rows,
    )
    targets = {"get_vs_raw_zmq": 0.7, "put_vs_raw_zmq": 0.5}
    ratios = [
        "get_vs_raw_zmq",
        "put_vs_raw_zmq",
        "get_vs_raw_tcp",
        "put_vs_raw_tcp",
        "put_fresh_vs_raw_zmq",
        "tls_get_vs_plain",
        "tls_put_vs_plain",
        "curve_get_vs_plain",
    ]
    rows = []
    for name in ratios:
        target = targets.get(name)
        cells = [f"`{name}`"] + [
            f(f"{name}_w{w}") + f" [{f(f'{name}_q1_w{w}')}–{f(f'{name}_q3_w{w}')}]"
            if f"{name}_q1_w{w}" in figures
            else f(f"{name}_w{w}")
            for w in windows
        ]
        if target is None:
            cells.append("")
        else:
            met = all(figures.get(f"{name}_w{w}", 0) >= target for w in windows)
            cells.append(f"≥ {target} ({'met' if met else 'missed'})")
        rows.append(cells)
    print_table(
        "Ratios: median over chunks of the per-chunk ratio [quartiles]",
        ["figure", *(f"window {w}" for w in windows), "target"],
        rows,
    )
    if "curve_get_vs_plain" in figures:
        print(f"\nNote: {CURVE_NOTE}.")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    parser.add_argument("--json", type=Path, help="write every figure as a flat JSON object")
    parser.add_argument("--batch", type=int, default=128, help="shards per request")
    parser.add_argument(
        "--windows", default="1,2", help="requests in flight per connection, comma-separated"
    )
    parser.add_argument("--no-tls", action="store_true", help="skip the TLS daemon")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a source tree of another build (e.g. `git archive` of the commit before): its "
        "daemon runs as peer `base`, interleaved with this build's (`*_vs_base` ratios)",
    )
    parser.add_argument("--raw-zmq-server", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--raw-tcp-server", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_zmq_server:
        raw_zmq_server(args.raw_zmq_server[0], int(args.raw_zmq_server[1]))
        return 0
    if args.raw_tcp_server:
        raw_tcp_server(args.raw_tcp_server[0], int(args.raw_tcp_server[1]))
        return 0
    tune_malloc()  # what the real client does; the same for every peer's rounds
    windows = [int(w) for w in args.windows.split(",")]
    batch_bytes = args.batch * RECORD
    capacity = (64 << 20) if args.quick else (256 << 20)
    fill = capacity // batch_bytes  # batches that fill the node once
    plan = Plan(
        capacity=capacity,
        fill=fill,
        steady=16 * fill if args.quick else 8 * fill,
        get_rounds=4000 if args.quick else 12000,
        chunks=24 if args.quick else 48,
    )
    started = time.monotonic()
    # A batch for every PUT round: keys never repeat, so every steady-state PUT stores new
    # shards (a node holds well under a second of PUTs and evicts one second's shards in key
    # order, so with batches coming round again about half of a round's shards were still
    # there, and the figure measured rewrites as much as new writes).
    work = Workload(make_batches(fill + plan.steady, args.batch, seed=1), args.batch)
    figures: dict[str, Any] = {
        "batch_shards": args.batch,
        "batch_bytes": batch_bytes,
        "capacity_bytes": capacity,
        "commit": commit(),
        "machine": machine(),
        "quick": args.quick,
        "loadavg_1m_start": os.getloadavg()[0],
    }
    ctx: zmq.Context[Any] = zmq.Context()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVCACHE_BENCH_DIR")) as tmp_name:
        tmp = Path(tmp_name)
        tls = None if args.no_tls else make_certificate(tmp)
        raw_zmq = RawZmq(ctx, tmp, work)
        raw_tcp = RawTcp(tmp, work)
        try:
            for window in windows:
                figures |= bench_window(
                    [raw_zmq, raw_tcp], work, plan, window, tmp, tls, args.baseline
                )
        finally:
            raw_zmq.close()
            raw_tcp.close()
    ctx.term()
    head = 1 if 1 in windows else windows[0]
    for name in (
        "get_vs_raw_zmq",
        "put_vs_raw_zmq",
        "get_vs_raw_tcp",
        "put_vs_raw_tcp",
        "put_fresh_vs_raw_zmq",
        "tls_get_vs_plain",
        "tls_put_vs_plain",
        "curve_get_vs_plain",
        "daemon_cpu_s_per_gb_get",
        "daemon_cpu_s_per_gb_put",
        "get_vs_base",
        "put_vs_base",
        "put_fresh_vs_base",
        "base_get_vs_raw_zmq",
        "base_put_vs_raw_zmq",
        "base_daemon_cpu_s_per_gb_get",
        "base_daemon_cpu_s_per_gb_put",
        "get_p50_ms",
        "get_p99_ms",
        "put_p50_ms",
        "put_p99_ms",
    ):
        if f"{name}_w{head}" in figures:
            figures[name] = figures[f"{name}_w{head}"]
    if "curve_get_vs_plain" in figures:
        figures["curve_note"] = CURVE_NOTE
    figures["elapsed_s"] = time.monotonic() - started
    figures["loadavg_1m_end"] = os.getloadavg()[0]
    report(figures, windows)
    print()
    width = max(map(len, figures))
    for name in sorted(figures):
        value = figures[name]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
