"""The vectorised PUT checks agree with ``split_shard`` + the key check, record by record."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import put_items

from kvcache import native
from kvcache.credentials import tenant_id
from kvcache.errors import IntegrityError, ProtocolError, ShardFormatError, StorageError
from kvcache.server.probe import fake_shard
from kvcache.server.records import (
    PARTITION_LEN,
    ROW_DTYPE,
    ROW_LEN,
    ClassTable,
    Row,
    check_put,
    check_put_numpy,
    expiry_entry,
    fresh_rows,
    partition,
    row_expiry_ms,
    row_location,
    split_expiry_entry,
    split_store_key,
    store_keys,
)
from kvcache.shard import HEADER_BYTES, split_shard
from kvcache.wire import Status

TENANT = tenant_id("default")


def reference_status(key: bytes, index: int, record: bytes) -> Status:
    try:
        header, _body = split_shard(record)
    except ShardFormatError:
        return Status.BAD_ITEM
    except IntegrityError:
        return Status.CHECKSUM
    if header.block_key != key or header.shard_index != index:
        return Status.WRONG_KEY
    return Status.OK


@st.composite
def mutated_records(draw: st.DrawFn) -> tuple[bytes, int, bytes]:
    key = draw(st.binary(min_size=16, max_size=16))
    index = draw(st.integers(0, 11))
    body = draw(st.binary(min_size=64, max_size=64)) * draw(st.integers(1, 3))
    cls = draw(st.sampled_from(["chat", "agent", "a", "x-y_z", "abcdefghijklmno"]))
    record = bytearray(fake_shard(key, index, body, traffic_class=cls))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "extend", "header_byte"]))
        if kind == "flip" and record:
            pos = draw(st.integers(0, len(record) - 1))
            record[pos] ^= draw(st.integers(1, 255))
        elif kind == "header_byte" and len(record) >= HEADER_BYTES:
            pos = draw(st.integers(0, HEADER_BYTES - 1))
            record[pos] = draw(st.integers(0, 255))
        elif kind == "cut":
            record = record[: draw(st.integers(0, len(record)))]
        elif kind == "extend":
            record += draw(st.binary(min_size=1, max_size=70))
    item_key = key if draw(st.booleans()) else draw(st.binary(min_size=16, max_size=16))
    item_index = index if draw(st.booleans()) else draw(st.integers(0, 300))
    return item_key, item_index, bytes(record)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(mutated_records(), min_size=1, max_size=8))
def test_check_put_agrees_with_split_shard(batch: list[tuple[bytes, int, bytes]]) -> None:
    items, data = put_items(batch)
    checked = check_put(TENANT, items, data)
    expected = [reference_status(*t) for t in batch]
    assert checked.status.tolist() == [int(s) for s in expected]
    ok = [i for i, s in enumerate(expected) if s == Status.OK]
    assert checked.positions == ok
    assert [bytes(r) for r in checked.records] == [batch[i][2] for i in ok]
    assert checked.keys == [TENANT + batch[i][0] + batch[i][1].to_bytes(2, "big") for i in ok]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(mutated_records(), min_size=1, max_size=8), expects=st.data())
def test_native_put_checks_equal_the_numpy_ones(
    batch: list[tuple[bytes, int, bytes]], expects: st.DataObject
) -> None:
    """kv_check_put (one call per request) gives every field of CheckedPut the numpy
    columns give, on records mutated every way the reference test mutates them."""
    if not native.AVAILABLE:
        pytest.skip("the native helpers are not built (CI requires them)")
    items, data = put_items(batch)
    items["expect"] = expects.draw(st.lists(_U64, min_size=len(batch), max_size=len(batch)))
    fast, slow = check_put(TENANT, items, data), check_put_numpy(TENANT, items, data)
    assert fast.status.dtype == slow.status.dtype
    assert fast.status.tolist() == slow.status.tolist()
    assert (fast.positions, fast.keys, fast.classes) == (slow.positions, slow.keys, slow.classes)
    assert (fast.stripes, fast.expects, fast.checks) == (slow.stripes, slow.expects, slow.checks)
    assert [bytes(r) for r in fast.records] == [bytes(r) for r in slow.records]


@pytest.mark.parametrize("check", [check_put, check_put_numpy])
def test_put_lengths_that_do_not_add_up_are_refused(check: object) -> None:
    items, data = put_items([(os.urandom(16), 0, fake_shard(os.urandom(16), 0, b"x" * 64))])
    with pytest.raises(ProtocolError, match="add up to"):
        check(TENANT, items, data[:-1])  # type: ignore[operator]


def test_store_keys_round_trip() -> None:
    keys = [os.urandom(16) for _ in range(5)]
    indices = np.array([0, 1, 255, 256, 65535], dtype=np.uint16)
    packed = store_keys(TENANT, np.array(keys, dtype="V16"), indices)
    assert [split_store_key(k) for k in packed] == [
        (TENANT, key, int(i)) for key, i in zip(keys, indices, strict=True)
    ]
    # Big-endian index: one key's shards sort in index order.
    three = store_keys(TENANT, np.array([keys[0]] * 3, dtype="V16"), np.array([256, 2, 1]))
    assert sorted(three) == [
        TENANT + keys[0] + b"\x00\x01",
        TENANT + keys[0] + b"\x00\x02",
        TENANT + keys[0] + b"\x01\x00",
    ]
    assert store_keys(TENANT, np.zeros(0, dtype="V16"), np.zeros(0, dtype=np.uint16)) == []


def test_expiry_entries_sort_by_partition_then_time() -> None:
    key = os.urandom(16)
    skey = TENANT + key + b"\x00\x03"
    early, late = expiry_entry(skey, "chat", 5), expiry_entry(skey, "chat", 6)
    other_class = expiry_entry(skey, "agent", 1)
    assert early[0] < late[0] and split_expiry_entry(*late) == (6, skey)
    # The duplicate is the block key and index: fixed size, so LMDB packs them (DUPFIXED).
    assert early[1] == late[1] == key + b"\x00\x03"
    assert early[0][:PARTITION_LEN] == partition(TENANT, "chat") != other_class[0][:PARTITION_LEN]


_U32 = st.integers(0, 2**32 - 1)
_U64 = st.integers(0, 2**64 - 1)
#: Expiries are whole seconds (kvcache.retention.decide.EXPIRY_QUANTUM_MS), kept as u32.
_EXPIRY = st.integers(0, 2**32 - 1).map(lambda s: s * 1000)
_CLASS = st.from_regex(r"\+?[a-z0-9][a-z0-9_-]{0,14}", fullmatch=True)


@given(
    rows=st.lists(
        st.tuples(
            st.binary(min_size=16, max_size=16),
            st.integers(0, 65535),
            _CLASS,
            _U32,
            _EXPIRY,
            _U64,
            _U32,
        ),
        min_size=1,
        max_size=20,
    ),
    written=st.integers(0, (2**32 - 1) * 1000),
    seg=_U32,
)
def test_fresh_rows_are_the_rows_one_at_a_time(
    rows: list[tuple[bytes, int, str, int, int, int, int]], written: int, seg: int
) -> None:
    """The column builder of a PUT's rows equals Row.pack, row by row, and every row reads
    back (Row.unpack, row_location, the numpy ROW_DTYPE) as what was written."""
    tenant = b"tenant-8"
    keys = store_keys(
        tenant,
        np.frombuffer(b"".join(r[0] for r in rows), "V16"),
        np.array([r[1] for r in rows]),
    )
    table = ClassTable()
    ids = np.array([table.id_of(r[2]) for r in rows], np.uint16)
    packed = fresh_rows(
        keys,
        class_ids=ids,
        sizes=np.array([r[3] for r in rows], np.uint32),
        expiry_ms=np.array([r[4] for r in rows], np.uint64),
        stripes=np.array([r[5] for r in rows], np.uint64),
        written_ms=written,
        seg=seg,
        offsets=np.array([r[6] for r in rows], np.uint32),
    )
    again = ClassTable.unpack(table.pack())
    assert again.names == table.names
    for (_k, index, cls, size, expiry, stripe, off), raw in zip(rows, packed, strict=True):
        row = Row(index, expiry, size, stripe, written, cls, seg, off)
        assert len(raw) == ROW_LEN and raw == row.pack(table)
        # Written times are kept in whole seconds, rounded up: never older than they were.
        back = Row.unpack(raw, again)
        assert back == replace(row, written_ms=back.written_ms)
        assert 0 <= back.written_ms - written < 1000 and back.written_ms % 1000 == 0
        assert row_location(raw) == row.location
        arr = np.frombuffer(raw, ROW_DTYPE)[0]
        assert (int(arr["index"]), int(arr["expiry"]) * 1000, int(arr["stripe"])) == (
            index,
            expiry,
            stripe,
        )
        assert row_expiry_ms(arr.reshape(1)).tolist() == [expiry]
    # The rows of one block key sort by shard index (the duplicates' order in the index).
    by_key: dict[bytes, list[bytes]] = {}
    for skey, raw in zip(keys, packed, strict=True):
        by_key.setdefault(skey[:24], []).append(raw)
    for found in by_key.values():
        assert [r[:2] for r in sorted(found)] == sorted(r[:2] for r in found)


def test_class_table_persists_only_what_was_committed() -> None:
    table = ClassTable.unpack(None)
    assert not table.dirty and table.id_of("chat") == 0 and table.dirty
    assert table.id_of("+chat") == 1 and table.id_of("chat") == 0
    table.persisted()
    assert not table.dirty and ClassTable.unpack(table.pack()).names == ["chat", "+chat"]


@given(expiry=st.integers(0, (2**32 - 1) * 1000))
def test_a_row_keeps_its_expiry_in_whole_seconds_never_earlier(expiry: int) -> None:
    table = ClassTable()
    row = Row(3, expiry, 1000, 7, 5000, "chat", 1, 2)
    back = Row.unpack(row.pack(table), table)
    assert 0 <= back.expiry_ms - expiry < 1000 and back.expiry_ms % 1000 == 0
    [column] = fresh_rows([b"t" * 8 + b"k" * 16 + b"\x00\x03"], class_ids=np.array([0]),
                          sizes=np.array([1000]), expiry_ms=np.array([expiry], np.uint64),
                          stripes=np.array([7], np.uint64), written_ms=5000, seg=1,
                          offsets=np.array([2]))  # fmt: skip
    assert column == row.pack(table)


def test_an_expiry_past_what_a_row_keeps_is_a_storage_error_not_a_wrap() -> None:
    table = ClassTable()
    too_far = (2**32 + 5) * 1000
    with pytest.raises(StorageError, match="clock"):
        Row(3, too_far, 1000, 7, 5000, "chat", 1, 2).pack(table)
    with pytest.raises(StorageError, match="clock"):
        fresh_rows([b"t" * 8 + b"k" * 16 + b"\x00\x03"], class_ids=np.array([0]),
                   sizes=np.array([1000]), expiry_ms=np.array([too_far], np.uint64),
                   stripes=np.array([7], np.uint64), written_ms=5000, seg=1,
                   offsets=np.array([2]))  # fmt: skip
