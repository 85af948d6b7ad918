"""Log output for every kvcache process: text or one JSON object per line, and sampled
per-request lines.

``kvcache --log-format json ...`` (or ``KVCACHE_LOG_FORMAT=json``) makes every
line a JSON object, so a log shipper (journald, Loki, Elasticsearch) indexes
fields instead of parsing text::

    {"ts": "2025-01-01T12:00:00.123Z", "level": "INFO", "logger": "kvcache.server.daemon",
     "msg": "kvcache server node-00: ...", "pid": 4242, "thread": "MainThread"}

Values passed with ``extra={...}`` become fields of their own.

A daemon answers thousands of requests a second, so a line per request is a
flood. :class:`RequestLog` writes at most ``rate_per_s`` request lines a second
(a token bucket, bursts of ``burst``) at DEBUG, each saying how many lines were
left out since the previous one; with DEBUG off it costs one level check.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from kvcache.errors import ConfigError

__all__ = [
    "LOG_FORMAT_ENV",
    "LOG_LEVEL_ENV",
    "JsonFormatter",
    "LogFormat",
    "RequestLog",
    "TokenBucket",
    "add_logging_flags",
    "configure_logging",
    "parse_log_format",
]

#: Environment variables naming the default log format and level of every kvcache command.
LOG_FORMAT_ENV = "KVCACHE_LOG_FORMAT"
LOG_LEVEL_ENV = "KVCACHE_LOG_LEVEL"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_OURS = "_kvcache_handler"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


class LogFormat(enum.Enum):
    """How log lines are written."""

    TEXT = "text"
    JSON = "json"


def parse_log_format(value: object) -> LogFormat:
    """A :class:`LogFormat` from its name; raises ConfigError naming the value."""
    if isinstance(value, LogFormat):
        return value
    try:
        return LogFormat(str(value).strip().lower())
    except ValueError:
        raise ConfigError(
            f"log format must be one of {[f.value for f in LogFormat]}, got {value!r}"
        ) from None


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ms), level, logger, message, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            "thread": record.threadName,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(
    level: str | int = "INFO",
    fmt: LogFormat | str = LogFormat.TEXT,
    *,
    stream: TextIO | None = None,
    force: bool = False,
) -> bool:
    """Send the root logger's records to ``stream`` (stderr) in ``fmt``; returns whether it did.

    Like :func:`logging.basicConfig`, it leaves a root logger that already has
    handlers it did not install alone (an application embedding kvcache, or
    pytest), unless ``force``; a handler it installed before is replaced, so a
    command may call it again once its config is read.
    """
    if isinstance(level, str) and level.upper() not in LEVELS:
        raise ConfigError(f"log level must be one of {list(LEVELS)}, got {level!r}")
    fmt = parse_log_format(fmt)
    root = logging.getLogger()
    foreign = [h for h in root.handlers if not getattr(h, _OURS, False)]
    if foreign and not force:
        return False
    handler = logging.StreamHandler(stream or sys.stderr)
    setattr(handler, _OURS, True)
    if fmt is LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    for old in list(root.handlers):
        if force or getattr(old, _OURS, False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else getattr(logging, level.upper()))
    return True


def add_logging_flags(parser: argparse.ArgumentParser, *, inherited: bool = False) -> None:
    """Add ``--log-level`` and ``--log-format`` to ``parser``.

    ``inherited``: for a subcommand's parser, with no defaults of its own, so
    the flags work before or after the subcommand and the top level's default
    is kept when they are not given after it.
    """
    env_default = os.environ.get(LOG_FORMAT_ENV, LogFormat.TEXT.value)
    env_level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        type=str.upper,
        default=argparse.SUPPRESS if inherited else env_level,
        help=f"logging threshold (default {env_level}; env {LOG_LEVEL_ENV}); DEBUG adds "
        "sampled per-request lines",
    )
    parser.add_argument(
        "--log-format",
        choices=[f.value for f in LogFormat],
        default=argparse.SUPPRESS if inherited else env_default,
        help=f"text, or one JSON object per line (default {env_default}; env {LOG_FORMAT_ENV})",
    )


class TokenBucket:
    """At most ``rate_per_s`` takes a second on average, ``burst`` at once. Time is passed in."""

    def __init__(
        self, rate_per_s: float, burst: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ConfigError(
                f"a token bucket needs rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}"
            )
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def take(self) -> bool:
        """Whether one more event may pass now (and count it)."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate_per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class RequestLog:
    """One DEBUG line per answered request, sampled by a token bucket.

    Call :meth:`record` once per request from the thread that answered it.
    Each written line carries ``suppressed``: the requests not written since
    the line before, so the sample's rate can be read back.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        rate_per_s: float = 10.0,
        burst: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self._bucket = TokenBucket(rate_per_s, burst, clock=clock)
        self._lock = threading.Lock()
        self.suppressed = 0

    def enabled(self) -> bool:
        """Whether lines would be written at all (DEBUG on for the logger)."""
        return self.logger.isEnabledFor(logging.DEBUG)

    def record(
        self,
        op: str,
        seconds: float,
        *,
        items: int = 0,
        statuses: Mapping[str, int] | None = None,
        bytes_in: int = 0,
        bytes_out: int = 0,
        **context: Any,
    ) -> bool:
        """Log one request if DEBUG is on and the bucket allows; returns whether it did.

        ``statuses``: item counts by status name; ``context``: more fields
        (tenant, peer, request_id, ...) for the line and its JSON form.
        """
        if not self.logger.isEnabledFor(logging.DEBUG):
            return False
        with self._lock:
            if not self._bucket.take():
                self.suppressed += 1
                return False
            suppressed, self.suppressed = self.suppressed, 0
        fields: dict[str, Any] = {
            "op": op,
            "seconds": round(seconds, 6),
            "items": items,
            "statuses": dict(statuses or {}),
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "suppressed": suppressed,
            **context,
        }
        text = " ".join(f"{k}={v}" for k, v in fields.items() if k != "statuses") + "".join(
            f" {k}={v}" for k, v in sorted(fields["statuses"].items())
        )
        self.logger.debug("request %s", text, extra={"request": fields})
        return True
