"""Reading: prefix match (one HAS per node) and hedged, verified loads (one GET per node)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.client.base import ClientBase
from kvcache.client.plan import HeldShards, MatchResult, StripeAssembly, match_from_held, plan_reads
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.shard import shard_len_for
from kvcache.wire import Header, Message, Op, make_items

__all__ = ["LoadResult", "ReadOps"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load brought back: ``blocks`` leading blocks, verified.

    ``payloads[i]`` is a zero-copy view of block ``i``'s bytes (valid as long as
    this result lives); when ``out`` was given, the bytes were also copied there.
    """

    blocks: int
    tokens: int
    payloads: list[npt.NDArray[np.uint8]]
    bytes_loaded: int


class ReadOps(ClientBase):
    """match_prefix / match_keys / load / load_keys / load_prefix."""

    # ------------------------------------------------------------------ match

    async def match_prefix(
        self,
        namespace: Namespace,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        max_blocks: int | None = None,
    ) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` (one batched HAS per node)."""
        keys = block_keys(namespace, tokens, max_blocks=max_blocks)
        return await self.match_keys(keys, tokens_per_block=namespace.tokens_per_block)

    async def match_keys(
        self, keys: Sequence[BlockKey], *, tokens_per_block: int = 1, settle_at: int | None = None
    ) -> MatchResult:
        """Like :meth:`match_prefix` for block keys computed by the caller (e.g. an engine's own
        prefix hashes mapped to keys); ``keys`` must be a prefix chain, first block first.

        Stragglers are not waited for once every block has ``settle_at`` shards of
        one stripe (default k) or cannot reach that many: a store asks with
        ``min_write_shards`` to learn which blocks are stored with a full quorum.
        """
        keys = list(keys)
        k, n = self.config.k, self.config.n
        settle = k if settle_at is None else settle_at
        if not keys:
            return match_from_held(keys, [], k=k, n=n, tokens_per_block=tokens_per_block)
        rows, per_node = self._keys_and_holders(keys)
        up = self._node_up_mask(rows, settle)
        asked = [node for node in per_node if up[node]]
        held = await self._has_round(keys, rows, per_node, asked, settle)
        skipped = [node for node in per_node if not up[node]]
        if skipped:
            # Nodes marked down were skipped; if some block fell short of ``settle`` and
            # the skipped nodes could make up the difference, ask them now (their probe).
            best = match_from_held(keys, held, k=k, n=n, tokens_per_block=1).best_count
            could = np.zeros(len(keys), np.int64)
            for node in skipped:
                could += (rows == node).sum(axis=1)
            if ((best < settle) & (best + could >= settle)).any():
                held += await self._has_round(keys, rows, per_node, skipped, settle, record=False)
        return match_from_held(keys, held, k=k, n=n, tokens_per_block=tokens_per_block)

    async def _has_round(
        self,
        keys: list[BlockKey],
        rows: npt.NDArray[np.int64],
        per_node: dict[int, npt.NDArray[np.int64]],
        nodes: Sequence[int],
        settle: int,
        *,
        record: bool = True,
    ) -> list[HeldShards]:
        """One batched HAS to each of ``nodes``; waits as long as an answer can still matter."""
        k, n = self.config.k, self.config.n
        key_words = np.frombuffer(b"".join(keys), dtype="V16")
        # Shards per block that nodes still to answer may hold: once no block's
        # outcome can change, stragglers are not waited for.
        unanswered = np.zeros(len(keys), np.int64)
        tasks: dict[asyncio.Task[Message], tuple[int, npt.NDArray[np.int64]]] = {}
        for node in nodes:
            blocks = per_node[node]
            items = make_items(Op.HAS, len(blocks), reply=False)
            items["key"] = key_words[blocks]
            header = Header(op=Op.HAS, request_id=0, count=len(blocks))
            tasks[self._spawn(self._call(node, header, items))] = (node, blocks)
            unanswered += (rows == node).sum(axis=1)
        held: list[HeldShards] = []
        started = self._clock()
        hedge_at = started + self._hedge_s(self.meta_latency)
        deadline = started + self.config.timeout_s
        pending = set(tasks)
        answered = 0
        while pending:
            now = self._clock()
            # Everyone gets until the hedge deadline; after it, k answers are enough.
            if now >= deadline or (now >= hedge_at and answered >= k):
                break
            if answered >= k:
                best = match_from_held(keys, held, k=k, n=n, tokens_per_block=1).best_count
                if ((best >= settle) | (best + unanswered < settle)).all():
                    break
            wake = hedge_at if now < hedge_at else deadline
            done, pending = await asyncio.wait(
                pending, timeout=wake - now, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                node, blocks = tasks[task]
                unanswered -= (rows == node).sum(axis=1)
                if task.cancelled() or task.exception() is not None:
                    continue
                recs = task.result().items
                answered += 1
                ordinal = recs["ordinal"].astype(np.int64)
                valid = ordinal < len(blocks)
                held.append(
                    HeldShards(
                        node=node,
                        ordinal=blocks[ordinal[valid]],
                        index=recs["index"][valid].astype(np.int64),
                        stripe=recs["stripe"][valid].astype(np.uint64),
                    )
                )
        if record and not pending:
            self.meta_latency.record(self._clock() - started)
        return held

    # ------------------------------------------------------------------ load

    async def load(
        self,
        namespace: Namespace,
        match: MatchResult,
        *,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
    ) -> LoadResult:
        """Load the hit blocks of ``match``; stops at the first block that cannot be rebuilt.

        ``out``, if given, is a (blocks, payload_bytes) uint8 array the verified
        bytes are copied into. A hit refreshes the blocks' retention under
        ``traffic_class``. Wrong bytes are never returned.
        """
        return await self.load_keys(
            match,
            payload_len=namespace.layout.payload_bytes,
            out=out,
            traffic_class=traffic_class,
        )

    async def load_keys(
        self,
        match: MatchResult,
        *,
        payload_len: int,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
    ) -> LoadResult:
        """:meth:`load` for blocks of ``payload_len`` bytes named by ``match`` alone."""
        total = match.hit_blocks
        if out is not None and (
            out.dtype != np.uint8
            or out.ndim != 2
            or out.shape[0] < total
            or out.shape[1] != payload_len
        ):
            raise ConfigError(f"out must be a uint8 array of shape (>= {total}, {payload_len})")
        cls = self._check_class(traffic_class or self.config.traffic_class)
        payloads: list[npt.NDArray[np.uint8]] = []
        step = self.config.max_batch_blocks
        loaded = 0
        for start in range(0, total, step):
            stop = min(total, start + step)
            asm = await self._load_batch(match, start, stop, payload_len, cls)
            good = asm.finish(self.codec)
            if asm.corrupt >= 0:
                # Enough shards but wrong bytes: the next store must rewrite this block
                # rather than trust its shard count and merely touch it.
                self.counters["blocks_corrupt"] += 1
                self.suspect(match.keys[start + asm.corrupt])
            for b in range(good):
                view = asm.payload(b)
                if out is not None:
                    out[start + b] = view
                payloads.append(view)
            self.counters["blocks_rebuilt"] += int(
                (~asm.got[:good, : self.config.k].all(axis=1)).sum()
            )
            loaded += good
            if good < stop - start:
                break
        self.counters["blocks_loaded"] += loaded
        return LoadResult(
            blocks=loaded,
            tokens=loaded * match.tokens_per_block,
            payloads=payloads,
            bytes_loaded=loaded * payload_len,
        )

    async def load_prefix(
        self,
        namespace: Namespace,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
    ) -> LoadResult:
        """Match and load in one call."""
        match = await self.match_prefix(namespace, tokens)
        return await self.load(namespace, match, out=out, traffic_class=traffic_class)

    async def _load_batch(
        self, match: MatchResult, start: int, stop: int, payload_len: int, cls: str
    ) -> StripeAssembly:
        k, n = self.config.k, self.config.n
        keys = match.keys[start:stop]
        asm = StripeAssembly(
            keys,
            match.stripe[start:stop],
            k=k,
            n=n,
            payload_len=payload_len,
            shard_len=shard_len_for(payload_len, k),
        )
        holders = match.holders[start:stop]
        plan = plan_reads(holders, self._node_up_mask(), k=k)
        key_words = asm.key_words
        started = self._clock()
        hedge_at = started + self._hedge_s(self.read_latency)
        deadline = started + self.config.timeout_s

        def send(
            node: int, blocks: npt.NDArray[np.int64], idx: npt.NDArray[np.int64]
        ) -> asyncio.Task[Message]:
            items = make_items(Op.GET, len(blocks), reply=False)
            items["key"] = key_words[blocks]
            items["index"] = idx
            header = Header(op=Op.GET, request_id=0, count=len(blocks), traffic_class=cls)
            task = self._spawn(self._call(node, header, items))
            requests[task] = (blocks, idx)
            return task

        requests: dict[
            asyncio.Task[Message], tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
        ] = {}
        pending = {send(node, blocks, idx) for node, blocks, idx in plan.first}
        hedged = False
        while True:
            complete = asm.complete()
            if complete.all():
                self.read_latency.record(self._clock() - started)
                break
            now = self._clock()
            if not hedged and (now >= hedge_at or not pending):
                hedged = True
                for node, blocks, idx in plan.later:
                    want = ~complete[blocks]
                    if want.any():
                        self.counters["hedges"] += 1
                        pending.add(send(node, blocks[want], idx[want]))
                continue
            if not pending or now >= deadline:
                break
            wake = hedge_at if not hedged else deadline
            done, pending = await asyncio.wait(
                pending, timeout=max(0.0, wake - now), return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task.cancelled() or task.exception() is not None:
                    continue
                blocks, idx = requests[task]
                reply = task.result()
                asm.add(blocks, idx, reply.items["status"], reply.data)
        return asm
