"""Serving SWA states between workers over real sockets: batching, digests, incarnations,
authentication, deadlines, and the whole tier against a real cluster."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvcache import DType, KVLayout, Namespace, block_keys
from kvcache.client import Client
from kvcache.credentials import TenantCredentials
from kvcache.errors import ArgumentError, ClosedError, ConfigError
from kvcache.keys import BlockKey
from kvcache.net import open_session
from kvcache.session import AUTH_BYTES, ServerHandshake
from kvcache.swa_local import (
    StateKey,
    SwaConfig,
    SwaStore,
    SwaTier,
    TcpPeerTransport,
    Wanted,
    state_digest,
)
from kvcache.swa_local.protocol import get_reply, get_request
from kvcache.swa_local.server import PeerServer
from kvcache.testing.localcluster import LocalCluster
from kvcache.wire import HEADER_BYTES, Header, Limits, MessageReader, Op, Status

SECRET = b"s" * 32
TENANT = TenantCredentials(name="default", secret=SECRET)
NS = b"\x11" * 8
LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=64, dtype=DType.FLOAT16, layers_in_block=2)
MAIN_NS = Namespace(model="test/hybrid", revision="r1", layout=LAYOUT)


def skey(n: int, position: int = 256) -> StateKey:
    return StateKey(namespace=NS, block=BlockKey(n.to_bytes(16, "big")), position=position)


def blob(n: int, size: int = 100_000) -> bytes:
    return np.random.default_rng(n).integers(0, 256, size, np.uint8).tobytes()


@pytest.fixture
def peer() -> Iterator[PeerServer]:
    store = SwaStore(max_bytes=64 << 20)
    with PeerServer(store, tenant=TENANT, incarnation=42) as server:
        server.start()
        yield server


@pytest.fixture
def transport() -> Iterator[TcpPeerTransport]:
    t = TcpPeerTransport(tenant="default", secret=SECRET, connections_per_peer=2)
    yield t
    t.close()


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def test_batched_fetch_returns_verified_states_and_clean_misses(
    peer: PeerServer, transport: TcpPeerTransport
) -> None:
    for n in range(3):
        peer.store.put(skey(n), blob(n))
    wanted = [
        Wanted(skey(0), 42, state_digest(blob(0))),
        Wanted(skey(9), 42),  # never held
        Wanted(skey(2), 42),
        Wanted(skey(1, position=255), 42),  # held, but for another position
        Wanted(skey(1), 42),
    ]
    got = transport.fetch(peer.endpoint, wanted, deadline=soon())
    assert [None if g is None else bytes(g) for g in got] == [blob(0), None, blob(2), None, blob(1)]
    assert peer.counters["states_served"] == 3 and peer.counters["not_found"] == 2
    assert transport.counters["fetched"] == 3 and transport.counters["not_found"] == 2


def test_a_state_that_fails_its_recorded_digest_is_never_returned(
    peer: PeerServer, transport: TcpPeerTransport
) -> None:
    peer.store.put(skey(1), blob(1))
    (got,) = transport.fetch(
        peer.endpoint, [Wanted(skey(1), 42, state_digest(b"other"))], deadline=soon()
    )
    assert got is None
    assert transport.counters["corrupt"] == 1


def test_states_larger_than_a_piece_land_in_the_callers_buffers(
    peer: PeerServer, transport: TcpPeerTransport
) -> None:
    big = blob(7, 1_000_003)  # four receive-and-hash pieces, the last one short
    peer.store.put(skey(7), big)
    peer.store.put(skey(8), blob(8))
    mine = bytearray(len(big))
    wrong = bytearray(5)  # not the state's size: drained, a miss, counted
    got = transport.fetch(
        peer.endpoint,
        [Wanted(skey(7), 42, state_digest(big)), Wanted(skey(8), 42), Wanted(skey(9), 42)],
        deadline=soon(),
        out=[memoryview(mine), memoryview(wrong), None],
    )
    assert got[0] is not None and got[0].obj is mine and bytes(mine) == big
    assert got[1:] == [None, None]
    assert transport.counters["wrong_size"] == 1 and transport.counters["not_found"] == 1
    # The connection is still in step: the next fetch on it gets the right bytes.
    (again,) = transport.fetch(peer.endpoint, [Wanted(skey(8), 42)], deadline=soon())
    assert again is not None and bytes(again) == blob(8)
    with pytest.raises(ArgumentError, match="2 buffers for 1 states"):
        transport.fetch(peer.endpoint, [Wanted(skey(8), 42)], deadline=soon(), out=[None, None])
    with pytest.raises(ArgumentError, match="writable"):
        transport.fetch(
            peer.endpoint, [Wanted(skey(8), 42)], deadline=soon(), out=[memoryview(b"x")]
        )


def test_a_refusal_comes_back_as_misses_with_its_reason_counted() -> None:
    store = SwaStore(max_bytes=1 << 20)
    store.put(skey(1), blob(1))
    limits = Limits(max_data_bytes=50_000)  # the state asked for is larger
    with (
        PeerServer(store, tenant=TENANT, incarnation=42, limits=limits) as server,
        TcpPeerTransport(tenant="default", secret=SECRET) as t,
    ):
        server.start()
        assert t.fetch(server.endpoint, [Wanted(skey(1), 42)], deadline=soon()) == [None]
        assert t.counters["errors"] == 1
        # A new connection replaces the one closed after the refusal.
        store.put(skey(2), blob(2, 1000))
        (got,) = t.fetch(server.endpoint, [Wanted(skey(2), 42)], deadline=soon())
        assert got is not None and bytes(got) == blob(2, 1000)


def test_another_incarnation_is_not_found(peer: PeerServer, transport: TcpPeerTransport) -> None:
    peer.store.put(skey(1), blob(1))
    (got,) = transport.fetch(peer.endpoint, [Wanted(skey(1), 41)], deadline=soon())
    assert got is None
    assert peer.counters["stale_incarnation"] == 1


def test_only_the_workers_tenant_is_served(peer: PeerServer) -> None:
    peer.store.put(skey(1), blob(1))
    wrong = TcpPeerTransport(tenant="default", secret=b"w" * 32)
    other = TcpPeerTransport(tenant="other", secret=SECRET)
    try:
        for t in (wrong, other):
            assert t.fetch(peer.endpoint, [Wanted(skey(1), 42)], deadline=soon()) == [None]
            assert t.counters["errors"] == 1
    finally:
        wrong.close()
        other.close()
    assert peer.counters["refused"] == 2 and peer.counters["states_served"] == 0


def test_a_silent_holder_costs_the_deadline_and_nothing_more(
    transport: TcpPeerTransport,
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # accepts connections (the kernel does), never says hello
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        started = time.monotonic()
        got = transport.fetch(endpoint, [Wanted(skey(1), 1)], deadline=started + 0.2)
        elapsed = time.monotonic() - started
    finally:
        listener.close()
    assert got == [None]
    assert 0.15 <= elapsed < 2.0
    assert transport.counters["errors"] + transport.counters["timeouts"] == 1


def test_a_dead_holder_is_a_clean_miss(transport: TcpPeerTransport) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nobody listens there
    assert transport.fetch(endpoint, [Wanted(skey(1), 1)], deadline=soon()) == [None]


def test_malformed_and_foreign_requests_are_refused(peer: PeerServer) -> None:
    sock = open_session(peer.endpoint, tenant="default", secret=SECRET, timeout_s=5, node="p")
    sock.settimeout(5)
    reader = MessageReader(limits=Limits(), replies=True)

    def reply() -> Header:
        while (message := reader.next_message()) is None:
            n = sock.recv_into(reader.recv_buffer())
            assert n, "peer closed before answering"
            reader.commit(n)
        return message.header

    sock.sendall(Header(op=Op.GET, request_id=5, count=0).pack())
    foreign = reply()
    assert foreign.status is Status.BAD_REQUEST and foreign.request_id == 5
    sock.sendall(b"XX" + bytes(46))  # bad magic: answered, then the connection is closed
    assert reply().status is Status.BAD_REQUEST
    assert sock.recv(1) == b""
    sock.close()
    assert peer.counters["bad_requests"] == 2


def test_a_request_with_a_data_section_is_refused_unread(peer: PeerServer) -> None:
    sock = open_session(peer.endpoint, tenant="default", secret=SECRET, timeout_s=5, node="p")
    sock.settimeout(5)
    reader = MessageReader(limits=Limits(), replies=True)
    # An SWA_GET announcing 250 MiB of data (a request carries none): refused at its header.
    sock.sendall(Header(op=Op.SWA_GET, request_id=7, count=0, data_len=250 << 20).pack())
    while (message := reader.next_message()) is None:
        n = sock.recv_into(reader.recv_buffer())
        assert n, "peer closed before answering"
        reader.commit(n)
    assert message.header.status is Status.BAD_REQUEST
    assert sock.recv(1) == b""
    sock.close()
    assert peer.counters["bad_requests"] == 1
    # It keeps serving.
    peer.store.put(skey(1), blob(1))
    with TcpPeerTransport(tenant="default", secret=SECRET) as t:
        (got,) = t.fetch(peer.endpoint, [Wanted(skey(1), 42)], deadline=soon())
    assert got is not None and bytes(got) == blob(1)


def test_a_request_that_stalls_half_sent_is_cut_off() -> None:
    store = SwaStore(max_bytes=1 << 20)
    with PeerServer(store, tenant=TENANT, incarnation=42, request_timeout_s=0.3) as server:
        server.start()
        sock = open_session(server.endpoint, tenant="default", secret=SECRET, timeout_s=5, node="p")
        sock.settimeout(10)
        # The header of a 1,000-item SWA_GET, and then nothing.
        sock.sendall(Header(op=Op.SWA_GET, request_id=1, count=1000).pack())
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed by the server, not by this 10 s timeout
        assert time.monotonic() - started < 5
        sock.close()
        assert server.counters["requests_cut_off"] == 1


def test_sockets_without_credentials_cannot_lock_the_tenant_out() -> None:
    store = SwaStore(max_bytes=1 << 20)
    store.put(skey(1), blob(1))
    idle: list[socket.socket] = []
    bounds = {"max_connections": 4, "max_preauth": 8, "max_preauth_per_peer": 8}
    with PeerServer(store, tenant=TENANT, incarnation=42, **bounds) as server:
        server.start()
        host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
        try:
            for _ in range(40):  # far more than every bound: they never say a word
                idle.append(socket.create_connection((host, int(port))))
            for n in range(3):  # the tenant's own peers still get through, each a new session
                with TcpPeerTransport(tenant="default", secret=SECRET) as t:
                    (got,) = t.fetch(server.endpoint, [Wanted(skey(1), 42)], deadline=soon())
                assert got is not None and bytes(got) == blob(1), n
        finally:
            for sock in idle:
                sock.close()
        assert server.counters["handshakes_displaced"] >= 30


def test_many_fetches_in_flight_share_a_few_connections(
    peer: PeerServer, transport: TcpPeerTransport
) -> None:
    import concurrent.futures

    for n in range(8):
        peer.store.put(skey(n), blob(n, 50_000))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(transport.fetch, peer.endpoint, [Wanted(skey(i % 8), 42)], deadline=soon())
            for i in range(64)
        ]
        results = [f.result() for f in futures]
    assert all(
        r[0] is not None and bytes(r[0]) == blob(i % 8, 50_000) for i, r in enumerate(results)
    )
    assert peer.counters["connections"] <= 2  # connections_per_peer


# ---------------------------------------------------------------------- the tier, with a cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("swa-tier"))
    c.start(nodes=12, capacity="128MiB")
    yield c
    c.stop()


def _tier(cluster: LocalCluster, **overrides: object) -> tuple[Client, SwaTier]:
    client = Client(cluster.client_config(timeout_s=2.0))
    tier = SwaTier(SwaConfig(**overrides), client)  # type: ignore[arg-type]
    tier.start()
    return client, tier


def test_a_state_taken_on_one_worker_is_found_and_fetched_by_another(
    cluster: LocalCluster,
) -> None:
    tokens = list(range(5000, 5000 + 16 * 4))
    keys = block_keys(MAIN_NS, tokens)
    state_key = StateKey(namespace=NS, block=keys[3], position=64)
    client_a, a = _tier(cluster)
    client_b, b = _tier(cluster)
    try:
        a.put(state_key, blob(3))
        assert a.flush()
        _, holders = b.lookup(MAIN_NS, tokens)
        assert [r.endpoint for r in holders[3]] == [a.endpoint]
        got = b.fetch(state_key, holders[3])
        assert got is not None and bytes(got) == blob(3)
        assert b.counters["remote_hits"] == 1
        # Into the engine's buffer: the holder's reply is received there.
        mine = bytearray(len(blob(3)))
        into = b.fetch(state_key, holders[3], out=memoryview(mine))
        assert isinstance(into, memoryview) and into.obj is mine and bytes(mine) == blob(3)
        assert b.fetch(state_key, holders[3], out=memoryview(bytearray(7))) is None
        assert b.counters["remote_hits"] == 2 and b.counters["misses"] == 1
        # The holder itself serves it from its own RAM.
        local = a.fetch(state_key, holders[3])
        assert local is not None and bytes(local) == blob(3)
        assert a.counters["local_hits"] == 1
        mine = bytearray(len(blob(3)))
        into = a.fetch(state_key, holders[3], out=memoryview(mine))
        assert into is not None and bytes(mine) == blob(3)
        assert a.fetch(state_key, holders[3], out=memoryview(bytearray(7))) is None
        # A clean shutdown withdraws the records: nobody is sent to a gone worker.
        a.close()
        _, holders = b.lookup(MAIN_NS, tokens)
        assert holders == {}
    finally:
        a.close()
        b.close()
        client_a.close()
        client_b.close()


def test_dead_and_restarted_workers_resolve_to_clean_misses(cluster: LocalCluster) -> None:
    tokens = list(range(9000, 9000 + 16 * 2))
    keys = block_keys(MAIN_NS, tokens)
    state_key = StateKey(namespace=NS, block=keys[1], position=32)
    client_a, a = _tier(cluster)
    client_b, b = _tier(cluster)
    try:
        a.put(state_key, blob(5))
        assert a.flush()
        endpoint = a.endpoint
        a.close(withdraw=False)  # as if the process died: its records stay behind
        _, holders = b.lookup(MAIN_NS, tokens)
        assert [r.endpoint for r in holders[1]] == [endpoint]
        assert b.fetch(state_key, holders[1]) is None
        # A new incarnation on the same endpoint, holding the same key again.
        client_c, c = _tier(cluster, listen=endpoint)
        try:
            c.store.put(state_key, blob(5))  # held, but not registered
            assert b.fetch(state_key, holders[1]) is None
            assert c.server.counters["stale_incarnation"] == 1
        finally:
            c.close()
            client_c.close()
        assert b.counters["misses"] == 2
    finally:
        b.close()
        client_a.close()
        client_b.close()


def test_split_and_pipelined_requests_are_answered_in_order(peer: PeerServer) -> None:
    """A request that arrives in pieces and two in one send take the generic reader; a
    whole request takes the peer's short path; the replies are the same. One with a data
    section (a request carries none) is refused."""
    for n in (1, 2):
        peer.store.put(skey(n), blob(n))
    sock = open_session(peer.endpoint, tenant="default", secret=SECRET, timeout_s=5, node="p")
    sock.settimeout(5)
    reader = MessageReader(limits=Limits(), replies=True)

    def reply() -> tuple[int, Status, bytes]:
        while (message := reader.next_message()) is None:
            got = sock.recv_into(reader.recv_buffer())
            assert got, "peer closed before answering"
            reader.commit(got)
        return message.header.request_id, message.header.status, bytes(message.data)

    one, two = get_request(7, [(skey(1), 42)]), get_request(8, [(skey(2), 42)])
    sock.sendall(one)  # whole
    assert reply() == (7, Status.OK, blob(1))
    sock.sendall(one[:20])  # in two pieces
    assert reader.next_message() is None
    sock.sendall(one[20:])
    assert reply() == (7, Status.OK, blob(1))
    sock.sendall(one + two)  # two at once
    assert [reply(), reply()] == [(7, Status.OK, blob(1)), (8, Status.OK, blob(2))]
    header = Header.unpack(two[:HEADER_BYTES])  # with a 3-byte data section: refused
    padded = Header(op=Op.SWA_GET, request_id=9, count=header.count, data_len=3)
    sock.sendall(padded.pack() + two[HEADER_BYTES:] + b"abc")
    assert reply()[1] is Status.BAD_REQUEST
    sock.close()
    assert peer.counters["requests"] == 4 and peer.counters["bad_requests"] == 1


def test_thousands_of_pipelined_requests_are_answered_one_after_another(
    peer: PeerServer, transport: TcpPeerTransport
) -> None:
    """3,000 requests sent at once, each answered (BAD_REQUEST: an SWA peer answers no GET)
    in order on a connection that stays open, and the peer serves on: each reply used to
    answer the next request from inside its own send, a stack frame a request."""
    count = 3000
    sock = open_session(peer.endpoint, tenant="default", secret=SECRET, timeout_s=5, node="p")
    sock.settimeout(10)
    reader = MessageReader(limits=Limits(), replies=True)
    sock.sendall(
        b"".join(Header(op=Op.GET, request_id=i + 1, count=0).pack() for i in range(count))
    )
    ids = []
    while len(ids) < count:
        while (message := reader.next_message()) is not None:
            assert message.header.status is Status.BAD_REQUEST
            ids.append(message.header.request_id)
        if len(ids) < count:
            got = sock.recv_into(reader.recv_buffer())
            assert got, f"peer closed after {len(ids)} replies"
            reader.commit(got)
    assert ids == list(range(1, count + 1))
    sock.close()
    peer.store.put(skey(3), blob(3))
    got = transport.fetch(
        peer.endpoint, [Wanted(skey(3), 42, state_digest(blob(3)))], deadline=soon()
    )
    assert [None if g is None else bytes(g) for g in got] == [blob(3)]


def _answer_handshake(conn: socket.socket) -> None:
    """The holder's side of the session handshake, as the worker's tenant."""
    handshake = ServerHandshake({TENANT.name: TENANT}.get)
    conn.sendall(handshake.hello())
    auth = b""
    while len(auth) < AUTH_BYTES:
        auth += conn.recv(AUTH_BYTES - len(auth))
    conn.sendall(handshake.answer(auth)[0])


def test_a_kept_connection_keeps_a_shorter_deadline_too(transport: TcpPeerTransport) -> None:
    """A connection armed for a long fetch, then used for a short one against a holder that
    has stopped answering, still gives up at the short one's deadline."""
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    release = threading.Event()

    def holder() -> None:  # answers the first request, then reads and keeps silent
        conn, _ = listener.accept()
        with conn:
            _answer_handshake(conn)
            reader = MessageReader(limits=Limits())
            for answered in range(2):
                while (message := reader.next_message()) is None:
                    reader.commit(conn.recv_into(reader.recv_buffer()))
                if not answered:
                    state = blob(1)
                    reply = get_reply(
                        message.header.request_id, [(Status.OK, len(state), state_digest(state))]
                    )
                    conn.sendall(reply + state)
            release.wait(30)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    try:
        first = transport.fetch(endpoint, [Wanted(skey(1), 1)], deadline=soon(30))
        assert first[0] is not None and bytes(first[0]) == blob(1)
        started = time.monotonic()
        second = transport.fetch(endpoint, [Wanted(skey(1), 1)], deadline=started + 0.3)
        elapsed = time.monotonic() - started
    finally:
        release.set()
        thread.join(10)
        listener.close()
    assert second == [None]
    assert 0.29 <= elapsed < 1.0  # the 30 s bound of the first fetch did not carry over
    assert transport.counters["timeouts"] == 1


def test_the_tiers_api_refuses_wrong_arguments_and_a_second_life(cluster: LocalCluster) -> None:
    """Wrong types are ArgumentErrors (an int state was stored as that many zero bytes, a
    read-only ``out`` made a silent miss); a second start returns the endpoint, a start after
    close is a ClosedError (was a KeyError, then an epoll error)."""
    client, tier = _tier(cluster)
    try:
        assert tier.start() == tier.endpoint
        key = skey(77)
        for bad_state in (5, "state"):
            with pytest.raises(ArgumentError, match="bytes-like"):
                tier.put(key, bad_state)  # type: ignore[arg-type]
        assert tier.store.get(key) is None  # nothing was stored
        tier.put(key, blob(77, 1000))
        with pytest.raises(ArgumentError, match="StateKey"):
            tier.fetch("key")  # type: ignore[arg-type]
        for bad_holders in ("abc", [1, 2]):
            with pytest.raises(ArgumentError, match="HolderRecords"):
                tier.fetch(key, bad_holders)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="writable"):
            tier.fetch(key, out=bytes(1000))  # type: ignore[arg-type]
        strided = memoryview(bytearray(2000))[::2]  # held here: a local hit (was TypeError)
        with pytest.raises(ArgumentError, match="contiguous"):
            tier.fetch(key, out=strided)
        with pytest.raises(ArgumentError, match="writable"):
            tier.fetch(key, out=12)  # type: ignore[arg-type]
        for bad_time in ("x", float("nan"), -1.0):
            with pytest.raises(ArgumentError, match="seconds"):
                tier.fetch(key, timeout_s=bad_time)  # type: ignore[arg-type]
            with pytest.raises(ArgumentError, match="seconds"):
                tier.flush(bad_time)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="Namespace"):
            tier.lookup("ns", list(range(64)))  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="sequence of ints"):
            tier.lookup(MAIN_NS, b"\x00" * 64)  # type: ignore[arg-type]
        got = tier.fetch(key)
        assert got is not None and bytes(got) == blob(77, 1000)
    finally:
        tier.close()
        client.close()
    with pytest.raises(ClosedError):
        tier.start()


def _scripted_holder(
    answer: list[tuple[float, float]], state: bytes
) -> tuple[str, Callable[[], None]]:
    """A holder with the tenant's secret that answers each request with ``state`` after a
    pause, in pieces of 64 KiB each followed by a pause: ``answer[i]`` = (pause first,
    pause per piece). Returns its endpoint and a stop function."""
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    stop = threading.Event()

    def holder() -> None:
        conn, _ = listener.accept()
        with conn:
            _answer_handshake(conn)
            reader = MessageReader(limits=Limits())
            with contextlib.suppress(OSError):
                for first, per_piece in answer:
                    while (message := reader.next_message()) is None:
                        reader.commit(conn.recv_into(reader.recv_buffer()))
                    stop.wait(first)
                    reply = get_reply(
                        message.header.request_id, [(Status.OK, len(state), state_digest(state))]
                    )
                    data = reply + state
                    for at in range(0, len(data), 64 << 10):
                        conn.sendall(data[at : at + (64 << 10)])
                        if stop.wait(per_piece):
                            return
            stop.wait(30)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join(10)
        listener.close()

    return endpoint, close


def test_a_trickling_holder_costs_the_deadline_and_not_twice_it(
    transport: TcpPeerTransport,
) -> None:
    """A holder sending a piece per 0.45 s kept a 0.5 s fetch for about 0.95 s: each receive
    of the native loop could wait the whole bound armed at the fetch's start."""
    state = blob(3, 1 << 20)
    endpoint, close = _scripted_holder([(0.0, 0.45)], state)
    try:
        started = time.monotonic()
        got = transport.fetch(endpoint, [Wanted(skey(1), 1)], deadline=started + 0.5)
        elapsed = time.monotonic() - started
    finally:
        close()
    assert got == [None]
    assert 0.49 <= elapsed < 0.5 * 1.1 + 0.1


def test_a_slow_fetch_leaves_no_short_bound_to_the_next_on_its_connection(
    transport: TcpPeerTransport,
) -> None:
    """A fetch that finishes late arms its connection's receive bound to the little time it
    had left; the next fetch on the connection arms its own again (else a holder pausing
    longer than that first bound, with the same timeout, was a spurious miss)."""
    state = blob(4, 1 << 20)
    endpoint, close = _scripted_holder([(0.0, 0.06), (1.0, 0.0)], state)
    try:
        first = transport.fetch(endpoint, [Wanted(skey(1), 1)], deadline=soon(1.5))
        assert first[0] is not None and bytes(first[0]) == state
        second = transport.fetch(endpoint, [Wanted(skey(1), 1)], deadline=soon(1.5))
        assert second[0] is not None and bytes(second[0]) == state
    finally:
        close()


def test_a_peers_refusal_keeps_its_reason_and_big_batches_are_split(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer refusing a request it could not read answers with an op of its own, and the
    fetcher dropped its reason ("answered STATS, not SWA_GET"); a batch over the items limit
    is now cut to fit it."""
    store = SwaStore(max_bytes=1 << 20)
    for n in range(10):
        store.put(skey(n), blob(n, 1000))
    wanted = [Wanted(skey(n), 42) for n in range(10)]
    with PeerServer(store, tenant=TENANT, incarnation=42, limits=Limits(max_items=4)) as server:
        server.start()
        with TcpPeerTransport(tenant="default", secret=SECRET) as t, caplog.at_level("INFO"):
            assert t.fetch(server.endpoint, wanted, deadline=soon()) == [None] * 10
            assert t.counters["errors"] == 1
        assert "exceed the limit of 4" in caplog.text
        with TcpPeerTransport(tenant="default", secret=SECRET, limits=Limits(max_items=4)) as t:
            got = t.fetch(server.endpoint, wanted, deadline=soon())
        assert [None if g is None else bytes(g) for g in got] == [blob(n, 1000) for n in range(10)]
        assert server.counters["states_served"] == 10


def test_a_closed_transport_starts_no_threads() -> None:
    t = TcpPeerTransport(tenant="default", secret=SECRET)
    t.close()
    before = {thread.name for thread in threading.enumerate()}
    requests = [
        ("tcp://127.0.0.1:1", Wanted(skey(1), 1)),
        ("tcp://127.0.0.1:2", Wanted(skey(2), 1)),
    ]
    assert t.fetch_many(requests, deadline=soon()) == [None, None]
    assert {thread.name for thread in threading.enumerate()} == before


def test_a_wildcard_listen_needs_an_advertised_endpoint() -> None:
    for listen in ("tcp://0.0.0.0:0", "tcp://[::]:7000"):
        with pytest.raises(ConfigError, match="advertise"):
            SwaConfig(listen=listen)
    assert SwaConfig(listen="tcp://0.0.0.0:0", advertise="tcp://10.0.0.5:7100").advertise
    with pytest.raises(ConfigError, match="not reachable"):
        SwaConfig(listen="tcp://0.0.0.0:0", advertise="tcp://0.0.0.0:7100")


def test_a_state_over_the_reply_limit_is_held_but_not_advertised(cluster: LocalCluster) -> None:
    """A state no peer could fetch (its reply would pass the wire's data limit) was
    advertised, and every peer that found the record paid a round trip for a sure miss."""
    client, tier = _tier(cluster)
    try:
        tier.start()
        tier.server.limits = Limits(max_data_bytes=50_000)  # the wire limit, made small
        big, small = skey(80), skey(81)
        assert tier.put(big, blob(80, 60_000)) is not None
        assert tier.put(small, blob(81, 1000)) is not None
        assert tier.flush(10)
        assert tier.counters["unpublished_too_large"] == 1
        got = tier.fetch(big)  # still served here
        assert got is not None and bytes(got) == blob(80, 60_000)
        _, holders = tier.directory.lookup_keys([big.block, small.block])
        assert sorted(holders) == [1]  # only the small state's record
    finally:
        tier.close()
        client.close()


def test_an_idle_connection_after_pipelined_requests_is_not_cut_off() -> None:
    """Two requests in one send whose replies could not go out at once: the second was
    answered later, from the send path, and the connection kept the first's start time, so
    once idle it was cut off as a request too slow to arrive."""
    store = SwaStore(max_bytes=64 << 20)
    for n in (1, 2):
        store.put(skey(n), blob(n, 12 << 20))  # larger than the socket's send buffer
    with PeerServer(store, tenant=TENANT, incarnation=42, request_timeout_s=0.3) as server:
        server.start()
        sock = open_session(server.endpoint, tenant="default", secret=SECRET, timeout_s=5, node="p")
        sock.settimeout(10)
        reader = MessageReader(limits=Limits(max_data_bytes=64 << 20), replies=True)

        def reply() -> tuple[int, Status]:
            while (message := reader.next_message()) is None:
                got = sock.recv_into(reader.recv_buffer())
                assert got, "the peer closed the connection"
                reader.commit(got)
            return message.header.request_id, message.header.status

        one, two = get_request(7, [(skey(1), 42)]), get_request(8, [(skey(2), 42)])
        sock.sendall(one + two)
        assert [reply(), reply()] == [(7, Status.OK), (8, Status.OK)]
        idle_until = time.monotonic() + 1.0  # past the request's grace, with nothing sent
        while time.monotonic() < idle_until:
            time.sleep(0.1)
        sock.sendall(one)
        assert reply() == (7, Status.OK)
        sock.close()
        assert server.counters["requests_cut_off"] == 0
