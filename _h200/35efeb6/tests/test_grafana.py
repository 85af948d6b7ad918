"""The Grafana dashboard in deploy/: valid, and every query names a metric a real daemon exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from server_fixtures import DaemonProcess, block_records, http

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "kvcache.json"

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "inf", "nan", "atan2",
}  # fmt: skip
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metrics(expr: str) -> set[str]:
    """The metric names an expression selects (a small tokenizer, not a full PromQL parser:
    enough for the dashboard's queries, and property-tested below)."""
    text = re.sub(r"\$\{[^}]*\}|\$\w+", " ", expr)  # Grafana variables
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', text)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    names = set()
    for match in _IDENT.finditer(text):
        name = match.group(0)
        before = text[match.start() - 1] if match.start() else " "
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or name.lower() in _KEYWORDS or before.isdigit() or before == ".":
            continue  # a function call, a keyword, or part of a number such as 1e3
        names.add(name)
    return names


def label_values_metric(query: str) -> set[str]:
    """The metric of a Grafana ``label_values(metric, label)`` variable query."""
    match = re.fullmatch(
        r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*(?:\{[^}]*\})?\s*,\s*\w+\s*\)\s*", query
    )
    assert match, f"unexpected variable query {query!r}"
    return {match.group(1)}


def dashboard_queries(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and templating query."""
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
        for inner in panel.get("panels", []):  # collapsed rows
            for target in inner.get("targets", []):
                yield f"panel {inner['title']!r} {target['refId']}", target["expr"]


def exported_metrics(text: str) -> set[str]:
    """Metric names a /metrics page defines: its # TYPE families (histograms with their
    _bucket, _sum and _count series) and every sample's name."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


_METRIC = st.from_regex(r"kvcache_server_[a-z]{1,8}(_total|_bytes)?", fullmatch=True)
_LABELS = st.sampled_from(
    ["", '{op="get"}', '{class=~"chat|agent",instance=~"$instance"}', '{kind!="x"}']
)


@st.composite
def _expr(draw: st.DrawFn, depth: int = 0) -> tuple[str, set[str]]:
    """A random PromQL expression and the metrics it names."""
    metric, labels = draw(_METRIC), draw(_LABELS)
    kind = draw(st.integers(0, 4 if depth < 2 else 1))
    if kind == 0:
        return f"{metric}{labels}", {metric}
    if kind == 1:
        window = draw(st.sampled_from(["5m", "$__rate_interval", "1h:5m"]))
        fn = draw(st.sampled_from(["rate", "increase", "irate"]))
        return f"{fn}({metric}{labels}[{window}])", {metric}
    inner, names = draw(_expr(depth + 1))
    if kind == 2:
        agg = draw(st.sampled_from(["sum", "max", "count", "avg"]))
        group = draw(st.sampled_from(["", " by (class, le)", " without (instance)"]))
        return f"{agg}{group} ({inner})", names
    if kind == 3:
        q = draw(st.sampled_from(["0.5", "0.99", "1e-2"]))
        return f"histogram_quantile({q}, {inner})", names
    other, more = draw(_expr(depth + 1))
    op = draw(st.sampled_from(["/", " * on (instance) group_left ", " > bool ", " and ", " - "]))
    return f"{inner}{op}{other}", names | more


@given(_expr())
def test_promql_metrics_finds_exactly_the_names_used(case: tuple[str, set[str]]) -> None:
    expr, names = case
    assert promql_metrics(expr) == names


def test_dashboard_is_importable_grafana_json() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["title"] == "kvcache" and doc["uid"]
    assert {i["name"] for i in doc["__inputs"]} == {"DS_PROMETHEUS"}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["w"] > 0 and pos["h"] > 0, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}" and panel["targets"]
    queries = list(dashboard_queries(doc))
    assert len(queries) >= 20


def test_every_query_names_a_metric_the_daemon_exports(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path) as daemon:
        with daemon.probe(timeout_s=10) as probe:  # some traffic, so labelled series exist
            shards = block_records(b"g" * 16, indices=range(3))
            probe.put(shards)
            probe.get([(k, i) for k, i, _ in shards] + [(b"h" * 16, 0)])
        status, body = http("GET", daemon.admin + "/metrics")
    assert status == 200
    exported = exported_metrics(body.decode())
    assert "kvcache_server_request_seconds_bucket" in exported
    doc = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for where, expr in dashboard_queries(doc):
        names = promql_metrics(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        missing = names - exported
        assert not missing, f"{where}: {sorted(missing)} not exported by the daemon ({expr!r})"
        used |= names
    for variable in doc["templating"]["list"]:
        query = (
            variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        )
        assert label_values_metric(query) <= exported
    # The dashboard covers the families an operator needs.
    for family in ("used_bytes", "class_bytes", "tenant_bytes", "hits_total", "misses_total",
                   "request_seconds_bucket", "errors_total", "evicted_bytes_total"):  # fmt: skip
        assert f"kvcache_server_{family}" in used, family
