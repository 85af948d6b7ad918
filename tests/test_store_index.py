"""Store format v6's index (one row per shard, a block's shards as duplicates of one key)
against a plain model: HAS, GET, DELETE and the sweep over random histories, and the
refusal of v4 and v5 directories."""

from __future__ import annotations

import tempfile
from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import FakeClock, block_records, get_items, keys_items, put_items

from kvcache.credentials import tenant_id
from kvcache.errors import StorageError
from kvcache.retention import DAY_S
from kvcache.server.store import ShardStore
from kvcache.shard import split_shard
from kvcache.wire import NO_INDEX, Op, Status, make_items

T = tenant_id("default")
OTHER = tenant_id("alice")
#: Block keys that share their first 8 bytes in pairs (the HAS fast path sorts by them).
KEYS = [bytes([n % 3]) * 8 + n.to_bytes(8, "big") for n in range(6)]
TTL_MS = 7 * DAY_S * 1000  # class chat

# A step: ("put", tenant, key, indices, seed) | ("del", key, index or None) | ("wait", hours)
_STEP = st.one_of(
    st.tuples(
        st.just("put"),
        st.sampled_from([T, OTHER]),
        st.sampled_from(KEYS),
        st.sets(st.integers(0, 11), min_size=1, max_size=4),
        st.integers(0, 1),
    ),
    st.tuples(st.just("del"), st.sampled_from(KEYS), st.one_of(st.none(), st.integers(0, 11))),
    st.tuples(st.just("wait"), st.sampled_from([1, 24, 24 * 6, 24 * 7])),
)


def model_has(
    model: dict[tuple[bytes, bytes, int], tuple[int, int]], tenant: bytes, asked: list[bytes],
    now_ms: int,
) -> list[tuple[int, int, int]]:  # fmt: skip
    """(ordinal, index, stripe) of every live shard of each asked key, in HAS order."""
    out = []
    for ordinal, k in enumerate(asked):
        for (t, key, index), (expiry, stripe) in sorted(model.items()):
            if t == tenant and key == k and expiry > now_ms:
                out.append((ordinal, index, stripe))
    return out


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(_STEP, min_size=1, max_size=14),
    asked=st.lists(st.sampled_from(KEYS), min_size=1, max_size=8),
)
def test_index_agrees_with_a_model(steps: list[tuple[object, ...]], asked: list[bytes]) -> None:
    clock = FakeClock()
    model: dict[tuple[bytes, bytes, int], tuple[int, int]] = {}
    with (
        tempfile.TemporaryDirectory() as d,
        ShardStore(
            Path(d) / "db", capacity_bytes=64 << 20, clock=clock, replace_after_s=0.0
        ) as store,
    ):
        for step in steps:
            now = int(clock() * 1000)
            if step[0] == "put":
                _, tenant, k, indices, seed = step
                assert isinstance(tenant, bytes) and isinstance(k, bytes)
                shards = block_records(k, indices=sorted(indices), body_len=64, seed=int(seed))  # type: ignore[call-overload]
                stripe = split_shard(shards[0][2])[0].stripe_id
                items, data = put_items(shards)
                items["expect"] = [
                    model.get((tenant, k, i), (0, 0))[1]
                    for i in sorted(indices)  # type: ignore[call-overload]
                ]
                status = store.put(tenant, items, data)["status"].tolist()  # type: ignore[arg-type]
                assert status == [Status.OK] * len(shards)
                for i in indices:  # type: ignore[union-attr]
                    model[(tenant, k, i)] = (now + TTL_MS, stripe)
            elif step[0] == "del":
                _, k, index = step
                assert isinstance(k, bytes)
                items = keys_items(Op.DELETE, [k])
                items["index"] = NO_INDEX if index is None else index
                want = Status.OK if any(
                    t == T and key == k and (index is None or i == index)
                    for (t, key, i) in model
                ) else Status.NOT_FOUND  # fmt: skip
                assert store.delete(T, items)["status"].tolist() == [want]
                for m in [m for m in model if m[0] == T and m[1] == k]:
                    if index is None or m[2] == index:
                        del model[m]
            else:
                clock.step(int(step[1]) * 3600)  # type: ignore[call-overload]
                now = int(clock() * 1000)
                store.sweep(limit=10_000)
                for m in [m for m, (e, _) in model.items() if e <= now]:
                    del model[m]
            now = int(clock() * 1000)
            for tenant in (T, OTHER):
                reply = store.has(tenant, keys_items(Op.HAS, asked))  # type: ignore[arg-type]
                got = list(
                    zip(
                        reply["ordinal"].tolist(),
                        reply["index"].tolist(),
                        reply["stripe"].tolist(),
                        strict=True,
                    )
                )
                assert got == model_has(model, tenant, asked, now)
            assert store.recount() == store.usage()
            assert store.usage()["shards"] == len(model)
        # GET of every model shard, and of some that are not there, in one request.
        wanted = [*sorted({(k, i) for t, k, i in model if t == T}), (KEYS[0], 12)]
        result = store.get(T, get_items(wanted))  # type: ignore[arg-type]
        try:
            statuses = result.items["status"].tolist()
        finally:
            result.release()
        assert statuses == [Status.OK] * (len(wanted) - 1) + [Status.NOT_FOUND]


def test_has_answers_many_keys_in_the_asked_order(tmp_path: Path) -> None:
    """The sorted fast path maps every shard back to its ordinal; a key asked twice is
    answered twice; an unknown key is absent."""
    clock = FakeClock()
    keys = [n.to_bytes(16, "little") for n in range(300)]
    with ShardStore(tmp_path / "db", capacity_bytes=256 << 20, clock=clock) as store:
        shards = [
            s
            for n, k in enumerate(keys)
            for s in block_records(k, indices=sorted({n % 12, 11}), body_len=64)
        ]
        items, data = put_items(shards)
        assert not store.put(T, items, data)["status"].any()  # type: ignore[arg-type]
        asked = [*reversed(keys), b"\xff" * 16]
        reply = store.has(T, keys_items(Op.HAS, asked))  # type: ignore[arg-type]
        held = {k: sorted({n % 12, 11}) for n, k in enumerate(keys)}
        expected = [(o, i) for o, k in enumerate(asked) for i in held.get(k, [])]
        assert (
            list(zip(reply["ordinal"].tolist(), reply["index"].tolist(), strict=True)) == expected
        )
        twice = store.has(T, keys_items(Op.HAS, [keys[5], keys[7], keys[5]]))  # type: ignore[arg-type]
        assert twice["ordinal"].tolist() == [0, 0, 1, 1, 2, 2]
        assert store.has(OTHER, keys_items(Op.HAS, keys[:3]))["ordinal"].tolist() == []  # type: ignore[arg-type]
        assert len(store.has(T, make_items(Op.HAS, 0, reply=False))) == 0


@pytest.mark.parametrize("old", ["kvcache-store-v4", "kvcache-store-v5"])
def test_an_older_directory_is_refused_with_a_clear_message(tmp_path: Path, old: str) -> None:
    path = tmp_path / "db"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=4)
    meta = env.open_db(b"meta")
    env.open_db(b"expiry", dupsort=True, dupfixed=True)
    with env.begin(write=True) as txn:
        txn.put(b"format", old.encode(), db=meta)
        if old.endswith("v4"):  # a location and a retention row per shard
            env.open_db(b"retention", txn=txn)
            txn.put(T + KEYS[1] + b"\x00\x00", bytes(16), db=env.open_db(b"shards", txn=txn))
        else:  # one 36-byte row per shard, its expiry in milliseconds
            index = env.open_db(b"index", txn=txn, dupsort=True, dupfixed=True)
            txn.put(T + KEYS[1], bytes(36), db=index)
    env.close()
    with pytest.raises(StorageError, match=rf"{old}.*kvcache-store-v6.*fresh data dir"):
        ShardStore(path, capacity_bytes=64 << 20, clock=FakeClock())
    # Refused, not changed: the old index is still there, under its own format marker.
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"meta", txn=txn, create=False)) == old.encode()
        name = b"shards" if old.endswith("v4") else b"index"
        assert txn.stat(env.open_db(name, txn=txn, create=False))["entries"] == 1
    env.close()
