"""A load's asks built as arrays: each send's items, shards and addresses cut from one array
each (``get_shards``), and a burst's request headers written into copies of one
(``_request_heads``), against building them one by one. No sockets."""

from __future__ import annotations

import ctypes

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import native
from kvcache.client.driver import GetShards, get_shards
from kvcache.client.rounds import Send
from kvcache.client.transport import Exchange, _request_heads
from kvcache.wire import NO_RETAIN, Op, Retain, make_items, pack_header


def _int64s_at(address: int, count: int) -> list[int]:
    return list((ctypes.c_int64 * count).from_address(address)) if count else []


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_get_shards_cuts_what_each_send_would_build_alone(sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    sends = [
        Send(t, t % 5, rng.integers(0, 100, size), rng.integers(0, 12, size))
        for t, size in enumerate(sizes)
    ]
    total = sum(sizes)
    items = make_items(Op.GET, total, reply=False)
    items["index"] = np.arange(total) % 65536
    blocks = np.concatenate([s.blocks for s in sends])
    indices = np.concatenate([s.indices for s in sends])
    views, shards = get_shards(sends, items, blocks, indices)
    assert len(views) == len(shards) == len(sends)
    at = 0
    for send, view, cut in zip(sends, views, shards, strict=True):
        alone = GetShards.of(send)
        assert cut.blocks.tolist() == alone.blocks.tolist() == send.blocks.tolist()
        assert cut.indices.tolist() == alone.indices.tolist()
        assert cut.blocks.dtype == cut.indices.dtype == np.int64
        assert cut.span == alone.span
        assert view["index"].tolist() == items["index"][at : at + len(send.blocks)].tolist()
        if native.AVAILABLE and len(send.blocks):
            # The addresses name the very arrays the exchange keeps alive.
            assert _int64s_at(cut.shards_at[0], len(send.blocks)) == send.blocks.tolist()
            assert _int64s_at(cut.shards_at[1], len(send.blocks)) == send.indices.tolist()
            assert cut.items_at == native.addresses_of(view)
        elif not len(send.blocks):
            assert cut.shards_at == (0, 0) and cut.span == (0, 0)
        at += len(send.blocks)


def _exchange(op: Op, count: int, retain: Retain, cls: str) -> Exchange:
    return Exchange(0, op, make_items(op, count, reply=False), traffic_class=cls,
                    retain=retain)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.integers(0, 5000), min_size=1, max_size=48),
    ids=st.lists(st.integers(0, 2**64 - 1), min_size=48, max_size=48),
    ttl=st.integers(0, 2**32 - 1),
    pin=st.booleans(),
    cls=st.sampled_from(["", "chat", "agent"]),
    mixed=st.booleans(),
    op=st.sampled_from([Op.GET, Op.HAS]),
)
def test_burst_heads_equal_headers_packed_one_by_one(
    counts: list[int], ids: list[int], ttl: int, pin: bool, cls: str, mixed: bool, op: Op
) -> None:
    retain = Retain(ttl_s=ttl, pin=pin)
    exchanges = [_exchange(op, c, retain, cls) for c in counts]
    if mixed:  # one exchange unlike the rest: every header packed on its own
        exchanges[-1] = _exchange(op, counts[-1], NO_RETAIN, "other")
    taken = [(x, None, None, ids[j]) for j, x in enumerate(exchanges)]
    heads = _request_heads(op, taken, np.array(counts, np.int64))  # type: ignore[arg-type]
    want = b"".join(
        pack_header(op, ids[j], c, flags=x.retain.flags, ttl_s=x.retain.ttl_s,
                    traffic_class=x.traffic_class)
        for j, (x, c) in enumerate(zip(exchanges, counts, strict=True))
    )  # fmt: skip
    assert heads.dtype == np.uint8 and heads.flags.writeable
    assert heads.tobytes() == want


def test_get_shards_of_no_asks_at_all() -> None:
    sends = [Send(1, 0, np.zeros(0, np.int64), np.zeros(0, np.int64))]
    views, shards = get_shards(sends, make_items(Op.GET, 0, reply=False), sends[0].blocks,
                               sends[0].indices)  # fmt: skip
    assert [len(v) for v in views] == [0]
    assert shards[0].span == (0, 0) and shards[0].shards_at == (0, 0)
