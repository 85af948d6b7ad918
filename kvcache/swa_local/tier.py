"""One worker's SWA tier: the store, the endpoint peers fetch from, the directory, fetches.

:class:`SwaTier` is what an engine adapter holds::

    tier = SwaTier(SwaConfig.load(...), client)      # client: this worker's kvcache Client
    tier.start()                                     # serve peers; returns the endpoint
    tier.put(key, state_bytes)                       # hold it, register it (in the background)
    match, holders = tier.lookup(namespace, tokens)  # blocks and holders, one round trip
    state = tier.fetch(key, holders[block])          # local first, then the holders, verified

A state is held for ``ttl_s`` from when it was taken (``kvcache.swa_local.store``)
and registered with the same remaining life, so the directory forgets it
when the holder does. Registration runs on a background thread: a put never
waits for the network, and a record that could not be registered costs a
future miss, nothing else. ``close`` withdraws this worker's records, so a
clean restart leaves none behind.
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcache.client import Client, MatchResult
from kvcache.credentials import TenantCredentials
from kvcache.errors import ArgumentError, ClosedError
from kvcache.keys import BlockKey, Namespace
from kvcache.swa_local.config import SwaConfig
from kvcache.swa_local.directory import Directory, Holders
from kvcache.swa_local.fetch import PeerTransport, TcpPeerTransport, Wanted, writable_bytes
from kvcache.swa_local.protocol import HolderRecord
from kvcache.swa_local.server import PeerServer
from kvcache.swa_local.state import StateKey
from kvcache.swa_local.store import StoredState, SwaStore

__all__ = ["SwaTier"]

log = logging.getLogger(__name__)

_STOP = None


class SwaTier:
    """A worker's SWA tier (see the module docstring)."""

    def __init__(
        self,
        config: SwaConfig,
        client: Client,
        *,
        transport: PeerTransport | None = None,
        incarnation: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.client = client
        self.incarnation = incarnation if incarnation is not None else secrets.randbits(63) + 1
        self.store = SwaStore(max_bytes=config.max_bytes, ttl_s=config.ttl_s, clock=clock)
        cc = client.config
        secret = cc.secret_bytes()
        self._tenant = TenantCredentials(name=cc.tenant, secret=secret)
        self.transport: PeerTransport = transport or TcpPeerTransport(
            tenant=cc.tenant, secret=secret, connections_per_peer=config.connections_per_peer
        )
        self.directory = Directory(client, replicas=config.directory_replicas)
        self.server = PeerServer(
            self.store,
            tenant=self._tenant,
            incarnation=self.incarnation,
            listen=config.listen,
            max_connections=config.max_connections,
        )
        self._clock = clock
        self.endpoint = ""
        self._published: queue.SimpleQueue[HolderRecord | None] = queue.SimpleQueue()
        self._publisher: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0
        self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(
            ("local_hits", "remote_hits", "misses", "puts", "unpublished_too_large"), 0
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Serve peers and start registering records; returns the endpoint peers use.

        Starting a started tier returns its endpoint; a closed tier cannot start again
        (ClosedError: make a new one)."""
        if self._closed:
            raise ClosedError("this SWA tier is closed; make a new SwaTier to serve again")
        if self._publisher is not None:
            return self.endpoint
        bound = self.server.start()
        self.endpoint = self.config.advertise or bound
        self._publisher = threading.Thread(
            target=self._publish_loop, name="kvcache-swa-publish", daemon=True
        )
        self._publisher.start()
        log.info(
            "SWA tier serving at %s (incarnation %x, %d MiB, TTL %.0f s)",
            self.endpoint,
            self.incarnation,
            self.config.max_bytes >> 20,
            self.config.ttl_s,
        )
        return self.endpoint

    def close(self, *, withdraw: bool | None = None, timeout_s: float = 5.0) -> None:
        """Stop serving; with ``withdraw`` (default: the config's ``withdraw_on_close``),
        first remove this worker's records from the directory (bounded by ``timeout_s``)."""
        timeout_s = _seconds(timeout_s, "timeout_s")
        if withdraw is None:
            withdraw = self.config.withdraw_on_close
        self._closed = True
        if self._publisher is not None:
            self._published.put(_STOP)
            self._publisher.join(timeout_s)
            self._publisher = None
            if withdraw:
                self._withdraw(timeout_s)
        self.server.close()
        self.transport.close()

    def __enter__(self) -> SwaTier:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ states

    def put(
        self, key: StateKey, data: bytes | bytearray | memoryview, *, publish: bool = True
    ) -> StoredState | None:
        """Hold ``data`` as state ``key`` and register it (in the background)."""
        state = self.store.put(key, data)
        if state is None:
            return None
        self._count("puts")
        if state.nbytes > self.server.limits.max_data_bytes:
            # Held for this worker's own use; no peer could fetch it (the reply would pass
            # the wire's data limit), so it is not advertised.
            self._count("unpublished_too_large")
            if self.counters["unpublished_too_large"] == 1:  # once: the counter says the rest
                log.warning(
                    "SWA state of %d bytes is over the peers' reply limit (%d): held here, "
                    "not published (counter unpublished_too_large)",
                    state.nbytes,
                    self.server.limits.max_data_bytes,
                )
            return state
        if publish and self.endpoint:
            with self._idle:
                self._pending += 1
            self._published.put(self._record(key, state, state.expiry - self._clock()))
        return state

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record put so far was sent to the directory; whether it was."""
        deadline = time.monotonic() + _seconds(timeout_s, "timeout_s")
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def lookup(self, namespace: Namespace, tokens: Sequence[int]) -> tuple[MatchResult, Holders]:
        """The stored prefix of ``tokens`` and the holders of states after each of its blocks."""
        return self.directory.lookup(namespace, tokens)

    def lookup_keys(
        self, keys: list[BlockKey], *, tokens_per_block: int
    ) -> tuple[MatchResult, Holders]:
        """:meth:`lookup` for block keys computed by the caller."""
        return self.directory.lookup_keys(keys, tokens_per_block=tokens_per_block)

    def fetch(
        self,
        key: StateKey,
        holders: Sequence[HolderRecord] = (),
        *,
        timeout_s: float | None = None,
        out: memoryview | None = None,
    ) -> bytes | memoryview | None:
        """State ``key``: from this worker's store, else from the first holder that has it,
        verified against its record's digest; None when nobody could serve it in time.

        With ``out`` (a writable buffer of the state's size), the state is written there
        (a holder's reply is received into it) and ``out`` comes back; a state of another
        size is a miss, and after a miss ``out`` holds undefined bytes.
        """
        if not isinstance(key, StateKey):
            raise ArgumentError(f"key must be a StateKey, got {type(key).__name__}")
        if isinstance(holders, str | bytes):
            raise ArgumentError("holders must be HolderRecords (from lookup), not a string")
        holders = tuple(holders)
        if not all(isinstance(record, HolderRecord) for record in holders):
            raise ArgumentError("holders must be HolderRecords (from lookup)")
        if timeout_s is not None:
            timeout_s = _seconds(timeout_s, "timeout_s")
        if out is not None:
            try:
                out = writable_bytes(out)
            except TypeError:
                raise ArgumentError(
                    f"out must be a writable contiguous buffer, got {type(out).__name__}"
                ) from None
        local = self.store.get(key)
        if local is not None:
            self._count("local_hits")
            if out is None:
                return local.data
            view = out
            if view.nbytes != local.nbytes:
                self._count("misses")
                return None
            view[:] = local.data
            return view
        deadline = self._clock() + (
            timeout_s if timeout_s is not None else self.config.fetch_timeout_s
        )
        for record in holders:
            if record.key != key or (
                record.endpoint == self.endpoint and record.incarnation == self.incarnation
            ):
                continue
            if self._clock() >= deadline:
                break
            want = Wanted(key, record.incarnation, record.digest)
            if out is None:
                (got,) = self.transport.fetch(record.endpoint, [want], deadline=deadline)
            else:
                (got,) = self.transport.fetch(
                    record.endpoint, [want], deadline=deadline, out=[memoryview(out)]
                )
            if got is not None:
                self._count("remote_hits")
                return got
        self._count("misses")
        return None

    def _count(self, name: str) -> None:
        with self._idle:  # the engine's loader and saver threads count concurrently
            self.counters[name] += 1

    def stats(self) -> dict[str, Any]:
        """Counters of the tier, its store, its server, its transport and its directory."""
        return {
            "endpoint": self.endpoint,
            "incarnation": self.incarnation,
            **{f"tier_{k}": v for k, v in self.counters.items()},
            "store": self.store.stats(),
            "server": dict(self.server.counters),
            "fetch": dict(getattr(self.transport, "counters", {})),
            "directory": dict(self.directory.counters),
        }

    # ------------------------------------------------------------------ the directory

    def _record(self, key: StateKey, state: StoredState, ttl_s: float) -> HolderRecord:
        return HolderRecord(
            key=key,
            endpoint=self.endpoint,
            incarnation=self.incarnation,
            nbytes=state.nbytes,
            digest=state.digest,
            ttl_s=max(0.0, ttl_s),
        )

    def _publish_loop(self) -> None:
        while True:
            first = self._published.get()
            batch = [] if first is None else [first]
            stop = first is None
            while not stop:
                try:
                    more = self._published.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    batch.append(more)
            if batch:
                try:
                    self.directory.publish(batch)
                except Exception:  # a lost record is a future miss, never a crashed engine
                    log.warning("registering %d SWA records failed", len(batch), exc_info=True)
                with self._idle:
                    self._pending -= len(batch)
                    self._idle.notify_all()
            if stop:
                return

    def _withdraw(self, timeout_s: float) -> None:
        records = [self._record(key, state, 0.0) for key, state in self.store.live()]
        if records:
            try:
                self.directory.publish(records, timeout_s=timeout_s)
            except Exception:
                log.warning("withdrawing %d SWA records failed", len(records), exc_info=True)


def _seconds(value: object, what: str) -> float:
    """A finite, non-negative number of seconds, else an ArgumentError naming ``what``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ArgumentError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)
