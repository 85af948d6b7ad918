"""The selector loops' shared plumbing (``kvcache.net_loop``) on real sockets: a send queue
that a full socket buffer interrupts and that resumes where it stopped, native segments,
the wake-up pipe, the listener and the selector registration."""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvcache import native
from kvcache.errors import KVCacheError
from kvcache.net_loop import SendQueue, WakePipe, accept_ready, bind_listener, watch


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    listener, endpoint = bind_listener("tcp://127.0.0.1:0", backlog=4, what="test endpoint")
    port = int(endpoint.rsplit(":", 1)[1])
    client = socket.create_connection(("127.0.0.1", port))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    assert selector.select(5)
    ((server, _),) = list(accept_ready(listener))
    selector.close()
    listener.close()
    assert not server.getblocking()
    assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    yield server, client
    server.close()
    client.close()


def _drain(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        assert n, "closed early"
        got += n
    return bytes(buf)


def test_a_full_socket_stops_the_queue_and_the_rest_follows_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, 8 << 20, np.uint8)  # far more than the socket buffers hold
    header = b"H" * 48
    words = np.arange(10, dtype=np.uint32)  # not a byte format: cast, not copied
    queue = SendQueue()
    queue.extend([header, b"", words, big])
    assert len(queue) == 3  # the empty section is dropped
    first = queue.flush(server)
    assert 0 < first < 48 + 40 + big.nbytes and queue  # the socket took part of it
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(_drain(client, 48 + 40 + big.nbytes)))
    reader.start()
    total = first
    selector = selectors.DefaultSelector()
    events = watch(selector, server, 0, selectors.EVENT_WRITE, None)
    while queue:
        assert selector.select(10)
        total += queue.flush(server)
    events = watch(selector, server, events, 0, None)
    assert events == 0 and not selector.get_map()
    selector.close()
    reader.join(10)
    assert total == 48 + 40 + big.nbytes
    assert received == [header + words.tobytes() + big.tobytes()]


@pytest.mark.skipif(not native.AVAILABLE, reason="the native library is not built")
def test_native_segments_go_out_between_plain_sections(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    parts = [np.full(n, i + 1, np.uint8) for i, n in enumerate((1000, 0, 70_000, 5))]
    seg = native.Segments.of(
        [native.addresses_of(p) for p in parts], [p.nbytes for p in parts], parts
    )
    queue = SendQueue()
    queue.extend([b"head", seg, native.Segments.of([], [], None), b"tail"])
    assert len(queue) == 3  # empty segments are dropped
    size = 4 + seg.nbytes + 4
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(_drain(client, size)))
    reader.start()
    selector = selectors.DefaultSelector()
    watch(selector, server, 0, selectors.EVENT_WRITE, None)
    while queue:
        queue.flush(server)
        if queue:
            assert selector.select(10)
    selector.close()
    reader.join(10)
    assert received == [b"head" + b"".join(p.tobytes() for p in parts) + b"tail"]


def test_a_failed_connection_raises_and_clear_drops_the_rest(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    client.close()  # a reset, not a clean close
    queue = SendQueue()
    queue.extend([bytes(1 << 20)] * 4)
    with pytest.raises(OSError):
        for _ in range(100):
            queue.flush(server)
    queue.clear()
    assert not queue and queue.flush(server) == 0


def test_the_wake_pipe_interrupts_a_select_until_drained() -> None:
    wake = WakePipe()
    selector = selectors.DefaultSelector()
    selector.register(wake, selectors.EVENT_READ)
    try:
        assert selector.select(0) == []
        threading.Thread(target=wake.wake).start()
        ((key, _),) = selector.select(10)
        assert key.fileobj is wake
        wake.wake()  # several wake-ups, one drain
        wake.drain()
        assert selector.select(0) == []
    finally:
        selector.close()
        wake.close()
        wake.close()  # idempotent
        wake.wake()  # closed: nothing happens
    assert wake.fileno() == -1


def test_the_listener_names_what_it_could_not_bind() -> None:
    taken, endpoint = bind_listener("tcp://127.0.0.1:0", backlog=1, what="test endpoint")
    try:
        with pytest.raises(KVCacheError, match=f"cannot bind test endpoint {endpoint}"):
            bind_listener(endpoint, backlog=1, what="test endpoint")
        with pytest.raises(KVCacheError, match=r"^test endpoint: "):
            bind_listener("udp://nowhere", backlog=1, what="test endpoint")
    finally:
        taken.close()
