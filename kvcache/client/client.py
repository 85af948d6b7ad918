"""The client inference workers call: match a prompt's cached prefix, load it, store new blocks.

:class:`Client` is the one implementation. It is blocking and thread-safe:
the transport's I/O threads move the bytes (with the GIL released), the
calling thread runs the decisions and checks, so several threads of one
worker (a lookup thread, a saver, the forward pass) share one client.
:class:`AsyncClient` runs the same calls off the event loop, for asyncio code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache.client.config import ClientConfig
from kvcache.client.core import ClientCore
from kvcache.client.driver import Reviver, Watchdog
from kvcache.client.loading import LoadResult, OnReady, check_out, load_keys
from kvcache.client.matching import DirectoryAnswer, match_keys, match_with_directory
from kvcache.client.plan import MatchResult
from kvcache.client.pool import ClientPool
from kvcache.client.storing import Payloads, StoreResult, store_keys, touch_or_delete
from kvcache.client.transport import Transport
from kvcache.cluster import ClusterMap
from kvcache.errors import ArgumentError, ClosedError, ConfigError, KVCacheError
from kvcache.gc_pause import gc_paused
from kvcache.keys import BlockKey, Namespace, are_block_keys, block_keys
from kvcache.retention.decide import Hint
from kvcache.wire import NO_RETAIN, Op, Retain

__all__ = ["AsyncClient", "Client"]

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
Tokens = Sequence[int] | npt.NDArray[np.integer]


def _data_call(method: Callable[Concatenate[Client, P], T]) -> Callable[Concatenate[Client, P], T]:
    """A data-path call: runs with the cyclic GC held off (``pause_gc``, kvcache.gc_pause)."""

    @functools.wraps(method)
    def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        if self._closed:
            raise ClosedError(f"Client.{method.__name__} called after close(); open a new Client")
        if os.getpid() != self._pid:
            raise ClosedError(
                f"Client.{method.__name__} called in a forked child: this client belongs to "
                f"process {self._pid} (its connections and I/O workers are that process's); "
                "open a Client of its own in the child"
            )
        with gc_paused(self._core.config.pause_gc):
            return method(self, *args, **kwargs)

    return call


def _check_tokens_per_block(tokens_per_block: object) -> None:
    if (
        isinstance(tokens_per_block, bool)
        or not isinstance(tokens_per_block, int)
        or tokens_per_block < 1
    ):
        raise ArgumentError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")


def _check_match(match: MatchResult, *, n: int, nodes: int) -> None:
    """A MatchResult a caller hands back must be one a match of this client's shape could
    have made (a hand-built or altered one raised numpy's errors deep in the load)."""
    hits = match.hit_blocks
    keys = match.keys
    if isinstance(hits, bool) or not isinstance(hits, int) or not 0 <= hits <= len(keys):
        raise ArgumentError(f"MatchResult.hit_blocks must be 0..{len(keys)}, got {hits!r}")
    holders, stripe = match.holders, match.stripe
    if (
        not isinstance(holders, np.ndarray)
        or holders.ndim != 2
        or holders.shape[0] < hits
        or holders.shape[1] != n
        or holders.dtype.kind not in "iu"
    ):
        raise ArgumentError(
            f"MatchResult.holders must be an int array of {hits} rows or more and {n} columns "
            "(this client's k + m): use a match made by this client"
        )
    if hits and (int(holders[:hits].min()) < -1 or int(holders[:hits].max()) >= nodes):
        raise ArgumentError("MatchResult.holders names nodes this client does not know")
    if not isinstance(stripe, np.ndarray) or stripe.ndim != 1 or len(stripe) < hits:
        raise ArgumentError(f"MatchResult.stripe must be an array of {hits} stripe ids or more")
    if not are_block_keys(keys[:hits]):
        raise ArgumentError("MatchResult.keys must be 16-byte block keys")


def _keys(namespace: object, tokens: Tokens, max_blocks: int | None = None) -> list[BlockKey]:
    if not isinstance(namespace, Namespace):
        raise ArgumentError(
            f"namespace must be a kvcache.Namespace, got {type(namespace).__name__}"
        )
    if max_blocks is not None and (
        isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 0
    ):
        raise ArgumentError(f"max_blocks must be an int >= 0 or None, got {max_blocks!r}")
    try:
        return block_keys(namespace, tokens, max_blocks=max_blocks)
    except ConfigError as exc:
        raise ArgumentError(str(exc)) from None
    except TypeError as exc:
        raise ArgumentError(f"tokens must be a sequence of ints or an int array: {exc}") from None


class Client:
    """A blocking, thread-safe kvcache client (see the module docstring)."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        cluster: ClusterMap | None = None,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, ClientConfig):
            raise ArgumentError(f"config must be a ClientConfig, got {type(config).__name__}")
        self._core = ClientCore(config, cluster=cluster, transport=transport, clock=clock)
        self._closed = False
        #: The process that opened it: a forked child's copy shares its sockets and workers.
        self._pid = os.getpid()
        self._watchdog: Watchdog | None = None
        self._reviver: Reviver | None = None
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool: ClientPool | None = None
        try:
            if hasattr(self._core.transport, "busy_since"):
                self._watchdog = Watchdog(
                    self._core.transport, self._core.health, config.timeout_s, clock=clock
                )
            if hasattr(self._core.transport, "credentials"):
                self._reviver = Reviver(self._core.transport, self._core.health)
            self._encoder = concurrent.futures.ThreadPoolExecutor(
                max(1, min(4, (os.cpu_count() or 2) // 2)), thread_name_prefix="kvcache-encode"
            )
            if config.io_processes:
                self._pool = ClientPool(config, config.io_processes)
        except BaseException:
            # What was started (threads, connections, worker processes) goes with the error.
            self.close()
            raise

    @property
    def config(self) -> ClientConfig:
        """The client's configuration."""
        return self._core.config

    @property
    def counters(self) -> dict[str, int]:
        """Client-side counters (hedges, node errors, blocks loaded/written, repairs...),
        the I/O pool's workers included."""
        counters = self._core.snapshot()
        if self._pool is not None and self._pool.broken is None:
            for name, n in self._pool.counters().items():
                counters[name] = counters.get(name, 0) + n
        return counters

    @property
    def io_pids(self) -> list[int]:
        """Process ids of the I/O pool's workers (none without a pool)."""
        return [] if self._pool is None else self._pool.pids

    def alloc_buffer(self, rows: int, row_bytes: int) -> npt.NDArray[np.uint8]:
        """A (rows, row_bytes) uint8 host buffer for loads and stores.

        With an I/O pool (``io_processes``) it lies in shared memory, so the workers
        read and write it directly; pass it (or a slice of it) as ``out`` or as the
        payloads. An engine pins it for DMA (``PagedKVAdapter.pin_host``).
        """
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ArgumentError(f"rows must be an int >= 0, got {rows!r}")
        if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1:
            raise ArgumentError(f"row_bytes must be a positive int, got {row_bytes!r}")
        if self._pool is None:
            try:
                return np.empty((rows, row_bytes), np.uint8)
            except (MemoryError, ValueError):  # ValueError: past numpy's largest array
                raise ArgumentError(
                    f"a buffer of {rows} x {row_bytes} bytes does not fit this host's memory"
                ) from None
        return self._pool.alloc(rows, row_bytes).array

    @property
    def core(self) -> ClientCore:
        """The shared state (cluster, placement, health) — for tools and tests."""
        return self._core

    # -------------------------------------------------------------- reads

    @_data_call
    def match_prefix(
        self, namespace: Namespace, tokens: Tokens, *, max_blocks: int | None = None
    ) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` (one batched HAS per node)."""
        keys = _keys(namespace, tokens, max_blocks)
        return match_keys(self._core, keys, tokens_per_block=namespace.tokens_per_block)

    @_data_call
    def match_keys(self, keys: Sequence[BlockKey], *, tokens_per_block: int = 1) -> MatchResult:
        """Like :meth:`match_prefix` for block keys computed by the caller (e.g. an engine's own
        prefix hashes mapped to keys); ``keys`` must be a prefix chain, first block first."""
        keys = list(keys)
        if not are_block_keys(keys):
            raise ArgumentError("keys must be 16-byte block keys (kvcache.keys.block_keys)")
        _check_tokens_per_block(tokens_per_block)
        return match_keys(self._core, keys, tokens_per_block=tokens_per_block)

    @_data_call
    def match_with_directory(
        self, keys: Sequence[BlockKey], *, tokens_per_block: int = 1
    ) -> tuple[MatchResult, list[DirectoryAnswer]]:
        """:meth:`match_keys`, plus the SWA holder records the nodes keep for ``keys``, in
        the same round trip (``kvcache.swa_local.directory`` parses them)."""
        keys = list(keys)
        if not are_block_keys(keys):
            raise ArgumentError("keys must be 16-byte block keys (kvcache.keys.block_keys)")
        _check_tokens_per_block(tokens_per_block)
        return match_with_directory(self._core, keys, tokens_per_block=tokens_per_block)

    @_data_call
    def load(
        self,
        namespace: Namespace,
        match: MatchResult,
        *,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
        on_ready: OnReady | None = None,
        hint: Hint | None = None,
    ) -> LoadResult:
        """Load the hit blocks of ``match``; stops at the first block that cannot be rebuilt.

        With ``out`` (a (blocks, payload_bytes) uint8 array, ideally pinned memory
        the engine copies from) the shards land there directly. ``on_ready(first,
        stop)`` is called as the verified prefix grows, so a device copy can start
        before the whole load is in. A hit refreshes the blocks' retention under
        ``traffic_class`` (or ``hint``'s class, TTL and pin: :class:`kvcache.retention.Hint`).
        Wrong bytes are never returned.
        """
        if not isinstance(namespace, Namespace):
            raise ArgumentError(
                f"namespace must be a kvcache.Namespace, got {type(namespace).__name__}"
            )
        return self.load_keys(
            match,
            payload_len=namespace.layout.payload_bytes,
            out=out,
            traffic_class=traffic_class,
            on_ready=on_ready,
            hint=hint,
        )

    @_data_call
    def load_keys(
        self,
        match: MatchResult | Sequence[BlockKey],
        *,
        payload_len: int,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
        on_ready: OnReady | None = None,
        hint: Hint | None = None,
    ) -> LoadResult:
        """:meth:`load` for blocks of ``payload_len`` bytes named by ``match`` alone.

        ``match`` may also be the block keys themselves, when the caller knows they are
        stored (it wrote them; a scheduler matched them): the load then makes no HAS round
        and asks placement's holders for whatever stripe they have (one round trip). A key
        that is not stored ends the loaded prefix there, as a miss would (after one more
        round, below). A block short of
        shards on those holders is looked for where a writer may also have put them (the
        stand-ins of holders it saw down): the keys from there on are matched (a HAS round
        over every node that may hold them), and what is found is loaded after the rest.
        """
        by_keys = not isinstance(match, MatchResult)
        result = self._load_keys(match, payload_len, out, traffic_class, on_ready, hint)
        if not by_keys or not isinstance(match, Sequence):
            return result
        start = result.blocks
        if start >= len(match):
            return result
        try:
            rest = match_keys(self._core, list(match[start:]))
        except KVCacheError as exc:  # what was loaded stands
            log.warning("matching the rest of a load of known keys failed: %s", exc)
            return result
        if not rest.hit_blocks:
            return result
        self._core.count("loads_rematched")
        more = self._load_keys(
            rest,
            payload_len,
            None if out is None else out[start:],
            traffic_class,
            None if on_ready is None else (lambda a, b: on_ready(start + a, start + b)),
            hint,
        )
        return LoadResult(
            blocks=start + more.blocks,
            tokens=result.tokens + more.tokens,
            payloads=[*result.payloads, *more.payloads],
            bytes_loaded=result.bytes_loaded + more.bytes_loaded,
        )

    def _load_keys(
        self,
        match: MatchResult | Sequence[BlockKey],
        payload_len: int,
        out: npt.NDArray[np.uint8] | None,
        traffic_class: str | None,
        on_ready: OnReady | None,
        hint: Hint | None,
    ) -> LoadResult:
        if not isinstance(match, MatchResult):
            keys = list(match) if isinstance(match, Sequence) else None
            if keys is None or not are_block_keys(keys):
                raise ArgumentError(
                    "match must be a MatchResult or a sequence of 16-byte block keys"
                )
            match = MatchResult.known(keys, n=self._core.config.n)
        else:
            _check_match(match, n=self._core.config.n, nodes=len(self._core.transport.nodes))
        traffic_class, retain = _hinted(traffic_class, hint)
        # The I/O pool carries no hints: a hinted load runs in this process.
        pooled = (
            self._pooled_load(match, payload_len, out, traffic_class, on_ready)
            if retain is NO_RETAIN
            else None
        )
        if pooled is not None:
            return pooled
        result = load_keys(
            self._core,
            match,
            payload_len=payload_len,
            out=out,
            traffic_class=traffic_class,
            on_ready=on_ready,
            retain=retain,
        )
        if retain.pin and result.blocks:  # a GET cannot pin: pin what was loaded
            touch_or_delete(
                self._core,
                Op.TOUCH,
                match.keys[: result.blocks],
                self._core.traffic_class(traffic_class),
                retain=retain,
            )
        return result

    def _pooled_load(
        self,
        match: MatchResult,
        payload_len: int,
        out: npt.NDArray[np.uint8] | None,
        traffic_class: str | None,
        on_ready: OnReady | None,
    ) -> LoadResult | None:
        """The load through the I/O pool, or None when it should run here."""
        pool = self._pool
        if (
            pool is None
            or pool.broken is not None  # a worker died: this process moves the bytes
            or not isinstance(match, MatchResult)
            or match.hit_blocks < 2
        ):
            return None
        if isinstance(payload_len, bool) or not isinstance(payload_len, int) or payload_len < 1:
            return None  # load_keys names the mistake
        total = match.hit_blocks
        buffer = (
            check_out(out, total, payload_len)
            if out is not None
            else pool.alloc(total, payload_len).array
        )
        region = pool.region(buffer[:total])
        if region is None:
            return None  # not shared memory: this process loads it
        good = pool.load(
            match,
            region,
            payload_len=payload_len,
            traffic_class=self._core.traffic_class(traffic_class),
            chunk_blocks=self.config.chunk_blocks(payload_len),
            on_ready=on_ready,
            nodes=tuple((n.id, n.data) for n in self._core.transport.nodes),
        )
        return LoadResult(
            blocks=good,
            tokens=good * match.tokens_per_block,
            payloads=[buffer[b] for b in range(good)],
            bytes_loaded=good * payload_len,
        )

    @_data_call
    def load_prefix(
        self,
        namespace: Namespace,
        tokens: Tokens,
        *,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
        hint: Hint | None = None,
    ) -> LoadResult:
        """Match and load in one call."""
        match = self.match_prefix(namespace, tokens)
        return self.load(namespace, match, out=out, traffic_class=traffic_class, hint=hint)

    # -------------------------------------------------------------- writes

    @_data_call
    def store(
        self,
        namespace: Namespace,
        tokens: Tokens,
        payloads: Payloads,
        *,
        traffic_class: str | None = None,
        first_block: int = 0,
        hint: Hint | None = None,
    ) -> StoreResult:
        """Store blocks ``first_block ..`` of ``tokens`` with the given payloads.

        Blocks already readable are touched, not resent. A block counts as
        written when at least ``min_write_shards`` shards of its stripe were
        stored; otherwise what was stored of it is removed again. Payloads are
        checked (count, size, dtype) before anything is sent. ``hint``
        (:class:`kvcache.retention.Hint`) names the request's class, TTL and pin;
        ``Hint(store=False)`` stores nothing.
        """
        if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
            raise ArgumentError(f"first_block must be an int >= 0, got {first_block!r}")
        try:
            count = len(payloads)
        except TypeError:
            raise ArgumentError(
                f"payloads must be a sequence of buffers or a 2-d uint8 array, got "
                f"{type(payloads).__name__}"
            ) from None
        all_keys = _keys(namespace, tokens, first_block + count)
        if len(all_keys) < first_block + count:
            raise ArgumentError(
                f"{count} payloads from block {first_block} need {first_block + count} full "
                f"blocks of tokens; the prompt has {len(all_keys)}"
            )
        return self._store(
            all_keys[first_block:],
            payloads,
            payload_len=namespace.layout.payload_bytes,
            traffic_class=traffic_class,
            first_block=first_block,
            hint=hint,
        )

    @_data_call
    def store_keys(
        self,
        keys: Sequence[BlockKey],
        payloads: Payloads,
        *,
        payload_len: int,
        traffic_class: str | None = None,
        hint: Hint | None = None,
    ) -> StoreResult:
        """:meth:`store` for blocks named by caller-computed keys (one payload per key)."""
        return self._store(
            keys, payloads, payload_len=payload_len, traffic_class=traffic_class, hint=hint
        )

    def _store(
        self,
        keys: Sequence[BlockKey],
        payloads: Payloads,
        *,
        payload_len: int,
        traffic_class: str | None,
        first_block: int = 0,
        hint: Hint | None = None,
    ) -> StoreResult:
        traffic_class, retain = _hinted(traffic_class, hint)
        if hint is not None and not hint.store:
            # Nothing is stored, but a bad call is still an error (it was a silent no-op).
            if isinstance(payload_len, bool) or not isinstance(payload_len, int) or payload_len < 1:
                raise ArgumentError(f"payload_len must be a positive int, got {payload_len!r}")
            if not isinstance(keys, Sequence) or not are_block_keys(list(keys)):
                raise ArgumentError("keys must be a sequence of 16-byte block keys")
            return StoreResult(0, 0, 0)
        pool = self._pool
        if (
            pool is not None
            and pool.broken is None  # a worker died: this process moves the bytes
            and retain is NO_RETAIN  # the I/O pool carries no hints
            and isinstance(payloads, np.ndarray)
            and payloads.ndim == 2
            and payloads.dtype == np.uint8
            and payloads.flags.c_contiguous
            and isinstance(payload_len, int)
            and payloads.shape == (len(keys), payload_len)
            and len(keys) >= 2
            and all(isinstance(k, bytes) and len(k) == 16 for k in keys)
        ):
            region = pool.region(payloads)
            if region is not None:
                return pool.store(
                    list(keys),
                    region,
                    payload_len=payload_len,
                    traffic_class=self._core.traffic_class(traffic_class),
                    first_block=first_block,
                    chunk_blocks=self.config.chunk_blocks(payload_len),
                )
        return store_keys(
            self._core,
            keys,
            payloads,
            payload_len=payload_len,
            traffic_class=traffic_class,
            first_block=first_block,
            encoder=self._encoder,
            retain=retain,
        )

    @_data_call
    def touch(
        self,
        namespace: Namespace,
        tokens: Tokens,
        *,
        traffic_class: str | None = None,
        hint: Hint | None = None,
    ) -> int:
        """Refresh retention of every stored full block of ``tokens``; returns blocks touched.

        ``hint``'s TTL and pin apply to the touched blocks."""
        traffic_class, retain = _hinted(traffic_class, hint)
        cls = self._core.traffic_class(traffic_class)
        return touch_or_delete(self._core, Op.TOUCH, _keys(namespace, tokens), cls, retain=retain)

    @_data_call
    def delete(self, namespace: Namespace, tokens: Tokens) -> int:
        """Remove every shard of every full block of ``tokens``; returns blocks found."""
        return touch_or_delete(self._core, Op.DELETE, _keys(namespace, tokens), "")

    def stats(self) -> dict[str, Any]:
        """Each node's STATS answer (or its error), by node id."""
        import json

        from kvcache.client.driver import Pump, PumpedExchange
        from kvcache.wire import make_items

        core = self._core
        pump = Pump(core.transport, core.health, core.clock)
        nodes = core.placement.nodes
        for i in range(len(nodes)):
            pump.submit(
                PumpedExchange(pump, i + 1, i, Op.STATS, make_items(Op.STATS, 0, reply=False))
            )
        out: dict[str, Any] = {node.id: {"error": "no answer"} for node in nodes}
        deadline = core.clock() + core.config.timeout_s
        while pump.outstanding and core.clock() < deadline:
            for event in pump.wait(deadline):
                node = nodes[event.exchange.node].id
                if event.reply is None:
                    out[node] = {"error": str(event.error)}
                    continue
                try:
                    out[node] = json.loads(bytes(event.reply.data))
                except ValueError:
                    out[node] = {"error": "unreadable stats"}
        pump.abandon(core.config.timeout_s)
        return out

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop the I/O threads and close every connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # a forked child's copy: what it would close is the parent's
        if self._pool is not None:
            self._pool.close()
        if self._watchdog is not None:
            self._watchdog.close()
        if self._reviver is not None:
            self._reviver.close()
        if self._encoder is not None:
            self._encoder.shutdown(wait=True)
        self._core.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """:class:`Client` for asyncio code: every call runs on a worker thread, never the loop.

    A cancelled call returns (raising CancelledError) only once its thread is done: a load
    lands shards in the caller's ``out`` and a store reads its payloads until then, so a
    caller reusing its buffer after the cancellation saw it written to (and a load checking
    the overwritten bytes took healthy stripes for broken ones). The thread ends within the
    call's own deadlines (``timeout_s`` a round)."""

    def __init__(self, config: ClientConfig, *, cluster: ClusterMap | None = None) -> None:
        self.client = Client(config, cluster=cluster)

    @property
    def config(self) -> ClientConfig:
        """The client's configuration."""
        return self.client.config

    @property
    def counters(self) -> dict[str, int]:
        """See :attr:`Client.counters`."""
        return self.client.counters

    async def match_prefix(
        self, namespace: Namespace, tokens: Tokens, *, max_blocks: int | None = None
    ) -> MatchResult:
        """See :meth:`Client.match_prefix`."""
        return await _to_thread_whole(
            self.client.match_prefix, namespace, tokens, max_blocks=max_blocks
        )

    async def match_keys(
        self, keys: Sequence[BlockKey], *, tokens_per_block: int = 1
    ) -> MatchResult:
        """See :meth:`Client.match_keys`."""
        return await _to_thread_whole(
            self.client.match_keys, keys, tokens_per_block=tokens_per_block
        )

    async def load(self, namespace: Namespace, match: MatchResult, **kwargs: Any) -> LoadResult:
        """See :meth:`Client.load`."""
        return await _to_thread_whole(self.client.load, namespace, match, **kwargs)

    async def load_keys(self, match: MatchResult | Sequence[BlockKey], **kwargs: Any) -> LoadResult:
        """See :meth:`Client.load_keys`."""
        return await _to_thread_whole(self.client.load_keys, match, **kwargs)

    async def load_prefix(self, namespace: Namespace, tokens: Tokens, **kwargs: Any) -> LoadResult:
        """See :meth:`Client.load_prefix`."""
        return await _to_thread_whole(self.client.load_prefix, namespace, tokens, **kwargs)

    async def store(
        self, namespace: Namespace, tokens: Tokens, payloads: Payloads, **kwargs: Any
    ) -> StoreResult:
        """See :meth:`Client.store`."""
        return await _to_thread_whole(self.client.store, namespace, tokens, payloads, **kwargs)

    async def store_keys(
        self, keys: Sequence[BlockKey], payloads: Payloads, **kwargs: Any
    ) -> StoreResult:
        """See :meth:`Client.store_keys`."""
        return await _to_thread_whole(self.client.store_keys, keys, payloads, **kwargs)

    async def touch(self, namespace: Namespace, tokens: Tokens, **kwargs: Any) -> int:
        """See :meth:`Client.touch`."""
        return await _to_thread_whole(self.client.touch, namespace, tokens, **kwargs)

    async def delete(self, namespace: Namespace, tokens: Tokens) -> int:
        """See :meth:`Client.delete`."""
        return await _to_thread_whole(self.client.delete, namespace, tokens)

    async def stats(self) -> dict[str, Any]:
        """See :meth:`Client.stats`."""
        return await _to_thread_whole(self.client.stats)

    async def aclose(self) -> None:
        """Close the client."""
        await _to_thread_whole(self.client.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _to_thread_whole(func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread``, except that a cancellation propagates only once the thread
    is done (see :class:`AsyncClient`)."""
    task = asyncio.ensure_future(asyncio.to_thread(func, *args, **kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):  # cancelled again: still wait
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: the call's own outcome goes with the cancellation
        raise


def _hinted(traffic_class: str | None, hint: Hint | None) -> tuple[str | None, Retain]:
    """The class a call uses and the hint's wire form (its TTL and pin)."""
    if hint is None:
        return traffic_class, NO_RETAIN
    if not isinstance(hint, Hint):
        raise ArgumentError(f"hint must be a kvcache.retention.Hint, got {type(hint).__name__}")
    retain = Retain(ttl_s=hint.ttl_s or 0, pin=hint.pin)
    return hint.traffic_class or traffic_class, (NO_RETAIN if retain == NO_RETAIN else retain)
