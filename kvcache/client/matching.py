"""Prefix match: which leading blocks of a prompt are stored, and where (one HAS per node).

The nodes asked per key are :meth:`~kvcache.client.view.ClusterView.read_rows`:
where a writer with this client's view would have put each shard, the
holders that are down, and holders under recently replaced maps, so a shard
is found wherever it was written while the map or a node was changing.

:func:`match_with_directory` asks the same question with ``HAS_DIR`` instead
of ``HAS``: each node also answers the SWA holder records it keeps for the
asked keys (``kvcache.server.swa_directory``), so an engine learns which
worker holds a sliding-window state in the round trip that matches the prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.client.core import ClientCore
from kvcache.client.driver import Pump, PumpedExchange
from kvcache.client.plan import HeldShards, MatchResult, best_counts, match_from_held
from kvcache.client.rounds import HasRound
from kvcache.client.view import ClusterView
from kvcache.errors import NodeTimeoutError
from kvcache.keys import BlockKey
from kvcache.wire import Op, make_items

__all__ = ["DirectoryAnswer", "held_shards", "match_keys", "match_with_directory"]

#: One node's directory answer: the block each request item asked about, and the raw
#: records (``kvcache.wire.DIR_ANSWER_DTYPE``; parsed by ``kvcache.swa_local.protocol``).
DirectoryAnswer = tuple[npt.NDArray[np.int64], memoryview]

log = logging.getLogger(__name__)

#: Most keys one HAS request carries (a daemon's default ``max_items`` is 16,384).
MAX_HAS_KEYS = 8192


def match_keys(
    core: ClientCore,
    keys: list[BlockKey],
    *,
    tokens_per_block: int = 1,
    settle_at: int | None = None,
) -> MatchResult:
    """The longest stored prefix of ``keys`` (a prefix chain, first block first)."""
    k, n = core.config.k, core.config.n
    held = held_shards(core, keys, settle=k if settle_at is None else settle_at)
    return match_from_held(keys, held, k=k, n=n, tokens_per_block=tokens_per_block)


def match_with_directory(
    core: ClientCore, keys: list[BlockKey], *, tokens_per_block: int = 1
) -> tuple[MatchResult, list[DirectoryAnswer]]:
    """:func:`match_keys`, plus every answering node's SWA holder records for ``keys``."""
    answers: list[DirectoryAnswer] = []
    held = held_shards(core, keys, settle=core.config.k, directory=answers)
    match = match_from_held(
        keys, held, k=core.config.k, n=core.config.n, tokens_per_block=tokens_per_block
    )
    return match, answers


def held_shards(
    core: ClientCore,
    keys: list[BlockKey],
    *,
    settle: int,
    directory: list[DirectoryAnswer] | None = None,
    view: ClusterView | None = None,
    rows: npt.NDArray[np.int64] | None = None,
    complete: bool = False,
) -> list[HeldShards]:
    """Every node's HAS answer for ``keys`` (nodes marked down are asked only when needed).

    ``rows`` are the nodes to ask per key (default: the view's read rows).
    Stragglers are not waited for once every block has ``settle`` shards of one
    stripe or cannot reach that many. With ``directory``, the nodes are asked
    ``HAS_DIR`` and their SWA holder records are appended to it. With ``complete``
    every node is waited for until the hedge time (a store replacing leftovers).
    """
    if not keys:
        return []
    view = view or core.view()
    if rows is None:
        rows = view.read_rows(keys, view.targets(keys, core.up_mask(view))[0])
    if len(keys) > MAX_HAS_KEYS:
        # A daemon takes at most ``max_items`` items a request (16,384 by default): a
        # longer prompt (a 1M-token one is 7,813 blocks of 128 tokens; 18,725 of a 2 GiB
        # load of 112 KiB blocks) is asked in segments, each with its ordinals shifted.
        held: list[HeldShards] = []
        for start in range(0, len(keys), MAX_HAS_KEYS):
            stop = min(len(keys), start + MAX_HAS_KEYS)
            part: list[DirectoryAnswer] | None = [] if directory is not None else None
            for h in held_shards(
                core, keys[start:stop], settle=settle, directory=part, view=view,
                rows=rows[start:stop], complete=complete,
            ):  # fmt: skip
                held.append(HeldShards(h.node, h.ordinal + start, h.index, h.stripe))
            if directory is not None and part is not None:
                directory += [(blocks + start, data) for blocks, data in part]
        return held
    up = core.node_up_mask(rows, settle, view)
    nodes = [int(node) for node in np.unique(rows) if node >= 0]
    cap = view.node_cap
    refused: list[int] = []
    held = _has_round(
        core,
        keys,
        rows,
        [nd for nd in nodes if up[nd]],
        settle,
        record=True,
        directory=directory,
        node_cap=cap,
        refused=refused,
        complete=complete,
    )
    skipped = [nd for nd in nodes if not up[nd] and view.live[nd]]
    if skipped:
        # Nodes marked down were skipped; if some block fell short of ``settle`` and
        # they could make up the difference, ask them now (their probe).
        best = best_counts(held, len(keys), n=core.config.n)
        could = np.zeros(len(keys), np.int64)
        for node in skipped:
            listed = (rows == node).sum(axis=1)
            could += np.where(listed > 0, np.maximum(listed, cap), 0)
        if ((best < settle) & (best + could >= settle)).any():
            held += _has_round(
                core, keys, rows, skipped, settle, record=False, directory=directory,
                node_cap=cap, refused=refused,
            )  # fmt: skip
    answered = {h.node for h in held}
    again = sorted(set(refused) - answered)
    if again and (best_counts(held, len(keys), n=core.config.n) < settle).any():
        # A node that failed at once rather than timing out, and answered nothing: most
        # often a daemon restarted since this client last used its connections, which
        # then fail on their first request (bench/membership.py counted 24 of 320 blocks
        # short this way, right after a repair). Asked once more, on new connections.
        log.debug("HAS: asking %d node(s) again after a failed request", len(again))
        held += _has_round(
            core, keys, rows, again, settle, record=False, directory=directory, node_cap=cap
        )
    return held


def _has_round(
    core: ClientCore,
    keys: Sequence[BlockKey],
    rows: npt.NDArray[np.int64],
    nodes: list[int],
    settle: int,
    *,
    record: bool,
    directory: list[DirectoryAnswer] | None = None,
    node_cap: int = 1,
    refused: list[int] | None = None,
    complete: bool = False,
) -> list[HeldShards]:
    """One HAS round over ``nodes``; nodes whose request failed other than by a timeout are
    appended to ``refused``."""
    config = core.config
    op = Op.HAS if directory is None else Op.HAS_DIR
    round_ = HasRound(
        rows,
        nodes,
        k=config.k,
        n=config.n,
        settle=settle,
        hedge_s=core.hedge_s(core.meta_latency),
        timeout_s=config.timeout_s,
        node_cap=node_cap,
        complete=complete,
    )
    pump = Pump(core.transport, core.health, core.clock)
    key_words = np.frombuffer(b"".join(keys), dtype="V16")
    started = core.clock()
    asks = []
    for send in round_.start(started):
        items = make_items(op, len(send.blocks), reply=False)
        items["key"] = key_words[send.blocks]
        asks.append(PumpedExchange(pump, send.ticket, send.node, op, items))
    if op is Op.HAS:
        # One native burst until at most the nodes the round can do without are out (a
        # match needs k of a block's n shards; a store's check, all it asks for).
        pump.submit_plain_burst(
            asks, round_.next_wakeup(), min_left=0 if complete else max(0, config.n - settle)
        )
    else:
        for ask in asks:
            pump.submit(ask)
    while not round_.done:
        # What arrived together is handed to the round at once (one look at the counts).
        answers: list[tuple[int, tuple[Any, Any, Any] | None]] = []
        for event in pump.wait(round_.next_wakeup()):
            if event.reply is None:
                answers.append((event.ticket, None))
                if refused is not None and not isinstance(
                    event.error, TimeoutError | NodeTimeoutError
                ):
                    refused.append(event.exchange.node)
                continue
            recs = event.reply.items
            asked = round_.sends.get(event.ticket)
            if directory is not None and asked is not None and event.reply.data.nbytes:
                directory.append((asked.blocks, event.reply.data))
            answers.append(
                (event.ticket, (recs["ordinal"].astype(np.int64), recs["index"].astype(np.int64),
                                recs["stripe"].astype(np.uint64)))
            )  # fmt: skip
        if answers:
            round_.on_answers(answers, core.clock())
        round_.tick(core.clock())
    if record and not round_.pending:
        core.meta_latency.record(core.clock() - started)
    pump.abandon(core.config.timeout_s)
    core.count("node_errors", pump.node_errors)
    return round_.held_shards()
