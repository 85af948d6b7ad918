"""The status page's pure parts: percentiles from buckets, counter windows, the view, access."""

from __future__ import annotations

import bisect
import importlib
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cluster import NodeInfo, NodeState
from kvcache.credentials import Credentials
from kvcache.dashboard.auth import COOKIE_NAME, Access, session_value
from kvcache.dashboard.config import DashboardConfig, load_dashboard_config
from kvcache.dashboard.quantiles import counter_delta, histogram_quantile, subtract_buckets
from kvcache.dashboard.samples import ClusterSample, History, NodePoll, flat_counters, window_delta
from kvcache.dashboard.view import REPAIR_NOTE, ViewContext, build_view
from kvcache.errors import ConfigError
from kvcache.server.metrics import LATENCY_BUCKETS_S, Metrics
from kvcache.wire import Op

BOUNDS = list(LATENCY_BUCKETS_S)


def test_public_names() -> None:
    mod = importlib.import_module("kvcache.dashboard")
    assert sorted(mod.__all__) == sorted(
        ["PREFIX", "Access", "Collector", "LocalNode", "ViewContext", "add_dashboard", "build_view"]
    )


def bucketize(values: list[float]) -> list[int]:
    """What Metrics does: bisect_left on the upper bounds, one extra bucket past the last."""
    buckets = [0] * (len(BOUNDS) + 1)
    for v in values:
        buckets[bisect.bisect_left(BOUNDS, v)] += 1
    return buckets


@given(
    values=st.lists(st.floats(min_value=0, max_value=20.0), min_size=1, max_size=300),
    q=st.floats(min_value=0.0, max_value=1.0),
)
@settings(max_examples=300)
def test_quantile_estimate_lies_in_the_bucket_of_the_true_value(
    values: list[float], q: float
) -> None:
    buckets = bucketize(values)
    estimate = histogram_quantile(q, BOUNDS, buckets)
    assert estimate is not None
    ordered = sorted(values)
    k = max(1, math.ceil(q * len(values)))  # the rank histogram_quantile looks for
    true = ordered[k - 1]
    j = bisect.bisect_left(BOUNDS, true)
    lower = 0.0 if j == 0 else BOUNDS[j - 1]
    upper = BOUNDS[j] if j < len(BOUNDS) else BOUNDS[-1]
    assert lower - 1e-12 <= estimate <= upper + 1e-12


@given(values=st.lists(st.floats(min_value=0, max_value=20.0), min_size=1, max_size=100))
def test_quantiles_rise_with_q(values: list[float]) -> None:
    buckets = bucketize(values)
    estimates = [histogram_quantile(q, BOUNDS, buckets) for q in np.linspace(0, 1, 21)]
    assert all(a is not None and b is not None and a <= b for a, b in itertools.pairwise(estimates))


def test_quantile_of_nothing_and_bad_arguments() -> None:
    assert histogram_quantile(0.5, BOUNDS, [0] * (len(BOUNDS) + 1)) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, BOUNDS, [1] * (len(BOUNDS) + 1))
    with pytest.raises(ValueError):
        histogram_quantile(0.5, BOUNDS, [1, 2])


@given(old=st.integers(0, 10**9), grew=st.integers(0, 10**9), after_restart=st.integers(0, 10**9))
def test_counter_delta_counts_growth_and_restarts(old: int, grew: int, after_restart: int) -> None:
    assert counter_delta(old, old + grew) == grew
    if after_restart < old:
        assert counter_delta(old, after_restart) == after_restart


def test_bucket_subtraction_after_a_restart_keeps_the_new_histogram() -> None:
    assert subtract_buckets([5, 6, 7], [1, 2, 3]) == [4, 4, 4]
    assert subtract_buckets([1, 0, 0], [1, 2, 3]) == [1, 0, 0]


def _metrics_stats(
    requests: int, hits: dict[str, int], misses: dict[str, int] | None = None
) -> dict[str, Any]:
    """A /stats document from a real Metrics object, with usage and watermarks added."""
    m = Metrics()
    for i in range(requests):
        m.observe(Op.GET, 0.0004 * (i + 1), bytes_in=10, bytes_out=100)
    for cls, n in hits.items():
        m.hit("get", cls, n)
    for cls, n in (misses or {}).items():
        m.miss("get", cls, n)
    snap = m.snapshot()
    snap["items"]["get"] = {"ok": sum(hits.values()), "not_found": sum((misses or {}).values())}
    snap["usage"] = {
        "used_bytes": 900,
        "capacity_bytes": 1000,
        "shards": 3,
        "classes": {"chat": {"bytes": 600, "shards": 2}, "agent": {"bytes": 300, "shards": 1}},
        "tenants": {
            "default": {
                "bytes": 900,
                "shards": 3,
                "classes": {
                    "chat": {"bytes": 600, "shards": 2},
                    "agent": {"bytes": 300, "shards": 1},
                },
            }
        },
    }
    snap["watermarks"] = {"high": 0.9, "low": 0.8}
    snap["gc"] = {"evicted_shards": 7, "expired_shards": 2}
    return snap


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


@given(
    doc=st.dictionaries(
        st.sampled_from(["requests", "hits", "misses", "items", "latency", "errors", "gc", "x"]),
        _JSONISH,
        max_size=8,
    )
)
@settings(max_examples=100, deadline=None)  # a check of behaviour, not speed: CI is loaded
def test_flat_counters_take_any_json_without_raising(doc: dict[str, Any]) -> None:
    out = flat_counters(doc)
    assert all(isinstance(v, float) for v in out.values())


def test_flat_counters_of_a_real_snapshot() -> None:
    out = flat_counters(_metrics_stats(3, {"chat": 5}, {"chat": 1}))
    assert out["requests:get"] == 3 and out["hits:get:chat"] == 5 and out["misses:get:chat"] == 1
    assert (
        out["latn:get:count"] == 3
        and sum(v for k, v in out.items() if k.startswith("lat:get:")) == 3
    )
    assert out["gc:evicted_shards"] == 7


def test_window_delta_sums_nodes_and_survives_a_restart() -> None:
    old = ClusterSample(0.0, {"a": {"x": 10.0}, "b": {"x": 5.0}})
    new = ClusterSample(60.0, {"a": {"x": 15.0}, "b": {"x": 2.0}, "c": {"x": 100.0}})
    # a grew 5; b restarted (counts 2 since); c was not in the old sample: unknown growth.
    assert window_delta(old, new) == {"x": 7.0}
    assert window_delta(None, new) == {"x": 117.0}


def test_history_keeps_spaced_samples_for_a_while() -> None:
    h = History(spacing_s=10, keep_s=60)
    kept = [h.add(ClusterSample(float(t))) for t in range(0, 100, 2)]
    assert sum(kept) == 10
    assert [s.at for s in h.samples()] == [40.0, 50.0, 60.0, 70.0, 80.0, 90.0]
    assert h.before(95.0, 30.0) is not None and h.before(95.0, 30.0).at == 60.0  # type: ignore[union-attr]
    assert h.before(41.0, 30.0).at == 40.0  # type: ignore[union-attr]  # only a shorter window
    assert h.before(40.0, 30.0) is None
    with pytest.raises(ValueError):
        History(spacing_s=10, keep_s=5)


def _node(i: int, **kw: Any) -> NodeInfo:
    return NodeInfo(
        id=f"n{i}", data=f"tcp://127.0.0.1:{7000 + i}", admin=f"http://127.0.0.1:{8000 + i}", **kw
    )


def test_view_of_a_cluster_with_a_dead_node() -> None:
    history = History(spacing_s=10, keep_s=600)
    ctx = ViewContext(served_by="n0", cluster_source="c.toml", cluster_epoch=3)
    nodes = [_node(0, domain="rack-a"), _node(1, domain="rack-b"), _node(2, state=NodeState.OUT)]
    first = [
        NodePoll(node=n, at=100.0, stats=_metrics_stats(2, {"chat": 10}, {"chat": 10}))
        for n in nodes
    ]
    view0 = build_view(
        first,
        now=100.0,
        history=history,
        last_seen={"n0": 100.0, "n1": 100.0, "n2": 100.0},
        context=ctx,
    )
    assert view0["window"]["seconds"] is None  # nothing earlier: since start
    history.add(ClusterSample.of(100.0, first))
    later = [
        NodePoll(
            node=nodes[0],
            at=160.0,
            stats=_metrics_stats(6, {"chat": 40, "agent": 10}, {"chat": 20}),
        ),
        NodePoll(node=nodes[1], at=160.0, error="cannot connect: connection refused"),
        NodePoll(node=nodes[2], at=160.0, stats=_metrics_stats(2, {"chat": 10}, {"chat": 10})),
    ]
    view = build_view(
        later,
        now=160.0,
        history=history,
        last_seen={"n0": 160.0, "n1": 100.0, "n2": 160.0},
        context=ctx,
    )
    assert view["cluster"] == {"source": "c.toml", "epoch": 3, "error": ""}
    by_id = {n["id"]: n for n in view["nodes"]}
    assert by_id["n1"]["health"] == "unreachable" and by_id["n1"]["age_s"] == 60.0
    assert by_id["n1"]["error"].startswith("cannot connect")
    assert by_id["n0"]["domain"] == "rack-a" and by_id["n2"]["state"] == "out"
    assert by_id["n0"]["watermark"]["state"] == "high"  # 900 of 1000 bytes, high mark 0.9
    assert by_id["n0"]["requests_per_s"] == pytest.approx(4 / 60)
    assert view["totals"]["healthy"] == 2 and view["totals"]["used_bytes"] == 1800
    assert view["totals"]["classes"]["chat"] == {"bytes": 1200, "shards": 4}
    assert view["totals"]["tenants"]["default"]["classes"] == {"chat": 1200, "agent": 600}
    assert view["window"]["seconds"] == 60.0
    chat = view["rates"]["classes"]["chat"]
    assert chat["hits_per_s"] == pytest.approx(30 / 60) and chat["misses_per_s"] == pytest.approx(
        10 / 60
    )
    assert chat["hit_ratio"] == pytest.approx(0.75)
    assert chat["total_hit_ratio"] == pytest.approx(50 / 80)
    assert view["rates"]["classes"]["agent"]["hit_ratio"] == 1.0
    assert view["series"]["t"] == [160.0]
    assert view["series"]["class_hit_ratio"]["chat"] == [pytest.approx(0.75)]
    get = view["latency"]["ops"]["get"]
    assert get["total"]["count"] == 8 and get["window"]["count"] == 4
    assert (
        get["window"]["p50_ms"] is not None and get["window"]["p50_ms"] <= get["window"]["p99_ms"]
    )
    assert view["gc"]["evicted_shards"]["total"] == 14
    assert view["repair"]["running"] is False and REPAIR_NOTE in view["repair"]["text"]


def test_view_without_per_class_misses_says_so() -> None:
    polls = [NodePoll(node=_node(0), at=1.0, stats=_metrics_stats(1, {"chat": 4}))]
    view = build_view(
        polls,
        now=1.0,
        history=History(),
        last_seen={},
        context=ViewContext(served_by="x", cluster_source="y"),
    )
    assert view["rates"]["per_class_misses"] is False
    assert view["rates"]["classes"]["chat"]["hit_ratio"] is None
    assert view["rates"]["all"]["total_hit_ratio"] == 1.0


def test_access_checks_token_header_and_cookie() -> None:
    token = "t" * 40
    access = Access(token)
    assert not access.allows({}, {})
    assert access.allows({"Authorization": f"Bearer {token}"}, {})
    assert not access.allows({"Authorization": f"Bearer {token}x"}, {})
    assert access.allows({}, {COOKIE_NAME: session_value(token)})
    assert not access.allows({}, {COOKIE_NAME: token})  # the cookie is not the token
    assert session_value(token) != session_value("u" * 40)
    assert Access(None).allows({}, {}) and Access(None).open
    assert "t" * 40 not in repr(access)


def test_dashboard_config_layers_and_token_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCACHE_ADMIN_TOKEN", raising=False)
    creds = Credentials.generate()
    assert creds.admin_token is not None
    creds.write(tmp_path / "credentials.toml")
    toml = tmp_path / "dash.toml"
    toml.write_text(f'[dashboard]\ncluster_file = "{tmp_path / "cluster.toml"}"\nrefresh_s = 5\n')
    config = load_dashboard_config(toml, flags={"listen": "0.0.0.0:9000"})
    assert config.refresh_s == 5.0 and config.listen == "0.0.0.0:9000"
    assert config.admin_token() == creds.admin_token  # credentials.toml beside the map
    monkeypatch.setenv("KVCACHE_DASHBOARD_REFRESH_S", "3")
    monkeypatch.setenv("KVCACHE_ADMIN_TOKEN", "e" * 32)
    config = load_dashboard_config(toml)
    assert config.refresh_s == 3.0 and config.admin_token() == "e" * 32
    assert load_dashboard_config(toml, flags={"no_auth": True}).admin_token() is None
    assert "e" * 32 not in repr(config)
    with pytest.raises(ConfigError, match="listen must be host:port"):
        load_dashboard_config(flags={"listen": "nope"})
    with pytest.raises(ConfigError, match="unknown setting"):
        load_dashboard_config(flags={"colour": "blue"})
    monkeypatch.delenv("KVCACHE_ADMIN_TOKEN")
    lonely = DashboardConfig(cluster_file=tmp_path / "elsewhere" / "cluster.toml")
    with pytest.raises(ConfigError, match="needs the admin token"):
        lonely.admin_token()
