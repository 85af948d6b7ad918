"""The retention promise, measured on a real daemon: removals by (tenant, class, cause), the
age-at-removal histogram and the oldest live age on /metrics and /stats, and the shipped
Prometheus alert rule for "evicted before TTL"."""

from __future__ import annotations

import json
import re
from pathlib import Path

from server_fixtures import DaemonProcess, block_records, http
from test_grafana import exported_metrics, promql_metrics

ALERTS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "kvcache-alerts.yml"


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include ``labels``."""
    found = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body = line[len(name) + 1 : line.rindex("}")]
        have = dict(re.findall(r'(\w+)="((?:\\.|[^"\\])*)"', body))
        if all(have.get(k) == v for k, v in labels.items()):
            found.append(float(line.rsplit(" ", 1)[1]))
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_evictions_before_ttl_show_on_metrics_and_stats(tmp_path: Path) -> None:
    body = 32 << 10
    record = len(block_records(b"\0" * 16, indices=[0], body_len=body)[0][2])
    capacity = 1 << 20  # room for 28 such shards under the 0.9 watermark
    with DaemonProcess(tmp_path, server={"capacity_bytes": capacity}) as daemon:
        with daemon.probe(tenant="alice", timeout_s=10) as probe:
            for n in range(40):  # 40 live chat shards into room for 28
                probe.put(block_records(n.to_bytes(16, "big"), indices=[0], body_len=body))
        with daemon.probe(timeout_s=10) as probe:
            probe.put(block_records(b"d" * 16, indices=[0], traffic_class="agent"))
            probe.delete([(b"d" * 16, 0, 0)])
        status, body = http("GET", daemon.admin + "/metrics")
        assert status == 200
        text = body.decode()
        evicted = sample(text, "kvcache_server_removed_shards_total", tenant="alice",
                         cause="evicted")  # fmt: skip
        stats = daemon.stats()
        assert evicted == stats["gc"]["evicted_shards"] > 0
        assert sample(text, "kvcache_server_removed_bytes_total", tenant="alice",
                      cause="evicted") == evicted * record  # fmt: skip
        assert sample(text, "kvcache_server_removed_shards_total", tenant="default",
                      cause="deleted", **{"class": "agent"}) == 1  # fmt: skip
        assert sample(text, "kvcache_server_removal_age_seconds_count", tenant="alice",
                      cause="evicted") == evicted  # fmt: skip
        assert sample(text, "kvcache_server_removal_age_seconds_bucket", tenant="alice",
                      cause="evicted", le="+Inf") == evicted  # fmt: skip
        oldest = sample(text, "kvcache_server_oldest_live_age_seconds", tenant="alice")
        assert 0 <= oldest < 600
        rows = stats_rows(daemon)
        assert {(r["tenant"], r["class"], r["cause"]) for r in rows} == {
            ("alice", "chat", "evicted"), ("default", "agent", "deleted")
        }  # fmt: skip
        # The status page says the promise was broken, for whom.
        status, body = http("GET", daemon.admin + "/dashboard/api/cluster",
                            token=daemon.admin_token)  # fmt: skip
        assert status == 200
        view = json.loads(body)["retention"]
        assert view["evicted_before_ttl"] == evicted and "broken" in view["text"]
        [alice] = [r for r in view["rows"] if r["tenant"] == "alice"]
        assert alice["evicted"] == evicted and alice["oldest_live_age_s"] is not None


def stats_rows(daemon: DaemonProcess) -> list[dict[str, object]]:
    status, body = http("GET", daemon.admin + "/stats")
    assert status == 200
    doc = json.loads(body)
    assert doc["retention"]["oldest_live_age_s"][0]["tenant"] == "alice"
    rows: list[dict[str, object]] = doc["retention"]["removals"]
    return rows


def test_the_shipped_alert_rule_watches_evictions_before_ttl(tmp_path: Path) -> None:
    text = ALERTS.read_text()
    exprs = re.findall(r"^\s*expr:\s*(.+)$", text, flags=re.M)
    assert exprs and "alert: KVCacheEvictedBeforeTTL" in text
    with DaemonProcess(tmp_path) as daemon:
        _, body = http("GET", daemon.admin + "/metrics")
    exported = exported_metrics(body.decode())
    for expr in exprs:
        names = promql_metrics(expr)
        assert names and names <= exported, expr
    assert 'cause="evicted"' in exprs[0] and "> 0" in exprs[0]
