"""Pin the public names of the server and retention packages."""

from __future__ import annotations

import kvcache.retention
import kvcache.server


def test_server_public_names() -> None:
    assert sorted(kvcache.server.__all__) == [
        "Clock",
        "DaemonInfo",
        "DaemonThread",
        "DataServer",
        "RequestHandler",
        "ServerConfig",
        "ShardStore",
        "SyncMode",
        "load_server_config",
        "run_daemon",
    ]
    for name in kvcache.server.__all__:
        assert hasattr(kvcache.server, name)


def test_retention_public_names() -> None:
    assert sorted(kvcache.retention.__all__) == [
        "Applied",
        "DAY_S",
        "DEFAULT_CLASSES",
        "DEFAULT_CLASS_NAME",
        "Hint",
        "NO_HINT",
        "RetentionPolicy",
        "clamp",
        "merged_expiry",
        "parse_duration",
    ]
