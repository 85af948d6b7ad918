"""Placement: deterministic, balanced, domain-aware, minimal movement; cluster map parsing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cluster import ClusterMap, NodeInfo, NodeState
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey
from kvcache.placement import Placement, holders_for


def cmap(n: int, *, domains: int | None = None, weights: list[float] | None = None) -> ClusterMap:
    return ClusterMap(
        epoch=1,
        nodes=tuple(
            NodeInfo(
                id=f"node-{i:02d}",
                data=f"tcp://127.0.0.1:{7000 + i}",
                domain=f"rack-{i % domains}" if domains else "",
                weight=weights[i] if weights else 1.0,
            )
            for i in range(n)
        ),
    )


def keys(count: int, seed: int = 0) -> list[BlockKey]:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(count, 16), dtype=np.uint8)
    return [BlockKey(r.tobytes()) for r in raw]


def test_deterministic_and_distinct() -> None:
    p = Placement(cmap(16), width=12)
    ks = keys(500)
    a, b = p.holders(ks), Placement(cmap(16), width=12).holders(ks)
    assert (a == b).all()
    assert all(len(set(row.tolist())) == 12 for row in a)


def test_pinned_placement() -> None:
    # Placement decides where data lives: a change strands every stored block.
    key = BlockKey(bytes(range(16)))
    got = [n.id for n in holders_for(cmap(14), key, width=12)]
    assert got == PINNED


PINNED = [
    "node-05", "node-11", "node-13", "node-06", "node-02", "node-07",
    "node-12", "node-03", "node-04", "node-08", "node-10", "node-00",
]  # fmt: skip


def test_load_within_ten_percent_over_100k_keys() -> None:
    nodes = 20
    p = Placement(cmap(nodes), width=12)
    counts = np.bincount(p.holders(keys(100_000)).ravel(), minlength=nodes)
    mean = counts.mean()
    assert np.abs(counts - mean).max() <= 0.10 * mean, counts


def test_weights_shift_load() -> None:
    weights = [2.0] + [1.0] * 19
    p = Placement(cmap(20, weights=weights), width=1)
    counts = np.bincount(p.holders(keys(50_000)).ravel(), minlength=20)
    ratio = counts[0] / counts[1:].mean()
    assert 1.7 < ratio < 2.3


@settings(derandomize=True, max_examples=25, deadline=None)
@given(st.integers(13, 30), st.integers(0, 10_000))
def test_adding_a_node_moves_only_keys_that_rank_it(n: int, seed: int) -> None:
    ks = keys(2000, seed)
    before = Placement(cmap(n), width=12)
    after = Placement(cmap(n + 1), width=12)
    old, new = before.holders(ks), after.holders(ks)
    new_index = n  # the added node is last
    for o, nw in zip(old, new, strict=True):
        if new_index not in nw:
            assert [before.nodes[i].id for i in o] == [after.nodes[i].id for i in nw]
        else:
            # Only the new node entered; the others keep their relative order.
            kept = [after.nodes[i].id for i in nw if i != new_index]
            assert kept == [before.nodes[i].id for i in o][: len(kept)]


def test_failure_domains_first() -> None:
    p = Placement(cmap(24, domains=6), width=12)
    domains = [n.domain for n in p.nodes]
    for row in p.holders(keys(300)):
        first = [domains[i] for i in row[:6]]
        assert len(set(first)) == 6


def test_fewer_nodes_than_width_wraps() -> None:
    p = Placement(cmap(3), width=12)
    rows = p.holders(keys(10))
    assert rows.shape == (10, 12)
    assert all(set(r.tolist()) == {0, 1, 2} for r in rows)


def test_out_nodes_get_no_placements() -> None:
    base = cmap(13)
    nodes = list(base.nodes)
    nodes[0] = NodeInfo(id=nodes[0].id, data=nodes[0].data, state=NodeState.OUT)
    p = Placement(ClusterMap(epoch=2, nodes=tuple(nodes)), width=12)
    assert "node-00" not in [n.id for n in p.nodes]


def test_cluster_file_round_trip(tmp_path: Path) -> None:
    m = cmap(4, domains=2)
    path = tmp_path / "cluster.toml"
    path.write_text(m.to_toml())
    assert ClusterMap.load(path) == m


@pytest.mark.parametrize(
    "text",
    [
        "epoch = 1\n",
        'epoch = 1\n[[nodes]]\nid = "a"\n',
        'epoch = 1\n[[nodes]]\nid = "a"\ndata = "http://x"\n',
        'epoch = 1\n[[nodes]]\nid = "a"\ndata = "tcp://x:1"\n[[nodes]]\nid = "a"\ndata = "tcp://x:2"\n',
        'epoch = 1\n[[nodes]]\nid = "a"\ndata = "tcp://x:1"\nstate = "maybe"\n',
        'epoch = 1\n[[nodes]]\nid = "a"\ndata = "tcp://x:1"\ncolour = "red"\n',
        "not toml [",
    ],
)
def test_bad_cluster_files(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        ClusterMap.load(path)


def test_missing_cluster_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ClusterMap.load(tmp_path / os.urandom(4).hex())
