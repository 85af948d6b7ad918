"""A storage daemon's event publisher: vLLM's PUB/ROUTER protocol, one stream per tenant.

The daemon's serving loop calls :meth:`EventPublisher.stored`, :meth:`~EventPublisher.removed`
and :meth:`~EventPublisher.swa_stored` / :meth:`~EventPublisher.swa_removed`; each appends one
small tuple to a bounded queue and returns (no socket, no encoding, no lock). A full queue
drops the entry and counts it: the serving loop never waits for a subscriber.

One thread owns the sockets (vLLM's design): it drains the queue, builds and encodes one
:class:`~kvcache.events.format.EventBatch` per tenant, gives it the tenant's next sequence
number, sends ``[topic, seq, payload]`` on an XPUB socket and keeps it for replay (bounded
in batches and bytes per tenant), and answers replay requests on a ROUTER socket.

Closed by default. With ``auth`` on (the default) both sockets take ZMQ's PLAIN mechanism:
the user name is a tenant name and the password :func:`events_token` of that tenant's secret
(an HMAC of it, so the data-path secret itself never crosses the wire), or ``admin`` and the
admin token. The XPUB socket is in manual mode: every subscription a subscriber sends is
mapped onto its own tenant's topic, so a tenant that subscribes to everything (``b""``) or
to another tenant's topic receives its own events only; replay answers only the
authenticated tenant's stream. PLAIN is not encryption: the password and the events travel
in clear, so the endpoints are bound to loopback by default (``docs/spec/events.md``,
``docs/security.md``).

Entries lost to a full queue cost their tenant one sequence number that has no message:
a subscriber sees the gap, asks for replay and is told to resync.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvcache.errors import ConfigError
from kvcache.events.format import (
    END_SEQ,
    MEDIUM_STORAGE,
    MEDIUM_SWA,
    RESYNC_SEQ,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    pack_seq,
    tenant_of_topic,
    topic_of,
)

__all__ = ["ADMIN_USER", "EventPublisher", "PublisherSettings", "events_token"]

log = logging.getLogger(__name__)

#: The PLAIN user name that sees every tenant's stream (password: the admin token).
ADMIN_USER = "admin"  # kvcache.credentials reserves it: no tenant may be named so
_TOKEN_TAG = b"kvcache:events:v1"
#: The publisher thread sleeps in poll at most this long when nothing is queued (the
#: serving thread wakes it through a pipe when it queues the first entry).
_IDLE_POLL_S = 1.0


def events_token(secret: bytes) -> str:
    """The PLAIN password of a tenant on the events endpoints: hex HMAC-SHA256 of the
    tenant's secret over a fixed tag (the secret itself is never sent)."""
    return hmac.new(secret, _TOKEN_TAG, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class PublisherSettings:
    """What the daemon's config says about its event stream (``events_*`` in ServerConfig)."""

    #: PUB (XPUB) endpoint to bind, e.g. ``tcp://127.0.0.1:7490`` (port 0: any free port).
    listen: str
    #: ROUTER endpoint for replay ("": the PUB port + 1; port 0 when PUB's is 0).
    replay_listen: str = ""
    #: Subscribers authenticate (PLAIN: tenant name + events_token); off: anyone who reaches
    #: the port reads every tenant's events.
    auth: bool = True
    #: Batches kept for replay per tenant, and their bytes at most.
    replay_batches: int = 10_000
    replay_bytes: int = 64 << 20
    #: Entries waiting for the publisher thread; more are dropped and counted.
    queue_entries: int = 1 << 16
    #: Most events in one batch.
    batch_events: int = 1024
    #: ZMQ send high-water mark of the PUB socket (messages per subscriber).
    hwm: int = 100_000
    #: vLLM's ``data_parallel_rank`` field of every batch (None: left out).
    data_parallel_rank: int | None = None
    #: Once woken by a queued entry, the publisher thread waits this long (seconds) before
    #: it drains the queue, so the events of many requests share one wake-up, one batch and
    #: one encoding: what an event costs the serving thread is then a queue append. The
    #: latency it adds is at most this.
    coalesce_s: float = 0.005

    def __post_init__(self) -> None:
        if not 0 <= self.coalesce_s <= 1:
            raise ConfigError(f"events: coalesce_s must be 0..1 s, got {self.coalesce_s}")
        for name in ("replay_batches", "replay_bytes", "queue_entries", "batch_events", "hwm"):
            if getattr(self, name) < 1:
                raise ConfigError(f"events: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("listen", "replay_listen"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"events: {name} must be a zmq endpoint (tcp://host:port), "
                                  f"got {value!r}")  # fmt: skip


@dataclass
class _Stream:
    """One tenant's sequence and replay buffer (publisher thread only)."""

    topic: bytes
    next_seq: int = 0
    #: (seq, payload); payload None: a batch lost to a full queue (replay must resync).
    kept: collections.deque[tuple[int, bytes | None]] = field(default_factory=collections.deque)
    kept_bytes: int = 0


#: Queue entry kinds.
_STORED, _REMOVED, _SWA_STORED, _SWA_REMOVED = range(4)


class EventPublisher:
    """See the module docstring. ``tenants``: tenant id → (name, secret)."""

    def __init__(
        self,
        settings: PublisherSettings,
        *,
        tenants: Mapping[bytes, tuple[str, bytes]],
        admin_token: str | None = None,
        clock: Callable[[], float] = time.time,
        tick: Callable[[], None] | None = None,
        tick_s: float = 1.0,
    ) -> None:
        self.settings = settings
        self._names = {bytes(t): name for t, (name, _secret) in tenants.items()}
        self._clock = clock
        self._tick = tick
        self._tick_s = tick_s
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._max_queue = settings.queue_entries
        #: Entries lost per tenant id (written by the serving thread only).
        self._lost: dict[bytes, int] = {}
        self._lost_seen: dict[bytes, int] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            ("queued", "dropped", "batches", "events", "replays", "replayed_batches",
             "resyncs", "subscriptions", "refused_subscriptions", "bad_requests"), 0
        )  # fmt: skip
        self._streams: dict[str, _Stream] = {}
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        binding = f"events_listen {settings.listen}"
        try:
            if settings.auth:
                self._auth = ThreadAuthenticator(
                    self._ctx, log=logging.getLogger(__name__ + ".zap")
                )
                self._auth.start()
                passwords = {name: events_token(secret) for name, secret in tenants.values()}
                if admin_token:
                    passwords[ADMIN_USER] = admin_token
                self._auth.configure_plain(domain="*", passwords=passwords)
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
            self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            # One full replay per subscriber at most; past it ROUTER drops (the subscriber then
            # misses the end marker, times out and resyncs) rather than queue without bound.
            self._router.setsockopt(zmq.SNDHWM, settings.replay_batches + 2)
            for sock in (self._pub, self._router):
                sock.plain_server = settings.auth
            self.endpoint = _bind(self._pub, settings.listen)
            replay = _replay_endpoint(settings, self.endpoint)
            binding = f"the replay endpoint {replay}" + (
                " (events_replay_listen)"
                if settings.replay_listen
                else " (events_listen's port + 1; set events_replay_listen to choose it)"
            )
            self.replay_endpoint = _bind(self._router, replay)
        except (zmq.ZMQError, OSError) as exc:
            self._close_sockets()
            raise ConfigError(f"events: cannot bind {binding}: {exc}") from None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sleeping = False
        self._thread = threading.Thread(target=self._run, name="kvcache-events", daemon=True)
        self._thread.start()
        log.info("events: publishing on %s, replay on %s (%s)", self.endpoint,
                 self.replay_endpoint, "PLAIN auth" if settings.auth else "NO auth")  # fmt: skip

    # ------------------------------------------------------------------ serving thread

    def _put(self, tenant: bytes, entry: tuple[Any, ...]) -> None:
        if len(self._queue) >= self._max_queue:
            self._lost[tenant] = self._lost.get(tenant, 0) + 1
            self.counters["dropped"] += 1
            return
        self._queue.append(entry)
        self.counters["queued"] += 1
        if self._sleeping:  # one byte wakes the publisher thread; none while it is awake
            self._sleeping = False
            with contextlib.suppress(OSError):  # full pipe: awake already; closed: stopping
                os.write(self._wake_w, b"\0")

    def stored(self, tenant: bytes, items: np.ndarray[Any, Any]) -> None:
        """PUT items (records with ``key`` and ``index``) stored for ``tenant``."""
        self._put(tenant, (_STORED, tenant, items["key"].tobytes(), items["index"].tolist()))

    def removed(
        self, tenant: bytes, traffic_class: str, cause: str, skeys: Sequence[bytes]
    ) -> None:
        """Shards removed (storage keys: tenant id, block key, big-endian shard index)."""
        if skeys:
            self._put(tenant, (_REMOVED, tenant, traffic_class, cause, list(skeys)))

    def swa_stored(self, tenant: bytes, record: bytes) -> None:
        """An SWA holder record (``DIR_RECORD_DTYPE`` bytes) registered."""
        self._put(tenant, (_SWA_STORED, tenant, record))

    def swa_removed(self, tenant: bytes, record: bytes, cause: str) -> None:
        """An SWA holder record dropped (expired, withdrawn, evicted)."""
        self._put(tenant, (_SWA_REMOVED, tenant, record, cause))

    # ------------------------------------------------------------------ any thread

    def stats(self) -> dict[str, Any]:
        """Counters, endpoints and the queue depth."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "auth": self.settings.auth,
            "queue": len(self._queue),
            **self.counters,
        }

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued, stop the thread, close the sockets (idempotent)."""
        if not self._stop.is_set():
            self._stop.set()
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")
            self._thread.join(timeout_s)
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._close_sockets()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything queued so far was published (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue or self._busy:
            if time.monotonic() > deadline:
                raise TimeoutError(f"events: {len(self._queue)} entries still queued")
            time.sleep(0.001)

    _busy = False

    def _close_sockets(self) -> None:
        for name in ("_pub", "_router"):
            sock = getattr(self, name, None)
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self._ctx.closed:
            self._ctx.term()

    # ------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic() + self._tick_s
        last_drain = 0.0
        while True:
            stopping = self._stop.is_set()
            timeout = 0
            if not (self._queue or stopping):
                self._sleeping = True
                if self._queue:  # queued between the check and the flag: no sleep
                    self._sleeping = False
                else:
                    left = next_tick - time.monotonic() if self._tick is not None else _IDLE_POLL_S
                    timeout = max(0, int(min(_IDLE_POLL_S, left) * 1000))
            try:
                for sock, _ in poller.poll(timeout):
                    if sock is self._pub:
                        self._subscription()
                    elif sock is self._router:
                        self._replay()
                    else:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                self._sleeping = False
                if self._queue and not self._stop.is_set():
                    # At most one drain per coalesce_s: more requests' events, one batch.
                    wait = last_drain + self.settings.coalesce_s - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    last_drain = time.monotonic()
                self._busy = True
                self._publish_queued()
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                log.exception("events: publisher error")
            except Exception:  # a bug must cost events, never the daemon
                log.exception("events: publisher error")
            finally:
                self._busy = False
            if stopping and not self._queue:
                return
            if self._tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick_s
                try:
                    self._tick()
                except Exception:
                    log.exception("events: tick failed")

    def _stream(self, tenant: bytes) -> _Stream | None:
        name = self._names.get(tenant)
        if name is None:
            return None
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = _Stream(topic_of(name))
        return stream

    def _publish_queued(self) -> None:
        """Drain the queue into one batch (or a few) per tenant; send and keep them."""
        pending: dict[bytes, list[BlockStored | BlockRemoved]] = {}
        queue = self._queue
        for _ in range(len(queue)):
            entry = queue.popleft()
            pending.setdefault(entry[1], []).append(_event(entry))
        for tenant, lost in list(self._lost.items()):
            if lost != self._lost_seen.get(tenant, 0):
                self._lost_seen[tenant] = lost
                stream = self._stream(tenant)
                if stream is not None:  # one sequence number with no message: a gap
                    self._keep(stream, stream.next_seq, None)
                    stream.next_seq += 1
        if not pending:
            return
        ts = self._clock()
        step = self.settings.batch_events
        for tenant, events in pending.items():
            stream = self._stream(tenant)
            if stream is None:
                continue
            for start in range(0, len(events), step):
                batch = EventBatch(ts=ts, events=list(events[start : start + step]),
                                   data_parallel_rank=self.settings.data_parallel_rank)  # fmt: skip
                payload = encode_batch(batch)
                seq = stream.next_seq
                stream.next_seq += 1
                self._pub.send_multipart((stream.topic, pack_seq(seq), payload), copy=False)
                self._keep(stream, seq, payload)
                self.counters["batches"] += 1
                self.counters["events"] += len(batch.events)

    def _keep(self, stream: _Stream, seq: int, payload: bytes | None) -> None:
        stream.kept.append((seq, payload))
        stream.kept_bytes += len(payload or b"")
        limit_n, limit_b = self.settings.replay_batches, self.settings.replay_bytes
        while len(stream.kept) > limit_n or (stream.kept_bytes > limit_b and len(stream.kept) > 1):
            _, old = stream.kept.popleft()
            stream.kept_bytes -= len(old or b"")

    def _user(self, frame: zmq.Frame) -> str | None:
        if not self.settings.auth:
            return None
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            return None
        return user if isinstance(user, str) else None

    def _subscription(self) -> None:
        """A (un)subscription from a subscriber: applied, mapped onto its tenant's topic."""
        frame = self._pub.recv(copy=False)
        data = bytes(frame.buffer)
        if not data or data[0] not in (0, 1):
            return
        wanted = data[1:]
        user = self._user(frame)
        applied = wanted
        if self.settings.auth and user != ADMIN_USER:
            if user is None:
                self.counters["refused_subscriptions"] += 1
                return
            own = topic_of(user)
            if own.startswith(wanted):
                applied = own  # "everything", or a prefix of its topic: its own topic
            elif not wanted.startswith(own):
                self.counters["refused_subscriptions"] += 1
                log.debug("events: %s may not subscribe to %r", user, wanted)
                return
        self._pub.setsockopt(zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE, applied)
        if data[0] == 1:
            self.counters["subscriptions"] += 1

    def _replay(self) -> None:
        """``[id, b"", seq]`` (vLLM's request: the authenticated tenant's stream) or
        ``[id, b"", seq, topic]``: kept batches from ``seq`` on, then the end marker, or
        the resync marker alone when ``seq`` is older than what is kept."""
        frames = self._router.recv_multipart(copy=False)
        ident = frames[0].bytes
        rest = [f.bytes for f in frames[1:]]
        if rest and not rest[0]:
            rest = rest[1:]
        user = self._user(frames[-1])
        self.counters["replays"] += 1
        if not 1 <= len(rest) <= 2 or len(rest[0]) != 8:
            self.counters["bad_requests"] += 1
            self._router.send_multipart((ident, b"", b"", END_SEQ, b""))
            return
        start = max(0, int.from_bytes(rest[0], "big", signed=True))
        name: str | None
        if len(rest) == 2:
            name = tenant_of_topic(rest[1])
            if self.settings.auth and user != ADMIN_USER and name != user:
                name = None
        else:
            name = user if user != ADMIN_USER else None
        stream = self._streams.get(name) if name is not None else None
        if stream is None:
            if name is None:
                self.counters["bad_requests"] += 1
            self._router.send_multipart((ident, b"", b"", END_SEQ, b""))
            return
        first = stream.kept[0][0] if stream.kept else stream.next_seq
        lost = any(p is None and s >= start for s, p in stream.kept)
        if (start < first and start < stream.next_seq) or lost:
            self.counters["resyncs"] += 1
            self._router.send_multipart((ident, b"", stream.topic, RESYNC_SEQ, b""))
            return
        for seq, payload in stream.kept:
            if seq >= start and payload is not None:
                self._router.send_multipart((ident, b"", stream.topic, pack_seq(seq), payload),
                                            copy=False)  # fmt: skip
                self.counters["replayed_batches"] += 1
        # The end marker's first frame (empty in vLLM's, ignored by its subscribers) carries
        # the stream's next sequence number: a subscriber asking past it learns that this
        # stream restarted (a daemon restart starts every topic at 0 again).
        self._router.send_multipart((ident, b"", pack_seq(stream.next_seq), END_SEQ, b""))


def _event(entry: tuple[Any, ...]) -> BlockStored | BlockRemoved:
    """The vLLM event of one queue entry (publisher thread)."""
    kind = entry[0]
    if kind == _STORED:
        raw: bytes = entry[2]
        return BlockStored(
            block_hashes=[raw[i : i + 16] for i in range(0, len(raw), 16)],
            parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
            medium=MEDIUM_STORAGE, lora_name=None, kvcache_shards=entry[3],
        )  # fmt: skip
    if kind == _REMOVED:
        skeys: list[bytes] = entry[4]
        return BlockRemoved(
            block_hashes=[k[8:24] for k in skeys], medium=MEDIUM_STORAGE,
            kvcache_cause=entry[3], kvcache_class=entry[2],
            kvcache_shards=[int.from_bytes(k[24:26], "big") for k in skeys],
        )  # fmt: skip
    record = np.frombuffer(entry[2], _dir_dtype())[0]
    key, holder = bytes(record["key"]), bytes(record["endpoint"]).decode("ascii", "replace")
    if kind == _SWA_STORED:
        return BlockStored(
            block_hashes=[key], parent_block_hash=None, token_ids=[], block_size=0,
            lora_id=None, medium=MEDIUM_SWA, lora_name=None, kvcache_holders=[holder],
            kvcache_ttl_ms=[int(record["ttl_ms"])], kvcache_positions=[int(record["position"])],
        )  # fmt: skip
    return BlockRemoved(block_hashes=[key], medium=MEDIUM_SWA, kvcache_cause=entry[3],
                        kvcache_holders=[holder])  # fmt: skip


def _dir_dtype() -> np.dtype[Any]:
    from kvcache.wire import DIR_RECORD_DTYPE

    return DIR_RECORD_DTYPE


def _replay_endpoint(settings: PublisherSettings, bound: str) -> str:
    if settings.replay_listen:
        return settings.replay_listen
    base, _, port = bound.rpartition(":")
    if not bound.startswith("tcp://") or not port.isdigit():
        raise ConfigError(f"events: set events_replay_listen (cannot derive it from {bound!r})")
    return f"{base}:{int(port) + 1}" if not settings.listen.endswith(":0") else f"{base}:0"


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind; returns the bound endpoint (the port resolved when 0 was asked)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = sock.bind_to_random_port(endpoint[:-2])
        return f"{endpoint[:-2]}:{port}"
    sock.bind(endpoint)
    return endpoint
