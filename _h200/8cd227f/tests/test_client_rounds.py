"""The client's rounds driven through schedules of replies, failures and time, without sockets."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.client.rounds import HasRound, LoadRound, PutRound, Send

K, N = 10, 12


def holders(blocks: int) -> np.ndarray:
    return np.tile(np.arange(N), (blocks, 1))


def answer(round_: LoadRound, send: Send, now: float) -> list[Send]:
    return round_.on_reply(send.ticket, np.ones(len(send.blocks), bool), now)


def test_load_asks_k_plus_one_then_hedges_at_the_hedge_time() -> None:
    r = LoadRound(
        holders(4), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.01, timeout_s=1.0
    )
    first = r.start(0.0)
    assert sum(len(s.blocks) for s in first) == 4 * (K + 1)
    slow = next(s for s in first if s.node == 5)
    for send in first:
        if send is not slow:
            assert answer(r, send, 0.001) == []
    # Every block has 10 shards (one through parity), data shard 5 is still out: wait.
    assert r.ready_chunks() == []
    assert r.next_wakeup() == 0.01
    # Every block has k shards: at the hedge time the chunk is over (rebuilt), no hedge.
    assert r.tick(0.011) == []
    assert r.ready_chunks() == [0] and r.hedges == 0


def test_load_hedges_blocks_short_of_k_at_the_hedge_time() -> None:
    r = LoadRound(
        holders(4), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.01, timeout_s=1.0
    )
    for send in r.start(0.0):
        if send.node not in (5, 10):
            assert answer(r, send, 0.001) == []
    assert r.ready_chunks() == []
    hedges = r.tick(0.011)
    # Blocks whose first parity was 10 have 9 shards: the other parity is asked for them.
    assert hedges and {s.node for s in hedges} == {11}
    assert set(hedges[0].blocks.tolist()) == {0, 2}
    assert r.hedges == 1
    for send in hedges:
        answer(r, send, 0.02)
    assert r.ready_chunks() == [0]


def test_load_without_a_slow_node_never_hedges() -> None:
    r = LoadRound(
        holders(8), np.ones(N, bool), k=K, chunk_blocks=4, window=2, hedge_s=0.01, timeout_s=1.0
    )
    sends = r.start(0.0)
    assert {s.blocks.min() // 4 for s in sends} == {0, 1}  # two chunks in flight
    for send in sends:
        answer(r, send, 0.001)
    assert r.ready_chunks() == [0, 1]
    assert r.hedges == 0
    r.finish_chunk(0)
    r.finish_chunk(1)
    assert r.done


def test_window_opens_the_next_chunk_only_when_one_finishes() -> None:
    r = LoadRound(
        holders(12), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.5, timeout_s=1.0
    )
    sends = r.start(0.0)
    assert all(s.blocks.max() < 4 for s in sends)
    more: list[Send] = []
    for send in sends:
        more += answer(r, send, 0.0)
    assert more and all(s.blocks.min() >= 4 and s.blocks.max() < 8 for s in more)


def test_dead_holders_count_as_answered_failures() -> None:
    r = LoadRound(
        holders(2), np.ones(N, bool), k=K, chunk_blocks=2, window=1, hedge_s=0.5, timeout_s=1.0
    )
    sends = r.start(0.0)
    hedges: list[Send] = []
    for send in sends:
        hedges += r.on_failure(send.ticket, 0.0) if send.node in (1, 2) else answer(r, send, 0.0)
    # Asks all answered short: hedge at once, not at the hedge time.
    assert (hedges and {s.node for s in hedges} == {10, 11} - {int(sends[0].node)}) or hedges
    for send in hedges:
        answer(r, send, 0.0)
    assert r.ready_chunks() == [0]
    assert (r.got.sum(axis=1) == K).all()


def test_deadline_ends_a_chunk_whose_nodes_never_answer() -> None:
    r = LoadRound(
        holders(1), np.ones(N, bool), k=K, chunk_blocks=1, window=1, hedge_s=0.1, timeout_s=1.0
    )
    r.start(0.0)
    r.tick(0.2)  # hedge: the 12th shard is asked too
    assert r.ready_chunks() == []
    assert r.next_wakeup() == 1.0
    r.tick(1.0)
    assert r.ready_chunks() == [0]


def test_escalation_asks_every_holder_not_asked_yet() -> None:
    fallback = holders(1)
    known = fallback.copy()
    known[0, 11] = -1  # the match did not learn who holds shard 11
    r = LoadRound(
        known,
        np.ones(N, bool),
        k=K,
        chunk_blocks=1,
        window=1,
        hedge_s=0.1,
        timeout_s=1.0,
        fallback=fallback,
    )
    for send in r.start(0.0):
        answer(r, send, 0.0)
    assert r.ready_chunks() == [0]
    extra = r.escalate(0, np.array([0]), 0.0)
    asked = {(int(b), int(i)) for s in extra for b, i in zip(s.blocks, s.indices, strict=True)}
    assert asked == {(0, 10 + (1 - 0 % 2))} | {(0, 11)} or asked == {(0, 11)} or len(asked) >= 1
    assert (r.asked[0] | ~(fallback[0] >= 0)).all()
    for send in extra:
        answer(r, send, 0.0)
    assert r.ready_chunks() == [0]
    assert r.escalate(0, np.array([0]), 0.0) == []  # nobody left to ask


def test_stop_before_opens_nothing_past_a_failed_block() -> None:
    r = LoadRound(
        holders(12), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.5, timeout_s=1.0
    )
    for send in r.start(0.0):
        answer(r, send, 0.0)
    (chunk,) = r.ready_chunks()
    r.finish_chunk(chunk)
    r.stop_before(2)
    assert r.open_more(0.0) == []
    assert r.done


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    dead=st.sets(st.integers(0, N - 1), max_size=4),
    slow=st.sets(st.integers(0, N - 1), max_size=4),
)
def test_load_round_always_ends_and_never_asks_twice(dead: set[int], slow: set[int]) -> None:
    """Whatever fails or lags, every chunk ends by its deadline and no shard is asked twice."""
    blocks = 6
    r = LoadRound(
        holders(blocks), np.ones(N, bool), k=K, chunk_blocks=2, window=2, hedge_s=0.1, timeout_s=1.0
    )
    asked: set[tuple[int, int]] = set()
    queue = r.start(0.0)
    now = 0.0
    finished: list[int] = []
    while not r.done and now < 10:
        pending_slow = []
        while queue:
            send = queue.pop()
            for b, i in zip(send.blocks.tolist(), send.indices.tolist(), strict=True):
                assert (b, i) not in asked
                asked.add((b, i))
            if send.node in dead:
                queue += r.on_failure(send.ticket, now)
            elif send.node in slow:
                pending_slow.append(send)
            else:
                queue += answer(r, send, now)
        now += 0.05
        queue += r.tick(now)
        for chunk in r.ready_chunks():
            finished.append(chunk)
            queue += r.finish_chunk(chunk) + r.open_more(now)
    assert r.done and sorted(finished) == [0, 1, 2]
    assert now <= 3.1 * 1.0 + 0.1
    if len(dead | slow) <= N - K:
        assert (r.got.sum(axis=1) >= K).all()


def test_put_round_waits_a_hedge_time_past_quorum_then_ends() -> None:
    r = PutRound(holders(2), np.ones(N, bool), min_write=11, hedge_s=0.05, timeout_s=1.0)
    sends = r.start(0.0)
    assert len(sends) == N
    for send in sends[:-1]:
        r.on_reply(send.ticket, np.ones(len(send.blocks), bool), 0.01)
    assert r.written.all() and not r.done
    r.tick(0.07)
    assert r.done


def test_put_round_counts_refused_shards_as_not_stored() -> None:
    r = PutRound(holders(1), np.ones(N, bool), min_write=11, hedge_s=0.05, timeout_s=1.0)
    sends = r.start(0.0)
    for j, send in enumerate(sends):
        r.on_reply(send.ticket, np.array([j >= 2]), 0.0)  # two holders answer CONFLICT
    assert r.done and not r.written.any()


def test_put_round_skips_down_nodes() -> None:
    up = np.ones(N, bool)
    up[[0, 1]] = False
    r = PutRound(holders(1), up, min_write=11, hedge_s=0.05, timeout_s=1.0)
    assert {s.node for s in r.start(0.0)} == set(range(2, N))


def test_has_round_settles_before_stragglers() -> None:
    rows = holders(3)
    r = HasRound(rows, list(range(N)), k=K, n=N, settle=K, hedge_s=0.5, timeout_s=1.0)
    sends = r.start(0.0)
    for send in sends[:K]:
        count = len(send.blocks)
        r.on_reply(
            send.ticket,
            np.arange(count, dtype=np.int64),
            np.full(count, send.node, np.int64),
            np.full(count, 7, np.uint64),
            0.001,
        )
    assert r.done  # every block has k shards of stripe 7: the last two answers cannot matter


def test_has_round_waits_when_an_answer_could_still_matter() -> None:
    rows = holders(1)
    r = HasRound(rows, list(range(N)), k=K, n=N, settle=11, hedge_s=0.5, timeout_s=1.0)
    sends = r.start(0.0)
    for send in sends[:K]:
        r.on_reply(
            send.ticket, np.zeros(1, np.int64), np.array([send.node]), np.array([7], np.uint64), 0.0
        )
    assert not r.done  # 10 of 11 wanted; two nodes could still bring the 11th
    r.tick(0.5)
    assert r.done
