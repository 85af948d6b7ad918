"""The client's rounds driven through schedules of replies, failures and time, without sockets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.client.plan import best_counts
from kvcache.client.rounds import HasRound, LoadRound, PutRound, Send

K, N = 10, 12


def holders(blocks: int) -> np.ndarray:
    return np.tile(np.arange(N), (blocks, 1))


def answer(round_: LoadRound, send: Send, now: float) -> list[Send]:
    return round_.on_reply(send.ticket, np.ones(len(send.blocks), bool), now)


def test_load_asks_k_plus_one_then_settles_briefly_for_a_late_data_shard() -> None:
    r = LoadRound(
        holders(4), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.01, timeout_s=1.0
    )
    first = r.start(0.0)
    assert sum(len(s.blocks) for s in first) == 4 * (K + 1)
    slow = next(s for s in first if s.node == 5)
    for send in first:
        if send is not slow:
            assert answer(r, send, 0.004) == []
    # Every block has 10 shards (one through parity), data shard 5 is still out: wait a
    # quarter of the 4 ms the chunk took, not the whole hedge time.
    assert r.ready_chunks() == []
    assert r.latency(0) == 0.004
    assert r.next_wakeup() == pytest.approx(0.005)
    # Every block has k shards: at the settle time the chunk is over (rebuilt), no hedge.
    assert r.tick(0.0051) == []
    assert r.ready_chunks() == [0] and r.hedges == 0


def test_load_takes_a_data_shard_that_arrives_while_settling() -> None:
    r = LoadRound(
        holders(4), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.01, timeout_s=1.0
    )
    first = r.start(0.0)
    slow = next(s for s in first if s.node == 5)
    for send in first:
        if send is not slow:
            answer(r, send, 0.004)
    assert r.tick(0.0045) == [] and r.ready_chunks() == []
    answer(r, slow, 0.0046)
    assert r.ready_chunks() == [0]
    assert r.got[:, :K].all()  # nothing to rebuild


def test_load_settle_time_never_passes_the_hedge_time() -> None:
    r = LoadRound(
        holders(4), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.0045, timeout_s=1.0
    )
    first = r.start(0.0)
    for send in first:
        if send.node != 5:
            answer(r, send, 0.004)
    assert r.next_wakeup() == pytest.approx(0.0045)
    # A chunk that never had k shards of every block has no latency sample.
    r2 = LoadRound(
        holders(4), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.01, timeout_s=1.0
    )
    r2.start(0.0)
    assert r2.tick(0.02)  # the hedge: nobody answered
    r2.tick(1.0)  # the deadline
    assert r2.ready_chunks() == [0] and r2.latency(0) is None


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
    # The data shards answered first and ended the chunk: the parity ask still out was
    # abandoned (its late answer ignored), so it counts as not asked.
    first_asked = set(np.flatnonzero(r.asked[0]).tolist())
    assert first_asked == set(range(K))
    extra = r.escalate(0, np.array([0]), 0.0)
    asked = {(int(b), int(i)) for s in extra for b, i in zip(s.blocks, s.indices, strict=True)}
    # The shards not asked (or abandoned); shard 11's holder comes from the placement fallback.
    assert asked == {(0, i) for i in range(N) if i not in first_asked}
    assert {int(s.node) for s in extra} == {int(fallback[0, i]) for _b, i in asked}
    assert r.asked[0].all()
    for send in extra:
        answer(r, send, 0.0)
    assert r.ready_chunks() == [0]
    assert r.escalate(0, np.array([0]), 0.0) == []  # nobody left to ask


def test_an_escalated_chunk_waits_for_its_new_asks() -> None:
    """Escalated blocks have all their data shards (some bad): the chunk is not over until
    the new asks are answered, or at its deadline."""
    r = LoadRound(
        holders(2), np.ones(N, bool), k=K, chunk_blocks=2, window=1, hedge_s=0.01, timeout_s=1.0
    )
    for send in r.start(0.0):
        answer(r, send, 0.001)
    assert r.ready_chunks() == [0]
    extra = r.escalate(0, np.array([0, 1]), 0.002)
    assert extra
    assert r.tick(0.5) == [] and r.ready_chunks() == []
    for send in extra[:-1]:
        answer(r, send, 0.6)
    assert r.ready_chunks() == []
    answer(r, extra[-1], 0.7)
    assert r.ready_chunks() == [0]
    # Never answered: over at the deadline.
    r2 = LoadRound(
        holders(1), np.ones(N, bool), k=K, chunk_blocks=1, window=1, hedge_s=0.01, timeout_s=1.0
    )
    for send in r2.start(0.0):
        answer(r2, send, 0.001)
    assert r2.ready_chunks() == [0]
    assert r2.escalate(0, np.array([0]), 0.002)
    assert r2.next_wakeup() == pytest.approx(1.002)
    r2.tick(1.01)
    assert r2.ready_chunks() == [0]


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


def test_put_round_of_conflicted_blocks_waits_a_hedge_time_not_for_a_silent_holder() -> None:
    """Blocks some holder answered CONFLICT for are decided (the store writes them the
    careful way afterwards): with every block written or conflicted, a holder that never
    answers holds the round up a hedge's time, not the timeout."""
    r = PutRound(holders(2), np.ones(N, bool), min_write=11, hedge_s=0.05, timeout_s=1.0)
    sends = r.start(0.0)
    for send in sends[:-1]:  # the last holder never answers
        stored = np.array([True, False])  # block 1 is another stripe's on every holder
        r.conflicts[send.blocks[~stored]] = True
        r.on_reply(send.ticket, stored, 0.01)
    assert r.written.tolist() == [True, False] and not r.done
    assert r.next_wakeup() == pytest.approx(0.06)
    r.tick(0.07)
    assert r.done and r.pending  # ended with the silent holder's PUT still out


def _least_loaded(b: int, row: np.ndarray, failed: frozenset[int]) -> int:
    """With exactly N nodes every node is a target: the live one holding fewest shards of
    the block, as the client's respill does."""
    counts = np.bincount(row[row >= 0], minlength=N)
    live = [n for n in range(N) if n not in failed]
    return min(live, key=lambda n: (counts[n], n)) if live else -1


def test_put_round_sends_silent_holders_shards_on_once_the_others_answered() -> None:
    """Two holders never answer: once no reply came for as long as the round took until
    the last one (at least a hedge's time), tick() sends their shards to live nodes, never
    to the other silent one, and the round is written long before its timeout. Their
    requests stay out: a late answer still counts, and is kept for a rollback."""
    r = PutRound(
        holders(3), np.ones(N, bool), min_write=11, hedge_s=0.05, timeout_s=1.0,
        respill=_least_loaded, redirect_limit=4, max_silent=2,
    )  # fmt: skip
    sends = r.start(0.0)
    silent = {3, 7}
    for send in sends:
        if send.node not in silent:
            r.on_reply(send.ticket, np.ones(len(send.blocks), bool), 0.2)
    assert not r.written.any() and not r.done
    assert r.next_wakeup() == pytest.approx(0.4)  # the round's 0.2 s again
    assert r.tick(0.3) == []
    hedged = r.tick(0.4)
    assert r.stalled == silent and not {s.node for s in hedged} & silent
    assert r.respilled == 6 and (r.redirected == 2).all()
    assert not np.isin(r.holders[:, [3, 7]], list(silent)).any()
    assert all(s.ticket in r.pending for s in sends if s.node in silent)
    assert r.next_wakeup() == pytest.approx(1.0)  # nothing left to hedge: the timeout
    for send in hedged:
        r.on_reply(send.ticket, np.ones(len(send.blocks), bool), 0.41)
    assert r.written.all() and not r.done
    late = next(s for s in sends if s.node == 3)
    r.on_reply(late.ticket, np.ones(len(late.blocks), bool), 0.42)
    assert [(node, blocks.tolist()) for node, blocks in r.late_acks] == [(3, [0, 1, 2])]
    r.tick(0.47)
    assert r.done


def test_put_round_hedges_no_holder_while_none_answered_or_too_many_are_silent() -> None:
    r = PutRound(
        holders(1), np.ones(N, bool), min_write=11, hedge_s=0.05, timeout_s=1.0,
        respill=_least_loaded, redirect_limit=4, max_silent=2,
    )  # fmt: skip
    sends = r.start(0.0)
    r.on_failure(sends[0].ticket, 0.0)  # refused at once: a failure, not an answer
    assert r.next_wakeup() == 1.0 and r.tick(0.5) == [] and not r.stalled
    for send in sends[1:9]:  # three holders left silent: more than max_silent
        r.on_reply(send.ticket, np.ones(1, bool), 0.1)
    assert r.next_wakeup() == 1.0 and r.tick(0.9) == [] and not r.stalled


def test_put_round_begins_by_hedging_the_nodes_an_earlier_round_found_silent() -> None:
    """A store drives its chunks' rounds in turn: a later chunk's round sends the shards
    of the nodes an earlier one found silent on as it begins, and counts its time from
    there (its replies waited for the driver)."""
    r = PutRound(
        holders(2), np.ones(N, bool), min_write=11, hedge_s=0.05, timeout_s=5.0,
        respill=_least_loaded, redirect_limit=4, max_silent=2,
    )  # fmt: skip
    sends = r.start(0.0)
    hedged = r.begin(3.0, {7})
    assert r.stalled == {7} and len(hedged) == 1 and hedged[0].node != 7
    for send in [*sends, *hedged]:
        if send.node not in (7, 9, 10):
            r.on_reply(send.ticket, np.ones(len(send.blocks), bool), 3.0)
    # Nodes 9 and 10 silent too: hedged a hedge's time after the last reply, not 3 s on.
    assert not r.written.any() and r.next_wakeup() == pytest.approx(3.05)
    more = r.tick(3.06)
    assert r.stalled == {7, 9, 10} and len(more) == 2
    assert not {s.node for s in more} & r.stalled


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


def test_a_complete_has_round_hears_every_node_until_the_hedge() -> None:
    """A store's HAS (``complete``): fresh blocks answered "nothing" by 10 nodes would
    settle a match, but a leftover shard on one of the last two must be seen to be
    replaced (issue 18: "two leftover shards, a store replaces only one")."""
    rows = holders(1)
    plain = HasRound(rows, list(range(N)), k=K, n=N, settle=11, hedge_s=0.5, timeout_s=1.0)
    full = HasRound(
        rows, list(range(N)), k=K, n=N, settle=11, hedge_s=0.5, timeout_s=1.0, complete=True
    )
    none = np.zeros(0, np.int64)
    for r in (plain, full):
        for send in r.start(0.0)[:K]:
            r.on_reply(send.ticket, none, none, np.zeros(0, np.uint64), 0.001)
    assert plain.done  # no block can reach 11 any more
    assert not full.done  # the last two may hold leftovers
    last = full.start(0.0)[K]
    full.on_reply(
        last.ticket, np.zeros(1, np.int64), np.array([last.node]), np.array([9], np.uint64), 0.002
    )
    assert not full.done
    full.tick(0.5)
    assert full.done and any(node == last.node for node, *_ in full.held)


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


def test_has_round_after_the_hedge_still_waits_for_a_block_that_can_reach_k() -> None:
    """A block stored on 11 nodes; at the hedge time 10 nodes answered, one of them the node
    without a shard: 9 known, and a slow node holds a 10th. Ending now would turn a stored
    block into a miss: the round waits for it (or the deadline)."""
    rows = holders(1)
    r = HasRound(rows, list(range(N)), k=K, n=N, settle=K, hedge_s=0.01, timeout_s=1.0)
    sends = {s.node: s for s in r.start(0.0)}
    for node in range(K):  # nodes 0..9 answer; node 0 has nothing
        held = np.zeros(0 if node == 0 else 1, np.int64)
        r.on_reply(
            sends[node].ticket,
            held,
            np.full(len(held), node, np.int64),
            np.full(len(held), 7, np.uint64),
            0.001,
        )
    r.tick(0.02)
    assert not r.done and r.next_wakeup() == 1.0
    r.on_reply(
        sends[10].ticket, np.zeros(1, np.int64), np.array([10]), np.array([7], np.uint64), 0.03
    )
    assert r.done
    (block_count,) = best_counts(r.held_shards(), 1, n=N)
    assert block_count == K


@pytest.mark.parametrize("node_cap, waits", [(1, False), (2, True)])
def test_has_round_counts_nodes_that_may_hold_two_shards(node_cap: int, waits: bool) -> None:
    """12 nodes; 2 were down when the block was written, so nodes 0 and 1 hold two shards
    each, and one shard has since been lost: 2..8 hold one, 9..11 none. Nodes 2..11
    answered (7 shards); 0 and 1 have not. Listed once each they could bring 2 more, short
    of k; with ``node_cap`` 2 they could bring 4, and the round waits for them instead of
    turning a readable block (11 shards) into a miss."""
    rows = holders(1)
    r = HasRound(
        rows, list(range(N)), k=K, n=N, settle=K, hedge_s=0.01, timeout_s=1.0, node_cap=node_cap
    )
    sends = {s.node: s for s in r.start(0.0)}
    for node in range(2, N):
        held = np.zeros(1 if node < 9 else 0, np.int64)
        r.on_reply(sends[node].ticket, held, held + node, np.full(len(held), 7, np.uint64), 0.02)
    assert r.done is not waits
    if waits:
        for node in (0, 1):
            r.on_reply(
                sends[node].ticket,
                np.zeros(2, np.int64),
                np.array([node, node + 9]),
                np.full(2, 7, np.uint64),
                0.03,
            )
        assert r.done
        assert best_counts(r.held_shards(), 1, n=N).tolist() == [11]


def test_has_round_counts_a_shard_on_two_nodes_once() -> None:
    """Nine distinct shards, one of them reported by two nodes: ten answers but only nine
    shards, so the round keeps waiting for the nodes that may hold the tenth."""
    rows = holders(1)
    r = HasRound(rows, list(range(N)), k=K, n=N, settle=K, hedge_s=0.5, timeout_s=1.0)
    sends = {s.node: s for s in r.start(0.0)}
    for node in range(K):
        index = node if node < K - 1 else 0  # node 9 holds a second copy of shard 0
        r.on_reply(
            sends[node].ticket,
            np.zeros(1, np.int64),
            np.array([index]),
            np.array([7], np.uint64),
            0.0,
        )
    assert not r.done
    r.on_reply(sends[K].ticket, np.zeros(1, np.int64), np.array([K]), np.array([7], np.uint64), 0.0)
    assert r.done and best_counts(r.held_shards(), 1, n=N).tolist() == [K]


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    dead=st.sets(st.integers(0, N - 1), max_size=3),
    rejected=st.sets(st.integers(0, N - 1), max_size=2),
)
def test_outcomes_handed_over_together_end_as_one_by_one(
    dead: set[int], rejected: set[int]
) -> None:
    """A burst's replies and failures given to ``on_outcomes`` at once leave the round as
    handing them over one at a time does: the same blocks with k shards, the same chunks
    ready, the same asks sent next (the chunk is looked at once, after all of them). One
    at a time, a chunk ready early drops the asks still out (a parity shard once the data
    shards are in); together, those replies are in already and count."""
    rounds = [
        LoadRound(
            holders(8), np.ones(N, bool), k=K, chunk_blocks=4, window=1, hedge_s=0.01, timeout_s=1.0
        )
        for _ in range(2)
    ]
    firsts = [r.start(0.0) for r in rounds]

    def outcome(send: Send) -> np.ndarray | None:
        if send.node in dead:
            return None
        ok = np.ones(len(send.blocks), bool)
        if send.node in rejected:
            ok[::2] = False  # the driver's checks turned some shards away
        return ok

    together = rounds[0].on_outcomes([(s.ticket, outcome(s)) for s in firsts[0]], 0.002)
    one_by_one: list[Send] = []
    for s in firsts[1]:
        got = outcome(s)
        one_by_one += (
            rounds[1].on_failure(s.ticket, 0.002)
            if got is None
            else rounds[1].on_reply(s.ticket, got, 0.002)
        )
    assert (rounds[0].got >= rounds[1].got).all()
    assert ((rounds[0].got.sum(axis=1) >= K) == (rounds[1].got.sum(axis=1) >= K)).all()
    assert rounds[0].ready_chunks() == rounds[1].ready_chunks()
    shape = [(s.node, s.blocks.tolist(), s.indices.tolist()) for s in together]
    assert shape == [(s.node, s.blocks.tolist(), s.indices.tolist()) for s in one_by_one]
    assert rounds[0].on_outcomes([(firsts[0][0].ticket, None)], 0.003) == []  # already over


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-1, 15), min_size=N, max_size=N), min_size=1, max_size=9),
    node_cap=st.integers(1, 3),
    dead=st.sets(st.integers(0, 15), max_size=3),
)
def test_has_round_asks_each_node_for_its_blocks_and_answers_together_as_one_by_one(
    rows: list[list[int]], node_cap: int, dead: set[int]
) -> None:
    """Each node is asked for the blocks ``rows`` lists it for, and may hold as many shards
    of a block as it is listed for (at least ``node_cap``): the plain definition, node by
    node. Answers handed over together end the round as one at a time does."""
    table = np.array(rows, np.int64)
    nodes = list(range(16))
    pair = [
        HasRound(table, nodes, k=2, n=N, settle=3, hedge_s=0.5, timeout_s=1.0, node_cap=node_cap)
        for _ in range(2)
    ]
    want_unanswered = np.zeros(len(table), np.int64)
    for node in nodes:
        listed = (table == node).sum(axis=1)
        want_unanswered += np.where(listed > 0, np.maximum(listed, node_cap), 0)
        [send] = [s for s in pair[0].sends.values() if s.node == node]
        assert send.blocks.tolist() == np.nonzero(listed)[0].tolist()
    assert pair[0].unanswered.tolist() == want_unanswered.tolist()

    def answers(r: HasRound) -> list[tuple[int, object]]:
        out: list[tuple[int, object]] = []
        for send in r.start(0.0):
            if send.node in dead:
                out.append((send.ticket, None))
                continue
            positions = [int(np.flatnonzero(table[b] == send.node)[0]) for b in send.blocks]
            out.append((send.ticket, (np.arange(len(send.blocks)), np.array(positions, np.int64),
                                      np.full(len(send.blocks), 7, np.uint64))))  # fmt: skip
        return out

    pair[0].on_answers(answers(pair[0]), 0.01)  # type: ignore[arg-type]
    for ticket, answer in answers(pair[1]):
        if answer is None:
            pair[1].on_failure(ticket, 0.01)
        else:
            pair[1].on_reply(ticket, *answer, 0.01)  # type: ignore[misc]
    assert pair[0].done == pair[1].done
    assert (pair[0]._count == pair[1]._count).all()
    assert pair[0].unanswered.tolist() == pair[1].unanswered.tolist() == [0] * len(table)
    key = [(h.node, h.ordinal.tolist(), h.index.tolist()) for h in pair[0].held_shards()]
    assert key == [(h.node, h.ordinal.tolist(), h.index.tolist()) for h in pair[1].held_shards()]


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(0, 40),
    width=st.integers(1, 14),
    nodes=st.integers(1, 60),
    unset=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**32 - 1),
)
def test_put_round_sends_what_a_pass_per_node_finds(
    blocks: int, width: int, nodes: int, unset: float, seed: int
) -> None:
    """A PUT round's sends (one sort of the holders) are, node by node, the positions
    ``np.nonzero(holders == node)`` finds, in its order; -1s and down nodes get none."""
    rng = np.random.default_rng(seed)
    holders = rng.integers(0, nodes, (blocks, width))
    holders[rng.random((blocks, width)) < unset] = -1
    up = rng.random(nodes) < 0.8
    round_ = PutRound(holders, up, min_write=1, hedge_s=0.01, timeout_s=1.0)
    got = {s.node: (s.blocks.tolist(), s.indices.tolist()) for s in round_.start(0.0)}
    want = {}
    for node in np.unique(holders).tolist():
        if node >= 0 and up[node]:
            b, i = np.nonzero(holders == node)
            want[node] = (b.tolist(), i.tolist())
    assert got == want
    assert all(s.blocks.dtype == np.int64 for s in round_.sends.values())
