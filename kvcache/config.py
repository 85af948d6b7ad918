"""Loading typed, frozen config objects from TOML, environment and flags.

Each component has one frozen, keyword-only dataclass (``ServerConfig``,
``ClientConfig``, ...). This module turns a mapping (a TOML table, environment
variables, parsed flags) into one, converting and validating every field, so a
wrong value is reported with its field name and source instead of failing later.
Precedence, lowest first: dataclass defaults, TOML file, environment, flags.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvcache.errors import ConfigError

__all__ = ["build_config", "env_overrides", "load_toml", "parse_size"]

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*\Z")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: Sizes past this are a typo, not a disk (and would overflow LMDB's and the wire's fields).
MAX_SIZE = 1 << 60

T = TypeVar("T")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a missing or malformed file is a ConfigError naming it."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None


def env_overrides(cls: type[Any], prefix: str) -> dict[str, str]:
    """Values for ``cls``'s fields from environment variables ``PREFIX_FIELD``."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}_{f.name.upper()}"
        if name in os.environ:
            out[f.name] = os.environ[name]
    return out


def parse_size(value: object, *, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"64MiB"``, ``"10G"``, ``"512k"`` (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a byte count, got {value!r}")
    size: int | None = None
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE_RE.match(value.lower())):
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    if size is not None:
        if not 0 <= size <= MAX_SIZE:
            raise ConfigError(f"{what} of {value!r} is out of range (0 .. 1 EiB)")
        return size
    raise ConfigError(f"{what} must be bytes or a size such as '512MiB' or '10G', got {value!r}")


def build_config(cls: type[T], *layers: Mapping[str, Any], source: str = "config") -> T:
    """Build ``cls`` from mappings applied in order (later wins); unknown keys are errors."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for layer in layers:
        for key, raw in layer.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(
                    f"{source}: unknown setting {key!r} for {cls.__name__}; "
                    f"known: {', '.join(sorted(fields))}"
                )
            if raw is None:
                continue
            values[name] = _convert(hints[name], raw, f"{cls.__name__}.{name}", source)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: invalid {cls.__name__}: {exc}") from None


def _convert(hint: Any, raw: Any, what: str, source: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw == "" and len(options) < len(typing.get_args(hint)):
            return None
        errors = []
        for option in options:
            try:
                return _convert(option, raw, what, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError("; ".join(errors))
    if origin in (tuple, list):
        (inner, *_rest) = typing.get_args(hint) or (Any,)
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{source}: {what} must be a list, got {raw!r}")
        converted = [_convert(inner, item, what, source) for item in items]
        return tuple(converted) if origin is tuple else converted
    if hint is Any:
        return raw
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw)
        except ValueError:
            choices = ", ".join(str(m.value) for m in hint)
            raise ConfigError(f"{source}: {what}={raw!r} is not one of {choices}") from None
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
            return raw.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{source}: {what} must be a boolean, got {raw!r}")
    if hint in (int, float):
        if isinstance(raw, bool):
            raise ConfigError(f"{source}: {what} must be a number, got {raw!r}")
        try:
            if hint is float:
                value = float(raw)
            elif isinstance(raw, int):
                value = raw
            elif isinstance(raw, str) and raw.strip().lstrip("+-").isdigit():
                value = int(raw)
            else:
                number = float(raw)
                if not number.is_integer():  # never truncated: 2.9 is not 2
                    raise ValueError
                value = int(number)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{source}: {what} must be {hint.__name__}, got {raw!r}") from None
        if hint is float and not math.isfinite(value):
            raise ConfigError(f"{source}: {what} must be a finite number, got {raw!r}")
        return value
    if hint is str:
        if not isinstance(raw, str):
            raise ConfigError(f"{source}: {what} must be a string, got {raw!r}")
        return raw
    if hint is Path:
        if not isinstance(raw, str | Path) or not str(raw):
            raise ConfigError(f"{source}: {what} must be a non-empty path, got {raw!r}")
        return Path(raw)
    if isinstance(raw, hint):
        return raw
    raise ConfigError(f"{source}: cannot read {what} of type {hint!r} from {raw!r}")
