"""The repairer's I/O: list, plan, rebuild and write, over one tenant's client core.

One pass of :meth:`Repairer.run_pass`:

1. every node the view knows is asked for its LIST pages
   (:class:`~.listing.ListingMerge` turns them into complete keys);
2. each batch of keys is planned (:func:`~.plan.plan_blocks`) against the
   current write targets;
3. for the blocks that lack shards, k shards are read (data shards first, so
   most blocks need no decode) into a :class:`~kvcache.client.assembly.LoadAssembly`,
   which verifies the payload against the writer's hash (all the other
   listed shards are asked for when that fails), re-encodes it and builds the
   missing shards with their headers (:meth:`LoadAssembly.repair_shards`, the
   read repair's code path);
4. the shards are PUT to their targets (naming the stripe a target holds
   there instead in ``expect``), and with ``prune`` the copies of complete
   blocks' shards that sit off their targets are deleted;
5. the state file's cursor moves past the batch.

Bytes read and written are paced to ``rate_bytes`` per second (a sleep on
the stop event, so SIGTERM ends the wait).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.client.assembly import LoadAssembly
from kvcache.client.core import ClientCore
from kvcache.client.driver import Event, GetExchange, Pump, PumpedExchange, gather_abort
from kvcache.client.rounds import Send
from kvcache.client.view import ClusterView
from kvcache.errors import ProtocolError
from kvcache.keys import BlockKey
from kvcache.repair.listing import Held, ListingMerge, list_request, parse_listing
from kvcache.repair.plan import BlockPlan, plan_blocks
from kvcache.repair.state import TenantState
from kvcache.shard import HEADER_BYTES
from kvcache.wire import LIST_MAX_PAGE, Op, Status, make_items

__all__ = ["RepairOptions", "RepairProgress", "Repairer"]

log = logging.getLogger(__name__)

_tickets = itertools.count(1 << 40)


@dataclass(frozen=True, slots=True, kw_only=True)
class RepairOptions:
    """How a repair pass runs."""

    #: Bytes read plus written per second at most (0: unlimited).
    rate_bytes: int = 200_000_000
    #: Keys planned and repaired together.
    batch_keys: int = 256
    #: Shards per LIST page.
    page: int = LIST_MAX_PAGE
    #: Delete shard copies off their targets once the targets hold theirs.
    prune: bool = False
    #: Stop the pass (resumably) once this many keys were scanned (None: no limit).
    limit_keys: int | None = None
    #: Blocks expiring sooner than this are not repaired.
    min_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.rate_bytes < 0:
            raise ProtocolError(f"rate_bytes must be >= 0, got {self.rate_bytes}")
        if self.batch_keys < 1 or not 1 <= self.page <= LIST_MAX_PAGE:
            raise ProtocolError(f"batch_keys >= 1 and page 1..{LIST_MAX_PAGE} required")


@dataclass(slots=True)
class RepairProgress:
    """What one pass over one tenant did so far."""

    tenant: str
    keys_scanned: int = 0
    blocks_complete: int = 0
    #: Short on their targets with nothing writable now (a target down): left for a later pass.
    blocks_waiting: int = 0
    blocks_repaired: int = 0
    blocks_unrecoverable: int = 0
    blocks_failed: int = 0
    shards_written: int = 0
    shards_deferred: int = 0
    strays_deleted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    nodes_unreachable: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    done: bool = False

    @property
    def gb_per_s(self) -> float:
        """Bytes read plus written per second, in GB/s."""
        moved = self.bytes_read + self.bytes_written
        return moved / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for ``--json``), with the rate."""
        out = asdict(self)
        out["gb_per_s"] = round(self.gb_per_s, 4)
        out["elapsed_s"] = round(self.elapsed_s, 3)
        return out

    def line(self) -> str:
        """One human line of progress."""
        return (
            f"{self.tenant}: {self.keys_scanned} keys scanned, {self.blocks_repaired} repaired "
            f"({self.shards_written} shards), {self.blocks_complete} complete, "
            f"{self.blocks_waiting} waiting for a target, "
            f"{self.blocks_unrecoverable} unrecoverable, {self.blocks_failed} failed; "
            f"{(self.bytes_read + self.bytes_written) / 1e6:.1f} MB in {self.elapsed_s:.1f} s "
            f"({self.gb_per_s:.3f} GB/s)" + (" done" if self.done else "")
        )


class _Throttle:
    """Paces bytes to a rate by sleeping on the stop event."""

    def __init__(self, rate: int, clock: Callable[[], float], stop: threading.Event) -> None:
        self._rate = rate
        self._clock = clock
        self._stop = stop
        self._start = clock()
        self._spent = 0

    def spend(self, nbytes: int) -> None:
        if self._rate <= 0:
            return
        self._spent += nbytes
        ahead = self._spent / self._rate - (self._clock() - self._start)
        if ahead > 0:
            self._stop.wait(ahead)


class Repairer:
    """Repair passes over the blocks of ``core``'s tenant (see the module docstring)."""

    def __init__(
        self,
        core: ClientCore,
        *,
        tenant: str,
        options: RepairOptions | None = None,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_batch: Callable[[RepairProgress], None] | None = None,
    ) -> None:
        self.core = core
        self.tenant = tenant
        self.options = options or RepairOptions()
        self.stop = stop or threading.Event()
        self._clock = clock
        self._wall = wall
        self._on_batch = on_batch

    def run_pass(
        self, state: TenantState, save: Callable[[], None] = lambda: None
    ) -> RepairProgress:
        """One pass from ``state.cursor`` (a finished pass starts over); updates ``state``
        and calls ``save`` after every batch."""
        opts = self.options
        if state.done:
            state.cursor, state.done = bytes(16), False
        progress = RepairProgress(self.tenant)
        started = self._clock()
        throttle = _Throttle(opts.rate_bytes, self._clock, self.stop)
        view = self.core.view()
        nodes = list(range(len(view.nodes)))
        merge = ListingMerge(nodes, start=state.cursor, page=opts.page)
        pump = Pump(self.core.transport, self.core.health, self.core.clock)
        pending: list[tuple[bytes, list[Held]]] = []
        try:
            while not self.stop.is_set():
                if len(pending) < opts.batch_keys and not merge.done:
                    self._list_pages(pump, merge, view)
                    pending += merge.release()
                    if len(pending) < opts.batch_keys and not merge.done:
                        continue
                if not pending:
                    break
                batch, pending = pending[: opts.batch_keys], pending[opts.batch_keys :]
                self._repair_batch(pump, view, batch, progress, throttle)
                progress.keys_scanned += len(batch)
                state.cursor = pending[0][0] if pending else merge.cursor
                if not pending and merge.done:
                    state.done = True
                progress.elapsed_s = self._clock() - started
                save()
                if self._on_batch is not None:
                    self._on_batch(progress)
                if opts.limit_keys is not None and progress.keys_scanned >= opts.limit_keys:
                    break
            if merge.done and not pending and not self.stop.is_set():
                state.done = True
        finally:
            pump.abandon()
        if state.done:
            state.passes += 1
            state.cursor = bytes(16)
        save()
        progress.done = state.done
        progress.nodes_unreachable = sorted(view.nodes[i].id for i in merge.failed)
        progress.elapsed_s = self._clock() - started
        return progress

    # -------------------------------------------------------------- listing

    def _list_pages(self, pump: Pump, merge: ListingMerge, view: ClusterView) -> None:
        """Ask every node that must list its next page, and feed the pages to ``merge``."""
        wanted = merge.wanted()
        cursors = dict(wanted)
        for node, (key, index, inclusive) in wanted:
            items = list_request(key, index, inclusive=inclusive, limit=merge.page)
            pump.submit(PumpedExchange(pump, next(_tickets), node, Op.LIST, items))
        for event in self._wait_all(pump, len(wanted)):
            node = event.exchange.node
            if event.reply is None:
                log.warning(
                    "repair: %s cannot list (%s); its shards are unknown in this pass",
                    view.nodes[node].id,
                    event.error,
                )
                merge.fail(node)
                continue
            try:
                merge.add(node, parse_listing(event.reply.items, after=cursors[node]))
            except ProtocolError as exc:
                log.warning("repair: bad LIST reply from %s: %s", view.nodes[node].id, exc)
                merge.fail(node)

    def _wait_all(self, pump: Pump, count: int) -> list[Event]:
        """The outcomes of ``count`` submitted exchanges (those late past the timeout fail)."""
        events: list[Event] = []
        deadline = self._clock() + max(10.0, 5 * self.core.config.timeout_s)
        while len(events) < count and self._clock() < deadline:
            events += pump.wait(deadline)
        if len(events) < count:
            late = pump.abandon(self.core.config.timeout_s)
            timeout = TimeoutError("no answer in time")
            events += [Event(ex.ticket, ex, None, timeout) for ex in late]
        return events

    # -------------------------------------------------------------- repairing

    def _repair_batch(
        self,
        pump: Pump,
        view: ClusterView,
        batch: list[tuple[bytes, list[Held]]],
        progress: RepairProgress,
        throttle: _Throttle,
    ) -> None:
        now_ms = int(self._wall() * 1000) + int(self.options.min_ttl_s * 1000)
        live = [(key, shards) for key, shards in batch if max(h.expiry_ms for h in shards) > now_ms]
        keys = [BlockKey(key) for key, _ in live]
        up = self.core.up_mask(view)
        targets = view.targets(keys, up)[0] if keys else np.zeros((0, self.core.config.n), int)
        writable = np.zeros(len(view.nodes), bool)
        writable[: len(up)] = up
        plan = plan_blocks(live, targets, k=self.core.config.k, writable=writable)
        progress.blocks_complete += plan.complete
        progress.blocks_waiting += plan.waiting
        progress.blocks_unrecoverable += len(plan.unrecoverable)
        progress.shards_deferred += plan.deferred
        by_len: dict[int, list[BlockPlan]] = {}
        for block in plan.repairs:
            by_len.setdefault(block.payload_len, []).append(block)
        for payload_len, blocks in by_len.items():
            self._rebuild(pump, blocks, payload_len, progress, throttle)
        if self.options.prune and plan.stray_only:
            # Only blocks whose every target is still up: one that went down since the
            # listing may hold the copy the prune would leave as the only one.
            rows = {key: row for (key, _), row in zip(live, targets.tolist(), strict=True)}
            now_up = self.core.up_mask(view)
            prunable = [
                block
                for block in plan.stray_only
                if all(0 <= node < len(now_up) and now_up[node] for node in rows[block.key])
            ]
            self._prune(pump, prunable, progress)

    def _rebuild(
        self,
        pump: Pump,
        blocks: list[BlockPlan],
        payload_len: int,
        progress: RepairProgress,
        throttle: _Throttle,
    ) -> None:
        config = self.core.config
        k, n = config.k, config.n
        key_words = np.frombuffer(b"".join(b.key for b in blocks), "V16")
        stripes = np.array([b.stripe for b in blocks], np.uint64)
        assembly = LoadAssembly(
            key_words=key_words,
            stripes=stripes,
            out=np.empty((len(blocks), payload_len), np.uint8),
            k=k,
            n=n,
            payload_len=payload_len,
            codec=self.core.codec,
        )
        sent: list[GetExchange] = []
        try:
            # Data shards first (no decode when all are there), k sources per block.
            first = [sorted(b.sources, key=lambda s: (s[0] >= k, s[0]))[:k] for b in blocks]
            read = self._gather(pump, assembly, first, sent)
            everything = np.arange(len(blocks))
            assembly.seal(everything)
            verdicts = assembly.verify(everything.tolist())
            failing = [j for j, v in enumerate(verdicts) if not v.good]
            if failing:
                assembly.unseal(np.array(failing, np.int64))
                rest = [
                    [s for s in blocks[j].sources if s not in first[j]] if j in failing else []
                    for j in range(len(blocks))
                ]
                read += self._gather(pump, assembly, rest, sent)
                assembly.seal(everything)
                for j, verdict in zip(failing, assembly.verify(failing), strict=True):
                    verdicts[j] = verdict
        finally:
            assembly.close(gather_abort(self.core.transport, [*pump.abandon(), *sent]))
        progress.bytes_read += read
        throttle.spend(read)
        per_node: dict[int, list[tuple[int, int, int, bytes, bytes]]] = {}
        unsound: set[int] = set()
        for j, (block, verdict) in enumerate(zip(blocks, verdicts, strict=True)):
            if not verdict.good:
                progress.blocks_failed += 1
                log.warning("repair: block %s could not be rebuilt and verified", block.key.hex())
                continue
            indices = tuple(i for i, _node, _expect in block.writes)
            shards = assembly.repair_shards(j, indices)
            if indices and not shards:
                unsound.add(j)
                progress.blocks_failed += 1
                log.warning("repair: block %s has no sound header to copy", block.key.hex())
                continue
            for shard, (_i, node, expect) in zip(shards, block.writes, strict=True):
                per_node.setdefault(node, []).append(
                    (j, shard.index, expect, shard.header, shard.body)
                )
        written = self._put(pump, key_words, per_node)
        for j, block in enumerate(blocks):
            if verdicts[j].good and j not in unsound:
                ok = written.get(j, 0)
                progress.shards_written += ok
                if ok == len(block.writes):
                    progress.blocks_repaired += 1
                else:
                    progress.blocks_failed += 1
        nbytes = sum(HEADER_BYTES + len(s[4]) for shards in per_node.values() for s in shards)
        progress.bytes_written += nbytes
        throttle.spend(nbytes)

    def _gather(
        self,
        pump: Pump,
        assembly: LoadAssembly,
        wanted: Sequence[Sequence[tuple[int, int]]],
        sent: list[GetExchange],
    ) -> int:
        """GET (index, node) shards of each block into ``assembly``; bytes received."""
        per_node: dict[int, tuple[list[int], list[int]]] = {}
        for j, sources in enumerate(wanted):
            for index, node in sources:
                blocks, indices = per_node.setdefault(node, ([], []))
                blocks.append(j)
                indices.append(index)
        for node, (blocks, indices) in per_node.items():
            send = Send(
                next(_tickets), node, np.array(blocks, np.int64), np.array(indices, np.int64)
            )
            items = make_items(Op.GET, len(blocks), reply=False)
            items["key"] = assembly.key_words[send.blocks]
            items["index"] = send.indices
            items["stripe"] = assembly.stripes[send.blocks]
            exchange = GetExchange(pump, send, items, assembly, "")
            sent.append(exchange)
            pump.submit(exchange)
        nbytes = 0
        for event in self._wait_all(pump, len(per_node)):
            got = event.exchange
            if event.reply is None or not isinstance(got, GetExchange):
                continue
            if not got.landed_in_assembly and event.reply.header.data_len:
                continue
            items = event.reply.items
            if len(items) != len(got.send.blocks):
                continue
            nbytes += event.reply.header.data_len
            assembly.accept(
                got.send.blocks,
                got.send.indices,
                items["status"],
                items["length"].astype(np.int64),
            )
        return nbytes

    def _put(
        self,
        pump: Pump,
        key_words: npt.NDArray[np.void],
        per_node: dict[int, list[tuple[int, int, int, bytes, bytes]]],
    ) -> dict[int, int]:
        """PUT the rebuilt shards; shards stored per block."""
        asked: dict[int, list[int]] = {}
        for node, shards in per_node.items():
            items = make_items(Op.PUT, len(shards), reply=False)
            items["key"] = key_words[[s[0] for s in shards]]
            items["index"] = [s[1] for s in shards]
            items["expect"] = [s[2] for s in shards]
            items["length"] = [HEADER_BYTES + len(s[4]) for s in shards]
            data = [part for s in shards for part in (s[3], s[4])]
            exchange = PumpedExchange(pump, next(_tickets), node, Op.PUT, items, data)
            asked[exchange.ticket] = [s[0] for s in shards]
            pump.submit(exchange)
        written: dict[int, int] = {}
        for event in self._wait_all(pump, len(per_node)):
            if event.reply is None:
                continue
            blocks = asked.get(event.ticket, [])
            statuses = event.reply.items["status"].tolist()
            if len(statuses) != len(blocks):
                continue
            for j, status in zip(blocks, statuses, strict=True):
                if status == Status.OK:
                    written[j] = written.get(j, 0) + 1
        return written

    def _prune(self, pump: Pump, blocks: list[BlockPlan], progress: RepairProgress) -> None:
        """Delete stripe copies off their targets, for blocks complete on their targets."""
        per_node: dict[int, list[tuple[bytes, int, int]]] = {}
        for block in blocks:
            for index, node in block.strays:
                per_node.setdefault(node, []).append((block.key, block.stripe, index))
        for node, victims in per_node.items():
            items = make_items(Op.DELETE, len(victims), reply=False)
            items["key"] = [v[0] for v in victims]
            items["stripe"] = [v[1] for v in victims]
            items["index"] = [v[2] for v in victims]
            pump.submit(PumpedExchange(pump, next(_tickets), node, Op.DELETE, items))
        for event in self._wait_all(pump, len(per_node)):
            if event.reply is not None:
                progress.strays_deleted += int(np.count_nonzero(event.reply.items["status"] == 0))
