"""Hedged, verified loads: a match's blocks into the caller's buffer, chunk by chunk.

A :class:`~kvcache.client.rounds.LoadRound` decides what to ask; GET replies
land in a :class:`~kvcache.client.assembly.LoadAssembly` over the caller's
``out``; each chunk is verified as soon as its asks are over, while later
chunks are still on the wire. A block that fails gets every holder not yet
asked (escalation) before it may end the prefix. What a load learned is put
to use without delaying it: shards found bad or missing are written back to
their holders (read repair), and a stripe that cannot be rebuilt from any
k of its shards is dropped from every holder, so any client's next store
rewrites the block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.client.assembly import BlockVerdict, LoadAssembly
from kvcache.client.core import ClientCore
from kvcache.client.driver import GetExchange, Pump, gather_abort, get_shards
from kvcache.client.plan import MatchResult
from kvcache.client.rounds import LoadRound, Send
from kvcache.client.transport import Exchange
from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey
from kvcache.shard import HEADER_BYTES, header_verdicts
from kvcache.wire import GET_REFRESHED, NO_INDEX, NO_RETAIN, Message, Op, Retain, make_items

__all__ = ["LoadResult", "load_keys"]

log = logging.getLogger(__name__)

#: Called with (first, stop) each time the verified prefix grows: blocks [first, stop) are ready.
OnReady = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load brought back: ``blocks`` leading blocks, verified.

    ``payloads[i]`` is a view of block ``i``'s bytes in the load's buffer
    (``out`` when given, else one the load allocated).
    """

    blocks: int
    tokens: int
    payloads: list[npt.NDArray[np.uint8]]
    bytes_loaded: int


def check_out(out: object, blocks: int, payload_len: int) -> npt.NDArray[np.uint8]:
    """``out`` if it can take ``blocks`` payloads, else ArgumentError (before any I/O)."""
    if not isinstance(out, np.ndarray):
        raise ArgumentError(f"out must be a numpy array, got {type(out).__name__}")
    if (
        out.dtype != np.uint8
        or out.ndim != 2
        or out.shape[0] < blocks
        or out.shape[1] != payload_len
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ArgumentError(
            f"out must be a writable, C-contiguous uint8 array of shape (>= {blocks}, "
            f"{payload_len}); got {out.dtype} {out.shape}"
        )
    return out


def load_keys(
    core: ClientCore,
    match: MatchResult,
    *,
    payload_len: int,
    out: npt.NDArray[np.uint8] | None = None,
    traffic_class: str | None = None,
    on_ready: OnReady | None = None,
    retain: Retain = NO_RETAIN,
    repair: bool = True,
) -> LoadResult:
    """Load the hit blocks of ``match``; stops at the first block that cannot be rebuilt.

    ``retain`` is the request's hint: its TTL goes with each GET (a pin cannot: the
    caller pins loaded blocks with a TOUCH). ``repair`` False: no read repair and no
    stripe dropped, whatever the config says (a check of a stripe before it is dropped)."""
    if not isinstance(match, MatchResult):
        raise ArgumentError(f"match must be a MatchResult, got {type(match).__name__}")
    if isinstance(payload_len, bool) or not isinstance(payload_len, int) or payload_len < 1:
        raise ArgumentError(f"payload_len must be a positive int, got {payload_len!r}")
    total = match.hit_blocks
    cls = core.traffic_class(traffic_class)
    if out is not None:
        buffer = check_out(out, total, payload_len)
    else:
        try:
            buffer = np.empty((total, payload_len), np.uint8)
        except (MemoryError, ValueError) as exc:
            raise ArgumentError(
                f"cannot allocate {total} blocks of payload_len {payload_len}: {exc}"
            ) from None
    if total == 0:
        return LoadResult(0, 0, [], 0)
    config = core.config
    keys = match.keys[:total]
    key_words = np.frombuffer(b"".join(keys), "V16")
    stripes = match.stripe[:total]
    assembly = LoadAssembly(
        key_words=key_words,
        stripes=stripes,
        out=buffer,
        k=config.k,
        n=config.n,
        payload_len=payload_len,
        codec=core.codec,
        scratch=core.scratch,
    )
    view = core.view()
    up = core.up_mask(view)
    placement_rows, _redirected, order = view.targets(keys, up)
    # A match stops listening once every block has k shards, so it may not know every
    # holder; where it does not, ask the node a writer with this view would have put the
    # shard on (the GET names the stripe, so a node without it just answers NOT_FOUND).
    guessed = match.holders[:total] < 0
    holders = np.where(guessed, placement_rows, match.holders[:total])
    # A guessed stand-in (the holder is down, and the match did not see the shard on the
    # node a writer would use instead) rarely has it: ask the known holders first.
    unlikely = guessed & (placement_rows != order[:, : placement_rows.shape[1]])
    hedge_s = core.hedge_s(core.read_latency)
    round_ = LoadRound(
        holders,
        core.node_up_mask(view=view),
        k=config.k,
        chunk_blocks=config.chunk_blocks(payload_len),
        window=config.window,
        hedge_s=hedge_s,
        timeout_s=config.timeout_s,
        unlikely=unlikely,
    )
    pump = Pump(core.transport, core.health, core.clock)
    sent: list[GetExchange] = []

    ask_retain = Retain(ttl_s=retain.ttl_s)

    def exchanges(sends: list[Send]) -> list[GetExchange]:
        # Every send's items in one array, and its shards cut from one array each.
        if not sends:
            return []
        blocks = np.concatenate([s.blocks for s in sends])
        indices = np.concatenate([s.indices for s in sends])
        items = make_items(Op.GET, len(blocks), reply=False)
        items["key"] = key_words[blocks]
        items["index"] = indices
        items["stripe"] = stripes[blocks]
        views, shards = get_shards(sends, items, blocks, indices)
        out = [
            GetExchange(pump, send, part, assembly, cls, ask_retain, shards=cut)
            for send, part, cut in zip(sends, views, shards, strict=True)
        ]
        sent.extend(out)
        return out

    def submit(sends: list[Send]) -> None:
        for exchange in exchanges(sends):
            pump.submit(exchange)

    # Per block: verified good, rebuilt, examined at all; shards found bad, where any.
    verified_good = np.zeros(total, bool)
    rebuilt = np.zeros(total, bool)
    examined = np.zeros(total, bool)
    bad: dict[int, tuple[int, ...]] = {}
    # Blocks whose expiry some holder moved on this hit (GET_REFRESHED): their shards not
    # asked for are refreshed after the load.
    refreshed = np.zeros(total, bool)
    escalated: set[int] = set()
    sealing: list[int] = []  # chunks over whose blocks a late reply is still landing
    # When each sealing chunk's wait for its late replies ends: a reply that started
    # landing and stalled (its holder descheduled or busy mid-send) is cut then, so a
    # slow holder costs a chunk at most a hedge time more, however many of its blocks
    # the holder serves (a placement group's: all of a 64-block call's).
    cut_at: dict[int, float] = {}
    end = total  # the first block known to fail ends the prefix
    good = 0
    try:
        # The first asks, one per node, go out and come back in one native burst (until the
        # hedge time at most); anything unusual carries on through the pump as usual.
        pump.submit_burst(exchanges(round_.start(core.clock())), round_.next_wakeup())
        while good < end:
            # What arrived together (a burst's replies, one per node) is handed over at once.
            wakeup = round_.next_wakeup()
            if cut_at:
                soonest = min(cut_at.values())
                wakeup = soonest if wakeup is None else min(wakeup, soonest)
            outcomes = [
                (event.ticket, None)
                if event.reply is None or not isinstance(event.exchange, GetExchange)
                else (event.ticket, _accept(assembly, event, refreshed))
                for event in pump.wait(wakeup)
            ]
            if outcomes:
                submit(round_.on_outcomes(outcomes, core.clock()))
            now = core.clock()
            submit(round_.tick(now))
            for chunk in [*sealing, *round_.ready_chunks()]:
                start, stop = round_.chunk_range(chunk)
                if start >= end:
                    if chunk in sealing:
                        sealing.remove(chunk)
                    cut_at.pop(chunk, None)
                    round_.finish_chunk(chunk)
                    continue
                # Late answers to abandoned asks must not write over what is checked: a
                # chunk with one still landing is verified when that one is in.
                span = np.arange(start, stop)
                if not assembly.seal(span):
                    if chunk not in sealing:
                        sealing.append(chunk)
                        cut_at[chunk] = now + hedge_s
                    elif now >= cut_at[chunk]:
                        cut_at[chunk] = now + hedge_s
                        cut = _cut_landings(pump, span)
                        core.count("landings_cut", cut)
                    continue
                if chunk in sealing:
                    sealing.remove(chunk)
                    cut_at.pop(chunk, None)
                latency = round_.latency(chunk)
                if chunk not in escalated and latency is not None:
                    core.read_latency.record(latency)
                todo = span[: max(0, min(stop, end) - start)]
                todo = todo[~verified_good[todo]]
                verdicts = assembly.verify_arrays(todo)
                verified_good[todo] = verdicts.good
                rebuilt[todo] = verdicts.rebuilt
                examined[todo] = True
                bad.update(verdicts.bad)
                failing = todo[~verdicts.good]
                if len(failing) and chunk not in escalated:
                    escalated.add(chunk)
                    sends = round_.escalate(chunk, failing, now)
                    if sends:
                        assembly.unseal(failing)
                        core.count("escalations")
                        submit(sends)
                        continue
                round_.finish_chunk(chunk)
                if len(failing):
                    end = min(end, int(failing[0]))
                    round_.stop_before(end)
                submit(round_.open_more(now))
            before = good
            if good < end:
                run = verified_good[good:end]
                good = end if run.all() else good + int(run.argmin())
            if on_ready is not None and good > before:
                on_ready(before, good)
            if round_.done and good < end:  # pragma: no cover - every chunk ends with verdicts
                log.error("load round ended with blocks %d..%d unverified", good, end)
                break
    finally:
        assembly.close(gather_abort(core.transport, [*pump.abandon(core.config.timeout_s), *sent]))
        for exchange in sent:
            exchange.detach()
    try:
        if refreshed[:good].any():
            _refresh_unasked(
                core,
                key_words,
                np.where(unlikely, -1, holders),
                round_.sent,
                refreshed[:good],
                core.node_up_mask(view=view),
                cls,
                retain,
            )
        core.count("node_errors", pump.node_errors)
        core.count("hedges", round_.hedges)
        core.count("blocks_loaded", good)
        core.count("blocks_rebuilt", int(np.count_nonzero(rebuilt[:good])))
        core.count("scratch_reused", int(assembly.scratch_reused))
        # Rejected shards never count as received, so they are never among a verdict's bad ones.
        core.count(
            "bad_shards_found",
            int(assembly.rejected[:good].sum()) + sum(len(v) for b, v in bad.items() if b < good),
        )
        if core.config.read_repair and repair:
            if (
                end < total
                and examined[end]
                and _broken_when_loaded_alone(
                    core, match, end, payload_len, cls, caller_buffer=out is not None
                )
            ):
                rows = view.read_rows([keys[end]], placement_rows[end : end + 1])
                _drop_broken(core, assembly, match, rows, end)
            past = end + 1 + np.flatnonzero(examined[end + 1 :] & ~verified_good[end + 1 :])
            if len(past):
                _mark_past(core, assembly, match, past)
            gone = core.gone_mask(view)
            _repair(core, assembly, match, placement_rows, order, gone, rebuilt, bad, good)
    finally:
        assembly.release()
    return LoadResult(
        blocks=good,
        tokens=good * match.tokens_per_block,
        payloads=list(buffer[:good]),
        bytes_loaded=good * payload_len,
    )


def _cut_landings(pump: Pump, span: npt.NDArray[np.int64]) -> int:
    """Cut the connections of the exchanges still landing in ``span`` (the chunk was
    decided without them, and they write into its blocks); returns how many. Each fails
    at once; its node is not marked down (:meth:`Pump.cut`)."""
    lo, hi = int(span[0]), int(span[-1]) + 1
    cut = 0
    for exchange in list(pump.outstanding.values()):
        if isinstance(exchange, GetExchange) and exchange.landing_asked:
            blocks = exchange.send.blocks
            if len(blocks) and ((blocks >= lo) & (blocks < hi)).any():
                pump.cut(exchange)
                cut += 1
    return cut


def _accept(
    assembly: LoadAssembly, event: object, refreshed: npt.NDArray[np.bool_]
) -> npt.NDArray[np.bool_]:
    exchange: GetExchange = event.exchange  # type: ignore[attr-defined]
    reply: Message = event.reply  # type: ignore[attr-defined]
    send = exchange.send
    items = reply.items
    if len(items) != len(send.blocks):
        return np.zeros(len(send.blocks), bool)
    # A native burst OR-ed the items' flags already: per exchange, no numpy step unless set.
    if exchange.accepted is None or exchange.item_flags & GET_REFRESHED:
        flags = items["flags"]
        if flags.any():
            refreshed[send.blocks[(flags & GET_REFRESHED) != 0]] = True
    if exchange.accepted is not None:  # landed and accepted by a native burst
        return exchange.accepted
    if reply.header.data_len and not exchange.landed_in_assembly:
        # Its shards went to scratch (the load was closing): only its NOT_FOUNDs count.
        statuses = np.where(items["status"] == 0, 255, items["status"]).astype(np.uint8)
        return assembly.accept(
            send.blocks, send.indices, statuses, items["length"].astype(np.int64)
        )
    blocks, indices = exchange.shards
    return assembly.accept_reply(
        blocks, indices, exchange.shards_at, items, exchange.native_landing
    )


def _refresh_unasked(
    core: ClientCore,
    key_words: npt.NDArray[np.void],
    holders: npt.NDArray[np.int64],
    sent: npt.NDArray[np.bool_],
    refreshed: npt.NDArray[np.bool_],
    node_up: npt.NDArray[np.bool_],
    cls: str,
    retain: Retain,
) -> None:
    """TOUCH, without waiting, the holders of the shards this load never asked for, of the
    blocks whose expiry a holder moved on this hit (``refreshed``, one per loaded block).

    A load reads k + 1 of a block's n shards, and a daemon slides the expiry only of the
    shards it is asked for: the others kept the expiry of the block's last write, so a
    block read every hour for days still lost those shards (its redundancy) one TTL after
    it was written, and under capacity pressure the daemons evicted a block's shards in
    different orders. A daemon flags a hit that moved an expiry (at most once per touch
    resolution per shard), so this runs for a block about once a minute at most.

    Only holders the load never sent an ask (``sent``): one it asked and gave up on is
    slow or stopped, and its own GET carries the slide once it answers. Not the guessed
    stand-ins of down holders (``holders`` is -1 there), which rarely hold the shard, nor
    nodes down now. Not waited for: a load pays no round trip for it, and a holder that is
    slow delays nothing (its TOUCH waits on its connection, as a read repair's PUT does).
    """
    rows = holders[: len(refreshed)]
    blocks, index = np.nonzero(refreshed[:, None] & ~sent[: len(refreshed)] & (rows >= 0))
    if not len(blocks):
        return
    nodes = rows[blocks, index]
    keep = node_up[nodes]
    blocks, nodes = blocks[keep], nodes[keep]
    for node in np.unique(nodes).tolist():
        mine = np.unique(blocks[nodes == node])
        items = make_items(Op.TOUCH, len(mine), reply=False)
        items["key"] = key_words[mine]
        core.transport.submit(
            _Background(
                core,
                "blocks_refreshed",
                node,
                Op.TOUCH,
                items,
                traffic_class=cls,
                retain=Retain(ttl_s=retain.ttl_s),
            )
        )


class _Background(Exchange):
    """A repair or drop sent without waiting; only its success is counted."""

    def __init__(self, core: ClientCore, counter: str, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._core = core
        self._counter = counter

    def finish(self, reply: Message | None, error: BaseException | None) -> None:
        if reply is not None:
            self._core.count(self._counter, int(np.count_nonzero(reply.items["status"] == 0)))


def _holder(match: MatchResult, placement_rows: npt.NDArray[np.int64], b: int, i: int) -> int:
    node = int(match.holders[b, i])
    return node if node >= 0 else int(placement_rows[b, i])


def _repair(
    core: ClientCore,
    assembly: LoadAssembly,
    match: MatchResult,
    placement_rows: npt.NDArray[np.int64],
    order: npt.NDArray[np.int64],
    gone: npt.NDArray[np.bool_],
    rebuilt: npt.NDArray[np.bool_],
    bad: dict[int, tuple[int, ...]],
    good: int,
) -> None:
    """Write back shards of verified blocks that a holder had bad or did not have.

    Onto the shard's holder under the current map while that holder is up. The shard
    of a holder that is down goes to its stand-in (the node a writer would use) only
    once the holder is ``gone`` (:meth:`ClientCore.gone_mask`: down for
    ``repair_down_after_s``, or dead by the membership source), as Ceph waits for
    "down" to become "out": a node down for a moment comes back with its shards, and
    copying every block a load touches onto stand-ins cost the first loads after a
    node was marked down about half their time, for copies nobody needed once it was
    back.
    """
    per_node: dict[int, list[tuple[int, int, bytes, bytes]]] = {}
    n = placement_rows.shape[1]
    unseen = match.holders[:good] < 0
    own = order[:good, :n]
    holder_gone = (own >= 0) & gone[np.maximum(own, 0)]
    # A shard found where the match saw it is put back there; otherwise on its holder,
    # or on the holder's stand-in once the holder is gone.
    allowed = ~unseen | (placement_rows[:good] == own) | holder_gone
    # Besides what the load found bad or missing: a gone holder's shards the match saw
    # nowhere (their stand-ins may not even have been asked: likely holders go first).
    missing = assembly.not_found[:good] | (unseen & holder_gone)
    # Only shards a repair may write make a block worth examining: with a holder down
    # but not yet gone, its stand-in answers NOT_FOUND for every block, and examining
    # each of those blocks (a hash and a header check apiece) for nothing it may repair
    # doubled a degraded load's client CPU.
    repairable = (missing | assembly.rejected[:good]) & allowed
    candidates = set(np.flatnonzero(repairable.any(axis=1)).tolist())
    candidates.update(b for b in bad if b < good)
    for b in sorted(candidates):
        verdict = BlockVerdict(True, bool(rebuilt[b]), bad.get(b, ()))
        wanted = assembly.bad_shards(b, verdict) | set(np.flatnonzero(missing[b]).tolist())
        wanted = {i for i in wanted if allowed[b, i]}
        if not wanted:
            continue
        for shard in assembly.repair_shards(b, tuple(sorted(wanted))):
            node = _holder(match, placement_rows, b, shard.index)
            if node < 0:
                continue
            per_node.setdefault(node, []).append((b, shard.index, shard.header, shard.body))
    for node, shards in per_node.items():
        items = make_items(Op.PUT, len(shards), reply=False)
        items["key"] = [assembly.key_words[b] for b, _i, _h, _d in shards]
        items["index"] = [i for _b, i, _h, _d in shards]
        items["length"] = [HEADER_BYTES + len(body) for *_rest, body in shards]
        data = [part for _b, _i, header, body in shards for part in (header, body)]
        core.transport.submit(_Background(core, "shards_repaired", node, Op.PUT, items, data))


def _stored_layout(assembly: LoadAssembly, b: int, stripe: int) -> tuple[int, int, int] | None:
    """The (k, m, payload length) block ``b``'s shards were stored with, when it is not the
    one this load asked for and nothing else is wrong with them: as many of its rejected
    shards as that layout's k, or more, carry headers that pass every check, name its key,
    ``stripe`` and the index asked, and agree on one other layout. Then the reader is not
    the block's (a caller's payload_len or KV layout, or a client of other erasure
    parameters: 8 + 4 shards are indices 0..11 too, which no answer of a HAS tells from
    10 + 2 ones), and it must not be dropped: a reader of its layout reads it whole. None
    otherwise (damage, records of another key or stripe)."""
    rejected = np.flatnonzero(assembly.rejected[b])
    if not len(rejected):
        return None
    # A record of a shard's length landed its header in the headers table; one of another
    # length, in the odd headers table (kv_landing_segments).
    odd = assembly.odd_headers[b, rejected]
    headers = np.where(odd["magic"] != b"", odd, assembly.headers[b, rejected])
    ks = headers["k"].astype(np.int64)
    ms = headers["m"].astype(np.int64)
    lengths = headers["payload_len"].astype(np.int64)
    intact = (
        header_verdicts(headers)
        & (headers["block_key"] == assembly.key_words[b])
        & (headers["stripe_id"] == np.uint64(stripe))
        & (headers["shard_index"] == rejected)
        & ((ks != assembly.k) | (ms != assembly.m) | (lengths != assembly.payload_len))
    )
    if not intact.any():
        return None
    layouts, counts = np.unique(
        np.stack([ks[intact], ms[intact], lengths[intact]], axis=1), axis=0, return_counts=True
    )
    best = int(np.argmax(counts))
    k, m, length = (int(x) for x in layouts[best])
    return (k, m, length) if counts[best] >= k else None


def _leave_other_erasure(
    core: ClientCore,
    stripes: list[tuple[BlockKey, int]],
    layout: tuple[int, int],
    assembly: LoadAssembly,
) -> None:
    """Blocks whose ``stripes`` were stored with another client's erasure parameters
    (``layout``: k and m): readable by such a client, never by this one. They are left as
    they are, and marked so this client's stores no longer count them as stored: they
    replace them once their shards are older than replace_after_s, as they replace a
    wider layout's stripe (docs/client.md)."""
    core.count("blocks_other_erasure", len(stripes))
    for key, stripe in stripes:
        core.suspect(key, stripe)
    log.warning(
        "block %s%s: stored as %d + %d shards, this client reads %d + %d; left as it is "
        "(clients that share a namespace should share k and m)",
        stripes[0][0].hex(),
        f" and {len(stripes) - 1} more" if len(stripes) > 1 else "",
        *layout,
        assembly.k,
        assembly.m,
    )


def _mark_past(
    core: ClientCore, assembly: LoadAssembly, match: MatchResult, failed: npt.NDArray[np.int64]
) -> None:
    """Mark the blocks of ``failed`` (examined, failed, past the block that ended the load,
    which :func:`_drop_broken` handled) so this client's next store rewrites them at once
    instead of touching them, one a load: those stored with another erasure layout (as
    :func:`_leave_other_erasure` does), and damaged ones (k shards or more, or more than m
    not the shard asked for). They are only marked, not dropped: a caller that wrote into
    ``out`` during the load can make good stripes fail here, and a rewrite of a good block
    costs a PUT, a drop the block."""
    found: dict[tuple[int, int], list[tuple[BlockKey, int]]] = {}
    for b in failed.tolist():
        stripe = int(assembly.stripes[b])
        if not stripe:
            continue
        other = _stored_layout(assembly, b, stripe)
        if other is not None:
            if other[:2] != (assembly.k, assembly.m):
                found.setdefault(other[:2], []).append((match.keys[b], stripe))
            continue  # another payload length: the reader's mistake, not the block's
        damaged = (
            int(assembly.got[b].sum()) >= assembly.k or int(assembly.rejected[b].sum()) > assembly.m
        )
        if damaged:
            core.suspect(match.keys[b], stripe)
    for layout, stripes in found.items():
        _leave_other_erasure(core, stripes, layout, assembly)


def _broken_when_loaded_alone(
    core: ClientCore,
    match: MatchResult,
    b: int,
    payload_len: int,
    traffic_class: str,
    *,
    caller_buffer: bool,
) -> bool:
    """Whether block ``b``, which did not verify, also fails a load of its own into memory
    only this call holds, before its stripe is dropped from every holder. The data shards
    of a load land in the caller's ``out``: a caller that wrote into it meanwhile (an
    asyncio task cancelled and its buffer reused) made healthy stripes fail to verify, and
    they were dropped cluster-wide. Loads into this client's own buffers need no check."""
    if not caller_buffer:
        return True
    one = MatchResult(
        keys=[match.keys[b]],
        hit_blocks=1,
        tokens_per_block=match.tokens_per_block,
        stripe=match.stripe[b : b + 1].copy(),
        holders=match.holders[b : b + 1].copy(),
        best_count=match.best_count[b : b + 1].copy(),
    )
    alone = load_keys(core, one, payload_len=payload_len, traffic_class=traffic_class, repair=False)
    if alone.blocks == 0:
        return True
    core.count("loads_buffer_changed")
    log.warning(
        "block %s did not verify in the caller's buffer but did alone: the buffer was "
        "written during the load (its blocks from there on are not returned); the stripe "
        "is kept",
        match.keys[b].hex(),
    )
    return False


def _drop_broken(
    core: ClientCore,
    assembly: LoadAssembly,
    match: MatchResult,
    placement_rows: npt.NDArray[np.int64],
    b: int,
) -> None:
    """Block ``b`` had k shards or more and no k of them rebuild it, or more than m of its
    shards are not the shard asked for (records of another key, of another stripe, or of
    another erasure layout): its stripe can never be read, yet a match sees it whole and a
    store would only touch it. It is dropped, so any client's next store rewrites it.
    ``placement_rows`` is one row: every node that may hold a shard of it."""
    unreadable = int(assembly.rejected[b].sum()) > assembly.m
    if int(assembly.got[b].sum()) < assembly.k and not unreadable:
        return  # short of shards, not damaged: the next store rewrites it anyway
    stripe = int(assembly.stripes[b])
    if stripe == 0:
        return  # no shard arrived to name the stripe: nothing to drop
    other = _stored_layout(assembly, b, stripe)
    if other is not None:
        k, m, other_length = other
        if (k, m) != (assembly.k, assembly.m):
            _leave_other_erasure(core, [(match.keys[b], stripe)], (k, m), assembly)
            return
        core.count("blocks_other_payload_len")
        log.warning(
            "block %s: its shards hold %d-byte payloads and this load asked for %d (a "
            "payload_len or layout that is not the one it was stored with); left as it is",
            match.keys[b].hex(),
            other_length,
            assembly.payload_len,
        )
        return
    core.count("blocks_corrupt")
    key = match.keys[b]
    log.warning(
        "block %s: stripe %016x cannot be read (%d of %d shards not the ones asked for, "
        "no %d of the rest verify); dropping it",
        key.hex(),
        stripe,
        int(assembly.rejected[b].sum()),
        assembly.n,
        assembly.k,
    )
    core.suspect(key, stripe)
    nodes = {int(x) for x in np.concatenate([match.holders[b], placement_rows[0]]) if x >= 0}
    for node in nodes:
        items = make_items(Op.DELETE, 1, reply=False)
        items["key"] = assembly.key_words[b]
        items["stripe"] = stripe
        items["index"] = NO_INDEX
        core.transport.submit(_Background(core, "stripes_dropped", node, Op.DELETE, items))
