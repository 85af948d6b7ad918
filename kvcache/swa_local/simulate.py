"""The economics of the SWA tier on a request trace: hit rates, RAM per worker, fetch traffic.

Replays a Mooncake-format trace (``kvcache.workload.read_trace``) against
``workers`` inference workers, each keeping the sliding-window states it takes
for ``ttl_s`` seconds (from creation, as ``SwaStore`` does), with no byte
bound (the peak it reports is what the bound must cover). Pure: time is the
trace's own, routing randomness is seeded.

- A request's *store hit* is the leading run of its full blocks that earlier
  requests had (an ideal block store: everything kept, as the main store's
  days-long retention is next to minutes here). Requests with a store hit are
  *continuations*; they are the ones that can use a state.
- A request takes a state at the end of its full blocks (what the vLLM
  connector does), on the worker it was routed to.
- A continuation *hits exactly* when a live state lies at the end of its store
  hit (``exact_hit_rate``): with bounded replay (DeepSeek V4.1 in vLLM 0.32) that
  is the only useful state, since the engine loads the stored KV to the end of the
  hit either way and, without the state there, replays the last ``replay_tokens``
  tokens (``replayed_tokens``, counted for continuations whose hit is longer than
  that; shorter ones are recomputed). The older, looser figure is
  ``boundary_hit_rate``: a live state at *any* block boundary inside the store hit,
  on any worker, or on its own worker (``same_worker_hit_rate``); the longest one is
  used. A hit held only
  elsewhere is fetched: ``state_bytes`` each (``fetch_bytes_per_s`` over the
  trace's duration). ``state_token_fraction`` is the part of the store hits'
  tokens that the states used cover (a state at an earlier boundary serves
  a shorter prefix; the rest is recomputed). A continuation is *unreachable*
  when no request ever took a state inside its store hit (prefixes shared
  across conversations, such as a system prompt, end where no request ended):
  no TTL serves it, and ``reachable_hit_rate`` leaves it out.
- Routing: ``random`` (seeded), or ``affinity``: to the worker holding the
  longest usable state (a cache-aware router), at random when none does.
"""

from __future__ import annotations

import enum
import heapq
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.errors import ArgumentError
from kvcache.workload import TRACE_BLOCK_TOKENS, Request, block_identities

__all__ = [
    "DSV41_STATE_BYTES",
    "REFERENCE_STATE_BYTES",
    "Routing",
    "SwaSimulation",
    "simulate",
    "sweep_ttl",
]

#: 20 sliding-window layers x 134 tokens x 528 bytes (the reference deployment).
REFERENCE_STATE_BYTES = 20 * 134 * 528

#: DeepSeek V4.1 Flash in vLLM 0.32 on SM100: 4 SWA blocks of 16,896 B in each of 40
#: layers plus the compressor ring's 98,304 B.
DSV41_STATE_BYTES = 40 * 4 * 16_896 + 98_304


class Routing(enum.Enum):
    """How requests are spread over workers."""

    RANDOM = "random"
    AFFINITY = "affinity"


@dataclass(frozen=True, slots=True)
class SwaSimulation:
    """What one replay measured (see the module docstring)."""

    workers: int
    ttl_s: float
    routing: Routing
    state_bytes: int
    requests: int
    continuations: int
    hits: int
    same_worker_hits: int
    store_hit_tokens: int
    state_tokens: int
    fetches: int
    peak_states_per_worker: int
    duration_s: float
    unreachable: int = 0
    exact_hits: int = 0
    replayed_tokens: int = 0

    @property
    def boundary_hit_rate(self) -> float:
        """Continuations that found a state at some block boundary of their store hit, on
        some worker (a state short of the hit's end is worth nothing under bounded replay)."""
        return self.hits / max(1, self.continuations)

    @property
    def exact_hit_rate(self) -> float:
        """Continuations whose state lies at the end of their store hit, on some worker."""
        return self.exact_hits / max(1, self.continuations)

    @property
    def same_worker_hit_rate(self) -> float:
        """Continuations that found a usable state on their own worker."""
        return self.same_worker_hits / max(1, self.continuations)

    @property
    def reachable_hit_rate(self) -> float:
        """Hits among the continuations some state could ever have served."""
        return self.hits / max(1, self.continuations - self.unreachable)

    @property
    def peak_bytes_per_worker(self) -> int:
        """The most state bytes one worker held at once."""
        return self.peak_states_per_worker * self.state_bytes

    @property
    def fetch_bytes_per_s(self) -> float:
        """Cross-worker state traffic, averaged over the trace."""
        return self.fetches * self.state_bytes / max(self.duration_s, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the headline figures first, then the counts behind them."""
        return {
            "exact_hit_rate": self.exact_hit_rate,
            "replayed_tokens": self.replayed_tokens,
            "boundary_hit_rate": self.boundary_hit_rate,
            "same_worker_hit_rate": self.same_worker_hit_rate,
            "peak_bytes_per_worker": self.peak_bytes_per_worker,
            "fetch_bytes_per_s": self.fetch_bytes_per_s,
            "workers": self.workers,
            "ttl_s": self.ttl_s,
            "routing": self.routing.value,
            "state_bytes": self.state_bytes,
            "requests": self.requests,
            "continuations": self.continuations,
            "unreachable": self.unreachable,
            "reachable_hit_rate": self.reachable_hit_rate,
            "hits": self.hits,
            "exact_hits": self.exact_hits,
            "same_worker_hits": self.same_worker_hits,
            "state_token_fraction": self.state_tokens / max(1, self.store_hit_tokens),
            "fetches": self.fetches,
            "peak_states_per_worker": self.peak_states_per_worker,
            "duration_s": self.duration_s,
        }


def simulate(
    requests: Iterable[Request],
    *,
    workers: int,
    ttl_s: float,
    routing: Routing = Routing.RANDOM,
    state_bytes: int = REFERENCE_STATE_BYTES,
    seed: int = 0,
    replay_tokens: int = 128,
    tokens_per_block: int = TRACE_BLOCK_TOKENS,
) -> SwaSimulation:
    """Replay ``requests`` (in arrival order: one that arrives before the one ahead of it is
    an ArgumentError, since the TTLs and the rates depend on it); see the module docstring.

    ``tokens_per_block`` is the store's block: the trace's 512 by default, 128 for
    DeepSeek V4.1 (each hash id then names 4 blocks, and states lie at 128-token
    boundaries, as ``kvcache demo --swa-workers`` takes them).
    """
    if workers < 1 or not ttl_s > 0 or state_bytes < 1:
        raise ArgumentError(
            f"need workers >= 1, ttl_s > 0, state_bytes >= 1; got {workers}, {ttl_s}, {state_bytes}"
        )
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    # State key (blocks, identity of the last block) -> {worker: expiry}.
    holders: dict[tuple[int, tuple[int, ...]], dict[int, float]] = {}
    live = [0] * workers
    peak = 0
    expiries: list[tuple[float, int, tuple[int, tuple[int, ...]]]] = []
    count = continuations = hits = same = fetches = unreachable = exact = replayed = 0
    taken: set[tuple[int, tuple[int, ...]]] = set()
    tpb = tokens_per_block
    store_tokens = state_tokens = 0
    first_ms = last_ms = None
    for req in requests:
        if last_ms is not None and req.timestamp_ms < last_ms:
            raise ArgumentError(
                f"request {count + 1} arrives at {req.timestamp_ms} ms, before the one ahead of "
                f"it ({last_ms} ms): give the requests in arrival order (sort the trace by "
                "timestamp)"
            )
        now = req.timestamp_ms / 1000.0
        first_ms = req.timestamp_ms if first_ms is None else first_ms
        last_ms = req.timestamp_ms
        while expiries and expiries[0][0] <= now:
            when, worker, key = heapq.heappop(expiries)
            held = holders.get(key)
            if held is not None and held.get(worker) == when:
                del held[worker]
                live[worker] -= 1
                if not held:
                    del holders[key]
        count += 1
        full = block_identities(req, tpb)
        hit = 0
        for block_id in full:
            if block_id not in seen:
                break
            hit += 1
        # The longest usable state within the store hit: who holds it.
        best_blocks, best = 0, {}
        for blocks in range(hit, 0, -1):
            held = holders.get((blocks, full[blocks - 1]))
            if held:
                best_blocks, best = blocks, held
                break
        # Affinity: to a holder of the state (the lowest-numbered, to be deterministic).
        worker = min(best) if routing is Routing.AFFINITY and best else rng.randrange(workers)
        if hit:
            continuations += 1
            store_tokens += hit * tpb
            if not any((b, full[b - 1]) in taken for b in range(1, hit + 1)):
                unreachable += 1
            if best_blocks == hit:
                exact += 1
            elif hit * tpb > replay_tokens:
                replayed += replay_tokens
            if best:
                hits += 1
                state_tokens += best_blocks * tpb
                if worker in best:
                    same += 1
                else:
                    fetches += 1
        seen.update(full)
        if full:
            key = (len(full), full[-1])
            taken.add(key)
            held = holders.setdefault(key, {})
            if worker not in held:
                live[worker] += 1
                peak = max(peak, live[worker])
            held[worker] = now + ttl_s
            heapq.heappush(expiries, (now + ttl_s, worker, key))
    duration = 0.0 if first_ms is None or last_ms is None else (last_ms - first_ms) / 1000.0
    return SwaSimulation(
        workers=workers,
        ttl_s=ttl_s,
        routing=routing,
        state_bytes=state_bytes,
        requests=count,
        continuations=continuations,
        hits=hits,
        same_worker_hits=same,
        store_hit_tokens=store_tokens,
        state_tokens=state_tokens,
        fetches=fetches,
        peak_states_per_worker=peak,
        duration_s=duration,
        unreachable=unreachable,
        exact_hits=exact,
        replayed_tokens=replayed,
    )


def sweep_ttl(
    requests: Sequence[Request],
    ttls_s: Sequence[float],
    **kwargs: Any,
) -> list[SwaSimulation]:
    """:func:`simulate` once per TTL (same routing seed)."""
    return [simulate(requests, ttl_s=ttl, **kwargs) for ttl in ttls_s]
