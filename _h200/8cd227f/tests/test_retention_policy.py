"""RetentionPolicy: defaults, loading, and the pure expiry decisions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.errors import ConfigError
from kvcache.retention import DAY_S, RetentionPolicy, merged_expiry, parse_duration


def test_defaults_are_agent_3_days_chat_7_days() -> None:
    policy = RetentionPolicy()
    assert policy.ttl_s("agent") == 3 * DAY_S
    assert policy.ttl_s("chat") == 7 * DAY_S
    assert policy.default_class == "default"
    assert policy.resolve("batch-eval") == "default"
    assert policy.expiry_for("chat", 100.0) == 100_000 + 7 * DAY_S * 1000


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (90, 90),
        ("90", 90),
        ("90s", 90),
        ("30m", 1800),
        ("72h", 3 * DAY_S),
        ("7d", 7 * DAY_S),
        ("1w", 7 * DAY_S),
        (2.5, 2),
    ],
)
def test_parse_duration(text: object, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "3 days", "-1", 0, True, "1y", None])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_from_mapping_toml_table_and_env_string() -> None:
    policy = RetentionPolicy.from_mapping({"classes": {"agent": "2d", "chat": "10d"}})
    assert dict(policy.classes) == {"agent": 2 * DAY_S, "chat": 10 * DAY_S}
    assert policy.default_class == "chat"  # no default named: the longest-lived class
    policy = RetentionPolicy.from_mapping(
        {"classes": "agent=1h, bulk=2h", "default_class": "agent"}
    )
    assert policy.ttl_s("bulk") == 7200
    assert policy.resolve("unknown") == "agent"
    assert RetentionPolicy.from_mapping(policy.to_dict()) == policy


@pytest.mark.parametrize(
    "table",
    [
        {"classes": {}},
        {"classes": {"Bad Name": 10}},
        {"classes": {"agent": 10}, "default_class": "chat"},
        {"classes": {"agent": 10}, "ttl": 5},
        {"classes": "agent"},
        {"default_class": 3},
    ],
)
def test_from_mapping_rejects(table: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RetentionPolicy.from_mapping(table)


def test_from_toml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "node.toml"
    path.write_text(
        '[retention]\ndefault_class = "agent"\n[retention.classes]\nagent = "3d"\nchat = 604800\n'
    )
    policy = RetentionPolicy.from_toml(path)
    assert policy.to_dict() == {
        "default_class": "agent",
        "classes": {"agent": 3 * DAY_S, "chat": 7 * DAY_S},
    }


@given(current=st.none() | st.integers(0, 2**60), candidate=st.integers(0, 2**60))
def test_merged_expiry_never_shortens(current: int | None, candidate: int) -> None:
    merged = merged_expiry(current, candidate)
    assert merged >= candidate
    assert current is None or merged >= current
    assert merged in (current, candidate)
