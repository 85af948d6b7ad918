"""The retention rules, as pure decisions: the one home the daemon and the simulator share.

Everything a storage daemon decides about a shard's life is decided here, with
``now`` passed in (milliseconds since the epoch, from the caller's injected
clock) and no I/O:

* **expiry of a write** (:func:`write_expiry`): ``now + ttl`` of the request's
  (clamped) hint, else of its class, rounded up to a whole second
  (:data:`EXPIRY_QUANTUM_MS`);
* **when a write may replace** a stored shard (:func:`write_action`): a repeat
  of the same stripe merges expiries, another stripe replaces only when the
  writer names it and it is old enough, an expired shard counts as absent;
* **slide on hit** (:func:`slide`): ``max(expiry, now + ttl)`` (rounded up alike), written only
  when it moves the expiry by at least the touch resolution;
* **merge of two classes' expiries** (:func:`merged_expiry`, :func:`merge`): the
  later expiry wins, with its class;
* **pins** (:func:`stored_class`, :func:`split_stored`, :func:`evictable`): a
  pinned shard is kept apart (its stored class carries :data:`PIN_MARK`) so
  capacity and quota eviction pass it by; it still expires;
* **hint clamping** (:func:`clamp`): a request's ``ttl`` is clamped into its
  class's admin bounds, a pin past the tenant's pin quota is dropped; both are
  reported so the caller can log and count them, never refuse the request.

:mod:`kvcache.server.store` applies these to LMDB records and
:mod:`kvcache.retention.simulate` to a trace, so the simulator predicts what
the daemons do. Normative rules: ``docs/spec/retention.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError, ConfigError, ShardFormatError
from kvcache.retention.policy import RetentionPolicy, parse_duration
from kvcache.shard import check_class_name

__all__ = [
    "EXPIRY_QUANTUM_MS",
    "NO_HINT",
    "PIN_MARK",
    "Applied",
    "Hint",
    "WriteAction",
    "clamp",
    "evictable",
    "is_live",
    "live_mask",
    "merge",
    "merged_expiry",
    "quiet_above",
    "slide",
    "split_stored",
    "stored_class",
    "write_action",
    "write_expiry",
]

#: Expiries are whole seconds, rounded up (never shortening a TTL). The shards one
#: request writes or slides on a node share one expiry even when the writes land a few
#: milliseconds apart (a load's GET and the refresh of its unasked shards), and every
#: node orders them alike: by block key within an expiry. So which shards pressure
#: takes first does not hang on which node answered a millisecond later, and the
#: simulator, replaying at the trace's timestamps, orders them as the daemons do.
EXPIRY_QUANTUM_MS = 1000

#: First character of a pinned shard's stored class (never valid in a class name, so a
#: pinned partition can never collide with a class's own).
PIN_MARK = "+"


@dataclass(frozen=True, slots=True, kw_only=True)
class Hint:
    """What one request asks of the store for its blocks.

    ``traffic_class`` empty means the engine's (or client's) default class;
    ``ttl_s`` None means the class's TTL; ``pin`` keeps the blocks out of
    capacity and quota eviction (counted against the tenant's pin quota);
    ``store=False`` means write nothing for this request (its hits still
    count and slide). Validated when built: a bad hint is an ArgumentError that
    names the field, raised before any I/O.
    """

    traffic_class: str = ""
    ttl_s: int | None = None
    pin: bool = False
    store: bool = True

    def __post_init__(self) -> None:
        if self.traffic_class:
            try:
                check_class_name(self.traffic_class)
            except ShardFormatError as exc:
                raise ArgumentError(f"retention hint traffic_class: {exc}") from None
        if self.ttl_s is not None and (
            isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, int) or self.ttl_s < 1
        ):
            raise ArgumentError(
                f"retention hint ttl must be whole seconds >= 1, got {self.ttl_s!r}"
            )
        if self.ttl_s is not None and self.ttl_s > 0xFFFF_FFFF:
            raise ArgumentError(f"retention hint ttl {self.ttl_s} s is past the 32-bit wire field")
        if not isinstance(self.pin, bool) or not isinstance(self.store, bool):
            raise ArgumentError(
                f"retention hint pin and store must be true or false, got "
                f"pin={self.pin!r} store={self.store!r}"
            )

    @property
    def is_default(self) -> bool:
        """No field set: the request behaves as if it had no hint."""
        return self == NO_HINT

    def with_default_class(self, name: str) -> Hint:
        """This hint with ``traffic_class`` filled in from ``name`` when it names none."""
        if self.traffic_class:
            return self
        return Hint(traffic_class=name, ttl_s=self.ttl_s, pin=self.pin, store=self.store)

    @classmethod
    def from_mapping(cls, raw: object, *, source: str = "kvcache hint") -> Hint:
        """A hint from a request's ``{"traffic_class": ..., "ttl": ..., "pin": ..., "store": ...}``.

        ``ttl`` is seconds or a duration string (``"90m"``, ``"3d"``). Unknown
        fields are errors, so a typo does not silently keep a default.
        """
        if raw is None:
            return NO_HINT
        if not isinstance(raw, Mapping):
            raise ArgumentError(f"{source} must be an object, got {type(raw).__name__}")
        unknown = set(raw) - {"traffic_class", "ttl", "pin", "store"}
        if unknown:
            raise ArgumentError(
                f"{source}: unknown field(s) {sorted(map(str, unknown))}; "
                "known: traffic_class, ttl, pin, store"
            )
        name = raw.get("traffic_class", "") or ""
        if not isinstance(name, str):
            raise ArgumentError(f"{source}: traffic_class must be a string, got {name!r}")
        ttl: int | None = None
        if raw.get("ttl") is not None:
            try:
                ttl = parse_duration(raw["ttl"], what=f"{source}: ttl")
            except ConfigError as exc:
                raise ArgumentError(str(exc)) from None
        pin, store = raw.get("pin", False), raw.get("store", True)
        if not isinstance(pin, bool) or not isinstance(store, bool):
            raise ArgumentError(
                f"{source}: pin and store must be true or false, got pin={pin!r} store={store!r}"
            )
        return cls(traffic_class=name, ttl_s=ttl, pin=pin, store=store)


NO_HINT = Hint()


@dataclass(frozen=True, slots=True, kw_only=True)
class Applied:
    """A hint after the policy's rules: what a write or hit really does.

    ``clamped`` says why the request got less (or other) than it asked, for a
    log line and a counter; None when it got exactly what it asked.
    """

    traffic_class: str
    ttl_s: int
    pin: bool
    clamped: str | None = None


def clamp(
    policy: RetentionPolicy,
    traffic_class: str,
    *,
    ttl_s: int | None = None,
    pin: bool = False,
    pin_room: bool = True,
) -> Applied:
    """Resolve a write's or hit's class and clamp its hint into what the policy allows.

    ``ttl_s`` goes into the class's bounds (:meth:`RetentionPolicy.bounds_of`);
    ``pin`` holds only when ``pin_room`` (the tenant's pin quota has room for
    it, decided by the caller that knows the bytes). A name the policy does not
    know counts as its default class.
    """
    name = policy.resolve(traffic_class)
    reasons: list[str] = []
    if traffic_class and name != traffic_class:
        reasons.append(f"class {traffic_class!r} is not in the policy: counted as {name!r}")
    ttl = policy.classes[name]
    if ttl_s is not None:
        low, high = policy.bounds_of(name)
        ttl = min(max(ttl_s, low), high)
        if ttl != ttl_s:
            reasons.append(f"ttl {ttl_s} s clamped to {ttl} s (class {name!r}: {low}..{high} s)")
    if pin and not pin_room:
        reasons.append("pin dropped: the tenant's pin quota is full")
        pin = False
    return Applied(
        traffic_class=name, ttl_s=ttl, pin=pin, clamped="; ".join(reasons) if reasons else None
    )


def write_expiry(now_ms: int, ttl_s: int) -> int:
    """Expiry (ms) of a write at ``now_ms`` that keeps its shard ``ttl_s`` seconds: the
    next whole second at or after ``now + ttl`` (:data:`EXPIRY_QUANTUM_MS`)."""
    return -(-(now_ms + ttl_s * 1000) // EXPIRY_QUANTUM_MS) * EXPIRY_QUANTUM_MS


def is_live(expiry_ms: int, now_ms: int) -> bool:
    """A shard is live while ``now < expiry``; an expired one is absent to every request."""
    return now_ms < expiry_ms


def live_mask(expiry_ms: npt.NDArray[np.int64], now_ms: int) -> npt.NDArray[np.bool_]:
    """:func:`is_live` of each of an array of expiries."""
    return np.asarray(expiry_ms) > now_ms


def merged_expiry(current_ms: int | None, candidate_ms: int) -> int:
    """The expiry a shard keeps when a write or hit proposes ``candidate_ms``: the later one.

    This is the whole "a block used by two classes keeps the longer TTL" rule:
    a hit never shortens a shard's life, whatever its class.
    """
    return candidate_ms if current_ms is None else max(current_ms, candidate_ms)


def merge(current: tuple[int, str] | None, candidate: tuple[int, str]) -> tuple[int, str]:
    """(expiry, stored class) kept when ``candidate`` meets ``current``: the later expiry
    with its class; a tie keeps the current one. A pin, once set, is kept by the merge
    (the stored class that holds it stays pinned).
    """
    if current is None:
        return candidate
    expiry = merged_expiry(current[0], candidate[0])
    if expiry == current[0]:
        name, pinned = split_stored(current[1])
        cand_pinned = split_stored(candidate[1])[1]
        return expiry, stored_class(name, pinned or cand_pinned)
    name, pinned = split_stored(candidate[1])
    return expiry, stored_class(name, pinned or split_stored(current[1])[1])


class WriteAction(enum.Enum):
    """What a PUT does to one (key, index) given what is stored there."""

    #: Nothing live is stored (absent or expired): the write starts afresh.
    FRESH = "fresh"
    #: The same stripe is stored live (a retry, a read repair): merge the expiries.
    REPEAT = "repeat"
    #: Another stripe is stored live, the writer named it and it is old enough: replace.
    REPLACE = "replace"
    #: Another stripe is stored live and may not be replaced: the item is CONFLICT.
    CONFLICT = "conflict"


def write_action(
    *,
    stored_expiry_ms: int | None,
    stored_stripe: int,
    stored_written_ms: int,
    stripe: int,
    expect: int,
    now_ms: int,
    replace_after_ms: int,
) -> WriteAction:
    """The racing-writer rule (``docs/spec/wire.md`` section 5), for one item.

    ``stored_expiry_ms`` None means nothing is stored at the item's (key, index).
    """
    if stored_expiry_ms is None or not is_live(stored_expiry_ms, now_ms):
        return WriteAction.FRESH
    if stored_stripe == stripe:
        return WriteAction.REPEAT
    if stored_stripe == expect and now_ms - stored_written_ms >= replace_after_ms:
        return WriteAction.REPLACE
    return WriteAction.CONFLICT


def slide(
    *,
    expiry_ms: int,
    stored: str,
    hit: Applied,
    now_ms: int,
    resolution_ms: int,
) -> tuple[int, str] | None:
    """The (expiry, stored class) a live shard's hit should write, or None to write nothing.

    ``expiry = max(expiry, now + ttl)``: a hit never shortens a life. A slide
    smaller than ``resolution_ms`` is not worth a write and is dropped, unless
    the hit pins a shard not pinned yet; the class that set the later expiry
    becomes the stored class, keeping a pin.
    """
    # Written out rather than through merge(): this runs once per sliding shard of a GET.
    candidate = -(-(now_ms + hit.ttl_s * 1000) // EXPIRY_QUANTUM_MS) * EXPIRY_QUANTUM_MS
    pinned = stored.startswith(PIN_MARK)
    if candidate - expiry_ms < resolution_ms and not (hit.pin and not pinned):
        return None
    if candidate > expiry_ms:
        return candidate, (PIN_MARK + hit.traffic_class if pinned or hit.pin else hit.traffic_class)
    return expiry_ms, (stored if pinned else PIN_MARK + stored)  # only a new pin gets here


def quiet_above(policy: RetentionPolicy, now_ms: int, resolution_ms: int, *, reach_s: int) -> int:
    """Above this expiry, a hit whose TTL is at most ``reach_s`` slides nothing worth a write:
    the daemon only tests liveness (its fast path). It allows for the rounding of
    :func:`write_expiry` whatever ``now``, so a bound taken at ``now_ms = 0`` and added
    to a later now (the native data plane's) is never too low."""
    return now_ms + max(0, reach_s * 1000 - resolution_ms) + EXPIRY_QUANTUM_MS - 1


def stored_class(name: str, pin: bool) -> str:
    """The class string a shard is stored (and partitioned) under: ``+name`` when pinned."""
    return PIN_MARK + name if pin else name


def split_stored(stored: str) -> tuple[str, bool]:
    """(class name, pinned) of a stored class string."""
    if stored.startswith(PIN_MARK):
        return stored[len(PIN_MARK) :], True
    return stored, False


def evictable(stored: str) -> bool:
    """Whether capacity or quota pressure may remove a shard stored under ``stored`` before
    its expiry (pinned shards: no; they go only when they expire or are deleted)."""
    return not stored.startswith(PIN_MARK)
