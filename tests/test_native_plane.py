"""The daemon's native data plane (kvcache.server.native_plane, kvcache/native/kvserve.c).

Real daemons on loopback, one with the plane and one without, fed the same shards and the
same requests: every reply must be byte-identical (hypothesis draws the requests, quiet
and not), and the plane must have answered many of them itself. Then what only a loop
has: pipelined and mixed requests on one connection, a client that stops reading (others
go on; its reply stays whole even when the segment it is sent from is dropped and its file
would be reused), the cut-offs (send timeout, slow request), malformed bytes, tenants,
expiry, metrics, and the switch that turns the plane off.
"""

from __future__ import annotations

import resource
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import DaemonProcess, block_records, http, wait_until

from kvcache.errors import NodeError
from kvcache.server import native_plane
from kvcache.server.probe import Probe, fake_shard
from kvcache.shard import HEADER_BYTES, ShardHeader, new_stripe_id
from kvcache.wire import (
    FLAG_TTL,
    Header,
    Message,
    Op,
    Retain,
    Status,
    encode,
    join,
    make_items,
    pack_header,
)

pytestmark = pytest.mark.skipif(
    not native_plane.AVAILABLE, reason="the native data plane is not built"
)

BODY = 1152  # 11,520-byte shards would make the hypothesis runs slow; the path is the same
CLASSES = {"chat": "7d", "agent": "3d", "short": "1h"}
RETENTION = {"classes": CLASSES, "default_class": "agent"}


def _keys(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(n)]


KEYS = _keys(24, 1)
UNKNOWN = _keys(4, 2)
#: Per stored key: its traffic class and which shard indices it has.
LAYOUT = {
    key: (("chat", "agent", "short")[i % 3], tuple(range(12)) if i % 4 else (0, 2, 5, 11))
    for i, key in enumerate(KEYS)
}


def _records() -> dict[bytes, list[tuple[bytes, int, bytes]]]:
    return {
        key: block_records(key, body_len=BODY, traffic_class=cls, indices=indices, seed=7)
        for key, (cls, indices) in LAYOUT.items()
    }


def _stripe_of(record: bytes) -> int:
    return ShardHeader.unpack(record[:HEADER_BYTES]).stripe_id


RECORDS = _records()
STRIPES = {key: _stripe_of(recs[0][2]) for key, recs in RECORDS.items()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, ...]]:
    """Two daemons with the same shards: the first answers through the plane, the second
    (native_plane = false) in Python alone."""
    root = tmp_path_factory.mktemp("plane")
    # An hour's touch resolution: a shard stays quiet for an hour after it is written (with
    # the default minute, GETs after the first minute would all slide, and go to Python).
    server = {"touch_resolution_s": 3600.0, "touch_flush_s": 0.2}
    for name in ("on", "off"):
        (root / name).mkdir()
    on = DaemonProcess(root / "on", server=server, retention=RETENTION)
    off = DaemonProcess(
        root / "off",
        server={**server, "native_plane": False},
        retention=RETENTION,
        credentials=on.credentials,
    )
    with on, off:
        for daemon in (on, off):
            with daemon.probe() as p:
                for recs in RECORDS.values():
                    assert (p.put(recs) == Status.OK).all()
        yield on, off


def _send(probe: Probe, raw: bytes) -> Message:
    probe.send_raw(raw)
    reply = probe.recv_message()
    assert reply is not None, "no reply"
    return reply


def _same(a: Message, b: Message) -> None:
    assert a.header == b.header
    assert a.items.tobytes() == b.items.tobytes()
    assert bytes(a.data) == bytes(b.data)


item_keys = st.sampled_from(KEYS + UNKNOWN)
get_items = st.lists(
    st.tuples(
        item_keys,
        st.one_of(st.integers(0, 11), st.sampled_from([12, 254, 255, 4000])),
        st.sampled_from(["any", "right", "wrong"]),
    ),
    min_size=1,
    max_size=40,
)


def _get_request(rid: int, wanted: list[tuple[bytes, int, str]], cls: str, ttl: int) -> bytes:
    items = make_items(Op.GET, len(wanted), reply=False)
    items["key"] = [w[0] for w in wanted]
    items["index"] = [w[1] for w in wanted]
    items["stripe"] = [
        0 if w[2] == "any" else (STRIPES.get(w[0], 5) if w[2] == "right" else 12345) for w in wanted
    ]
    header = Header(
        op=Op.GET,
        request_id=rid,
        count=len(wanted),
        traffic_class=cls,
        retain=Retain(ttl_s=ttl) if ttl else Retain(),
    )
    return join(encode(header, items))


def _has_request(rid: int, keys: list[bytes], cls: str) -> bytes:
    items = make_items(Op.HAS, len(keys), reply=False)
    items["key"] = keys
    return join(
        encode(Header(op=Op.HAS, request_id=rid, count=len(keys), traffic_class=cls), items)
    )


requests = st.lists(
    st.one_of(
        st.tuples(
            st.just("get"),
            get_items,
            st.sampled_from(["", "chat", "agent", "short", "other"]),
            st.sampled_from([0, 0, 0, 3600]),
        ),
        st.tuples(
            st.just("has"),
            st.lists(item_keys, min_size=1, max_size=40),
            st.sampled_from(["", "", "chat"]),
            st.just(0),
        ),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=requests, pipelined=st.booleans())
def test_the_plane_answers_exactly_what_python_answers(
    pair: tuple[DaemonProcess, DaemonProcess], batch: list[Any], pipelined: bool
) -> None:
    on, off = pair
    raws = [
        _get_request(i + 1, body, cls, ttl) if op == "get" else _has_request(i + 1, body, cls)
        for i, (op, body, cls, ttl) in enumerate(batch)
    ]
    replies: list[list[Message]] = []
    for daemon in (on, off):
        with daemon.probe() as p:
            if pipelined:  # every request sent before the first reply is read
                p.send_raw(b"".join(raws))
                got = [p.recv_message() for _ in raws]
                assert all(m is not None for m in got)
                replies.append([m for m in got if m is not None])
            else:
                replies.append([_send(p, raw) for raw in raws])
    for a, b in zip(*replies, strict=True):
        _same(a, b)


def test_the_plane_answered_most_of_them_itself(pair: tuple[DaemonProcess, ...]) -> None:
    on, off = pair
    expected = {(s[0], s[1]): s[2] for recs in RECORDS.values() for s in recs}
    with on.probe() as p:
        before = on.stats()["native"]["requests"]
        for cls in ("chat", "agent", "short"):  # each class's own hits slide nothing
            wanted = [(key, i) for key, (c, indices) in LAYOUT.items() if c == cls for i in indices]
            statuses, records = p.get(wanted, traffic_class=cls)
            assert (statuses == Status.OK).all()
            assert records == [expected[w] for w in wanted]
        assert p.has(KEYS)[KEYS[1]] == {i: STRIPES[KEYS[1]] for i in range(12)}
        after = on.stats()["native"]["requests"]
    assert after["get"] == before["get"] + 3 and after["has"] == before["has"] + 1
    assert off.stats()["native"]["requests"] == {"get": 0, "has": 0}


def test_expired_shards_are_not_answered_by_the_plane(tmp_path: Path) -> None:
    server = {"allow_clock_override": True}
    with DaemonProcess(tmp_path, server=server, retention=RETENTION) as d, d.probe() as p:
        short = block_records(KEYS[0], body_len=BODY, traffic_class="short")
        long = block_records(KEYS[1], body_len=BODY, traffic_class="chat")
        assert (p.put(short + long) == Status.OK).all()
        assert set(p.has([KEYS[0], KEYS[1]])[KEYS[0]]) == set(range(12))
        token = d.admin_token
        assert http("POST", d.admin + "/debug/clock", {"offset_s": 7200}, token=token)[0] == 200
        # The clock moved: the short class's shards are gone for HAS and GET alike.
        live = dict.fromkeys(range(12), _stripe_of(long[0][2]))
        assert p.has([KEYS[0], KEYS[1]]) == {KEYS[0]: {}, KEYS[1]: live}
        statuses, _ = p.get([(KEYS[0], 3), (KEYS[1], 3)])
        assert statuses.tolist() == [Status.NOT_FOUND, Status.OK]
        native = d.stats()["native"]
        assert native["requests"]["has"] >= 2 and native["handed"]["get_not_quiet"] >= 1


def _raw_get(rid: int, wanted: list[tuple[bytes, int]]) -> bytes:
    items = make_items(Op.GET, len(wanted), reply=False)
    items["key"] = [w[0] for w in wanted]
    items["index"] = [w[1] for w in wanted]
    return join(encode(Header(op=Op.GET, request_id=rid, count=len(wanted)), items))


def test_mixed_requests_on_one_connection_come_back_in_order(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path) as d, d.probe() as p:
        recs = block_records(KEYS[2], body_len=BODY)
        assert (p.put(recs) == Status.OK).all()
        more = block_records(KEYS[3], body_len=BODY)
        put_items = make_items(Op.PUT, len(more), reply=False)
        put_items["key"] = [s[0] for s in more]
        put_items["index"] = [s[1] for s in more]
        put_items["length"] = [len(s[2]) for s in more]
        touch = make_items(Op.TOUCH, 1, reply=False)
        touch["key"] = KEYS[2]
        stream = [
            _raw_get(1, [(KEYS[2], 0), (KEYS[2], 1)]),  # native
            join(
                encode(
                    Header(op=Op.PUT, request_id=2, count=len(more)),
                    put_items,
                    b"".join(s[2] for s in more),
                )
            ),  # handed to Python
            _raw_get(3, [(KEYS[3], 4)]),  # native again
            join(encode(Header(op=Op.TOUCH, request_id=4, count=1), touch)),
            _has_request(5, [KEYS[2], KEYS[3]], ""),
            join(encode(Header(op=Op.STATS, request_id=6, count=0))),
            _raw_get(7, [(KEYS[2], 11)]),
        ]
        p.send_raw(b"".join(stream))
        replies = [p.recv_message() for _ in stream]
        assert [m.header.request_id for m in replies if m is not None] == list(range(1, 8))
        assert all(m is not None and m.header.status == Status.OK for m in replies)
        first, _put, third, _touch, has, _stats, last = replies
        assert first is not None and bytes(first.data) == recs[0][2] + recs[1][2]
        assert third is not None and bytes(third.data) == more[4][2]
        assert has is not None and len(has.items) == 24
        assert last is not None and bytes(last.data) == recs[11][2]
        # What came pipelined behind the PUT was buffered by the Python loop, which
        # answered it; once the connection is idle the plane takes it back.
        before = d.stats()["native"]
        assert before["requests"]["get"] >= 1 and before["handed"]["op"] >= 1
        assert p.touch([KEYS[2]]).tolist() == [Status.OK]
        assert p.get([(KEYS[3], 5)])[1] == [more[5][2]]
        after = d.stats()["native"]
        assert after["requests"]["get"] == before["requests"]["get"] + 1
        assert after["handed"]["op"] == before["handed"]["op"] + 1


def _big_block_set(n_blocks: int, body: int) -> list[tuple[bytes, int, bytes]]:
    out: list[tuple[bytes, int, bytes]] = []
    for key in _keys(n_blocks, 99):
        out += block_records(key, body_len=body)
    return out


def test_a_client_that_stops_reading_stalls_only_itself_and_gets_its_bytes(
    tmp_path: Path,
) -> None:
    """Its reply waits in the plane while others are served; the shards it asked for are
    deleted, their segment dropped and new writes made meanwhile (a reused segment file
    would send those instead): its reply is still the bytes asked for."""
    server = {"capacity_bytes": 64 << 20}  # 4 MiB segments
    with DaemonProcess(tmp_path, server=server) as d, d.probe() as writer:
        shards = _big_block_set(60, 11_520)  # 8.4 MB in three segments
        for lo in range(0, len(shards), 96):
            assert (writer.put(shards[lo : lo + 96]) == Status.OK).all()
        filler = _big_block_set(36, 11_520)
        for lo in range(0, len(filler), 96):
            assert (writer.put(filler[lo : lo + 96]) == Status.OK).all()
        stalled = d.probe()
        stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        wanted = [(s[0], s[1]) for s in shards]
        stalled.send_raw(_raw_get(1, wanted))
        # Others are served while that reply waits for its reader.
        with d.probe() as other:
            statuses, got = other.get([(filler[0][0], filler[0][1])])
            assert statuses.tolist() == [Status.OK] and got == [filler[0][2]]
        wait_until(lambda: d.stats()["native"]["requests"]["get"] >= 2, what="both GETs")
        # Delete the stalled reply's shards; their segments empty and are dropped.
        dropped = d.stats()["gc"]["segments_dropped"]
        keys = sorted({s[0] for s in shards})
        assert (writer.delete([(k, 0, 0xFFFF) for k in keys]) == Status.OK).all()
        wait_until(lambda: d.stats()["gc"]["segments_dropped"] > dropped, what="a segment drop")
        fresh = _big_block_set(60, 11_520)[::-1]
        for lo in range(0, len(fresh), 96):
            assert (writer.put(fresh[lo : lo + 96]) == Status.OK).all()
        reply = stalled.recv_message(timeout_s=30)
        stalled.close()
        assert reply is not None and reply.header.status == Status.OK
        assert (reply.items["status"] == Status.OK).all()
        assert bytes(reply.data) == b"".join(s[2] for s in shards)


def test_a_reply_nobody_reads_is_cut_off_after_the_send_timeout(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, server={"send_timeout_s": 0.5}) as d, d.probe() as writer:
        shards = _big_block_set(80, 11_520)
        for lo in range(0, len(shards), 96):
            assert (writer.put(shards[lo : lo + 96]) == Status.OK).all()
        stalled = d.probe()
        stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        stalled.send_raw(_raw_get(1, [(s[0], s[1]) for s in shards]))
        wait_until(
            lambda: d.stats()["errors"].get("send_timeout", 0) >= 1,
            timeout_s=20,
            what="the send timeout",
        )
        stalled.close()
        with d.probe() as p:  # and the daemon goes on
            assert p.get([(shards[0][0], shards[0][1])])[0].tolist() == [Status.OK]


def test_a_request_that_trickles_in_is_cut_off(tmp_path: Path) -> None:
    server = {"request_grace_s": 0.3, "min_request_rate": 1 << 20, "request_timeout_s": 5.0}
    with DaemonProcess(tmp_path, server=server) as d, d.probe() as p:
        assert p.has([KEYS[0]]) == {KEYS[0]: {}}  # the connection is the plane's now
        p.send_raw(_raw_get(2, [(KEYS[0], 1)] * 8)[:60])  # a header and a bit
        wait_until(
            lambda: d.stats()["errors"].get("slow_request", 0) >= 1,
            timeout_s=20,
            what="the slow-request cut-off",
        )
        assert p.recv_message(timeout_s=2) is None  # closed
        assert d.stats()["connections"] == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"XX" + bytes(46),  # bad magic
        pack_header(Op.GET, 1, 1, flags=1) + bytes(32),  # a reply sent as a request
        pack_header(Op.GET, 1, 1)[:2] + b"\x09" + pack_header(Op.GET, 1, 1)[3:] + bytes(32),
        pack_header(Op.GET, 1, 1 << 20),  # more items than allowed
        struct.pack("<2sBBHHQIIQ16s", b"KV", 2, 2, FLAG_TTL, 0, 1, 1, 0, 0, bytes(16)),
    ],
    ids=["magic", "reply-flag", "version", "too-many-items", "ttl-flag-without-ttl"],
)
def test_malformed_requests_on_a_native_connection_get_python_s_error(
    tmp_path: Path, raw: bytes
) -> None:
    with DaemonProcess(tmp_path) as d, d.probe() as p:
        assert p.has([KEYS[0]]) == {KEYS[0]: {}}
        p.send_raw(raw)
        reply = p.recv_message(timeout_s=5)
        assert reply is not None and reply.header.status == Status.BAD_REQUEST
        assert p.recv_message(timeout_s=2) is None  # and the stream is closed
        with d.probe() as q:
            assert q.has([KEYS[0]]) == {KEYS[0]: {}}
        assert d.alive()


def test_a_tenant_never_reads_another_tenant_s_shards_through_the_plane(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path) as d, d.probe("default") as owner, d.probe("alice") as other:
        recs = block_records(KEYS[5], body_len=BODY)
        assert (owner.put(recs) == Status.OK).all()
        assert owner.get([(KEYS[5], 0)])[0].tolist() == [Status.OK]
        assert other.has([KEYS[5]]) == {KEYS[5]: {}}
        assert other.get([(KEYS[5], 0)])[0].tolist() == [Status.NOT_FOUND]
        assert d.stats()["native"]["requests"]["get"] >= 1


def test_metrics_count_what_the_plane_answered(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, retention=RETENTION) as d, d.probe() as p:
        recs = block_records(KEYS[6], body_len=BODY, traffic_class="chat")
        assert (p.put(recs) == Status.OK).all()
        before = d.stats()
        for _ in range(3):
            assert (p.get([(KEYS[6], i) for i in range(10)], traffic_class="chat")[0] == 0).all()
        after = d.stats()
        assert after["native"]["requests"]["get"] - before["native"]["requests"]["get"] == 3
        assert after["requests"]["get"] - before["requests"]["get"] == 3
        assert after["hits"]["get"]["chat"] - before["hits"]["get"].get("chat", 0) == 30
        assert after["items"]["get"]["ok"] - before["items"]["get"].get("ok", 0) == 30
        latency = after["latency"]["ops"]["get"]
        assert sum(latency["buckets"]) == latency["count"] >= 3
        status, body = http("GET", d.admin + "/metrics")
        assert status == 200
        text = body.decode()
        assert 'kvcache_server_native_requests_total{op="get"}' in text
        assert 'kvcache_server_native_handoffs_total{reason="op"}' in text


def test_misses_are_answered_by_the_plane_and_counted(tmp_path: Path) -> None:
    """A GET with misses (an unknown key, a shard index the node lacks, another stripe
    than the one stored) is what a load sends to the node standing in for a dead holder:
    the plane answers it, with Python's statuses, and counts the misses per class."""
    with DaemonProcess(tmp_path, retention=RETENTION) as d, d.probe() as p:
        recs = block_records(KEYS[8], body_len=BODY, traffic_class="chat")
        assert (p.put(recs[:6]) == Status.OK).all()  # shards 0-5 only
        before = d.stats()
        wanted = [(KEYS[8], 1), (UNKNOWN[0], 1), (KEYS[8], 7), (KEYS[8], 2)]
        statuses, records = p.get(wanted, traffic_class="chat")
        assert statuses.tolist() == [Status.OK, Status.NOT_FOUND, Status.NOT_FOUND, Status.OK]
        assert records == [recs[1][2], None, None, recs[2][2]]
        all_missed, _ = p.get([(UNKNOWN[1], 0), (UNKNOWN[2], 3)], traffic_class="chat")
        assert all_missed.tolist() == [Status.NOT_FOUND] * 2
        after = d.stats()
    native = {k: after["native"]["requests"][k] - before["native"]["requests"][k] for k in ("get",)}
    assert native == {"get": 2}
    assert after["native"]["handed"] == before["native"]["handed"]
    assert after["misses"]["get"]["chat"] - before["misses"]["get"].get("chat", 0) == 4
    assert after["hits"]["get"]["chat"] - before["hits"]["get"].get("chat", 0) == 2
    assert after["items"]["get"]["not_found"] - before["items"]["get"].get("not_found", 0) == 4


def test_the_plane_can_be_turned_off(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, server={"native_plane": False}) as d, d.probe() as p:
        recs = block_records(KEYS[7], body_len=BODY)
        assert (p.put(recs) == Status.OK).all()
        assert p.get([(KEYS[7], 0)])[0].tolist() == [Status.OK]
        assert d.stats()["native"]["requests"] == {"get": 0, "has": 0}


def test_hits_waiting_to_be_written(tmp_path: Path) -> None:
    """A GET that slides an expiry leaves a hit to write. Meanwhile quiet GETs are still the
    plane's (a slide only moves an expiry later), but a HAS that meets a row past its
    expiry goes to Python, which knows the hit kept that shard alive."""
    retention = {"classes": {"chat": "7d", "agent": "1d"}, "default_class": "agent"}
    server = {"allow_clock_override": True, "touch_flush_s": 3600.0}
    with DaemonProcess(tmp_path, server=server, retention=retention) as d, d.probe() as p:
        agent = block_records(KEYS[8], body_len=BODY, traffic_class="agent")
        chat = block_records(KEYS[9], body_len=BODY, traffic_class="chat")
        assert (p.put(agent + chat) == Status.OK).all()
        token = d.admin_token
        day = 24 * 3600
        assert http("POST", d.admin + "/debug/clock", {"offset_s": day - 30}, token=token)[0] == 200
        before = d.stats()["native"]
        # A chat hit of an agent shard 30 s before its expiry slides it to chat's 7 days:
        # not quiet, answered in Python, and the slide waits to be written.
        assert p.get([(KEYS[8], 0)], traffic_class="chat")[0].tolist() == [Status.OK]
        mid = d.stats()["native"]
        assert mid["handed"]["get_not_quiet"] == before["handed"]["get_not_quiet"] + 1
        # A quiet GET is the plane's all the same (after the clock move, the chat block is
        # quiet for an agent hit: 6 days left against agent's 1).
        assert p.get([(KEYS[9], 0)], traffic_class="agent")[0].tolist() == [Status.OK]
        assert d.stats()["native"]["requests"]["get"] == mid["requests"]["get"] + 1
        # Past the agent rows' expiry: shard 0 lives on by the unwritten hit, the rest are gone.
        assert http("POST", d.admin + "/debug/clock", {"offset_s": day + 60}, token=token)[0] == 200
        stripe = _stripe_of(agent[0][2])
        assert p.has([KEYS[8]]) == {KEYS[8]: {0: stripe}}
        # Either the plane met the expired row with a hit pending and handed the HAS over,
        # or the sweeper, due at the clock move, wrote the hit first (then the row says so).
        after = d.stats()
        handed = after["native"]["handed"]["has"] - before["handed"]["has"]
        assert handed == 1 or (handed == 0 and after["gc"]["touches_written"] >= 1)


def test_garbage_after_a_native_request_costs_only_that_connection(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    with DaemonProcess(tmp_path) as d:
        with d.probe() as p:
            assert (p.put(block_records(KEYS[9], body_len=BODY)) == Status.OK).all()
        for _ in range(20):
            with d.probe() as p:
                assert p.get([(KEYS[9], 2)])[0].tolist() == [Status.OK]
                p.send_raw(
                    rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
                )
                p.recv_message(timeout_s=0.2)
        with d.probe() as p:
            assert p.get([(KEYS[9], 2)])[0].tolist() == [Status.OK]
        assert d.alive()


def test_a_new_stripe_replaces_what_the_plane_serves(tmp_path: Path) -> None:
    """Shards rewritten under a new stripe (after the racing-writer wait) are what the plane
    serves next: it reads the index at each request."""
    server = {"replace_after_s": 1.0, "allow_clock_override": True}
    with DaemonProcess(tmp_path, server=server) as d, d.probe() as p:
        first = block_records(KEYS[10], body_len=BODY, seed=1)
        assert (p.put(first) == Status.OK).all()
        assert p.get([(KEYS[10], 3)])[1] == [first[3][2]]
        old = _stripe_of(first[0][2])
        stripe = new_stripe_id()
        second = [
            (k, i, fake_shard(k, i, np.full(BODY, i, np.uint8).tobytes(), stripe_id=stripe))
            for k, i, _ in first
        ]
        # The racing-writer wait, on the daemon's clock (rows keep whole seconds).
        assert (
            http("POST", d.admin + "/debug/clock", {"offset_s": 5}, token=d.admin_token)[0] == 200
        )
        assert (p.put(second, expect=[old] * 12) == Status.OK).all()
        assert p.get([(KEYS[10], 3)])[1] == [second[3][2]]
        assert p.get([(KEYS[10], 3)], stripe=[old])[0].tolist() == [Status.NOT_FOUND]


def test_out_of_descriptors_the_daemon_goes_on_serving_and_recovers(tmp_path: Path) -> None:
    """accept() failing with EMFILE leaves the listener ready; the engine must still serve
    the connections it has, notice closed ones, and take new ones once descriptors free."""

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (80, 80))

    with DaemonProcess(tmp_path, preexec=few_descriptors) as d:
        with d.probe() as p:
            assert (p.put(block_records(KEYS[11], body_len=BODY)) == Status.OK).all()
        probes: list[Probe] = []
        while True:  # open connections until the daemon runs out of descriptors
            try:
                q = d.probe(timeout_s=1.0)
                assert q.get([(KEYS[11], 0)])[0].tolist() == [Status.OK]
            except (NodeError, OSError, AssertionError):
                break
            probes.append(q)
        assert len(probes) > 10
        # Connections waiting in the backlog keep the listener ready while accept() fails
        # (the admin port cannot accept either: the stats come at the end).
        waiting = [socket.create_connection(_address(d.data)) for _ in range(3)]
        for q in probes[:5]:  # the connections it has are still served
            assert q.get([(KEYS[11], 1)])[0].tolist() == [Status.OK]
        for q in probes[5:15]:
            q.close()
        for sock in waiting:
            sock.close()

        def new_connection_works() -> bool:
            try:
                with d.probe(timeout_s=2.0) as q:
                    return q.get([(KEYS[11], 2)])[0].tolist() == [Status.OK]
            except (NodeError, OSError):
                return False

        wait_until(new_connection_works, timeout_s=20, what="a new connection once some closed")
        for q in probes[15:]:
            q.close()
        assert d.stats()["errors"]["accept"] >= 1


def test_a_put_handed_over_waits_while_its_tenant_holds_its_share(tmp_path: Path) -> None:
    """Admission holds for requests the engine hands over: a PUT whose tenant already holds
    its in-flight share is not read on (inflight_paused), as on the Python path."""
    mib = 1 << 20
    server = {"max_inflight_bytes": mib, "tenant_inflight_bytes": mib}
    with DaemonProcess(tmp_path, server=server) as d:
        conns = [d.probe() for _ in range(3)]
        for q in conns:  # each connection the plane's: a HAS answered natively
            assert q.has([KEYS[0]]) == {KEYS[0]: {}}
        items = make_items(Op.PUT, 1, reply=False)
        items["length"] = 64 * mib
        head = Header(op=Op.PUT, request_id=1, count=1, data_len=64 * mib).pack()
        conns[0].send_raw(head + items.tobytes() + bytes(4 * mib))
        wait_until(lambda: d.stats()["inflight_bytes"] >= 2 * mib, what="the first PUT's bytes")
        for n, q in enumerate(conns[1:], 1):
            q.send_raw(head + items.tobytes() + bytes(mib))
            wait_until(lambda n=n: d.stats()["errors"].get("inflight_paused", 0) >= n,
                       what=f"PUT {n + 1} paused")  # fmt: skip
        assert d.stats()["native"]["handed"]["op"] >= 3
        for q in conns:
            q.close()
        wait_until(lambda: d.stats()["inflight_bytes"] == 0, what="the bytes released")


def _address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)
