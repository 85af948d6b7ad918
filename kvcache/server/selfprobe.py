"""Does the data path answer? A daemon's own request through its own data port.

``/healthz`` used to say 200 whenever the HTTP thread was alive, including while one
tenant's half-sent PUTs held the loop and no other request was answered (issue 18). A
:class:`SelfProbe` opens a real connection to the daemon's data endpoint, runs the
session handshake as a real tenant, sends a HAS for one key nobody stores, and waits
for the answer under a deadline: the accept path, the handshake, the loop, the request
decoder and an LMDB read transaction all have to work for it to pass. A stalled loop,
a full connection table, an exhausted in-flight budget or a store that errors each
show as a failure, with the reason.

The verdict is cached for ``cache_s`` (1 s by default), and one probe runs at a time:
a load balancer polling ``/healthz`` many times a second costs the daemon one HAS a
second. The probe's clock is passed in, so tests step it.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvcache.errors import KVCacheError
from kvcache.server.probe import Probe
from kvcache.wire import Op, Status, make_items, parse_endpoint

__all__ = ["ProbeVerdict", "SelfProbe", "probe_endpoint"]

log = logging.getLogger(__name__)

#: A key no writer produces (block keys are xxh3-128 digests): the HAS finds nothing.
_PROBE_KEY = b"kvcache:selfprobe"[:16]


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """One probe's outcome: whether the data path answered, how fast, and if not, why."""

    ok: bool
    latency_s: float
    reason: str
    at: float


def probe_endpoint(bound: str) -> str:
    """Where to reach a daemon bound to ``bound`` from the same host (a wildcard address
    becomes loopback)."""
    host, port = parse_endpoint(bound)
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:{port}"


class SelfProbe:
    """Cached HAS probes of one daemon's data path (see the module docstring)."""

    def __init__(
        self,
        endpoint: Callable[[], str],
        *,
        tenant: str,
        secret: bytes,
        tls: bool = False,
        timeout_s: float = 1.0,
        cache_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._endpoint = endpoint
        self._tenant, self._secret = tenant, secret
        self._tls: ssl.SSLContext | None = None
        if tls:
            # Its own certificate on its own port: the probe checks the path, not the name.
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            self._tls.check_hostname = False
            self._tls.verify_mode = ssl.CERT_NONE
        self.timeout_s, self.cache_s = timeout_s, cache_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: ProbeVerdict | None = None
        #: Probes run and probes failed, for /metrics.
        self.runs = 0
        self.failures = 0

    def verdict(self) -> ProbeVerdict:
        """The last verdict if younger than ``cache_s``, else a new probe's (blocking, at
        most ``timeout_s``; concurrent callers wait for the one probe in flight)."""
        with self._lock:
            last = self._last
            if last is not None and self._clock() - last.at < self.cache_s:
                return last
            self._last = self._run()
            return self._last

    def _run(self) -> ProbeVerdict:
        started = self._clock()
        self.runs += 1
        try:
            with Probe(
                probe_endpoint(self._endpoint()),
                tenant=self._tenant,
                secret=self._secret,
                timeout_s=self.timeout_s,
                tls=self._tls,
            ) as probe:
                items = make_items(Op.HAS, 1, reply=False)
                items["key"] = np.frombuffer(_PROBE_KEY.ljust(16, b"\0"), "V16")
                reply = probe.request(Op.HAS, items)
            if reply.header.status != Status.OK:
                reason = f"HAS answered {Status(reply.header.status).name}: {reply.error_text()}"
                return self._fail(started, reason)
        except (KVCacheError, OSError) as exc:
            return self._fail(started, f"{type(exc).__name__}: {exc}")
        return ProbeVerdict(True, self._clock() - started, "", started)

    def _fail(self, started: float, reason: str) -> ProbeVerdict:
        self.failures += 1
        log.warning("self-probe of the data path failed: %s", reason)
        return ProbeVerdict(False, self._clock() - started, reason, started)
