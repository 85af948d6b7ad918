"""``kvcache repair`` against real daemons on loopback: a wiped node, a resumed pass, a node
set out. Blocks are stored and loaded through the shipped client; what each node holds is
read back with LIST."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcache.cli import main
from kvcache.client import Client
from kvcache.client.matching import held_shards
from kvcache.client.plan import best_counts
from kvcache.cluster import ClusterMap, NodeState
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.placement import Placement
from kvcache.server.probe import Probe
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=256, dtype=DType.INT8, layers_in_block=1)
NS = Namespace(model="repair-test", revision="1", layout=LAYOUT)


def store_blocks(cluster: LocalCluster, blocks: int, seed: int) -> tuple[np.ndarray, list[bytes]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, blocks * LAYOUT.tokens_per_block).astype(np.uint32)
    keys = block_keys(NS, tokens)
    payloads = [payload_for_key(k, LAYOUT.payload_bytes) for k in keys]
    with Client(cluster.client_config(read_repair=False)) as client:
        assert client.store(NS, tokens, payloads).written == blocks
    return tokens, [bytes(k) for k in keys]


def held(cluster: LocalCluster, node: int) -> dict[bytes, set[int]]:
    """{key: shard indices} node ``node`` holds (tenant default), through LIST."""
    secret = cluster.credentials().tenant("default").secret  # type: ignore[union-attr]
    out: dict[bytes, set[int]] = {}
    with Probe(cluster.nodes[node].data, tenant="default", secret=secret) as probe:
        start, index, inclusive = bytes(16), 0, True
        for _page in range(1000):
            page = probe.list(start, index, inclusive=inclusive, limit=4096)
            for row in page:
                out.setdefault(bytes(row["key"]), set()).add(int(row["index"]))
            if len(page) < 4096:
                return out
            start, index, inclusive = bytes(page[-1]["key"]), int(page[-1]["index"]), False
    raise AssertionError("listing did not end")


def misplaced(cluster: LocalCluster, keys: list[bytes], skip: frozenset[int] = frozenset()) -> int:
    """Shards of ``keys`` their current holder (under the cluster file's map) lacks."""
    cmap = ClusterMap.load(cluster.cluster_file)
    placement = Placement(cmap, width=12)
    position = {n.id: i for i, n in enumerate(cluster.nodes)}
    holders = placement.holders([k for k in keys])  # type: ignore[misc]
    listing = {i: held(cluster, i) for i in range(len(cluster.nodes)) if i not in skip}
    missing = 0
    for row, key in zip(holders.tolist(), keys, strict=True):
        for index, local in enumerate(row):
            node = position[placement.nodes[local].id]
            if index not in listing.get(node, {}).get(key, set()):
                missing += 1
    return missing


def repair(cluster: LocalCluster, *extra: str) -> int:
    return main(
        [
            "repair",
            "--cluster-file",
            str(cluster.cluster_file),
            "--credentials",
            str(cluster.credentials_file),
            "--rate",
            "0",
            *extra,
        ]
    )


def loads_intact(cluster: LocalCluster, tokens: np.ndarray, keys: list[bytes]) -> None:
    with Client(cluster.client_config(read_repair=False)) as client:
        result = client.load_prefix(NS, tokens)
    assert result.blocks == len(keys)
    for got, key in zip(result.payloads, keys, strict=True):
        assert np.array_equal(got, payload_for_key(key, LAYOUT.payload_bytes))  # type: ignore[arg-type]


def test_repair_restores_a_wiped_node_and_resumes_from_its_state_file(
    cluster_factory: Callable[..., LocalCluster],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cluster = cluster_factory(12)
    tokens, keys = store_blocks(cluster, 60, seed=1)
    assert misplaced(cluster, keys) == 0
    # Node 3 loses its disk: stopped, wiped, started empty.
    cluster.kill(3)
    shutil.rmtree(cluster.data_dir(3))
    cluster.data_dir(3).mkdir()
    cluster.restart(3)
    assert held(cluster, 3) == {}
    assert misplaced(cluster, keys) == 60  # one shard of every block
    state = tmp_path / "repair-state.json"
    capsys.readouterr()
    assert repair(cluster, "--state", str(state), "--json") == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["done"] and result["keys_scanned"] == 60
    assert result["blocks_repaired"] == 60 and result["shards_written"] == 60
    assert result["bytes_written"] > 0 and result["gb_per_s"] > 0
    assert misplaced(cluster, keys) == 0
    # Full stripes again: two other daemons down and every block still loads byte-identical.
    cluster.kill(5)
    cluster.kill(9)
    loads_intact(cluster, tokens, keys)
    cluster.restart(5)
    cluster.restart(9)

    # Resume: node 7 wiped, a pass stopped after about 20 keys, then finished.
    cluster.kill(7)
    shutil.rmtree(cluster.data_dir(7))
    cluster.data_dir(7).mkdir()
    cluster.restart(7)
    assert repair(cluster, "--state", str(state), "--json", "--limit", "20", "--batch", "10") == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not first["done"] and 20 <= first["keys_scanned"] < 60
    saved = json.loads(state.read_text())["tenants"]["default"]
    assert not saved["done"] and saved["cursor"] != "00" * 16
    assert misplaced(cluster, keys) == 60 - first["blocks_repaired"]
    assert repair(cluster, "--state", str(state), "--json") == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["done"]
    # Nothing finished was scanned again.
    assert first["keys_scanned"] + second["keys_scanned"] == 60
    assert first["blocks_repaired"] + second["blocks_repaired"] == 60
    assert misplaced(cluster, keys) == 0
    assert json.loads(state.read_text())["tenants"]["default"]["passes"] == 2


def test_full_stripes_count_a_restarted_daemon_on_its_first_has(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """bench/membership.py's check (held_shards with settle=12) right after a daemon restart.

    The client's connections to the old process fail on their first request; before the
    fix that request's answer was lost and blocks with all 12 shards counted 11 (the
    0.925 repair_complete of issue 21)."""
    cluster = cluster_factory(12)
    tokens, keys = store_blocks(cluster, 24, seed=4)
    block_keys_ = [BlockKey(k) for k in keys]
    # A long timeout: on a loaded machine a slow answer must not pass for the failure
    # under test (which is immediate: a closed connection).
    with Client(cluster.client_config(read_repair=False, timeout_s=60.0)) as client:
        assert client.load_prefix(NS, tokens).blocks == 24  # connections up
        assert (best_counts(held_shards(client.core, block_keys_, settle=12), 24, n=12) == 12).all()
        for victim in (4, 7):
            cluster.kill(victim)
            cluster.restart(victim)
            held_now = held_shards(client.core, block_keys_, settle=12)
            assert (best_counts(held_now, 24, n=12) == 12).all(), victim
            assert client.load_prefix(NS, tokens).blocks == 24


def test_repair_moves_the_shards_of_a_node_set_out(
    cluster_factory: Callable[..., LocalCluster], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = cluster_factory(13)
    tokens, keys = store_blocks(cluster, 40, seed=2)
    assert misplaced(cluster, keys) == 0
    out_node = 4
    before = held(cluster, out_node)
    assert before  # it holds shards of some blocks
    epoch = ClusterMap.load(cluster.cluster_file).epoch
    node_id = cluster.nodes[out_node].id
    assert main(["node", "out", node_id, "--cluster-file", str(cluster.cluster_file)]) == 0
    cmap = ClusterMap.load(cluster.cluster_file)
    assert cmap.epoch == epoch + 1
    assert {n.id: n.state for n in cmap.nodes}[node_id] is NodeState.OUT
    moved = misplaced(cluster, keys, skip=frozenset({out_node}))
    # At least the out node's shards need new holders (placement may shift other positions).
    assert moved >= sum(len(v) for k, v in before.items() if k in set(keys)) > 0
    capsys.readouterr()
    assert repair(cluster, "--json", "--prune") == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["shards_written"] == moved
    assert misplaced(cluster, keys, skip=frozenset({out_node})) == 0
    # A second pass finds every block complete and prunes the copies left off their
    # holders: the node that is out keeps none of these blocks' shards.
    assert repair(cluster, "--json", "--prune") == 0
    pruned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert pruned["blocks_repaired"] == 0 and pruned["strays_deleted"] >= len(
        [k for k in before if k in set(keys)]
    )
    assert not set(held(cluster, out_node)) & set(keys)
    assert misplaced(cluster, keys, skip=frozenset({out_node})) == 0
    # The node that is out goes away entirely; two more fail; loads still byte-identical.
    cluster.kill(out_node)
    cluster.kill(0 if out_node != 0 else 1)
    cluster.kill(11)
    loads_intact(cluster, tokens, keys)


def test_repair_follow_repairs_a_node_wiped_while_it_runs_and_stops_on_sigterm(
    cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """The background repairer (`kvcache repair --follow`) as a process: a node wiped
    after it started is repaired by a later pass, and SIGTERM stops it cleanly."""
    cluster = cluster_factory(12)
    tokens, keys = store_blocks(cluster, 30, seed=3)
    log = tmp_path / "follow.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvcache.cli", "repair",
                "--cluster-file", str(cluster.cluster_file),
                "--credentials", str(cluster.credentials_file),
                "--rate", "0", "--follow", "--interval", "0.5", "--json",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # Its first pass finds everything whole.
        deadline = time.monotonic() + 60
        while '"done": true' not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no finished pass"
            time.sleep(0.05)
        cluster.kill(6)
        shutil.rmtree(cluster.data_dir(6))
        cluster.data_dir(6).mkdir()
        cluster.restart(6)
        deadline = time.monotonic() + 60
        while misplaced(cluster, keys) != 0:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the follower did not repair the wiped node"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    loads_intact(cluster, tokens, keys)


def test_repair_reports_user_mistakes_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.toml"
    code = main(
        ["repair", "--cluster-file", str(missing), "--credentials", str(missing), "--rate", "x"]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "kvcache: error:" in err and "Traceback" not in err


def test_scrub_deletes_a_flipped_shard_in_a_live_daemon(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    from kvcache.chaos import ShardFault, plant
    from tests.server_fixtures import http, wait_until

    cluster = cluster_factory(12)
    tokens, keys = store_blocks(cluster, 8, seed=3)
    fault = plant(cluster, keys[2], 4, ShardFault.CORRUPT_BODY)  # type: ignore[arg-type]
    node = fault.node
    admin = cluster.nodes[node].admin
    token = cluster.credentials().admin_token

    def scrub_stats() -> dict:
        _status, raw = http("GET", f"{admin}/stats")
        return json.loads(raw)["scrub"]

    passes = scrub_stats()["passes"]
    status, _body = http("POST", f"{admin}/scrub", {}, token=token)
    assert status == 200
    wait_until(lambda: scrub_stats()["passes"] > passes, timeout_s=30, what="a scrub pass")
    assert scrub_stats()["shards_bad"] == 1
    _status, metrics = http("GET", f"{admin}/metrics")
    assert b"kvcache_server_scrub_shards_bad_total 1" in metrics
    assert 4 not in held(cluster, node).get(keys[2], set())
    loads_intact(cluster, tokens, keys)
    # The repairer puts the deleted shard back.
    assert misplaced(cluster, keys) == 1
    assert repair(cluster) == 0
    assert misplaced(cluster, keys) == 0
