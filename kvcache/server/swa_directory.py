"""The directory of SWA-state holders that a storage daemon keeps in RAM. No I/O.

An inference worker that keeps a sliding-window state (``kvcache.swa_local``)
registers a small *holder record* (``DIR_PUT``) on the first few rendezvous
holders of the block key the state follows, so a request on any worker finds
it: the same HAS that matches the prompt's blocks returns the records of its
keys (``HAS_DIR``), at no extra round trip. ``docs/spec/swa.md`` is the
normative description.

Records live in RAM only, never in LMDB: they are worth what the state they
point at is worth, a few minutes. Each has the TTL its worker asked for (the
state's remaining life, so holder and directory forget together), is filed
under the tenant that wrote it, and is bounded three times: ``max_per_key``
records per key (the one expiring first makes way), ``max_per_tenant`` per tenant
(that tenant's oldest write makes way) and ``max_records`` in all (the oldest
write of the tenant holding the most makes way). So one tenant's flood of
``DIR_PUT`` evicts only its own records: 278,528 records in 2 s from one tenant
evicted another's record when the one bound was shared (issue 18). A TTL of 0 withdraws a record. A record outlives a
dead or restarted worker by at most its TTL; a fetch from it fails cleanly
(connection refused, or NOT_FOUND for another incarnation), never wrongly.

Time is passed in (``clock``, seconds, monotonic).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.credentials import TenantId
from kvcache.wire import DIR_ANSWER_DTYPE, DIR_RECORD_DTYPE, Status, parse_endpoint

__all__ = ["MAX_TTL_S", "SwaDirectory"]

#: Longest TTL a record may ask for; SWA states live minutes, not hours.
MAX_TTL_S = 3600
_RECORD_BYTES = DIR_RECORD_DTYPE.itemsize


@dataclass(slots=True)
class _Record:
    raw: bytes
    expiry: float


class SwaDirectory:
    """Holder records per (tenant, block key), with TTLs and bounds (see the module docstring)."""

    def __init__(
        self,
        *,
        max_records: int = 1 << 18,
        max_per_key: int = 8,
        max_per_tenant: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (
            max_records < 1
            or max_per_key < 1
            or (max_per_tenant is not None and max_per_tenant < 1)
        ):
            raise ValueError("max_records, max_per_key and max_per_tenant must be >= 1")
        self.max_records = max_records
        self.max_per_key = max_per_key
        #: Records one tenant may hold (default: ``max_records``; the daemon configures
        #: ``swa_directory_per_tenant``, half of it by default).
        self.max_per_tenant = max_per_tenant or max_records
        # Per tenant: its records, oldest write first.
        self._tenants: dict[bytes, collections.OrderedDict[tuple[bytes, bytes], _Record]] = {}
        self._clock = clock
        # (tenant + key, holder) -> record, oldest write first; and the same records by key.
        self._order: collections.OrderedDict[tuple[bytes, bytes], _Record] = (
            collections.OrderedDict()
        )
        self._by_key: dict[bytes, dict[bytes, _Record]] = {}
        # The records by expiry, soonest first: (expiry, seq, slot, holder, record). TTLs
        # differ by record, so write order is not expiry order (a sweep from the oldest
        # write stopped at one long-lived record and kept every shorter one behind it).
        # Entries of records dropped or replaced since stay until popped (or a rebuild).
        self._expiries: list[tuple[float, int, bytes, bytes, _Record]] = []
        self._seq = itertools.count()
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "withdrawn", "rejected", "lookups", "answered", "expired", "evicted"), 0
        )
        #: Told of records registered (cause None) and dropped (cause: expired, withdrawn,
        #: evicted), with the tenant and the record's bytes: the daemon's event stream.
        self.listener: Callable[[bytes, bytes, str | None], None] | None = None

    def __len__(self) -> int:
        return len(self._order)

    # ------------------------------------------------------------------ writes

    def put(self, tenant: TenantId, items: npt.NDArray[np.void]) -> npt.NDArray[np.uint8]:
        """Register (or, with ``ttl_ms`` 0, withdraw) ``items``' records; a status per item."""
        now = self._clock()
        self._sweep(now)
        status = np.full(len(items), Status.OK, np.uint8)
        raw = np.ascontiguousarray(items).view(np.uint8).tobytes()
        for i in range(len(items)):
            record = raw[i * _RECORD_BYTES : (i + 1) * _RECORD_BYTES]
            item = items[i]
            ttl_ms = int(item["ttl_ms"])
            if not _valid(item) or ttl_ms > MAX_TTL_S * 1000:
                status[i] = Status.BAD_ITEM
                self.counters["rejected"] += 1
                continue
            slot = tenant + bytes(item["key"])
            holder = _holder(record)
            if ttl_ms == 0:
                if self._drop(slot, holder, "withdrawn") is None:
                    status[i] = Status.NOT_FOUND
                else:
                    self.counters["withdrawn"] += 1
                continue
            self._drop(slot, holder)
            entry = _Record(record, now + ttl_ms / 1000)
            per_key = self._by_key.setdefault(slot, {})
            if len(per_key) >= self.max_per_key:
                first = min(per_key, key=lambda h: per_key[h].expiry)
                self._drop(slot, first, "evicted")
                self.counters["evicted"] += 1
                per_key = self._by_key.setdefault(slot, {})
            per_key[holder] = entry
            self._order[(slot, holder)] = entry
            heapq.heappush(self._expiries, (entry.expiry, next(self._seq), slot, holder, entry))
            own = self._tenants.setdefault(bytes(tenant), collections.OrderedDict())
            own[(slot, holder)] = entry
            self.counters["puts"] += 1
            if self.listener is not None:
                self.listener(bytes(tenant), record, None)
            if len(own) > self.max_per_tenant:
                self._drop(*next(iter(own)), "evicted")
                self.counters["evicted"] += 1
        while len(self._order) > self.max_records:
            largest = max(self._tenants.values(), key=len)
            self._drop(*next(iter(largest)), "evicted")
            self.counters["evicted"] += 1
        return status

    # ------------------------------------------------------------------ reads

    def lookup(self, tenant: TenantId, keys: npt.NDArray[np.void]) -> npt.NDArray[np.void]:
        """Every live record of each key (``ordinal``: the key's position), remaining TTLs."""
        now = self._clock()
        self._sweep(now)
        self.counters["lookups"] += 1
        if not self._by_key:
            return np.zeros(0, DIR_ANSWER_DTYPE)
        rows: list[tuple[int, bytes, int]] = []
        raw = np.ascontiguousarray(keys).view(np.uint8).tobytes()
        for ordinal in range(len(keys)):
            per_key = self._by_key.get(tenant + raw[ordinal * 16 : (ordinal + 1) * 16])
            if not per_key:
                continue
            for record in per_key.values():
                left_ms = int((record.expiry - now) * 1000)
                if left_ms > 0:
                    rows.append((ordinal, record.raw, left_ms))
        answer = np.zeros(len(rows), DIR_ANSWER_DTYPE)
        if rows:
            answer["ordinal"] = [r[0] for r in rows]
            answer["record"] = np.frombuffer(b"".join(r[1] for r in rows), DIR_RECORD_DTYPE)
            answer["record"]["ttl_ms"] = [r[2] for r in rows]
            self.counters["answered"] += len(rows)
        return answer

    def stats(self) -> dict[str, int]:
        """Counters and the number of records held."""
        return {"records": len(self._order), **self.counters}

    def expire(self) -> None:
        """Drop the records whose TTL passed (lookups and writes do it too, as they go)."""
        self._sweep(self._clock(), limit=max(256, len(self._expiries)))

    def held_by(self, tenant: TenantId) -> int:
        """Records ``tenant`` holds."""
        return len(self._tenants.get(bytes(tenant), ()))

    # ------------------------------------------------------------------ internals

    def _sweep(self, now: float, limit: int = 256) -> None:
        """Drop the records whose expiry passed, soonest first (bounded work per call)."""
        heap = self._expiries
        if len(heap) > 2 * len(self._order) + 4096:  # mostly records gone since
            heap[:] = [e for e in heap if self._order.get((e[2], e[3])) is e[4]]
            heapq.heapify(heap)
        for _ in range(limit):
            if not heap or heap[0][0] > now:
                return
            _expiry, _seq, slot, holder, record = heapq.heappop(heap)
            if self._order.get((slot, holder)) is record:
                self._drop(slot, holder, "expired")
                self.counters["expired"] += 1

    def _drop(self, slot: bytes, holder: bytes, cause: str | None = None) -> _Record | None:
        """Forget one record; ``cause`` (expired, withdrawn, evicted) tells the listener
        (None: a record replaced by a new write of its holder, which tells it itself)."""
        record = self._order.pop((slot, holder), None)
        if record is not None:
            if cause is not None and self.listener is not None:
                self.listener(slot[:-16], record.raw, cause)
            self._unindex(slot, holder)
            tenant = slot[:-16]
            own = self._tenants.get(tenant)
            if own is not None:
                own.pop((slot, holder), None)
                if not own:
                    del self._tenants[tenant]
        return record

    def _unindex(self, slot: bytes, holder: bytes) -> None:
        per_key = self._by_key.get(slot)
        if per_key is not None:
            per_key.pop(holder, None)
            if not per_key:
                del self._by_key[slot]


def _holder(record: bytes) -> bytes:
    """What makes two records of one key the same holder: state namespace, position, endpoint."""
    fields = DIR_RECORD_DTYPE.fields
    assert fields is not None
    pos = fields["position"][1]
    ns = fields["state_ns"][1]
    ep = fields["endpoint"][1]
    return record[ns : ns + 8] + record[pos : pos + 4] + record[ep:]


def _valid(item: np.void) -> bool:
    if int(item["position"]) == 0 or int(item["nbytes"]) == 0:
        return False
    try:
        parse_endpoint(bytes(item["endpoint"]).decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True
