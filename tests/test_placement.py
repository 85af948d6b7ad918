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
from kvcache.placement import (
    Placement,
    holders_for,
    max_redirect,
    write_targets,
    write_targets_many,
)


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


# Sequential per-position rendezvous (kvcache:position:v1), since issue 10; by the key's
# placement tag (its first 4 bytes, block keys v2), its shards turned by its bytes 4..7
# (here by 4), since issue 21.
PINNED = [
    "node-00", "node-11", "node-02", "node-08", "node-09", "node-07",
    "node-04", "node-13", "node-03", "node-10", "node-05", "node-06",
]  # fmt: skip


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    tag=st.binary(min_size=4, max_size=4),
    rests=st.lists(st.binary(min_size=12, max_size=12), min_size=1, max_size=20),
    nodes=st.integers(1, 60),
)
def test_only_the_placement_tag_places_a_key(tag: bytes, rests: list[bytes], nodes: int) -> None:
    """Keys that share their first 4 bytes (a placement group's) have the same holders and
    spill positions; each key's shards are its group's holders turned by its rotation;
    whatever rows were cached before."""
    ks = [BlockKey(tag + rest) for rest in rests]
    p = Placement(cmap(nodes), width=12)
    before = p.order(keys(50, seed=nodes))  # other tags in the cache first
    rows = p.order(ks)
    turns = p.rotations(ks)
    assert ((turns >= 0) & (turns < 12)).all()
    # Turned back, every key's row is the group's.
    back = np.take_along_axis(rows[:, :12], (np.arange(12)[None, :] - turns[:, None]) % 12, axis=1)
    assert (back == back[0]).all()
    assert (rows[:, 12:] == rows[0, 12:]).all()
    fresh = Placement(cmap(nodes), width=12)
    assert (fresh.order(ks[-1:]) == rows[-1]).all()
    assert (fresh.order(keys(50, seed=nodes)) == before).all()


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    tags=st.lists(st.binary(min_size=4, max_size=4), min_size=1, max_size=4),
    picks=st.lists(st.tuples(st.integers(0, 3), st.binary(min_size=12, max_size=12)), max_size=40),
    nodes=st.integers(1, 30),
)
def test_a_batch_of_several_groups_places_each_key_as_alone(
    tags: list[bytes], picks: list[tuple[int, bytes]], nodes: int
) -> None:
    """A batch whose keys come from several groups, in any order, some cached and some
    not, gets for each key the row it gets alone; :meth:`positions` turned by the key's
    rotation is that row."""
    ks = [BlockKey(tags[i % len(tags)] + rest) for i, rest in picks]
    p = Placement(cmap(nodes), width=12)
    p.order(ks[: len(ks) // 2])  # half the groups cached beforehand
    rows = p.order(ks)
    alone = Placement(cmap(nodes), width=12)
    expected = np.array([alone.order([k])[0] for k in ks]).reshape(len(ks), p.depth)
    assert np.array_equal(rows, expected)
    turns = p.rotations(ks)
    turned = p.positions(ks)
    turned[:, :12] = np.take_along_axis(
        turned[:, :12], (np.arange(12)[None, :] + turns[:, None]) % 12, axis=1
    )
    assert np.array_equal(rows, turned)
    assert np.array_equal(p.order(ks, 5), rows[:, :5])


def test_a_prompts_groups_spread_over_the_cluster() -> None:
    """A 1,024-block prompt of 112 KiB blocks (16 groups of 64) asks 12 nodes a group,
    and its groups together cover most of a 48-node cluster."""
    from kvcache.keys import Namespace, block_keys
    from kvcache.layout import DType, KVLayout

    layout = KVLayout(
        tokens_per_block=128, bytes_per_token=896, dtype=DType.BFLOAT16, layers_in_block=1
    )
    ns = Namespace(model="m", revision="r", layout=layout)
    ks = block_keys(ns, np.arange(1024 * 128, dtype=np.uint32))
    rows = Placement(cmap(48), width=12).holders(ks)
    for g in range(16):
        group = rows[64 * g : 64 * (g + 1)]
        assert len({frozenset(r) for r in group.tolist()}) == 1
        # Its data shards (0..9) are spread over all 12 holders, not kept on 10.
        assert len(set(group[:, :10].ravel().tolist())) == 12
    assert len(set(rows[:64].ravel().tolist())) == 12
    assert len(set(rows.ravel().tolist())) >= 40


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
@given(st.integers(12, 30), st.integers(0, 10_000))
def test_adding_a_node_moves_only_what_it_wins(n: int, seed: int) -> None:
    """Each position keeps its node, or goes to the new node, or to the one node the
    new node displaced (a node the old placement had put at an earlier position); so
    the set of holders changes by at most one node in and one out."""
    ks = keys(2000, seed)
    before = Placement(cmap(n), width=12)
    after = Placement(cmap(n + 1), width=12)
    old = np.array(before.ids)[before.positions(ks)[:, :12]]
    new = np.array(after.ids)[after.positions(ks)[:, :12]]
    added = f"node-{n:02d}"
    for o, nw in zip(old.tolist(), new.tolist(), strict=True):
        assert len(set(nw) - set(o)) <= 1 and len(set(o) - set(nw)) <= 1
        assert set(nw) - set(o) <= {added}
        for p, (was, now) in enumerate(zip(o, nw, strict=True)):
            assert now in (was, added) or now in o[:p], (p, o, nw)


@pytest.mark.parametrize(("n", "bound"), [(12, 2.5), (16, 1.5), (24, 0.9)])
def test_a_join_remaps_few_shards(n: int, bound: float) -> None:
    # Rank order ("shard i to the i-th best node") remapped 6.0, 4.6 and 3.1 per key here.
    ks = keys(3000, 7)
    a, b = Placement(cmap(n), width=12), Placement(cmap(n + 1), width=12)
    old = np.array(a.ids)[a.holders(ks)]
    new = np.array(b.ids)[b.holders(ks)]
    assert (old != new).sum(axis=1).mean() <= bound


def test_failure_domains_balanced() -> None:
    p = Placement(cmap(24, domains=6), width=12)
    domains = np.array([n.domain for n in p.nodes])
    ks = keys(300)
    for row, held in zip(p.positions(ks)[:, :12], p.holders(ks), strict=True):
        assert sorted(row.tolist()) == sorted(held.tolist())  # the same nodes, turned
        assert len(set(domains[row[:6]].tolist())) == 6
        assert sorted(np.unique(domains[row], return_counts=True)[1].tolist()) == [2] * 6


def test_hosts_as_domains_four_by_three() -> None:
    # 4 hosts of 3 daemons: every host holds exactly 3 shards of every block, so losing
    # a host and one more daemon loses at most 4 shards (an 8+4 stripe survives it).
    p = Placement(cmap(12, domains=4), width=12)
    domains = np.array([n.domain for n in p.nodes])
    for row in p.holders(keys(300)):
        assert sorted(np.unique(domains[row], return_counts=True)[1].tolist()) == [3] * 4


def test_fewer_nodes_than_width_wraps_evenly() -> None:
    p = Placement(cmap(3), width=12)
    rows = p.holders(keys(10))
    assert rows.shape == (10, 12)
    assert all(np.bincount(r, minlength=3).tolist() == [4, 4, 4] for r in rows)


def test_spill_positions_continue_the_order() -> None:
    p = Placement(cmap(20), width=12, spill=4)
    order = p.order(keys(200))
    assert order.shape == (200, 16)
    assert all(len(set(r.tolist())) == 16 for r in order)
    assert (order[:, :12] == p.holders(keys(200))).all()


def test_out_and_drain_nodes_get_no_placements() -> None:
    base = cmap(14)
    nodes = list(base.nodes)
    nodes[0] = NodeInfo(id=nodes[0].id, data=nodes[0].data, state=NodeState.OUT)
    nodes[1] = NodeInfo(id=nodes[1].id, data=nodes[1].data, state=NodeState.DRAIN)
    m = ClusterMap(epoch=2, nodes=tuple(nodes))
    ids = [n.id for n in Placement(m, width=12).nodes]
    assert "node-00" not in ids and "node-01" not in ids
    readers = [n.id for n in Placement(m, width=12, states=(NodeState.UP, NodeState.DRAIN)).nodes]
    assert "node-01" in readers and "node-00" not in readers


# ---------------------------------------------------------------------- write targets


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    st.integers(10, 24),
    st.integers(0, 3),
    st.data(),
)
def test_write_targets_rules(nodes: int, domains: int, data: st.DataObject) -> None:
    width, limit = 12, 4
    p = Placement(cmap(nodes, domains=domains or None), width=width)
    key = keys(1, data.draw(st.integers(0, 10_000)))
    order = p.order(key)[0].tolist()
    down = data.draw(st.sets(st.integers(0, nodes - 1), max_size=6))
    live = [i not in down for i in range(nodes)]
    targets, moved = write_targets(order, live, p.domain_of, width=width, limit=limit)
    holders = order[:width]
    assert moved == sum(not live[h] for h in holders)
    if moved > limit or not any(live):
        assert targets == [-1] * width
        return
    assert all(t >= 0 and live[t] for t in targets)
    # Shards of live holders stay; the others are the only ones that move.
    assert [i for i in range(width) if targets[i] != holders[i]] == [
        i for i in range(width) if not live[holders[i]]
    ]
    spill = [x for x in order[width:] if live[x] and x not in holders]
    if len(spill) >= moved:
        # Enough spill nodes: the next ones in rendezvous order, in shard order, all distinct.
        moved_to = [targets[i] for i in range(width) if not live[holders[i]]]
        assert moved_to == spill[:moved]
        assert len(set(targets)) == min(width, nodes)
    else:
        # Not enough distinct live nodes: shards pile up evenly on the live ones.
        counts = np.bincount(targets, minlength=nodes)[[i for i in range(nodes) if live[i]]]
        assert counts.max() - counts.min() <= 1


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    st.integers(3, 24),
    st.integers(0, 4),
    st.sampled_from([0, 2, 4]),
    st.integers(0, 6),
    st.data(),
)
def test_write_targets_many_equals_write_targets(
    nodes: int, domains: int, spill: int, limit: int, data: st.DataObject
) -> None:
    """The columnar placement of a batch makes exactly the per-key choices, row by row:
    unaddressable (-1) entries, refusals, spills, doubling up, domains, no live node."""
    width = 12
    p = Placement(cmap(nodes, domains=domains or None), width=width, spill=spill)
    order = p.order(keys(data.draw(st.integers(1, 40)), data.draw(st.integers(0, 10_000))))
    if data.draw(st.booleans()):  # nodes the caller cannot address
        holes = data.draw(st.lists(st.integers(0, order.size - 1), max_size=6))
        order.reshape(-1)[holes] = -1
    down = data.draw(st.sets(st.integers(0, nodes - 1), max_size=nodes))
    live = np.array([i not in down for i in range(nodes)])
    got, moved = write_targets_many(order, live, p.domain_of, width=width, limit=limit)
    for row, got_row, got_moved in zip(order.tolist(), got.tolist(), moved.tolist(), strict=True):
        want, want_moved = write_targets(row, live.tolist(), p.domain_of, width=width, limit=limit)
        assert (got_row, got_moved) == (want, want_moved)


def test_twelve_nodes_two_down_doubles_up_two_live_nodes() -> None:
    p = Placement(cmap(12), width=12)
    for key in keys(50, 3):
        order = p.order([key])[0].tolist()
        live = [i not in (0, 1) for i in range(12)]
        targets, moved = write_targets(order, live, p.domain_of, width=12, limit=4)
        assert moved == 2
        counts = np.bincount(targets, minlength=12)
        assert counts[0] == counts[1] == 0
        assert sorted(counts[2:].tolist()) == [1] * 8 + [2] * 2


def test_four_hosts_one_down_plus_one_stays_balanced() -> None:
    # Host 0 (nodes 0, 4, 8) and node 1 down: the 12 shards go to the 8 live daemons,
    # no host gets more than 4.
    p = Placement(cmap(12, domains=4), width=12)
    host = np.array([int(n.domain[-1]) for n in p.nodes])
    down = {0, 4, 8, 1}
    for key in keys(100, 5):
        order = p.order([key])[0].tolist()
        live = [i not in down for i in range(12)]
        targets, moved = write_targets(order, live, p.domain_of, width=12, limit=4)
        assert moved == 4 and min(targets) >= 0 and not set(targets) & down
        assert np.bincount(host[targets], minlength=4).max() <= 4


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.integers(1, 30), st.integers(0, 30))
def test_max_redirect_keeps_two_writers_apart(k: int, m: int) -> None:
    # Two writers each send at most max_redirect shards off their holders, so their
    # targets differ in at most 2 * max_redirect indices, and both reaching q needs
    # 2 q <= n + d: impossible for every quorum q in k..n when q > n / 2.
    n = k + m
    for q in range(k, n + 1):
        r = max_redirect(n=n, min_write=q)
        assert r >= 0
        if 2 * q > n:
            assert 2 * q > n + 2 * r
    assert max_redirect(n=12, min_write=11) == 4
    assert max_redirect(n=12, min_write=10) == 3


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.integers(12, 20), st.data())
def test_two_views_of_liveness_differ_in_few_slots(nodes: int, data: st.DataObject) -> None:
    """Writers with different views of which nodes are down place each shard index on
    the same node except for at most 2 * limit indices: the racing-writer bound."""
    p = Placement(cmap(nodes), width=12)
    order = p.order(keys(1, data.draw(st.integers(0, 999))))[0].tolist()
    views = [data.draw(st.sets(st.integers(0, nodes - 1), max_size=5)) for _ in range(2)]
    got = []
    for down in views:
        live = [i not in down for i in range(nodes)]
        got.append(write_targets(order, live, p.domain_of, width=12, limit=4)[0])
    a, b = got
    if -1 in a or -1 in b:
        return
    assert sum(x != y for x, y in zip(a, b, strict=True)) <= 8


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


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 20),
    st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=40),
    st.integers(0, 6),
)
def test_one_domain_per_node_shortcut_matches_the_general_rule(
    count: int, keys: list[bytes], spill: int
) -> None:
    nodes = tuple(
        NodeInfo(id=f"n{i}", data=f"tcp://127.0.0.1:{7000 + i}", weight=1.0 + (i % 3))
        for i in range(count)
    )
    placement = Placement(ClusterMap(epoch=1, nodes=nodes), width=12, spill=spill)
    block_keys = [BlockKey(k) for k in keys]
    fast = placement._compute(block_keys)
    assert np.array_equal(fast, placement._compute(block_keys, general=True))
    # The cached rows are the computed ones.
    assert np.array_equal(placement.positions(block_keys), fast)
    assert np.array_equal(placement.positions(block_keys), fast)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 20), st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=30))
def test_equal_weights_order_by_the_rendezvous_scores(count: int, keys: list[bytes]) -> None:
    """With one weight, placement compares hash bits instead of -w / ln(u): the same order
    as the scores themselves (checked against :meth:`Placement.scores`, position by
    position, each node taken once per round)."""
    nodes = tuple(NodeInfo(id=f"n{i}", data=f"tcp://127.0.0.1:{7000 + i}") for i in range(count))
    placement = Placement(ClusterMap(epoch=1, nodes=nodes), width=12)
    block_keys = [BlockKey(k) for k in keys]
    got = placement.positions(block_keys)
    for b, key in enumerate(block_keys):
        taken: set[int] = set()
        for p in range(placement.depth):
            if len(taken) == count:
                taken = set()
            scores = placement.scores([key], p)[0]
            best = max((x for x in range(count) if x not in taken), key=lambda x: scores[x])
            assert got[b, p] == best
            taken.add(best)


def test_pair_scores_are_the_entries_of_scores() -> None:
    nodes = tuple(
        NodeInfo(id=f"n{i}", data="tcp://127.0.0.1:1", weight=1.0 + i % 3) for i in range(20)
    )
    placement = Placement(ClusterMap(epoch=1, nodes=nodes), width=12)
    rng = np.random.default_rng(3)
    block_keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(50)]
    which = rng.integers(0, 20, 50)
    for position in (0, 5, 15):
        full = placement.scores(block_keys, position)
        pairs = placement.pair_scores(block_keys, which, position)
        assert np.array_equal(pairs, full[np.arange(50), which])
