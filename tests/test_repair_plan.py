"""The repairer's pure parts: the LIST codec, the merge of per-node listings, the plan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.errors import ProtocolError
from kvcache.repair.listing import Held, ListingMerge, list_request, parse_listing
from kvcache.repair.plan import plan_blocks
from kvcache.wire import LIST_INCLUSIVE, LIST_MAX_PAGE, Header, Op, decode, encode, join, make_items

K, N = 10, 12


def reply_items(rows: list[tuple[bytes, int, int, int, int]]) -> np.ndarray:
    items = make_items(Op.LIST, len(rows), reply=True)
    if rows:
        items["key"] = [r[0] for r in rows]
        items["index"] = [r[1] for r in rows]
        items["stripe"] = [r[2] for r in rows]
        items["payload_len"] = [r[3] for r in rows]
        items["expiry_ms"] = [r[4] for r in rows]
    return items


_keys = st.binary(min_size=16, max_size=16)
_row = st.tuples(
    _keys,
    st.integers(0, 254),
    st.integers(1, 2**64 - 1),
    st.integers(1, 2**32 - 1),
    st.integers(0, 2**63),
)


@given(st.lists(_row, max_size=50, unique_by=lambda r: (r[0], r[1])))
def test_list_reply_round_trips_through_the_wire(rows: list) -> None:
    rows = sorted(rows)
    header = Header(op=Op.LIST, request_id=7, count=len(rows), flags=1)
    message = decode(join(encode(header, reply_items(rows))))
    assert parse_listing(message.items) == rows


@given(st.lists(_row, min_size=2, max_size=20, unique_by=lambda r: (r[0], r[1])))
def test_parse_listing_refuses_disorder(rows: list) -> None:
    rows = sorted(rows)
    with pytest.raises(ProtocolError):
        parse_listing(reply_items(rows[::-1]))
    # A repeat of the exclusive cursor is refused too; with the inclusive one it is fine.
    first = rows[0]
    assert parse_listing(reply_items(rows), after=(first[0], first[1], True)) == rows
    with pytest.raises(ProtocolError):
        parse_listing(reply_items(rows), after=(first[0], first[1], False))


def test_list_request_validates() -> None:
    items = list_request(bytes(16), 3, inclusive=True, limit=10)
    assert int(items["flags"][0]) == LIST_INCLUSIVE and int(items["limit"][0]) == 10
    with pytest.raises(ProtocolError):
        list_request(bytes(15), inclusive=True)
    with pytest.raises(ProtocolError):
        list_request(bytes(16), inclusive=True, limit=LIST_MAX_PAGE + 1)


class FakeNode:
    """Answers LIST from a sorted list of rows, as a daemon does."""

    def __init__(self, rows: list[tuple[bytes, int, int, int, int]]) -> None:
        self.rows = sorted(rows)

    def page(self, cursor: tuple[bytes, int, bool], limit: int) -> list:
        key, index, inclusive = cursor
        out = [
            r
            for r in self.rows
            if (r[0], r[1]) > (key, index) or (inclusive and (r[0], r[1]) == (key, index))
        ]
        return out[:limit]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(_row, max_size=40, unique_by=lambda r: (r[0], r[1])), min_size=1, max_size=5),
    st.integers(1, 9),
    st.data(),
)
def test_merge_releases_each_key_once_with_every_nodes_shards(
    per_node: list, page: int, data: st.DataObject
) -> None:
    nodes = [FakeNode(rows) for rows in per_node]
    failing = data.draw(st.sets(st.integers(0, len(nodes) - 1), max_size=len(nodes) - 1))
    merge = ListingMerge(list(range(len(nodes))), page=page)
    released: list[tuple[bytes, list[Held]]] = []
    for _step in range(10_000):
        if merge.done:
            break
        for node, cursor in merge.wanted():
            if node in failing:
                merge.fail(node)
            else:
                merge.add(
                    node, parse_listing(reply_items(nodes[node].page(cursor, page)), after=cursor)
                )
        before = merge.cursor
        out = merge.release()
        assert merge.cursor >= before
        released += out
    assert merge.done
    keys = [k for k, _ in released]
    assert keys == sorted(set(keys))  # each key once, in order
    expected: dict[bytes, set] = {}
    for n, node in enumerate(nodes):
        if n in failing:
            continue
        for key, index, stripe, _p, _e in node.rows:
            expected.setdefault(key, set()).add((n, index, stripe))
    got = {k: {(h.node, h.index, h.stripe) for h in hs} for k, hs in released}
    assert got == expected


def held(rows: list[tuple[int, int, int]], payload_len: int = 1000) -> list[Held]:
    return [Held(node, index, stripe, payload_len, 10**15) for node, index, stripe in rows]


def test_plan_complete_missing_unrecoverable_and_strays() -> None:
    targets = np.arange(N, dtype=np.int64)[None, :].repeat(4, axis=0)
    full = [(i, i, 7) for i in range(N)]
    one_missing = [(i, i, 7) for i in range(N) if i != 3]
    too_few = [(i, i, 7) for i in range(K - 1)]
    # Shard 5 lives on node 20 (a spill node); node 5 holds another stripe at index 5.
    moved = [(i, i, 7) for i in range(N) if i != 5] + [(20, 5, 7), (5, 5, 99)]
    plan = plan_blocks(
        [(b"a" * 16, held(full)), (b"b" * 16, held(one_missing)), (b"c" * 16, held(too_few)),
         (b"d" * 16, held(moved))],
        targets,
        k=K,
    )  # fmt: skip
    assert plan.complete == 1 and plan.unrecoverable == [b"c" * 16]
    by_key = {p.key: p for p in plan.repairs}
    assert by_key[b"b" * 16].writes == ((3, 3, 0),)
    d = by_key[b"d" * 16]
    assert d.stripe == 7 and d.writes == ((5, 5, 99),) and d.strays == ((5, 20),)
    assert (5, 20) in d.sources


def test_plan_defers_writes_to_nodes_that_cannot_take_them() -> None:
    targets = np.arange(N, dtype=np.int64)[None, :].copy()
    targets[0, 2] = -1
    writable = np.ones(N, bool)
    writable[4] = False
    shards = held([(i, i, 1) for i in range(N) if i not in (2, 4, 6)])
    plan = plan_blocks([(b"k" * 16, shards)], targets, k=K - 1, writable=writable)
    assert plan.deferred == 2 and plan.repairs[0].writes == ((6, 6, 0),)


@given(
    st.lists(st.integers(0, 15), min_size=0, max_size=30),
    st.lists(st.sampled_from([1, 2]), min_size=30, max_size=30),
)
def test_plan_property_writes_exactly_what_targets_lack(nodes: list, stripes: list) -> None:
    rows = [(node, i % N, stripes[i]) for i, node in enumerate(nodes)]
    targets = np.arange(N, dtype=np.int64)[None, :]
    plan = plan_blocks([(b"z" * 16, held(rows))], targets, k=K)
    by_stripe: dict[int, set[int]] = {}
    for _node, index, stripe in rows:
        by_stripe.setdefault(stripe, set()).add(index)
    if not rows:
        assert not plan.repairs and not plan.unrecoverable and plan.complete == 0
        return
    best = max(by_stripe, key=lambda s: (len(by_stripe[s]), s))
    if len(by_stripe[best]) < K:
        assert plan.unrecoverable == [b"z" * 16]
        return
    lacking = {i for i in range(N) if (i, i, best) not in set(rows)}
    writes = {w[0] for p in plan.repairs for w in p.writes}
    assert writes == lacking
    assert (plan.complete == 1) == (not lacking)


def test_a_block_whose_targets_are_unplaceable_is_waiting_not_complete_nor_pruned() -> None:
    """With more holders down than writes may redirect past, every target is -1: the block
    used to count as complete, every copy as a stray, and ``--prune`` deleted them all."""
    targets = np.full((1, N), -1, np.int64)
    plan = plan_blocks([(b"w" * 16, held([(i, i, 3) for i in range(N)]))], targets, k=K)
    assert plan.complete == 0 and plan.waiting == 1
    assert not plan.stray_only and not plan.repairs and plan.deferred == N
    # One target down (not writable), the rest holding theirs: waiting, nothing pruned,
    # even with a copy of the down target's shard elsewhere.
    targets = np.arange(N, dtype=np.int64)[None, :]
    writable = np.ones(N + 1, bool)
    writable[4] = False
    rows = [(i, i, 3) for i in range(N) if i != 4] + [(N, 4, 3), (N, 5, 3)]
    plan = plan_blocks([(b"v" * 16, held(rows))], targets, k=K, writable=writable)
    assert plan.complete == 0 and plan.waiting == 1 and not plan.stray_only


def test_a_copy_with_a_damaged_payload_length_neither_decides_nor_serves() -> None:
    """One flipped bit in one copy's ``payload_len`` made it the block's length (the
    largest): every pass failed the block and never rebuilt its missing shard."""
    targets = np.arange(N, dtype=np.int64)[None, :]
    rows = held([(i, i, 5) for i in range(N) if i not in (3, 6)], payload_len=4096)
    rows.append(Held(6, 6, 5, 4096 | (1 << 30), 10**15))
    plan = plan_blocks([(b"p" * 16, rows)], targets, k=K)
    (block,) = plan.repairs
    assert block.payload_len == 4096
    assert 6 not in [index for index, _ in block.sources]
    assert sorted(w[0] for w in block.writes) == [3, 6]  # the damaged copy is rewritten


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 15), st.integers(0, N - 1)), min_size=0, max_size=30),
    st.lists(st.integers(-1, 15), min_size=N, max_size=N),
    st.lists(st.booleans(), min_size=16, max_size=16),
)
def test_plan_property_a_pruned_copy_is_never_the_only_one_on_a_live_target(
    rows: list, row: list, up: list
) -> None:
    """Whatever the targets and which nodes can be written: a block whose strays may be
    pruned has every index's copy on that index's target, and that target is writable."""
    targets = np.array([row], np.int64)
    writable = np.array(up, bool)
    plan = plan_blocks(
        [(b"q" * 16, held([(node, index, 1) for node, index in rows]))],
        targets,
        k=K,
        writable=writable,
    )
    for block in plan.stray_only:
        have = {(node, index) for node, index in rows}
        for index in range(N):
            assert row[index] >= 0 and writable[row[index]]
            assert (row[index], index) in have
        assert all(node != row[index] for index, node in block.strays)
