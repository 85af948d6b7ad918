"""The directory of SWA holders: daemon RAM records (TTL, bounds, tenants), the wire ops,
and the lookup riding on the prefix match against a real cluster."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_fixtures import FakeClock

from kvcache import DType, KVLayout, Namespace, block_keys
from kvcache.client import Client
from kvcache.credentials import tenant_id
from kvcache.errors import ProtocolError
from kvcache.keys import BlockKey
from kvcache.server.handler import Request, RequestHandler
from kvcache.server.metrics import Metrics
from kvcache.server.store import ShardStore
from kvcache.server.swa_directory import SwaDirectory
from kvcache.swa_local import HolderRecord, StateKey, state_digest
from kvcache.swa_local.directory import Directory
from kvcache.swa_local.protocol import parse_answers, record_items
from kvcache.testing.localcluster import LocalCluster
from kvcache.wire import (
    DIR_ANSWER_DTYPE,
    Header,
    Op,
    Status,
    decode,
    encode,
    join,
    make_items,
)

T = tenant_id("default")
OTHER = tenant_id("other")
NS = b"\x05" * 8
LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=64, dtype=DType.FLOAT16, layers_in_block=2)
MAIN_NS = Namespace(model="test/hybrid", revision="r1", layout=LAYOUT)


def bkey(n: int) -> BlockKey:
    return BlockKey(n.to_bytes(16, "big"))


def record(
    n: int,
    *,
    endpoint: str = "tcp://10.0.0.1:7000",
    ttl_s: float = 180.0,
    position: int = 64,
    incarnation: int = 7,
) -> HolderRecord:
    return HolderRecord(
        key=StateKey(namespace=NS, block=bkey(n), position=position),
        endpoint=endpoint,
        incarnation=incarnation,
        nbytes=1000 + n,
        digest=state_digest(n.to_bytes(4, "big")),
        ttl_s=ttl_s,
    )


def keys_items(keys: list[BlockKey]) -> np.ndarray:
    items = make_items(Op.HAS_DIR, len(keys), reply=False)
    items["key"] = keys
    return items


def answers(directory: SwaDirectory, tenant: bytes, keys: list[BlockKey]) -> list[HolderRecord]:
    raw = directory.lookup(tenant, keys_items(keys))  # type: ignore[arg-type]
    return [r for _, r in parse_answers(raw.tobytes(), keys, np.arange(len(keys)))]


# ---------------------------------------------------------------------- the RAM directory


def test_records_expire_with_the_ttl_their_worker_asked_for() -> None:
    clock = FakeClock()
    directory = SwaDirectory(clock=clock)
    status = directory.put(T, record_items([record(1, ttl_s=10), record(2, ttl_s=100)]))  # type: ignore[arg-type]
    assert status.tolist() == [Status.OK, Status.OK]
    clock.step(5)
    (first,) = answers(directory, T, [bkey(1)])
    assert first.ttl_s == pytest.approx(5, abs=0.01)  # the remaining life is answered
    assert first.endpoint == "tcp://10.0.0.1:7000" and first.incarnation == 7
    clock.step(5)
    assert answers(directory, T, [bkey(1)]) == []
    assert len(answers(directory, T, [bkey(2)])) == 1


def test_a_long_lived_record_does_not_keep_shorter_ones_after_it() -> None:
    """Records were swept from the oldest write and the sweep stopped at the first live
    one: one tenant's 1-hour record kept every later 1 s record of any tenant in RAM (held,
    counted, never reported expired), and a router kept sending turns to them."""
    clock = FakeClock()
    directory = SwaDirectory(clock=clock)
    dropped: list[str | None] = []
    directory.listener = lambda _tenant, _raw, cause: dropped.append(cause)
    directory.put(T, record_items([record(0, ttl_s=3600)]))  # type: ignore[arg-type]
    short = [record(n, ttl_s=1) for n in range(1, 1001)]
    directory.put(OTHER, record_items(short))  # type: ignore[arg-type]
    directory.put(T, record_items([record(5000, ttl_s=1), record(5000, ttl_s=2)]))  # type: ignore[arg-type]
    clock.step(5)
    directory.expire()
    assert directory.held_by(OTHER) == 0 and directory.held_by(T) == 1
    assert directory.stats()["records"] == 1
    assert dropped.count("expired") == 1001  # the replaced 1 s record is not counted twice
    assert len(answers(directory, T, [bkey(0)])) == 1


def test_tenants_never_see_each_others_records() -> None:
    directory = SwaDirectory(clock=FakeClock())
    directory.put(T, record_items([record(1)]))  # type: ignore[arg-type]
    assert answers(directory, OTHER, [bkey(1)]) == []
    assert len(answers(directory, T, [bkey(1)])) == 1


def test_same_holder_replaces_its_record_and_ttl_zero_withdraws() -> None:
    clock = FakeClock()
    directory = SwaDirectory(clock=clock)
    directory.put(T, record_items([record(1, incarnation=1)]))  # type: ignore[arg-type]
    # The worker restarted at the same endpoint: its new record replaces the old one.
    directory.put(T, record_items([record(1, incarnation=2)]))  # type: ignore[arg-type]
    assert [r.incarnation for r in answers(directory, T, [bkey(1)])] == [2]
    assert len(directory) == 1
    withdrawn = directory.put(T, record_items([record(1, ttl_s=0)]))  # type: ignore[arg-type]
    assert withdrawn.tolist() == [Status.OK]
    assert answers(directory, T, [bkey(1)]) == []
    again = directory.put(T, record_items([record(1, ttl_s=0)]))  # type: ignore[arg-type]
    assert again.tolist() == [Status.NOT_FOUND]


def test_records_are_bounded_per_key_and_in_all() -> None:
    directory = SwaDirectory(max_records=10, max_per_key=3, clock=FakeClock())
    holders = [record(1, endpoint=f"tcp://10.0.0.{i}:7000", ttl_s=100 + i) for i in range(5)]
    directory.put(T, record_items(holders))  # type: ignore[arg-type]
    kept = answers(directory, T, [bkey(1)])
    # The records expiring first made way.
    assert sorted(r.endpoint for r in kept) == [f"tcp://10.0.0.{i}:7000" for i in (2, 3, 4)]
    directory.put(T, record_items([record(n) for n in range(10, 30)]))  # type: ignore[arg-type]
    assert len(directory) == 10
    assert directory.stats()["evicted"] == 2 + 3 + 10


@pytest.mark.parametrize(
    ("field", "value"),
    [("position", 0), ("nbytes", 0), ("endpoint", b"not-an-endpoint"), ("ttl_ms", 4_000_000)],
)
def test_malformed_records_fail_alone(field: str, value: Any) -> None:
    directory = SwaDirectory(clock=FakeClock())
    items = record_items([record(1), record(2)])
    items[0][field] = value
    assert directory.put(T, items).tolist() == [Status.BAD_ITEM, Status.OK]  # type: ignore[arg-type]
    assert len(directory) == 1


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=3 * DIR_ANSWER_DTYPE.itemsize))
def test_answer_parser_raises_only_protocol_errors(raw: bytes) -> None:
    keys = [bkey(1), bkey(2)]
    with contextlib.suppress(ProtocolError):
        parse_answers(raw, keys, np.arange(2))


def test_answer_naming_another_key_is_refused() -> None:
    directory = SwaDirectory(clock=FakeClock())
    directory.put(T, record_items([record(1)]))  # type: ignore[arg-type]
    raw = directory.lookup(T, keys_items([bkey(1)])).tobytes()  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="another key"):
        parse_answers(raw, [bkey(2)], np.arange(1))


# ---------------------------------------------------------------------- the daemon's handler


@pytest.fixture
def handler(tmp_path: Path) -> Iterator[RequestHandler]:
    with ShardStore(tmp_path / "db", capacity_bytes=64 << 20, clock=FakeClock()) as store:
        yield RequestHandler(store, Metrics(), node_id="h", tenant_names={T: "default"})


def _request(op: Op, items: Any) -> Request:
    raw = join(encode(Header(op=op, request_id=3, count=len(items)), items))
    return Request(T, decode(raw), time.perf_counter(), len(raw))  # type: ignore[arg-type]


def test_handler_registers_and_answers_records(handler: RequestHandler) -> None:
    reply = handler.handle(_request(Op.DIR_PUT, record_items([record(4)])))
    put = decode(join(reply.frames))
    assert put.items["status"].tolist() == [Status.OK]
    reply = handler.handle(_request(Op.HAS_DIR, keys_items([bkey(3), bkey(4)])))
    has = decode(join(reply.frames))
    assert len(has.items) == 0  # no shards stored: the HAS part is empty
    (got,) = [r for _, r in parse_answers(has.data, [bkey(3), bkey(4)], np.arange(2))]
    assert got.key.block == bkey(4) and got.nbytes == 1004
    assert handler.stats()["swa_directory"]["records"] == 1


def test_a_daemon_refuses_swa_get(handler: RequestHandler) -> None:
    reply = decode(
        join(handler.handle(_request(Op.SWA_GET, make_items(Op.SWA_GET, 1, reply=False))).frames)
    )
    assert reply.header.status is Status.BAD_REQUEST
    assert "worker" in reply.error_text()


# ---------------------------------------------------------------------- a real cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("swa-dir"))
    c.start(nodes=12, capacity="128MiB", tenants=("default", "other"))
    yield c
    c.stop()


def test_lookup_rides_on_the_match_and_survives_a_dead_daemon(cluster: LocalCluster) -> None:
    tokens = list(range(1000, 1000 + 16 * 6))
    keys = block_keys(MAIN_NS, tokens)
    payloads = np.random.default_rng(1).integers(0, 256, (4, LAYOUT.payload_bytes), np.uint8)
    with Client(cluster.client_config(timeout_s=2.0)) as client:
        client.store(MAIN_NS, tokens, payloads)  # the first 4 of 6 blocks are stored
        directory = Directory(client, replicas=3)
        records = [
            HolderRecord(
                key=StateKey(namespace=NS, block=keys[b], position=(b + 1) * 16),
                endpoint="tcp://127.0.0.1:1",
                incarnation=99,
                nbytes=4096,
                digest=state_digest(bytes([b])),
                ttl_s=60,
            )
            for b in (1, 3)
        ]
        assert directory.publish(records) == 2
        match, holders = directory.lookup(MAIN_NS, tokens)
        # The match is what a plain match_prefix says; the records came back with it.
        assert match.hit_blocks == client.match_prefix(MAIN_NS, tokens).hit_blocks == 4
        assert sorted(holders) == [1, 3]
        assert holders[3][0].key == records[1].key and holders[3][0].incarnation == 99
        assert 59 < holders[3][0].ttl_s <= 60
        # One worker's states at two positions after one block are two records, both found
        # (the lookup took them for one replica's copy of the other).
        second = HolderRecord(
            key=StateKey(namespace=NS, block=keys[3], position=4 * 16 + 6),
            endpoint="tcp://127.0.0.1:1",
            incarnation=99,
            nbytes=4096,
            digest=state_digest(b"x"),
            ttl_s=50,
        )
        assert directory.publish([second]) == 1
        _, holders = directory.lookup(MAIN_NS, tokens)
        assert sorted(r.key.position for r in holders[3]) == [64, 70]
        # Another tenant sees nothing, even with the same keys.
        other = cluster.client_config(tenant="other", timeout_s=2.0)
    with Client(other) as client:
        _, theirs = Directory(client).lookup(MAIN_NS, tokens)
        assert theirs == {}
    # A record lives on 3 of the key's holders: stopping the first one loses nothing.
    with Client(cluster.client_config(timeout_s=2.0)) as client:
        first = int(client.core.placement.holders([keys[3]])[0, 0])
    cluster.pause(first)
    try:
        with Client(cluster.client_config(timeout_s=1.0)) as client:
            _, holders = Directory(client).lookup(MAIN_NS, tokens)
            assert sorted(holders) == [1, 3]
    finally:
        cluster.resume(first)


def test_one_tenants_flood_evicts_only_its_own_records() -> None:
    """Issue 18: a tenant's DIR_PUT flood past the shared bound evicted another tenant's
    record. Now the flooder's own oldest records make way, by the per-tenant bound and by
    the total (the tenant holding the most gives way)."""
    directory = SwaDirectory(max_records=50, max_per_key=8, max_per_tenant=30, clock=FakeClock())
    directory.put(OTHER, record_items([record(1)]))  # type: ignore[arg-type]
    for start in range(100, 400, 25):
        directory.put(T, record_items([record(n) for n in range(start, start + 25)]))  # type: ignore[arg-type]
    assert len(answers(directory, OTHER, [bkey(1)])) == 1
    assert directory.held_by(T) == 30 and directory.held_by(OTHER) == 1
    # The newest of the flood are kept, the oldest made way.
    assert len(answers(directory, T, [bkey(399)])) == 1
    assert answers(directory, T, [bkey(100)]) == []
    # Past the total (two floods of 30 and one record > 50), the largest tenant gives way.
    third = tenant_id("third")
    directory.put(third, record_items([record(n) for n in range(500, 530)]))  # type: ignore[arg-type]
    assert len(directory) == 50
    assert len(answers(directory, OTHER, [bkey(1)])) == 1
