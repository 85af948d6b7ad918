"""What a retention policy would do to a workload: hit rate and capacity, without a cluster.

Replays a request trace against an idealised cluster under the daemons' own
rules (:mod:`kvcache.retention.decide`), driven as the client drives them: the
leading run of live blocks is read, which slides it; every block after it is
stored in one PUT, a live one coming back CONFLICT and then touched (slid) once
the client has asked, one evicted meanwhile written again. A slide shorter than
the touch resolution is not written, and the later expiry wins when classes
share a block. Without ``capacity_blocks`` nothing is evicted; with it, a PUT
that would take the live blocks past ``high_watermark × capacity`` first evicts
the earliest-expiring unpinned blocks until all its blocks fit (the live ones
count, as a daemon counts a PUT's bytes before it knows which conflict), and
then eviction goes on down to ``low_watermark × capacity`` (a daemon's drain
after such a write). Ties in expiry (the blocks one request wrote or slid on a
node share an expiry: :data:`~kvcache.retention.decide.EXPIRY_QUANTUM_MS`) go
class by class in name order (a daemon's expiry index is partitioned by class),
then by ``tie_key``, the block's key, as the daemons order them; a trace names no keys,
so without it they go by a scrambled block id, ordered as arbitrarily as keys
are (ids in trace order would take every prefix's head first). Every such
eviction is of a live block, so it counts as *evicted before its TTL*.

The hit rate is the tokens of each request's leading run of live blocks over
all input tokens; capacity is the number of live blocks (and their bytes with
the 10 + 2 overhead) seen just before each request. Both are also kept per
traffic class: a request's hit counts for its own class, a live block for the
class whose TTL holds it (the one that set its current expiry). Pure: time is
the trace's own.
"""

from __future__ import annotations

import heapq
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvcache.errors import ConfigError
from kvcache.retention import decide
from kvcache.retention.policy import RetentionPolicy
from kvcache.workload import TRACE_BLOCK_TOKENS, Request

__all__ = ["ClassResult", "SimulationResult", "simulate"]


@dataclass(frozen=True, slots=True)
class ClassResult:
    """One traffic class's share of a simulation: its requests' hits, the blocks it holds."""

    input_tokens: int
    hit_tokens: int
    peak_blocks: int
    mean_blocks: float
    #: Blocks of this class removed by capacity pressure while still live.
    evicted_before_ttl: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of this class's input tokens served from the cache."""
        return self.hit_tokens / max(1, self.input_tokens)

    def stored_bytes(
        self, block_bytes: int, *, k: int = 10, m: int = 2, peak: bool = True
    ) -> float:
        """Bytes of the blocks this class holds, with the k + m overhead."""
        blocks = self.peak_blocks if peak else self.mean_blocks
        return blocks * block_bytes * (k + m) / k


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Outcome of replaying a trace under one policy."""

    requests: int
    input_tokens: int
    hit_tokens: int
    peak_blocks: int
    mean_blocks: float
    expirations: int
    #: The same figures per traffic class.
    classes: Mapping[str, ClassResult] = field(default_factory=dict)
    #: Live blocks removed by capacity pressure (0 without ``capacity_blocks``).
    evicted_before_ttl: int = 0
    #: The capacity simulated, in blocks (None: unbounded).
    capacity_blocks: int | None = None
    #: Most live blocks just after a request's writes: what a store must hold (under its
    #: high watermark) for nothing to be evicted before its TTL.
    peak_written_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of input tokens served from the cache."""
        return self.hit_tokens / max(1, self.input_tokens)

    def stored_bytes(
        self, block_bytes: int, *, k: int = 10, m: int = 2, peak: bool = True
    ) -> float:
        """Bytes on the storage nodes (payload × (k + m) / k) at the peak or on average."""
        blocks = self.peak_blocks if peak else self.mean_blocks
        return blocks * block_bytes * (k + m) / k


def _scrambled(block: int) -> int:
    """A stand-in for a block's key in the order of ties: a bijection of the id that
    spreads consecutive ids (Fibonacci hashing)."""
    return (block * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF


def simulate(
    requests: Iterable[Request],
    policy: RetentionPolicy,
    *,
    touch_resolution_s: float = 60.0,
    capacity_blocks: int | None = None,
    high_watermark: float = 0.9,
    low_watermark: float = 0.8,
    observe: Callable[[Request, Mapping[int, tuple[int, str]]], None] | None = None,
    tie_key: Callable[[int], bytes] | None = None,
) -> SimulationResult:
    """Replay ``requests`` (in arrival order) under ``policy``.

    ``observe``, if given, sees each request and then every live block's
    (expiry ms, stored class) after it (how a test holds the simulator against
    a real store, block by block).

    ``tie_key`` maps a block id to its key (:func:`kvcache.workload.replay_keys`) when
    the simulation should order expiry ties exactly as the daemons of a replay will.

    ``touch_resolution_s`` is the daemons' (``ServerConfig.touch_resolution_s``,
    60 s by default): it decides which slides are written, so it changes what
    lives.
    """
    resolution_ms = max(1, int(touch_resolution_s * 1000))
    tie: Callable[[int], bytes | int] = _scrambled if tie_key is None else tie_key
    if not 0 < low_watermark <= high_watermark <= 1:
        raise ConfigError(
            f"watermarks must satisfy 0 < low <= high <= 1, got low={low_watermark!r}, "
            f"high={high_watermark!r}"
        )
    if capacity_blocks is not None and capacity_blocks < 1:
        raise ConfigError(f"capacity must be at least one block, got {capacity_blocks!r}")
    high = None if capacity_blocks is None else int(capacity_blocks * high_watermark)
    low = None if capacity_blocks is None else int(capacity_blocks * low_watermark)
    state: dict[int, tuple[int, str]] = {}  # block -> (expiry_ms, stored class)
    # (expiry_ms, (stored class, tie), block); stale entries skipped. A daemon's expiry
    # index is partitioned by class and takes a tied second class by class, in name order.
    heap: list[tuple[int, tuple[bytes, bytes | int], int]] = []
    requests_seen = input_tokens = hit_tokens = peak = expirations = evicted = 0
    peak_written = 0
    draining = False
    live_sum = 0
    live_by: dict[str, int] = {}
    peak_by: dict[str, int] = {}
    sum_by: dict[str, int] = {}
    tokens_by: dict[str, int] = {}
    hits_by: dict[str, int] = {}
    evicted_by: dict[str, int] = {}

    def owner(stored: str) -> str:
        return decide.split_stored(stored)[0]

    def drop(block: int) -> str:
        name = owner(state.pop(block)[1])
        live_by[name] -= 1
        return name

    def put(block: int, new: tuple[int, str]) -> None:
        cur = state.get(block)
        if cur is not None:
            live_by[owner(cur[1])] -= 1
        state[block] = new
        live_by[owner(new[1])] = live_by.get(owner(new[1]), 0) + 1
        heapq.heappush(heap, (new[0], (new[1].encode(), tie(block)), block))

    def evict_down_to(target: int) -> None:
        nonlocal evicted
        skipped: list[tuple[int, tuple[bytes, bytes | int], int]] = []
        while len(state) > target and heap:
            item = heapq.heappop(heap)
            when, block = item[0], item[2]
            cur = state.get(block)
            if cur is None or cur[0] != when:
                continue  # stale: slid or gone
            if not decide.evictable(cur[1]):
                skipped.append(item)
                continue
            name = drop(block)
            evicted += 1
            evicted_by[name] = evicted_by.get(name, 0) + 1
        for item in skipped:
            heapq.heappush(heap, item)

    def touch(blocks: Iterable[int], applied: decide.Applied, now: int) -> None:
        for block in blocks:
            cur = state.get(block)
            if cur is None:
                continue
            moved = decide.slide(
                expiry_ms=cur[0], stored=cur[1], hit=applied, now_ms=now,
                resolution_ms=resolution_ms,
            )  # fmt: skip
            if moved is not None:
                put(block, moved)

    def store(blocks: list[int], written: tuple[int, str]) -> list[int]:
        """One PUT of ``blocks`` as a daemon takes it: room made for all of them, the
        absent ones written, then the drain to the low watermark; returns the blocks
        that were live (another write's shards: CONFLICT, nothing written)."""
        nonlocal draining, peak_written
        if high is not None and blocks and len(state) + len(blocks) > high:
            draining = True
            evict_down_to(max(0, high - len(blocks)))
        held = [b for b in blocks if b in state]
        for block in blocks:
            if block not in state:
                put(block, written)
        peak_written = max(peak_written, len(state))
        if low is not None and high is not None and (draining or len(state) > high):
            evict_down_to(low)  # the daemons' drain after a crossing write
            draining = False
        return held

    for req in requests:
        now = req.timestamp_ms
        while heap and not decide.is_live(heap[0][0], now):
            when, _, block = heapq.heappop(heap)
            cur = state.get(block)
            if cur is not None and cur[0] == when:
                drop(block)
                expirations += 1
        live = len(state)
        peak = max(peak, live)
        live_sum += live
        for name, n in live_by.items():
            peak_by[name] = max(peak_by.get(name, 0), n)
            sum_by[name] = sum_by.get(name, 0) + n
        full = req.hash_ids[: req.full_blocks]
        hit = 0
        for block in full:
            if block not in state:
                break
            hit += 1
        applied = decide.clamp(policy, req.traffic_class)
        cls = applied.traffic_class
        written = (decide.write_expiry(now, applied.ttl_s), decide.stored_class(cls, applied.pin))

        # As the client does: the leading run is read (GET), which slides it...
        touch(dict.fromkeys(full[:hit]), applied, now)
        # ...then every block after it is stored (one PUT, the room made for all of it);
        # the ones some write holds come back CONFLICT, and the client asks (HAS) and
        # touches those still there and writes those the drain took meanwhile.
        conflicted = store(list(dict.fromkeys(full[hit:])), written)
        if conflicted:
            touch(conflicted, applied, now)
            store([b for b in conflicted if b not in state], written)
        if observe is not None:
            observe(req, types.MappingProxyType(state))
        requests_seen += 1
        input_tokens += req.input_length
        served = min(hit * TRACE_BLOCK_TOKENS, req.input_length)
        hit_tokens += served
        tokens_by[cls] = tokens_by.get(cls, 0) + req.input_length
        hits_by[cls] = hits_by.get(cls, 0) + served
    n = max(1, requests_seen)
    return SimulationResult(
        requests=requests_seen,
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        peak_blocks=peak,
        mean_blocks=live_sum / n,
        expirations=expirations,
        evicted_before_ttl=evicted,
        capacity_blocks=capacity_blocks,
        peak_written_blocks=peak_written,
        classes={
            name: ClassResult(
                input_tokens=tokens_by.get(name, 0),
                hit_tokens=hits_by.get(name, 0),
                peak_blocks=peak_by.get(name, 0),
                mean_blocks=sum_by.get(name, 0) / n,
                evicted_before_ttl=evicted_by.get(name, 0),
            )
            for name in sorted(set(tokens_by) | set(live_by))
        },
    )
