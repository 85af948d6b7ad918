"""The retention policy: traffic classes, their TTLs, and the pure decisions made with them.

Every write and every hit names a traffic class (``agent``, ``chat``, ...). The
policy maps each class to a time to live; a shard expires ``ttl`` after the
last write or hit of a class, and when two classes use the same shard the
later expiry wins. Names the policy does not know fall back to its default
class, so a client cannot grow the set of classes (and the metrics' label
cardinality) by inventing names. Normative rules: ``docs/spec/retention.md``.

Everything here is pure: no clock is read, ``now`` is always passed in.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.config import load_toml
from kvcache.errors import ConfigError, ShardFormatError
from kvcache.shard import check_class_name

__all__ = [
    "DAY_S",
    "DEFAULT_CLASSES",
    "DEFAULT_CLASS_NAME",
    "MIN_HINT_TTL_S",
    "RetentionPolicy",
    "parse_duration",
]

DAY_S = 86_400
#: The shipped TTLs: agent traffic 3 days, chat 7 days (see docs/spec/retention.md for why).
DEFAULT_CLASSES: Mapping[str, int] = types.MappingProxyType(
    {"agent": 3 * DAY_S, "chat": 7 * DAY_S, "default": 3 * DAY_S}
)
DEFAULT_CLASS_NAME = "default"
#: Longest TTL accepted (10 years): keeps ``now + ttl`` in milliseconds far from u64 limits.
MAX_TTL_S = 10 * 365 * DAY_S
#: Shortest TTL a request's hint may ask for unless the admin sets a class's bounds.
MIN_HINT_TTL_S = 60

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": DAY_S, "w": 7 * DAY_S}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*\Z")


def parse_duration(value: object, *, what: str = "duration") -> int:
    """Seconds from an int/float of seconds or a string like ``"72h"``, ``"3d"``, ``"90s"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.match(value.lower())):
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise ConfigError(
            f"{what} must be seconds or a string such as '90s', '30m', '72h', '7d'; got {value!r}"
        )
    if not 1 <= seconds <= MAX_TTL_S:
        raise ConfigError(f"{what}={value!r} must be between 1 s and {MAX_TTL_S} s")
    return int(seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """Traffic classes → TTL in seconds, and the class used for names not listed.

    Frozen: a daemon swaps a whole policy at once, so a request never sees half
    of an update.
    """

    classes: Mapping[str, int] = field(default_factory=lambda: DEFAULT_CLASSES)
    default_class: str = DEFAULT_CLASS_NAME
    #: Per class, the (shortest, longest) TTL in seconds a request's ``ttl`` hint may ask
    #: for; a hint outside is clamped into them. A class not listed gets
    #: (min(MIN_HINT_TTL_S, ttl), ttl): a hint may shorten its life, not lengthen it.
    ttl_bounds: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    #: max_ttl_s, computed once (it is read for every hit a daemon serves).
    _max_ttl_s: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.classes, Mapping) or not self.classes:
            raise ConfigError("retention policy needs at least one traffic class")
        checked: dict[str, int] = {}
        for name, ttl in sorted(self.classes.items()):
            try:
                check_class_name(name)
            except ShardFormatError as exc:
                raise ConfigError(f"retention class: {exc}") from None
            if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL_S:
                raise ConfigError(
                    f"retention class {name!r}: TTL must be whole seconds in 1..{MAX_TTL_S}, "
                    f"got {ttl!r}"
                )
            checked[name] = ttl
        if self.default_class not in checked:
            raise ConfigError(
                f"retention default_class {self.default_class!r} is not one of the classes "
                f"{sorted(checked)}; add it under [retention.classes]"
            )
        object.__setattr__(self, "classes", types.MappingProxyType(checked))
        bounds: dict[str, tuple[int, int]] = {}
        for name, pair in sorted(dict(self.ttl_bounds).items()):
            if name not in checked:
                raise ConfigError(
                    f"retention ttl_bounds names class {name!r}, which is not one of the "
                    f"classes {sorted(checked)}"
                )
            low, high = pair
            if not (
                isinstance(low, int) and isinstance(high, int) and 1 <= low <= high <= MAX_TTL_S
            ):
                raise ConfigError(
                    f"retention ttl_bounds of class {name!r} must be whole seconds "
                    f"1 <= min <= max <= {MAX_TTL_S}, got {pair!r}"
                )
            bounds[name] = (low, high)
        object.__setattr__(self, "ttl_bounds", types.MappingProxyType(bounds))
        longest = max([*checked.values(), *(high for _, high in bounds.values())])
        object.__setattr__(self, "_max_ttl_s", longest)

    def resolve(self, name: str) -> str:
        """The class a write or hit named ``name`` counts as: itself if known, else the default."""
        return name if name in self.classes else self.default_class

    def ttl_s(self, name: str) -> int:
        """TTL in seconds for traffic named ``name`` (unknown names get the default's TTL)."""
        return self.classes[self.resolve(name)]

    def expiry_for(self, name: str, now_s: float) -> int:
        """Expiry (ms since the epoch) for a write or hit of class ``name`` at ``now_s``
        (:func:`kvcache.retention.decide.write_expiry`)."""
        from kvcache.retention.decide import write_expiry  # decide builds on this module

        return write_expiry(int(now_s * 1000), self.ttl_s(name))

    def bounds_of(self, name: str) -> tuple[int, int]:
        """(shortest, longest) TTL a hint may ask for in the class ``name`` resolves to."""
        cls = self.resolve(name)
        ttl = self.classes[cls]
        return self.ttl_bounds.get(cls, (min(MIN_HINT_TTL_S, ttl), ttl))

    @property
    def max_ttl_s(self) -> int:
        """The longest TTL any write or hit can ask for: of any class or any class's bounds
        (bounds how far one hit can move an expiry)."""
        return self._max_ttl_s

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (TTLs in seconds), accepted back by :meth:`from_mapping`."""
        out: dict[str, Any] = {"default_class": self.default_class, "classes": dict(self.classes)}
        if self.ttl_bounds:
            out["ttl_bounds"] = {k: list(v) for k, v in self.ttl_bounds.items()}
        return out

    def to_json(self) -> bytes:
        """The policy as compact UTF-8 JSON (how a daemon persists it)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_mapping(
        cls, table: Mapping[str, Any], *, source: str = "retention"
    ) -> RetentionPolicy:
        """Build from a mapping such as a TOML ``[retention]`` table or a JSON body.

        ``classes`` is a table of name → duration (seconds or ``"3d"``-style
        strings) or a string ``"agent=3d,chat=7d"`` (handy in an environment
        variable). Unknown keys are errors, so a typo does not silently keep a default.
        """
        if not isinstance(table, Mapping):
            raise ConfigError(f"{source}: retention policy must be a table, got {table!r}")
        unknown = set(table) - {"classes", "default_class", "ttl_bounds"}
        if unknown:
            raise ConfigError(
                f"{source}: unknown retention setting(s) {sorted(unknown)}; "
                "known: classes, default_class, ttl_bounds"
            )
        raw_classes = table.get("classes", DEFAULT_CLASSES)
        if isinstance(raw_classes, str):
            raw_classes = _parse_class_list(raw_classes, source)
        if not isinstance(raw_classes, Mapping):
            raise ConfigError(f"{source}: retention classes must be a table, got {raw_classes!r}")
        classes = {
            str(name): parse_duration(ttl, what=f"{source}: TTL of class {name!r}")
            for name, ttl in raw_classes.items()
        }
        if not classes:
            raise ConfigError(f"{source}: retention policy needs at least one traffic class")
        default_class = table.get("default_class", DEFAULT_CLASS_NAME)
        if not isinstance(default_class, str):
            raise ConfigError(f"{source}: default_class must be a string, got {default_class!r}")
        if default_class not in classes and "default_class" not in table:
            # A table that lists its own classes without naming a default: the
            # longest-lived class is the safe fallback (it never drops data early).
            default_class = max(sorted(classes), key=lambda name: classes[name])
        bounds = _parse_bounds(table.get("ttl_bounds", {}), source)
        try:
            return cls(classes=classes, default_class=default_class, ttl_bounds=bounds)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> RetentionPolicy:
        """The ``[retention]`` table of a TOML file (defaults when the file has none)."""
        table = load_toml(path).get("retention", {})
        return cls.from_mapping(table, source=str(path))


def _parse_class_list(text: str, source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, ttl = part.partition("=")
        if not sep:
            raise ConfigError(f"{source}: expected name=duration in {text!r}, got {part!r}")
        if name.strip() in out:
            raise ConfigError(f"{source}: class {name.strip()!r} is named twice in {text!r}")
        out[name.strip()] = ttl.strip()
    return out


def _parse_bounds(raw: object, source: str) -> dict[str, tuple[int, int]]:
    """``{class: "1m..7d"}`` or ``{class: [60, 604800]}`` (a string ``"agent=1m..7d,..."`` too)."""
    if isinstance(raw, str):
        raw = _parse_class_list(raw, source)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: ttl_bounds must be a table of class = 'min..max'")
    out: dict[str, tuple[int, int]] = {}
    for name, value in raw.items():
        what = f"{source}: ttl_bounds of class {name!r}"
        if isinstance(value, str) and ".." in value:
            low, _, high = value.partition("..")
            pair = (parse_duration(low, what=what), parse_duration(high, what=what))
        elif isinstance(value, list | tuple) and len(value) == 2:
            pair = (parse_duration(value[0], what=what), parse_duration(value[1], what=what))
        else:
            raise ConfigError(f"{what} must be 'min..max' (e.g. '1m..7d'), got {value!r}")
        out[str(name)] = pair
    return out
