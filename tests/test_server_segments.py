"""Store format v4/v5: shard records in segment files beside the LMDB index (real files)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_fixtures import FakeClock, block_records, get_items, keys_items, put_items

from kvcache.credentials import tenant_id
from kvcache.errors import StorageError
from kvcache.net_loop import FileRange, SendQueue, frame_nbytes, frame_view
from kvcache.retention import DAY_S, RetentionPolicy
from kvcache.server import store as store_module
from kvcache.server.probe import fake_shard
from kvcache.server.scrub import Scrubber
from kvcache.server.segments import SPARE_KEEP_S, SegmentFd, SegmentFiles
from kvcache.server.store import ShardStore
from kvcache.wire import Op, Status

T = tenant_id("default")
SEG = 64 << 10  # small segments, so a few blocks fill one


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def open_store(path: Path, clock: FakeClock, **kwargs: object) -> ShardStore:
    return ShardStore(path, capacity_bytes=64 << 20, clock=clock, segment_bytes=SEG, **kwargs)  # type: ignore[arg-type]


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def put(store: ShardStore, shards: list[tuple[bytes, int, bytes]]) -> list[int]:
    items, data = put_items(shards)
    return store.put(T, items, data)["status"].tolist()  # type: ignore[no-any-return]


def read(store: ShardStore, wanted: list[tuple[bytes, int]]) -> tuple[list[int], bytes, int]:
    """(statuses, the reply's data section, how many buffers it was sent as)."""
    result = store.get(T, get_items(wanted))
    try:
        data = b"".join(bytes(p) for p in result.parts)
        return result.items["status"].tolist(), data, len(result.parts)
    finally:
        result.release()


def churn_segments(store: ShardStore) -> None:
    """Roll many segments, drop them and reuse their files (blocks 2..29 come and go)."""
    for n in range(2, 30):
        put(store, block_records(key(n), body_len=2048))
        store.delete(T, get_items([(key(n), i) for i in range(12)]))
        while store.reclaim():
            pass
    assert store.counters["segments_dropped"] >= 5


def assert_blocks(
    store: ShardStore, blocks: dict[int, list[tuple[bytes, int, bytes]]], gone: list[int]
) -> None:
    """Every block of ``gone`` is not found; every other reads back whole, byte for byte."""
    for n, shards in blocks.items():
        status, data, _ = read(store, [(key(n), i) for i in range(12)])
        if n in gone:
            assert status == [Status.NOT_FOUND] * 12
        else:
            assert status == [Status.OK] * 12 and data == b"".join(r for _, _, r in shards)


def seg_files(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.seg"))


def test_a_batch_is_one_append_and_is_read_back_as_one_buffer(
    tmp_path: Path, clock: FakeClock
) -> None:
    shards = block_records(key(1), body_len=640)
    with open_store(tmp_path / "db", clock) as store:
        assert put(store, shards) == [Status.OK] * 12
        status, data, buffers = read(store, [(key(1), i) for i in range(12)])
        assert status == [Status.OK] * 12
        assert data == b"".join(r for _, _, r in shards)
        assert buffers == 1  # twelve adjacent records, one view
        # Asked out of order or with a gap: still exact bytes, in item order.
        status, data, buffers = read(store, [(key(1), 5), (key(1), 3), (key(9), 0), (key(1), 4)])
        assert status == [Status.OK, Status.OK, Status.NOT_FOUND, Status.OK]
        assert data == shards[5][2] + shards[3][2] + shards[4][2]
        assert buffers == 2  # 5 | 3 (not after 5) then 4 (after 3): 3 and 4 joined


def test_segments_roll_and_reopen_keeps_every_record(tmp_path: Path, clock: FakeClock) -> None:
    blocks = {n: block_records(key(n), body_len=2048) for n in range(12)}  # ~25 KiB each
    with open_store(tmp_path / "db", clock) as store:
        for shards in blocks.values():
            assert put(store, shards) == [Status.OK] * 12
        assert len(seg_files(tmp_path / "db")) >= 4
    with open_store(tmp_path / "db", clock) as store:
        for n, shards in blocks.items():
            status, data, _ = read(store, [(key(n), i) for i in range(12)])
            assert status == [Status.OK] * 12 and data == b"".join(r for _, _, r in shards)
        assert store.recount() == store.usage()


def test_dead_segments_are_dropped_and_a_sparse_one_is_compacted(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Expired shards free whole segments; a segment with a few live shards left has them
    copied forward (never dropped), then goes."""
    policy = RetentionPolicy.from_mapping({"classes": {"chat": "1d", "agent": "7d"}})
    budget = {"segment_budget_bytes": 100 << 10}
    with open_store(tmp_path / "db", clock, policy=policy, **budget) as store:
        keep = block_records(key(100), body_len=2048, traffic_class="agent")
        for n in range(10):
            assert put(store, block_records(key(n), body_len=2048)) == [Status.OK] * 12
            if n == 1:
                assert put(store, keep) == [Status.OK] * 12
        before = {p.name for p in seg_files(tmp_path / "db")}
        clock.step(DAY_S + 60)  # every chat block expires; the agent block does not
        assert store.sweep(limit=10_000) == 120
        for _ in range(20):
            if not store.reclaim():
                break
        assert store.counters["segments_dropped"] >= 3
        after = {p.name for p in seg_files(tmp_path / "db")}
        assert not (before - after) <= set() and len(after) < len(before)
        status, data, _ = read(store, [(key(100), i) for i in range(12)])
        assert status == [Status.OK] * 12 and data == b"".join(r for _, _, r in keep)
        assert store.recount() == store.usage()
        files = sum(p.stat().st_size for p in seg_files(tmp_path / "db"))
        assert files <= 3 * SEG  # the dead space went
    with open_store(tmp_path / "db", clock, policy=policy, **budget) as store:  # it persists
        status, data, _ = read(store, [(key(100), i) for i in range(12)])
        assert status == [Status.OK] * 12 and data == b"".join(r for _, _, r in keep)


def test_compaction_moves_live_records_and_keeps_their_bytes(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Past their budget, the segment files are compacted: a sparse segment's live records
    are copied forward, exactly, and the segment goes."""
    with open_store(tmp_path / "db", clock, segment_budget_bytes=150 << 10) as store:
        blocks = {n: block_records(key(n), body_len=2048) for n in range(8)}
        for shards in blocks.values():
            put(store, shards)
        # Delete most of the first segments' blocks, keeping every third one.
        gone = [n for n in range(6) if n % 3]
        items = get_items([(key(n), i) for n in gone for i in range(12)])
        assert (store.delete(T, items)["status"] == Status.OK).all()
        for _ in range(50):
            if not store.reclaim():
                break
        assert store.counters["compacted_shards"] > 0
        assert store.segments.file_bytes <= 150 << 10
        assert_blocks(store, blocks, gone)
        assert store.recount() == store.usage()
        # Scrub's reader sees the moved records whole.
        assert len(store.records_after(b"", max_bytes=1 << 30)) == 12 * (8 - len(gone))


def test_a_compaction_step_of_small_records_is_bounded_by_records(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A segment of many small records is compacted in steps of at most
    ``_COMPACT_STEP_RECORDS`` records looked at (the step holds the daemon's loop), each
    going on inside the batch where the last one stopped: every live record is moved once,
    the segment goes, and every block reads back whole."""
    step = store_module._COMPACT_STEP_RECORDS
    with ShardStore(
        tmp_path / "db", capacity_bytes=64 << 20, clock=clock, segment_bytes=2 << 20,
        segment_budget_bytes=1 << 20,
    ) as store:  # fmt: skip
        blocks = {n: block_records(key(n), body_len=64) for n in range(500)}
        # 6,000 records of 168 bytes in ONE batch: a step can only stop inside it.
        assert put(store, [s for shards in blocks.values() for s in shards]) == [Status.OK] * 6000
        # A third deleted; the records a step stops at (2,048th, 4,096th) are live ones.
        gone = [n for n in blocks if n % 3 == 1]
        assert {2048 // 12, 4096 // 12}.isdisjoint(gone)
        items = get_items([(key(n), i) for n in gone for i in range(12)])
        assert (store.delete(T, items)["status"] == Status.OK).all()
        big = block_records(key(10_000), body_len=120_000)  # does not fit: seals the first
        assert put(store, big) == [Status.OK] * 12
        blocks[10_000] = big
        first = min(store.segments.state)
        moves = []
        for _ in range(50):
            before = store.counters["compacted_shards"]
            more = store.reclaim()
            moves.append(store.counters["compacted_shards"] - before)
            if not more:
                break
        kept = 12 * (len(blocks) - 1 - len(gone))
        assert sum(moves) == kept  # each live record moved exactly once
        # 6,000 records looked at, two thirds of them live: three steps at least, not one.
        assert max(moves) <= step and sum(1 for m in moves if m) >= -(-6000 // step) >= 3
        assert store.counters["segments_compacted"] == 1 and first not in store.segments.state
        assert_blocks(store, blocks, gone)
        assert store.recount() == store.usage()


def test_a_segment_compaction_cannot_empty_is_left_alone_not_compacted_again(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A sparse segment with a damaged batch head: compaction's walk stops there, so a pass
    cannot move the records behind it. The pass is counted once as uncompactable and the
    segment is never picked again (each pass would move nothing, back to back: a daemon
    spinning on it). Its records stay readable through their rows, and the segment goes
    once they do."""
    with open_store(tmp_path / "db", clock, segment_budget_bytes=100 << 10) as store:
        blocks = {n: block_records(key(n), body_len=2048) for n in range(8)}
        for shards in blocks.values():
            assert put(store, shards) == [Status.OK] * 12
        first = min(store.segments.state)
        walked = list(store.segments.walk(first))
        batches = sorted({at for at, _skey, _rec, _len in walked})
        assert len(batches) >= 2  # two blocks' batches at least in the first segment
        in_first = sorted({int.from_bytes(skey[8:24], "big") for _a, skey, _r, _l in walked})
        gone = in_first[0]  # the first batch's block; the second batch is damaged below
        store.delete(T, get_items([(key(gone), i) for i in range(12)]))
        with open(store.segments.path_of(first), "r+b") as f:  # the second batch's magic
            f.seek(batches[1])
            f.write(b"\x00\x00\x00\x00")
        calls = 0
        while store.reclaim():
            calls += 1
            assert calls < 100, "reclaim() keeps asking to run again"
        assert store.counters["segments_uncompactable"] == 1
        assert first in store.segments.state  # its live records could not be moved
        # Another segment shrinks (reclaim looks again): the damaged one is not walked again.
        compacted = store.counters["segments_compacted"]
        active = store.segments.active
        last = {int.from_bytes(skey[8:24], "big") for _a, skey, _r, _l in
                store.segments.walk(active)}  # fmt: skip
        store.delete(T, get_items([(key(n), i) for n in last for i in range(12)]))
        assert store.segments.state[active].live == 0
        while store.reclaim():
            calls += 1
            assert calls < 100, "reclaim() keeps asking to run again"
        assert store.counters["segments_uncompactable"] == 1
        assert store.counters["segments_compacted"] == compacted
        blocks = {n: shards for n, shards in blocks.items() if n not in last}
        assert_blocks(store, blocks, [gone])  # the records behind the damage read back
        # Once they go, the segment goes.
        store.delete(T, get_items([(key(n), i) for n in in_first if n != gone for i in range(12)]))
        while store.reclaim():
            pass
        assert first not in store.segments.state


@pytest.mark.parametrize("files_over_budget", [1.2, 2.0])
def test_a_drain_goes_first_and_compaction_after_it(
    tmp_path: Path, clock: FakeClock, files_over_budget: float
) -> None:
    """While a drain to the low watermark is under way and the segment files are within
    1.25x their budget, no compaction step runs between its batches (the drain empties
    segments itself); with no drain, the sparse segments deletes left are compacted,
    exactly. Files past that slack are compacted during the drain too (a drain that cannot
    finish must not stop compaction for good)."""
    blocks = {n: block_records(key(n), body_len=2048) for n in range(40)}
    with open_store(tmp_path / "db", clock) as store:
        for n, shards in blocks.items():
            if n == 20:
                clock.step(10)  # the later blocks expire later: eviction takes the first ones
            assert put(store, shards) == [Status.OK] * 12
        gone = [n for n in range(20, 40) if n % 3]  # later segments thinned by deletes
        store.delete(T, get_items([(key(n), i) for n in gone for i in range(12)]))
        while store.reclaim():  # segments the deletes emptied go now
            pass
        used, files = store.book.used, store.segments.file_bytes

    def reopened(budget: int) -> ShardStore:
        return ShardStore(tmp_path / "db", capacity_bytes=used, clock=clock, segment_bytes=SEG,
                          segment_budget_bytes=budget, sweep_batch=12)  # fmt: skip

    # Its capacity at what it holds, and a budget its files exceed: over the high watermark,
    # so a drain is due, and compaction too.
    with reopened(int(files / files_over_budget)) as store:
        turns_draining = compacted_draining = 0
        for _ in range(1000):
            before = store.counters["compacted_shards"]
            more = store.maintain()
            if store.book.used > store._low:  # still draining after this turn
                turns_draining += 1
                compacted_draining += store.counters["compacted_shards"] - before
            if not more:
                break
        assert turns_draining >= 2 and store.book.used <= store._low
        assert store.counters["evicted_shards"] > 0
        assert (compacted_draining > 0) == (files_over_budget > store_module._DRAIN_FIRST_SLACK)
    with reopened(files // 3) as store:  # drained: no drain due, compaction runs
        while store.maintain():
            pass
        assert store.counters["evicted_shards"] == 0
        assert store.counters["compacted_shards"] > 0 or compacted_draining > 0
        kept = 0
        for n, shards in blocks.items():  # eviction takes shards, not blocks: one at a time
            for k, i, record in shards:
                status, data, _ = read(store, [(k, i)])
                assert status == [Status.NOT_FOUND] if n in gone else data in (b"", record)
                kept += data == record
        assert kept == store.usage()["shards"] > 0
        assert store.recount() == store.usage()


def test_a_v3_directory_is_refused_with_a_clear_message(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "db"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=4)
    shards, meta = env.open_db(b"shards"), env.open_db(b"meta")
    env.open_db(b"retention")
    env.open_db(b"expiry", dupsort=True, dupfixed=True)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"kvcache-store-v3", db=meta)
        txn.put(T + key(1) + b"\x00\x00", b"a whole record", db=shards)
    env.close()
    with pytest.raises(StorageError, match=r"kvcache-store-v3.*segment files.*fresh data direct"):
        open_store(path, clock)


def test_a_missing_or_cut_segment_loses_only_its_shards(tmp_path: Path, clock: FakeClock) -> None:
    with open_store(tmp_path / "db", clock) as store:
        for n in range(6):
            put(store, block_records(key(n), body_len=2048))
    files = seg_files(tmp_path / "db")
    files[0].unlink()
    os.truncate(files[1], 100)
    with open_store(tmp_path / "db", clock) as store:
        lost = [n for n in range(6) if read(store, [(key(n), 0)])[0] != [Status.OK]]
        assert lost and len(lost) < 6
        for n in set(range(6)) - set(lost):
            status, _, _ = read(store, [(key(n), i) for i in range(12)])
            assert status == [Status.OK] * 12
        assert store.recount() == store.usage()
        assert put(store, block_records(key(99), body_len=2048)) == [Status.OK] * 12


def test_bytes_past_the_committed_end_are_overwritten(tmp_path: Path, clock: FakeClock) -> None:
    """A crash between a segment write and its index commit leaves bytes nothing points
    at; the next append writes over them."""
    with open_store(tmp_path / "db", clock) as store:
        put(store, block_records(key(1), body_len=640))
    (active,) = seg_files(tmp_path / "db")
    with open(active, "ab") as fh:
        fh.write(b"\xff" * 5000)  # an append whose transaction never committed
    with open_store(tmp_path / "db", clock) as store:
        shards = block_records(key(2), body_len=640)
        assert put(store, shards) == [Status.OK] * 12
        status, data, _ = read(store, [(key(2), i) for i in range(12)])
        assert status == [Status.OK] * 12 and data == b"".join(r for _, _, r in shards)
        walked = [k for seg in store.segments.state for _, k, _, _ in store.segments.walk(seg)]
        assert len(walked) == 24


def test_segment_files_refuse_a_bad_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="segment_bytes"):
        SegmentFiles(tmp_path, segment_bytes=1000, sync_each_write=False)


def test_under_its_budget_a_sparse_segment_is_left_alone(tmp_path: Path, clock: FakeClock) -> None:
    """Compaction copies records only when the files pass their budget: under it, a
    half-dead segment stays (its shards will mostly go by themselves), an empty one goes."""
    with open_store(tmp_path / "db", clock) as store:
        for n in range(8):
            put(store, block_records(key(n), body_len=2048))
        gone = [n for n in range(6) if n % 3]
        items = get_items([(key(n), i) for n in gone for i in range(12)])
        store.delete(T, items)
        store.delete(T, get_items([(key(0), i) for i in range(12)]))
        store.delete(T, get_items([(key(3), i) for i in range(6)]))
        while store.reclaim():
            pass
        assert store.counters["compacted_shards"] == 0
        assert store.counters["segments_dropped"] >= 1
        status, _, _ = read(store, [(key(3), i) for i in range(6, 12)])
        assert status == [Status.OK] * 6
        assert store.recount() == store.usage()


def node_share(n: int) -> list[tuple[bytes, int, bytes]]:
    """What one node of twelve gets of block ``n``: one of its shards."""
    return block_records(key(n), body_len=2048, indices=[n % 12])


def fill_full_node(
    store: ShardStore, clock: FakeClock, *, seconds: int, per_second: int, first: int = 0
) -> int:
    """PUT ``per_second`` batches a second, each of one shard of 16 fresh blocks (keys from
    ``first`` on), for ``seconds`` seconds into a node that fills and evicts, running its
    maintenance after each PUT as the daemon does; returns the most bytes the segment
    files took at any point."""
    most = 0
    for s in range(seconds):
        for b in range(per_second):
            base = first + 1000 * s + 16 * b
            batch = [shard for n in range(base, base + 16) for shard in node_share(n)]
            assert put(store, batch) == [Status.OK] * 16
            store.drain_after_crossing()
            while store.maintain():
                pass
            most = max(most, store.segments.file_bytes)
        clock.step(1)
    return most


def test_a_full_node_does_not_compact_what_eviction_takes_next(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Shards written in one second share an expiry and are evicted in key order, so a
    full node thins every segment of the head second at once. Those segments are left to
    eviction, not compacted (their records are the next to go): no record is copied, the
    dead space stays within about two seconds' writes, and what is live reads back whole."""
    capacity = 1 << 20
    with ShardStore(tmp_path / "full", capacity_bytes=capacity, clock=clock, monotonic=clock,
                    segment_bytes=SEG, segment_budget_bytes=capacity * 8 // 10) as store:  # fmt: skip
        per_second = 15  # 240 shards, ~520 KiB of records a second: half the node
        most = fill_full_node(store, clock, seconds=10, per_second=per_second)
        assert store.counters["evicted_shards"] > 16 * per_second * 5
        assert store.counters["segments_dropped"] > 20
        assert store.counters["compacted_shards"] == 0
        second = 16 * per_second * (2048 + 104 + 64)
        assert most <= store.segment_budget + 2 * second + 2 * SEG
        newest = range(9000, 9000 + 16 * per_second)  # the last second: all live
        status, data, _ = read(store, [(key(n), n % 12) for n in newest])
        assert status == [Status.OK] * len(newest)
        assert data == b"".join(r for n in newest for _, _, r in node_share(n))
        assert store.recount() == store.usage()


def files_on_disk(path: Path) -> dict[str, int]:
    """Bytes of the segment files and of the files kept for reuse, as the disk holds them."""
    directory = path / "segments"
    return {
        kind: sum(f.stat().st_size for f in directory.glob(f"*.{kind}"))
        for kind in ("seg", "spare")
    }


def test_a_full_node_writes_new_segments_into_the_files_of_dropped_ones(
    tmp_path: Path, clock: FakeClock
) -> None:
    """On a full node every dropped segment's file is kept and the next segment rewrites it
    (its pages cached, its blocks allocated), so after its first drops the node makes few
    new files; the kept files never take the disk past the bound the segments alone keep;
    the live records read back whole from rewritten files; a node that stops writing gives
    the kept files back after SPARE_KEEP_S, and a restart removes any left."""
    capacity = 1 << 20
    path = tmp_path / "full"
    with ShardStore(path, capacity_bytes=capacity, clock=clock, monotonic=clock,
                    segment_bytes=SEG, segment_budget_bytes=capacity * 8 // 10) as store:  # fmt: skip
        per_second = 15
        most = 0
        new_files_after_first_drop = 0
        for s in range(10):
            for b in range(per_second):
                before = (store.segments.active, store.counters["segments_reused"])
                dropped = store.counters["segments_dropped"]
                base = 1000 * s + 16 * b
                batch = [shard for n in range(base, base + 16) for shard in node_share(n)]
                assert put(store, batch) == [Status.OK] * 16
                rolled = store.segments.active - before[0]
                reused = store.counters["segments_reused"] - before[1]
                if dropped:
                    new_files_after_first_drop += rolled - reused
                store.drain_after_crossing()
                while store.maintain():
                    pass
                disk = files_on_disk(path)
                most = max(most, disk["seg"] + disk["spare"])
                # A drop moves a file to the spares, a new segment takes one back: every
                # dropped file is either reused or still kept.
                spares = len(list((path / "segments").glob("*.spare")))
                assert (
                    store.counters["segments_reused"] + spares == store.counters["segments_dropped"]
                )
            clock.step(1)
        assert store.counters["segments_dropped"] > 20
        assert store.counters["segments_reused"] > 20
        assert new_files_after_first_drop <= 4
        second = 16 * per_second * (2048 + 104 + 64)
        assert most <= store.segment_budget + 2 * second + 2 * SEG
        newest = range(9000, 9000 + 16 * per_second)
        status, data, _ = read(store, [(key(n), n % 12) for n in newest])
        assert status == [Status.OK] * len(newest)
        assert data == b"".join(r for n in newest for _, _, r in node_share(n))
        assert files_on_disk(path)["spare"] > 0
        clock.step(SPARE_KEEP_S + 10)  # the node idles: what it kept is given back
        store.maintain()
        assert files_on_disk(path)["spare"] == 0
        # Spares again (a minute's churn), then a restart: they are removed, the rest reads.
        fill_full_node(store, clock, seconds=2, per_second=per_second, first=20_000)
        assert files_on_disk(path)["spare"] > 0
    with ShardStore(path, capacity_bytes=capacity, clock=clock, monotonic=clock,
                    segment_bytes=SEG, segment_budget_bytes=capacity * 8 // 10) as store:  # fmt: skip
        assert files_on_disk(path)["spare"] == 0
        newest = range(21_000, 21_000 + 16 * per_second)
        status, data, _ = read(store, [(key(n), n % 12) for n in newest])
        assert status == [Status.OK] * len(newest)
        assert data == b"".join(r for n in newest for _, _, r in node_share(n))


def test_kept_files_are_reused_newest_first_and_given_back_after_a_while(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A dropped segment's file is kept; a new segment takes the newest kept (its pages the
    likeliest still cached) and rewrites it from the start; one kept longer than
    ``keep_s`` is removed by release_spares, a younger one stays."""
    files = SegmentFiles(tmp_path, segment_bytes=SEG, sync_each_write=False, monotonic=clock)
    files.load({})
    record = bytes(range(250)) * 120  # 30,000 bytes: two batches fill a segment
    for _ in range(6):  # segments 0, 1, 2
        files.append([T + key(1)], [record])
    assert files.active == 2
    files.drop(0)
    clock.step(10)
    files.drop(1)
    assert sorted(p.name for p in (tmp_path / "segments").glob("*.spare")) == [
        "00000000.spare",
        "00000001.spare",
    ]
    seg, first, _ = files.append([T + key(3)], [record[::-1]])  # rolls onto segment 1's file
    assert (seg, files.reused) == (3, 1)
    assert not (tmp_path / "segments" / "00000001.spare").exists()
    assert bytes(files.view(3)[first : first + len(record)]) == record[::-1]
    clock.step(SPARE_KEEP_S - 5)  # segment 0's file: kept 35 s
    files.drop(2)  # kept from now
    clock.step(4)
    assert files.release_spares() == 1
    assert [p.name for p in (tmp_path / "segments").glob("*.spare")] == ["00000002.spare"]
    assert files.spare_bytes == os.stat(tmp_path / "segments" / "00000002.spare").st_size > 0
    files.close()


def test_a_restarted_full_node_still_leaves_its_head_segments_to_eviction(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Each segment's latest expiry is kept in its meta row, so a full node restarted (a
    rolling restart) still knows which segments eviction empties next, and copies none."""

    def open_full() -> ShardStore:
        return ShardStore(tmp_path / "full", capacity_bytes=1 << 20, clock=clock,
                          monotonic=clock, segment_bytes=SEG,
                          segment_budget_bytes=(1 << 20) * 8 // 10)  # fmt: skip

    with open_full() as store:
        fill_full_node(store, clock, seconds=4, per_second=15)
        assert store.counters["compacted_shards"] == 0
        kept = dict(store._latest_expiry)
        assert kept and set(kept) <= set(store.segments.state)
    with open_full() as store:
        assert store._latest_expiry == kept
        fill_full_node(store, clock, seconds=6, per_second=15, first=4000)
        assert store.counters["evicted_shards"] > 16 * 15 * 3
        assert store.counters["segments_dropped"] > 10
        assert store.counters["compacted_shards"] == 0
        assert set(store._latest_expiry) <= set(store.segments.state)  # dropped ones forgotten
        assert store.recount() == store.usage()
    with open_full() as store:  # what it dropped is gone from the meta rows too
        assert set(store._latest_expiry) <= set(store.segments.state)


def test_a_full_node_compacts_a_sparse_segment_that_lives_longer(
    tmp_path: Path, clock: FakeClock
) -> None:
    """On a full node, a segment of a longer class that deletes thinned is compacted (its
    records are not the next to go), even when the node found only head segments to
    compact a moment before, and while it then idles: its live records move forward,
    exactly, and the dead space goes."""
    policy = RetentionPolicy.from_mapping({"classes": {"chat": "1d", "agent": "7d"}})
    capacity = 1 << 20
    with ShardStore(tmp_path / "db", capacity_bytes=capacity, clock=clock, monotonic=clock,
                    segment_bytes=SEG, policy=policy,
                    segment_budget_bytes=capacity // 2) as store:  # fmt: skip
        fill_full_node(store, clock, seconds=6, per_second=14)  # chat: full, evicting
        agent = {n: block_records(key(n), body_len=2048, traffic_class="agent") for n in range(6)}
        for shards in agent.values():
            assert put(store, shards) == [Status.OK] * 12
        for b in range(3):  # more chat in the same second: their segments are sealed
            batch = [shard for n in range(50_000 + 16 * b, 50_016 + 16 * b)
                     for shard in node_share(n)]  # fmt: skip
            assert put(store, batch) == [Status.OK] * 16
            store.drain_after_crossing()
            while store.maintain():  # it finds only head segments to compact, if any
                pass
        assert store.book.used >= 0.7 * capacity  # full: within a drain of the low watermark
        before = store.counters["compacted_shards"]
        gone = [n for n in agent if n]  # deleted within the second it last looked
        store.delete(T, get_items([(key(n), i) for n in gone for i in range(12)]))
        for _ in range(10):  # the node idles: maintenance each second, nothing else
            while store.maintain():
                pass
            clock.step(1)
        assert store.counters["compacted_shards"] - before >= 12  # block 0's, moved
        assert_blocks(store, agent, gone)
        assert store.recount() == store.usage()


def test_a_full_node_compacts_the_segments_of_records_a_hit_kept(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Hits slide a few shards' expiries while the rest of their seconds are evicted: the
    segments they keep alive fall behind the head, and are compacted (they are not the
    next to go), so the files stay within about a second's writes of their budget."""
    capacity = 1 << 20
    hot: list[bytes] = []
    with ShardStore(tmp_path / "db", capacity_bytes=capacity, clock=clock, monotonic=clock,
                    segment_bytes=SEG, segment_budget_bytes=capacity * 8 // 10,
                    touch_resolution_s=1, touch_flush_s=0) as store:  # fmt: skip
        per_second = 15
        for s in range(30):
            fill_full_node(store, clock, seconds=1, per_second=per_second, first=1000 * s)
            if s < 8:
                hot.extend(key(1000 * s + 32 * b) for b in range(per_second // 2 + 1))
            status = store.touch(T, keys_items(Op.TOUCH, hot), "chat")["status"]
            assert (status == Status.OK).all()  # the hot blocks stay live
            store.flush_touches()
        assert store.counters["compacted_shards"] > 0
        second = 16 * per_second * (2048 + 104 + 64)
        assert store.segments.file_bytes <= store.segment_budget + second + 2 * SEG
        status, _, _ = read(store, [(k, int.from_bytes(k, "big") % 12) for k in hot])
        assert status == [Status.OK] * len(hot)
        assert store.recount() == store.usage()


def test_the_periodic_sync_syncs_segments_then_the_index(tmp_path: Path, clock: FakeClock) -> None:
    """sync = periodic: the sync thread fdatasyncs the segments written since its last round
    before it syncs LMDB (what a synced index points at is on disk first)."""
    from kvcache.server.config import SyncMode

    calls: list[str] = []
    store = open_store(tmp_path / "db", clock, sync=SyncMode.PERIODIC, sync_interval_s=3600)
    try:
        segment_sync, env_sync = store.segments.sync, store._env.sync
        store.segments.sync = lambda: (calls.append("segments"), segment_sync())[1]  # type: ignore[method-assign]
        put(store, block_records(key(1), body_len=640))
        assert store.segments._dirty  # written, not yet synced
        with store.segments.writing:
            pass  # the writer holds it only from an append to its commit
        store._sync_durably()
        assert calls == ["segments"] * 4 and not store.segments._dirty  # 3 unheld, 1 held
        assert env_sync is not None
    finally:
        store.close()


def test_sweeping_part_of_one_batch_takes_its_head_and_keeps_the_rest(
    tmp_path: Path, clock: FakeClock
) -> None:
    """One PUT batch is one expiry key with its shards as duplicates: a sweep bounded below
    its size takes the first shards of it, the next takes the next, and the counters, the
    segment's live bytes and the shards left stay exact."""
    shards = [s for n in range(5) for s in block_records(key(n), body_len=640)]
    with open_store(tmp_path / "db", clock) as store:
        assert put(store, shards) == [Status.OK] * 60
        clock.step(8 * DAY_S)
        seg = store.segments.active
        taken = []
        while (n := store.sweep(limit=7)) > 0:
            taken.append(n)
            assert store.recount() == store.usage()
            assert store.segments.state[seg].live == 60 - sum(taken)
        assert taken == [7] * 8 + [4]
        assert store.usage()["shards"] == 0


def test_a_reply_in_flight_keeps_its_bytes_while_its_segment_goes(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A GET's views outlive the segment they point into: a dropped segment that a reply
    still holds a view of is unlinked, never rewritten as a later segment."""
    first = block_records(key(1), body_len=2048)
    with open_store(tmp_path / "db", clock) as store:
        put(store, first)
        held = store.get(T, get_items([(key(1), i) for i in range(12)]))  # not released
        # The segment grows after that view was taken: a later GET maps it again.
        second = block_records(key(99), body_len=2048)
        put(store, second)
        assert read(store, [(key(99), i) for i in range(12)])[1] == b"".join(
            r for _, _, r in second
        )
        store.delete(T, get_items([(key(k), i) for k in (1, 99) for i in range(12)]))
        churn_segments(store)
        assert b"".join(bytes(p) for p in held.parts) == b"".join(r for _, _, r in first)
        held.release()


@settings(max_examples=30, deadline=None)
@given(
    batches=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 3), st.integers(0, 40), st.integers(0, 11), st.integers(1, 300)
            ),
            min_size=1,
            max_size=12,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_walk_names_every_record_of_every_tenant(
    batches: list[list[tuple[int, int, int, int]]],
) -> None:
    """Store format v6's batches name a record by a slot in the batch's tenant table and
    the record's own header: walking them gives back every (storage key, offset, length)
    that was appended, tenants of a group commit mixed in one batch."""
    tenants = [tenant_id(f"t{n}") for n in range(4)]
    with tempfile.TemporaryDirectory() as d:
        files = SegmentFiles(Path(d), segment_bytes=SEG, sync_each_write=False)
        try:
            files.load({})
            written = []
            for batch in batches:
                keys, records = [], []
                for t, k, i, body in batch:
                    keys.append(tenants[t] + key(k) + i.to_bytes(2, "big"))
                    records.append(fake_shard(key(k), i, bytes(body)))
                seg, first, _before = files.append(keys, records)
                at = first
                for skey, record in zip(keys, records, strict=True):
                    written.append((seg, skey, at, len(record)))
                    at += len(record)
            walked = [
                (seg, skey, at, length)
                for seg in sorted(files.state)
                for _, skey, at, length in files.walk(seg)
            ]
            assert walked == written
            assert_walks_resume(files)
        finally:
            files.close()


def assert_walks_resume(files: SegmentFiles) -> None:
    """A walk resumed at a record's offset, in its batch, goes on from that record; one
    resumed a byte into it, from the next (what a compaction step stopped there does)."""
    for seg in files.state:
        rows = list(files.walk(seg))
        for j, (batch_at, _skey, at, _length) in enumerate(rows):
            assert list(files.walk(seg, batch_at, at)) == rows[j:]
            assert list(files.walk(seg, batch_at, at + 1)) == rows[j + 1 :]


@settings(max_examples=30, deadline=None)
@given(
    count=st.integers(1, 40),
    body=st.integers(1, 300),
    odd=st.sampled_from([None, "length", "tenant"]),
)
def test_a_uniform_batch_has_no_entries_and_walks_the_same(
    count: int, body: int, odd: str | None
) -> None:
    """A batch of one tenant's records of one length (the common PUT) is written with its
    head and tenant alone, no per-record entry; one record of another length or tenant
    brings the entries back. Either way a walk names every record."""
    tenants = [tenant_id("t0"), tenant_id("t1")]
    keys, records = [], []
    for n in range(count):
        t = 1 if odd == "tenant" and n == count - 1 else 0
        size = body + (1 if odd == "length" and n == count - 1 else 0)
        keys.append(tenants[t] + key(n) + (n % 12).to_bytes(2, "big"))
        records.append(fake_shard(key(n), n % 12, bytes(size)))
    with tempfile.TemporaryDirectory() as d:
        files = SegmentFiles(Path(d), segment_bytes=SEG, sync_each_write=False)
        try:
            files.load({})
            seg, first, _before = files.append(keys, records)
            mixed = odd is not None and count > 1
            ntenants = 2 if odd == "tenant" and count > 1 else 1
            head = 24 + 8 * ntenants + (6 * count if mixed else 0)
            assert first == head
            assert files.state[seg].end == head + sum(map(len, records))
            walked = [(skey, at, length) for _, skey, at, length in files.walk(seg)]
            ats = [first + sum(map(len, records[:n])) for n in range(count)]
            assert walked == list(zip(keys, ats, map(len, records), strict=True))
            assert_walks_resume(files)
        finally:
            files.close()


def _sent(parts: list[object]) -> bytes:
    """What a SendQueue puts on a socket for ``parts`` (sendfile for FileRanges)."""
    queue = SendQueue()
    queue.extend(parts)
    ours, theirs = socket.socketpair()
    received = bytearray()
    with ours, theirs:
        ours.setblocking(False)
        while queue:
            queue.flush(ours)
            while chunk := _recv_some(theirs):
                received += chunk
    return bytes(received)


def _recv_some(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 20)
    except BlockingIOError:
        return b""


def test_long_runs_are_sent_with_sendfile_and_short_ones_from_the_map(
    tmp_path: Path, clock: FakeClock
) -> None:
    shards = block_records(key(1), body_len=2048)  # 12 records of ~2.1 KB, ~25 KB in all
    whole = b"".join(r for _, _, r in shards)
    with open_store(tmp_path / "db", clock, sendfile_min_bytes=8 << 10) as store:
        put(store, shards)
        result = store.get(T, get_items([(key(1), i) for i in range(12)]))
        (part,) = result.parts
        assert isinstance(part, FileRange) and part.length == len(whole)
        assert frame_nbytes(part) == len(whole) and bytes(frame_view(part)) == whole
        assert _sent([b"head", *result.parts, b"tail"]) == b"head" + whole + b"tail"
        result.release()
        # Two records apart on disk are two short runs: sent from the map.
        result = store.get(T, get_items([(key(1), 7), (key(1), 2)]))
        assert all(type(p) is memoryview for p in result.parts) and len(result.parts) == 2
        assert _sent(result.parts) == shards[7][2] + shards[2][2]
        result.release()
    with open_store(tmp_path / "db", clock) as store:  # the default of ShardStore: never
        result = store.get(T, get_items([(key(1), i) for i in range(12)]))
        assert all(type(p) is memoryview for p in result.parts)
        result.release()


def test_a_reply_sending_with_sendfile_keeps_its_file_while_its_segment_goes(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A FileRange holds its segment's descriptor: once the segment is dropped (and its
    number's file unlinked, and other dropped files reused), the reply still sends the
    bytes it was given, never another segment's."""
    first = block_records(key(1), body_len=2048)
    with open_store(tmp_path / "db", clock, sendfile_min_bytes=4 << 10) as store:
        put(store, first)
        held = store.get(T, get_items([(key(1), i) for i in range(12)]))  # not released
        assert any(isinstance(p, FileRange) for p in held.parts)
        store.delete(T, get_items([(key(1), i) for i in range(12)]))
        churn_segments(store)
        assert _sent(held.parts) == b"".join(r for _, _, r in first)
        held.release()


def test_a_file_shorter_than_its_range_fails_the_send(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    file = SegmentFd(fd)
    queue = SendQueue()
    queue.extend([FileRange(file, 50, memoryview(bytes(200)))])  # 150 bytes past the end
    ours, theirs = socket.socketpair()
    with ours, theirs, pytest.raises(OSError, match="short of its range"):
        ours.setblocking(False)
        for _ in range(10):
            queue.flush(ours)
            _recv_some(theirs)


@pytest.mark.parametrize("damage", ["entry-too-long", "uniform-too-short", "uniform-two-tenants"])
def test_a_damaged_batch_head_ends_the_walk_without_an_error(damage: str) -> None:
    """A batch head that does not add up (an entry past the batch's records, a uniform
    length shorter than a shard header, a uniform batch naming two tenants) stops the walk
    there, logged; the batches before it are walked, nothing is read past the file."""
    import struct

    tenants = [tenant_id("t0"), tenant_id("t1")]
    with tempfile.TemporaryDirectory() as d:
        files = SegmentFiles(Path(d), segment_bytes=SEG, sync_each_write=False)
        try:
            files.load({})
            good_keys = [tenants[0] + key(1) + b"\x00\x01"]
            seg, _first, _ = files.append(good_keys, [fake_shard(key(1), 1, bytes(64))])
            mixed = damage == "entry-too-long"
            keys = [tenants[0] + key(n) + b"\x00\x02" for n in range(2, 5)]
            bodies = [bytes(40 + (n if mixed else 0)) for n in range(3)]
            _seg, first, _ = files.append(keys, [fake_shard(key(n), 2, b) for n, b in
                                                 zip(range(2, 5), bodies, strict=True)])  # fmt: skip
            path = files.path_of(seg)
            raw = bytearray(path.read_bytes())
            head = first - (24 + 8 + (6 * 3 if mixed else 0))
            if damage == "entry-too-long":
                struct.pack_into("<I", raw, head + 24 + 8, 1 << 20)  # the first entry's length
            elif damage == "uniform-too-short":
                struct.pack_into("<IQ", raw, head + 4, 9, 9 * 48)  # count, the same record bytes
                struct.pack_into("<I", raw, head + 20, 48)  # uniform: under a shard header
            else:
                struct.pack_into("<I", raw, head + 16, 2)  # two tenants, uniform
            path.write_bytes(bytes(raw))
            walked = [skey for _, skey, _at, _len in files.walk(seg)]
            assert walked == good_keys
        finally:
            files.close()


@pytest.mark.parametrize("sync_each_write", [True, False])
def test_a_new_segments_name_is_synced_before_what_points_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync_each_write: bool
) -> None:
    """A new segment file (created, or a kept file renamed) is a directory entry: the
    directory is fsynced at once with ``sync = commit``, and by the next :meth:`sync` with
    periodic syncs, so a power cut cannot keep index rows that point into a nameless file."""
    synced_dirs: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            synced_dirs.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    files = SegmentFiles(tmp_path, segment_bytes=SEG, sync_each_write=sync_each_write)
    files.load({})
    record = bytes(range(250)) * 120  # two batches fill a segment
    seg_dir = str(tmp_path / "segments")
    for batch, rolled_to in enumerate([0, 0, 1, 1]):
        files.append([T + key(batch)], [record])
        assert files.active == rolled_to
        # Each roll syncs the directory at once with sync = commit, not before sync() else.
        assert synced_dirs.count(seg_dir) == ((1 if batch < 2 else 2) if sync_each_write else 0)
    files.sync()
    assert synced_dirs.count(seg_dir) == (2 if sync_each_write else 1)
    files.sync()  # nothing new: no directory sync
    assert synced_dirs.count(seg_dir) == (2 if sync_each_write else 1)
    files.drop(0)
    files.append([T + key(9)], [record])  # a kept file renamed into segment 2
    assert files.reused == 1
    files.sync()
    assert synced_dirs.count(seg_dir) == (3 if sync_each_write else 2)
    files.close()


def test_a_segment_cut_short_under_a_running_store_is_damage_not_a_crash(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A segment file cut short while the store runs: a scrub read its records through the
    map past the file's end (SIGBUS: the daemon died without a word). Now the size is
    checked before this process reads a view: the scrub discards the rows it cannot read
    and goes on, and the rest of the store is served."""
    with open_store(tmp_path / "db", clock) as store:
        blocks = {n: block_records(key(n), body_len=2048) for n in range(6)}
        for shards in blocks.values():
            put(store, shards)
        first = min(store.segments.state)
        cut_keys = {k for _, k, _, _ in store.segments.walk(first)}
        os.truncate(seg_files(tmp_path / "db")[0], 100)
        cut = sorted(
            {n for n in blocks if any(T + key(n) + bytes([0, i]) in cut_keys for i in range(12))}
        )
        assert cut
        # (A GET of them hands the map to the kernel, which answers EFAULT: in a daemon the
        # connection closes. Read here by this process, it would be the SIGBUS.)
        scrubber = scrub_a_pass(store, clock)
        assert not scrubber.running and scrubber.shards_deleted == len(cut_keys)
        assert store.counters["rows_unreadable"] >= len(cut_keys)
        assert_blocks(store, {n: blocks[n] for n in blocks}, cut)


def test_a_row_naming_a_segment_there_is_not_fails_that_item_only(
    tmp_path: Path, clock: FakeClock
) -> None:
    """One damaged index row naming a segment that does not exist made every GET that
    asked for it fail whole (the other shards refused with it), and stalled the scrub."""
    import dataclasses

    from kvcache.server.records import Row

    with open_store(tmp_path / "db", clock) as store:
        shards = block_records(key(7), body_len=640)
        put(store, shards)
        skey = T + key(7) + bytes([0, 4])
        with store._env.begin(write=True) as txn:
            raw = store._row(txn, skey)
            assert raw is not None
            bad = dataclasses.replace(Row.unpack(raw, store.classes), seg=0x7E57).pack(
                store.classes
            )
            txn.delete(skey[:-2], raw, db=store._index)
            txn.put(skey[:-2], bad, db=store._index)
        status, data, _ = read(store, [(key(7), i) for i in range(12)])
        assert status == [Status.OK] * 4 + [Status.NOT_FOUND] + [Status.OK] * 7
        assert data == b"".join(r for _, i, r in shards if i != 4)
        scrubber = scrub_a_pass(store, clock)
        assert not scrubber.running and scrubber.shards_deleted == 1
        assert read(store, [(key(7), 4)])[0] == [Status.NOT_FOUND]


def scrub_a_pass(store: ShardStore, clock: FakeClock) -> Scrubber:
    """A scrubber of ``store`` that has run one whole pass (or 100 steps of a second)."""
    scrubber = Scrubber(store, rate_bytes=1 << 30, interval_s=3600, clock=clock)
    scrubber.start_now()
    for _ in range(100):
        clock.step(1)
        scrubber.step()
        if not scrubber.running:
            break
    return scrubber
