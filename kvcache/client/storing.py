"""Writing: quorum stores of erasure-coded blocks, touches and deletes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.client.encoding import build_node_records, encode_stripes
from kvcache.client.reads import ReadOps
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.wire import NO_INDEX, Header, Message, Op, make_items

__all__ = ["Payloads", "StoreOps", "StoreResult"]

log = logging.getLogger(__name__)

Payloads = Sequence[bytes | bytearray | memoryview | npt.NDArray[np.uint8]] | npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of a store: blocks written, blocks already present (touched), blocks failed."""

    written: int
    touched: int
    failed: int
    failed_blocks: tuple[int, ...] = field(default=())


class StoreOps(ReadOps):
    """store / store_keys / touch / delete (a store first matches, to skip what is stored)."""

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
        match = await self.match_keys(keys, settle_at=self.config.min_write_shards)
        present = match.best_count >= self.config.min_write_shards
        if self._suspect:
            present &= np.array([key not in self._suspect for key in keys], bool)
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
            for i in batch[ok].tolist():
                self._suspect.pop(keys[i], None)
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
        up = self._node_up_mask(holders, self.config.min_write_shards)
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
