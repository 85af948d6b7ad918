"""The client's decisions, without I/O: what to ask whom, when to hedge, when a round is over.

Each round is a small state machine in the style of h11: the driver
(:mod:`kvcache.client.driver`) calls :meth:`start`, then reports every reply,
failure and timer tick, and performs the :class:`Send` actions each call
returns. Rounds take the time as an argument and never read a clock or touch
a socket, so tests drive them through any schedule of replies and delays.

* :class:`HasRound` — one HAS per node; over when every answer that could
  still change the outcome is in; after the hedge time, once every block
  has k shards or cannot reach k whatever the rest answer; or at the
  deadline.
* :class:`LoadRound` — a whole load, cut into chunks of blocks with several
  chunks in flight (the window). Each chunk asks k + 1 shards per block
  first, the remaining holders at its hedge time (or when its first asks are
  all answered short), and is over when every block has all its data
  shards, or every block has k shards and a short settle time has passed
  (data shards still on their way are worth a little wait, a node that went
  silent is not), or every ask is answered, or at its deadline. A block that
  then cannot be rebuilt or fails verification is escalated: every holder
  not asked yet is asked.
* :class:`PutRound` — one batch of blocks, all shards sent at once; over when
  every node answered, or a hedge time after every block reached the write
  quorum, or at the deadline. A node that fails (no answer, refused
  connection) has its shards sent on to the next node of each block's
  rendezvous order, within the block's redirect budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache.client.plan import HeldShards, best_counts, plan_reads

__all__ = ["HasRound", "LoadRound", "PutRound", "Send"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Send(NamedTuple):
    """Ask ``node`` for (or send it) shard ``indices[j]`` of block ``blocks[j]`` (a named
    tuple: a load makes one per node and chunk)."""

    ticket: int
    node: int
    blocks: IntArray
    indices: IntArray


_tickets = itertools.count(1)


def _by_holder(holders: IntArray) -> list[tuple[int, IntArray, IntArray]]:
    """Per node of ``holders`` (-1s left out), in node order: the (block, shard index)
    positions it holds, in row-major order, as ``np.nonzero(holders == node)`` gives them,
    found in one sort rather than one pass over ``holders`` per node (48 nodes: 48 passes)."""
    width = holders.shape[1] if holders.ndim == 2 else 0
    flat = holders.reshape(-1)
    order = np.argsort(flat, kind="stable")
    nodes = flat[order]
    order = order[nodes >= 0]
    nodes = nodes[nodes >= 0]
    if not len(nodes):
        return []
    blocks, indices = np.divmod(order.astype(np.int64), max(1, width))
    bounds = [0, *(np.flatnonzero(nodes[1:] != nodes[:-1]) + 1).tolist(), len(nodes)]
    firsts = nodes[bounds[:-1]].tolist()
    return [
        (int(node), blocks[a:b], indices[a:b])
        for node, a, b in zip(firsts, bounds[:-1], bounds[1:], strict=True)
    ]


def _send(node: int, blocks: IntArray, indices: IntArray) -> Send:
    return Send(
        next(_tickets), node, blocks.astype(np.int64, copy=False),
        indices.astype(np.int64, copy=False),
    )  # fmt: skip


# ---------------------------------------------------------------------- HAS


class HasRound:
    """Which shards do the holders have? One HAS per node (see the module docstring).

    ``rows`` are the placement holders of each block; ``settle`` is how many
    shards of one stripe a block needs before its answer cannot improve
    (k for a match, ``min_write_shards`` for a store's check). ``node_cap`` is
    the most shards of one block a node listed once may hold (more than one
    where writers had to double up on live nodes while holders were down), so
    a block is given up on only when the nodes yet to answer cannot hold
    enough.
    """

    def __init__(
        self,
        rows: IntArray,
        nodes: Sequence[int],
        *,
        k: int,
        n: int,
        settle: int,
        hedge_s: float,
        timeout_s: float,
        node_cap: int = 1,
        complete: bool = False,
    ) -> None:
        self.rows = rows
        self.k, self.n, self.settle = k, n, settle
        #: Wait for every node until the hedge time, whatever the counts say (a store: a
        #: leftover shard on the last node to answer must be seen, to be replaced).
        self.complete = complete
        self._hedge_s, self._timeout_s = hedge_s, timeout_s
        self.sends = {}
        #: Per block: shards that nodes yet to answer may hold.
        self.unanswered = np.zeros(len(rows), np.int64)
        self._may_hold: dict[int, tuple[IntArray, IntArray]] = {}
        # Each (node, block) pair of ``rows`` and how often the node is listed for the block,
        # sorted by node: one pass over the rows, not two per node (48 nodes: 96 passes).
        width = rows.shape[1] if rows.ndim == 2 else 0
        listed_at = rows.reshape(-1)
        keep = listed_at >= 0
        pairs = listed_at[keep].astype(np.int64) * len(rows) + (
            np.arange(listed_at.size, dtype=np.int64)[keep] // max(1, width)
        )
        uniq, times = np.unique(pairs, return_counts=True)
        pair_node, pair_block = np.divmod(uniq, max(1, len(rows)))
        wanted = np.asarray(list(nodes), np.int64)
        starts = np.searchsorted(pair_node, wanted, "left")
        ends = np.searchsorted(pair_node, wanted, "right")
        for node, a, b in zip(wanted.tolist(), starts.tolist(), ends.tolist(), strict=True):
            blocks = pair_block[a:b]
            send = _send(node, blocks, np.zeros(len(blocks), np.int64))
            self.sends[send.ticket] = send
            may = np.maximum(times[a:b], node_cap)
            self._may_hold[send.ticket] = (blocks, may)
            self.unanswered[blocks] += may
        self.pending = set(self.sends)
        self.answered = 0
        self.held: list[tuple[int, IntArray, IntArray, npt.NDArray[np.uint64]]] = []
        # Per block: shards seen, the first stripe seen, and whether another one was:
        # while a block's answers agree on one stripe, its best count is its shard count.
        self._count = np.zeros(len(rows), np.int64)
        self._seen = np.zeros((len(rows), n), bool)
        self._stripe = np.zeros(len(rows), np.uint64)
        self._mixed = np.zeros(len(rows), bool)
        self.started = 0.0
        self._hedged = False
        self.done = not self.pending

    def start(self, now: float) -> list[Send]:
        """The HAS requests to send."""
        self.started = now
        return list(self.sends.values())

    def on_reply(
        self,
        ticket: int,
        ordinal: IntArray,
        index: IntArray,
        stripe: npt.NDArray[np.uint64],
        now: float,
    ) -> None:
        """A node's answer: for its request item ``ordinal[j]``, it holds ``index[j]`` of ``stripe[j]``."""
        self.on_answers([(ticket, (ordinal, index, stripe))], now)

    def on_failure(self, ticket: int, now: float) -> None:
        """A node did not answer."""
        self.on_answers([(ticket, None)], now)

    def on_answers(
        self,
        answers: Sequence[tuple[int, tuple[IntArray, IntArray, npt.NDArray[np.uint64]] | None]],
        now: float,
    ) -> None:
        """Several nodes' outcomes at once, as :meth:`on_reply` (ordinal, index, stripe) or
        :meth:`on_failure` (None) take them one by one; the counts are updated and the round
        looked at once for all of them (a match over 48 nodes paid both per reply)."""
        parts: list[tuple[IntArray, IntArray, npt.NDArray[np.uint64]]] = []
        resolved = False
        for ticket, answer in answers:
            send = self._resolve(ticket)
            if send is None:
                continue
            resolved = True
            if answer is None:
                continue
            ordinal, index, stripe = answer
            self.answered += 1
            valid = (ordinal >= 0) & (ordinal < len(send.blocks))
            blocks, stripes = send.blocks[ordinal[valid]], stripe[valid]
            self.held.append((send.node, blocks, index[valid], stripes))
            parts.append((blocks, index[valid], stripes))
        if parts:
            blocks = np.concatenate([p[0] for p in parts])
            indices = np.concatenate([p[1] for p in parts])
            stripes = np.concatenate([p[2] for p in parts])
            # A block's first stripe is the first one answered for it.
            firsts, at = np.unique(blocks, return_index=True)
            unseen = self._stripe[firsts] == 0
            self._stripe[firsts[unseen]] = stripes[at[unseen]]
            same = (self._stripe[blocks] == stripes) & (indices >= 0) & (indices < self.n)
            self._mixed[blocks[~same]] = True
            # Distinct indices: a shard can sit on two nodes (sent on after a node failed
            # that stored it anyway, or put back by a read repair), and counts once.
            self._seen[blocks[same], indices[same]] = True
            self._count[firsts] = self._seen[firsts].sum(axis=1)
        if resolved:
            self._check(now)

    def tick(self, now: float) -> None:
        """Time passed."""
        self._check(now)

    def next_wakeup(self) -> float | None:
        """When :meth:`tick` must be called next (None: only replies can change anything)."""
        if self.done:
            return None
        hedge_at = self.started + self._hedge_s
        return self.started + self._timeout_s if self._hedged else hedge_at

    def _resolve(self, ticket: int) -> Send | None:
        if ticket not in self.pending:
            return None
        self.pending.discard(ticket)
        send = self.sends[ticket]
        blocks, may = self._may_hold[ticket]
        self.unanswered[blocks] -= may
        return send

    def _check(self, now: float) -> None:
        if not self.pending or now >= self.started + self._timeout_s:
            self.done = True
            return
        if now >= self.started + self._hedge_s:
            self._hedged = True
        if self.complete:
            self.done = self._hedged
            return
        if self.answered < self.k:
            return
        best = self._count
        if self._mixed.any():  # rare: two writes of a block answered; count per stripe
            best = best_counts(self.held_shards(), len(self.rows), n=self.n)
        # Until the hedge time every block waits for ``settle`` shards; after it, k are
        # enough, but a block that may still reach k waits for it (else a slow node would
        # turn a stored block into a miss).
        want = self.k if self._hedged else self.settle
        if ((best >= want) | (best + self.unanswered < want)).all():
            self.done = True

    def held_shards(self) -> list[HeldShards]:
        """The answers so far."""
        return [HeldShards(node, blocks, idx, stripe) for node, blocks, idx, stripe in self.held]


# ---------------------------------------------------------------------- loads


_PENDING, _OPEN, _READY, _TAKEN, _FINISHED = range(5)


class LoadRound:
    """A hedged load of many blocks, chunk by chunk (see the module docstring).

    ``holders[b, i]`` is the node holding shard ``i`` of block ``b``'s chosen
    stripe (-1: unknown); ``fallback`` (same shape), where a holder is
    unknown, the node placement puts it on, asked only when escalating.
    The driver reports which shards of a reply it accepted, takes
    :meth:`ready_chunks` to verify, then calls :meth:`escalate` or
    :meth:`finish_chunk` for each.
    """

    #: Once every block of a chunk has k shards, missing data shards are waited for this
    #: fraction of the time the chunk took to get there (at least SETTLE_FLOOR_S, at most
    #: until the hedge time): shards sent with the others arrive within it, while a node
    #: that stopped answering costs a rebuild instead of a wait.
    SETTLE_FRACTION = 0.25
    SETTLE_FLOOR_S = 0.0005

    def __init__(
        self,
        holders: IntArray,
        node_up: BoolArray,
        *,
        k: int,
        chunk_blocks: int,
        window: int,
        hedge_s: float,
        timeout_s: float,
        fallback: IntArray | None = None,
        spare: int = 1,
        unlikely: BoolArray | None = None,
    ) -> None:
        self.holders = holders
        self.fallback = fallback
        #: Holders to ask after the others (see :func:`kvcache.client.plan.plan_reads`).
        self.unlikely = unlikely
        self.node_up = node_up
        self.blocks, self.n = holders.shape
        self.k = k
        self.chunk_blocks = max(1, chunk_blocks)
        self.window = max(1, window)
        self.spare = spare
        self._hedge_s, self._timeout_s = hedge_s, timeout_s
        self.chunks = -(-self.blocks // self.chunk_blocks) if self.blocks else 0
        self.state = [_PENDING] * self.chunks
        self.got = np.zeros((self.blocks, self.n), bool)
        self.asked = np.zeros((self.blocks, self.n), bool)
        #: Shards asked at least once (an abandoned ask clears ``asked``, never this).
        self.sent = np.zeros((self.blocks, self.n), bool)
        self._hedge_at = [0.0] * self.chunks
        self._deadline = [0.0] * self.chunks
        self._later: list[list[tuple[int, IntArray, IntArray]]] = [[] for _ in range(self.chunks)]
        self._outstanding: list[set[int]] = [set() for _ in range(self.chunks)]
        self.sends: dict[int, tuple[int, Send]] = {}
        #: Hedge requests sent (each one a node asked for its later shards of a chunk).
        self.hedges = 0
        self._next_chunk = 0
        self._limit = self.chunks
        #: When each chunk was opened, and when each first had k shards of every block
        #: (None: not yet): the latency a load's hedging is tuned by.
        self.opened_at = [0.0] * self.chunks
        self.complete_at: list[float | None] = [None] * self.chunks
        self._settle_at = [0.0] * self.chunks
        self._escalating = [False] * self.chunks

    # -------------------------------------------------------------- events

    def start(self, now: float) -> list[Send]:
        """Open the first ``window`` chunks."""
        return self._open_more(now)

    def on_reply(self, ticket: int, accepted: BoolArray, now: float) -> list[Send]:
        """The shards of ``ticket`` that arrived and passed the driver's checks."""
        return self.on_outcomes([(ticket, accepted)], now)

    def on_failure(self, ticket: int, now: float) -> list[Send]:
        """``ticket`` failed: no shard of it arrived."""
        return self.on_outcomes([(ticket, None)], now)

    def on_outcomes(
        self, outcomes: Sequence[tuple[int, BoolArray | None]], now: float
    ) -> list[Send]:
        """Several tickets' outcomes at once: per ticket, the shards that arrived and passed
        the driver's checks (None: it failed, nothing arrived). Each chunk they touch is
        then looked at once, not once per reply: a load over many nodes (48 replies to a
        chunk) paid the chunk's completion checks for every one of them."""
        touched: list[int] = []
        got: list[Send] = []
        oks: list[BoolArray] = []
        for ticket, accepted in outcomes:
            entry = self.sends.pop(ticket, None)
            if entry is None:
                continue
            chunk, send = entry
            self._outstanding[chunk].discard(ticket)
            if accepted is not None:
                got.append(send)
                oks.append(accepted)
            if chunk not in touched:
                touched.append(chunk)
        if len(got) == 1:
            ok = oks[0]
            self.got[got[0].blocks[ok], got[0].indices[ok]] = True
        elif got:  # every reply's shards in one write
            ok = np.concatenate(oks)
            blocks = np.concatenate([s.blocks for s in got])
            indices = np.concatenate([s.indices for s in got])
            self.got[blocks[ok], indices[ok]] = True
        out: list[Send] = []
        for chunk in touched:
            out += self._advance(chunk, now)
        return out

    def tick(self, now: float) -> list[Send]:
        """Time passed: hedge or close chunks whose times came."""
        out: list[Send] = []
        for chunk in range(self.chunks):
            if self.state[chunk] == _OPEN:
                out += self._advance(chunk, now)
        return out

    def next_wakeup(self) -> float | None:
        """When :meth:`tick` must be called next (None: nothing is waiting on time)."""
        times = []
        for chunk in range(self.chunks):
            if self.state[chunk] == _OPEN:
                if self.complete_at[chunk] is not None:
                    times.append(self._settle_at[chunk])
                times.append(self._hedge_at[chunk] if self._later[chunk] else self._deadline[chunk])
        return min(times, default=None)

    def latency(self, chunk: int) -> float | None:
        """Seconds ``chunk`` took to have k shards of every block (None: it never did)."""
        done = self.complete_at[chunk]
        return None if done is None else done - self.opened_at[chunk]

    # -------------------------------------------------------------- the driver's side

    def ready_chunks(self) -> list[int]:
        """Chunks whose asks are over and that the driver has not taken yet (in order)."""
        out = [c for c in range(self.chunks) if self.state[c] == _READY]
        for c in out:
            self.state[c] = _TAKEN
        return out

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """The blocks of ``chunk``: [start, stop)."""
        start = chunk * self.chunk_blocks
        return start, min(self.blocks, start + self.chunk_blocks)

    def escalate(self, chunk: int, blocks: IntArray, now: float) -> list[Send]:
        """Ask every holder of ``blocks`` not asked yet (a block failed); reopens the chunk.

        Returns no sends (and leaves the chunk finished) when there is nobody left to ask.
        """
        rows = self.holders[blocks]
        if self.fallback is not None:
            rows = np.where(rows >= 0, rows, self.fallback[blocks])
        want = (rows >= 0) & ~self.asked[blocks]
        if not want.any():
            return []
        b_idx, i_idx = np.nonzero(want)
        sends = self._group(rows[b_idx, i_idx], blocks[b_idx], i_idx)
        self.state[chunk] = _OPEN
        self._later[chunk] = []
        self._deadline[chunk] = now + self._timeout_s
        self.complete_at[chunk] = None
        # The escalated blocks have their data shards, some of them bad: the chunk is
        # over only when every new ask is answered (or at the deadline).
        self._escalating[chunk] = True
        return self._track(chunk, sends)

    def finish_chunk(self, chunk: int) -> list[Send]:
        """The driver is done with ``chunk``; the window may open the next one."""
        self.state[chunk] = _FINISHED
        return []

    def open_more(self, now: float) -> list[Send]:
        """Open chunks while fewer than ``window`` are in flight."""
        return self._open_more(now)

    def stop_before(self, block: int) -> None:
        """Open no chunk that starts at or after ``block`` (a block before it ended the prefix)."""
        limit = -(-block // self.chunk_blocks)
        self._limit = min(self._limit, limit)
        for chunk in range(self._limit, self.chunks):
            self.state[chunk] = _FINISHED
            self._later[chunk] = []
            for ticket in self._outstanding[chunk]:
                self.sends.pop(ticket, None)  # abandoned: its reply is ignored
            self._outstanding[chunk].clear()

    @property
    def done(self) -> bool:
        """Every chunk was handed to the driver and finished."""
        return all(s == _FINISHED for s in self.state)

    # -------------------------------------------------------------- internals

    def _open_more(self, now: float) -> list[Send]:
        out: list[Send] = []
        in_flight = sum(1 for s in self.state if s == _OPEN)
        while self._next_chunk < min(self.chunks, self._limit) and in_flight < self.window:
            out += self._open(self._next_chunk, now)
            self._next_chunk += 1
            in_flight += 1
        return out

    def _open(self, chunk: int, now: float) -> list[Send]:
        start, stop = self.chunk_range(chunk)
        plan = plan_reads(
            self.holders[start:stop],
            self.node_up,
            k=self.k,
            spare=self.spare,
            unlikely=None if self.unlikely is None else self.unlikely[start:stop],
            first_block=start,
        )
        self.state[chunk] = _OPEN
        self.opened_at[chunk] = now
        self._hedge_at[chunk] = now + self._hedge_s
        self._deadline[chunk] = now + self._timeout_s
        self._later[chunk] = plan.later
        first = [Send(next(_tickets), node, b, i) for node, b, i in plan.first]
        out = self._track(chunk, first)
        if not out:
            out += self._advance(chunk, now)
        return out

    def _track(self, chunk: int, sends: list[Send]) -> list[Send]:
        if not sends:
            return sends
        outstanding = self._outstanding[chunk]
        for send in sends:
            self.sends[send.ticket] = (chunk, send)
            outstanding.add(send.ticket)
        if len(sends) == 1:
            blocks, indices = sends[0].blocks, sends[0].indices
        else:  # one pair of writes for every send (a chunk over 48 nodes has 48)
            blocks = np.concatenate([s.blocks for s in sends])
            indices = np.concatenate([s.indices for s in sends])
        self.asked[blocks, indices] = True
        self.sent[blocks, indices] = True
        return sends

    def _group(self, nodes: IntArray, blocks: IntArray, indices: IntArray) -> list[Send]:
        out = []
        for node in np.unique(nodes).tolist():
            sel = nodes == node
            out.append(_send(node, blocks[sel], indices[sel]))
        return out

    def _advance(self, chunk: int, now: float) -> list[Send]:
        if self.state[chunk] != _OPEN:
            return []
        out: list[Send] = []
        if self._escalating[chunk]:
            if self._outstanding[chunk] and now < self._deadline[chunk]:
                return out
            self.state[chunk] = _READY
            self._abandon(chunk)
            return self._open_more(now)
        start, stop = self.chunk_range(chunk)
        got = self.got[start:stop]
        complete = got.sum(axis=1) >= self.k
        if complete.all() and self.complete_at[chunk] is None:
            self.complete_at[chunk] = now
            settle = max(self.SETTLE_FLOOR_S, self.SETTLE_FRACTION * (now - self.opened_at[chunk]))
            self._settle_at[chunk] = min(now + settle, max(now, self._hedge_at[chunk]))
        # Every block with all its data shards: done, nothing to rebuild. Blocks complete
        # only through parity wait a little for their data shards (see SETTLE_FRACTION),
        # unless nothing more is coming.
        if got[:, : self.k].all() or (
            complete.all() and (now >= self._settle_at[chunk] or not self._outstanding[chunk])
        ):
            self._later[chunk] = []
            self.state[chunk] = _READY
        elif self._later[chunk] and (now >= self._hedge_at[chunk] or not self._outstanding[chunk]):
            # Hedge: ask the remaining holders for the blocks still short.
            for node, blocks, idx in self._later[chunk]:
                want = ~complete[blocks - start]
                if want.any():
                    self.hedges += 1
                    out += self._track(chunk, [_send(node, blocks[want], idx[want])])
            self._later[chunk] = []
            if not self._outstanding[chunk]:
                self.state[chunk] = _READY
        elif not self._outstanding[chunk] or now >= self._deadline[chunk]:
            self.state[chunk] = _READY
        if self.state[chunk] == _READY:
            self._abandon(chunk)
            out += self._open_more(now)
        return out

    def _abandon(self, chunk: int) -> None:
        """Asks of ``chunk`` still out are abandoned: their replies are ignored, and their
        shards count as not asked, so an escalation asks for them again."""
        for ticket in list(self._outstanding[chunk]):
            entry = self.sends.pop(ticket, None)
            if entry is not None:
                send = entry[1]
                self.asked[send.blocks, send.indices] = False
        self._outstanding[chunk].clear()


# ---------------------------------------------------------------------- stores


#: Picks a new node for a shard of block ``b`` whose node failed: (b, the block's current
#: targets, the nodes failed in this round) -> node, or -1 for none.
Respill = Callable[[int, IntArray, frozenset[int]], int]


class PutRound:
    """One batch of blocks written to their holders (see the module docstring).

    ``holders[b, i]`` is the node shard ``i`` of block ``b`` goes to (-1: not
    sent); nodes not in ``node_up`` are skipped (their shards count as not
    stored). With ``respill``, the shards of a node whose request fails are
    sent to ``respill(b, holders[b], failed_nodes)`` instead, as long as
    ``redirected[b]`` (shards of the block already off their holders) stays
    within ``redirect_limit``; :attr:`holders` always says where each shard went.
    Once every block is decided (written, or answered CONFLICT by some holder) the round
    waits for the rest only ``hedge_s`` more, not to ``timeout_s``. Holders that stay
    silent while the others have answered (no more than ``max_silent`` of the round's
    nodes) are hedged like failed ones (their shards sent on, their requests left out in
    case they answer after all): once no reply came for as long as the round took from
    :meth:`begin` until its last one (at least ``hedge_s``), :meth:`tick` returns those
    sends. A store drives its chunks' rounds in turn; :meth:`begin` also hedges at once
    the nodes an earlier chunk's round found silent. A late answer of a hedged node is
    kept in :attr:`late_acks`, so a rollback deletes there too.
    """

    def __init__(
        self,
        holders: IntArray,
        node_up: BoolArray,
        *,
        min_write: int,
        hedge_s: float,
        timeout_s: float,
        respill: Respill | None = None,
        redirected: IntArray | None = None,
        redirect_limit: int = 0,
        max_silent: int = 0,
    ) -> None:
        self.holders = holders.copy()
        self.min_write = min_write
        self._hedge_s, self._timeout_s = hedge_s, timeout_s
        blocks, n = holders.shape
        self.acks = np.zeros((blocks, n), bool)
        #: Blocks a holder answered CONFLICT for (another stripe's live shard is stored
        #: there); the driver marks them.
        self.conflicts = np.zeros(blocks, bool)
        self.sends: dict[int, Send] = {}
        self._respill = respill
        self.redirected = (
            redirected.copy() if redirected is not None else np.zeros(blocks, np.int64)
        )
        self.redirect_limit = redirect_limit
        #: Nodes whose request failed in this round.
        self.failed: set[int] = set()
        #: Nodes still silent when the others had answered (their shards sent on).
        self.stalled: set[int] = set()
        #: (node, blocks) a hedged node stored after all, its shards being elsewhere now.
        self.late_acks: list[tuple[int, IntArray]] = []
        self._max_silent = max_silent
        self._since = 0.0  # when the driver began handling this round's replies
        self._last_reply: float | None = None  # the last reply handled (not failures)
        #: Shards sent on to another node after their node failed.
        self.respilled = 0
        for node, b, i in _by_holder(holders):
            if node_up[node]:
                send = Send(next(_tickets), node, b, i)
                self.sends[send.ticket] = send
        self.pending = set(self.sends)
        self._first = frozenset(self.sends)  # the requests a silent holder may be hedged for
        self.started = 0.0
        self.quorum_at: float | None = None
        self.done = not self.pending

    def start(self, now: float) -> list[Send]:
        """The PUT requests to send."""
        self.started = self._since = now
        self._check(now)
        return list(self.sends.values())

    def begin(self, now: float, silent: Iterable[int] = ()) -> list[Send]:
        """The driver handles this round's replies from ``now`` on (replies that waited for
        it are stamped with the time it handles them, so the round's time counts from
        here); the round's requests to ``silent`` nodes (found silent by an earlier round
        of the same store) are hedged at once: returns the sends that carry them on."""
        self._since = max(self._since, now)
        out: list[Send] = []
        nodes = {self.sends[t].node for t in self.pending & self._first} & set(silent)
        if nodes and not self.done and self.quorum_at is None:
            out = self._hedge(nodes, now)
        self._check(now)
        return out

    def on_reply(self, ticket: int, stored: BoolArray, now: float) -> None:
        """Which shards of ``ticket`` the node stored."""
        self.on_replies([(ticket, stored)], now)

    def on_replies(self, replies: Sequence[tuple[int, BoolArray]], now: float) -> None:
        """:meth:`on_reply` for replies that arrived together (a burst's, one per node):
        the round is judged once for all of them."""
        for ticket, stored in replies:
            if ticket not in self.pending:
                continue
            self.pending.discard(ticket)
            self._last_reply = now
            send = self.sends[ticket]
            self.acks[send.blocks[stored], send.indices[stored]] = True
            if send.node in self.stalled and stored.any():
                self.late_acks.append((send.node, np.unique(send.blocks[stored])))
        self._check(now)

    def on_failure(self, ticket: int, now: float) -> list[Send]:
        """``ticket`` failed: none of its shards count as stored; returns the sends that
        carry them to other nodes (see the class docstring)."""
        if ticket not in self.pending:
            return []
        self.pending.discard(ticket)
        send = self.sends[ticket]
        self.failed.add(send.node)
        out = self._redirect(send, now)
        self._check(now)
        return out

    def _stall_at(self) -> float | None:
        """When the round's first requests still out count as stalled: no reply for as
        long as the round took until its last one, and at least a hedge's time; None
        while nothing answered, every block is decided or none is left to hedge (a
        request that carries shards on is not hedged again: it waits for the timeout)."""
        if self.done or self.quorum_at is not None or self._last_reply is None:
            return None
        silent = self._silent()
        if not silent or len(silent) > self._max_silent:
            return None
        last = self._last_reply
        return last + max(self._hedge_s, last - self._since)

    def _silent(self) -> set[int]:
        """The nodes of the round's first requests still out, not hedged yet."""
        return {self.sends[t].node for t in self.pending & self._first} - self.stalled

    def _hedge(self, nodes: set[int], now: float) -> list[Send]:
        """Send the shards of ``nodes``' first requests on (all of them marked first, so
        none is sent to another of them)."""
        self.stalled |= nodes
        out: list[Send] = []
        for ticket in sorted(self.pending & self._first):
            send = self.sends[ticket]
            if send.node in nodes:
                out.extend(self._redirect(send, now))
        return out

    def _redirect(self, send: Send, now: float) -> list[Send]:
        if self._respill is None or now >= self.started + self._timeout_s:
            return []
        failed = frozenset(self.failed | self.stalled)
        moved: dict[int, list[tuple[int, int]]] = {}
        for b, i in zip(send.blocks.tolist(), send.indices.tolist(), strict=True):
            if self.acks[b, i] or self.holders[b, i] != send.node or self.conflicts[b]:
                continue  # stored, sent on already, or written the careful way after all
            if self.redirected[b] >= self.redirect_limit:
                continue
            node = self._respill(b, self.holders[b], failed)
            if node < 0 or node in failed:
                continue
            self.holders[b, i] = node
            self.redirected[b] += 1
            moved.setdefault(node, []).append((b, i))
        out = []
        for node, pairs in moved.items():
            blocks = np.array([b for b, _ in pairs], np.int64)
            indices = np.array([i for _, i in pairs], np.int64)
            new = _send(node, blocks, indices)
            self.sends[new.ticket] = new
            self.pending.add(new.ticket)
            self.respilled += len(pairs)
            out.append(new)
        return out

    def tick(self, now: float) -> list[Send]:
        """Time passed; returns the sends that carry a stalled holder's shards on (see the
        class docstring)."""
        out: list[Send] = []
        stall_at = self._stall_at()
        if stall_at is not None and now >= stall_at:
            out = self._hedge(self._silent(), now)
        self._check(now)
        return out

    def next_wakeup(self) -> float | None:
        """When :meth:`tick` must be called next."""
        if self.done:
            return None
        limit = self.started + self._timeout_s
        if self.quorum_at is not None:
            return min(limit, self.quorum_at + self._hedge_s)
        stall_at = self._stall_at()
        return limit if stall_at is None else min(limit, stall_at)

    @property
    def written(self) -> BoolArray:
        """Per block: stored with at least ``min_write`` shards."""
        result: BoolArray = self.acks.sum(axis=1) >= self.min_write
        return result

    def _check(self, now: float) -> None:
        # Decided: written, or answered CONFLICT by some holder (the store takes those the
        # careful way after the round, whatever the rest answer). A round whose blocks are
        # all decided waits for stragglers only a hedge's time, not the timeout: a holder
        # that stopped answering must not hold up a store of blocks that already exist.
        if self.quorum_at is None and (self.written | self.conflicts).all():
            self.quorum_at = now
        limit = self.started + self._timeout_s
        if self.quorum_at is not None:
            limit = min(limit, self.quorum_at + self._hedge_s)
        if not self.pending or now >= limit:
            self.done = True
