"""The async client: prefix match, hedged loads and quorum stores against a cluster.

All network work runs on one asyncio loop; ``kvcache.client.sync.Client`` is the
thin blocking façade over it. Pure planning and assembly live in
``kvcache.client.plan`` and ``kvcache.client.writes``; this module only moves
messages and keeps node health.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

from kvcache.client.config import ClientConfig
from kvcache.client.health import LatencyTracker, NodeHealth
from kvcache.client.plan import HeldShards, MatchResult, StripeAssembly, match_from_held, plan_reads
from kvcache.client.transport import NodeChannel
from kvcache.client.writes import build_node_records, encode_stripes
from kvcache.cluster import ClusterMap
from kvcache.erasure import ErasureParams, get_codec
from kvcache.errors import ConfigError, NodeError
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.memtune import tune_malloc
from kvcache.placement import Placement
from kvcache.shard import check_class_name, shard_len_for
from kvcache.wire import NO_INDEX, Header, Limits, Message, Op, make_items

__all__ = ["AsyncClient", "LoadResult", "StoreResult"]

log = logging.getLogger(__name__)

Payloads = Sequence[bytes | bytearray | memoryview | npt.NDArray[np.uint8]] | npt.NDArray[np.uint8]


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


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of a store: blocks written, blocks already present (touched), blocks failed."""

    written: int
    touched: int
    failed: int
    failed_blocks: tuple[int, ...] = field(default=())


class AsyncClient:
    """A kvcache client bound to one event loop."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        cluster: ClusterMap | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        if config.tune_malloc:
            tune_malloc()
        self.cluster = cluster if cluster is not None else ClusterMap.load(config.cluster_file)
        self.placement = Placement(self.cluster, width=config.n)
        self.params = ErasureParams(k=config.k, m=config.m)
        self.codec = get_codec(self.params)
        self.health = NodeHealth(retry_s=config.down_retry_s, clock=clock)
        self.read_latency = LatencyTracker()
        self.meta_latency = LatencyTracker()
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._limits = Limits()
        token = config.token.encode() if config.token else None
        self._channels = [
            NodeChannel(self._ctx, node, limits=self._limits, token=token)
            for node in self.placement.nodes
        ]
        self._background: set[asyncio.Task[Any]] = set()
        self.counters: dict[str, int] = {
            "hedges": 0,
            "node_errors": 0,
            "blocks_loaded": 0,
            "blocks_rebuilt": 0,
            "blocks_written": 0,
            "blocks_touched": 0,
            "write_failures": 0,
        }

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Close every socket."""
        for task in list(self._background):
            task.cancel()
        for ch in self._channels:
            await ch.aclose()
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ helpers

    def _node_up_mask(self) -> npt.NDArray[np.bool_]:
        return np.array([self.health.is_up(ch.node.id) for ch in self._channels], bool)

    def _hedge_s(self, tracker: LatencyTracker) -> float:
        if self.config.hedge_ms is not None:
            return self.config.hedge_ms / 1000.0
        return tracker.hedge_after()

    async def _call(
        self,
        node: int,
        header: Header,
        items: npt.NDArray[np.void] | None,
        data: Any = None,
    ) -> Message:
        channel = self._channels[node]
        try:
            reply = await channel.request(header, items, data, timeout=self.config.timeout_s)
        except NodeError as exc:
            self.counters["node_errors"] += 1
            self.health.mark_down(channel.node.id, str(exc))
            channel.reset()
            raise
        self.health.mark_up(channel.node.id)
        return reply

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Task[Any]) -> None:
        """Forget a finished task; its error (already counted in node health) is consumed."""
        self._background.discard(task)
        if not task.cancelled():
            task.exception()

    def _keys_and_holders(
        self, keys: Sequence[BlockKey]
    ) -> tuple[npt.NDArray[np.int64], dict[int, npt.NDArray[np.int64]]]:
        """Placement rows, and per node the block numbers it holds a shard of."""
        rows = self.placement.holders(keys)
        per_node: dict[int, npt.NDArray[np.int64]] = {}
        if len(keys):
            nodes_of = np.unique(rows)
            for node in nodes_of.tolist():
                per_node[node] = np.nonzero((rows == node).any(axis=1))[0]
        return rows, per_node

    @staticmethod
    def _check_class(traffic_class: str) -> str:
        return check_class_name(traffic_class)

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
        self, keys: Sequence[BlockKey], *, tokens_per_block: int = 1
    ) -> MatchResult:
        """Like :meth:`match_prefix` for block keys computed by the caller (e.g. an engine's own
        prefix hashes mapped to keys); ``keys`` must be a prefix chain, first block first."""
        keys = list(keys)
        k, n = self.config.k, self.config.n
        if not keys:
            return match_from_held(keys, [], k=k, n=n, tokens_per_block=tokens_per_block)
        rows, per_node = self._keys_and_holders(keys)
        key_words = np.frombuffer(b"".join(keys), dtype="V16")
        up = self._node_up_mask()
        # Shards per block that nodes still to answer may hold: once no block's
        # outcome can change, stragglers are not waited for.
        unanswered = np.zeros(len(keys), np.int64)
        tasks: dict[asyncio.Task[Message], tuple[int, npt.NDArray[np.int64]]] = {}
        for node, blocks in per_node.items():
            if not up[node]:
                continue
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
                if ((best >= k) | (best + unanswered < k)).all():
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
        if not pending:
            self.meta_latency.record(self._clock() - started)
        return match_from_held(keys, held, k=k, n=n, tokens_per_block=tokens_per_block)

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

    # ------------------------------------------------------------------ store

    async def store(
        self,
        namespace: Namespace,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        payloads: Payloads,
        *,
        traffic_class: str | None = None,
        first_block: int = 0,
    ) -> StoreResult:
        """Store blocks ``first_block ..`` of ``tokens`` with the given payloads.

        Blocks already stored with a full stripe are touched, not resent. A
        block counts as written when at least ``min_write_shards`` shards were
        acknowledged; otherwise what was stored of it is removed again.
        """
        cls = self._check_class(traffic_class or self.config.traffic_class)
        count = len(payloads)
        all_keys = block_keys(namespace, tokens, max_blocks=first_block + count)
        if len(all_keys) < first_block + count:
            raise ConfigError(
                f"{count} payloads from block {first_block} need {first_block + count} full "
                f"blocks of tokens; the prompt has {len(all_keys)}"
            )
        return await self.store_keys(
            all_keys[first_block:],
            payloads,
            payload_len=namespace.layout.payload_bytes,
            traffic_class=cls,
            first_block=first_block,
        )

    async def store_keys(
        self,
        keys: Sequence[BlockKey],
        payloads: Payloads,
        *,
        payload_len: int,
        traffic_class: str | None = None,
        first_block: int = 0,
    ) -> StoreResult:
        """:meth:`store` for blocks named by caller-computed keys (one payload per key)."""
        cls = self._check_class(traffic_class or self.config.traffic_class)
        keys = list(keys)
        if len(keys) != len(payloads):
            raise ConfigError(f"{len(keys)} keys but {len(payloads)} payloads")
        match = await self.match_keys(keys)
        present = match.best_count >= self.config.min_write_shards
        touched = 0
        if present.any():
            touched = await self._touch_keys([keys[i] for i in np.nonzero(present)[0]], cls)
        todo = np.nonzero(~present)[0]
        written = 0
        failed: list[int] = []
        step = self.config.max_batch_blocks
        for start in range(0, len(todo), step):
            batch = todo[start : start + step]
            ok = await self._put_batch(
                [keys[i] for i in batch], [payloads[i] for i in batch], payload_len, cls
            )
            written += int(ok.sum())
            failed.extend((first_block + batch[~ok]).tolist())
        self.counters["blocks_written"] += written
        self.counters["blocks_touched"] += touched
        self.counters["write_failures"] += len(failed)
        return StoreResult(
            written=written, touched=touched, failed=len(failed), failed_blocks=tuple(failed)
        )

    async def _put_batch(
        self, keys: list[BlockKey], payloads: Sequence[Any], payload_len: int, cls: str
    ) -> npt.NDArray[np.bool_]:
        n = self.config.n
        stripes, stripe_ids, header_bytes = encode_stripes(
            self.codec, keys, payloads, payload_len=payload_len, traffic_class=cls,
            now_ms=int(time.time() * 1000),
        )  # fmt: skip
        holders = self.placement.holders(keys)
        up = self._node_up_mask()
        acks = np.zeros((len(keys), n), bool)
        tasks: dict[
            asyncio.Task[Message], tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64]]
        ] = {}
        for node in np.unique(holders).tolist():
            if not up[node]:
                continue
            b, i = np.nonzero(holders == node)
            items, frame = build_node_records(keys, b, i, stripes, header_bytes)
            header = Header(op=Op.PUT, request_id=0, count=len(b))
            tasks[self._spawn(self._call(node, header, items, frame))] = (node, b, i)
        pending = set(tasks)
        started = self._clock()
        deadline = started + self.config.timeout_s
        quorum_at: float | None = None
        while pending:
            now = self._clock()
            if quorum_at is None and (acks.sum(axis=1) >= self.config.min_write_shards).all():
                quorum_at = now
            limit = (
                deadline
                if quorum_at is None
                else min(deadline, quorum_at + self._hedge_s(self.read_latency))
            )
            if now >= limit:
                break
            done, pending = await asyncio.wait(
                pending, timeout=limit - now, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task.cancelled() or task.exception() is not None:
                    continue
                _node, b, i = tasks[task]
                status = task.result().items["status"]
                acks[b[status == 0], i[status == 0]] = True
        ok: npt.NDArray[np.bool_] = acks.sum(axis=1) >= self.config.min_write_shards
        if not ok.all():
            await self._rollback(keys, stripe_ids, holders, acks, ~ok)
        return ok

    async def _rollback(
        self,
        keys: list[BlockKey],
        stripe_ids: npt.NDArray[np.uint64],
        holders: npt.NDArray[np.int64],
        acks: npt.NDArray[np.bool_],
        failed: npt.NDArray[np.bool_],
    ) -> None:
        """Delete the shards of failed blocks that did get stored (only our stripe)."""
        key_words = np.frombuffer(b"".join(keys), dtype="V16")
        mask = acks & failed[:, None]
        calls = []
        for node in np.unique(holders[mask]).tolist():
            b, _i = np.nonzero(mask & (holders == node))
            b = np.unique(b)
            items = make_items(Op.DELETE, len(b), reply=False)
            items["key"] = key_words[b]
            items["stripe"] = stripe_ids[b]
            items["index"] = NO_INDEX
            header = Header(op=Op.DELETE, request_id=0, count=len(b))
            calls.append(self._call(node, header, items))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.warning("rollback of a failed write incomplete: %s", r)

    # ------------------------------------------------------------------ touch / delete / stats

    async def touch(
        self,
        namespace: Namespace,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        traffic_class: str | None = None,
    ) -> int:
        """Refresh retention of every stored full block of ``tokens``; returns blocks touched."""
        cls = self._check_class(traffic_class or self.config.traffic_class)
        return await self._touch_keys(block_keys(namespace, tokens), cls)

    async def _touch_keys(self, keys: list[BlockKey], cls: str) -> int:
        return await self._fan_out(Op.TOUCH, keys, cls)

    async def delete(
        self, namespace: Namespace, tokens: Sequence[int] | npt.NDArray[np.integer]
    ) -> int:
        """Remove every shard of every full block of ``tokens``; returns blocks found."""
        return await self._fan_out(Op.DELETE, block_keys(namespace, tokens), "")

    async def _fan_out(self, op: Op, keys: list[BlockKey], cls: str) -> int:
        """Send a per-key op to every holder; returns keys at least one node knew."""
        if not keys:
            return 0
        _rows, per_node = self._keys_and_holders(keys)
        key_words = np.frombuffer(b"".join(keys), dtype="V16")
        up = self._node_up_mask()
        found = np.zeros(len(keys), bool)
        calls = []
        for node, blocks in per_node.items():
            if not up[node]:
                continue
            items = make_items(op, len(blocks), reply=False)
            items["key"] = key_words[blocks]
            if op is Op.DELETE:
                items["stripe"] = 0
                items["index"] = NO_INDEX
            header = Header(op=op, request_id=0, count=len(blocks), traffic_class=cls)
            calls.append((blocks, self._call(node, header, items)))
        results = await asyncio.gather(*(c for _, c in calls), return_exceptions=True)
        for (blocks, _), reply in zip(calls, results, strict=True):
            if isinstance(reply, BaseException):
                continue
            found[blocks[reply.items["status"] == 0]] = True
        return int(found.sum())

    async def stats(self) -> dict[str, Any]:
        """Each node's STATS answer (or its error), by node id."""
        calls = [
            self._call(i, Header(op=Op.STATS, request_id=0, count=0), None)
            for i in range(len(self._channels))
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        out: dict[str, Any] = {}
        for ch, reply in zip(self._channels, results, strict=True):
            if isinstance(reply, BaseException):
                out[ch.node.id] = {"error": str(reply)}
            else:
                try:
                    out[ch.node.id] = json.loads(bytes(reply.data))
                except ValueError:
                    out[ch.node.id] = {"error": "unreadable stats"}
        return out
