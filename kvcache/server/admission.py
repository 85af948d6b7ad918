"""Who may send the daemon what, and for how long: admission decisions, no I/O.

The socket loop (:mod:`kvcache.server.loop`) asks these rules before it reads a
new request, accepts a connection, or keeps a half-received request waiting;
time is passed in, so tests step it. Issue 18 found three ways one peer could
stall a daemon, and each rule answers one:

- **Bytes are counted as they arrive, per tenant.** The in-flight budget
  (``max_inflight_bytes``) used to count a request's *declared* data length the
  moment its header was read, so five half-sent 256 MiB PUTs held the whole
  1 GiB budget with 5 KB received, and every other connection waited. Now a
  request holds only what it has received, each tenant holds at most
  ``tenant_inflight_bytes`` of it, and a tenant that holds nothing may always
  start one request: one tenant's stalls cost the others nothing.
- **Half-received requests have a deadline and a minimum rate.** A request
  still arriving after ``request_timeout_s``, or slower than
  ``min_request_rate`` bytes/s once ``request_grace_s`` passed, is cut off
  (slow loris).
- **Unauthenticated connections have their own bounds.** They no longer share
  ``max_connections`` with authenticated ones: at most ``max_preauth``
  (``max_preauth_per_peer`` per peer address) wait for their handshake, for
  ``handshake_timeout_s`` at most, and when the pool is full the oldest waiting
  one makes room. A peer that holds a thousand idle sockets open only ever
  cycles through its own; a real client's handshake takes milliseconds and gets
  through. Authenticated connections are bounded per tenant too.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Admission", "AdmissionLimits"]

K = TypeVar("K")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionLimits:
    """The bounds (``ServerConfig`` carries them; see docs/server.md)."""

    max_inflight_bytes: int = 1 << 30
    tenant_inflight_bytes: int = 256 << 20
    max_connections: int = 1024
    tenant_connections: int = 512
    max_preauth: int = 1024
    max_preauth_per_peer: int = 512
    handshake_timeout_s: float = 5.0
    request_timeout_s: float = 60.0
    request_grace_s: float = 2.0
    min_request_rate: float = 1 << 20


class Admission(Generic[K]):
    """Counts what each connection (key ``K``) holds and decides what it may do next."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.inflight = 0
        self._tenant_bytes: collections.Counter[object] = collections.Counter()
        self._tenant_conns: collections.Counter[object] = collections.Counter()
        #: Waiting for their handshake, oldest first: key -> (peer, opened).
        self._preauth: collections.OrderedDict[K, tuple[str, float]] = collections.OrderedDict()
        self._peer_preauth: collections.Counter[str] = collections.Counter()

    # ---------------------------------------------------------------- connections

    def preauth_open(self, key: K, peer: str, now: float) -> list[K]:
        """A new connection waits for its handshake; the waiting ones it displaces
        (oldest of its own peer first when that peer is at its bound, else oldest of all)."""
        limits = self.limits
        evict: list[K] = []
        if self._peer_preauth[peer] >= limits.max_preauth_per_peer:
            for other, (other_peer, _opened) in self._preauth.items():
                if other_peer == peer:
                    evict.append(other)
                    break
        elif len(self._preauth) >= limits.max_preauth:
            evict.append(next(iter(self._preauth)))
        for other in evict:
            self.preauth_close(other)
        self._preauth[key] = (peer, now)
        self._peer_preauth[peer] += 1
        return evict

    def preauth_close(self, key: K) -> None:
        """``key`` finished its handshake, or is gone."""
        entry = self._preauth.pop(key, None)
        if entry is not None:
            peer = entry[0]
            self._peer_preauth[peer] -= 1
            if self._peer_preauth[peer] <= 0:
                del self._peer_preauth[peer]

    def handshakes_overdue(self, now: float) -> list[K]:
        """Waiting connections past ``handshake_timeout_s`` (oldest first)."""
        late: list[K] = []
        for key, (_peer, opened) in self._preauth.items():
            if now - opened <= self.limits.handshake_timeout_s:
                break  # the rest are younger
            late.append(key)
        return late

    @property
    def preauth(self) -> int:
        """Connections waiting for their handshake."""
        return len(self._preauth)

    def tenant_may_connect(self, tenant: object, authenticated: int) -> str | None:
        """None if ``tenant`` may hold one more connection, else why not."""
        if authenticated >= self.limits.max_connections:
            return "too_many_connections"
        if self._tenant_conns[tenant] >= self.limits.tenant_connections:
            return "tenant_connection_limit"
        return None

    def tenant_connected(self, tenant: object) -> None:
        """An authenticated connection of ``tenant`` opened."""
        self._tenant_conns[tenant] += 1

    def tenant_disconnected(self, tenant: object) -> None:
        """An authenticated connection of ``tenant`` closed."""
        self._tenant_conns[tenant] -= 1
        if self._tenant_conns[tenant] <= 0:
            del self._tenant_conns[tenant]

    # ---------------------------------------------------------------- bytes

    def may_start(self, tenant: object) -> bool:
        """May a connection of ``tenant`` start receiving a new request?"""
        held = self._tenant_bytes[tenant]
        if held == 0:
            return True  # one request per tenant always moves: nobody starves
        return (
            held < self.limits.tenant_inflight_bytes
            and self.inflight < self.limits.max_inflight_bytes
        )

    def moved(self, tenant: object, delta: int) -> None:
        """``tenant``'s half-received requests now hold ``delta`` bytes more (or fewer)."""
        if not delta:
            return
        self.inflight += delta
        held = self._tenant_bytes[tenant] + delta
        if held > 0:
            self._tenant_bytes[tenant] = held
        else:
            self._tenant_bytes.pop(tenant, None)

    def tenant_bytes(self, tenant: object) -> int:
        """Bytes ``tenant``'s half-received requests hold."""
        return self._tenant_bytes[tenant]

    def request_overdue(self, started: float, received: int, now: float) -> str | None:
        """Why a request that started arriving at ``started`` and has ``received`` bytes
        so far must be cut off now, or None."""
        elapsed = now - started
        limits = self.limits
        if elapsed > limits.request_timeout_s:
            return "request_timeout"
        if elapsed > limits.request_grace_s and received < limits.min_request_rate * elapsed:
            return "slow_request"
        return None
