"""The cluster simulator's pure parts: balance statistics, move accounting, the repair
planner's accounting, and placement chunking. (The chain and the Monte Carlo check are
in test_sim_durability.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvcache.placement as placement_module
from kvcache.cli import main
from kvcache.errors import ArgumentError
from kvcache.placement import Placement
from kvcache.sim import (
    Layout,
    balance_stats,
    measure_join,
    measure_leave,
    moved_slots,
    plan_loss,
    repair_time,
    sample_keys,
    synthetic_map,
)
from kvcache.sim.balance import holders_of
from kvcache.sim.movement import join_candidates, rows_without


def test_fair_counts_show_no_structural_spread() -> None:
    rng = np.random.default_rng(1)
    nodes, keys, width = 2000, 20_000, 12
    counts = np.bincount(rng.integers(0, nodes, keys * width), minlength=nodes).astype(np.int64)
    stats = balance_stats(counts, keys=keys, width=width, rng=rng, target_per_node=1e9)
    # Sampling alone: the measured max/mean sits with the fair placement's.
    assert abs(stats.max_over_mean - stats.null_max_over_mean) < 0.1
    assert 0.9 < stats.dispersion < 1.1
    assert stats.structural_spread_upper < 0.03
    assert stats.projected_max_over_mean < 1.12


def test_a_skewed_placement_is_seen_and_projected() -> None:
    rng = np.random.default_rng(2)
    nodes, keys, width = 2000, 20_000, 12
    share = np.where(np.arange(nodes) % 2 == 0, 1.2, 0.8)  # relative spread 0.2
    counts = rng.multinomial(keys * width, share / share.sum()).astype(np.int64)
    stats = balance_stats(counts, keys=keys, width=width, rng=rng, target_per_node=1e9)
    assert 0.17 < stats.structural_spread < 0.23
    # At 10⁹ shards per node the 1.2 share is all that is left of max / mean, scaled by
    # the normal-max factor the projection uses (it is a bound, not the exact max).
    assert stats.projected_max_over_mean > 1.2


def test_balance_stats_rejects_inconsistent_counts() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ArgumentError):
        balance_stats(np.ones(10, np.int64), keys=3, width=2, rng=rng, target_per_node=1.0)


def test_real_placement_balance_is_only_sampling_noise() -> None:
    layout = Layout(nodes=200, domain_size=10)
    rng = np.random.default_rng(3)
    keys = sample_keys(4000, rng)
    rows = holders_of(synthetic_map(layout), keys, width=12)
    counts = np.bincount(rows.reshape(-1), minlength=200).astype(np.int64)
    stats = balance_stats(counts, keys=4000, width=12, rng=rng, target_per_node=1e9)
    assert stats.structural_spread_upper < 0.05
    assert stats.max_over_mean < stats.null_max_over_mean_p95 + 0.05


def test_moved_slots_counts_changed_cells() -> None:
    a = np.array([[0, 1, 2], [3, 4, 5]])
    b = np.array([[0, 9, 2], [3, 4, 8]])
    assert moved_slots(a, b) == 2
    with pytest.raises(ArgumentError):
        moved_slots(a, b[:1])


@pytest.mark.parametrize("domain_size", [0, 6])
def test_leave_replaces_only_the_keys_it_held(domain_size: int) -> None:
    layout = Layout(nodes=48, domain_size=domain_size)
    keys = sample_keys(600, np.random.default_rng(4))
    rows = holders_of(synthetic_map(layout), keys, width=12)
    fast, after = measure_leave(layout, keys, rows, width=12, node=7)
    full, after_full = measure_leave(layout, keys, rows, width=12, node=7, full=True)
    assert np.array_equal(after, after_full)
    assert fast.moved == full.moved
    assert not (after == 7).any()
    # At least the leaver's shards move; each of them to a node that is not the leaver.
    assert fast.moved >= fast.node_slots == int((rows == 7).sum()) > 0


def test_join_moves_what_the_new_node_takes() -> None:
    layout = Layout(nodes=48)
    keys = sample_keys(600, np.random.default_rng(5))
    rows = holders_of(synthetic_map(layout), keys, width=12)
    stats = measure_join(layout, keys, rows, width=12)
    after = holders_of(synthetic_map(layout, extra=1), keys, width=12)
    assert stats.node_slots == int((after == 48).sum()) > 0
    assert stats.moved == int((rows != after).sum()) >= stats.node_slots
    # Keys without the new node keep their rows.
    untouched = ~(after == 48).any(axis=1)
    assert np.array_equal(rows[untouched], after[untouched])
    assert stats.ideal_fraction == pytest.approx(1 / 49)


@pytest.mark.parametrize("domain_size", [0, 6])
def test_join_candidates_hold_every_key_the_joiner_takes(domain_size: int) -> None:
    layout = Layout(nodes=48, domain_size=domain_size)
    keys = sample_keys(600, np.random.default_rng(11))
    rows = holders_of(synthetic_map(layout), keys, width=12)
    for joiner in range(3):
        cand = join_candidates(layout, keys, rows, joiner=joiner)
        after = holders_of(synthetic_map(layout, extra=1, first_extra=joiner), keys, width=12)
        changed = (after != rows).any(axis=1)
        assert changed.any()
        assert not (changed & ~cand).any()
    fast = measure_join(layout, keys, rows, width=12, joins=3)
    full = measure_join(layout, keys, rows, width=12, joins=3, full=True)
    assert (fast.moved, fast.node_slots, fast.keys) == (full.moved, full.node_slots, 1800)


def test_plan_loss_one_node_reads_k_writes_one() -> None:
    layout = Layout(nodes=60)
    keys = sample_keys(500, np.random.default_rng(6))
    rows = holders_of(synthetic_map(layout), keys, width=12)
    cost = plan_loss(layout, keys, rows, k=10, lost=frozenset({3}))
    lost = int((rows == 3).sum())
    assert cost.lost_shards == lost == cost.blocks_repaired
    assert cost.unrecoverable == 0
    assert cost.reads == 10 * lost
    # The lost shards, plus any shards the map change displaced.
    assert cost.writes >= lost
    assert cost.traffic_per_lost_shard >= 11.0


def test_plan_loss_counts_blocks_beyond_repair() -> None:
    layout = Layout(nodes=30)
    keys = sample_keys(800, np.random.default_rng(7))
    rows = holders_of(synthetic_map(layout), keys, width=3)
    lost = frozenset(range(12))
    cost = plan_loss(layout, keys, rows, k=1, lost=lost)
    gone = int(np.isin(rows, list(lost)).all(axis=1).sum())
    assert gone > 0
    assert cost.unrecoverable == gone
    touched = int(np.isin(rows, list(lost)).any(axis=1).sum())
    assert cost.blocks_repaired == touched - gone


def test_repair_time_arithmetic() -> None:
    layout = Layout(nodes=60)
    keys = sample_keys(300, np.random.default_rng(8))
    rows = holders_of(synthetic_map(layout), keys, width=12)
    cost = plan_loss(layout, keys, rows, k=10, lost=frozenset({0}))
    t = repair_time(cost, node_bytes=1e12, per_node_gbps=1.0, nic_gbps=10.0, detect_s=60.0)
    expected = 1e12 * cost.traffic_per_lost_shard / (59 * 1e9) + 60.0
    assert t.seconds == pytest.approx(expected)
    slowed = repair_time(
        cost, node_bytes=1e12, per_node_gbps=1.0, nic_gbps=10.0, foreground_gbps=9.5
    )
    assert slowed.per_node_gbps == pytest.approx(0.5)
    with pytest.raises(ArgumentError, match="no room"):
        repair_time(cost, node_bytes=1e12, per_node_gbps=1.0, nic_gbps=10.0, foreground_gbps=10)


def test_rows_without_maps_indices_back() -> None:
    layout = Layout(nodes=40)
    keys = sample_keys(200, np.random.default_rng(9))
    rows = holders_of(synthetic_map(layout), keys, width=12)
    after = rows_without(layout, keys, rows, width=12, gone=frozenset({0, 39}))
    assert not np.isin(after, [0, 39]).any()
    assert (after >= 0).all() and (after < 40).all()
    assert all(len(set(r)) == 12 for r in after.tolist())


def test_placement_in_chunks_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = synthetic_map(Layout(nodes=50, domain_size=5))
    keys = sample_keys(300, np.random.default_rng(10))
    whole = Placement(cluster, width=12)._compute(keys)
    monkeypatch.setattr(placement_module, "_CHUNK_PAIRS", 16 * 50 * 7)  # 7 keys a chunk
    chunked = Placement(cluster, width=12)._compute(keys)
    assert np.array_equal(whole, chunked)


def test_cli_balance_writes_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.json"
    args = ["sim", "balance", "--nodes", "100", "--keys", "300", "--domain-size", "10"]
    code = main([*args, "--json", str(out)])
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["balance_100_keys"] == 300
    assert figures["balance_100_domains_mean_per_node"] == pytest.approx(36.0)
    assert "balance_100_max_over_mean" in capsys.readouterr().out


def test_cli_rejects_mismatched_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "move", "--nodes", "100,200", "--keys", "300"]) == 1
    assert "--keys names 1 counts" in capsys.readouterr().err
