"""The store's event stream for routers (kvcache.events, docs/spec/events.md), on real daemons.

The end-to-end test follows two daemons with an independent subscriber
(``tests/events_listener.py``: plain pyzmq + msgspec, vLLM-shaped structs) through 10,000
block stores, capacity evictions, deletes and expiries driven by the daemons' clocks, with one
subscriber killed mid-run and restarted: it catches up by replay, and every event arrives,
in order, exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from events_listener import KVEventBatch
from hypothesis import given
from hypothesis import strategies as st
from server_fixtures import DaemonProcess, block_records, http, wait_until

from kvcache.errors import ConfigError
from kvcache.events.format import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    tenant_of_topic,
    topic_of,
)
from kvcache.events.publisher import EventPublisher, PublisherSettings, events_token
from kvcache.events.subscriber import Delivery, Resync, Subscriber
from kvcache.server.config import ServerConfig, load_server_config

LISTENER = Path(__file__).resolve().parent / "events_listener.py"
EVENTS = {"events_listen": "tcp://127.0.0.1:0", "allow_clock_override": True}
DAY_S = 86400.0

keys16 = st.binary(min_size=16, max_size=16)


# ---------------------------------------------------------------------- format


@given(
    stored=st.lists(keys16, min_size=1, max_size=20),
    removed=st.lists(keys16, min_size=1, max_size=20),
    cause=st.sampled_from(["expired", "evicted", "quota", "deleted"]),
    rank=st.none() | st.integers(0, 7),
)
def test_batches_decode_with_vllms_structs(
    stored: list[bytes], removed: list[bytes], cause: str, rank: int | None
) -> None:
    batch = EventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=list(stored),
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium="STORAGE",
                lora_name=None,
                kvcache_shards=list(range(len(stored))),
            ),
            BlockRemoved(block_hashes=list(removed), medium="STORAGE", kvcache_cause=cause),
        ],
        data_parallel_rank=rank,
    )
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    theirs = msgspec.msgpack.decode(payload, type=KVEventBatch)  # vLLM's decoder ignores ours
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored", "BlockRemoved"]
    assert theirs.events[0].block_hashes == stored and theirs.events[0].medium == "STORAGE"
    assert theirs.events[1].block_hashes == removed
    assert theirs.data_parallel_rank == rank
    assert msgspec.msgpack.decode(payload)[1][1]["kvcache_cause"] == cause


@given(st.from_regex(r"[a-z0-9_.\-]{1,64}", fullmatch=True))
def test_topics_name_their_tenant_and_none_prefixes_another(name: str) -> None:
    assert tenant_of_topic(topic_of(name)) == name
    assert not topic_of(name + "x").startswith(topic_of(name))
    assert tenant_of_topic(b"other/" + name.encode() + b"/") is None


def test_config_events_off_by_default_and_closed(tmp_path: Path) -> None:
    assert ServerConfig().events_listen == ""
    assert ServerConfig(events_listen="tcp://127.0.0.1:0").events_auth
    with pytest.raises(ConfigError, match="loopback"):
        ServerConfig(events_listen="tcp://0.0.0.0:7490", events_auth=False)
    ServerConfig(events_listen="tcp://127.0.0.1:7490", events_auth=False)  # loopback: allowed
    with pytest.raises(ConfigError, match="events_listen"):
        ServerConfig(events_listen="http://x:1")
    toml = tmp_path / "node.toml"
    toml.write_text(
        '[server]\nevents_listen = "tcp://127.0.0.1:7490"\nevents_replay_bytes = "1MiB"\n'
    )
    os.environ["KVCACHE_SERVER_EVENTS_QUEUE"] = "77"
    try:
        config, _ = load_server_config(toml, flags={"events_replay_listen": "tcp://127.0.0.1:7499"})
    finally:
        del os.environ["KVCACHE_SERVER_EVENTS_QUEUE"]
    assert (config.events_listen, config.events_replay_bytes, config.events_queue) == (
        "tcp://127.0.0.1:7490", 1 << 20, 77)  # fmt: skip
    assert config.events_replay_listen == "tcp://127.0.0.1:7499"


# ---------------------------------------------------------------------- tenants and replay


def test_a_tenant_sees_its_own_events_only(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, server=EVENTS) as daemon:
        info = json.loads(daemon.ready_path.read_text())
        alice = daemon.credentials.tenant("alice")
        default = daemon.credentials.tenant("default")
        assert alice is not None and default is not None
        ctx = zmq.Context()
        try:
            # Alice asks for everything, and for default's topic: she gets her own events.
            greedy = raw_sub(ctx, info["events"], "alice", events_token(alice.secret), b"")
            nosy = raw_sub(ctx, info["events"], "alice", events_token(alice.secret),
                           topic_of("default"))  # fmt: skip
            wrong = raw_sub(ctx, info["events"], "alice", events_token(default.secret), b"")
            admin = raw_sub(ctx, info["events"], "admin", daemon.admin_token, b"")
            wait_until(lambda: daemon.stats()["events"]["subscriptions"] >= 2, what="subs")
            time.sleep(0.2)  # the admin's subscription may still be on its way
            for tenant, key in (("alice", b"a" * 16), ("default", b"d" * 16)):
                with daemon.probe(tenant=tenant) as probe:
                    probe.put(block_records(key, indices=[3]))
            got = drain(greedy, 2)
            assert [t for t, _ in got] == [topic_of("alice")]
            assert got[0][1].events[0].block_hashes == [b"a" * 16]
            assert drain(nosy, 1) == []  # default's topic was refused, its own not asked for
            assert drain(wrong, 1) == []  # a bad password: nothing at all
            assert sorted(t for t, _ in drain(admin, 2)) == [topic_of("alice"), topic_of("default")]
            assert daemon.stats()["events"]["refused_subscriptions"] >= 1
            # Replay answers the authenticated tenant's stream only.
            with Subscriber(info["events"], info["events_replay"], tenant="alice",
                            secret=alice.secret, start_seq=0) as sub:  # fmt: skip
                items = sub.poll(0.1)
            assert [(i.topic, i.seq, i.replayed) for i in items if isinstance(i, Delivery)] == [
                (topic_of("alice"), 0, True)
            ]
        finally:
            ctx.destroy(linger=0)


def test_a_subscriber_too_far_behind_is_told_to_resync(tmp_path: Path) -> None:
    server = {**EVENTS, "events_replay_batches": 3}
    with DaemonProcess(tmp_path, server=server) as daemon:
        info = json.loads(daemon.ready_path.read_text())
        alice = daemon.credentials.tenant("alice")
        assert alice is not None
        with daemon.probe(tenant="alice") as probe:
            for n in range(6):  # six PUT replies, each its own batch: six batches, three kept
                probe.put(block_records(n.to_bytes(16, "big"), indices=[0]))
                wait_until(lambda n=n: daemon.stats()["events"]["batches"] == n + 1, what="batch")
        with Subscriber(info["events"], info["events_replay"], tenant="alice",
                        secret=alice.secret, start_seq=3) as sub:  # fmt: skip
            caught = sub.poll(0.1)
        assert [(i.seq, i.replayed) for i in caught if isinstance(i, Delivery)] == [
            (3, True), (4, True), (5, True)]  # fmt: skip
        with Subscriber(info["events"], info["events_replay"], tenant="alice",
                        secret=alice.secret, start_seq=1) as sub:  # fmt: skip
            told = sub.poll(0.1)
            assert [type(i) for i in told] == [Resync]
            with daemon.probe(tenant="alice") as probe:  # the stream goes on from the live batch
                probe.put(block_records(b"z" * 16, indices=[0]))
            [live] = sub.poll(5.0)
            assert isinstance(live, Delivery) and (live.seq, live.replayed) == (6, False)
        assert daemon.stats()["events"]["resyncs"] == 1


def test_lost_entries_cost_a_gap_that_replay_answers_with_resync() -> None:
    """The serving side never waits: with the queue full an entry is dropped, counted, and
    its tenant's stream skips a sequence number, which replay cannot fill."""
    tenant = b"\x01" * 8
    publisher = EventPublisher(
        PublisherSettings(listen="tcp://127.0.0.1:0", auth=False, queue_entries=1),
        tenants={tenant: ("t", b"s" * 16)},
    )
    try:
        sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
        wait_until(lambda: publisher.counters["subscriptions"] >= 1, what="subscription")
        publisher.removed(tenant, "chat", "expired", [tenant + b"k" * 16 + b"\0\0"])
        publisher.flush()
        publisher._max_queue = 0  # the queue is full: the next entry is dropped
        publisher.removed(tenant, "chat", "expired", [tenant + b"l" * 16 + b"\0\0"])
        publisher._max_queue = 1
        assert publisher.counters["dropped"] == 1
        publisher.removed(tenant, "chat", "expired", [tenant + b"m" * 16 + b"\0\0"])
        publisher.flush()
        items: list[Delivery | Resync] = []
        wait_until(lambda: items.extend(sub.poll(0.2)) or len(items) >= 3, what="3 items")
        assert [type(i) for i in items] == [Delivery, Resync, Delivery]
        assert isinstance(items[1], Resync) and (items[1].missing_from, items[1].resume_at) == (
            1,
            2,
        )
        sub.close()
    finally:
        publisher.close()


# ---------------------------------------------------------------------- the scripted run

BLOCKS = 10_000
PER_PUT = 100


def test_every_store_eviction_and_expiry_reaches_an_independent_subscriber(
    tmp_path: Path,
) -> None:
    """10,000 blocks (one shard each on two daemons), 1 MiB capacity so pressure evicts,
    some deletes, then the clock moves past the TTL: every event in order, no gap, and the
    subscriber killed halfway catches up by replay."""
    server = {**EVENTS, "capacity_bytes": 1 << 20}
    for i in range(2):
        (tmp_path / f"n{i}").mkdir()
    daemons = [DaemonProcess(tmp_path / f"n{i}", server=server) for i in range(2)]
    listeners: list[subprocess.Popen[bytes] | None] = [None, None]
    try:
        for d in daemons:
            d.start()
        infos = [json.loads(d.ready_path.read_text()) for d in daemons]
        outs = [tmp_path / f"events{i}.jsonl" for i in range(2)]

        def listen(i: int, start: int) -> subprocess.Popen[bytes]:
            entry = daemons[i].credentials.tenant("alice")
            assert entry is not None
            proc = subprocess.Popen([
                sys.executable, str(LISTENER), "--endpoint", infos[i]["events"],
                "--replay", infos[i]["events_replay"], "--user", "alice",
                "--password", events_token(entry.secret), "--out", str(outs[i]),
                "--start-seq", str(start),
            ])  # fmt: skip
            wait_until(lambda: any("ready" in r for r in read_lines(outs[i])), what="ready")
            return proc

        listeners = [listen(0, 0), listen(1, 0)]
        put_shards: list[set[tuple[str, int]]] = [set(), set()]
        deleted: set[tuple[str, int]] = set()
        probes = [d.probe(tenant="alice", timeout_s=30) for d in daemons]
        try:
            for start in range(0, BLOCKS, PER_PUT):
                if start == BLOCKS // 2:  # kill one subscriber; go on storing while it is away
                    proc = listeners[0]
                    assert proc is not None
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                if start == BLOCKS // 2 + 20 * PER_PUT:
                    listeners[0] = listen(0, last_seq(outs[0]) + 1)
                for i, probe in enumerate(probes):
                    shards = []
                    for n in range(start, start + PER_PUT):
                        shards += block_records(n.to_bytes(16, "big"), indices=[i], body_len=64)
                    status = probe.put(shards)
                    assert (status == 0).all()
                    put_shards[i] |= {(s[0].hex(), s[1]) for s in shards}
            # Deletes of a few blocks still held (the newest: eviction takes the oldest first).
            for n in range(BLOCKS - 50, BLOCKS):
                probes[0].delete([(n.to_bytes(16, "big"), 0, 0)])
                deleted.add((n.to_bytes(16, "big").hex(), 0))
        finally:
            for probe in probes:
                probe.close()
        # Every remaining shard expires: the daemons' clocks move 8 days on (chat keeps 7).
        for d in daemons:
            status, _ = http("POST", d.admin + "/debug/clock", {"offset_s": 8 * DAY_S},
                             token=d.admin_token)  # fmt: skip
            assert status == 200
        for i, d in enumerate(daemons):
            wait_until(lambda i=i: removed_count(outs[i]) == len(put_shards[i]), timeout_s=60,
                       what=f"every removal of daemon {i}")  # fmt: skip
            check_stream(outs[i], put_shards[i], deleted if i == 0 else set(), d.stats())
        assert any(r.get("replayed") for r in read_lines(outs[0])), "no catch-up by replay"
    finally:
        for proc in listeners:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for d in daemons:
            d.__exit__()


def check_stream(path: Path, put: set[tuple[str, int]], deleted: set[tuple[str, int]],
                 stats: dict[str, Any]) -> None:  # fmt: skip
    """Sequence numbers 0..n-1 once each; each shard stored once, then removed once."""
    rows = [r for r in read_lines(path) if "seq" in r]
    assert not [r for r in read_lines(path) if "resync" in r]
    assert [r["seq"] for r in rows] == list(range(len(rows)))
    live: set[tuple[str, int]] = set()
    stored: set[tuple[str, int]] = set()
    causes: dict[str, int] = {}
    for row in rows:
        for name, medium, cause, keys, shards in row["events"]:
            assert medium == "STORAGE"
            for key, shard in zip(keys, shards, strict=True):
                if name == "BlockStored":
                    assert (key, shard) not in stored, "stored twice"
                    stored.add((key, shard))
                    live.add((key, shard))
                else:
                    assert (key, shard) in live, "removed before stored, or twice"
                    live.remove((key, shard))
                    causes[cause] = causes.get(cause, 0) + 1
                    if (key, shard) in deleted:
                        assert cause == "deleted"
    assert stored == put and not live
    counted = {r["cause"]: r["shards"] for r in stats["retention"]["removals"]}
    assert causes == counted, (causes, counted)
    assert causes.get("evicted", 0) > 0 and causes.get("expired", 0) > 0
    assert causes.get("deleted", 0) == len(deleted)
    assert stats["events"]["dropped"] == 0


# ---------------------------------------------------------------------- helpers


def raw_sub(ctx: zmq.Context[Any], endpoint: str, user: str, password: str,
            topic: bytes) -> zmq.Socket[Any]:  # fmt: skip
    sock = ctx.socket(zmq.SUB)
    sock.plain_username, sock.plain_password = user.encode(), password.encode()
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    return sock


def drain(sock: zmq.Socket[Any], timeout_s: float) -> list[tuple[bytes, KVEventBatch]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        topic, _seq, payload = sock.recv_multipart()
        out.append((topic, msgspec.msgpack.decode(payload, type=KVEventBatch)))
        if time.monotonic() > deadline:
            break
    return out


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for text in path.read_text().splitlines():
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError:  # a line cut short by SIGKILL
            continue
    return rows


def last_seq(path: Path) -> int:
    """The last sequence written; the file is cut back to its last whole line."""
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.rfind(b"\n") + 1])
    return max(r["seq"] for r in read_lines(path) if "seq" in r)


def removed_count(path: Path) -> int:
    return sum(len(e[3]) for r in read_lines(path) if "seq" in r for e in r["events"]
               if e[0] == "BlockRemoved")  # fmt: skip


def test_cli_prints_one_line_per_event(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, server=EVENTS) as daemon:
        info = json.loads(daemon.ready_path.read_text())
        with daemon.probe(tenant="alice") as probe:
            probe.put(block_records(b"c" * 16, indices=[0, 1]))
            wait_until(lambda: daemon.stats()["events"]["batches"] == 1, what="a batch")
            probe.delete([(b"c" * 16, 0, 0)])
        wait_until(lambda: daemon.stats()["events"]["batches"] == 2, what="two batches")
        base = [sys.executable, "-m", "kvcache.cli", "events", "--endpoint", info["events"],
                "--replay-endpoint", info["events_replay"], "--tenant", "alice",
                "--credentials", str(daemon.credentials_path)]  # fmt: skip
        text = subprocess.run(base, capture_output=True, text=True, timeout=60, check=True).stdout
        lines = text.splitlines()
        assert len(lines) == 2, text
        assert " alice #0 BlockStored STORAGE n=2 " + (b"c" * 16).hex() in lines[0]
        assert " alice #1 BlockRemoved STORAGE deleted class=chat n=1 " in lines[1]
        doc = subprocess.run([*base, "--json", "--count", "1"], capture_output=True, text=True,
                             timeout=60, check=True).stdout  # fmt: skip
        assert json.loads(doc) | {"node": None} == {
            "node": None, "tenant": "alice", "seq": 0, "event": "BlockStored",
            "medium": "STORAGE", "keys": [(b"c" * 16).hex()] * 2, "shards": [0, 1]}  # fmt: skip
        # A wrong token: the daemon answers nothing; no event, the replay it asked for times
        # out (said on a RESYNC line), and the dump exits 1 saying so.
        wrong = subprocess.run([*base[:-4], "--tenant", "alice", "--token", "0" * 64],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "Block" not in wrong.stdout and "replay timed out" in wrong.stdout
        assert wrong.returncode == 1 and "never answered" in wrong.stderr


def test_swa_holder_records_coming_and_going_are_events() -> None:
    """The daemon's SWA directory tells the publisher of each record registered, withdrawn,
    evicted and expired (wired as kvcache.server.daemon wires it; expiry by the clock)."""
    from server_fixtures import FakeClock
    from test_swa_directory import record

    from kvcache.server.swa_directory import SwaDirectory
    from kvcache.swa_local.protocol import record_items

    tenant = b"\x02" * 8
    clock = FakeClock(100.0)
    directory = SwaDirectory(max_per_key=1, clock=clock)
    publisher = EventPublisher(
        PublisherSettings(listen="tcp://127.0.0.1:0", auth=False), tenants={tenant: ("t", b"")}
    )

    def listener(t: bytes, raw: bytes, cause: str | None) -> None:
        if cause is None:
            publisher.swa_stored(t, raw)
        else:
            publisher.swa_removed(t, raw, cause)

    directory.listener = listener
    try:
        with Subscriber(publisher.endpoint, publisher.replay_endpoint, tenant="t") as sub:
            wait_until(lambda: publisher.counters["subscriptions"] >= 1, what="subscription")
            put = lambda rec: directory.put(tenant, record_items([rec]))  # noqa: E731
            put(record(1, ttl_s=5.0))
            put(record(1, ttl_s=0.0))  # withdrawn by its worker
            put(record(2, ttl_s=5.0, endpoint="tcp://10.0.0.1:7000"))
            put(record(2, ttl_s=5.0, endpoint="tcp://10.0.0.2:7000"))  # one per key: evicts
            clock.step(10.0)
            directory.expire()
            publisher.flush()
            events: list[Any] = []
            wait_until(lambda: events.extend(e for i in sub.poll(0.2) if isinstance(i, Delivery)
                                             for e in i.batch.events) or len(events) >= 6,
                       what="six events")  # fmt: skip
        got = [(type(e).__name__, e.medium, getattr(e, "kvcache_cause", None),
                e.block_hashes[0][-1], e.kvcache_holders) for e in events]  # fmt: skip
        assert got == [
            ("BlockStored", "SWA", None, 1, ["tcp://10.0.0.1:7000"]),
            ("BlockRemoved", "SWA", "withdrawn", 1, ["tcp://10.0.0.1:7000"]),
            ("BlockStored", "SWA", None, 2, ["tcp://10.0.0.1:7000"]),
            ("BlockRemoved", "SWA", "evicted", 2, ["tcp://10.0.0.1:7000"]),
            ("BlockStored", "SWA", None, 2, ["tcp://10.0.0.2:7000"]),
            ("BlockRemoved", "SWA", "expired", 2, ["tcp://10.0.0.2:7000"]),
        ]
        assert events[0].kvcache_ttl_ms == [5000] and events[0].kvcache_positions == [64]
    finally:
        publisher.close()


def test_a_daemon_restart_is_a_resync(tmp_path: Path) -> None:
    """A restarted daemon starts its topics at 0 again: a subscriber restarted with the
    sequence it had reached asks past the new stream's end and is told to resync."""
    from kvcache.testing.localcluster import free_ports

    pub, replay = free_ports(2)
    server = {**EVENTS, "events_listen": f"tcp://127.0.0.1:{pub}",
              "events_replay_listen": f"tcp://127.0.0.1:{replay}"}  # fmt: skip
    daemon = DaemonProcess(tmp_path, server=server).start()
    alice = daemon.credentials.tenant("alice")
    assert alice is not None
    endpoints = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with daemon.probe(tenant="alice") as probe:
            for n in range(3):
                probe.put(block_records(n.to_bytes(16, "big"), indices=[0]))
                wait_until(lambda n=n: daemon.stats()["events"]["batches"] == n + 1, what="batch")
        with Subscriber(*endpoints, tenant="alice", secret=alice.secret, start_seq=0) as sub:
            assert [i.seq for i in sub.poll(0.1) if isinstance(i, Delivery)] == [0, 1, 2]
        daemon.stop()
        daemon.start()
        with daemon.probe(tenant="alice") as probe:
            probe.put(block_records(b"r" * 16, indices=[0]))
        wait_until(lambda: daemon.stats()["events"]["batches"] == 1, what="the new stream")
        with Subscriber(*endpoints, tenant="alice", secret=alice.secret, start_seq=3) as late:
            told = late.poll(0.1)
        assert [type(i) for i in told] == [Resync]
        assert isinstance(told[0], Resync) and "restarted" in told[0].reason
    finally:
        daemon.__exit__()
