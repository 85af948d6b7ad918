"""A subscriber to one storage daemon's event stream, with gap detection, replay and resync.

:class:`Subscriber` connects a SUB socket to the daemon's PUB endpoint and a DEALER to its
replay endpoint, and hands out, in sequence order per topic, every batch exactly once
(:class:`Delivery`). A sequence gap (messages the SUB socket missed: a slow subscriber past
the high-water mark, a restart, a reconnect) is filled from replay before the next batch is
delivered. When the daemon no longer keeps the missing batches it answers "resync", and the
subscriber hands out a :class:`Resync` notice: what it learnt from this stream before is no
longer complete, and the caller rebuilds its view (see ``docs/spec/events.md``, "Resync").

A restarted subscriber passes ``start_seq`` (the sequence after the last one it handled) and
catches up from replay before it reads live batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from kvcache.errors import ConfigError, FormatError
from kvcache.events.format import (
    EventBatch,
    decode_batch,
    pack_seq,
    tenant_of_topic,
    topic_of,
    unpack_seq,
)
from kvcache.events.publisher import ADMIN_USER, events_token

__all__ = ["Delivery", "Resync", "Subscriber"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One batch, in order: ``seq`` follows the previous delivery of ``topic`` by one."""

    topic: bytes
    seq: int
    batch: EventBatch
    #: It came from replay (it was missed live).
    replayed: bool

    @property
    def tenant(self) -> str | None:
        """The tenant the batch belongs to."""
        return tenant_of_topic(self.topic)


@dataclass(frozen=True, slots=True)
class Resync:
    """Batches ``missing_from`` .. ``resume_at - 1`` of ``topic`` are lost for good: the
    caller's view of this stream is incomplete and must be rebuilt."""

    topic: bytes
    missing_from: int
    resume_at: int
    reason: str


class Subscriber:
    """One daemon's stream (see the module docstring).

    ``tenant`` + ``secret`` (the tenant's data-path secret; the PLAIN password is derived
    from it) or ``token`` authenticate; ``admin_token`` reads every tenant (user ``admin``).
    A daemon run with ``events_auth = false`` takes none of them.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        tenant: str | None = None,
        secret: bytes | None = None,
        token: str | None = None,
        admin_token: str | None = None,
        start_seq: int | None = None,
        replay_timeout_s: float = 5.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        user: str | None
        password: str | None
        if admin_token is not None:
            user, password = ADMIN_USER, admin_token
        elif tenant is not None and (secret is not None or token is not None):
            user, password = tenant, token if token is not None else events_token(secret or b"")
        elif secret is not None or token is not None:
            raise ConfigError("events: a secret or token needs the tenant name it belongs to")
        else:
            user = password = None
        self.tenant = tenant
        #: The topic subscribed to: the tenant's, or every kvcache topic for the admin.
        self.topic = topic_of(tenant) if tenant is not None and admin_token is None else b"kvcache/"
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._dealer: zmq.Socket[Any] | None = None
        for sock in [self._sub]:
            _credentials(sock, user, password)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if replay_endpoint is not None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            _credentials(self._dealer, user, password)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(replay_endpoint)
        self.endpoint = endpoint
        self._replay_timeout_s = replay_timeout_s
        #: Next sequence expected, per topic.
        self.next_seq: dict[bytes, int] = {}
        self._start_seq = start_seq
        self._pending: list[Delivery | Resync] = []
        #: The last sequence received live, per topic (a smaller one later: a restart).
        self._last_live: dict[bytes, int] = {}
        self.counters = dict.fromkeys(
            ("delivered", "replayed", "gaps", "resyncs", "replay_timeouts"), 0
        )
        if start_seq is not None and admin_token is None and tenant is not None:
            self._catch_up(self.topic, start_seq, None)

    def close(self) -> None:
        """Close the sockets (and the context this subscriber made)."""
        for sock in (self._sub, self._dealer):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self, timeout_s: float = 1.0) -> list[Delivery | Resync]:
        """What arrived within ``timeout_s`` (at least one item unless it timed out)."""
        if self._pending:
            out, self._pending = self._pending, []
            return out
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(left):
                return []
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._live(frames)
            if self._pending:
                out, self._pending = self._pending, []
                return out
            if time.monotonic() >= deadline:
                return []

    def follow(self, *, idle_s: float = 1.0) -> Iterator[Delivery | Resync]:
        """Every item, forever (until the caller stops iterating)."""
        while True:
            yield from self.poll(idle_s)

    # ------------------------------------------------------------------ internals

    def _live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("events: a message of %d frames from %s (want 3)", len(frames),
                        self.endpoint)  # fmt: skip
            return
        topic, raw_seq, payload = frames
        try:
            seq = unpack_seq(raw_seq)
            batch = decode_batch(payload)
        except FormatError as exc:
            log.warning("events: undecodable message from %s: %s", self.endpoint, exc)
            return
        expected = self.next_seq.get(topic)
        if expected is None:
            start = self._start_seq if self._start_seq is not None else seq
            expected = self.next_seq[topic] = start
        if seq < expected:
            if seq <= self._last_live.get(topic, -1):  # a live stream never goes back:
                self._resync(topic, expected, seq, "the daemon's stream restarted")
                self._deliver(Delivery(topic, seq, batch, replayed=False))
                self._last_live[topic] = seq
            return  # otherwise: replayed already
        if seq > expected:
            self.counters["gaps"] += 1
            self._catch_up(topic, expected, seq)
            if seq < self.next_seq[topic]:
                return
        self._deliver(Delivery(topic, seq, batch, replayed=False))
        self._last_live[topic] = seq

    def _deliver(self, item: Delivery) -> None:
        self.next_seq[item.topic] = item.seq + 1
        self._pending.append(item)
        self.counters["replayed" if item.replayed else "delivered"] += 1

    def _catch_up(self, topic: bytes, start: int, upto: int | None) -> None:
        """Replay ``topic`` from ``start`` (up to ``upto``, exclusive, when a live batch is in
        hand); on "cannot catch up" note a Resync and resume at ``upto``."""
        self.next_seq.setdefault(topic, start)
        if self._dealer is None:
            self._resync(topic, start, upto, "no replay endpoint")
            return
        self._dealer.send_multipart((b"", pack_seq(start), topic))
        deadline = time.monotonic() + self._replay_timeout_s
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0 or not self._dealer.poll(left):
                self.counters["replay_timeouts"] += 1
                self._resync(topic, start, upto, "replay timed out")
                return
            frames = self._dealer.recv_multipart()
            if frames and not frames[0]:
                frames = frames[1:]
            if len(frames) != 3:
                continue
            got_topic, raw_seq, payload = frames
            try:
                seq = unpack_seq(raw_seq)
            except FormatError:
                continue
            if seq == -1:
                if len(got_topic) == 8 and start > unpack_seq(got_topic):
                    # Asked past the daemon's last batch: its stream started again at 0.
                    self._resync(topic, start, upto, "the daemon's stream restarted")
                elif upto is not None and self.next_seq[topic] < upto:
                    self._resync(topic, self.next_seq[topic], upto, "replay ended short")
                return
            if seq == -2:
                self._resync(topic, start, upto, "the daemon no longer keeps these batches")
                return
            if got_topic != topic or seq < self.next_seq[topic]:
                continue
            if upto is not None and seq >= upto:
                continue
            if seq != self.next_seq[topic]:
                self._resync(topic, self.next_seq[topic], seq, "replay skipped batches")
            try:
                batch = decode_batch(payload)
            except FormatError as exc:
                log.warning("events: undecodable replayed batch: %s", exc)
                continue
            self._deliver(Delivery(topic, seq, batch, replayed=True))

    def _resync(self, topic: bytes, start: int, upto: int | None, reason: str) -> None:
        self.counters["resyncs"] += 1
        log.warning("events: %s %r: batches %d..%s lost (%s): resync", self.endpoint, topic,
                    start, "?" if upto is None else upto - 1, reason)  # fmt: skip
        self._pending.append(Resync(topic, start, start if upto is None else upto, reason))
        if upto is None:  # no live batch in hand: the next one sets where the stream resumes
            self.next_seq.pop(topic, None)
            self._start_seq = None
        else:
            self.next_seq[topic] = upto


def _credentials(sock: zmq.Socket[Any], user: str | None, password: str | None) -> None:
    if user is not None and password is not None:
        sock.plain_username = user.encode()
        sock.plain_password = password.encode()
