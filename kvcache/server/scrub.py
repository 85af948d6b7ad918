"""Scrub: re-verify every stored shard in the background and delete the bad ones.

A daemon's :class:`Scrubber` walks the ``shards`` database in storage-key
order (every tenant), a bounded batch per step, and checks each record with
the rules a PUT is checked with (:func:`kvcache.server.records.check_put`:
header rules, header checksum, body checksum, and that the header names the
key and shard index it is stored under). A record that fails is deleted
(:meth:`~kvcache.server.store.ShardStore.discard`, only if it is still the
record that was read), so the next load's read repair or the repairer
(``kvcache repair``) puts a good copy back; until then the stripe is one
shard short, which a load survives.

The loop thread (:mod:`kvcache.server.loop`) calls :meth:`Scrubber.step`
between requests, like the retention work. Reading is rate-limited
(``scrub_rate_bytes`` per second, a token bucket refilled from a monotonic
clock that is passed in), and one step reads at most :data:`MAX_BATCH_BYTES`,
so a step holds the loop for a few milliseconds at most. A pass starts
``scrub_interval_s`` after the previous one started (the first one that long
after the daemon started), or at once on ``POST /scrub``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcache.errors import ProtocolError
from kvcache.server.records import TENANT_LEN, check_put, split_store_key
from kvcache.server.store import ShardStore
from kvcache.wire import Op, Status, make_items

__all__ = ["MAX_BATCH_BYTES", "Scrubber"]

log = logging.getLogger(__name__)

#: Most record bytes one step reads (bounds how long it holds the loop: ~1 ms per MiB).
MAX_BATCH_BYTES = 4 << 20
#: The token bucket holds at most this many seconds of rate (a burst after an idle spell).
_BURST_S = 0.25


class Scrubber:
    """Background re-verification of one store's shards (owned by the store's thread)."""

    def __init__(
        self,
        store: ShardStore,
        *,
        rate_bytes: int,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.rate_bytes = rate_bytes
        self.interval_s = interval_s
        self._clock = clock
        now = clock()
        self._next_pass = now + interval_s
        self._last_refill = now
        self._tokens = 0.0
        self._cursor: bytes | None = None  # None: no pass running
        # Counters (plain ints: the admin thread reads them without a lock).
        self.passes = 0
        self.shards_checked = 0
        self.bytes_checked = 0
        self.shards_bad = 0
        self.shards_deleted = 0
        self.pass_shards = 0
        self.pass_total = 0
        self.last_pass_s = 0.0
        self._pass_started = 0.0

    @property
    def enabled(self) -> bool:
        """Whether scrubbing is on (a rate of 0 turns it off)."""
        return self.rate_bytes > 0

    @property
    def running(self) -> bool:
        """Whether a pass is in progress."""
        return self._cursor is not None

    def start_now(self) -> dict[str, Any]:
        """Start a pass now (unless one is running); returns :meth:`stats`."""
        if self.enabled and self._cursor is None:
            self._begin(self._clock())
        return self.stats()

    def step(self) -> bool:
        """Do one bounded batch if a pass is due and the rate allows; True when more
        work could be done at once (the loop then calls again without idling)."""
        if not self.enabled:
            return False
        now = self._clock()
        if self._cursor is None:
            if now < self._next_pass:
                return False
            self._begin(now)
        self._tokens = min(
            self._tokens + (now - self._last_refill) * self.rate_bytes,
            max(self.rate_bytes * _BURST_S, 1.0),
        )
        self._last_refill = now
        if self._tokens < min(MAX_BATCH_BYTES, self.rate_bytes * _BURST_S) / 4:
            return False
        budget = int(min(self._tokens, MAX_BATCH_BYTES))
        assert self._cursor is not None  # set by _begin
        found = self.store.records_after(self._cursor, max_bytes=max(budget, 1))
        if not found:
            self._finish(now)
            return False
        nbytes = sum(len(record) for _k, record in found)
        self._tokens -= nbytes
        bad = verify_records(found)
        if bad:
            deleted = self.store.discard(bad)
            self.shards_bad += len(bad)
            self.shards_deleted += deleted
            for skey, _record in bad:
                tenant, key, index = split_store_key(skey)
                log.warning(
                    "scrub: shard %d of block %s (tenant %s) failed its checks; deleted",
                    index,
                    key.hex(),
                    tenant.hex(),
                )
        self.shards_checked += len(found)
        self.pass_shards += len(found)
        self.bytes_checked += nbytes
        self._cursor = found[-1][0]
        return self._tokens >= MAX_BATCH_BYTES

    def stats(self) -> dict[str, Any]:
        """Counters and progress, for ``/stats`` and ``/metrics``."""
        total = max(self.pass_total, self.pass_shards)
        return {
            "enabled": self.enabled,
            "rate_bytes": self.rate_bytes,
            "interval_s": self.interval_s,
            "running": self.running,
            "passes": self.passes,
            "shards_checked": self.shards_checked,
            "bytes_checked": self.bytes_checked,
            "shards_bad": self.shards_bad,
            "shards_deleted": self.shards_deleted,
            "pass_shards": self.pass_shards,
            "pass_progress": (self.pass_shards / total if total else 1.0) if self.running else 1.0,
            "last_pass_s": round(self.last_pass_s, 3),
        }

    def _begin(self, now: float) -> None:
        self._cursor = b""
        self.pass_shards = 0
        self.pass_total = int(self.store.usage()["shards"])
        self._pass_started = now
        self._last_refill = now
        self._next_pass = now + self.interval_s
        log.info("scrub pass %d started over %d shards", self.passes + 1, self.pass_total)

    def _finish(self, now: float) -> None:
        self._cursor = None
        self.passes += 1
        self.last_pass_s = now - self._pass_started
        log.info(
            "scrub pass %d done: %d shards checked in %.1f s; %d bad so far",
            self.passes,
            self.pass_shards,
            self.last_pass_s,
            self.shards_bad,
        )


def verify_records(found: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The (storage key, record) pairs of ``found`` that fail the PUT checks."""
    if not found:
        return []
    items = make_items(Op.PUT, len(found), reply=False)
    raw_keys = np.frombuffer(b"".join(k for k, _r in found), np.uint8).reshape(len(found), -1)
    items["key"] = np.ascontiguousarray(raw_keys[:, TENANT_LEN:-2]).view("V16").ravel()
    items["index"] = (raw_keys[:, -2].astype(np.uint16) << 8) | raw_keys[:, -1]
    items["length"] = [len(r) for _k, r in found]
    data = memoryview(b"".join(r for _k, r in found))
    try:
        # The tenant only names the storage keys check_put returns; the verdicts do not
        # depend on it.
        checked = check_put(found[0][0][:TENANT_LEN], items, data)
    except ProtocolError:  # pragma: no cover - lengths are ours, they always add up
        return list(found)
    bad = np.flatnonzero(checked.status != Status.OK).tolist()
    return [found[i] for i in bad]
