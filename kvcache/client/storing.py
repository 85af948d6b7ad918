"""Quorum stores: encode, send every holder its shards, keep what reached the write quorum.

A store sends its PUTs at once, a chunk at a time with ``window`` chunks in
flight while the next ones are encoded on a small thread pool (ISA-L and xxh3
release the GIL). A block counts as written when ``min_write_shards`` shards
of *its* stripe were stored; otherwise the shards it did store are deleted
again. A block some holder answered CONFLICT for (a live shard of another
stripe is stored there) is stored again the careful way: first ask the
holders what they have (HAS); a block that is readable (k shards of one
stripe) is then only touched, the rest is written, naming what it may replace.
Blocks are stored because a match just missed them, so the HAS round that
every store once began with found nothing almost always: it cost a round trip
and the client's and daemons' CPU for it (``ask_before_store`` brings it back
for every store; a client that knows a block's stripe is broken asks first).

Racing writers: a daemon never replaces a live shard of another stripe
unless the PUT names that stripe (``expect``) and it is old enough that its
writer has finished (``docs/spec/wire.md``). A store names a stripe only
when it is not readable (fewer than k shards) or known broken. So two
concurrent stores of one block cannot both be acknowledged: each node keeps
the first, at most one writer reaches the quorum, the other rolls back. A
long store decides again, per chunk, what it may replace once its first
decision is older than ``EXPECT_FRESH_S``.

Down holders: a shard whose holder is down (by the membership source or
this client's own health tracking) goes to the key's next live node in
rendezvous order, and when a node fails during the PUT its shards are sent
on the same way (:class:`~kvcache.client.rounds.PutRound`). A block is
written only with at most ``max_redirect`` shards off their holders, which
keeps the racing-writer guarantee (``docs/spec/shard-layout.md``, section 6).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache.client.core import ClientCore
from kvcache.client.driver import Pump, PumpedExchange
from kvcache.client.encoding import EncodedBatch, as_payload_rows, encode_batch
from kvcache.client.matching import held_shards
from kvcache.client.plan import HeldShards, best_counts
from kvcache.client.rounds import PutRound, Send
from kvcache.client.view import ClusterView
from kvcache.errors import ArgumentError, ClosedError, ConfigError
from kvcache.keys import BlockKey, are_block_keys
from kvcache.wire import NO_INDEX, NO_RETAIN, Op, Retain, Status, make_items

__all__ = ["Payloads", "StoreResult", "store_keys", "touch_or_delete"]

A = TypeVar("A")
R = TypeVar("R")

log = logging.getLogger(__name__)

#: A CONFLICT item's status as a plain int: numpy compares an array with it directly (an
#: enum member costs a failed attribute lookup on its class per comparison).
_CONFLICT = int(Status.CONFLICT)

#: A chunk written longer than this after the store's HAS asks again what it may replace:
#: well inside the daemons' ``replace_after_s`` (10 s by default), so a long store never
#: replaces the shards of a stripe another writer has finished in the meantime.
EXPECT_FRESH_S = 2.0

Payloads = Sequence[Any] | npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of a store: blocks written, blocks already present (touched), blocks failed."""

    written: int
    touched: int
    failed: int
    failed_blocks: tuple[int, ...] = field(default=())


def store_keys(
    core: ClientCore,
    keys: Sequence[BlockKey],
    payloads: Payloads,
    *,
    payload_len: int,
    traffic_class: str | None = None,
    first_block: int = 0,
    encoder: concurrent.futures.Executor | None = None,
    retain: Retain = NO_RETAIN,
) -> StoreResult:
    """Store one payload per key (see the module docstring); ``retain`` (the request's TTL
    and pin hint) goes with every PUT and TOUCH."""
    cls = core.traffic_class(traffic_class)
    keys = list(keys)
    if isinstance(payload_len, bool) or not isinstance(payload_len, int) or payload_len < 1:
        raise ArgumentError(f"payload_len must be a positive int, got {payload_len!r}")
    if not are_block_keys(keys):
        raise ArgumentError("keys must be 16-byte block keys (kvcache.keys.block_keys)")
    try:
        rows = as_payload_rows(payloads, payload_len)
    except ConfigError as exc:
        raise ArgumentError(str(exc)) from None
    if len(keys) != len(rows):
        raise ArgumentError(f"{len(keys)} keys but {len(rows)} payloads")
    if not keys:
        return StoreResult(0, 0, 0)
    ask = core.config.ask_before_store or bool(core.suspects(keys))
    result, contested = _store(
        core, keys, rows, payload_len=payload_len, cls=cls, first_block=first_block,
        encoder=encoder, retain=retain, ask=ask,
    )  # fmt: skip
    if not contested:
        return result
    # Another stripe is stored on some holders: the careful way for those blocks (a HAS
    # first, so a readable block is touched and a broken one replaced).
    again, _ = _store(
        core, [keys[i] for i in contested], _rows_of(rows, np.asarray(contested, np.int64)),
        payload_len=payload_len, cls=cls, first_block=0, encoder=encoder, retain=retain,
        ask=True,
    )  # fmt: skip
    failed = sorted(
        {*result.failed_blocks} - {first_block + i for i in contested}
        | {first_block + contested[j] for j in again.failed_blocks}
    )
    return StoreResult(
        written=result.written + again.written,
        touched=result.touched + again.touched,
        failed=len(failed),
        failed_blocks=tuple(failed),
    )


def _store(
    core: ClientCore,
    keys: list[BlockKey],
    rows: Any,
    *,
    payload_len: int,
    cls: str,
    first_block: int,
    encoder: concurrent.futures.Executor | None,
    retain: Retain,
    ask: bool,
) -> tuple[StoreResult, list[int]]:
    """One pass of :func:`store_keys`; with ``ask`` the HAS round first. Also returns the
    blocks (indices into ``keys``) that failed with a CONFLICT from some holder, when not
    ``ask``: the caller stores those again, asking first."""
    config = core.config
    n = config.n
    view = core.view()
    up = core.up_mask(view)
    placement_rows, redirected, order = view.targets(keys, up)
    # Where a HAS asks: only a store that asks first needs it.
    read_rows = view.read_rows(keys, placement_rows) if ask else placement_rows
    if ask:
        held = held_shards(
            core, keys, settle=config.min_write_shards, view=view, rows=read_rows, complete=True
        )
        suspects = core.suspects(keys)
        best = best_counts(without_suspects(held, suspects), len(keys), n=n)
        stored = _stored_blocks(held, best, read_rows, k=config.k, whole=config.min_write_shards)
        present = stored
        touched = touch_or_delete(
            core, Op.TOUCH, [keys[i] for i in np.flatnonzero(present)], cls, view=view,
            retain=retain,
        )  # fmt: skip
        for i in suspects:
            if present[i]:  # another stripe of it is readable: the broken one is no matter
                core.clear_suspect(keys[i])
        todo = np.flatnonzero(~present)
        expect = _replaceable(held, placement_rows, stored, suspects)
    else:  # nothing asked, nothing named: a holder keeps any live shard it has
        touched = 0
        todo = np.arange(len(keys))
        expect = np.zeros(placement_rows.shape, np.uint64)
    checked_at = core.clock()
    conflicted = np.zeros(len(keys), bool)
    chunk = config.chunk_blocks(payload_len)
    groups = [todo[s : s + chunk] for s in range(0, len(todo), chunk)]
    now_ms = int(time.time() * 1000)

    def encode(group: npt.NDArray[np.int64]) -> EncodedBatch:
        return encode_batch(
            core.codec,
            [keys[i] for i in group],
            _rows_of(rows, group),
            payload_len=payload_len,
            traffic_class=cls,
            now_ms=now_ms,
        )

    written = 0
    failed: list[int] = []
    pending: list[concurrent.futures.Future[EncodedBatch]] = []
    own_pool = encoder is None
    pool = encoder or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcache-encode")
    try:
        ahead = config.window + 1
        # The first chunk is encoded here: nothing is in flight yet for the pool to overlap
        # it with, and a call of one chunk then makes no thread hop at all.
        pending = [_submit(pool, encode, g) for g in groups[1:ahead]]
        if groups:
            first: concurrent.futures.Future[EncodedBatch] = concurrent.futures.Future()
            first.set_result(encode(groups[0]))
            pending.insert(0, first)
        flights: list[tuple[npt.NDArray[np.int64], EncodedBatch, PutRound, Pump]] = []
        silent: set[int] = set()  # nodes a chunk's round found silent: hedged at once after
        next_group = len(pending)
        done_groups = 0
        while done_groups < len(groups):
            while pending and len(flights) < config.window:
                g_index = len(flights) + done_groups
                batch = pending.pop(0).result()
                if ask and core.clock() - checked_at > EXPECT_FRESH_S:
                    # What this store may replace was decided long ago: decide again for
                    # this chunk, so it never replaces a stripe another writer finished since.
                    group = groups[g_index]
                    expect[group] = _fresh_expect(
                        core,
                        [keys[i] for i in group],
                        placement_rows[group],
                        view,
                        read_rows[group],
                    )
                flights.append(
                    _start_put(
                        core, view, up, groups[g_index], batch, placement_rows, expect,
                        redirected=redirected, order=order, retain=retain,
                        burst=len(groups) == 1,
                    )
                )  # fmt: skip
                if next_group < len(groups):
                    pending.append(_submit(pool, encode, groups[next_group]))
                    next_group += 1
            group, batch, round_, pump = flights[0]
            _drive_put(core, round_, pump, batch, expect[group], retain, silent)
            silent |= round_.stalled
            flights.pop(0)
            done_groups += 1
            ok = round_.written
            written += int(ok.sum())
            failed.extend((first_block + group[~ok]).tolist())
            conflicted[group[~ok & round_.conflicts]] = True
            for i in group[ok].tolist():
                core.clear_suspect(keys[i])
            if not ok.all():
                _rollback(core, batch, round_, ~ok)
    finally:
        for future in pending:
            future.cancel()
        if own_pool:
            pool.shutdown(wait=True)
    contested = [] if ask else np.flatnonzero(conflicted).tolist()
    core.count("blocks_written", written)
    core.count("blocks_touched", touched)
    core.count("write_failures", len(failed) - len(contested))
    result = StoreResult(
        written=written, touched=touched, failed=len(failed), failed_blocks=tuple(failed)
    )
    return result, contested


def _fresh_expect(
    core: ClientCore,
    keys: list[BlockKey],
    placement_rows: npt.NDArray[np.int64],
    view: ClusterView,
    read_rows: npt.NDArray[np.int64],
) -> npt.NDArray[np.uint64]:
    """:func:`_replaceable` for ``keys`` from a new HAS round."""
    config = core.config
    held = held_shards(
        core, keys, settle=config.min_write_shards, view=view, rows=read_rows, complete=True
    )
    suspects = core.suspects(keys)
    best = best_counts(without_suspects(held, suspects), len(keys), n=config.n)
    stored = _stored_blocks(held, best, read_rows, k=config.k, whole=config.min_write_shards)
    return _replaceable(held, placement_rows, stored, suspects)


def _stored_blocks(
    held: list[HeldShards],
    best: npt.NDArray[np.int64],
    asked: npt.NDArray[np.int64],
    *,
    k: int,
    whole: int,
) -> npt.NDArray[np.bool_]:
    """Per block: whether its best stripe counts as stored. That needs as many shards as a
    write leaves (``whole``, min_write_shards), counting those the holders that did not
    answer may hold (stopped or slow: a stored block must not be rewritten for them), and
    at least k found. A stripe short of that with every holder answering is one a writer
    lost shards of, or one still being written: a racing writer's, which rolls back if it
    misses its quorum (a store touched it and reported the block stored, and it was gone)."""
    answered = np.zeros(int(asked.max(initial=-1)) + 2, bool)
    for h in held:
        if h.node < len(answered):
            answered[h.node] = True
    silent = ((asked >= 0) & ~answered[asked]).sum(axis=1)
    stored: npt.NDArray[np.bool_] = (best >= k) & (best + silent >= whole)
    return stored


def _replaceable(
    held: list[HeldShards],
    placement_rows: npt.NDArray[np.int64],
    stored: npt.NDArray[np.bool_],
    suspects: dict[int, int],
) -> npt.NDArray[np.uint64]:
    """``expect[b, i]``: the stripe a PUT of shard i of block b may replace on its holder.

    Only stripes of blocks that do not count as stored (:func:`_stored_blocks`: too few
    shards to read, or fewer than a write leaves with every holder answering) or known
    broken; the daemon still refuses if that shard is younger than its
    ``replace_after_s`` (its writer may be at work).
    """
    expect = np.zeros(placement_rows.shape, np.uint64)
    n = placement_rows.shape[1]
    for h in held:
        # A shard index past this client's k + m is another erasure layout's (a HAS answer
        # is the daemon's, whatever it says): it names no shard of ours to replace.
        h = _select(h, (h.index >= 0) & (h.index < n))
        if not len(h.ordinal):
            continue
        on_holder = placement_rows[h.ordinal, h.index] == h.node
        weak = ~stored[h.ordinal]
        broken = np.array(
            [suspects.get(int(b)) == int(s) for b, s in zip(h.ordinal, h.stripe, strict=True)],
            bool,
        )
        sel = on_holder & (weak | broken)
        expect[h.ordinal[sel], h.index[sel]] = h.stripe[sel]
    return expect


def _select(h: HeldShards, sel: npt.NDArray[np.bool_]) -> HeldShards:
    if sel.all():
        return h
    return HeldShards(h.node, h.ordinal[sel], h.index[sel], h.stripe[sel])


def without_suspects(held: list[HeldShards], suspects: dict[int, int]) -> list[HeldShards]:
    """``held`` without the shards of stripes a load of this client found broken
    (``suspects``: block to stripe). Such a stripe never counts as stored: the block is
    written again, unless another stripe of it is readable (a racing writer's, or one a
    store wrote beside it), which is then only touched."""
    if not suspects:
        return held
    out = []
    for h in held:
        keep = np.array(
            [
                suspects.get(b) != s
                for b, s in zip(h.ordinal.tolist(), h.stripe.tolist(), strict=True)
            ],
            bool,
        )
        out.append(_select(h, keep))
    return out


def _start_put(
    core: ClientCore,
    view: ClusterView,
    up: npt.NDArray[np.bool_],
    group: npt.NDArray[np.int64],
    batch: EncodedBatch,
    placement_rows: npt.NDArray[np.int64],
    expect: npt.NDArray[np.uint64],
    *,
    redirected: npt.NDArray[np.int64],
    order: npt.NDArray[np.int64],
    retain: Retain = NO_RETAIN,
    burst: bool = False,
) -> tuple[npt.NDArray[np.int64], EncodedBatch, PutRound, Pump]:
    """Start one chunk's PUT round. ``burst``: the chunk is the store's only one, so its
    PUTs go out, and their replies come back, in one native burst on this thread
    (``TcpTransport.burst_plain``) until at most the nodes the write quorum can do without
    are out; nothing else of the store waits to be encoded or sent meanwhile."""
    config = core.config
    holders = placement_rows[group]
    orders = order[group]

    def respill(b: int, row: npt.NDArray[np.int64], failed: frozenset[int]) -> int:
        return view.respill(orders[b].tolist(), row.tolist(), up, failed)

    round_ = PutRound(
        holders,
        up,
        min_write=config.min_write_shards,
        hedge_s=core.hedge_s(core.read_latency),
        timeout_s=config.timeout_s,
        respill=respill,
        redirected=redirected[group],
        redirect_limit=view.redirect_limit,
        max_silent=config.n - config.k,
    )
    core.count("shards_redirected", int(redirected[group].sum()))
    pump = Pump(core.transport, core.health, core.clock)
    sends = round_.start(core.clock())
    puts = [
        PumpedExchange(pump, send.ticket, send.node, Op.PUT, items, data, retain=retain)
        for send, (items, data) in zip(
            sends,
            batch.sections([(s.blocks, s.indices) for s in sends], expect[group]),
            strict=True,
        )
    ]
    if burst:
        # The burst returns once at most the holders a block may lack for a while are out
        # (n - k: the round hedges a silent holder by sending its shards on).
        pump.submit_plain_burst(puts, round_.next_wakeup(), min_left=max(0, config.n - config.k))
    else:
        for put in puts:
            pump.submit(put)
    return group, batch, round_, pump


def _drive_put(
    core: ClientCore,
    round_: PutRound,
    pump: Pump,
    batch: EncodedBatch,
    group_expect: Any,
    retain: Retain = NO_RETAIN,
    silent: set[int] | frozenset[int] = frozenset(),
) -> None:
    """Run a PUT round to its end; blocks a holder answered CONFLICT for are marked in
    ``round_.conflicts``. ``silent``: nodes an earlier round of the store found silent
    (this round sends their shards on at once)."""

    def send_on(sends: list[Send]) -> None:
        sections = batch.sections([(s.blocks, s.indices) for s in sends], group_expect)
        for send, (items, data) in zip(sends, sections, strict=True):
            pump.submit(
                PumpedExchange(pump, send.ticket, send.node, Op.PUT, items, data, retain=retain)
            )

    send_on(round_.begin(core.clock(), silent))
    while not round_.done:
        stored: list[tuple[int, npt.NDArray[np.bool_]]] = []
        for event in pump.wait(round_.next_wakeup()):
            if event.reply is None:
                send_on(round_.on_failure(event.ticket, core.clock()))
                continue
            statuses = event.reply.items["status"]
            conflicts = statuses == _CONFLICT
            if conflicts.any():
                core.count("write_conflicts", int(np.count_nonzero(conflicts)))
                sent = round_.sends.get(event.ticket)
                if sent is not None and len(sent.blocks) == len(statuses):
                    round_.conflicts[sent.blocks[conflicts]] = True
            stored.append((event.ticket, statuses == 0))
        if stored:
            round_.on_replies(stored, core.clock())
        send_on(round_.tick(core.clock()))
    # Counted from the round's start: a round that ran to its deadline marks the nodes that
    # never answered down, so the next store sends their shards elsewhere at once.
    pump.abandon(core.config.timeout_s, since=round_.started)
    core.count("node_errors", pump.node_errors)
    core.count("shards_redirected", round_.respilled)


def _rollback(
    core: ClientCore, batch: EncodedBatch, round_: PutRound, failed: npt.NDArray[np.bool_]
) -> None:
    """Delete the shards of failed blocks that did get stored (only this write's stripe),
    where their holders are now and where a hedged node stored them after all."""
    mask = round_.acks & failed[:, None]
    if not mask.any():
        return
    key_words = np.frombuffer(b"".join(batch.keys), dtype="V16")
    pump = Pump(core.transport, core.health, core.clock)
    on: dict[int, list[npt.NDArray[np.int64]]] = {}
    for node in np.unique(round_.holders[mask]).tolist():
        on.setdefault(int(node), []).append(np.nonzero(mask & (round_.holders == node))[0])
    for node, blocks in round_.late_acks:
        on.setdefault(node, []).append(blocks[failed[blocks]])
    for tickets, (node, parts) in enumerate(sorted(on.items()), start=1):
        b = np.unique(np.concatenate(parts))
        if not len(b):
            continue
        items = make_items(Op.DELETE, len(b), reply=False)
        items["key"] = key_words[b]
        items["stripe"] = batch.stripe_ids[b]
        items["index"] = NO_INDEX
        pump.submit(PumpedExchange(pump, -tickets, int(node), Op.DELETE, items))
    deadline = core.clock() + core.config.timeout_s
    while pump.outstanding and core.clock() < deadline:
        for event in pump.wait(deadline):
            if event.error is not None:
                log.warning("rollback of a failed write incomplete: %s", event.error)
    pump.abandon(core.config.timeout_s)


def touch_or_delete(
    core: ClientCore,
    op: Op,
    keys: list[BlockKey],
    cls: str,
    *,
    view: ClusterView | None = None,
    retain: Retain = NO_RETAIN,
) -> int:
    """Send TOUCH (or DELETE of every shard) for ``keys`` to every node that may hold some
    (the view's read rows); keys any node knew.

    It waits for every node's answer, but not for nodes that stopped answering: once each
    key waits on no more nodes than its stripe may lose (``n - k``), the rest get a
    hedge's time, not the timeout. A store of blocks that exist already touches them this
    way, and a holder that hangs must not hold that store up (a touch it misses leaves
    its shards to expire earlier; a delete it misses leaves its shards behind, which for
    10 + 2 are too few to read the block)."""
    if not keys:
        return 0
    view = view or core.view()
    rows = view.read_rows(keys, view.targets(keys, core.up_mask(view))[0])
    key_words = np.frombuffer(b"".join(keys), dtype="V16")
    up = core.node_up_mask(view=view)
    found = np.zeros(len(keys), bool)
    pump = Pump(core.transport, core.health, core.clock)
    blocks_of: dict[int, npt.NDArray[np.int64]] = {}
    waiting = np.zeros(len(keys), np.int64)  # per key: the nodes it still waits on
    for node in np.unique(rows).tolist():
        if node < 0 or not up[node]:
            continue
        blocks = np.nonzero((rows == node).any(axis=1))[0]
        waiting[blocks] += 1
        items = make_items(op, len(blocks), reply=False)
        items["key"] = key_words[blocks]
        if op is Op.DELETE:
            items["stripe"] = 0
            items["index"] = NO_INDEX
        ticket = len(blocks_of) + 1
        blocks_of[ticket] = blocks
        pump.submit(
            PumpedExchange(
                pump,
                ticket,
                int(node),
                op,
                items,
                traffic_class=cls if op is Op.TOUCH else "",
                retain=retain if op is Op.TOUCH else NO_RETAIN,
            )
        )
    deadline = core.clock() + core.config.timeout_s
    slack = core.config.n - core.config.k
    while pump.outstanding and core.clock() < deadline:
        for event in pump.wait(deadline):
            waiting[blocks_of[event.ticket]] -= 1
            if event.reply is not None:
                found[blocks_of[event.ticket][event.reply.items["status"] == 0]] = True
        if pump.outstanding and int(waiting.max()) <= slack:
            deadline = min(deadline, core.clock() + core.hedge_s(core.meta_latency))
            slack = -1  # the hedge's time is given once
    pump.abandon(core.config.timeout_s)
    return int(found.sum())


def _rows_of(
    rows: list[npt.NDArray[np.uint8]] | npt.NDArray[np.uint8], group: npt.NDArray[np.int64]
) -> list[npt.NDArray[np.uint8]] | npt.NDArray[np.uint8]:
    """The payload rows of ``group``: a view of the caller's array when they are a range of
    it (no copy, and the encoder needs no work per block), else a list of rows."""
    if isinstance(rows, np.ndarray) and len(group) and group[-1] - group[0] == len(group) - 1:
        return rows[int(group[0]) : int(group[-1]) + 1]
    return [rows[i] for i in group]


def _submit(
    pool: concurrent.futures.Executor, fn: Callable[[A], R], arg: A
) -> concurrent.futures.Future[R]:
    """``pool.submit(fn, arg)``; the client's encoder shut down by ``close()`` during the
    store is a ClosedError (it was a bare RuntimeError from the executor)."""
    try:
        return pool.submit(fn, arg)
    except RuntimeError as exc:
        raise ClosedError(f"the client was closed during the store ({exc})") from None
