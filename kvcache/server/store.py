"""The shard store of one daemon: tenant-scoped batch operations over LMDB. No sockets.

All storage logic of a daemon lives in :class:`ShardStore`, with a Python API
(the network front end in :mod:`kvcache.server.handler` only decodes, calls
and encodes), so it is tested directly with a fake clock. Batch operations
take and return wire item records (:mod:`kvcache.wire`), which lets a batch
of hundreds of shards pass with numpy instead of a Python object per item.
The layout on disk is in :mod:`kvcache.server.records`; the environment, its
sync thread and its errors in :mod:`kvcache.server.lmdb_env`; the counters in
:mod:`kvcache.server.accounting`; whose shards make room in
:mod:`kvcache.server.eviction`; the retention rules (expiry of a write, when a
write may replace, slide on hit, merging two classes' expiries, pins, hint
clamping) in :mod:`kvcache.retention.decide`, which the trace simulator uses
too: this module only applies its decisions to LMDB records.

Rules, in short (``docs/spec/wire.md`` has them in full):

* One PUT batch is one write transaction: it all lands or none of it does
  (:meth:`ShardStore.put_many` writes several in one: group commit).
* A PUT never replaces a live shard of another stripe unless the item names
  that stripe in ``expect`` and the shard was stored ``replace_after_s`` ago or
  more (a writer still at work is never overwritten): concurrent writers of one
  block cannot both be acknowledged while leaving it unreadable (CONFLICT).
* Shard records live in append-only segment files (:mod:`kvcache.server.segments`);
  LMDB holds the index: where each record is, its retention, the expiry index and
  the counters. A PUT batch is appended with one ``pwritev`` before the index
  transaction that points at it commits (and synced before it, as ``sync`` says).
* GET replies are views of the segments' read-only maps (no copy), records that
  follow each other joined into one view.
* Space is reclaimed per segment: one with nothing live is unlinked, one mostly
  dead has its live records copied forward first (:meth:`ShardStore.compact`);
  no live shard is ever dropped to reclaim space.
* Hits do not write on the read path: they are collected and written in
  batches by :meth:`ShardStore.maintain`, and only when they move an expiry
  by at least ``touch_resolution_s``.

A store is owned by one thread; only :meth:`usage` and :attr:`counters` may be
read from others.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import operator
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import lmdb
import numpy as np
import numpy.typing as npt

from kvcache.credentials import TenantId
from kvcache.errors import CapacityError, ConfigError, ProtocolError, QuotaError, StorageError
from kvcache.net_loop import FileRange
from kvcache.retention import decide
from kvcache.retention.decide import Applied, WriteAction, clamp
from kvcache.retention.policy import RetentionPolicy
from kvcache.server.accounting import Deltas, UsageBook
from kvcache.server.config import DamagedFile, SyncMode, default_map_size
from kvcache.server.eviction import Quota, QuotaNeed, capacity_tiers, quota_needs
from kvcache.server.lmdb_env import LmdbEnvironment, storage_error
from kvcache.server.records import (
    BLOCK_LEN,
    CLASSES_KEY,
    EXPIRY_UNIT_MS,
    FORMAT,
    HIT_DTYPE,
    HIT_LEN,
    KEY_LEN,
    PARTITION_LEN,
    ROW,
    ROW_DTYPE,
    ROW_LEN,
    SEGMENT_EXPIRY_PREFIX,
    SEGMENT_PREFIX,
    TENANT_LEN,
    USAGE_PREFIX,
    CheckedPut,
    ClassTable,
    Row,
    check_put,
    class_field,
    expiry_entry,
    fresh_rows,
    get_key_rows,
    partition,
    quiet_get,
    row_expiry_ms,
    row_location,
    split_expiry_entry,
    split_rows,
)
from kvcache.server.removals import RemovalBook
from kvcache.server.segments import LOCATION, SegmentFiles, SegmentState, default_segment_bytes
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE
from kvcache.wire import GET_REFRESHED, NO_INDEX, NO_RETAIN, Op, Retain, Status, make_items

__all__ = ["COUNTERS", "Clock", "GetResult", "PutBatch", "ReplyTooLargeError", "ShardStore"]

log = logging.getLogger(__name__)

#: Seconds since the epoch; injected so tests step days without sleeping.
Clock = Callable[[], float]

_U64 = struct.Struct(">Q")
#: A row's size field (kvcache.server.records.ROW: after the index and the class id).
_SIZE = struct.Struct(">I")
#: The payload length field of a stored shard's header (see kvcache.shard.HEADER_DTYPE).
_PAYLOAD_LEN = struct.Struct("<I")
_PAYLOAD_LEN_AT: int = HEADER_DTYPE.fields["payload_len"][1]  # type: ignore[index]
_second = operator.itemgetter(1)
_LOC = struct.Struct(">IIII")
#: ShardStore._alive's answers for a live shard: no expiry moved, or this hit moved it.
_LIVE, _SLID = 1, 2
#: Where a record's header check sits (the last 4 bytes of the 104-byte header).
_CHECK_AT: int = HEADER_DTYPE.fields["header_check"][1]  # type: ignore[index]
#: A sealed segment whose live bytes fall below this fraction of it may be compacted.
_COMPACT_BELOW = 0.9
#: Bytes of records one compaction step copies at most.
_COMPACT_STEP = 8 << 20
#: Records one compaction step looks at most, moved or not: the step holds the writer and
#: the daemon's loop, and each record costs an index lookup (and a move). Bytes alone let
#: a step of small records run long: 8 MiB of 168-byte records was 0.75 s a step at 10^6
#: shards (``bench/scale.py``), in which the node answered nothing.
_COMPACT_STEP_RECORDS = 2048
#: While a drain is under way, compaction waits as long as the segment files stay within
#: this multiple of their budget.
_DRAIN_FIRST_SLACK = 1.25
#: Rows one DELETE item may change, for the room a write transaction needs (a whole-key
#: delete takes every shard of the key; a key's rows are packed 128 to a page).
_ROWS_A_DELETE = 16
#: Pending hits are written once this many have piled up, whatever their age.
_MAX_PENDING_TOUCHES = 8192

#: Names in :attr:`ShardStore.counters`.
COUNTERS = (
    "expired_shards",
    "expired_bytes",
    "evicted_shards",
    "evicted_bytes",
    "quota_evicted_shards",
    "quota_evicted_bytes",
    "touches_written",
    "hints_clamped",
    "pins_refused",
    "segments_dropped",
    "segments_reused",
    "segments_compacted",
    "segments_uncompactable",
    "rows_unreadable",
    "compacted_shards",
    "put_conflicts",
    "put_lookup_retries",
    "error_capacity",
    "error_quota",
    "error_map_full",
    "error_disk_full",
    "error_disk_io",
    "error_storage",
    "error_corrupted",
)


P = ParamSpec("P")
R = TypeVar("R")


#: Write failures in a row (I/O errors, not a full disk) after which /healthz says unhealthy.
IO_FAILURES_UNHEALTHY = 3


def _watch_damage(
    method: Callable[Concatenate[ShardStore, P], R],
) -> Callable[Concatenate[ShardStore, P], R]:
    """A store call whose LMDB errors become StorageErrors, and whose damage errors
    (``corrupted``: the file itself is bad) mark the store damaged (see ShardStore.damaged)."""

    @functools.wraps(method)
    def call(self: ShardStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except (lmdb.Error, OSError) as exc:
            error = self.failed(exc, method.__name__)
            self.counters[f"error_{error.kind}"] += 1
            raise error from exc
        except StorageError as exc:
            if exc.kind == "corrupted":
                self.mark_damaged(str(exc))
            raise

    return call


class ReplyTooLargeError(ProtocolError):
    """A GET would need a reply larger than the data limit: ask for fewer shards."""


@dataclass(frozen=True, slots=True)
class PutBatch:
    """One PUT request: whose it is, its item records and its data section."""

    tenant: TenantId
    items: npt.NDArray[np.void]
    data: memoryview
    #: The request's retention hint (its header's TTL and pin flags).
    retain: Retain = NO_RETAIN


class GetResult:
    """A GET's reply items and the found records, as views of the segment files.

    ``parts`` are the found records back to back, in item order (the reply's data
    section), with records adjacent on disk joined into one view (or one FileRange,
    sent with ``sendfile``): not one per item. Call :meth:`release` once the reply is
    sent.
    """

    __slots__ = ("_txn", "items", "parts")

    def __init__(
        self,
        items: npt.NDArray[np.void],
        parts: list[memoryview | FileRange],
        txn: lmdb.Transaction | None,
    ) -> None:
        self.items = items
        self.parts = parts
        self._txn = txn

    @property
    def nbytes(self) -> int:
        """Bytes of the records."""
        return int(self.items["length"].sum()) if len(self.items) else 0

    def release(self) -> None:
        """End the read transaction (idempotent); the views must not be used after."""
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
        self.parts = []


class ShardStore:
    """Shards of one node in LMDB, scoped by tenant, with per-class retention."""

    def __init__(
        self,
        path: str | Path,
        *,
        capacity_bytes: int,
        policy: RetentionPolicy | None = None,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        map_size_bytes: int | None = None,
        sync: SyncMode = SyncMode.PERIODIC,
        sync_interval_s: float = 5.0,
        sweep_batch: int = 512,
        touch_resolution_s: float = 60.0,
        touch_flush_s: float = 1.0,
        max_reply_bytes: int = 256 << 20,
        quotas: Mapping[TenantId, Quota] | None = None,
        max_readers: int = 256,
        replace_after_s: float = 10.0,
        damaged_file: DamagedFile = DamagedFile.QUARANTINE,
        segment_bytes: int | None = None,
        segment_budget_bytes: int | None = None,
        sendfile_min_bytes: int = 0,
        writemap: bool = True,
    ) -> None:
        if not 0 < low_watermark < high_watermark <= 1:
            raise ConfigError(f"bad watermarks low={low_watermark} high={high_watermark}")
        self.capacity_bytes = capacity_bytes
        #: Compaction keeps the segment files under this (default: the capacity).
        self.segment_budget = segment_budget_bytes or capacity_bytes
        self._high = int(capacity_bytes * high_watermark)
        self._low = int(capacity_bytes * low_watermark)
        # Set when usage reached the high watermark; background eviction then runs until
        # usage is down to the low one.
        self._draining = False
        # Set by the write that reached it: one batch is drained before the next request.
        self._crossed = False
        self._clock = clock
        #: When pending hits are due (``touch_flush_s``): a clock of its own, injected too,
        #: so a test steps the flusher without sleeping.
        self._monotonic = monotonic
        self._sweep_batch = sweep_batch
        self._resolution_ms = max(1, int(touch_resolution_s * 1000))
        self._touch_flush_s = touch_flush_s
        self._max_reply = max_reply_bytes
        self._replace_after_ms = int(replace_after_s * 1000)
        self.quotas: Mapping[TenantId, Quota] = quotas or {}
        self._lmdb = LmdbEnvironment(
            path,
            map_size=map_size_bytes or default_map_size(capacity_bytes),
            sync=sync,
            sync_interval_s=sync_interval_s,
            max_readers=max_readers,
            damaged_file=damaged_file,
            writemap=writemap,
        )
        self.path = self._lmdb.path
        #: Why the data file found at start was moved aside (None: it was whole).
        self.quarantined = self._lmdb.quarantined
        #: Why this store takes no more writes: LMDB said its file is damaged at run time
        #: (MDB_CORRUPTED and the like). PUTs are then refused (StorageError, answered
        #: UNAVAILABLE), /healthz says unhealthy, and the daemon leaves the membership.
        self.damaged: str | None = None
        #: Called once, with the reason, when the store is first found damaged.
        self.on_damaged: Callable[[str], None] | None = None
        try:
            self.segments = SegmentFiles(
                self._lmdb.path,
                segment_bytes=segment_bytes or default_segment_bytes(capacity_bytes),
                sync_each_write=sync is SyncMode.COMMIT,
                sendfile_min_bytes=sendfile_min_bytes,
                monotonic=monotonic,
            )
        except (OSError, ValueError) as exc:
            self._lmdb.close()
            raise StorageError(f"cannot use the segment files of {path}: {exc}") from exc
        self._lmdb.sync_hook = self._sync_durably
        self._env = self._lmdb.env
        self._index = self._lmdb.index
        #: Stored class names by the ids the index rows carry.
        self.classes = ClassTable()
        self._expiry = self._lmdb.expiry
        self._meta = self._lmdb.meta
        #: (expiry_ms, class) a hit asked for, per storage key, not yet written.
        self._pending: dict[bytes, tuple[int, str]] = {}
        self._pending_since = 0.0
        self._next_sweep_ms = 0
        #: The segment being compacted: (segment, batch offset, record offset) to go on at.
        self._compacting: tuple[int, int, int] | None = None
        #: Segments whose live bytes fell since reclaim() last looked (it looks at no other).
        self._shrunk: set[int] = set()
        self._sealed_upto = -1
        #: Sealed segments under 90 % live: candidates for compaction.
        self._sparse: set[int] = set()
        #: Segments a whole compaction pass left live records in: their walk stopped at a
        #: damaged batch head, or a record's length disagreed with its row. Never picked
        #: again (each pass would move nothing more, and the loop would run them back to
        #: back); their records stay readable by their rows, and go as the rows do.
        self._uncompactable: set[int] = set()
        #: Write transactions failed with I/O errors since the last one that committed.
        self._io_failures = 0
        self._io_failure: str | None = None
        #: The latest expiry (ms) appended to each segment, as its meta row keeps it (a
        #: segment written before they were kept is not in it): see :meth:`_goes_first`.
        self._latest_expiry: dict[int, int] = {}
        #: The node's earliest live expiry as reclaim() last read it, and when (monotonic s).
        self._head_seen: tuple[int, float] = (0, -math.inf)
        #: Event counters (expired/evicted shards and bytes, errors by kind). The key set
        #: is fixed here, so another thread may copy the dict at any time.
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.book = UsageBook()
        #: Removals by (tenant, class, cause), with ages: whether the retention promise held.
        self.removals = RemovalBook()
        self.policy = policy or RetentionPolicy()
        try:
            self._load_meta()
        except BaseException:
            self._lmdb.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Write pending hits, sync, and close the environment (idempotent)."""
        if self._lmdb.closed:
            return
        try:
            self.flush_touches()
        finally:
            try:
                self.segments.sync()
            finally:
                try:
                    self.segments.close()
                finally:  # the index is closed (and synced) even when the files are gone
                    self._lmdb.close()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sync_durably(self) -> None:
        """The periodic sync (its own thread): the segments, then the index. Most of the
        segments' bytes are synced while writers go on; then, with writers held out
        between an append and its commit, what they appended meanwhile and the index (a
        few MB at most: records are not in it). The unheld sync runs up to three times,
        each taking what came in during the one before, so what writers wait for is small."""
        for _ in range(3):
            self.segments.sync()
        with self.segments.writing:
            self.segments.sync()
            self._env.sync(True)

    def failed(self, exc: BaseException, what: str) -> StorageError:
        """The StorageError for an LMDB or OS exception; a damaged file marks the store."""
        error = storage_error(exc, what)
        if error.kind == "corrupted":
            self.mark_damaged(str(error))
        elif error.kind in ("disk_io", "storage"):
            self._io_failures += 1
            self._io_failure = str(error)
        return error

    @property
    def io_failing(self) -> str | None:
        """Why writes keep failing with I/O errors (not a full disk, which still serves
        reads), once enough failed in a row with no write succeeding since: the file
        system shut down, the data directory removed. ``/healthz`` then says unhealthy."""
        return self._io_failure if self._io_failures >= IO_FAILURES_UNHEALTHY else None

    def _wrote(self) -> None:
        """A write transaction committed: writes work."""
        self._io_failures = 0
        self._io_failure = None

    def mark_damaged(self, reason: str) -> None:
        """Take no more writes (see :attr:`damaged`); logged and reported once."""
        if self.damaged is not None:
            return
        self.damaged = reason
        log.error("LMDB file of %s is damaged (%s): refusing PUTs from now on", self.path, reason)
        if self.on_damaged is not None:
            self.on_damaged(reason)

    def now_ms(self) -> int:
        """The injected clock, in milliseconds."""
        return int(self._clock() * 1000)

    # ------------------------------------------------------------------ native reads

    @property
    def max_reply_bytes(self) -> int:
        """The most bytes of records one GET reply may carry (else TOO_LARGE)."""
        return self._max_reply

    @property
    def writemap(self) -> bool:
        """Whether LMDB writes through its map (see kvcache.server.lmdb_env)."""
        return self._lmdb.writemap

    @property
    def map_size(self) -> int:
        """The LMDB map size (a second, read-only handle on the file must map as much)."""
        return self._lmdb.map_size

    def realtime_offset_s(self) -> float | None:
        """Seconds the store's clock runs ahead of wall time (``time.time``), or None when
        it is some other clock (a test's): the native data plane reads wall time itself and
        answers only while this is known."""
        clock = self._clock
        if clock is time.time:
            return 0.0
        offset = getattr(clock, "realtime_offset_s", None)
        return offset() if callable(offset) else None

    @property
    def touches_pending(self) -> bool:
        """Whether hits wait to be written. Their slides only ever move an expiry later, so
        a row live by its own expiry is live either way; a row past it may be alive by one
        (what a read from the index rows alone must not decide)."""
        return bool(self._pending)

    def quiet_delta_ms(self, traffic_class: str) -> int:
        """How far past now a shard's expiry must lie for a GET naming ``traffic_class``
        (no TTL hint) to be a plain read, with no slide due: :meth:`get`'s quiet bound."""
        hit = self._hit(traffic_class)
        reach = hit.ttl_s if hit is not None else self.policy.max_ttl_s
        return decide.quiet_above(self.policy, 0, self._resolution_ms, reach_s=reach)

    # ------------------------------------------------------------------ policy

    def set_policy(self, policy: RetentionPolicy) -> None:
        """Use ``policy`` from now on and persist it (it then wins over the config file).

        Stored expiries are kept: a new TTL applies from each shard's next write or hit.
        """
        with self._lmdb.begin_write(64) as txn:
            txn.put(b"policy", policy.to_json(), db=self._meta)
        self.policy = policy

    def clear_policy(self, fallback: RetentionPolicy) -> None:
        """Forget a persisted policy and use ``fallback`` (the config file's) again."""
        with self._lmdb.begin_write(64) as txn:
            txn.delete(b"policy", db=self._meta)
        self.policy = fallback

    # ------------------------------------------------------------------ PUT

    def put(self, tenant: TenantId, items: npt.NDArray[np.void], data: memoryview) -> Any:
        """Store one PUT batch of ``tenant`` in one transaction; per-item status records."""
        reply = self.put_many([PutBatch(tenant, items, data)])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def put_many(self, batches: Sequence[PutBatch]) -> list[npt.NDArray[np.void] | ProtocolError]:
        """Store several PUT batches in ONE transaction (group commit); a reply per batch.

        Each batch's items are checked on their own and fail only themselves (a
        batch whose data does not match its items gets its ProtocolError back
        instead of a reply). What passed is written together; if that
        transaction fails, each batch is written in a transaction of its own, so
        a failure stays with its batch (and tenant): a batch that fails alone
        gets NO_SPACE for its passing items (INTERNAL for a store error, QUOTA
        for a tenant over its quota) and nothing of it is stored.
        """
        if self.damaged is not None:
            raise StorageError(
                f"this node's LMDB file is damaged ({self.damaged}); it takes no writes until "
                "restarted on a repaired or fresh data file",
                kind="corrupted",
            )
        checked: list[CheckedPut | ProtocolError] = []
        for batch in batches:
            try:
                one = check_put(batch.tenant, batch.items, batch.data)
                checked.append(
                    one if batch.retain is NO_RETAIN else replace(one, retain=batch.retain)
                )
            except ProtocolError as exc:
                checked.append(exc)
        passed = [c for c in checked if not isinstance(c, ProtocolError) and c.keys]
        if passed:
            for c, failed in zip(passed, self._write_isolated(passed), strict=True):
                if failed is not None:
                    c.status[c.positions] = failed
        replies: list[npt.NDArray[np.void] | ProtocolError] = []
        for outcome in checked:
            if isinstance(outcome, ProtocolError):
                replies.append(outcome)
                continue
            reply = make_items(Op.PUT, len(outcome.status), reply=True)
            reply["status"] = outcome.status
            replies.append(reply)
        return replies

    def _write_isolated(self, passed: list[CheckedPut]) -> list[Status | None]:
        """Per batch: the status its items get (None: stored). One transaction for all;
        if it fails, each batch is written on its own, so one batch's failure (a tenant
        at its quota, above all) fails only that batch, never the other tenants' PUTs
        that arrived with it (issue 18: 17.4 % of a tenant's PUT items came back QUOTA
        while another tenant flooded past its quota)."""
        if len(passed) == 1:
            return [self._write_checked(passed)]
        if self._write_checked(passed, quiet=True) is None:
            return [None] * len(passed)
        return [self._write_checked([c]) for c in passed]

    def _write_checked(self, passed: list[CheckedPut], *, quiet: bool = False) -> Status | None:
        """Write checked batches in one transaction; the status every item gets if it fails
        (``quiet``: neither counted nor logged, as the caller tries again batch by batch)."""
        try:
            self._write(passed)
        except StorageError as exc:
            if exc.kind == "corrupted":
                self.counters["error_corrupted"] += 1
                self.mark_damaged(str(exc))
                raise
            if quiet:
                return Status.INTERNAL
            self.counters[f"error_{exc.kind}"] += 1
            if exc.kind in ("capacity", "quota"):
                log.warning("PUT refused: %s", exc)
            else:
                log.error("PUT failed (%s): %s", exc.kind, exc)
            return {"quota": Status.QUOTA, "storage": Status.INTERNAL}.get(
                exc.kind, Status.NO_SPACE
            )
        return None

    def _write(self, passed: list[CheckedPut]) -> None:
        # Pins first: a batch whose pin its tenant's pin quota holds counts against the
        # tenant's total quota, not its class quota (docs/spec/retention.md, "Hints"); it
        # was charged to the class, evicting the tenant's unpinned blocks or refused QUOTA.
        pins = self._pin_rooms(passed)
        incoming = self._incoming(passed, pins)
        total = sum(sum(v.values()) for v in incoming.values())
        if self.book.used + total > self._high or any(
            self._quota_needs(TenantId(t), per_class)[1] for t, per_class in incoming.items()
        ):
            # Room is made only for what will grow the store: a shard that has a row here
            # is refused CONFLICT (a re-store of stored blocks: every shard of it) or
            # replaces one of about its size. All counted, a re-store of a conversation's
            # prefix evicted as many bytes of other blocks as it sent, and wrote none.
            # A batch's first shard tells a re-store (its earliest block is held) from new
            # blocks, in one lookup: the whole batch is looked up only then (all of it cost
            # 140 us a PUT of 128 shards of new blocks on a full node).
            try:
                with self._env.begin() as txn:
                    index = self._index
                    firsts = (txn.get(c.keys[0][:BLOCK_LEN], db=index) for c in passed)
                    held = (
                        self._rows_of(txn, [k for c in passed for k in c.keys])
                        if any(row is not None for row in firsts)
                        else {}
                    )
            except lmdb.Error as exc:
                raise self.failed(
                    exc, f"looking up the rows of {len(passed)} PUT batch(es)"
                ) from exc
            if held:
                incoming = self._incoming(passed, pins, held=held)
                total = sum(sum(v.values()) for v in incoming.values())
        for tenant, per_class in incoming.items():
            self._make_room_for_quota(TenantId(tenant), per_class)
        self._make_room(
            total, writer=TenantId(next(iter(incoming))) if len(incoming) == 1 else None
        )
        shards = sum(len(c.keys) for c in passed)
        self._lmdb.preallocate(shards * 128)  # index rows only (without writemap)
        now = self.now_ms()
        resolved: dict[tuple[str, Retain], tuple[str, int]] = {}
        # The usual PUT stores blocks this node holds no row of. Then the lookup for earlier
        # rows is skipped: each block's first row goes in with no-overwrite, and if a block
        # had a row after all (a racing writer, a repair, a retry), that transaction is
        # undone and the batch is written again the careful way, lookup first.
        try:
            written = self._write_attempt(passed, shards, now, resolved, pins, optimistic=True)
        except _HadRows:
            self.counters["put_lookup_retries"] += 1
            written = self._write_attempt(passed, shards, now, resolved, pins, optimistic=False)
        deltas, status_updates, earliest = written
        self._wrote()
        self._apply(deltas)
        self._next_sweep_ms = min(self._next_sweep_ms, earliest)
        for c, conflicts in status_updates:
            c.status[[c.positions[j] for j in conflicts]] = Status.CONFLICT
            self.counters["put_conflicts"] += len(conflicts)

    def _incoming(
        self,
        passed: list[CheckedPut],
        pins: dict[int, bool],
        *,
        held: dict[bytes, bytes] | None = None,
    ) -> dict[bytes, dict[str, int]]:
        """Bytes ``passed`` adds per tenant and stored class; with ``held`` (the rows of its
        keys this node has), a shard with a row in the partition it is written to counts
        only what it is larger than that row (one moving partitions counts whole there)."""
        incoming: dict[bytes, dict[str, int]] = {}
        names = self.classes.names
        for c in passed:
            per = incoming.setdefault(c.keys[0][:TENANT_LEN], {})
            pinned = pins.get(id(c), False)
            if held is None:
                by_class = _bytes_by_class(c)
            else:
                by_class = {}
                for skey, record, cls in zip(c.keys, c.records, c.classes, strict=True):
                    grows = len(record)
                    raw = held.get(skey)
                    if raw is not None:
                        _index, cid, size = ROW.unpack(raw)[:3]
                        name = decide.stored_class(self.policy.resolve(cls), pin=pinned)
                        if names[cid] == name:
                            grows = max(0, grows - size)
                    by_class[cls] = by_class.get(cls, 0) + grows
            for cls, size in by_class.items():
                name = self.policy.resolve(cls)
                if pinned:
                    name = decide.stored_class(name, pin=True)  # its partition: no class quota
                per[name] = per.get(name, 0) + size
        return incoming

    def _write_attempt(
        self,
        passed: list[CheckedPut],
        shards: int,
        now: int,
        resolved: dict[tuple[str, Retain], tuple[str, int]],
        pins: dict[int, bool],
        *,
        optimistic: bool,
    ) -> tuple[Deltas, list[tuple[CheckedPut, list[int]]], int]:
        """One transaction storing ``passed`` (segment append and index rows); returns its
        deltas, the shards refused as conflicts (per batch) and the earliest expiry written.
        ``optimistic``: without the lookup for earlier rows (:func:`_put_new_rows`); raises
        :class:`_HadRows`, with the transaction and the append undone, when a block had one."""
        replace_after_ms = self._replace_after_ms
        classes = self.classes
        deltas = Deltas()
        status_updates: list[tuple[CheckedPut, list[int]]] = []
        appended: tuple[int, SegmentState] | None = None
        cols = _Columns()
        # Pending hits a rewrite took over: dropped once the transaction commits, not before
        # (an attempt undone, _HadRows above all, must leave them for the retry to merge:
        # a group commit of two batches of one shard lost a hit's slide that way).
        settled: list[bytes] = []
        try:
            with self.segments.writing, self._lmdb.begin_write(shards) as txn:
                # Shards written earlier in this transaction: (expiry, size, stripe, class).
                staged: dict[bytes, tuple[int, int, int, str]] = {}
                expiry_rows: list[tuple[bytes, bytes]] = []
                rewritten = False
                earliest = 2**63
                for c in passed:
                    old = {} if optimistic else self._rows_of(txn, c.keys)
                    if not old and self._fresh_batch(c, staged):
                        # The common PUT: every shard new. Rows built as columns; what later
                        # batches of this transaction must see is staged (none follow the last).
                        stage = c is not passed[-1]
                        earliest = min(
                            earliest,
                            self._write_fresh(c, now, resolved, pins, cols,
                                              staged if stage else None, expiry_rows, deltas),
                        )  # fmt: skip
                        continue
                    conflicts: list[int] = []
                    tenant = c.keys[0][:TENANT_LEN]
                    for j, (skey, record, cls, stripe, expect) in enumerate(
                        zip(c.keys, c.records, c.classes, c.stripes, c.expects, strict=True)
                    ):
                        if (cls, c.retain) not in resolved:
                            resolved[cls, c.retain] = self._write_retention(cls, now, c, pins)
                        name, expiry = resolved[cls, c.retain]
                        prior = staged.get(skey)
                        raw = None if prior is not None else old.get(skey)
                        if raw is not None:
                            rec = Row.unpack(raw, classes)
                            prior = (rec.expiry_ms, rec.size, rec.stripe, rec.traffic_class)
                            written = rec.written_ms
                        else:
                            written = now
                        if prior is not None:
                            p_expiry, p_size, p_stripe, p_cls = prior
                            current = self._current(skey, p_expiry, p_cls)
                            action = decide.write_action(
                                stored_expiry_ms=current[0],
                                stored_stripe=p_stripe,
                                stored_written_ms=written,
                                stripe=stripe,
                                expect=expect,
                                now_ms=now,
                                replace_after_ms=replace_after_ms,
                            )
                            if action is WriteAction.CONFLICT:
                                conflicts.append(j)
                                continue
                            deltas.add(partition(tenant, p_cls), -p_size, -1)
                            if raw is None:  # written earlier in this transaction
                                expiry_rows.remove(expiry_entry(skey, p_cls, p_expiry))
                                rewritten = True
                            else:
                                deltas.add_segment(rec.seg, -rec.size, -1)
                                txn.delete(skey[:BLOCK_LEN], raw, db=self._index)
                                txn.delete(*expiry_entry(skey, p_cls, p_expiry), db=self._expiry)
                                del old[skey]
                            if action is WriteAction.REPEAT:
                                # A repeat of the same write keeps the later expiry and its class.
                                expiry, name = decide.merge(current, (expiry, name))
                            settled.append(skey)
                        size = len(record)
                        cols.add(skey, record, classes.id_of(name), expiry, stripe)
                        staged[skey] = (expiry, size, stripe, name)
                        expiry_rows.append(expiry_entry(skey, name, expiry))
                        deltas.add(partition(tenant, name), size, 1)
                        earliest = min(earliest, expiry)
                    if conflicts:
                        status_updates.append((c, conflicts))
                if cols.keys:
                    if rewritten:  # a key twice in this transaction: only its last record
                        cols.keep_last()
                    seg, first, prior_state = self.segments.append(cols.keys, cols.records)
                    appended = (seg, prior_state)
                    self.counters["segments_reused"] = self.segments.reused
                    self._note_expiry(txn, seg, max(cols.expiry))
                    lengths = np.fromiter(map(len, cols.records), np.int64, len(cols.records))
                    rows = fresh_rows(
                        cols.keys,
                        class_ids=np.array(cols.class_ids, np.uint16),
                        sizes=lengths,
                        expiry_ms=np.array(cols.expiry, np.uint64),
                        stripes=np.array(cols.stripes, np.uint64),
                        written_ms=now,
                        seg=seg,
                        offsets=first + np.cumsum(lengths) - lengths,
                    )
                    blocks = [k[:BLOCK_LEN] for k in cols.keys]
                    if optimistic:
                        _put_new_rows(txn.cursor(db=self._index), blocks, rows)
                    else:
                        txn.cursor(db=self._index).putmulti(zip(blocks, rows, strict=True))
                    txn.cursor(db=self._expiry).putmulti(expiry_rows)
                    self._write_usage(txn, deltas, appended=seg)
        except (lmdb.Error, OSError) as exc:
            if appended is not None:
                self.segments.rewind(*appended)
            raise self.failed(exc, f"storing {len(passed)} PUT batch(es)") from exc
        except BaseException:  # _HadRows too: the retry appends again
            if appended is not None:
                self.segments.rewind(*appended)
            raise
        for skey in settled:
            self._pending.pop(skey, None)
        return deltas, status_updates, earliest

    @staticmethod
    def _fresh_batch(c: CheckedPut, staged: dict[bytes, tuple[int, int, int, str]]) -> bool:
        """No key of ``c`` repeats, in it or in what this transaction wrote already."""
        keys = set(c.keys)
        return len(keys) == len(c.keys) and (not staged or keys.isdisjoint(staged))

    def _write_fresh(
        self,
        c: CheckedPut,
        now: int,
        resolved: dict[tuple[str, Retain], tuple[str, int]],
        pins: dict[int, bool],
        cols: _Columns,
        staged: dict[bytes, tuple[int, int, int, str]] | None,
        expiry_rows: list[tuple[bytes, bytes]],
        deltas: Deltas,
    ) -> int:
        """Columns of a batch of new shards (no previous record of any); returns the earliest
        expiry written. What it writes goes into ``staged`` too, unless that is None."""
        earliest = 2**63
        groups: dict[str, list[int]] = {}
        if c.classes.count(c.classes[0]) == len(c.classes):
            groups[c.classes[0]] = list(range(len(c.classes)))  # one class: the usual batch
        else:
            for j, cls in enumerate(c.classes):
                groups.setdefault(cls, []).append(j)
        sizes = list(map(len, c.records))
        tenant = c.keys[0][:TENANT_LEN]
        whole = len(groups) == 1
        for cls, idx in groups.items():
            if (cls, c.retain) not in resolved:
                resolved[cls, c.retain] = self._write_retention(cls, now, c, pins)
            name, expiry = resolved[cls, c.retain]
            keys = c.keys if whole else [c.keys[j] for j in idx]
            part_sizes = sizes if whole else [sizes[j] for j in idx]
            stripes = c.stripes if whole else [c.stripes[j] for j in idx]
            n = len(idx)
            cols.keys.extend(keys)
            cols.records.extend(c.records if whole else [c.records[j] for j in idx])
            cols.class_ids.extend(itertools.repeat(self.classes.id_of(name), n))
            cols.expiry.extend(itertools.repeat(expiry, n))
            cols.stripes.extend(stripes)
            if staged is not None:
                staged.update(
                    zip(keys, zip(itertools.repeat(expiry), part_sizes, stripes,
                                  itertools.repeat(name), strict=False), strict=True)
                )  # fmt: skip
            ekey = tenant + class_field(name) + _U64.pack(expiry)
            expiry_rows.extend(zip(itertools.repeat(ekey), [k[TENANT_LEN:] for k in keys],
                                   strict=False))  # fmt: skip
            deltas.add(partition(tenant, name), sum(part_sizes), n)
            earliest = min(earliest, expiry)
        return earliest

    def _quota_needs(
        self, tenant: TenantId, incoming: dict[str, int]
    ) -> tuple[dict[bytes, int], list[QuotaNeed]]:
        """The tenant's partitions (bytes each) and what it must free for ``incoming``."""
        quota = self.quotas.get(tenant)
        if quota is None or (quota.total is None and not quota.classes):
            return {}, []
        parts = {p: self.book.partition_bytes(p) for p in self.book.partitions(tenant)}
        class_bytes = {p[TENANT_LEN:].rstrip(b"\x00").decode(): n for p, n in parts.items()}
        needs = quota_needs(
            quota,
            tenant_bytes=sum(parts.values()),
            class_bytes=class_bytes,
            incoming=incoming,
        )
        return parts, needs

    def _make_room_for_quota(self, tenant: TenantId, incoming: dict[str, int]) -> None:
        """Evict the tenant's own shards so ``incoming`` fits its quotas, or raise QuotaError."""
        parts, needs = self._quota_needs(tenant, incoming)
        for need in needs:
            scope = (
                list(parts)
                if need.traffic_class is None
                else [partition(tenant, need.traffic_class)]
            )
            freed = self._evict_from(scope, need.nbytes, counter="quota_evicted")
            if freed < need.nbytes:
                what = (
                    "its quota"
                    if need.traffic_class is None
                    else (f"its quota for class {need.traffic_class!r}")
                )
                raise QuotaError(
                    f"tenant {tenant.hex()} is at {what}: {need.nbytes} bytes must go and only "
                    f"{freed} could be evicted"
                )

    def _make_room(self, incoming: int, *, writer: TenantId | None) -> None:
        """Evict just enough for ``incoming`` bytes to fit under the high watermark.

        The rest of the way down to the low watermark is background work: one bounded
        batch once the turn's PUTs are answered (:meth:`drain_after_crossing`), then
        :meth:`maintain`, between requests, so no request waits for a large eviction.
        """
        if self.book.used + incoming <= self._high:
            return
        if incoming > self.capacity_bytes:
            raise CapacityError(
                f"batch of {incoming} bytes exceeds the node capacity of {self.capacity_bytes}"
            )
        self._draining = self._crossed = True
        self.evict(max(0, self._high - incoming), writer=writer)
        if self.book.used + incoming > self.capacity_bytes:
            raise CapacityError(
                f"no room for {incoming} bytes: {self.book.used} of {self.capacity_bytes} used "
                "after eviction"
            )

    # ------------------------------------------------------------------ GET / HAS

    @_watch_damage
    def get(
        self,
        tenant: TenantId,
        items: npt.NDArray[np.void],
        traffic_class: str = "",
        retain: Retain = NO_RETAIN,
    ) -> GetResult:
        """Per-item status and length, and the found records as views (no copy).

        An item whose ``stripe`` is nonzero and differs from the stored one is
        NOT_FOUND. A hit slides the shard's expiry to ``now + ttl(class)`` (the
        shard's own class when none is given) when a slide is due, and its reply
        item then carries :data:`~kvcache.wire.GET_REFRESHED` (the reader
        refreshes the block's other shards); an expired shard is NOT_FOUND even
        before the sweeper removes it. The caller must release the result.
        """
        raw_keys = get_key_rows(tenant, items)
        n = len(items)
        reply = make_items(Op.GET, n, reply=True)  # all OK (0), length 0
        now = self.now_ms()
        # Above this expiry a hit is live and no class's TTL could slide it by a
        # whole touch resolution: no bookkeeping, only the expiry test.
        policy = self.policy
        hit = self._hit(traffic_class, retain)
        quiet_above = decide.quiet_above(
            policy,
            now,
            self._resolution_ms,
            reach_s=hit.ttl_s if hit is not None else policy.max_ttl_s,
        )
        ttl_hint = retain.ttl_s
        stripes = items["stripe"]
        # Index rows are small (32 bytes): copied out, they cost less than py-lmdb's buffer
        # objects, which it must invalidate one by one (bufviewlist_release was a fifth of a
        # GET's store time, py-spy).
        with self._env.begin() as txn:
            parts = self._get_quiet(txn, items, raw_keys, quiet_above, reply)
            if parts is not None:  # every item a live hit of the wanted stripe, no slide due
                return GetResult(reply, parts, None)
            keys = split_rows(raw_keys, KEY_LEN)
            wanted = stripes.tolist()
            locations: list[bytes] = []
            hits: list[int] = []
            slid: list[int] = []
            # The hits' expiry slides, recorded only once the reply is known to fit: a GET
            # refused TOO_LARGE changes no stored state (docs/spec/wire.md, section 4).
            slides: dict[bytes, tuple[int, str]] = {}
            rows = self._rows_of(txn, keys)
            unpack = ROW.unpack
            segments = self.segments.state
            for i, key in enumerate(keys):
                raw = rows.get(key)
                if raw is None:
                    continue
                _index, cid, size, expiry, stripe, _written, seg, off = unpack(raw)
                if wanted[i] and stripe != wanted[i]:
                    continue
                if seg not in segments:  # a damaged row: this item only is NOT_FOUND
                    self.counters["rows_unreadable"] += 1
                    continue
                if expiry <= quiet_above:
                    live = self._alive(key, expiry, cid, size, now, hit, ttl_hint, slides=slides)
                    if not live:
                        continue
                    if live == _SLID:
                        slid.append(i)
                locations.append(_LOC.pack(seg, off, size, 0))
                hits.append(i)
        found = np.frombuffer(b"".join(locations), LOCATION)
        sizes = found["len"]
        self._check_reply_size(sizes.tolist(), hits)
        if slides:
            if not self._pending:
                self._pending_since = self._monotonic()
            self._pending.update(slides)
        if len(hits) < n:
            reply["status"] = Status.NOT_FOUND
            reply["status"][hits] = Status.OK
        reply["length"][hits] = sizes
        if slid:
            reply["flags"][slid] = GET_REFRESHED
        return GetResult(reply, self.segments.views(found), None)

    def _check_reply_size(self, sizes: list[int], positions: list[int] | None = None) -> None:
        if sum(sizes) <= self._max_reply:  # the usual case, without a Python step per item
            return
        total = 0
        for j, size in enumerate(sizes):
            total += size
            if total > self._max_reply:
                i = j if positions is None else positions[j]
                raise ReplyTooLargeError(
                    f"GET reply would exceed {self._max_reply} bytes at item {i}: "
                    "ask for fewer shards per request"
                )

    def _get_quiet(
        self,
        txn: lmdb.Transaction,
        items: npt.NDArray[np.void],
        raw_keys: bytes,
        quiet_above: int,
        reply: npt.NDArray[np.void],
    ) -> list[memoryview | FileRange] | None:
        """The reply's data section if every asked shard (storage keys ``raw_keys``, one
        per item) is a live hit of the wanted stripe that needs no expiry slide, with
        ``reply``'s lengths set; else None, ``reply`` untouched (the caller then takes the
        per-item path).

        The common GET, done without a Python step per item beyond slicing the block keys:
        one ``getmulti`` of the blocks' index rows, then :func:`records.quiet_get` (one
        native call) checks them and finds the runs of adjacent records to send.
        """
        n = len(items)
        if not n:
            return None
        if self._pending and not self._pending.keys().isdisjoint(split_rows(raw_keys, KEY_LEN)):
            return None
        blocks = split_rows(raw_keys, KEY_LEN, BLOCK_LEN)
        if n > 1 and len(set(blocks)) != n:  # several shards of a block on this node
            blocks = list(dict.fromkeys(blocks))
        found = self._block_rows(txn, blocks)
        quiet = quiet_get(items, raw_keys, found, quiet_above, reply)
        if quiet is None:
            return None
        runs, total = quiet
        segs, starts, ends = runs.T.tolist()
        if not self.segments.state.keys() >= set(segs):
            return None  # a row names a segment there is not: the per-item path skips it
        if total > self._max_reply:
            self._check_reply_size(reply["length"].tolist())
        return self.segments.run_views(segs, starts, ends)

    @_watch_damage
    def has(self, tenant: TenantId, items: npt.NDArray[np.void]) -> npt.NDArray[np.void]:
        """One record (ordinal, shard index, stripe id) per live shard of each asked key."""
        # The match path of every request: the keys sorted (neighbours share B-tree pages),
        # one C-level getmulti answers them all (every row of each, in one buffer), and the
        # answer is mapped back to the asked order and checked as numpy columns.
        n = len(items)
        if not n:
            return make_items(Op.HAS, 0, reply=True)
        keys16 = np.ascontiguousarray(items["key"]).view(np.uint8).reshape(n, 16)
        hi = np.ascontiguousarray(keys16[:, :8]).view(">u8").ravel()
        lo = np.ascontiguousarray(keys16[:, 8:]).view(">u8").ravel()
        order = np.lexsort((lo, hi))
        hs = hi[order]
        blocks = np.empty((n, BLOCK_LEN), np.uint8)
        blocks[:, :TENANT_LEN] = np.frombuffer(tenant, np.uint8)
        blocks[:, TENANT_LEN:] = keys16[order]
        asked: list[bytes] = blocks.view(f"V{BLOCK_LEN}").ravel().tolist()
        now = self.now_ms()
        with self._env.begin() as txn:
            found = self._block_rows(txn, asked if n < 2 or (hs[1:] != hs[:-1]).all()
                                     else list(dict.fromkeys(asked)))  # fmt: skip
        m = len(found) // HIT_LEN
        if not m:
            return make_items(Op.HAS, 0, reply=True)
        raw = np.frombuffer(found, np.uint8).reshape(m, HIT_LEN)
        rows = raw.view(HIT_DTYPE).reshape(m)["row"]
        rh = np.ascontiguousarray(raw[:, TENANT_LEN : TENANT_LEN + 8]).view(">u8").ravel()
        rl = np.ascontiguousarray(raw[:, TENANT_LEN + 8 : BLOCK_LEN]).view(">u8").ravel()
        pos = np.searchsorted(hs, rh)
        if (n > 1 and not (hs[1:] != hs[:-1]).all()) or not (
            (hs[pos] == rh).all() and (lo[order][pos] == rl).all()
        ):
            # A key asked twice, or two keys sharing their first 8 bytes: by dictionary.
            return self._has_general(_prefixes(tenant, items), raw, rows, now)
        ordinals = order[pos].astype(np.uint64)
        live = self._live_rows(raw, rows, now)
        keep = np.flatnonzero(live)
        keep = keep[np.argsort(ordinals[keep], kind="stable")]  # in the asked order
        reply = make_items(Op.HAS, len(keep), reply=True)
        if len(keep):
            reply["ordinal"] = ordinals[keep]
            reply["index"] = rows["index"][keep]
            reply["stripe"] = rows["stripe"][keep]
        return reply

    def _live_rows(
        self, raw: npt.NDArray[np.uint8], rows: npt.NDArray[np.void], now: int
    ) -> npt.NDArray[np.bool_]:
        """Which rows of a getmulti answer are live (a pending hit may have moved them on)."""
        live: npt.NDArray[np.bool_] = row_expiry_ms(rows) > now
        pending = self._pending
        if pending and not live.all():
            for j in np.flatnonzero(~live).tolist():
                late = pending.get(raw[j, :KEY_LEN].tobytes())
                if late is not None and late[0] > now:
                    live[j] = True
        return live

    def _has_general(
        self,
        prefixes: list[bytes],
        raw: npt.NDArray[np.uint8],
        rows: npt.NDArray[np.void],
        now: int,
    ) -> npt.NDArray[np.void]:
        """HAS records for any request (keys repeated included), from the getmulti answer
        ``raw`` (grouped by key, each key once)."""
        live = self._live_rows(raw, rows, now)
        flat = raw.tobytes()
        asked: dict[bytes, list[int]] = {}
        for i, k in enumerate(prefixes):
            asked.setdefault(k, []).append(i)
        pick: list[int] = []
        ords: list[int] = []
        for j in range(len(raw)):
            if live[j]:
                at = j * HIT_LEN
                for o in asked.get(flat[at : at + BLOCK_LEN], ()):
                    pick.append(j)
                    ords.append(o)
        order = np.argsort(np.array(ords, np.int64), kind="stable")
        sel = np.array(pick, np.int64)[order]
        reply = make_items(Op.HAS, len(sel), reply=True)
        if len(sel):
            reply["ordinal"] = np.array(ords, np.uint64)[order]
            reply["index"] = rows["index"][sel]
            reply["stripe"] = rows["stripe"][sel]
        return reply

    # ------------------------------------------------------------------ LIST / scrub

    @_watch_damage
    def list_shards(
        self, tenant: TenantId, start: bytes, index: int, *, inclusive: bool, limit: int
    ) -> npt.NDArray[np.void]:
        """Up to ``limit`` live shards of ``tenant`` from (``start`` key, ``index``) on, in
        storage-key order (key, then index), as LIST reply records. One read transaction
        over the index rows; each shard's header is read for its payload length."""
        if limit <= 0:
            return make_items(Op.LIST, 0, reply=True)
        now = self.now_ms()
        pending = self._pending
        payload_len = _PAYLOAD_LEN.unpack_from
        first = tenant + start + index.to_bytes(2, "big")
        skeys: list[bytes] = []
        heads: list[tuple[int, int, int]] = []
        payloads: list[int] = []
        classes: list[bytes] = []
        names = self.classes.names
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._index)
            found = cursor.set_range(first[:BLOCK_LEN])
            while found:
                block = bytes(cursor.key())
                if block[:TENANT_LEN] != tenant:
                    break
                raw = bytes(cursor.value())
                skey = block + raw[:2]
                if skey < first or (skey == first and not inclusive):
                    found = cursor.next()
                    continue
                _index, cid, size, expiry, stripe, _written, seg, off = ROW.unpack(raw)
                if pending:
                    expiry = max(expiry, pending.get(skey, (0,))[0])
                if expiry > now:
                    try:
                        record = self.segments.read(_LOC.pack(seg, off, size, 0))
                    except OSError:  # its segment gone or cut short: listed with no length
                        self.counters["rows_unreadable"] += 1
                        record = memoryview(b"")
                    skeys.append(skey)
                    heads.append((size, stripe, expiry))
                    payloads.append(
                        payload_len(record, _PAYLOAD_LEN_AT)[0]
                        if len(record) >= _PAYLOAD_LEN_AT + 4
                        else 0
                    )
                    classes.append(names[cid].encode())  # "+name" for a pinned shard
                    if len(skeys) == limit:
                        break
                found = cursor.next()
        n = len(skeys)
        reply = make_items(Op.LIST, n, reply=True)
        if n:
            packed = np.frombuffer(b"".join(skeys), np.uint8).reshape(n, KEY_LEN)
            reply["key"] = np.ascontiguousarray(packed[:, TENANT_LEN:-2]).view("V16").ravel()
            reply["index"] = (packed[:, -2].astype(np.uint16) << 8) | packed[:, -1]
            cols = np.array(heads, np.uint64)
            reply["length"] = cols[:, 0]
            reply["stripe"] = cols[:, 1]
            reply["expiry_ms"] = cols[:, 2]
            reply["payload_len"] = payloads
            reply["traffic_class"] = classes
        return reply

    @_watch_damage
    def records_after(self, after: bytes, *, max_bytes: int) -> list[tuple[bytes, bytes]]:
        """Copies of stored (storage key, record) pairs after storage key ``after`` (every
        tenant), in key order, about ``max_bytes`` of records at most (at least one): what
        a scrub step re-verifies. Empty once the end is reached."""
        out: list[tuple[bytes, bytes]] = []
        total = 0
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._index)
            found = cursor.set_range(after[:BLOCK_LEN]) if after else cursor.first()
            while found:
                raw = bytes(cursor.value())
                skey = bytes(cursor.key()) + raw[:2]
                if skey > after:
                    record = self._record_copy(row_location(raw))
                    out.append((skey, record))
                    total += len(record)
                    if total >= max_bytes:
                        break
                found = cursor.next()
        return out

    def _record_copy(self, location: bytes) -> bytes:
        """A copy of the record at ``location``; empty when it cannot be read (its segment
        gone or cut short from outside): a record that fails every check, so a scrub
        discards its row instead of stopping at it."""
        try:
            return bytes(self.segments.read(location))
        except OSError as exc:
            self.counters["rows_unreadable"] += 1
            log.warning("a shard's record cannot be read (%s); treated as damaged", exc)
            return b""

    @_watch_damage
    def discard(self, found: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete each shard (storage key, record) whose stored record is still exactly
        ``record`` (a scrub found it bad; a shard rewritten since stays). Returns how many."""
        deltas = Deltas()
        try:
            with self._lmdb.begin_write(len(found)) as txn:
                rows = self._rows_of(txn, [skey for skey, _ in found])
                for skey, record in found:
                    raw = rows.pop(skey, None)
                    if raw is None or self._record_copy(row_location(raw)) != record:
                        continue
                    self._remove(txn, skey, raw, deltas)
                self._write_usage(txn, deltas)
        except lmdb.Error as exc:
            raise self.failed(exc, "deleting bad shards") from exc
        self._apply(deltas)
        for skey in deltas.removed:
            self._pending.pop(skey, None)
        return len(deltas.removed)

    # ------------------------------------------------------------------ TOUCH / DELETE

    @_watch_damage
    def touch(
        self,
        tenant: TenantId,
        items: npt.NDArray[np.void],
        traffic_class: str = "",
        retain: Retain = NO_RETAIN,
    ) -> npt.NDArray[np.void]:
        """Slide the expiry of every live shard of each key, without reading shard bytes.

        With ``retain.pin`` the live shards are pinned too, as far as the tenant's pin
        quota holds them (shard by shard, in request order); pins are written at once.
        """
        status = np.full(len(items), Status.NOT_FOUND, dtype=np.uint8)
        now = self.now_ms()
        hit = self._hit(traffic_class, retain)
        budget: list[int] | None = None
        if retain.pin:
            quota = self.quotas.get(tenant)
            budget = [(quota.pins if quota else 0) - self._pinned_bytes(tenant)]
        prefixes = _prefixes(tenant, items)
        with self._env.begin() as txn:
            groups = self._groups(txn, prefixes)
        unpack = ROW.unpack
        for i, key in enumerate(prefixes):
            for raw in groups.get(key, ()):
                _index, cid, size, expiry, *_rest = unpack(raw)
                if self._alive(key + raw[:2], expiry, cid, size, now, hit, retain.ttl_s, budget):
                    status[i] = Status.OK
        if budget is not None:
            self.flush_touches()  # a pin counts against the quota from now on
        reply = make_items(Op.TOUCH, len(items), reply=True)
        reply["status"] = status
        return reply

    @_watch_damage
    def delete(self, tenant: TenantId, items: npt.NDArray[np.void]) -> npt.NDArray[np.void]:
        """Remove matching shards (stripe 0: any; index NO_INDEX: all of the key) in one txn."""
        status = np.full(len(items), Status.NOT_FOUND, dtype=np.uint8)
        deltas = Deltas()
        deleted: dict[bytes, list[tuple[int, int, int, bytes]]] = {}
        try:
            with self._lmdb.begin_write(len(items) * _ROWS_A_DELETE) as txn:
                prefixes = _prefixes(tenant, items)
                groups = self._groups(txn, prefixes)
                gone_keys: set[bytes] = set()
                for i, (key, stripe, index) in enumerate(
                    zip(prefixes, items["stripe"].tolist(), items["index"].tolist(), strict=True)
                ):
                    want = None if index == NO_INDEX else index.to_bytes(2, "big")
                    for raw in groups.get(key, ()):
                        skey = key + raw[:2]
                        if (want is not None and raw[:2] != want) or skey in gone_keys:
                            continue
                        if stripe and ROW.unpack(raw)[4] != stripe:
                            continue
                        rec = self._remove(txn, skey, raw, deltas)
                        gone_keys.add(skey)
                        gone = deleted.setdefault(partition(tenant, rec.traffic_class), [])
                        gone.append((rec.expiry_ms, rec.size, rec.written_ms, skey))
                        status[i] = Status.OK
                self._write_usage(txn, deltas)
        except lmdb.Error as exc:
            raise self.failed(exc, "DELETE") from exc
        self._apply(deltas)
        for skey in deltas.removed:
            self._pending.pop(skey, None)
        for part, removed in deleted.items():
            self._count_removed(part, "deleted", _Removed.of_rows(removed))
        reply = make_items(Op.DELETE, len(items), reply=True)
        reply["status"] = status
        return reply

    # ------------------------------------------------------------------ retention work

    def seconds_to_sweep(self) -> float:
        """Seconds until the earliest expiry is due to be swept (0 or less: due now), so
        the loop's idle wait ends when it is due rather than at its next poll. (No LMDB
        here, so no damage watch: the loop asks on every turn.)"""
        return (self._next_sweep_ms - self.now_ms()) / 1000

    def drain_after_crossing(self) -> int:
        """After a write that reached the high watermark: one bounded batch (at most
        ``sweep_batch`` shards) of the drain to the low watermark; shards evicted (0 when
        no write crossed since the last call).

        The daemon's loop calls it once a turn's PUTs are answered and before any other
        request is: the drain used to wait for the loop's next maintenance, and requests
        answered first found shards the drain was about to take (and slid some, changing
        what it took), so what a replay hit depended on timing. A drain of one batch, a
        small node's whole drain, now ends where the retention simulator and the capacity
        planner put it: after the write, before the next request (issue 20). A longer one
        goes on in :meth:`maintain`."""
        if not self._crossed:
            return 0
        self._crossed = False
        before = self.counters["evicted_shards"]
        self.evict(self._low, limit=self._sweep_batch)
        self._draining = self.book.used > self._low
        return self.counters["evicted_shards"] - before

    def maintain(self) -> bool:
        """Do what is due: write hits, sweep one bounded batch, evict, reclaim segments, and
        give back the files kept for reuse that a while of writing did not need.

        Returns True when more work is waiting (call again soon); each call
        holds the writer for at most one bounded transaction per task, so reads
        and writes in between are not stalled for long.
        """
        more = False
        if self._pending and (
            len(self._pending) >= _MAX_PENDING_TOUCHES
            or self._monotonic() - self._pending_since >= self._touch_flush_s
        ):
            self.flush_touches()
        if self.now_ms() >= self._next_sweep_ms:
            try:
                more |= self.sweep(limit=self._sweep_batch) >= self._sweep_batch
            except BaseException:
                # Tried again in a second, not on every turn of a loop that wakes when a
                # sweep is due (seconds_to_sweep).
                self._next_sweep_ms = self.now_ms() + 1000
                raise
        if self.book.used > self._high:
            self._draining = True
        if self._draining:
            freed = self.evict(self._low, limit=self._sweep_batch)
            self._draining = self.book.used > self._low
            # A drain that freed nothing (what is left above the low watermark is pinned)
            # is tried again at the loop's next turn, not at once: asking again at once had
            # the daemon's loop spin, a pass over every partition each time.
            more |= self._draining and freed > 0
        more |= self.reclaim()
        self.segments.release_spares()
        return more

    @_watch_damage
    def flush_touches(self) -> int:
        """Write the collected hits' expiries (one transaction); returns records updated."""
        if not self._pending:
            return 0
        pending, self._pending = self._pending, {}
        moved = Deltas()
        updated = 0
        try:
            with self._lmdb.begin_write(3 * len(pending)) as txn:
                rows = self._rows_of(txn, list(pending))
                classes = self.classes
                for skey, (candidate, cls) in pending.items():
                    raw = rows.get(skey)
                    if raw is None:
                        continue
                    rec = Row.unpack(raw, classes)
                    candidate, cls = decide.merge(
                        (rec.expiry_ms, rec.traffic_class), (candidate, cls)
                    )
                    if candidate == rec.expiry_ms and cls == rec.traffic_class:
                        continue
                    new = replace(rec, expiry_ms=candidate, traffic_class=cls)
                    txn.delete(
                        *expiry_entry(skey, rec.traffic_class, rec.expiry_ms), db=self._expiry
                    )
                    txn.put(*expiry_entry(skey, cls, candidate), db=self._expiry)
                    block = skey[:BLOCK_LEN]
                    txn.delete(block, raw, db=self._index)
                    txn.put(block, new.pack(classes), db=self._index)
                    if cls != rec.traffic_class:
                        moved.add(partition(skey[:TENANT_LEN], rec.traffic_class), -rec.size, -1)
                        moved.add(partition(skey[:TENANT_LEN], cls), rec.size, 1)
                    updated += 1
                self._write_usage(txn, moved)
        except lmdb.Error as exc:
            # The hits' slides are lost (they are hints; kept, a flush that keeps failing,
            # a full map, would hold every sweep and eviction behind it).
            raise self.failed(exc, "writing hits") from exc
        self.book.apply(moved)
        self.classes.persisted()
        self.counters["touches_written"] += updated
        return updated

    @_watch_damage
    def sweep(self, *, limit: int | None = None) -> int:
        """Delete up to ``limit`` expired shards, earliest first; returns how many."""
        self.flush_touches()
        now = self.now_ms()
        budget = limit or self._sweep_batch
        swept = 0
        for part in self.book.partitions():
            if swept >= budget:
                break
            freed = self._delete_head(part, budget - swept, until_expiry_ms=now, cause="expired")
            swept += freed.freed_shards
            self.counters["expired_shards"] += freed.freed_shards
            self.counters["expired_bytes"] += freed.freed_bytes
        if swept < budget:
            self._next_sweep_ms = self._first_expiry_ms()
        return swept

    @_watch_damage
    def evict(
        self, target_bytes: int, *, limit: int | None = None, writer: TenantId | None = None
    ) -> int:
        """Delete earliest-expiring shards until usage is at most ``target_bytes``.

        Whose shards go first is :func:`kvcache.server.eviction.capacity_tiers`'s
        decision. ``limit`` bounds the work of one call (shards).
        """
        self.flush_touches()
        evicted = 0
        tenant_bytes = {t: self.book.tenant_bytes(t) for t in self.book.tenants()}
        tiers = capacity_tiers(
            writer, tenant_bytes=tenant_bytes, quotas=self.quotas, capacity=self.capacity_bytes
        )
        for tier in tiers:
            if self.book.used <= target_bytes:
                break
            parts = [p for t in tier for p in self.book.partitions(t)]
            before = self.counters["evicted_shards"]
            self._evict_from(parts, self.book.used - target_bytes, counter="evicted", limit=limit)
            evicted += self.counters["evicted_shards"] - before
            if limit is not None and evicted >= limit:
                break
        return evicted

    def _evict_from(
        self, parts: list[bytes], nbytes: int, *, counter: str, limit: int | None = None
    ) -> int:
        """Free at least ``nbytes`` from ``parts``, earliest expiry across them first.

        A batch from one partition stops where another partition's head is earlier, so
        the order is the expiry's across partitions (the trace simulator's).

        Returns bytes freed (less than asked when the partitions ran empty or
        ``limit`` shards were deleted).
        """
        self.flush_touches()
        freed = 0
        shards = 0
        # Pinned shards have partitions of their own, which pressure passes by.
        parts = [p for p in parts if decide.evictable(_partition_class(p))]
        heads = {p: h for p in parts if (h := self._head_expiry(p)) is not None}
        cause = "quota" if counter == "quota_evicted" else "evicted"
        while freed < nbytes and heads and (limit is None or shards < limit):
            # Earliest head first; on a tie, the partition key (tenant, class name) decides,
            # alike on every node and as the trace simulator orders ties across classes.
            part = min(heads, key=lambda p: (heads[p], p))
            bound = min((h for p, h in heads.items() if p != part), default=None)
            batch = self._sweep_batch if limit is None else min(self._sweep_batch, limit - shards)
            out = self._delete_head(
                part, batch, until_expiry_ms=bound, until_bytes=nbytes - freed, cause=cause
            )
            freed += out.freed_bytes
            shards += out.freed_shards
            self.counters[f"{counter}_shards"] += out.freed_shards
            self.counters[f"{counter}_bytes"] += out.freed_bytes
            head = self._head_expiry(part)
            # A run up to the bound may have held only stale expiry entries (dropped, none
            # freed): the partition stays while its head moved.
            if head is None or (not out.freed_shards and head == heads[part]):
                heads.pop(part)
            else:
                heads[part] = head
        return freed

    # ------------------------------------------------------------------ introspection

    def usage(self, names: dict[TenantId, str] | None = None) -> dict[str, Any]:
        """Bytes and shards in total, per class and per tenant; safe from any thread."""
        return {**self.book.snapshot(names), "capacity_bytes": self.capacity_bytes}

    def oldest_live(self, *, max_steps: int = 256) -> dict[tuple[TenantId, str], int]:
        """Per (tenant id, class): the age (ms) of the partition's earliest-expiring live
        shard, since this daemon stored it: the shard pressure would remove next, and,
        when a class's shards share one TTL, the one used longest ago. Expired shards not
        swept yet are passed over (at most ``max_steps`` per partition). Pinned shards
        count under their class. One read transaction of its own and the locked usage
        book: safe from any thread, like :meth:`usage`."""
        now = self.now_ms()
        out: dict[tuple[TenantId, str], int] = {}
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._expiry)
            for part in self.book.partitions():
                if not cursor.set_range(part):
                    continue
                for _ in range(max_steps):
                    ekey = bytes(cursor.key())
                    if ekey[:PARTITION_LEN] != part:
                        break
                    expiry, skey = split_expiry_entry(ekey, bytes(cursor.value()))
                    raw = self._row(txn, skey) if decide.is_live(expiry, now) else None
                    if raw is not None:
                        key = (
                            TenantId(part[:TENANT_LEN]),
                            decide.split_stored(_partition_class(part))[0],
                        )
                        out[key] = max(out.get(key, 0), now - int(ROW.unpack(raw)[5]) * 1000)
                        break
                    if not cursor.next():
                        break
        return out

    def recount(self) -> dict[str, Any]:
        """Usage recomputed from the index rows (a consistency check for tests)."""
        book = UsageBook()
        deltas = Deltas()
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._index):
                rec = Row.unpack(raw, self.classes)
                deltas.add(partition(key[:TENANT_LEN], rec.traffic_class), rec.size, 1)
        book.apply(deltas)
        return {**book.snapshot(), "capacity_bytes": self.capacity_bytes}

    def expiry_of(self, tenant: TenantId, key: bytes, index: int) -> tuple[int, str] | None:
        """(expiry_ms, class) of one shard as stored plus pending hits, or None."""
        skey = tenant + key + index.to_bytes(2, "big")
        with self._env.begin() as txn:
            raw = self._row(txn, skey)
        if raw is None:
            return None
        rec = Row.unpack(raw, self.classes)
        pending = self._pending.get(skey)
        if pending and pending[0] > rec.expiry_ms:
            return pending
        return rec.expiry_ms, rec.traffic_class

    # ------------------------------------------------------------------ internals

    def _pin_rooms(self, passed: list[CheckedPut]) -> dict[int, bool]:
        """Per pinning batch (by id), whether its tenant's pin quota holds all its bytes;
        batches of one tenant are granted in order, each taking from what is left."""
        rooms: dict[int, bool] = {}
        left: dict[bytes, int] = {}
        for c in passed:
            if not c.retain.pin or not c.keys:
                continue
            tenant = c.keys[0][:TENANT_LEN]
            if tenant not in left:
                quota = self.quotas.get(TenantId(tenant))
                left[tenant] = (quota.pins if quota else 0) - self._pinned_bytes(tenant)
            need = sum(map(len, c.records))
            rooms[id(c)] = need <= left[tenant]
            if rooms[id(c)]:
                left[tenant] -= need
        return rooms

    def _pinned_bytes(self, tenant: bytes) -> int:
        """Bytes of the tenant's pinned shards on this node (its pinned partitions)."""
        return sum(
            self.book.partition_bytes(p)
            for p in self.book.partitions(TenantId(tenant))
            if not decide.evictable(_partition_class(p))
        )

    def _write_retention(
        self, traffic_class: str, now: int, c: CheckedPut | None = None,
        pins: dict[int, bool] | None = None,
    ) -> tuple[str, int]:  # fmt: skip
        """(stored class, expiry) of a write of ``traffic_class`` at ``now`` (of batch ``c``,
        with its hint: TTL clamped into the class's bounds, pin if its quota holds it)."""
        retain = c.retain if c is not None else NO_RETAIN
        applied = clamp(
            self.policy,
            traffic_class,
            ttl_s=retain.ttl_s or None,
            pin=retain.pin,
            pin_room=bool(pins and c is not None and pins.get(id(c))),
        )
        if applied.clamped is not None and retain != NO_RETAIN:  # a hint, not just a class
            self._clamped(applied.clamped, pin_dropped=retain.pin and not applied.pin)
        return (
            decide.stored_class(applied.traffic_class, applied.pin),
            decide.write_expiry(now, applied.ttl_s),
        )

    def _hit(self, traffic_class: str, retain: Retain = NO_RETAIN) -> Applied | None:
        """What a hit of ``traffic_class`` does (None: each shard's own class decides)."""
        if not traffic_class:
            return None
        applied = clamp(self.policy, traffic_class, ttl_s=retain.ttl_s or None)
        if applied.clamped is not None and retain.ttl_s:  # a hint, not just a class
            self._clamped(applied.clamped, pin_dropped=False)
        return applied

    def _clamped(self, why: str, *, pin_dropped: bool) -> None:
        """A hint the policy did not grant as asked: counted, and logged (rate-limited by
        the counter: the first and every 1000th)."""
        self.counters["hints_clamped"] += 1
        if pin_dropped:
            self.counters["pins_refused"] += 1
        if self.counters["hints_clamped"] % 1000 == 1:
            log.warning(
                "retention hint clamped (%d so far): %s", self.counters["hints_clamped"], why
            )

    def _alive(
        self,
        key: bytes,
        expiry: int,
        class_id: int,
        size: int,
        now: int,
        hit: Applied | None,
        ttl_hint: int = 0,
        pin_budget: list[int] | None = None,
        *,
        slides: dict[bytes, tuple[int, str]] | None = None,
    ) -> int:
        """Whether the shard (storage key, its row's expiry, class id and size) is live (0:
        not; :data:`_LIVE`; :data:`_SLID`: live, and this hit moved its expiry); if so,
        record the hit's expiry slide (and pin, while ``pin_budget[0]`` bytes of pin quota
        are left): into ``slides`` when given (the caller applies them), else pending."""
        pending_class = ""
        if self._pending:
            pending = self._pending.get(key)
            if pending is not None and pending[0] > expiry:
                expiry, pending_class = pending
        if expiry <= now:  # decide.is_live, inline: this runs for every hit of a walk
            return 0
        policy = self.policy
        stored = pending_class or self.classes.names[class_id]
        pin = False
        if pin_budget is not None and decide.evictable(stored):
            pin = size <= pin_budget[0]
            if pin:
                pin_budget[0] -= size
            else:
                self._clamped("pin dropped: the tenant's pin quota is full", pin_dropped=True)
        if not pin and decide.write_expiry(now, policy.max_ttl_s) - expiry < self._resolution_ms:
            return _LIVE  # no class could move the expiry enough to be worth a write
        if hit is None:
            hit = clamp(policy, decide.split_stored(stored)[0], ttl_s=ttl_hint or None)
        if pin:
            hit = replace(hit, pin=True)
        move = decide.slide(
            expiry_ms=expiry, stored=stored, hit=hit, now_ms=now, resolution_ms=self._resolution_ms
        )
        if move is None:
            return _LIVE
        if slides is not None:
            slides[key] = move
            return _SLID
        if not self._pending:
            self._pending_since = self._monotonic()
        self._pending[key] = move
        return _SLID

    def _current(self, key: bytes, expiry: int, stored: str) -> tuple[int, str]:
        """(expiry, stored class) of a shard: its row's, or a pending hit's when later."""
        if self._pending:
            pending = self._pending.get(key)
            if pending is not None and pending[0] > expiry:
                return pending
        return expiry, stored

    def _remove(self, txn: lmdb.Transaction, skey: bytes, raw: bytes, deltas: Deltas) -> Row:
        """Delete one shard's row (``raw``, as stored) and expiry entry; returns the row."""
        rec = Row.unpack(raw, self.classes)
        txn.delete(skey[:BLOCK_LEN], raw, db=self._index)
        txn.delete(*expiry_entry(skey, rec.traffic_class, rec.expiry_ms), db=self._expiry)
        deltas.add_segment(rec.seg, -rec.size, -1)
        deltas.add(partition(skey[:TENANT_LEN], rec.traffic_class), -rec.size, -1)
        deltas.removed.append(skey)
        return rec

    def _block_rows(self, txn: lmdb.Transaction, blocks: list[bytes]) -> memoryview | bytes:
        """Every row of each index key in ``blocks`` (tenant + block key), as one buffer of
        (key, row) pairs (:data:`HIT_DTYPE`), grouped by key in the order asked; missing keys
        give nothing. One C-level call for all of them."""
        if not blocks:
            return b""
        found: memoryview = txn.cursor(db=self._index).getmulti(
            blocks, dupdata=True, dupfixed_bytes=ROW_LEN, keyfixed=True
        )
        return found

    def _rows_of(self, txn: lmdb.Transaction, skeys: Sequence[bytes]) -> dict[bytes, bytes]:
        """The stored row of each storage key of ``skeys`` that has one."""
        if not skeys:
            return {}
        raw = bytes(self._block_rows(txn, list(dict.fromkeys(k[:BLOCK_LEN] for k in skeys))))
        if not raw:
            return {}
        return {
            raw[at : at + KEY_LEN]: raw[at + BLOCK_LEN : at + HIT_LEN]
            for at in range(0, len(raw), HIT_LEN)
        }

    def _groups(self, txn: lmdb.Transaction, blocks: Sequence[bytes]) -> dict[bytes, list[bytes]]:
        """Rows of each index key of ``blocks`` that has any, in shard-index order."""
        raw = bytes(self._block_rows(txn, list(dict.fromkeys(blocks))))
        out: dict[bytes, list[bytes]] = {}
        for at in range(0, len(raw), HIT_LEN):
            out.setdefault(raw[at : at + BLOCK_LEN], []).append(raw[at + BLOCK_LEN : at + HIT_LEN])
        return out

    def _row(self, txn: lmdb.Transaction, skey: bytes) -> bytes | None:
        """The stored row of one storage key, or None."""
        cursor = txn.cursor(db=self._index)
        if not cursor.set_range_dup(skey[:BLOCK_LEN], skey[BLOCK_LEN:]):
            return None
        raw = bytes(cursor.value())
        return raw if raw[:2] == skey[BLOCK_LEN:] else None

    def _head_expiry(self, part: bytes) -> int | None:
        """The earliest expiry in partition ``part``, or None when it is empty."""
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._expiry)
            if not cursor.set_range(part):
                return None
            ekey = cursor.key()
            if ekey[:PARTITION_LEN] != part:
                return None
            return split_expiry_entry(ekey, b"")[0]

    def _delete_head(
        self,
        part: bytes,
        limit: int,
        *,
        until_expiry_ms: int | None = None,
        until_bytes: int | None = None,
        cause: str = "expired",
    ) -> Deltas:
        """Delete from the earliest expiry of one partition on, up to ``limit`` shards, in one
        transaction: while the expiry is at most ``until_expiry_ms`` and fewer than
        ``until_bytes`` were freed.

        An expiry key's duplicates (the shards of one PUT batch, as a rule) are taken in
        order: each shard's row is found and deleted by one cursor step (one B-tree descent
        a shard), the sizes and segments summed as arrays, and the taken duplicates
        deleted together (the whole key when all go). An entry whose row is gone or names
        another expiry (never so, but checked) is dropped from the expiry index alone.
        """
        deltas = Deltas()
        last_expiry = 2**64 if until_expiry_ms is None else until_expiry_ms
        to_free = 2**63 if until_bytes is None else until_bytes
        removed = deltas.removed
        nbytes = 0
        gone: list[_Removed] = []  # what each expiry key gave up
        tenant = part[:TENANT_LEN]
        # A row in this partition names its class; an entry whose row names another (moved
        # there since, under the same expiry second) is stale here.
        known = self.classes.find(_partition_class(part))
        class_id = b"" if known is None else known.to_bytes(2, "big")
        size_of = _SIZE.unpack_from
        try:
            with self._lmdb.begin_write(limit) as txn:
                cursor = txn.cursor(db=self._expiry)
                rows_at = txn.cursor(db=self._index)
                find, value, drop = rows_at.set_range_dup, rows_at.value, rows_at.delete
                while len(removed) < limit and nbytes < to_free and cursor.set_range(part):
                    ekey = cursor.key()
                    if ekey[:PARTITION_LEN] != part:
                        break
                    at_expiry = ekey[PARTITION_LEN:]
                    expiry = _U64.unpack(at_expiry)[0]
                    if expiry > last_expiry:
                        break
                    row_expiry = (expiry // EXPIRY_UNIT_MS).to_bytes(4, "big")  # a row's field
                    total = cursor.count()
                    dups = list(itertools.islice(cursor.iternext_dup(keys=False),
                                                 limit - len(removed)))  # fmt: skip
                    raws: list[bytes] = []
                    taken: list[bytes] = []
                    seen = 0
                    for dup in dups:
                        seen += 1
                        block, index = tenant + dup[:16], dup[16:]
                        if find(block, index):
                            raw = value()
                            if (
                                raw[:2] == index
                                and raw[8:12] == row_expiry
                                and raw[2:4] == class_id
                            ):
                                drop()
                                raws.append(raw)
                                taken.append(block + index)
                                if until_bytes is not None:
                                    nbytes += size_of(raw, 4)[0]
                                    if nbytes >= to_free:
                                        break
                                continue
                        log.warning("dropped a stale expiry entry for %s", (block + index).hex())
                    if seen == total:
                        txn.delete(ekey, db=self._expiry)  # the key and all its duplicates
                    else:  # the first ``seen`` duplicates, from the head on
                        cursor.set_range(part)
                        step = cursor.delete
                        for _ in range(seen):
                            step()
                    if not raws:
                        continue
                    rows = np.frombuffer(b"".join(raws), ROW_DTYPE)
                    sizes = rows["size"].astype(np.int64)
                    freed = int(sizes.sum())
                    if until_bytes is None:
                        nbytes += freed
                    take = len(raws)
                    deltas.add(part, -freed, -take)
                    segs, inverse = np.unique(rows["seg"], return_inverse=True)
                    per_seg = np.bincount(inverse, weights=sizes, minlength=len(segs))
                    counts = np.bincount(inverse, minlength=len(segs))
                    for seg, b, c in zip(segs.tolist(), per_seg.tolist(), counts.tolist(),
                                         strict=True):  # fmt: skip
                        deltas.add_segment(seg, -int(b), -c)
                    removed.extend(taken)
                    written = rows["written"].astype(np.int64) * 1000
                    gone.append(_Removed(np.full(take, expiry, np.int64), sizes, written, taken))
                self._write_usage(txn, deltas)
        except lmdb.Error as exc:
            raise self.failed(exc, "deleting expired or evicted shards") from exc
        self._apply(deltas)
        if self._pending:
            for skey in removed:
                self._pending.pop(skey, None)
        if gone:
            self._count_removed(part, cause, _Removed.joined(gone))
        return deltas

    def _count_removed(self, part: bytes, cause: str, gone: _Removed) -> None:
        """Count removals of partition ``part``: an already expired shard that pressure
        reached counts as ``expired``, a live one under its ``cause``."""
        if not gone.keys:
            return
        now = self.now_ms()
        tenant, name = part[:TENANT_LEN], decide.split_stored(_partition_class(part))[0]
        if cause != "expired":
            live = decide.live_mask(gone.expiry_ms, now)
            if not live.all():
                dead, gone = gone.where(~live), gone.where(live)
                self.removals.record(tenant, name, "expired", sizes=dead.sizes,
                                     ages_ms=now - dead.written_ms, keys=dead.keys)  # fmt: skip
        if gone.keys:
            self.removals.record(tenant, name, cause, sizes=gone.sizes,
                                 ages_ms=now - gone.written_ms, keys=gone.keys)  # fmt: skip

    def _lost_segments(self, segments: Mapping[int, SegmentState]) -> set[int]:
        """Segments the index points into whose file is gone or shorter than what was
        committed (a damaged or restored directory, or power lost under ``sync =
        periodic`` after a segment was dropped): their shards are lost to this node."""
        sizes = self.segments.on_disk()
        lost = set()
        for seg, state in segments.items():
            size = sizes.get(seg)
            if state.live and (size is None or size < state.end):
                log.error(
                    "segment %s is %s (index: %d bytes, %d live shards): forgetting its "
                    "shards (read repair and `kvcache repair` put them back)",
                    self.segments.path_of(seg),
                    "missing" if size is None else f"cut short at {size} bytes",
                    state.end,
                    state.live,
                )
                lost.add(seg)
        return lost

    def _forget_segments(self, txn: lmdb.Transaction, lost: set[int]) -> Deltas:
        """Remove every index entry pointing into ``lost`` (one walk of the index)."""
        deltas = Deltas()
        victims = []
        for block, raw in txn.cursor(db=self._index):
            if ROW.unpack(raw)[6] in lost:
                victims.append((bytes(block) + bytes(raw[:2]), bytes(raw)))
        for skey, raw in victims:
            self._remove(txn, skey, raw, deltas)
        self._write_usage(txn, deltas)
        return deltas

    # ------------------------------------------------------------------ segment space

    @_watch_damage
    def reclaim(self) -> bool:
        """Unlink sealed segments with nothing live, and compact one step of a sparse one
        (its live records copied forward, so it empties). Returns True when more is due.

        Compaction runs only while the segment files take more than the node's capacity
        (live bytes are held under its high watermark, so that much is dead space), on the
        sparsest sealed segment under 90 % live. Under expiry-ordered eviction segments
        mostly empty on their own, and copying records that go soon anyway is waste
        (measured: with a threshold of half live, compaction took a fifth of a full
        node's PUT CPU). No live shard is dropped for space here: capacity eviction alone
        does that, by the node's live bytes.
        """
        seg_files = self.segments
        active = seg_files.active
        if active != self._sealed_upto:  # segments sealed since: look at them too
            self._shrunk.update(s for s in seg_files.state if self._sealed_upto <= s < active)
            self._sealed_upto = active
        if not self._shrunk and self._compacting is None:
            return False
        looked, self._shrunk = self._shrunk, set()
        if active in looked:
            self._shrunk.add(active)  # looked at again once sealed
        state = seg_files.state
        empty = [s for s in looked if s != active and s in state and not state[s].live]
        if empty:
            with self._lmdb.begin_write(2 * len(empty)) as txn:
                for seg in empty:
                    txn.delete(SEGMENT_PREFIX + seg.to_bytes(4, "big"), db=self._meta)
                    txn.delete(SEGMENT_EXPIRY_PREFIX + seg.to_bytes(4, "big"), db=self._meta)
            for seg in empty:
                seg_files.drop(seg)
                self._latest_expiry.pop(seg, None)
                self._uncompactable.discard(seg)
                if self._compacting is not None and self._compacting[0] == seg:
                    self._compacting = None
            self.counters["segments_dropped"] += len(empty)
        for seg in looked:
            st = state.get(seg)
            if (
                seg != active
                and st is not None
                and st.live
                and st.live_bytes < _COMPACT_BELOW * st.end
                and seg not in self._uncompactable
            ):
                self._sparse.add(seg)
        if self._draining and self.segments.file_bytes <= _DRAIN_FIRST_SLACK * self.segment_budget:
            # A drain to the low watermark is under way: it empties segments itself, and a
            # compaction step between its batches copies records it may take next (at 10^7
            # shards the drain ran at half its rate with them; bench/scale.py). Past the
            # slack the steps run again: a drain that cannot finish (pins above the low
            # watermark) would otherwise stop compaction for good, the files growing a
            # segment per long-lived record.
            return False
        if self._compacting is None:
            self._sparse = {s for s in self._sparse if s in state and state[s].live}
            if not self._sparse or self.segments.file_bytes <= self.segment_budget:
                return False
            # A full node (within a drain of its low watermark) leaves to eviction what
            # eviction takes next; any other compacts it (deletes made it sparse). Finding
            # the head reads every partition's, so a full node with nothing else to compact
            # looks again a second later, not at every turn of the loop.
            head = None
            if self.book.used >= 2 * self._low - self._high:
                head = self._head_for_compaction()
            sparse = [
                (state[s].live_bytes / state[s].end, s)
                for s in self._sparse
                if head is None or not self._goes_first(s, head)
            ]
            if not sparse:
                return False
            self._compacting = (min(sparse)[1], 0, 0)
        seg, start, resume = self._compacting
        nxt = self._compact_step(seg, start, resume)
        self._compacting = None if nxt is None else (seg, *nxt)
        if nxt is None:
            left = state.get(seg)
            if left is None or not left.live:
                self.counters["segments_compacted"] += 1
            else:
                self._uncompactable.add(seg)
                self._sparse.discard(seg)
                self.counters["segments_uncompactable"] += 1
                log.warning(
                    "segment %s: compaction left %d live records in it (a damaged batch head "
                    "or record); it is not compacted again, its records go as their rows do",
                    seg, left.live,
                )  # fmt: skip
        return True

    def _note_expiry(self, txn: lmdb.Transaction, seg: int, expiry_ms: int) -> None:
        """Keep ``seg``'s latest expiry (in memory and, in ``txn``, in its meta row)."""
        if expiry_ms > self._latest_expiry.get(seg, -1):
            self._latest_expiry[seg] = expiry_ms
            txn.put(SEGMENT_EXPIRY_PREFIX + seg.to_bytes(4, "big"), _U64.pack(expiry_ms),
                    db=self._meta)  # fmt: skip

    def _head_for_compaction(self) -> int:
        """The node's earliest live expiry for :meth:`_goes_first`, read at most once a
        second: reading it visits every partition's first expiry, and reclaim() asks at
        every turn of a full node's loop. A second-old head is at most a second behind."""
        head, seen = self._head_seen
        now = self._monotonic()
        if now >= seen + 1.0:
            head = self._first_expiry_ms()
            self._head_seen = (head, now)
        return head

    def _goes_first(self, seg: int, head_ms: int) -> bool:
        """Whether ``seg``'s records are the node's next to go: every record this process
        appended there expires within two seconds of the earliest live expiry of the node
        (``head_ms``, read up to a second ago), so eviction empties it before anything
        newer. Asked while the node is full. A segment whose recorded expiries all lie before the head holds only
        records whose expiry a hit slid since (the rest are gone): it is compacted as any.

        Such a segment is not compacted: copying its live records forward is work thrown
        away. Expiries are whole seconds, and one second's shards are evicted in key
        order, not in the order they were written, so a full node whose writes of one
        second span several segments thins all of them at once; compacting them cost a
        full node 4x the CPU of its PUTs (measured: 2.8 ms against 0.67 ms a 64-shard
        PUT, 64 MiB node). The dead space left is within the records of two expiry seconds
        per class, and it goes with them; a node that stops filling keeps it until they
        expire. A hit that slid a record's expiry is not seen here: that only delays its
        segment's compaction until the head passes the segment's recorded expiry.
        """
        latest = self._latest_expiry.get(seg)
        return latest is not None and head_ms <= latest <= head_ms + 2 * EXPIRY_UNIT_MS

    def _compact_rows(self, seg: int) -> int:
        """Rows one compaction step of ``seg`` may change: its live records, at most what one
        step can copy."""
        state = self.segments.state.get(seg)
        live = state.live if state is not None else 0
        return 2 * min(live, _COMPACT_STEP // HEADER_BYTES, _COMPACT_STEP_RECORDS) + 8

    def _compact_step(self, seg: int, start: int, resume: int = 0) -> tuple[int, int] | None:
        """Copy the live records of ``seg`` from the batch at offset ``start`` (its records
        from offset ``resume`` on) forward, at most _COMPACT_STEP bytes and
        _COMPACT_STEP_RECORDS records looked at, in one transaction; where the next step
        goes on (batch offset, record offset), or None at the end."""
        keys: list[bytes] = []
        records: list[memoryview] = []
        olds: list[bytes] = []
        nxt: tuple[int, int] | None = None
        copied = 0
        looked = 0
        deltas = Deltas()
        appended: tuple[int, SegmentState] | None = None
        try:
            with (
                self.segments.writing,
                self._lmdb.begin_write(self._compact_rows(seg)) as txn,
            ):
                for batch_at, skey, at, length in self.segments.walk(seg, start, resume):
                    if copied >= _COMPACT_STEP or looked >= _COMPACT_STEP_RECORDS:
                        nxt = (batch_at, at)
                        break
                    looked += 1
                    raw = self._row(txn, skey)
                    if raw is None:
                        continue
                    _i, _c, size, _e, _s, _w, where, off = ROW.unpack(raw)
                    if where != seg or off != at:
                        continue  # replaced or removed since
                    if size != length:  # a damaged batch head: the row's length is the truth
                        log.warning("segment %s: the record at %d is %d bytes by its batch, %d "
                                    "by the index; not moved", seg, at, length, size)  # fmt: skip
                        continue
                    keys.append(skey)
                    records.append(self.segments.view(seg)[at : at + length])
                    olds.append(raw)
                    deltas.add_segment(seg, -length, -1)
                    copied += length
                if keys:
                    new, first, before = self.segments.append(keys, records)
                    appended = (new, before)
                    self.counters["segments_reused"] = self.segments.reused
                    offset = first
                    for skey, raw, record in zip(keys, olds, records, strict=True):
                        moved = replace(Row.unpack(raw, self.classes), seg=new, off=offset)
                        self._note_expiry(txn, new, moved.expiry_ms)
                        offset += len(record)
                        txn.delete(skey[:BLOCK_LEN], raw, db=self._index)
                        txn.put(skey[:BLOCK_LEN], moved.pack(self.classes), db=self._index)
                    self._write_usage(txn, deltas, appended=new)
        except BaseException:
            if appended is not None:
                self.segments.rewind(*appended)
            raise
        self._apply(deltas)
        self.counters["compacted_shards"] += len(keys)
        return nxt

    def _first_expiry_ms(self) -> int:
        heads = [h for p in self.book.partitions() if (h := self._head_expiry(p)) is not None]
        return min(heads, default=2**63)

    def _write_usage(
        self, txn: lmdb.Transaction, deltas: Deltas, *, appended: int | None = None
    ) -> None:
        for key, value in self.book.meta_rows(deltas):
            txn.put(key, value, db=self._meta)
        if self.classes.dirty:  # ids handed out since: persisted with the rows naming them
            txn.put(CLASSES_KEY, self.classes.pack(), db=self._meta)
        touched = set(deltas.segments)
        if appended is not None:
            touched.add(appended)  # its end moved
        for seg in touched:
            state = self.segments.state.get(seg)
            if state is None:  # pragma: no cover - a record in a segment the index forgot
                continue
            dbytes, dcount = deltas.segments.get(seg, (0, 0))
            row = SegmentState(state.end, state.live_bytes + dbytes, state.live + dcount)
            txn.put(SEGMENT_PREFIX + seg.to_bytes(4, "big"), row.pack(), db=self._meta)

    def _apply(self, deltas: Deltas) -> None:
        """Mirror a committed transaction's counters (usage and segments' live bytes)."""
        self.book.apply(deltas)
        self.classes.persisted()
        state = self.segments.state
        for seg, (dbytes, dcount) in deltas.segments.items():
            found = state.get(seg)
            if found is not None:
                found.live_bytes += dbytes
                found.live += dcount
                if dcount < 0:
                    self._shrunk.add(seg)

    def _load_meta(self) -> None:
        # The rows this start may change: a few meta rows, and those of segments found lost.
        lost: set[int] = set()
        rows = 64
        with self._env.begin() as txn:
            if txn.get(b"format", db=self._meta) == FORMAT:
                found = {
                    int.from_bytes(rest, "big"): SegmentState.unpack(value)
                    for rest, value in _meta_rows(txn.cursor(db=self._meta), SEGMENT_PREFIX)
                }
                lost = self._lost_segments(found)
                rows += 2 * len(found) + sum(found[seg].live for seg in lost)
        with self._lmdb.begin_write(rows) as txn:
            fmt = txn.get(b"format", db=self._meta)
            if fmt is None:
                if txn.stat(self._index)["entries"]:
                    raise StorageError(f"{self.path} holds shards but no format marker")
                txn.put(b"format", FORMAT, db=self._meta)
            elif fmt == b"kvcache-store-v5":
                raise StorageError(
                    f"{self.path} was written in store format 'kvcache-store-v5' (36-byte index "
                    f"rows with millisecond expiries); this build reads {FORMAT.decode()!r} "
                    "(32-byte rows, expiries in whole seconds, segment batches without a "
                    "per-record entry): use a fresh data directory (the store is a cache; "
                    "nothing in it needs to be kept)"
                )
            elif fmt == b"kvcache-store-v4":
                raise StorageError(
                    f"{self.path} was written in store format 'kvcache-store-v4' (a location "
                    f"and a retention row per shard, in two databases); this build reads "
                    f"{FORMAT.decode()!r} (one index row per shard, a block's shards under one "
                    "key): use a fresh data directory (the store is a cache; nothing in it "
                    "needs to be kept)"
                )
            elif fmt == b"kvcache-store-v3":
                raise StorageError(
                    f"{self.path} was written in store format 'kvcache-store-v3' (shard records "
                    f"inside LMDB); this build reads {FORMAT.decode()!r} (records in segment "
                    "files beside an LMDB index): use a fresh data directory (the store is a "
                    "cache; nothing in it needs to be kept)"
                )
            elif fmt != FORMAT:
                raise StorageError(
                    f"{self.path} was written in store format {fmt.decode(errors='replace')!r}; "
                    f"this build reads {FORMAT.decode()!r}: use a fresh data directory "
                    "(the store is a cache; nothing in it needs to be kept)"
                )
            self.classes = ClassTable.unpack(txn.get(CLASSES_KEY, db=self._meta))
            raw_policy = txn.get(b"policy", db=self._meta)
            cursor = txn.cursor(db=self._meta)
            self.book.load(
                [(USAGE_PREFIX + rest, value) for rest, value in _meta_rows(cursor, USAGE_PREFIX)]
            )
            segments = {
                int.from_bytes(rest, "big"): SegmentState.unpack(value)
                for rest, value in _meta_rows(cursor, SEGMENT_PREFIX)
            }
            latest = {
                int.from_bytes(rest, "big"): _U64.unpack(value)[0]
                for rest, value in _meta_rows(cursor, SEGMENT_EXPIRY_PREFIX)
            }
            forgotten = Deltas()
            if lost:
                forgotten = self._forget_segments(txn, lost)
                for seg in lost:
                    txn.delete(SEGMENT_PREFIX + seg.to_bytes(4, "big"), db=self._meta)
                    segments.pop(seg)
            for seg in set(latest) - set(segments):  # a segment gone: its row goes too
                txn.delete(SEGMENT_EXPIRY_PREFIX + seg.to_bytes(4, "big"), db=self._meta)
                del latest[seg]
        self._latest_expiry = latest
        self.book.apply(forgotten)
        self.segments.load(segments)
        if raw_policy is not None:
            persisted = RetentionPolicy.from_mapping(json.loads(raw_policy), source="stored policy")
            if persisted != self.policy:
                log.warning(
                    "using the retention policy set through the admin API (%s) instead of the "
                    "configured one (%s); DELETE /retention reverts to the configured one",
                    persisted.to_dict(),
                    self.policy.to_dict(),
                )
            self.policy = persisted
        self._next_sweep_ms = self._first_expiry_ms()


def _meta_rows(cursor: lmdb.Cursor, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """The meta rows whose keys start with ``prefix``: (the rest of the key, value)."""
    rows: list[tuple[bytes, bytes]] = []
    if cursor.set_range(prefix):
        for key, value in cursor:
            raw = bytes(key)
            if not raw.startswith(prefix):
                break
            rows.append((raw[len(prefix) :], bytes(value)))
    return rows


def _bytes_by_class(c: CheckedPut) -> dict[str, int]:
    """The record bytes of a checked PUT batch per traffic class its headers name."""
    first = c.classes[0]
    if c.classes.count(first) == len(c.classes):
        return {first: sum(map(len, c.records))}
    out: dict[str, int] = {}
    for record, cls in zip(c.records, c.classes, strict=True):
        out[cls] = out.get(cls, 0) + len(record)
    return out


def _partition_class(part: bytes) -> str:
    """The stored class name of an expiry-index partition."""
    return part[TENANT_LEN:].rstrip(b"\x00").decode("ascii")


class _Columns:
    """The shards a PUT transaction writes, as columns (rows are built once the records'
    places in the segment are known)."""

    __slots__ = ("class_ids", "expiry", "keys", "records", "stripes")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.records: list[memoryview] = []
        self.class_ids: list[int] = []
        self.expiry: list[int] = []
        self.stripes: list[int] = []

    def add(self, key: bytes, record: memoryview, class_id: int, expiry: int, stripe: int) -> None:
        self.keys.append(key)
        self.records.append(record)
        self.class_ids.append(class_id)
        self.expiry.append(expiry)
        self.stripes.append(stripe)

    def keep_last(self) -> None:
        """Keep only the last write of each key (a key written twice in one transaction)."""
        last = {k: i for i, k in enumerate(self.keys)}
        keep = sorted(last.values())
        for name in self.__slots__:
            column = getattr(self, name)
            setattr(self, name, [column[i] for i in keep])


@dataclass(frozen=True, slots=True)
class _Removed:
    """Shards a transaction removed from one partition, as columns: the expiry, size and
    written time (ms) of each, and its storage key (how removals are counted)."""

    expiry_ms: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    written_ms: npt.NDArray[np.int64]
    keys: list[bytes]

    @classmethod
    def of_rows(cls, rows: Sequence[tuple[int, int, int, bytes]]) -> _Removed:
        """From (expiry, size, written, key) of each shard."""
        expiry, sizes, written, keys = zip(*rows, strict=True) if rows else ((), (), (), ())
        return cls(
            np.array(expiry, np.int64), np.array(sizes, np.int64), np.array(written, np.int64),
            list(keys),
        )  # fmt: skip

    @classmethod
    def joined(cls, parts: Sequence[_Removed]) -> _Removed:
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.expiry_ms for p in parts]),
            np.concatenate([p.sizes for p in parts]),
            np.concatenate([p.written_ms for p in parts]),
            [k for p in parts for k in p.keys],
        )

    def where(self, mask: npt.NDArray[np.bool_]) -> _Removed:
        """The shards ``mask`` picks."""
        keys = list(itertools.compress(self.keys, mask.tolist()))
        return _Removed(self.expiry_ms[mask], self.sizes[mask], self.written_ms[mask], keys)


class _HadRows(Exception):
    """A PUT written without the lookup for earlier rows met one: write it again with it."""


def _put_new_rows(index: lmdb.Cursor, blocks: list[bytes], rows: list[bytes]) -> None:
    """Put the index rows of a PUT written without the lookup for earlier rows (storage
    keys distinct): the first row of each block with no-overwrite, so that a block holding
    a row from before this transaction refuses it, then its other shards' rows beside it.
    Raises :class:`_HadRows` when a block had one (the transaction is then undone)."""
    # Each block's first position: with a block repeated, the smallest index is kept last.
    first = dict(zip(reversed(blocks), range(len(blocks) - 1, -1, -1), strict=True))
    if len(first) == len(blocks):  # one shard of each block: what one node of twelve gets
        _, added = index.putmulti(zip(blocks, rows, strict=True), overwrite=False)
        if added != len(rows):
            raise _HadRows
        return
    heads = np.zeros(len(blocks), bool)
    heads[list(first.values())] = True
    head_at, rest_at = np.flatnonzero(heads).tolist(), np.flatnonzero(~heads).tolist()
    _, added = index.putmulti(((blocks[i], rows[i]) for i in head_at), overwrite=False)
    if added != len(head_at):
        raise _HadRows
    _, added = index.putmulti((blocks[i], rows[i]) for i in rest_at)
    if added != len(rest_at):  # never so (distinct keys, new rows), but undone if it were
        raise _HadRows


def _prefixes(tenant: bytes, items: npt.NDArray[np.void]) -> list[bytes]:
    """tenant + block key of every item: the prefix of that key's storage keys."""
    raw = np.ascontiguousarray(items["key"]).tobytes()
    return [tenant + raw[i : i + 16] for i in range(0, len(raw), 16)]
