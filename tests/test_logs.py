"""Log output: JSON lines, the flags of every command, sampled per-request lines."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_fixtures import DaemonProcess, block_records, wait_until

from kvcache.cli import build_parser
from kvcache.errors import ConfigError
from kvcache.logs import (
    JsonFormatter,
    LogFormat,
    RequestLog,
    TokenBucket,
    configure_logging,
    parse_log_format,
)
from kvcache.server.metrics import Metrics
from kvcache.wire import Op

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_EXTRA_KEY = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True).filter(
    lambda k: (
        k not in vars(logging.LogRecord("", 0, "", 0, "", None, None))
        and k not in ("message", "asctime", "ts", "level", "logger", "msg", "pid", "thread")
    )
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def debug_logger() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    logger = logging.getLogger("kvcache.test.requests")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


@given(
    message=_TEXT,
    args=st.lists(st.integers(), max_size=3),
    extra=st.dictionaries(_EXTRA_KEY, st.one_of(st.integers(), _TEXT, st.none()), max_size=4),
)
@settings(max_examples=200)
def test_json_lines_carry_the_message_and_every_extra(
    message: str, args: list[int], extra: dict[str, object]
) -> None:
    fmt = message.replace("%", "%%") + " %s" * len(args)
    record = logging.LogRecord("kvcache.x", logging.WARNING, __file__, 1, fmt, tuple(args), None)
    record.__dict__.update(extra)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["msg"] == record.getMessage()
    assert out["level"] == "WARNING" and out["logger"] == "kvcache.x"
    assert out["ts"].endswith("Z") and len(out["ts"]) == len("2025-01-01T00:00:00.000Z")
    for key, value in extra.items():
        assert out[key] == value


def test_json_lines_carry_the_traceback() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("kvcache.test.exc")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed %d", 3)
    finally:
        logger.removeHandler(handler)
    out = json.loads(stream.getvalue())
    assert out["msg"] == "failed 3" and "ValueError: boom" in out["exc"]


def test_configure_logging_leaves_foreign_handlers_unless_forced() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        stream = io.StringIO()
        if root.handlers:  # under pytest, its capture handlers are there
            assert configure_logging("INFO", "json", stream=stream) is False
        assert configure_logging("INFO", "json", stream=stream, force=True) is True
        logging.getLogger("kvcache.test").info("hello %s", "json")
        assert json.loads(stream.getvalue())["msg"] == "hello json"
        again = io.StringIO()  # ours is replaced, not stacked
        assert configure_logging("WARNING", LogFormat.TEXT, stream=again) is True
        assert len(root.handlers) == 1
        logging.getLogger("kvcache.test").info("dropped")
        logging.getLogger("kvcache.test").warning("kept")
        assert "kept" in again.getvalue() and "dropped" not in again.getvalue()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_bad_format_and_level_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="log format"):
        parse_log_format("xml")
    with pytest.raises(ConfigError, match="log level"):
        configure_logging("LOUD")


def test_log_flags_work_before_and_after_any_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    args = parser.parse_args(["--log-format", "json", "server", "--data-dir", "x"])
    assert (args.log_format, args.log_level) == ("json", "INFO")
    args = parser.parse_args(["server", "--log-format", "json", "--log-level", "debug"])
    assert (args.log_format, args.log_level) == ("json", "DEBUG")
    args = parser.parse_args(["retention", "show", "--log-format", "json"])
    assert args.log_format == "json"
    monkeypatch.setenv("KVCACHE_LOG_FORMAT", "json")
    monkeypatch.setenv("KVCACHE_LOG_LEVEL", "warning")
    args = build_parser().parse_args(["status"])
    assert (args.log_format, args.log_level) == ("json", "WARNING")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--log-format", "xml"])


@given(steps=st.lists(st.floats(min_value=0, max_value=2.0), min_size=1, max_size=200))
def test_token_bucket_never_passes_more_than_burst_plus_rate(steps: list[float]) -> None:
    clock = FakeClock()
    bucket = TokenBucket(5.0, 3, clock=clock)
    start = clock.now
    passed = 0
    for step in steps:
        clock.now += step
        passed += bucket.take()
    assert passed <= 3 + 5.0 * (clock.now - start) + 1e-9


def test_token_bucket_passes_a_steady_rate_below_its_own() -> None:
    clock = FakeClock()
    bucket = TokenBucket(10.0, 1, clock=clock)
    results = []
    for _ in range(50):
        clock.now += 0.11
        results.append(bucket.take())
    assert all(results)


def test_request_lines_are_sampled_and_count_what_they_left_out(
    debug_logger: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = debug_logger
    clock = FakeClock()
    log = RequestLog(logger, rate_per_s=10, burst=5, clock=clock)
    written = sum(log.record("get", 0.001, items=64) for _ in range(1000))
    assert written == 5
    clock.now += 0.25  # 2.5 tokens more at 10 a second: 2 lines
    written += sum(log.record("put", 0.002, items=8, tenant="alice") for _ in range(1000))
    assert written == 7
    clock.now += 60.0  # a long pause refills the bucket only up to the burst
    written += sum(log.record("put", 0.002) for _ in range(1000))
    assert written == 12
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert len(lines) == 12
    assert lines[5]["request"]["suppressed"] == 995  # the first burst's leftovers
    assert lines[5]["request"]["op"] == "put" and lines[5]["request"]["tenant"] == "alice"
    assert "op=put" in lines[5]["msg"] and "items=8" in lines[5]["msg"]
    assert lines[7]["request"]["suppressed"] == 998
    assert sum(1 + x["request"]["suppressed"] for x in lines) <= 3000


def test_request_lines_cost_nothing_without_debug() -> None:
    logger = logging.getLogger("kvcache.test.quiet")
    logger.setLevel(logging.INFO)
    log = RequestLog(logger, rate_per_s=1000, burst=1000)
    assert not log.enabled()
    assert not any(log.record("get", 0.1) for _ in range(10))
    assert log.suppressed == 0  # not even counted: nothing is sampled when off


def test_metrics_write_sampled_request_lines(
    debug_logger: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = debug_logger
    metrics = Metrics(request_log=RequestLog(logger, rate_per_s=1, burst=2, clock=FakeClock()))
    counts = np.zeros(16, dtype=np.int64)
    counts[0], counts[1] = 60, 4
    for _ in range(10):
        metrics.observe(Op.GET, 0.002, bytes_in=100, bytes_out=5000, counts=counts)
    lines = [json.loads(x)["request"] for x in stream.getvalue().splitlines()]
    assert len(lines) == 2
    assert lines[0]["statuses"] == {"ok": 60, "not_found": 4} and lines[0]["items"] == 64
    assert lines[0]["bytes_out"] == 5000
    assert metrics.snapshot()["requests"]["get"] == 10  # counting is not sampled


def test_daemon_logs_json_and_samples_its_request_lines(tmp_path: Path) -> None:
    env = {"KVCACHE_LOG_FORMAT": "json", "KVCACHE_LOG_LEVEL": "DEBUG"}
    with DaemonProcess(tmp_path, env=env) as daemon:
        requests = 0
        with daemon.probe(timeout_s=10) as probe:
            shards = block_records(b"k" * 16, indices=range(4))
            probe.put(shards)
            requests += 1
            for _ in range(200):
                probe.get([(k, i) for k, i, _ in shards])
                requests += 1

        def request_lines() -> list[dict[str, object]]:
            out = []
            for line in daemon.log().splitlines():
                entry = json.loads(line)  # every line of the daemon is JSON
                if entry["logger"] == "kvcache.server.requests":
                    out.append(entry["request"])
            return out

        lines = wait_until(request_lines, what="a request line")
        log_text = daemon.log()
    entries = [json.loads(x) for x in log_text.splitlines()]
    started = [e for e in entries if e["logger"] == "kvcache.server.daemon"]
    assert started and "test-node" in started[0]["msg"]
    assert all(e["level"] in ("DEBUG", "INFO", "WARNING") for e in entries)
    # Sampled: 20 at once, 10 a second after that; the 201 requests took well under 15 s.
    assert 1 <= len(lines) < requests
    assert sum(1 + int(x["suppressed"]) for x in lines) <= requests  # type: ignore[call-overload]
    # The test's PUTs and GETs, and the HAS of /healthz's self-probe through the data path.
    assert {"put", "get"} & {x["op"] for x in lines}
    assert {x["op"] for x in lines} <= {"put", "get", "has"}
