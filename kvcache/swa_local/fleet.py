"""A fleet of workers' SWA tiers replaying a trace: what ``kvcache demo --swa-workers`` runs.

``kvcache swa simulate`` predicts, on a trace, how often a continuation finds the
sliding-window state at the end of its store hit (``exact_hit_rate``) and how many
tokens bounded replay recomputes when it does not (``replayed_tokens``). This
module measures the same two figures for real: ``workers`` :class:`SwaTier`
instances (each its own RAM store, its own peer endpoint, its own incarnation) on
one cluster, every state registered in the daemons' directory, looked up with
``HAS_DIR``, fetched over TCP from the worker that holds it and checked byte for byte.

Two choices make the measurement comparable with the simulator's:

- **Trace time.** The tiers run on a clock that follows the trace's timestamps
  (plus the real time spent inside a request), so a state lives ``ttl_s`` of *trace*
  time, as in the simulator, however fast the replay runs. The daemons keep records
  on their own clock, longer than that: a holder whose state expired answers
  NOT_FOUND, which is a miss, as in a real fleet whose directory lags.
- **The same routing.** Requests go to ``random.Random(seed).randrange(workers)``,
  one draw per request in arrival order: the simulator's random routing, draw for draw.

A request takes its state at the end of its full blocks, as the vLLM connector does
for DeepSeek V4.1; the bytes are synthesised from the state key, so a fetched state
that is not the one put is counted in ``wrong_bytes``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcache.client import Client, MatchResult
from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey, Namespace
from kvcache.swa_local.config import SwaConfig
from kvcache.swa_local.fetch import TcpPeerTransport
from kvcache.swa_local.state import StateKey, state_namespace_id
from kvcache.swa_local.tier import SwaTier
from kvcache.workload import payload_for_key

__all__ = ["FleetFigures", "SwaFleet", "TraceClock"]

log = logging.getLogger(__name__)


class TraceClock:
    """Trace time: the current request's timestamp plus the real time since it began.

    Never goes back (a request that arrives in the trace before the previous one's real
    work ended starts where that one stopped)."""

    def __init__(self) -> None:
        self._base = 0.0
        self._real = time.monotonic()
        self._last = 0.0

    def advance(self, trace_s: float) -> None:
        """A request arrives at ``trace_s`` seconds of trace time."""
        self._base = max(trace_s, self())
        self._real = time.monotonic()

    def __call__(self) -> float:
        now = self._base + (time.monotonic() - self._real)
        self._last = max(self._last, now)
        return self._last


@dataclass(slots=True)
class FleetFigures:
    """What a fleet replay measured (the simulator's names)."""

    workers: int
    ttl_s: float
    state_bytes: int
    replay_tokens: int
    continuations: int = 0
    exact_hits: int = 0
    replayed_tokens: int = 0
    local_fetches: int = 0
    remote_fetches: int = 0
    states_put: int = 0
    wrong_bytes: int = 0

    @property
    def exact_hit_rate(self) -> float:
        """Continuations whose state at the end of their store hit was fetched."""
        return self.exact_hits / max(1, self.continuations)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the derived rate."""
        return {
            "exact_hit_rate": self.exact_hit_rate,
            "replayed_tokens": self.replayed_tokens,
            "workers": self.workers,
            "ttl_s": self.ttl_s,
            "state_bytes": self.state_bytes,
            "replay_tokens": self.replay_tokens,
            "continuations": self.continuations,
            "exact_hits": self.exact_hits,
            "local_fetches": self.local_fetches,
            "remote_fetches": self.remote_fetches,
            "states_put": self.states_put,
            "wrong_bytes": self.wrong_bytes,
        }


class SwaFleet:
    """``workers`` SWA tiers sharing one kvcache client, on a trace clock (module docstring)."""

    def __init__(
        self,
        client: Client,
        namespace: Namespace,
        *,
        workers: int,
        ttl_s: float,
        state_bytes: int,
        seed: int = 0,
        replay_tokens: int = 128,
        max_bytes: int = 2 << 30,
    ) -> None:
        if workers < 1 or not ttl_s > 0 or state_bytes < 1 or replay_tokens < 0:
            raise ArgumentError(
                "need workers >= 1, ttl_s > 0, state_bytes >= 1, replay_tokens >= 0; got "
                f"{workers}, {ttl_s}, {state_bytes}, {replay_tokens}"
            )
        self.namespace = namespace
        self.clock = TraceClock()
        self._rng = random.Random(seed)
        self._state_ns = state_namespace_id(namespace)
        self._tpb = namespace.tokens_per_block
        config = SwaConfig(max_bytes=max_bytes, ttl_s=ttl_s)
        cc = client.config
        self.tiers = [
            SwaTier(
                config,
                client,
                transport=TcpPeerTransport(
                    tenant=cc.tenant, secret=cc.secret_bytes(), clock=self.clock
                ),
                clock=self.clock,
            )
            for _ in range(workers)
        ]
        self.figures = FleetFigures(
            workers=workers, ttl_s=ttl_s, state_bytes=state_bytes, replay_tokens=replay_tokens
        )

    def __enter__(self) -> SwaFleet:
        for tier in self.tiers:
            tier.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for tier in self.tiers:
            tier.close()

    def route(self, trace_s: float) -> int:
        """The worker a request arriving at ``trace_s`` goes to (the simulator's draw)."""
        self.clock.advance(trace_s)
        return self._rng.randrange(len(self.tiers))

    def lookup(self, worker: int, keys: list[BlockKey]) -> tuple[MatchResult, dict[int, Any]]:
        """The stored prefix and its holder records, in one round trip (``HAS_DIR``)."""
        return self.tiers[worker].lookup_keys(keys, tokens_per_block=self._tpb)

    def continue_at(
        self, worker: int, keys: Sequence[BlockKey], hit_blocks: int, holders: dict[int, Any]
    ) -> bool:
        """A continuation whose store hit is ``hit_blocks`` blocks: fetch the state at its
        end (this worker's RAM, else its holders); whether it was had. Without it, bounded
        replay recomputes the hit's last ``replay_tokens`` tokens (a hit no longer than
        that is recomputed whole, and counts no replay)."""
        if hit_blocks < 1:
            return False
        fig = self.figures
        fig.continuations += 1
        key = self._key(keys, hit_blocks)
        tier = self.tiers[worker]
        before = dict(tier.counters)
        got = tier.fetch(key, holders.get(hit_blocks - 1, ()))
        fig.local_fetches += tier.counters["local_hits"] - before["local_hits"]
        fig.remote_fetches += tier.counters["remote_hits"] - before["remote_hits"]
        if got is not None:
            expected = self._state(key)
            data = np.frombuffer(got, np.uint8)
            if data.size != expected.size:
                fig.wrong_bytes += max(data.size, expected.size)
            else:
                fig.wrong_bytes += int(np.count_nonzero(data != expected))
            fig.exact_hits += 1
            return True
        if hit_blocks * self._tpb > fig.replay_tokens:
            fig.replayed_tokens += fig.replay_tokens
        return False

    def take(self, worker: int, keys: Sequence[BlockKey]) -> None:
        """The request's state at the end of its full blocks, held by ``worker`` and
        registered before the next request (so the replay does not race its directory)."""
        if not keys:
            return
        key = self._key(keys, len(keys))
        tier = self.tiers[worker]
        if tier.put(key, self._state(key).tobytes()) is not None:
            self.figures.states_put += 1
        if not tier.flush():
            log.warning("an SWA record was not registered in time")

    def _key(self, keys: Sequence[BlockKey], blocks: int) -> StateKey:
        return StateKey(
            namespace=self._state_ns, block=keys[blocks - 1], position=blocks * self._tpb
        )

    def _state(self, key: StateKey) -> np.ndarray[Any, np.dtype[np.uint8]]:
        seed = key.block + key.position.to_bytes(4, "little")
        return payload_for_key(seed, self.figures.state_bytes)

    def stats(self) -> list[dict[str, Any]]:
        """Each tier's counters."""
        return [tier.stats() for tier in self.tiers]
