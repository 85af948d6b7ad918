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
* GET replies are views into the read transaction (no copy);
  :meth:`GetResult.release` ends it once the reply is sent.
* Hits do not write on the read path: they are collected and written in
  batches by :meth:`ShardStore.maintain`, and only when they move an expiry
  by at least ``touch_resolution_s``.

A store is owned by one thread; only :meth:`usage` and :attr:`counters` may be
read from others.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import lmdb
import numpy as np
import numpy.typing as npt

from kvcache.credentials import TenantId
from kvcache.errors import CapacityError, ConfigError, ProtocolError, QuotaError, StorageError
from kvcache.retention import decide
from kvcache.retention.decide import Applied, WriteAction, clamp
from kvcache.retention.policy import RetentionPolicy
from kvcache.server.accounting import Deltas, UsageBook
from kvcache.server.config import DamagedFile, SyncMode, default_map_size
from kvcache.server.eviction import Quota, capacity_tiers, quota_needs
from kvcache.server.lmdb_env import LmdbEnvironment, storage_error
from kvcache.server.records import (
    FORMAT,
    KEY_LEN,
    PARTITION_LEN,
    RETENTION_HEAD,
    TENANT_LEN,
    USAGE_PREFIX,
    CheckedPut,
    Retention,
    check_put,
    expiry_entry,
    fresh_rows,
    partition,
    record_class,
    record_expiry,
    split_expiry_entry,
    store_keys,
)
from kvcache.server.removals import RemovalBook
from kvcache.shard import HEADER_DTYPE
from kvcache.wire import NO_INDEX, NO_RETAIN, Op, Retain, Status, make_items

__all__ = ["COUNTERS", "Clock", "GetResult", "PutBatch", "ReplyTooLargeError", "ShardStore"]

log = logging.getLogger(__name__)

#: Seconds since the epoch; injected so tests step days without sleeping.
Clock = Callable[[], float]

_U64 = struct.Struct(">Q")
#: The payload length field of a stored shard's header (see kvcache.shard.HEADER_DTYPE).
_PAYLOAD_LEN = struct.Struct("<I")
_PAYLOAD_LEN_AT: int = HEADER_DTYPE.fields["payload_len"][1]  # type: ignore[index]
_second = operator.itemgetter(1)
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
    "put_conflicts",
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


def _watch_damage(
    method: Callable[Concatenate[ShardStore, P], R],
) -> Callable[Concatenate[ShardStore, P], R]:
    """A store call whose LMDB errors become StorageErrors, and whose damage errors
    (``corrupted``: the file itself is bad) mark the store damaged (see ShardStore.damaged)."""

    @functools.wraps(method)
    def call(self: ShardStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except lmdb.Error as exc:
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
    """A GET's reply items and the stored records, as views into a read transaction.

    The views stay valid until :meth:`release`; call it once the reply is sent.
    """

    __slots__ = ("_txn", "items", "parts")

    def __init__(
        self, items: npt.NDArray[np.void], parts: list[memoryview], txn: lmdb.Transaction | None
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
    ) -> None:
        if not 0 < low_watermark < high_watermark <= 1:
            raise ConfigError(f"bad watermarks low={low_watermark} high={high_watermark}")
        self.capacity_bytes = capacity_bytes
        self._high = int(capacity_bytes * high_watermark)
        self._low = int(capacity_bytes * low_watermark)
        # Set when usage reached the high watermark; background eviction then runs until
        # usage is down to the low one.
        self._draining = False
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
        self._env = self._lmdb.env
        self._shards = self._lmdb.shards
        self._retention = self._lmdb.retention
        self._expiry = self._lmdb.expiry
        self._meta = self._lmdb.meta
        #: (expiry_ms, class) a hit asked for, per storage key, not yet written.
        self._pending: dict[bytes, tuple[int, str]] = {}
        self._pending_since = 0.0
        self._next_sweep_ms = 0
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
            self._lmdb.close()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def failed(self, exc: BaseException, what: str) -> StorageError:
        """The StorageError for an LMDB or OS exception; a damaged file marks the store."""
        error = storage_error(exc, what)
        if error.kind == "corrupted":
            self.mark_damaged(str(error))
        return error

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

    # ------------------------------------------------------------------ policy

    def set_policy(self, policy: RetentionPolicy) -> None:
        """Use ``policy`` from now on and persist it (it then wins over the config file).

        Stored expiries are kept: a new TTL applies from each shard's next write or hit.
        """
        with self._env.begin(write=True) as txn:
            txn.put(b"policy", policy.to_json(), db=self._meta)
        self.policy = policy

    def clear_policy(self, fallback: RetentionPolicy) -> None:
        """Forget a persisted policy and use ``fallback`` (the config file's) again."""
        with self._env.begin(write=True) as txn:
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
        incoming: dict[bytes, dict[str, int]] = {}
        for c in passed:
            per = incoming.setdefault(c.keys[0][:TENANT_LEN], {})
            for record, cls in zip(c.records, c.classes, strict=True):
                name = self.policy.resolve(cls)
                per[name] = per.get(name, 0) + len(record)
        total = sum(sum(v.values()) for v in incoming.values())
        for tenant, per_class in incoming.items():
            self._make_room_for_quota(TenantId(tenant), per_class)
        self._make_room(
            total, writer=TenantId(next(iter(incoming))) if len(incoming) == 1 else None
        )
        self._lmdb.preallocate(total)
        now = self.now_ms()
        resolved: dict[tuple[str, Retain], tuple[str, int]] = {}
        pins = self._pin_rooms(passed)
        replace_after_ms = self._replace_after_ms
        deltas = Deltas()
        status_updates: list[tuple[CheckedPut, list[int]]] = []
        try:
            with self._env.begin(write=True) as txn:
                get_old = txn.cursor(db=self._retention).getmulti
                shard_rows: list[tuple[bytes, memoryview]] = []
                retention_rows: dict[bytes, bytes] = {}
                expiry_rows: list[tuple[bytes, bytes]] = []
                earliest = 2**63
                for c in passed:
                    old = dict(get_old(list(dict.fromkeys(c.keys))))
                    if not old and self._fresh_batch(c, retention_rows):
                        # The common PUT: every shard new. Rows built as columns.
                        earliest = min(
                            earliest,
                            self._write_fresh(c, now, resolved, pins, shard_rows, retention_rows,
                                              expiry_rows, deltas),
                        )  # fmt: skip
                        continue
                    conflicts: list[int] = []
                    for j, (skey, record, cls, stripe, expect) in enumerate(
                        zip(c.keys, c.records, c.classes, c.stripes, c.expects, strict=True)
                    ):
                        if (cls, c.retain) not in resolved:
                            resolved[cls, c.retain] = self._write_retention(cls, now, c, pins)
                        name, expiry = resolved[cls, c.retain]
                        before = retention_rows.get(skey) or old.get(skey)
                        if before is not None:
                            rec = Retention.unpack(before)
                            current = self._current(skey, before)
                            action = decide.write_action(
                                stored_expiry_ms=current[0],
                                stored_stripe=rec.stripe,
                                stored_written_ms=rec.written_ms,
                                stripe=stripe,
                                expect=expect,
                                now_ms=now,
                                replace_after_ms=replace_after_ms,
                            )
                            if action is WriteAction.CONFLICT:
                                conflicts.append(j)
                                continue
                            old_part = partition(skey[:TENANT_LEN], rec.traffic_class)
                            deltas.add(old_part, -rec.size, -1)
                            if skey in retention_rows:  # written earlier in this batch
                                expiry_rows.remove(
                                    expiry_entry(skey, rec.traffic_class, rec.expiry_ms)
                                )
                            else:
                                txn.delete(
                                    *expiry_entry(skey, rec.traffic_class, rec.expiry_ms),
                                    db=self._expiry,
                                )
                            if action is WriteAction.REPEAT:
                                # A repeat of the same write keeps the later expiry and its class.
                                expiry, name = decide.merge(current, (expiry, name))
                            self._pending.pop(skey, None)
                        size = len(record)
                        shard_rows.append((skey, record))
                        retention_rows[skey] = (
                            RETENTION_HEAD.pack(expiry, size, stripe, now) + name.encode()
                        )
                        expiry_rows.append(expiry_entry(skey, name, expiry))
                        deltas.add(partition(skey[:TENANT_LEN], name), size, 1)
                        earliest = min(earliest, expiry)
                    if conflicts:
                        status_updates.append((c, conflicts))
                if shard_rows:
                    txn.cursor(db=self._shards).putmulti(shard_rows)
                    txn.cursor(db=self._retention).putmulti(list(retention_rows.items()))
                    txn.cursor(db=self._expiry).putmulti(expiry_rows)
                    self._write_usage(txn, deltas)
        except lmdb.Error as exc:
            raise self.failed(exc, f"storing {len(passed)} PUT batch(es)") from exc
        except OSError as exc:
            raise self.failed(exc, f"storing {len(passed)} PUT batch(es)") from exc
        self.book.apply(deltas)
        self._next_sweep_ms = min(self._next_sweep_ms, earliest)
        for c, conflicts in status_updates:
            c.status[[c.positions[j] for j in conflicts]] = Status.CONFLICT
            self.counters["put_conflicts"] += len(conflicts)

    @staticmethod
    def _fresh_batch(c: CheckedPut, retention_rows: dict[bytes, bytes]) -> bool:
        """No key of ``c`` repeats, in it or in what this transaction wrote already."""
        keys = set(c.keys)
        return len(keys) == len(c.keys) and keys.isdisjoint(retention_rows)

    def _write_fresh(
        self,
        c: CheckedPut,
        now: int,
        resolved: dict[tuple[str, Retain], tuple[str, int]],
        pins: dict[int, bool],
        shard_rows: list[tuple[bytes, memoryview]],
        retention_rows: dict[bytes, bytes],
        expiry_rows: list[tuple[bytes, bytes]],
        deltas: Deltas,
    ) -> int:
        """Rows of a batch of new shards (no previous record of any); returns the earliest
        expiry written."""
        earliest = 2**63
        groups: dict[str, list[int]] = {}
        for j, cls in enumerate(c.classes):
            groups.setdefault(cls, []).append(j)
        sizes = np.fromiter(map(len, c.records), np.int64, len(c.records))
        stripes = np.array(c.stripes, np.uint64)
        tenant = c.keys[0][:TENANT_LEN]
        for cls, idx in groups.items():
            if (cls, c.retain) not in resolved:
                resolved[cls, c.retain] = self._write_retention(cls, now, c, pins)
            name, expiry = resolved[cls, c.retain]
            keys = c.keys if len(idx) == len(c.keys) else [c.keys[j] for j in idx]
            records = c.records if len(idx) == len(c.keys) else [c.records[j] for j in idx]
            sel = np.asarray(idx, np.int64)
            ret, exp = fresh_rows(
                keys,
                sizes[sel],
                stripes[sel],
                traffic_class=name,
                expiry_ms=expiry,
                written_ms=now,
            )
            shard_rows.extend(zip(keys, records, strict=True))
            retention_rows.update(zip(keys, ret, strict=True))
            expiry_rows.extend(exp)
            deltas.add(partition(tenant, name), int(sizes[sel].sum()), len(idx))
            earliest = min(earliest, expiry)
        return earliest

    def _make_room_for_quota(self, tenant: TenantId, incoming: dict[str, int]) -> None:
        """Evict the tenant's own shards so ``incoming`` fits its quotas, or raise QuotaError."""
        quota = self.quotas.get(tenant)
        if quota is None:
            return
        parts = {p: self.book.partition_bytes(p) for p in self.book.partitions(tenant)}
        class_bytes = {p[TENANT_LEN:].rstrip(b"\x00").decode(): n for p, n in parts.items()}
        needs = quota_needs(
            quota,
            tenant_bytes=sum(parts.values()),
            class_bytes=class_bytes,
            incoming=incoming,
        )
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

        The rest of the way down to the low watermark is background work
        (:meth:`maintain`, bounded batches between requests), so no request
        waits for a large eviction.
        """
        if self.book.used + incoming <= self._high:
            return
        if incoming > self.capacity_bytes:
            raise CapacityError(
                f"batch of {incoming} bytes exceeds the node capacity of {self.capacity_bytes}"
            )
        self._draining = True
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
        shard's own class when none is given); an expired shard is NOT_FOUND
        even before the sweeper removes it. The caller must release the result.
        """
        keys = store_keys(tenant, items["key"], items["index"])
        wanted = items["stripe"].tolist()
        reply = make_items(Op.GET, len(keys), reply=True)  # all OK (0), length 0
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
        txn = self._env.begin(buffers=True)
        try:
            parts = self._get_quiet(txn, keys, wanted, quiet_above)
            if parts is not None:  # every item a live hit of the wanted stripe, no slide due
                sizes = list(map(len, parts))
                self._check_reply_size(sizes)
                reply["length"] = sizes
                return GetResult(reply, parts, txn)
            parts = []
            hits: list[int] = []
            sizes = []
            lookup = txn.get
            rdb, sdb = self._retention, self._shards
            unpack = RETENTION_HEAD.unpack_from
            for i, key in enumerate(keys):
                raw = lookup(key, None, rdb)
                if raw is None:
                    continue
                expiry, _size, stripe, _written = unpack(raw)
                if wanted[i] and stripe != wanted[i]:
                    continue
                if expiry <= quiet_above and not self._alive(key, raw, now, hit, ttl_hint):
                    continue
                record = lookup(key, None, sdb)
                if record is None:  # pragma: no cover - retention without shard: never so
                    continue
                parts.append(record)
                hits.append(i)
                sizes.append(len(record))
            self._check_reply_size(sizes, hits)
            if len(hits) < len(keys):
                reply["status"] = Status.NOT_FOUND
                reply["status"][hits] = Status.OK
            reply["length"][hits] = sizes
            return GetResult(reply, parts, txn)
        except BaseException:
            txn.abort()
            raise

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
        self, txn: lmdb.Transaction, keys: list[bytes], wanted: list[int], quiet_above: int
    ) -> list[memoryview] | None:
        """Every record of ``keys`` if all are live hits of the wanted stripes that need no
        expiry slide, else None (the caller then takes the per-item path).

        The common GET, done without a Python step per item: two ``getmulti``
        lookups and the checks over C iterators.
        """
        if not keys or (self._pending and not self._pending.keys().isdisjoint(keys)):
            return None
        found = txn.cursor(db=self._retention).getmulti(keys)
        if len(found) != len(keys):
            return None
        heads = list(map(RETENTION_HEAD.unpack_from, map(_second, found)))
        if min(heads)[0] <= quiet_above:
            return None
        if any(w and w != h[2] for w, h in zip(wanted, heads, strict=True)):
            return None
        records = txn.cursor(db=self._shards).getmulti(keys)
        if len(records) != len(keys):  # pragma: no cover - retention without shard: never so
            return None
        return list(map(_second, records))

    @_watch_damage
    def has(self, tenant: TenantId, items: npt.NDArray[np.void]) -> npt.NDArray[np.void]:
        """One record (ordinal, shard index, stripe id) per live shard of each asked key."""
        # The match path of every request: one cursor walk, no objects per shard.
        found: list[tuple[int, int, int]] = []
        append = found.append
        now = self.now_ms()
        pending = self._pending
        unpack = RETENTION_HEAD.unpack_from
        prefix_len = TENANT_LEN + 16
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._retention)
            set_range, key_of, value_of, step = (
                cursor.set_range,
                cursor.key,
                cursor.value,
                cursor.next,
            )
            for ordinal, key in enumerate(_prefixes(tenant, items)):
                if not set_range(key):
                    continue
                while True:
                    skey = key_of()
                    if skey[:prefix_len] != key:
                        break
                    expiry, _size, stripe, _written = unpack(value_of())
                    if pending:
                        expiry = max(expiry, pending.get(bytes(skey), (0,))[0])
                    if expiry > now:
                        append((ordinal, (skey[-2] << 8) | skey[-1], stripe))
                    if not step():
                        break
        reply = make_items(Op.HAS, len(found), reply=True)
        if found:
            arr = np.array(found, dtype=np.uint64)
            reply["ordinal"] = arr[:, 0]
            reply["index"] = arr[:, 1]
            reply["stripe"] = arr[:, 2]
        return reply

    # ------------------------------------------------------------------ LIST / scrub

    @_watch_damage
    def list_shards(
        self, tenant: TenantId, start: bytes, index: int, *, inclusive: bool, limit: int
    ) -> npt.NDArray[np.void]:
        """Up to ``limit`` live shards of ``tenant`` from (``start`` key, ``index``) on, in
        storage-key order (key, then index), as LIST reply records. One read transaction
        over the retention records; each shard's header is read for its payload length."""
        if limit <= 0:
            return make_items(Op.LIST, 0, reply=True)
        now = self.now_ms()
        pending = self._pending
        unpack = RETENTION_HEAD.unpack_from
        payload_len = _PAYLOAD_LEN.unpack_from
        first = tenant + start + index.to_bytes(2, "big")
        skeys: list[bytes] = []
        heads: list[tuple[int, int, int]] = []
        payloads: list[int] = []
        classes: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._retention)
            lookup, sdb = txn.get, self._shards
            found = cursor.set_range(first)
            if found and not inclusive and bytes(cursor.key()) == first:
                found = cursor.next()
            while found:
                skey = bytes(cursor.key())
                if skey[:TENANT_LEN] != tenant:
                    break
                raw = cursor.value()
                expiry, size, stripe, _written = unpack(raw)
                if pending:
                    expiry = max(expiry, pending.get(skey, (0,))[0])
                record = lookup(skey, None, sdb) if expiry > now else None
                if record is not None:
                    skeys.append(skey)
                    heads.append((size, stripe, expiry))
                    payloads.append(
                        payload_len(record, _PAYLOAD_LEN_AT)[0]
                        if len(record) >= _PAYLOAD_LEN_AT + 4
                        else 0
                    )
                    classes.append(bytes(raw[RETENTION_HEAD.size :]))
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
            cursor = txn.cursor(db=self._shards)
            if not cursor.set_range(after):
                return out
            if bytes(cursor.key()) == after and not cursor.next():
                return out
            for skey, record in cursor:
                out.append((bytes(skey), bytes(record)))
                total += len(record)
                if total >= max_bytes:
                    break
        return out

    @_watch_damage
    def discard(self, found: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete each shard (storage key, record) whose stored record is still exactly
        ``record`` (a scrub found it bad; a shard rewritten since stays). Returns how many."""
        deltas = Deltas()
        try:
            with self._env.begin(write=True) as txn:
                for skey, record in found:
                    stored = txn.get(skey, db=self._shards)
                    raw = txn.get(skey, db=self._retention)
                    if stored is None or raw is None or bytes(stored) != record:
                        continue
                    self._remove(txn, skey, Retention.unpack(raw), deltas)
                self._write_usage(txn, deltas)
        except lmdb.Error as exc:
            raise self.failed(exc, "deleting bad shards") from exc
        self.book.apply(deltas)
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
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._retention)
            for i, key in enumerate(_prefixes(tenant, items)):
                for skey, raw in _walk(cursor, key):
                    if self._alive(bytes(skey), raw, now, hit, retain.ttl_s, budget):
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
        deleted: dict[bytes, list[tuple[int, int, int]]] = {}
        try:
            with self._env.begin(write=True) as txn:
                cursor = txn.cursor(db=self._retention)
                for i, (key, stripe, index) in enumerate(
                    zip(
                        _prefixes(tenant, items),
                        items["stripe"].tolist(),
                        items["index"].tolist(),
                        strict=True,
                    )
                ):
                    if index == NO_INDEX:
                        victims = [(bytes(k), Retention.unpack(v)) for k, v in _walk(cursor, key)]
                    else:
                        skey = key + index.to_bytes(2, "big")
                        raw = txn.get(skey, db=self._retention)
                        victims = [] if raw is None else [(skey, Retention.unpack(raw))]
                    for skey, rec in victims:
                        if stripe and rec.stripe != stripe:
                            continue
                        self._remove(txn, skey, rec, deltas)
                        gone = deleted.setdefault(partition(tenant, rec.traffic_class), [])
                        gone.append((rec.expiry_ms, rec.size, rec.written_ms))
                        status[i] = Status.OK
                self._write_usage(txn, deltas)
        except lmdb.Error as exc:
            raise self.failed(exc, "DELETE") from exc
        self.book.apply(deltas)
        for skey in deltas.removed:
            self._pending.pop(skey, None)
        for part, removed in deleted.items():
            self._count_removed(part, "deleted", removed)
        reply = make_items(Op.DELETE, len(items), reply=True)
        reply["status"] = status
        return reply

    # ------------------------------------------------------------------ retention work

    @_watch_damage
    def maintain(self) -> bool:
        """Do what is due: write hits, sweep one bounded batch, evict.

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
            more |= self.sweep(limit=self._sweep_batch) >= self._sweep_batch
        if self.book.used > self._high:
            self._draining = True
        if self._draining:
            self.evict(self._low, limit=self._sweep_batch)
            self._draining = self.book.used > self._low
            more |= self._draining
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
            with self._env.begin(write=True) as txn:
                for skey, (candidate, cls) in pending.items():
                    raw = txn.get(skey, db=self._retention)
                    if raw is None:
                        continue
                    rec = Retention.unpack(raw)
                    candidate, cls = decide.merge(
                        (rec.expiry_ms, rec.traffic_class), (candidate, cls)
                    )
                    if candidate == rec.expiry_ms and cls == rec.traffic_class:
                        continue
                    new = Retention(candidate, rec.size, rec.stripe, rec.written_ms, cls)
                    txn.delete(
                        *expiry_entry(skey, rec.traffic_class, rec.expiry_ms), db=self._expiry
                    )
                    txn.put(*expiry_entry(skey, cls, candidate), db=self._expiry)
                    txn.put(skey, new.pack(), db=self._retention)
                    if cls != rec.traffic_class:
                        moved.add(partition(skey[:TENANT_LEN], rec.traffic_class), -rec.size, -1)
                        moved.add(partition(skey[:TENANT_LEN], cls), rec.size, 1)
                    updated += 1
                self._write_usage(txn, moved)
        except lmdb.Error as exc:
            raise self.failed(exc, "writing hits") from exc
        self.book.apply(moved)
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

        Returns bytes freed (less than asked when the partitions ran empty or
        ``limit`` shards were deleted).
        """
        self.flush_touches()
        freed = 0
        shards = 0
        # Pinned shards have partitions of their own, which pressure passes by.
        parts = [p for p in parts if decide.evictable(_partition_class(p))]
        heads = {p: h for p in parts if (h := self._head_expiry(p)) is not None}
        while freed < nbytes and heads and (limit is None or shards < limit):
            part = min(heads, key=heads.__getitem__)
            batch = self._sweep_batch if limit is None else min(self._sweep_batch, limit - shards)
            out = self._delete_head(
                part, batch, until_bytes=nbytes - freed,
                cause="quota" if counter == "quota_evicted" else "evicted",
            )  # fmt: skip
            freed += out.freed_bytes
            shards += out.freed_shards
            self.counters[f"{counter}_shards"] += out.freed_shards
            self.counters[f"{counter}_bytes"] += out.freed_bytes
            head = self._head_expiry(part)
            if head is None or not out.freed_shards:
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
        unpack = RETENTION_HEAD.unpack_from
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
                    raw = txn.get(skey, db=self._retention) if decide.is_live(expiry, now) else None
                    if raw is not None:
                        key = (
                            TenantId(part[:TENANT_LEN]),
                            decide.split_stored(_partition_class(part))[0],
                        )
                        out[key] = max(out.get(key, 0), now - int(unpack(raw)[3]))
                        break
                    if not cursor.next():
                        break
        return out

    def recount(self) -> dict[str, Any]:
        """Usage recomputed from the retention records (a consistency check for tests)."""
        book = UsageBook()
        deltas = Deltas()
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._retention):
                rec = Retention.unpack(raw)
                deltas.add(partition(key[:TENANT_LEN], rec.traffic_class), rec.size, 1)
        book.apply(deltas)
        return {**book.snapshot(), "capacity_bytes": self.capacity_bytes}

    def expiry_of(self, tenant: TenantId, key: bytes, index: int) -> tuple[int, str] | None:
        """(expiry_ms, class) of one shard as stored plus pending hits, or None."""
        skey = tenant + key + index.to_bytes(2, "big")
        with self._env.begin() as txn:
            raw = txn.get(skey, db=self._retention)
        if raw is None:
            return None
        rec = Retention.unpack(raw)
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
        raw: bytes | memoryview,
        now: int,
        hit: Applied | None,
        ttl_hint: int = 0,
        pin_budget: list[int] | None = None,
    ) -> bool:
        """Whether the shard is live; if so, record the hit's expiry slide (and pin, while
        ``pin_budget[0]`` bytes of pin quota are left)."""
        # The expiry first, the class only when a slide is due: most hits need no class.
        expiry, pending_class = record_expiry(raw), ""
        if self._pending:
            pending = self._pending.get(bytes(key))
            if pending is not None and pending[0] > expiry:
                expiry, pending_class = pending
        if expiry <= now:  # decide.is_live, inline: this runs for every hit of a walk
            return False
        policy = self.policy
        pin = False
        if pin_budget is not None and decide.evictable(pending_class or record_class(raw)):
            size = int(RETENTION_HEAD.unpack_from(raw)[1])
            pin = size <= pin_budget[0]
            if pin:
                pin_budget[0] -= size
            else:
                self._clamped("pin dropped: the tenant's pin quota is full", pin_dropped=True)
        if not pin and now + policy.max_ttl_s * 1000 - expiry < self._resolution_ms:
            return True  # no class could move the expiry enough to be worth a write
        stored = pending_class or record_class(raw)
        if hit is None:
            hit = clamp(policy, decide.split_stored(stored)[0], ttl_s=ttl_hint or None)
        if pin:
            hit = replace(hit, pin=True)
        move = decide.slide(
            expiry_ms=expiry, stored=stored, hit=hit, now_ms=now, resolution_ms=self._resolution_ms
        )
        if move is not None:
            if not self._pending:
                self._pending_since = self._monotonic()
            self._pending[bytes(key)] = move
        return True

    def _current(self, key: bytes | memoryview, raw: bytes | memoryview) -> tuple[int, str]:
        """(expiry, stored class) of a shard: its record's, or a pending hit's when later."""
        expiry = record_expiry(raw)
        if self._pending:
            pending = self._pending.get(bytes(key))
            if pending is not None and pending[0] > expiry:
                return pending
        return expiry, record_class(raw)

    def _remove(self, txn: lmdb.Transaction, skey: bytes, rec: Retention, deltas: Deltas) -> None:
        txn.delete(skey, db=self._shards)
        txn.delete(skey, db=self._retention)
        txn.delete(*expiry_entry(skey, rec.traffic_class, rec.expiry_ms), db=self._expiry)
        deltas.add(partition(skey[:TENANT_LEN], rec.traffic_class), -rec.size, -1)
        deltas.removed.append(skey)

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
        ``until_bytes`` were freed."""
        deltas = Deltas()
        last_expiry = 2**64 if until_expiry_ms is None else until_expiry_ms
        to_free = 2**63 if until_bytes is None else until_bytes
        unpack = RETENTION_HEAD.unpack_from
        removed = deltas.removed
        nbytes = 0
        gone: list[tuple[int, int, int]] = []  # (expiry, size, written) of each removed
        try:
            with self._env.begin(write=True) as txn:
                cursor = txn.cursor(db=self._expiry)
                lookup, delete = txn.get, txn.delete
                rdb, sdb = self._retention, self._shards
                ekey = cursor.key() if cursor.set_range(part) else b""
                while ekey[:PARTITION_LEN] == part and len(removed) < limit and nbytes < to_free:
                    expiry, skey = split_expiry_entry(ekey, cursor.value())
                    if expiry > last_expiry:
                        break
                    raw = lookup(skey, None, rdb)
                    cursor.delete()  # this duplicate, and move to the next entry
                    ekey = cursor.key()
                    if raw is None or unpack(raw)[0] != expiry:  # pragma: no cover - stale entry
                        log.warning("dropped a stale expiry entry for %s", skey.hex())
                        continue
                    delete(skey, b"", sdb)
                    delete(skey, b"", rdb)
                    removed.append(skey)
                    head = unpack(raw)
                    size = head[1]
                    gone.append((head[0], size, head[3]))
                    nbytes += size
                    deltas.add(part, -size, -1)
                self._write_usage(txn, deltas)
        except lmdb.Error as exc:
            raise self.failed(exc, "deleting expired or evicted shards") from exc
        self.book.apply(deltas)
        if self._pending:
            for skey in removed:
                self._pending.pop(skey, None)
        self._count_removed(part, cause, gone)
        return deltas

    def _count_removed(self, part: bytes, cause: str, gone: list[tuple[int, int, int]]) -> None:
        """Count removals of partition ``part``: an already expired shard that pressure
        reached counts as ``expired``, a live one under its ``cause``."""
        if not gone:
            return
        now = self.now_ms()
        tenant, name = part[:TENANT_LEN], decide.split_stored(_partition_class(part))[0]
        if cause != "expired":
            dead = [g for g in gone if not decide.is_live(g[0], now)]
            if dead:
                gone = [g for g in gone if decide.is_live(g[0], now)]
                self.removals.record(tenant, name, "expired", sizes=[g[1] for g in dead],
                                     ages_ms=[now - g[2] for g in dead])  # fmt: skip
        self.removals.record(
            tenant, name, cause, sizes=[g[1] for g in gone], ages_ms=[now - g[2] for g in gone]
        )

    def _first_expiry_ms(self) -> int:
        heads = [h for p in self.book.partitions() if (h := self._head_expiry(p)) is not None]
        return min(heads, default=2**63)

    def _write_usage(self, txn: lmdb.Transaction, deltas: Deltas) -> None:
        for key, value in self.book.meta_rows(deltas):
            txn.put(key, value, db=self._meta)

    def _load_meta(self) -> None:
        with self._env.begin(write=True) as txn:
            fmt = txn.get(b"format", db=self._meta)
            if fmt is None:
                if txn.stat(self._shards)["entries"]:
                    raise StorageError(f"{self.path} holds shards but no format marker")
                txn.put(b"format", FORMAT, db=self._meta)
            elif fmt != FORMAT:
                raise StorageError(
                    f"{self.path} was written in store format {fmt.decode(errors='replace')!r}; "
                    f"this build reads {FORMAT.decode()!r}: use a fresh data directory "
                    "(the store is a cache; nothing in it needs to be kept)"
                )
            raw_policy = txn.get(b"policy", db=self._meta)
            cursor = txn.cursor(db=self._meta)
            rows = []
            if cursor.set_range(USAGE_PREFIX):
                for key, value in cursor:
                    if not key.startswith(USAGE_PREFIX):
                        break
                    rows.append((bytes(key), bytes(value)))
            self.book.load(rows)
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


def _partition_class(part: bytes) -> str:
    """The stored class name of an expiry-index partition."""
    return part[TENANT_LEN:].rstrip(b"\x00").decode("ascii")


def _prefixes(tenant: bytes, items: npt.NDArray[np.void]) -> list[bytes]:
    """tenant + block key of every item: the prefix of that key's storage keys."""
    raw = np.ascontiguousarray(items["key"]).tobytes()
    return [tenant + raw[i : i + 16] for i in range(0, len(raw), 16)]


def _walk(cursor: lmdb.Cursor, prefix: bytes) -> Iterator[tuple[bytes, Any]]:
    """(storage key, value) of every record whose key starts with ``prefix``."""
    if not cursor.set_range(prefix):
        return
    size = len(prefix)
    while True:
        skey = bytes(cursor.key())
        if skey[:size] != prefix:
            return
        yield skey, cursor.value()
        if not cursor.next():
            return
