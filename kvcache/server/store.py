"""The shard store: one LMDB environment, retention, sweeping and eviction. No sockets.

All storage logic of a daemon lives in :class:`ShardStore` (the network front
end in :mod:`kvcache.server.service` only decodes, calls and encodes), so it is
tested directly with a fake clock. Batch operations take and return wire item
records (:mod:`kvcache.wire`), which lets a batch of hundreds of shards pass
with numpy instead of a Python object per item.

Layout of the environment (named databases)::

    shards     key16 | index u16 BE            → header || body, exactly as PUT
    retention  key16 | index u16 BE            → expiry_ms | size | stripe | class
    expiry     expiry_ms u64 BE | key16 | idx  → b""   (walked oldest first)
    meta       b"format", b"used", b"count",
               b"class:" + name → bytes u64 | shards u64, b"policy" → JSON

One PUT batch is one write transaction: it all lands or none of it does
(:meth:`ShardStore.put_many` writes several batches in one: group commit).
Hits do not write on the read path: they are collected and written in
batches by :meth:`ShardStore.maintain`, and only when they move an expiry by
at least ``touch_resolution_s``. A store is owned by one thread; only
:meth:`usage` and :attr:`counters` may be read from others.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import operator
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import numpy.typing as npt

from kvcache.errors import CapacityError, ConfigError, ProtocolError, StorageError
from kvcache.retention.policy import RetentionPolicy
from kvcache.server.config import SyncMode, default_map_size
from kvcache.server.records import (
    RETENTION_HEAD,
    CheckedPut,
    Retention,
    check_put,
    expiry_key,
    record_class,
    record_expiry,
    split_expiry_key,
    store_keys,
)
from kvcache.wire import NO_INDEX, Op, Status, make_items

__all__ = ["COUNTERS", "Clock", "ReplyTooLargeError", "ShardStore", "Usage"]

log = logging.getLogger(__name__)

#: Seconds since the epoch; injected so tests step days without sleeping.
Clock = Callable[[], float]

FORMAT = b"kvcache-store-v1"
_U64 = struct.Struct(">Q")
#: The leading expiry_ms of a retention record (see :class:`Retention`).
_EXPIRY = struct.Struct(">Q")
#: A retention record's fixed part: expiry_ms, size, stripe (the class name follows).
_RETENTION = struct.Struct(">QIQ")
_CLASS_COUNTS = struct.Struct(">QQ")
_second = operator.itemgetter(1)
#: The data file is kept allocated this far past what LMDB uses (see _preallocate).
_PREALLOCATE_BYTES = 64 << 20
#: Pending hits are written once this many have piled up, whatever their age.
_MAX_PENDING_TOUCHES = 8192
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


#: Names in :attr:`ShardStore.counters`.
COUNTERS = (
    "expired_shards",
    "expired_bytes",
    "evicted_shards",
    "evicted_bytes",
    "touches_written",
    "error_capacity",
    "error_map_full",
    "error_disk_full",
    "error_disk_io",
    "error_storage",
)


class ReplyTooLargeError(ProtocolError):
    """A GET would need a reply larger than the data-frame limit: ask for fewer shards."""


Usage = dict[str, Any]


class ShardStore:
    """Shards of one node in LMDB, with per-class retention. Owned by one thread."""

    def __init__(
        self,
        path: str | Path,
        *,
        capacity_bytes: int,
        policy: RetentionPolicy | None = None,
        clock: Clock = time.time,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        map_size_bytes: int | None = None,
        sync: SyncMode = SyncMode.PERIODIC,
        sync_interval_s: float = 5.0,
        sweep_batch: int = 512,
        touch_resolution_s: float = 60.0,
        touch_flush_s: float = 1.0,
        max_reply_bytes: int = 256 << 20,
    ) -> None:
        if not 0 < low_watermark < high_watermark <= 1:
            raise ConfigError(f"bad watermarks low={low_watermark} high={high_watermark}")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self._high = int(capacity_bytes * high_watermark)
        self._low = int(capacity_bytes * low_watermark)
        self._clock = clock
        self._sync = sync
        self._sync_interval = sync_interval_s
        self._sweep_batch = sweep_batch
        self._resolution_ms = int(touch_resolution_s * 1000)
        self._touch_flush_s = touch_flush_s
        self._max_reply = max_reply_bytes
        self._lock = threading.Lock()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lockfile = _lock_dir(self.path)
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=map_size_bytes or default_map_size(capacity_bytes),
                max_dbs=4,
                writemap=False,
                sync=sync is SyncMode.COMMIT,
                metasync=sync is SyncMode.COMMIT,
                readahead=False,
                max_readers=64,
            )
        except lmdb.Error as exc:
            os.close(self._lockfile)
            raise StorageError(f"cannot open LMDB environment in {self.path}: {exc}") from exc
        self._shards = self._env.open_db(b"shards")
        self._retention = self._env.open_db(b"retention")
        self._expiry = self._env.open_db(b"expiry")
        self._meta = self._env.open_db(b"meta")
        #: (expiry_ms, class) a hit asked for, per storage key, not yet written.
        self._pending: dict[bytes, tuple[int, str]] = {}
        self._pending_since = 0.0
        self._last_sync = time.monotonic()
        self._next_sweep_ms = 0
        #: Event counters (expired/evicted shards and bytes, errors by kind). The key set
        #: is fixed here, so another thread may copy the dict at any time.
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._used = 0
        self._count = 0
        self._by_class: dict[str, list[int]] = {}
        self.policy = policy or RetentionPolicy()
        self._load_meta()
        self._map_size = int(self._env.info()["map_size"])
        self._page_size = int(self._env.stat()["psize"])
        self._datafd = os.open(self.path / "data.mdb", os.O_RDWR)
        self._allocated = os.fstat(self._datafd).st_size
        # Periodic syncs run on their own thread: an fsync of hundreds of megabytes on
        # the service thread stalled every request behind it (tail latency spikes).
        self._stop_sync = threading.Event()
        self._syncer: threading.Thread | None = None
        if self._sync is SyncMode.PERIODIC:
            self._syncer = threading.Thread(
                target=self._sync_periodically, name="kvcache-lmdb-sync", daemon=True
            )
            self._syncer.start()

    def _sync_periodically(self) -> None:
        while not self._stop_sync.wait(self._sync_interval):
            try:
                self._env.sync(True)
            except lmdb.Error as exc:  # reported, retried at the next interval
                log.error("periodic LMDB sync failed: %s", exc)
            self._last_sync = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Write pending hits, sync, and close the environment (idempotent)."""
        if self._lockfile < 0:
            return
        self._stop_sync.set()
        if self._syncer is not None:
            self._syncer.join()
        try:
            self.flush_touches()
            self._env.sync(True)
        finally:
            self._env.close()
            os.close(self._datafd)
            os.close(self._lockfile)
            self._lockfile = -1

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    # ------------------------------------------------------------------ batch ops

    def put(self, items: npt.NDArray[np.void], data: memoryview) -> npt.NDArray[np.void]:
        """Store a PUT batch in one transaction; per-item status records."""
        reply = self.put_many([(items, data)])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def put_many(
        self, batches: Sequence[tuple[npt.NDArray[np.void], memoryview]]
    ) -> list[npt.NDArray[np.void] | ProtocolError]:
        """Store several PUT batches in ONE transaction (group commit); a reply per batch.

        Each batch's items are checked on their own and fail only themselves
        (a batch whose data does not match its items gets its ProtocolError
        back instead of a reply). What passed is written together: if that
        transaction fails, every batch's passing items are NO_SPACE (INTERNAL
        for a store error) and nothing of any of them is stored. The outcome
        equals writing the batches one after the other in order, except that
        none of them can evict another.
        """
        checked: list[CheckedPut | ProtocolError] = []
        for items, data in batches:
            try:
                checked.append(check_put(items, data))
            except ProtocolError as exc:
                checked.append(exc)
        passed = [c for c in checked if not isinstance(c, ProtocolError) and c.keys]
        if passed:
            failed = self._write_batches(passed)
            if failed is not None:
                for c in passed:
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

    def _write_batches(self, passed: list[CheckedPut]) -> Status | None:
        """Write checked batches in one transaction; the status every item gets if it fails."""
        if len(passed) == 1:
            keys, records, classes, stripes = (
                passed[0].keys,
                passed[0].records,
                passed[0].classes,
                passed[0].stripes,
            )
        else:
            keys = [k for c in passed for k in c.keys]
            records = [r for c in passed for r in c.records]
            classes = [n for c in passed for n in c.classes]
            stripes = [s for c in passed for s in c.stripes]
        try:
            self._write(keys, records, classes, stripes)
        except CapacityError as exc:
            log.warning("PUT of %d shards refused: %s", len(keys), exc)
            self.counters["error_capacity"] += 1
            return Status.NO_SPACE
        except lmdb.MapFullError:
            log.error(
                "LMDB map full (map size %d bytes) storing %d shards: raise map_size_bytes "
                "or lower capacity_bytes",
                self._env.info()["map_size"],
                len(keys),
            )
            self.counters["error_map_full"] += 1
            return Status.NO_SPACE
        except (lmdb.Error, OSError) as exc:
            kind = _write_error_kind(exc)
            log.error("PUT of %d shards failed (%s): %s", len(keys), kind, exc)
            self.counters[f"error_{kind}"] += 1
            return Status.INTERNAL if kind == "storage" else Status.NO_SPACE
        return None

    def get(
        self, items: npt.NDArray[np.void], traffic_class: str = ""
    ) -> tuple[npt.NDArray[np.void], bytes]:
        """Per-item status and length, and the found records concatenated (one copy).

        A hit slides the shard's expiry to ``now + ttl(traffic_class)`` (the
        shard's own class when none is given); an expired shard is NOT_FOUND
        even before the sweeper removes it.
        """
        keys = store_keys(items["key"], items["index"])
        reply = make_items(Op.GET, len(keys), reply=True)  # all OK (0), length 0
        now = self.now_ms()
        # Above this expiry a hit is live and no class's TTL could slide it by a
        # whole touch resolution: no bookkeeping, only the expiry test.
        policy = self.policy
        reach_ms = (policy.ttl_s(traffic_class) if traffic_class else policy.max_ttl_s) * 1000
        quiet_above = now + max(0, reach_ms - max(self._resolution_ms, 1))
        pending = self._pending
        unpack = _EXPIRY.unpack_from
        max_reply = self._max_reply
        hits: list[int] = []
        sizes: list[int] = []
        with self._env.begin(buffers=True) as txn:
            parts = self._get_quiet(txn, keys, quiet_above)
            if parts is not None:  # every item a live hit that needs no expiry slide
                sizes = list(map(len, parts))
                if sum(sizes) > max_reply:
                    first = next(i for i, t in enumerate(accumulate(sizes)) if t > max_reply)
                    raise ReplyTooLargeError(
                        f"GET reply would exceed {max_reply} bytes at item {first}: "
                        "ask for fewer shards per request"
                    )
                reply["length"] = sizes
            else:
                parts = []
                total = 0
                lookup = txn.get
                rdb, sdb = self._retention, self._shards
                for i, key in enumerate(keys):
                    raw = lookup(key, None, rdb)
                    if raw is None:
                        continue
                    expiry = unpack(raw)[0]
                    if pending and (slid := pending.get(key)) is not None and slid[0] > expiry:
                        expiry = slid[0]
                    if expiry <= quiet_above and not self._alive(key, raw, now, traffic_class):
                        continue
                    record = lookup(key, None, sdb)
                    if record is None:  # pragma: no cover - retention without shard: never so
                        continue
                    size = len(record)
                    total += size
                    if total > max_reply:
                        raise ReplyTooLargeError(
                            f"GET reply would exceed {max_reply} bytes at item {i}: "
                            "ask for fewer shards per request"
                        )
                    parts.append(record)
                    hits.append(i)
                    sizes.append(size)
                if len(hits) < len(keys):
                    reply["status"] = Status.NOT_FOUND
                    reply["status"][hits] = Status.OK
                reply["length"][hits] = sizes
            data = b"".join(parts)
        return reply, data

    def _get_quiet(
        self, txn: lmdb.Transaction, keys: list[bytes], quiet_above: int
    ) -> list[memoryview] | None:
        """Every record of ``keys`` if all are live hits that need no expiry slide, else None.

        The common GET, done without a Python step per item: two ``getmulti``
        lookups and the expiry test over C iterators. Anything else (a miss, an
        expired shard, a due slide, a pending slide of one of the keys) returns
        None and the caller takes the per-item path.
        """
        if not keys or (self._pending and not self._pending.keys().isdisjoint(keys)):
            return None
        found = txn.cursor(db=self._retention).getmulti(keys)
        if len(found) != len(keys):
            return None
        if min(map(_EXPIRY.unpack_from, map(_second, found)))[0] <= quiet_above:
            return None
        records = txn.cursor(db=self._shards).getmulti(keys)
        if len(records) != len(keys):  # pragma: no cover - retention without shard: never so
            return None
        return list(map(_second, records))

    def has(self, items: npt.NDArray[np.void]) -> npt.NDArray[np.void]:
        """One record (ordinal, shard index, stripe id) per live shard of each asked key."""
        # The match path of every request: one cursor walk, no objects per shard.
        found: list[tuple[int, int, int]] = []
        append = found.append
        now = self.now_ms()
        pending = self._pending
        unpack = RETENTION_HEAD.unpack_from
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._retention)
            set_range, key_of, value_of, step = (
                cursor.set_range,
                cursor.key,
                cursor.value,
                cursor.next,
            )
            for ordinal, key in enumerate(_keys16(items)):
                if not set_range(key):
                    continue
                while True:
                    skey = key_of()
                    if skey[:16] != key:
                        break
                    expiry, _size, stripe = unpack(value_of())
                    if pending:
                        expiry = max(expiry, pending.get(bytes(skey), (0,))[0])
                    if expiry > now:
                        append((ordinal, (skey[16] << 8) | skey[17], stripe))
                    if not step():
                        break
        reply = make_items(Op.HAS, len(found), reply=True)
        if found:
            arr = np.array(found, dtype=np.uint64)
            reply["ordinal"] = arr[:, 0]
            reply["index"] = arr[:, 1]
            reply["stripe"] = arr[:, 2]
        return reply

    def touch(self, items: npt.NDArray[np.void], traffic_class: str = "") -> npt.NDArray[np.void]:
        """Slide the expiry of every live shard of each key, without reading shard bytes."""
        status = np.full(len(items), Status.NOT_FOUND, dtype=np.uint8)
        now = self.now_ms()
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor(db=self._retention)
            for i, key in enumerate(_keys16(items)):
                for skey, raw in _prefix(cursor, key):
                    if self._alive(bytes(skey), raw, now, traffic_class):
                        status[i] = Status.OK
        reply = make_items(Op.TOUCH, len(items), reply=True)
        reply["status"] = status
        return reply

    def delete(self, items: npt.NDArray[np.void]) -> npt.NDArray[np.void]:
        """Remove matching shards (stripe 0: any; index NO_INDEX: all of the key) in one txn."""
        status = np.full(len(items), Status.NOT_FOUND, dtype=np.uint8)
        freed = _Freed()
        with self._env.begin(write=True) as txn:
            cursor = txn.cursor(db=self._retention)
            for i, (key, stripe, index) in enumerate(
                zip(_keys16(items), items["stripe"].tolist(), items["index"].tolist(), strict=True)
            ):
                if index == NO_INDEX:
                    victims = [(bytes(k), Retention.unpack(v)) for k, v in _prefix(cursor, key)]
                else:
                    skey = key + index.to_bytes(2, "big")
                    raw = txn.get(skey, db=self._retention)
                    victims = [] if raw is None else [(skey, Retention.unpack(raw))]
                for skey, rec in victims:
                    if stripe and rec.stripe != stripe:
                        continue
                    self._remove(txn, skey, rec, freed)
                    status[i] = Status.OK
            self._write_counts(txn, freed.deltas())
        self._apply(freed.deltas())
        for skey in freed.keys:
            self._pending.pop(skey, None)
        reply = make_items(Op.DELETE, len(items), reply=True)
        reply["status"] = status
        return reply

    # ------------------------------------------------------------------ retention work

    def maintain(self) -> bool:
        """Do what is due: write hits, sweep one bounded batch, evict, sync.

        Returns True when more work is waiting (call again soon); each call
        holds the writer for at most one bounded transaction per task, so reads
        and writes in between are not stalled for long.
        """
        more = False
        if self._pending and (
            len(self._pending) >= _MAX_PENDING_TOUCHES
            or time.monotonic() - self._pending_since >= self._touch_flush_s
        ):
            self.flush_touches()
        now = self.now_ms()
        if now >= self._next_sweep_ms:
            more |= self.sweep(limit=self._sweep_batch) >= self._sweep_batch
        if self._used > self._high:
            self.evict(self._low, limit=self._sweep_batch)
            more |= self._used > self._low
        return more

    def flush_touches(self) -> int:
        """Write the collected hits' expiries (one transaction); returns records updated."""
        if not self._pending:
            return 0
        pending, self._pending = self._pending, {}
        moved = _Freed()
        updated = 0
        with self._env.begin(write=True) as txn:
            for skey, (candidate, cls) in pending.items():
                raw = txn.get(skey, db=self._retention)
                if raw is None:
                    continue
                rec = Retention.unpack(raw)
                if candidate <= rec.expiry_ms:
                    continue
                new = Retention(candidate, rec.size, rec.stripe, cls)
                txn.delete(expiry_key(rec.expiry_ms, skey), db=self._expiry)
                txn.put(expiry_key(candidate, skey), b"", db=self._expiry)
                txn.put(skey, new.pack(), db=self._retention)
                if cls != rec.traffic_class:
                    moved.add(rec.traffic_class, -rec.size, -1)
                    moved.add(cls, rec.size, 1)
                updated += 1
            self._write_counts(txn, moved.deltas())
        self._apply(moved.deltas())
        self.counters["touches_written"] += updated
        return updated

    def sweep(self, *, limit: int | None = None) -> int:
        """Delete up to ``limit`` expired shards, earliest first; returns how many."""
        self.flush_touches()
        now = self.now_ms()
        freed = self._delete_head(limit or self._sweep_batch, until_expiry_ms=now)
        self.counters["expired_shards"] += freed.count
        self.counters["expired_bytes"] += freed.bytes
        if freed.count < (limit or self._sweep_batch):
            self._next_sweep_ms = self._first_expiry_ms()
        return freed.count

    def evict(self, target_bytes: int, *, limit: int | None = None) -> int:
        """Delete earliest-expiring shards until usage is at most ``target_bytes``."""
        self.flush_touches()
        evicted = 0
        while self._used > target_bytes:
            freed = self._delete_head(limit or self._sweep_batch, until_used=target_bytes)
            if not freed.count:
                break
            evicted += freed.count
            self.counters["evicted_shards"] += freed.count
            self.counters["evicted_bytes"] += freed.bytes
            if limit is not None:
                break
        return evicted

    # ------------------------------------------------------------------ introspection

    def usage(self) -> Usage:
        """Bytes and shards in total and per class; safe to call from any thread."""
        with self._lock:
            return {
                "used_bytes": self._used,
                "shards": self._count,
                "capacity_bytes": self.capacity_bytes,
                "classes": {
                    name: {"bytes": b, "shards": n}
                    for name, (b, n) in sorted(self._by_class.items())
                },
            }

    def recount(self) -> Usage:
        """Usage recomputed from the retention records (a consistency check for tests)."""
        used = count = 0
        by_class: dict[str, list[int]] = {}
        with self._env.begin() as txn:
            for _key, raw in txn.cursor(db=self._retention):
                rec = Retention.unpack(raw)
                used += rec.size
                count += 1
                entry = by_class.setdefault(rec.traffic_class, [0, 0])
                entry[0] += rec.size
                entry[1] += 1
        return {
            "used_bytes": used,
            "shards": count,
            "capacity_bytes": self.capacity_bytes,
            "classes": {
                name: {"bytes": b, "shards": n} for name, (b, n) in sorted(by_class.items())
            },
        }

    def expiry_of(self, key: bytes, index: int) -> tuple[int, str] | None:
        """(expiry_ms, class) of one shard as stored plus pending hits, or None."""
        skey = key + index.to_bytes(2, "big")
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

    def _write(
        self, keys: list[bytes], records: list[memoryview], classes: list[str], stripes: list[int]
    ) -> None:
        incoming = sum(map(len, records))
        self._make_room(incoming)
        self._preallocate(incoming)
        policy = self.policy
        now_s = self.now_ms() / 1000
        # (class, expiry) a write of each named class gets: once per batch, not per shard.
        resolved = {
            name: (cls, policy.expiry_for(cls, now_s))
            for name in set(classes)
            for cls in (policy.resolve(name),)
        }
        pack_key = _U64.pack
        pack = _RETENTION.pack
        unique = list(dict.fromkeys(keys))
        deltas = _Freed()
        with self._env.begin(write=True) as txn:
            old: dict[bytes, bytes] = dict(txn.cursor(db=self._retention).getmulti(unique))
            if not old and len(unique) == len(keys) and len(resolved) == 1:
                # The usual batch: new shards of one class. Same outcome as the loop below.
                ((cls, expiry),) = resolved.values()
                name = cls.encode("ascii")
                rows = [
                    (k, pack(expiry, n, st) + name)
                    for k, n, st in zip(keys, map(len, records), stripes, strict=True)
                ]
                prefix = pack_key(expiry)
                fresh = [(prefix + k, b"") for k in keys]
                deltas.add(cls, incoming, len(keys))
                earliest = expiry
            else:
                rows, fresh, earliest = self._merge_writes(
                    txn, keys, records, classes, stripes, resolved, old, deltas
                )
            txn.cursor(db=self._shards).putmulti(list(zip(keys, records, strict=True)))
            txn.cursor(db=self._retention).putmulti(rows)
            txn.cursor(db=self._expiry).putmulti(fresh)
            self._write_counts(txn, deltas.deltas())
        self._apply(deltas.deltas())
        self._next_sweep_ms = min(self._next_sweep_ms, earliest)

    def _merge_writes(
        self,
        txn: lmdb.Transaction,
        keys: list[bytes],
        records: list[memoryview],
        classes: list[str],
        stripes: list[int],
        resolved: dict[str, tuple[str, int]],
        old: dict[bytes, bytes],
        deltas: _Freed,
    ) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]], int]:
        """Retention rows and new expiry entries for a batch that overwrites or repeats keys.

        A rewrite keeps the later of the old and the new expiry (and that one's
        class); within a batch the last record of a key wins. Stale expiry
        entries are deleted here; returns (retention rows, expiry entries, earliest expiry).
        """
        pack_key = _U64.pack
        #: key → (expiry_ms, size, stripe, class)
        state: dict[bytes, tuple[int, int, int, str]] = {}
        for key, record, name, stripe in zip(keys, records, classes, stripes, strict=True):
            cls, candidate = resolved[name]
            size = len(record)
            current = state.get(key)
            if current is None and key in old:
                rec = Retention.unpack(old[key])
                current = (rec.expiry_ms, rec.size, rec.stripe, rec.traffic_class)
            if current is not None:
                deltas.add(current[3], -current[1], -1)
                if current[0] > candidate:
                    candidate, cls = current[0], current[3]
            state[key] = (candidate, size, stripe, cls)
            deltas.add(cls, size, 1)
        pack = _RETENTION.pack
        rows = [(k, pack(e, n, st) + c.encode("ascii")) for k, (e, n, st, c) in state.items()]
        fresh = []
        for key, (expiry, *_rest) in state.items():
            before = old.get(key)
            if before is not None:
                before_expiry = record_expiry(before)
                if before_expiry == expiry:
                    continue
                txn.delete(pack_key(before_expiry) + key, db=self._expiry)
            fresh.append((pack_key(expiry) + key, b""))
        return rows, fresh, min(r[0] for r in state.values())

    def _preallocate(self, incoming: int) -> None:
        """Keep the data file allocated a chunk ahead of what LMDB uses.

        LMDB grows its file by writing past the end; ext4 then allocates
        blocks inside every such ``pwrite``. Allocating them ahead in one
        ``fallocate`` made the store's part of a first fill 15 % cheaper
        (3-8 % of a PUT end to end, measured); once the node is full LMDB
        reuses its freed pages and this does nothing. Best effort: a failure
        (disk full, no fallocate) is left to LMDB's own write to report.
        """
        used = (int(self._env.info()["last_pgno"]) + 1) * self._page_size
        if used + 2 * incoming <= self._allocated or self._allocated >= self._map_size:
            return
        target = min(self._map_size, used + 2 * incoming + _PREALLOCATE_BYTES)
        try:
            os.posix_fallocate(self._datafd, self._allocated, target - self._allocated)
        except OSError as exc:
            log.debug("preallocating %s to %d bytes failed: %s", self.path, target, exc)
            return
        self._allocated = target

    def _make_room(self, incoming: int) -> None:
        if self._used + incoming <= self._high:
            return
        if incoming > self.capacity_bytes:
            raise CapacityError(
                f"batch of {incoming} bytes exceeds the node capacity of {self.capacity_bytes}"
            )
        self.evict(max(0, self._low - incoming))
        if self._used + incoming > self.capacity_bytes:
            raise CapacityError(
                f"no room for {incoming} bytes: {self._used} of {self.capacity_bytes} used "
                "after eviction"
            )

    def _alive(self, key: bytes, raw: bytes | memoryview, now: int, traffic_class: str) -> bool:
        """Whether the shard is live; if so, record the hit's expiry slide."""
        expiry = self._expiry_of(key, raw)
        if expiry <= now:
            return False
        policy = self.policy
        if now + policy.max_ttl_s * 1000 - expiry < max(self._resolution_ms, 1):
            return True  # no class could move the expiry enough to be worth a write
        cls = policy.resolve(traffic_class or record_class(raw))
        candidate = now + policy.ttl_s(cls) * 1000
        if candidate - expiry >= max(self._resolution_ms, 1):
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending[key] = (candidate, cls)
        return True

    def _expiry_of(self, key: bytes | memoryview, raw: bytes | memoryview) -> int:
        expiry = record_expiry(raw)
        if self._pending:
            pending = self._pending.get(bytes(key))
            if pending is not None and pending[0] > expiry:
                return pending[0]
        return expiry

    def _remove(self, txn: lmdb.Transaction, skey: bytes, rec: Retention, freed: _Freed) -> None:
        txn.delete(skey, db=self._shards)
        txn.delete(skey, db=self._retention)
        txn.delete(expiry_key(rec.expiry_ms, skey), db=self._expiry)
        freed.add(rec.traffic_class, -rec.size, -1)
        freed.keys.append(skey)

    def _delete_head(
        self, limit: int, *, until_expiry_ms: int | None = None, until_used: int | None = None
    ) -> _Freed:
        """Delete from the earliest expiry on, up to ``limit`` shards, in one transaction."""
        freed = _Freed()
        last_expiry = 2**64 if until_expiry_ms is None else until_expiry_ms
        # Stop once usage is down to until_used: while freed bytes < used - until_used.
        to_free = 2**63 if until_used is None else self._used - until_used
        unpack_u64 = _U64.unpack_from
        unpack_record = _RETENTION.unpack_from
        removed = freed.keys
        #: raw class name → [bytes, shards] freed
        by_class: dict[bytes, list[int]] = {}
        nbytes = 0
        with self._env.begin(write=True) as txn:
            cursor = txn.cursor(db=self._expiry)
            lookup, delete = txn.get, txn.delete
            rdb, sdb = self._retention, self._shards
            ekey = cursor.key() if cursor.first() else b""
            while ekey and len(removed) < limit and nbytes < to_free:
                expiry = unpack_u64(ekey)[0]
                if expiry > last_expiry:
                    break
                skey = ekey[_U64.size :]
                raw = lookup(skey, None, rdb)
                cursor.delete()  # and move to the next entry
                ekey = cursor.key()
                if raw is None or unpack_u64(raw)[0] != expiry:  # pragma: no cover - stale entry
                    log.warning("dropped a stale expiry entry for %s", skey.hex())
                    continue
                delete(skey, b"", sdb)
                delete(skey, b"", rdb)
                removed.append(skey)
                size = unpack_record(raw)[1]
                nbytes += size
                name = raw[_RETENTION.size :]
                entry = by_class.get(name)
                if entry is None:
                    by_class[name] = [size, 1]
                else:
                    entry[0] += size
                    entry[1] += 1
            for name, (dbytes, count) in by_class.items():
                freed.add(name.decode("ascii"), -dbytes, -count)
            self._write_counts(txn, freed.deltas())
        self._apply(freed.deltas())
        if self._pending:
            for skey in removed:
                self._pending.pop(skey, None)
        return freed

    def _first_expiry_ms(self) -> int:
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._expiry)
            if not cursor.first():
                return 2**63
            return split_expiry_key(cursor.key())[0]

    def _write_counts(self, txn: lmdb.Transaction, deltas: dict[str, list[int]]) -> None:
        if not deltas:
            return
        used = self._used
        count = self._count
        for name, (dbytes, dcount) in deltas.items():
            used += dbytes
            count += dcount
            before = self._by_class.get(name, [0, 0])
            txn.put(
                b"class:" + name.encode(),
                _CLASS_COUNTS.pack(before[0] + dbytes, before[1] + dcount),
                db=self._meta,
            )
        txn.put(b"used", _U64.pack(used), db=self._meta)
        txn.put(b"count", _U64.pack(count), db=self._meta)

    def _apply(self, deltas: dict[str, list[int]]) -> None:
        """Mirror a committed transaction's counter changes in memory."""
        if not deltas:
            return
        with self._lock:
            for name, (dbytes, dcount) in deltas.items():
                entry = self._by_class.setdefault(name, [0, 0])
                entry[0] += dbytes
                entry[1] += dcount
                self._used += dbytes
                self._count += dcount
                if entry == [0, 0]:
                    del self._by_class[name]

    def _load_meta(self) -> None:
        with self._env.begin(write=True) as txn:
            fmt = txn.get(b"format", db=self._meta)
            if fmt is None:
                if txn.stat(self._shards)["entries"]:
                    raise StorageError(f"{self.path} holds shards but no format marker")
                txn.put(b"format", FORMAT, db=self._meta)
            elif fmt != FORMAT:
                raise StorageError(
                    f"{self.path} was written in store format {fmt!r}; this build reads "
                    f"{FORMAT!r}: use a fresh data directory"
                )
            raw_policy = txn.get(b"policy", db=self._meta)
            self._used = _u64(txn.get(b"used", db=self._meta))
            self._count = _u64(txn.get(b"count", db=self._meta))
            cursor = txn.cursor(db=self._meta)
            if cursor.set_range(b"class:"):
                for key, value in cursor:
                    if not key.startswith(b"class:"):
                        break
                    nbytes, nshards = _CLASS_COUNTS.unpack(value)
                    if nshards:
                        self._by_class[key[6:].decode()] = [nbytes, nshards]
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


class _Freed:
    """Counter changes of one transaction, per class."""

    __slots__ = ("_deltas", "bytes", "count", "keys")

    def __init__(self) -> None:
        self._deltas: dict[str, list[int]] = {}
        self.bytes = 0
        self.count = 0
        self.keys: list[bytes] = []

    def add(self, name: str, dbytes: int, dcount: int) -> None:
        entry = self._deltas.setdefault(name, [0, 0])
        entry[0] += dbytes
        entry[1] += dcount
        if dcount < 0:
            self.bytes -= dbytes
            self.count -= dcount

    def deltas(self) -> dict[str, list[int]]:
        return {k: v for k, v in self._deltas.items() if v != [0, 0]}


def _keys16(items: npt.NDArray[np.void]) -> list[bytes]:
    raw = np.ascontiguousarray(items["key"]).tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def _prefix(cursor: lmdb.Cursor, key: bytes) -> Iterator[tuple[bytes, Any]]:
    """(storage key, value) of every record whose key starts with the 16-byte block key."""
    if not cursor.set_range(key):
        return
    while True:
        skey = bytes(cursor.key())
        if skey[:16] != key:
            return
        yield skey, cursor.value()
        if not cursor.next():
            return


def _index_of(skey: bytes) -> int:
    return int.from_bytes(skey[16:18], "big")


def _u64(raw: bytes | None) -> int:
    return 0 if raw is None else int(_U64.unpack(raw)[0])


def _write_error_kind(exc: BaseException) -> str:
    """``disk_full``, ``disk_io`` or ``storage``.

    LMDB reports a short write (what a filling disk causes) as EIO, so EIO
    counts as a disk problem that refuses the batch, like ENOSPC.
    """
    text = str(exc).lower()
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
        return "disk_full"
    if any(s in text for s in ("no space", "too large", "quota")):
        return "disk_full"
    if (isinstance(exc, OSError) and exc.errno == errno.EIO) or "input/output error" in text:
        return "disk_io"
    return "storage"


def _lock_dir(path: Path) -> int:
    """Hold an exclusive lock on the data directory for this process's life."""
    fd = os.open(path / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StorageError(
            f"data directory {path} is in use by another daemon; give each daemon its own"
        ) from None
    return fd
