"""Real ``kvcache server`` processes on loopback with real LMDB directories."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_fixtures import (
    DaemonProcess,
    block_records,
    get_items,
    http,
    put_items,
    wait_until,
)

from kvcache.errors import AuthError, NodeError
from kvcache.retention import DAY_S
from kvcache.server.probe import NodeRefusedError, Probe
from kvcache.session import HELLO_BYTES
from kvcache.shard import split_shard
from kvcache.wire import (
    NO_INDEX,
    Header,
    Limits,
    Message,
    Op,
    Status,
    encode,
    join,
    make_items,
    parse_endpoint,
)

pytestmark = pytest.mark.timeout(120)


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def good_client_served(daemon: DaemonProcess, n: int = 7) -> None:
    """A well-behaved client must still be served after whatever came before."""
    with daemon.probe(timeout_s=10) as probe:
        shards = block_records(key(10_000 + n), indices=[0, 1])
        assert probe.put(shards).tolist() == [Status.OK, Status.OK]
        status, records = probe.get([(k, i) for k, i, _ in shards])
        assert status.tolist() == [Status.OK, Status.OK]
        assert records == [r for _, _, r in shards]
    assert daemon.alive()


def error_count(daemon: DaemonProcess, kind: str) -> int:
    return int(daemon.stats()["errors"].get(kind, 0))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the tests that do not harm it; small limits make bad input cheap."""
    root = tmp_path_factory.mktemp("daemon")
    proc = DaemonProcess(root, server={"max_data_bytes": 1 << 20, "max_items": 512})
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log()


def test_batched_round_trip(daemon: DaemonProcess) -> None:
    keys = [key(n) for n in range(32)]
    shards = [s for k in keys for s in block_records(k, body_len=1024)]
    with daemon.probe() as probe:
        assert probe.put(shards).tolist() == [Status.OK] * len(shards)
        status, records = probe.get([(k, i) for k, i, _ in shards] + [(key(999), 0)])
        assert status.tolist() == [Status.OK] * len(shards) + [Status.NOT_FOUND]
        assert records[:-1] == [r for _, _, r in shards]
        held = probe.has([*keys, key(999)])
        stripe = split_shard(shards[0][2])[0].stripe_id
        assert held[keys[0]] == dict.fromkeys(range(12), stripe)
        assert held[key(999)] == {}
        assert probe.touch([*keys[:2], key(999)], traffic_class="chat").tolist() == [0, 0, 1]
        assert probe.delete([(keys[0], 0, NO_INDEX), (keys[1], 0, 3)]).tolist() == [0, 0]
        assert probe.has(keys[:2]) == {
            keys[0]: {},
            keys[1]: {i: held[keys[1]][i] for i in range(12) if i != 3},
        }
        stats = probe.stats()
    assert stats["node_id"] == "test-node"
    assert stats["usage"]["tenants"]["default"]["shards"] == stats["usage"]["shards"]
    assert stats["usage"]["shards"] >= len(shards) - 13
    assert stats["requests"]["put"] >= 1
    status_code, body = http("GET", daemon.admin + "/metrics")
    text = body.decode()
    assert status_code == 200
    for name in (
        'kvcache_server_requests_total{op="get"}',
        'kvcache_server_request_seconds_bucket{op="put",le="+Inf"}',
        'kvcache_server_class_bytes{class="chat"}',
        "kvcache_server_expired_shards_total",
        "kvcache_server_evicted_shards_total",
        "kvcache_server_segments_dropped_total",
        "kvcache_server_compacted_shards_total",
        'kvcache_server_items_total{op="get",status="not_found"}',
        'kvcache_server_tenant_bytes{tenant="default",class="chat"}',
    ):
        assert name in text, name


def test_pipelined_requests_are_answered_in_order(daemon: DaemonProcess) -> None:
    """Several requests in flight on one socket: PUTs queued together share a transaction."""
    blocks = [block_records(key(7000 + n), body_len=4096) for n in range(6)]
    with daemon.probe() as probe:
        for n, shards in enumerate(blocks):
            items, data = put_items(shards)
            probe.send_raw(
                join(encode(Header(op=Op.PUT, request_id=100 + n, count=12), items, data))
            )
        wanted = [(k, i) for shards in blocks for k, i, _ in shards]
        get = get_items(wanted)
        probe.send_raw(join(encode(Header(op=Op.GET, request_id=200, count=len(get)), get)))
        replies: list[Message] = []
        for _ in range(len(blocks) + 1):
            reply = probe.recv_message()
            assert reply is not None
            replies.append(reply)
    assert [r.header.request_id for r in replies] == [*range(100, 106), 200]
    for reply in replies[:-1]:
        assert reply.header.status == Status.OK
        assert reply.items["status"].tolist() == [Status.OK] * 12
    assert replies[-1].items["status"].tolist() == [Status.OK] * len(wanted)
    assert bytes(replies[-1].data) == b"".join(r for shards in blocks for _, _, r in shards)


def _exchange(daemon: DaemonProcess, raw: bytes, *, timeout_s: float = 5.0) -> Message | None:
    """Send ``raw`` on an authenticated connection, close our side, and read one reply."""
    with daemon.probe() as probe:
        probe.send_raw(raw)
        probe.sock.shutdown(socket.SHUT_WR)
        reply = probe.recv_message(timeout_s)
        # After a message it could not parse, the daemon closes the connection.
        assert probe.recv_message(timeout_s) is None
        return reply


def _valid_has() -> bytes:
    items = make_items(Op.HAS, 1, reply=False)
    return join(encode(Header(op=Op.HAS, request_id=77, count=1), items))


def _mutate(offset: int, value: bytes) -> bytes:
    raw = bytearray(_valid_has())
    raw[offset : offset + len(value)] = value
    return bytes(raw)


def _bad_put_lengths() -> bytes:
    items = make_items(Op.PUT, 2, reply=False)
    items["length"] = [4, 4]
    raw = bytearray(join(encode(Header(op=Op.PUT, request_id=1, count=2), items, b"x" * 8)))
    items["length"] = [4, 5]  # the header says 8 bytes of data, the items 9
    raw[48 : 48 + items.nbytes] = items.tobytes()
    return bytes(raw)


BAD_MESSAGES = {
    "wrong_magic": lambda: _mutate(0, b"XX"),
    "wrong_version": lambda: _mutate(2, b"\x07"),
    "unknown_op": lambda: _mutate(3, b"\x42"),
    "unknown_flags": lambda: _mutate(4, b"\x80"),
    "reserved_field": lambda: _mutate(20, b"\x01"),
    "bad_class_field": lambda: _mutate(32, b"\x05AB"),
    "reply_flag_on_request": lambda: _mutate(4, b"\x01"),
    "too_many_items": lambda: join(
        encode(Header(op=Op.HAS, request_id=77, count=513), make_items(Op.HAS, 513, reply=False))
    ),
    "oversized_data": lambda: Header(op=Op.PUT, request_id=1, count=0, data_len=2 << 20).pack(),
    "lengths_disagree": _bad_put_lengths,
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_bad_message_gets_error_reply_and_counter(daemon: DaemonProcess, case: str) -> None:
    before = error_count(daemon, "bad_request")
    reply = _exchange(daemon, BAD_MESSAGES[case]())
    assert reply is not None, "no reply to a bad message"
    assert reply.header.status is Status.BAD_REQUEST
    assert reply.error_text().startswith("bad_request")
    wait_until(lambda: error_count(daemon, "bad_request") == before + 1, what="the counter")
    good_client_served(daemon)


def test_a_has_reply_of_many_shards_a_key_is_read_within_the_limits(
    daemon: DaemonProcess,
) -> None:
    """A node holding all 12 shards of 100 keys answers a HAS of them with 1,200 items,
    past a reader's 512-item limit on messages: a HAS reply carries an item per live shard,
    so readers bound it by 255 items an asked key, and the reply is read whole."""
    keys = [key(20_000 + n) for n in range(100)]
    with daemon.probe(limits=Limits(max_items=512, max_data_bytes=1 << 20)) as probe:
        for n in range(0, len(keys), 40):  # 480 shards a PUT: under the daemon's 512
            shards = [s for k in keys[n : n + 40] for s in block_records(k, body_len=64)]
            assert (probe.put(shards) == Status.OK).all()
        held = probe.has(keys)
    assert all(sorted(held[k]) == list(range(12)) for k in keys)


def test_thousands_of_pipelined_bad_requests_are_each_answered(daemon: DaemonProcess) -> None:
    """2,000 well-framed requests that carry a status (which a request must not), sent at
    once: each gets its own BAD_REQUEST, in order, on a connection that stays open, and
    the daemon serves on. (Each error reply used to parse the next request from inside its
    own send, a stack frame a request: the daemon died of a RecursionError at 328.)"""
    count = 2000
    before = error_count(daemon, "bad_request")
    raw = b"".join(
        Header(op=Op.HAS, request_id=i + 1, count=0, status=Status.NOT_FOUND).pack()
        for i in range(count)
    )
    with daemon.probe() as probe:
        probe.send_raw(raw)
        ids = []
        for _ in range(count):
            reply = probe.recv_message(10.0)
            assert reply is not None, f"no reply after {len(ids)}"
            assert reply.header.status is Status.BAD_REQUEST
            ids.append(reply.header.request_id)
        assert ids == list(range(1, count + 1))
        # The connection is still open and serves a good request.
        probe.send_raw(_valid_has())
        reply = probe.recv_message(10.0)
        assert reply is not None and reply.header.status is Status.OK
    wait_until(lambda: error_count(daemon, "bad_request") == before + count, what="the counter")
    good_client_served(daemon)


def test_connections_closed_for_bad_requests_give_their_slots_back(tmp_path: Path) -> None:
    """A tenant allowed 4 connections sends a malformed request on each of 6 in turn (each
    answered BAD_REQUEST and closed): every closed one gives its slot back, so the tenant
    still connects. At its limit, a fifth connection is refused with a RESULT that says
    so (KVNO, busy: a NodeError the client retries, not an AuthError)."""
    daemon = DaemonProcess(tmp_path, server={"tenant_connections": 4})
    with daemon:
        for _ in range(6):
            with daemon.probe("alice") as probe:
                probe.send_raw(b"XX" + bytes(46))  # bad magic: BAD_REQUEST, then closed
                reply = probe.recv_message(5.0)
                assert reply is not None and reply.header.status is Status.BAD_REQUEST
                assert probe.recv_message(5.0) is None
        wait_until(lambda: daemon.stats()["connections"] == 0, what="the closes")
        good_client_served(daemon)
        held = [daemon.probe("alice") for _ in range(4)]
        try:
            with pytest.raises(NodeError, match="connection limit"):
                daemon.probe("alice")
            assert error_count(daemon, "tenant_connection_limit") == 1
        finally:
            for probe in held:
                probe.close()
        wait_until(lambda: daemon.stats()["connections"] == 0, what="the closes")
        with daemon.probe("alice") as probe:  # every slot came back
            assert probe.has([key(1)]) == {key(1): {}}


def test_a_request_admission_holds_back_is_not_cut_off_as_slow(tmp_path: Path) -> None:
    """A tenant's large PUT is arriving and holds more than the tenant's in-flight share;
    its small PUT on another connection, sent whole, waits unread (inflight_paused). Held
    back past the slow-request grace, it is not cut off as slow (the wait is the daemon's
    doing), and once the large PUT is in, it is answered."""
    grace = 0.5
    daemon = DaemonProcess(
        tmp_path, server={"tenant_inflight_bytes": 4 << 20, "request_grace_s": grace}
    )
    big = 12 << 20
    with daemon, daemon.probe("alice") as large, daemon.probe("alice") as small:
        items = make_items(Op.PUT, 1, reply=False)
        items["key"] = key(1)
        items["length"] = big
        head = Header(op=Op.PUT, request_id=1, count=1, data_len=big)
        large.send_raw(head.pack() + items.tobytes())
        large.send_raw(bytes(8 << 20))  # 8 of its 12 MiB: over alice's 4 MiB share
        wait_until(lambda: daemon.stats()["inflight_bytes"] >= 4 << 20, what="the bytes")
        shards = block_records(key(2), indices=[0])
        put, data = put_items(shards)
        small.send_raw(join(encode(Header(op=Op.PUT, request_id=2, count=1), put, data)))
        wait_until(lambda: error_count(daemon, "inflight_paused") >= 1, what="the pause")
        time.sleep(4 * grace)  # what is tested: time passing past the grace cuts nothing
        assert error_count(daemon, "slow_request") == 0
        large.send_raw(bytes(big - (8 << 20)))
        reply = large.recv_message(10.0)
        assert reply is not None and reply.items["status"].tolist() == [Status.BAD_ITEM]
        reply = small.recv_message(10.0)
        assert reply is not None and reply.items["status"].tolist() == [Status.OK]
        assert error_count(daemon, "slow_request") == 0


@pytest.mark.parametrize("cut", [10, 47, 48 + 8])
def test_truncated_message_costs_only_its_connection(daemon: DaemonProcess, cut: int) -> None:
    """A request cut short by its client's close costs that connection, and is counted."""
    before = daemon.stats()["disconnects"]
    truncated = error_count(daemon, "truncated")
    assert _exchange(daemon, _valid_has()[:cut], timeout_s=2.0) is None
    wait_until(lambda: daemon.stats()["disconnects"] > before, what="the disconnect")
    wait_until(lambda: error_count(daemon, "truncated") == truncated + 1, what="the count")
    good_client_served(daemon)


def test_a_put_cut_short_is_counted_and_stores_nothing(daemon: DaemonProcess) -> None:
    """A PUT's header and part of its data, then the client closes: the daemon counts it
    as truncated (whichever of its loops was reading it), and stores nothing of it."""
    truncated = error_count(daemon, "truncated")
    shards = block_records(key(30_000), indices=[0, 1])
    items, data = put_items(shards)
    raw = join(encode(Header(op=Op.PUT, request_id=5, count=2), items, data))
    with daemon.probe() as probe:
        probe.send_raw(raw[: len(raw) - 100])
    wait_until(lambda: error_count(daemon, "truncated") == truncated + 1, what="the count")
    with daemon.probe() as probe:
        assert probe.has([key(30_000)]) == {key(30_000): {}}
    good_client_served(daemon)


def test_clients_without_credentials_are_refused(daemon: DaemonProcess) -> None:
    """No handshake, a wrong secret, another tenant's name: nothing is served or stored."""
    before = error_count(daemon, "unauthorized")
    host, port = parse_endpoint(daemon.data)
    # A client that skips the handshake and just sends requests.
    shards = block_records(key(4242), indices=[0])
    items, data = put_items(shards)
    with socket.create_connection((host, port), timeout=5) as sock:
        assert len(sock.recv(HELLO_BYTES, socket.MSG_WAITALL)) == HELLO_BYTES
        sock.sendall(join(encode(Header(op=Op.PUT, request_id=1, count=1), items, data)))
        answer = sock.recv(4096)
        assert answer[:4] == b"KVNO"
        try:
            rest = sock.recv(4096)
        except ConnectionResetError:  # closed with our unread request still in its buffer
            rest = b""
        assert rest == b""
    with pytest.raises(AuthError):
        Probe(daemon.data, tenant="default", secret=b"w" * 32)
    with pytest.raises(AuthError):
        Probe(daemon.data, tenant="mallory", secret=b"w" * 32)
    wait_until(lambda: error_count(daemon, "unauthorized") == before + 3, what="the refusals")
    with daemon.probe() as probe:
        assert probe.has([key(4242)])[key(4242)] == {}
    good_client_served(daemon)


def test_tenants_never_see_each_other(daemon: DaemonProcess) -> None:
    shards = block_records(key(777))
    with daemon.probe("default") as owner, daemon.probe("alice") as other:
        assert owner.put(shards).tolist() == [0] * 12
        # The other tenant knows the key: it can neither see, read, delete nor overwrite it.
        assert other.has([key(777)])[key(777)] == {}
        assert other.get([(key(777), 0)])[0].tolist() == [Status.NOT_FOUND]
        assert other.delete([(key(777), 0, NO_INDEX)]).tolist() == [Status.NOT_FOUND]
        forged = block_records(key(777), seed=5)
        assert other.put(forged).tolist() == [0] * 12  # stored, but as alice's own block
        status, records = owner.get([(k, i) for k, i, _ in shards])
        assert status.tolist() == [0] * 12 and records == [r for _, _, r in shards]
    tenants = daemon.stats()["usage"]["tenants"]
    assert tenants["default"]["shards"] >= 12 and tenants["alice"]["shards"] >= 12
    # Over the data path a tenant's STATS lists its own usage, not the other tenants'.
    with daemon.probe("alice") as other:
        seen = other.stats()["usage"]
    assert set(seen["tenants"]) == {"alice"}
    assert seen["shards"] == daemon.stats()["usage"]["shards"]  # node totals stay


def test_bad_items_fail_alone_and_are_counted(daemon: DaemonProcess) -> None:
    good = block_records(key(500), indices=[0, 1, 2])
    corrupt = bytearray(good[1][2])
    corrupt[-5] ^= 0xFF
    foreign = block_records(key(501), indices=[2])[0][2]
    before = {k: error_count(daemon, k) for k in ("checksum", "wrong_key", "bad_item")}
    with daemon.probe() as probe:
        status = probe.put(
            [good[0], (key(500), 1, bytes(corrupt)), (key(500), 2, foreign), (key(500), 3, b"junk")]
        )
        assert status.tolist() == [Status.OK, Status.CHECKSUM, Status.WRONG_KEY, Status.BAD_ITEM]
        status, _ = probe.get([(key(500), 0), (key(500), 300)])
        assert status.tolist() == [Status.OK, Status.BAD_ITEM]
        assert set(probe.has([key(500)])[key(500)]) == {0}
    after = {k: error_count(daemon, k) for k in before}
    assert after == {
        "checksum": before["checksum"] + 1,
        "wrong_key": before["wrong_key"] + 1,
        "bad_item": before["bad_item"] + 2,
    }
    good_client_served(daemon)


def test_reply_over_the_data_limit_is_refused(daemon: DaemonProcess) -> None:
    shards = block_records(key(600), body_len=128 << 10)  # 12 x 128 KiB > 1 MiB limit
    with daemon.probe() as probe:
        assert probe.put(shards[:6]).tolist() == [0] * 6
        assert probe.put(shards[6:]).tolist() == [0] * 6
        with pytest.raises(NodeRefusedError) as refused:
            probe.get([(k, i) for k, i, _ in shards])
        assert refused.value.status is Status.TOO_LARGE
    good_client_served(daemon)


def test_admin_changes_need_the_admin_token(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path) as daemon:
        token = daemon.admin_token
        policy = {"classes": {"agent": "1d", "chat": "2d"}, "default_class": "chat"}
        assert http("PUT", daemon.admin + "/retention", policy)[0] == 401
        assert http("PUT", daemon.admin + "/retention", policy, token="nope-nope")[0] == 401
        assert http("DELETE", daemon.admin + "/retention")[0] == 401
        status, body = http("PUT", daemon.admin + "/retention", policy, token=token)
        assert status == 200 and json.loads(body)["classes"] == {"agent": DAY_S, "chat": 2 * DAY_S}
        assert json.loads(http("GET", daemon.admin + "/retention")[1])["default_class"] == "chat"
        assert http("PUT", daemon.admin + "/retention", {"classes": {}}, token=token)[0] == 400
        assert http("POST", daemon.admin + "/debug/clock", {"offset_s": 1}, token=token)[0] == 404
        assert error_count(daemon, "admin_unauthorized") == 3
        assert daemon.stop() == 0


def test_without_an_admin_token_admin_changes_are_refused(tmp_path: Path) -> None:
    from kvcache.credentials import Credentials

    creds = Credentials(tenants=Credentials.generate().tenants)
    with DaemonProcess(tmp_path, credentials=creds) as daemon:
        policy = {"classes": {"agent": "1s"}}
        assert http("PUT", daemon.admin + "/retention", policy, token="anything-at-all")[0] == 403
        assert daemon.stop() == 0


def test_default_daemon_generates_private_credentials(tmp_path: Path) -> None:
    """`kvcache server` with no credentials configured makes its own, readable by root only."""
    with DaemonProcess(tmp_path, server={"credentials_file": ""}) as daemon:
        path = daemon.data_dir / "credentials.toml"
        assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
        from kvcache.credentials import Credentials

        generated = Credentials.load(path)
        with Probe(daemon.data, tenant="default", secret=generated.tenant("default").secret) as p:  # type: ignore[union-attr]
            assert p.has([key(1)])[key(1)] == {}
        with pytest.raises(AuthError):
            daemon.probe()  # the fixture's own credentials are not the daemon's
        assert daemon.stop() == 0


def test_map_full_refuses_the_batch_and_keeps_serving(tmp_path: Path) -> None:
    server = {"capacity_bytes": 1 << 30, "map_size_bytes": 1 << 20}
    with DaemonProcess(tmp_path, server=server) as daemon, daemon.probe() as probe:
        # Store format v4 keeps records in segment files: only index rows fill the map.
        big = [s for n in range(2, 1200) for s in block_records(key(n), body_len=64)]
        assert probe.put(big).tolist() == [Status.NO_SPACE] * len(big)
        assert probe.has([key(2)])[key(2)] == {}
        assert error_count(daemon, "map_full") == 1
        assert error_count(daemon, "no_space") == len(big)
        good_client_served(daemon)
        assert daemon.stop() == 0


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_disk_full_refuses_the_batch_and_keeps_serving(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes LMDB's writes past 4 MiB fail the way a full disk does."""
    with DaemonProcess(tmp_path, preexec=_limit_file_size) as daemon, daemon.probe() as probe:
        small = block_records(key(1), body_len=1024)
        assert probe.put(small).tolist() == [Status.OK] * 12
        big = block_records(key(2), body_len=512 << 10)  # 6 MiB in one batch
        assert probe.put(big).tolist() == [Status.NO_SPACE] * 12
        assert probe.has([key(2)])[key(2)] == {}
        # LMDB reports a short write as EIO, else ENOSPC: either refuses the batch.
        assert error_count(daemon, "disk_full") + error_count(daemon, "disk_io") == 1
        # A file may not grow to the map's size here: LMDB opened without writemap.
        assert daemon.stats()["lmdb_writemap"] is False
        assert "opens without writemap" in daemon.log()
        status, records = probe.get([(k, i) for k, i, _ in small])
        assert status.tolist() == [Status.OK] * 12 and records == [r for _, _, r in small]
        good_client_served(daemon)
        assert daemon.stop() == 0


_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def _on_a_small_tmpfs(path: Path, size: int) -> Callable[[], None]:
    """A daemon's preexec: a mount namespace of its own (and a user namespace when not root),
    in which ``path`` is a tmpfs of ``size`` bytes: a real file system that fills up."""
    uid, gid = os.getuid(), os.getgid()

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        root = os.geteuid() == 0
        if libc.unshare(_CLONE_NEWNS | (0 if root else _CLONE_NEWUSER)) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        if not root:
            Path("/proc/self/setgroups").write_text("deny")
            Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
            Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
        if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            raise OSError(ctypes.get_errno(), "making / private")
        options = f"size={size}".encode()
        if libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, options) != 0:
            raise OSError(ctypes.get_errno(), f"mounting a tmpfs on {path}")

    return preexec


def test_a_full_file_system_refuses_writes_and_never_kills_the_daemon(tmp_path: Path) -> None:
    """On a real file system that fills (a 24 MiB tmpfs), with LMDB writing through its map:
    PUTs are refused NO_SPACE once nothing more fits, the daemon keeps running and serving
    what it holds, and stops cleanly. (A store through the map into a hole a full disk
    cannot fill would be a SIGBUS: the file is allocated before every write transaction.)"""
    (tmp_path / "data").mkdir()
    server = {"capacity_bytes": 1 << 30, "max_items": 8192, "max_data_bytes": 8 << 20}
    daemon = DaemonProcess(
        tmp_path, server=server, preexec=_on_a_small_tmpfs(tmp_path / "data", 24 << 20)
    )
    with daemon, daemon.probe(timeout_s=10) as probe:  # entering it starts it
        stored: list[tuple[bytes, int, bytes]] = []
        refused = 0
        for n in range(400):
            # Small records, many to a PUT: the index grows about as fast as the segments.
            batch = [
                s
                for b in range(256)
                for s in block_records(key(n * 256 + b), body_len=64, indices=range(4))
            ]
            status = probe.put(batch).tolist()
            if status == [Status.OK] * len(batch):
                stored += batch
                continue
            assert set(status) == {Status.NO_SPACE}, set(status)
            refused += 1
            if refused == 5:
                break
        assert refused == 5, "the 24 MiB file system never filled"
        assert daemon.alive()
        assert error_count(daemon, "disk_full") + error_count(daemon, "disk_io") >= 5
        # Deletes on the full file system: LMDB copies every page it changes to a new one
        # (none freed in a transaction is reused by it), so these need pages past the end.
        keys = list(dict.fromkeys(k for k, _, _ in stored))
        gone, kept = keys[: len(keys) // 2], keys[len(keys) // 2 :]
        for at in range(0, len(gone), 4096):
            # Refused for want of room is fine, as long as the daemon lives.
            with contextlib.suppress(NodeRefusedError):
                probe.delete([(k, 0, NO_INDEX) for k in gone[at : at + 4096]])
            assert daemon.alive()
        still = set(kept)
        stored = [s for s in stored if s[0] in still]
        sample = stored[:: max(1, len(stored) // 400)]
        status_got, records = probe.get([(k, i) for k, i, _ in sample])
        assert status_got.tolist() == [Status.OK] * len(sample)
        assert records == [r for _, _, r in sample]
        assert daemon.stats()["lmdb_writemap"] is True
    assert daemon.stop() == 0


def test_kill_9_under_write_load_keeps_every_acknowledged_shard(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, server={"sync": "none"}).start()
    acked: list[tuple[bytes, int, bytes]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with daemon.probe(timeout_s=2) as probe:
                n = 0
                while not stop.is_set():
                    batch = [
                        s for b in range(8) for s in block_records(key(n * 8 + b), body_len=4096)
                    ]
                    n += 1
                    try:
                        status = probe.put(batch)
                    except Exception:
                        return  # the daemon died under us: what was acknowledged is in `acked`
                    acked.extend(
                        s for s, st in zip(batch, status.tolist(), strict=True) if st == Status.OK
                    )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    wait_until(lambda: len(acked) >= 96 * 20, timeout_s=60, what="20 acknowledged batches")
    daemon.kill()
    stop.set()
    thread.join(30)
    assert not errors
    count = len(acked)
    daemon.start()
    try:
        with daemon.probe() as probe:
            for start in range(0, count, 480):
                chunk = acked[start : start + 480]
                status, records = probe.get([(k, i) for k, i, _ in chunk])
                assert status.tolist() == [Status.OK] * len(chunk)
                for (_, _, expected), got in zip(chunk, records, strict=True):
                    assert got == expected
                    assert got is not None
                    split_shard(got)
            usage = probe.stats()["usage"]
        assert usage["shards"] >= count
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_retention_end_to_end_with_a_stepped_clock(tmp_path: Path) -> None:
    server = {"allow_clock_override": True}
    with DaemonProcess(tmp_path, server=server) as daemon, daemon.probe() as probe:
        token = daemon.admin_token
        agent = block_records(key(1), traffic_class="agent")
        chat = block_records(key(2), traffic_class="chat")
        hot = block_records(key(3), traffic_class="agent")
        assert probe.put(agent + chat + hot).tolist() == [0] * 36

        def step(seconds: float) -> None:
            status, body = http(
                "POST", daemon.admin + "/debug/clock", {"offset_s": seconds}, token=token
            )
            assert status == 200, body

        step(2 * DAY_S)
        assert probe.touch([key(3)], traffic_class="agent").tolist() == [0]  # slides to day 5
        step(3 * DAY_S + 60)
        held = probe.has([key(1), key(2), key(3)])
        assert held[key(1)] == {} and len(held[key(2)]) == 12 and len(held[key(3)]) == 12
        assert probe.get([(key(1), 0)])[0].tolist() == [Status.NOT_FOUND]
        wait_until(lambda: daemon.stats()["gc"]["expired_shards"] >= 12, what="the sweeper")
        step(5 * DAY_S + 60)
        assert probe.has([key(3)])[key(3)] == {}
        step(7 * DAY_S + 60)
        assert probe.has([key(2)])[key(2)] == {}
        wait_until(lambda: daemon.stats()["gc"]["expired_shards"] == 36, what="the sweeper")
        assert daemon.stats()["usage"]["shards"] == 0
        assert http("POST", daemon.admin + "/debug/clock", {"offset_s": 0})[0] == 401
        assert daemon.stop() == 0


def test_a_held_clock_reads_one_time_until_moved(tmp_path: Path) -> None:
    """``{"at_s": T}`` holds the daemon's clock at T (a replay at a trace's own times):
    every request is answered at T, by Python (the native plane reads wall time)."""
    server = {"allow_clock_override": True}
    with DaemonProcess(tmp_path, server=server) as daemon, daemon.probe() as probe:
        token, url = daemon.admin_token, daemon.admin + "/debug/clock"
        assert probe.put(block_records(key(1), traffic_class="agent")).tolist() == [0] * 12
        at = float(int(time.time()) + 3 * DAY_S + 60)  # past the write's 3-day TTL
        status, body = http("POST", url, {"at_s": at}, token=token)
        assert status == 200 and json.loads(body)["now"] == at, body
        assert probe.has([key(1)])[key(1)] == {}
        assert probe.get([(key(1), 0)])[0].tolist() == [Status.NOT_FOUND]
        assert probe.put(block_records(key(2), traffic_class="agent")).tolist() == [0] * 12
        assert len(probe.has([key(2)])[key(2)]) == 12
        for bad in ({"at_s": "x"}, {"at_s": True}, {"at_s": 1, "offset_s": 2}, {}, [1],
                    {"at_s": float("nan")}, {"at_s": 1e12}, {"at_s": -5},
                    {"offset_s": float("inf")}, {"offset_s": 2e9}):  # fmt: skip
            status, body = http("POST", url, bad, token=token)
            assert status == 400 and b"at_s" in body, (bad, body)
        status, body = http("POST", url, {"offset_s": 0}, token=token)
        assert status == 200 and abs(json.loads(body)["now"] - time.time()) < 60, body
        # Back at wall time, the shard written at the held time is live and key 1 is gone.
        assert len(probe.has([key(2)])[key(2)]) == 12 and probe.has([key(1)])[key(1)] == {}
        assert daemon.stop() == 0


def test_sigterm_during_requests_exits_zero(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path).start()
    shards = block_records(key(1), body_len=64 << 10)
    with daemon.probe(timeout_s=2) as probe:
        assert probe.put(shards).tolist() == [0] * 12
        probe.send_raw(join(encode(Header(op=Op.GET, request_id=5, count=12), _get_items(shards))))
        assert daemon.stop() == 0
    assert "LMDB closed" in daemon.log()
    # Restart: what was written is there.
    with daemon, daemon.probe() as probe:
        assert probe.get([(k, i) for k, i, _ in shards])[1] == [r for _, _, r in shards]


def _get_items(shards: list[tuple[bytes, int, bytes]]) -> np.ndarray:
    items = make_items(Op.GET, len(shards), reply=False)
    items["key"] = [s[0] for s in shards]
    items["index"] = [s[1] for s in shards]
    return items


def test_second_daemon_on_the_same_directory_refuses(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path) as daemon:
        other = DaemonProcess(tmp_path)
        with pytest.raises(AssertionError, match="exited with 1"):
            other.start()
        assert "in use" in other.log()
        assert daemon.alive()
    assert os.path.exists(tmp_path / "data" / "data.mdb")


def _rss_anon_kib(pid: int) -> int:
    """Heap and other anonymous memory of a process (LMDB's mapped file is not in it)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/PID/status")


def test_clients_that_never_read_replies_cost_bounded_memory(tmp_path: Path) -> None:
    """Eight clients each ask for 16 MiB and never read the replies: the daemon sends from
    its read transactions (no copies), so its anonymous memory hardly grows; it keeps serving
    others, and closes the stalled connections at the send timeout."""
    daemon = DaemonProcess(tmp_path, server={"send_timeout_s": 2.0, "max_data_bytes": 32 << 20})
    daemon.start()
    try:
        blocks = [block_records(key(50_000 + n), body_len=128 << 10) for n in range(12)]
        with daemon.probe(timeout_s=30) as probe:
            for shards in blocks:
                assert probe.put(shards).tolist() == [Status.OK] * 12
        wanted = [(k, i) for shards in blocks for k, i, _ in shards]  # 144 x 128 KiB = 18 MiB
        assert daemon.proc is not None
        before = _rss_anon_kib(daemon.proc.pid)
        stalled = []
        for n in range(8):
            probe = daemon.probe(timeout_s=30)
            probe.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            items = get_items(wanted)
            probe.send_raw(
                join(encode(Header(op=Op.GET, request_id=n + 1, count=len(items)), items))
            )
            stalled.append(probe)
        good_client_served(daemon)  # the loop still answers everyone else
        grown_mib = (_rss_anon_kib(daemon.proc.pid) - before) / 1024
        # 8 replies of 18 MiB unread would be 144 MiB if copied; views cost almost nothing.
        print(f"daemon anonymous memory grew {grown_mib:.1f} MiB with 8 unread 18 MiB replies")
        assert grown_mib < 16, grown_mib
        wait_until(lambda: error_count(daemon, "send_timeout") >= 8, timeout_s=20, what="timeouts")
        good_client_served(daemon, 8)
        for probe in stalled:
            probe.close()
    finally:
        assert daemon.stop() == 0, daemon.log()


def _healthz(daemon: DaemonProcess) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(daemon.admin + "/healthz", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_healthz_says_unhealthy_while_writes_fail_with_io_errors(tmp_path: Path) -> None:
    """Its segment directory removed under it, a daemon could not write a new segment, so
    every PUT failed, yet /healthz said ok (its probe, a HAS, reads the index only). After
    a few failed writes in a row it is unhealthy, and healthy again once a write succeeds."""
    import shutil

    with DaemonProcess(tmp_path, server={"capacity_bytes": 64 << 20}) as daemon:
        with daemon.probe() as probe:
            assert probe.put(block_records(key(1), body_len=1024)).tolist() == [Status.OK] * 12
            assert _healthz(daemon)[0] == 200
            shutil.rmtree(daemon.data_dir / "segments")
            statuses: list[int] = []
            n = 2
            while _healthz(daemon)[0] == 200:
                assert n < 200, "writes never failed"
                # 1.2 MB a batch: the 4 MiB segment of a 64 MiB node fills in a few.
                statuses += probe.put(
                    [s for m in range(n, n + 10) for s in block_records(key(m), body_len=8192)]
                ).tolist()
                n += 10
            code, body = _healthz(daemon)
            assert (code, body["status"]) == (503, "unhealthy") and "segments" in body["reason"]
            assert Status.INTERNAL in statuses
            # Reads of what it has still work; once the directory is back, writes do too.
            assert probe.has([key(1)])[key(1)]
            (daemon.data_dir / "segments").mkdir()
            assert probe.put(block_records(key(999), body_len=1024)).tolist() == [Status.OK] * 12
            assert _healthz(daemon)[0] == 200
        assert daemon.stop() == 0


def test_slow_admin_clients_cannot_take_the_data_path_down(daemon: DaemonProcess) -> None:
    """Admin connections that send half a header and wait were held for ever; enough of
    them used up the daemon's descriptors and the data path stopped taking sessions. They
    are bounded now: past MAX_ADMIN_CONNECTIONS they are closed as they arrive."""
    from kvcache.server.admin import MAX_ADMIN_CONNECTIONS

    host, port = daemon.admin.removeprefix("http://").rsplit(":", 1)
    slow: list[socket.socket] = []
    try:
        for _ in range(MAX_ADMIN_CONNECTIONS + 64):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the end
            slow.append(sock)
        closed = 0
        for sock in slow[MAX_ADMIN_CONNECTIONS:]:  # those past the bound: closed on arrival
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:  # closed with its half header unread
                closed += 1
        assert closed == 64
        good_client_served(daemon, n=8)
    finally:
        for sock in slow:
            sock.close()
    wait_until(
        lambda: http("GET", daemon.admin + "/healthz")[0] == 200, what="/healthz to answer again"
    )


def test_an_admin_connection_is_cut_at_its_age() -> None:
    from aiohttp import web

    from kvcache.server.admin import AdminServer

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(text="x")

    app = web.Application()
    app.router.add_get("/x", handler)
    server = AdminServer(app, "127.0.0.1:0", max_connections=4, connection_max_s=0.5)
    url = server.start()
    try:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n")  # half a request, then nothing
        started = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - started < 5
        sock.close()
        assert server.counters["aged_out"] == 1
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # and it serves
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def _listed(probe: Probe) -> list[tuple[int, int, str]]:
    """(index, expiry_ms, class) of every shard LIST answers, pending hits included."""
    items = make_items(Op.LIST, 1, reply=False)
    items["limit"] = 100
    items["flags"] = 1  # from the start
    reply = probe.request(Op.LIST, items)
    return [
        (
            int(r["index"]),
            int(r["expiry_ms"]),
            bytes(r["traffic_class"]).rstrip(b"\0").decode(),
        )
        for r in reply.items
    ]


def test_a_get_refused_too_large_changes_no_expiry(tmp_path: Path) -> None:
    """The GET's hits recorded their expiry slides before the reply size was checked: a GET
    refused TOO_LARGE as a whole moved the shards it hit from 10 minutes to 7 days (a
    message-level failure must not change stored state: docs/spec/wire.md)."""
    daemon = DaemonProcess(
        tmp_path,
        server={"native_plane": False, "max_data_bytes": 4096},
        retention={"default_class": "short", "classes": {"short": "10m", "long": "7d"}},
    ).start()
    try:
        key = bytes(range(16))
        records = block_records(key, body_len=640, traffic_class="short", indices=range(8))
        with daemon.probe() as probe:
            for at in (0, 4):
                assert (probe.put(records[at : at + 4]) == Status.OK).all()
            before = _listed(probe)
            request = get_items([(key, i) for i in range(8)])  # 8 x 744 bytes > 4096
            reply = probe.request(Op.GET, request, traffic_class="long")
            assert reply.header.status is Status.TOO_LARGE
            assert _listed(probe) == before
            reply = probe.request(Op.GET, request[:4], traffic_class="long")  # one that fits
            assert reply.header.status is Status.OK
            after = {i: expiry for i, expiry, _ in _listed(probe)}
            assert all(after[i] > before[i][1] + 86_400_000 for i in range(4))  # slid to 7 d
            assert all(after[i] == before[i][1] for i in range(4, 8))
    finally:
        assert daemon.stop() == 0, daemon.log()
