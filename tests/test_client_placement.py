"""Writes that survive down holders, and reads that find shards wherever they were written,
through the in-process transport (real stores and handlers, no sockets)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache.client import Client, ClientConfig
from kvcache.client.local import LocalNode, LocalTransport
from kvcache.client.matching import held_shards
from kvcache.client.plan import best_counts
from kvcache.client.transport import Exchange
from kvcache.cluster import ClusterMap, NodeInfo, NodeState
from kvcache.credentials import tenant_id
from kvcache.errors import NodeError
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.membership.model import Membership
from kvcache.server.handler import RequestHandler
from kvcache.server.metrics import Metrics
from kvcache.server.store import ShardStore
from kvcache.wire import Op, make_items
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
P = LAYOUT.payload_bytes
NS = Namespace(model="placement", revision="1", layout=LAYOUT)
T = tenant_id("default")


class Nodes:
    """``count`` in-process nodes; a client's map may name any subset of them."""

    def __init__(self, root: Path, count: int) -> None:
        self.infos = tuple(
            NodeInfo(id=f"node-{i:02d}", data=f"tcp://127.0.0.1:{21000 + i}") for i in range(count)
        )
        self.stores = [ShardStore(root / f"n{i}", capacity_bytes=256 << 20) for i in range(count)]
        self.nodes = [
            LocalNode(RequestHandler(s, Metrics(), node_id=f"node-{i:02d}", tenant_names={T: "d"}))
            for i, s in enumerate(self.stores)
        ]
        self.transports: list[LocalTransport] = []
        self.root = root

    def map(self, count: int, epoch: int = 1) -> ClusterMap:
        return ClusterMap(epoch=epoch, nodes=self.infos[:count])

    def client(self, cluster: ClusterMap, **overrides: object) -> Client:
        transport = LocalTransport(self.infos, self.nodes, tenant=T)
        self.transports.append(transport)
        config = ClientConfig(cluster_file=self.root / "unused.toml", **overrides)  # type: ignore[arg-type]
        return Client(config, cluster=cluster, transport=transport)

    def shards_on(self, i: int) -> int:
        return int(self.stores[i].usage()["shards"])

    def close(self) -> None:
        for t in self.transports:
            t.close()
        for s in self.stores:
            s.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    made = Nodes(tmp_path, 16)
    yield made
    made.close()


def prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 64).astype(np.uint32)


def payloads(tokens: np.ndarray) -> list[np.ndarray]:
    return [payload_for_key(k, P) for k in block_keys(NS, tokens)]


def identical(client: Client, tokens: np.ndarray) -> int:
    result = client.load_prefix(NS, tokens)
    for got, want in zip(result.payloads, payloads(tokens), strict=False):
        assert np.array_equal(got, want)
    return result.blocks


def shard_count(client: Client, tokens: np.ndarray) -> list[int]:
    """Shards of the best stripe per block found by asking every node a reader asks
    (a HAS round that waits for all 12 shards instead of settling at k)."""
    keys = block_keys(NS, tokens)
    held = held_shards(client.core, keys, settle=12)
    return best_counts(held, len(keys), n=12).tolist()


def test_twelve_nodes_two_dead_writes_go_on(nodes: Nodes) -> None:
    """Exactly 12 nodes, 2 dead: a store puts all 12 shards on the 10 live nodes (two of
    them hold two), quorum 11 as always; the blocks load byte-identical, and still do when
    the dead nodes come back."""
    tokens = prompt(10, 1)
    with nodes.client(nodes.map(12)) as client:
        nodes.nodes[0].kill()
        nodes.nodes[1].kill()
        stored = client.store(NS, tokens, payloads(tokens))
        assert (stored.written, stored.failed) == (10, 0)
        assert nodes.shards_on(0) == nodes.shards_on(1) == 0
        assert sum(nodes.shards_on(i) for i in range(2, 12)) == 10 * 12
        assert client.counters["shards_redirected"] >= 10 * 2  # some twice: 0 to 1, then on
        assert identical(client, tokens) == 10
        nodes.nodes[0].dead = nodes.nodes[1].dead = False
    with nodes.client(nodes.map(12)) as fresh:
        assert shard_count(fresh, tokens) == [12] * 10
        assert identical(fresh, tokens) == 10


def test_more_than_twelve_nodes_down_holders_spill_to_the_next_nodes(nodes: Nodes) -> None:
    """14 nodes, 2 dead: the dead holders' shards go to the keys' next nodes in rendezvous
    order, so every block has 12 distinct holders; a reader finds all 12 shards, also
    after the dead nodes come back (it asks the spill nodes too)."""
    tokens = prompt(12, 2)
    with nodes.client(nodes.map(14)) as client:
        nodes.nodes[3].kill()
        nodes.nodes[9].kill()
        stored = client.store(NS, tokens, payloads(tokens))
        assert stored.written == 12
        assert nodes.shards_on(3) == nodes.shards_on(9) == 0
        assert shard_count(client, tokens) == [12] * 12
        assert identical(client, tokens) == 12
    nodes.nodes[3].dead = nodes.nodes[9].dead = False
    with nodes.client(nodes.map(14)) as reader:
        assert shard_count(reader, tokens) == [12] * 12
        assert identical(reader, tokens) == 12


class PutsFail(LocalTransport):
    """Nodes in ``failing`` answer everything but PUT, which fails as a dead node's would
    (a daemon that died between a store's HAS and its PUT)."""

    failing: frozenset[int] = frozenset()

    def submit(self, exchange: Exchange) -> None:
        if exchange.op is Op.PUT and exchange.node in self.failing:
            exchange.finish(None, NodeError("connection refused", node=f"node-{exchange.node}"))
            return
        super().submit(exchange)


def test_a_node_that_fails_during_the_put_is_sent_around(nodes: Nodes) -> None:
    """The client believes three nodes are up (they answered its HAS) when their PUTs
    fail: their shards go on to other nodes within the same round and the blocks are
    written with 12 shards."""
    tokens = prompt(6, 3)
    transport = PutsFail(nodes.infos, nodes.nodes, tenant=T)
    transport.failing = frozenset({5, 6, 7})
    nodes.transports.append(transport)
    config = ClientConfig(cluster_file=nodes.root / "unused.toml")
    with Client(config, cluster=nodes.map(12), transport=transport) as client:
        result = client.store(NS, tokens, payloads(tokens))
        assert (result.written, result.failed) == (6, 0)
        assert nodes.shards_on(5) == nodes.shards_on(6) == nodes.shards_on(7) == 0
        assert client.counters["shards_redirected"] >= 6 * 3
        assert shard_count(client, tokens) == [12] * 6
        assert identical(client, tokens) == 6


def test_put_round_redirects_a_failed_node(nodes: Nodes) -> None:
    """PutRound alone: a node fails, its shards are re-sent to the respill target."""
    from kvcache.client.rounds import PutRound

    holders = np.array([[0, 1, 2, 3]], np.int64)
    round_ = PutRound(
        holders,
        np.ones(6, bool),
        min_write=3,
        hedge_s=0.01,
        timeout_s=1.0,
        respill=lambda b, row, failed: 4 if 4 not in row else 5,
        redirect_limit=1,
    )
    sends = {s.node: s for s in round_.start(0.0)}
    round_.on_reply(sends[0].ticket, np.array([True]), 0.001)
    again = round_.on_failure(sends[1].ticket, 0.002)
    assert [(s.node, s.indices.tolist()) for s in again] == [(4, [1])]
    assert round_.holders.tolist() == [[0, 4, 2, 3]]
    # The budget of one redirect is spent: a second failure is not redirected.
    assert round_.on_failure(sends[2].ticket, 0.003) == []
    round_.on_reply(again[0].ticket, np.array([True]), 0.004)
    round_.on_reply(sends[3].ticket, np.array([True]), 0.005)
    assert round_.written.tolist() == [True]


def test_too_many_down_holders_fail_cleanly(nodes: Nodes) -> None:
    """Five of 12 down: more than max_redirect (4) shards would be off their holders, so no
    block is written (and nothing is left behind)."""
    tokens = prompt(4, 4)
    with nodes.client(nodes.map(12)) as client:
        for i in range(5):
            nodes.nodes[i].kill()
        client.match_prefix(NS, tokens)  # discovers the dead nodes
        stored = client.store(NS, tokens, payloads(tokens))
        assert (stored.written, stored.failed) == (0, 4)
        assert sum(nodes.shards_on(i) for i in range(12)) == 0


def test_a_join_keeps_every_hit(nodes: Nodes) -> None:
    """Blocks written on 12 nodes; a 13th joins (a new map): every block is still a hit with
    12 shards found (the holder that left the set is asked as a previous holder), and a
    store after the join only touches them."""
    tokens = prompt(30, 5)
    with nodes.client(nodes.map(12)) as client:
        assert client.store(NS, tokens, payloads(tokens)).written == 30
        client.core.topology.update(Membership(nodes.map(13, epoch=2)))
        assert client.core.view().epoch == 2
        assert shard_count(client, tokens) == [12] * 30
        assert identical(client, tokens) == 30
        again = client.store(NS, tokens, payloads(tokens))
        assert (again.written, again.touched) == (0, 30)
        assert client.counters["map_changes"] == 1


def test_without_history_a_join_costs_at_most_one_shard_per_block(nodes: Nodes) -> None:
    """A client that never saw the old map (started after the join): each block lost at most
    the one shard on the node that left its holder set (and usually not even that: the
    displaced holder is the key's next node in rendezvous order, which readers ask as a
    spill node), so it is still a hit."""
    tokens = prompt(30, 6)
    with nodes.client(nodes.map(12)) as client:
        client.store(NS, tokens, payloads(tokens))
    with nodes.client(nodes.map(13, epoch=2)) as late:
        counts = shard_count(late, tokens)
        assert min(counts) >= 11
        assert identical(late, tokens) == 30


def test_a_drained_node_is_still_read_but_gets_no_writes(nodes: Nodes) -> None:
    tokens = prompt(8, 7)
    later = prompt(8, 8)
    with nodes.client(nodes.map(12)) as client:
        client.store(NS, tokens, payloads(tokens))
    infos = list(nodes.infos[:13])
    infos[4] = NodeInfo(id=infos[4].id, data=infos[4].data, state=NodeState.DRAIN)
    drained = ClusterMap(epoch=2, nodes=tuple(infos))
    before = nodes.shards_on(4)
    with nodes.client(drained) as client:
        assert shard_count(client, tokens) == [12] * 8
        assert identical(client, tokens) == 8
        assert client.store(NS, later, payloads(later)).written == 8
        assert nodes.shards_on(4) == before


def test_touch_and_delete_reach_spilled_shards(nodes: Nodes) -> None:
    tokens = prompt(5, 9)
    with nodes.client(nodes.map(14)) as client:
        nodes.nodes[2].kill()
        assert client.store(NS, tokens, payloads(tokens)).written == 5
        nodes.nodes[2].dead = False
    with nodes.client(nodes.map(14)) as client:
        assert client.touch(NS, tokens) == 5
        assert client.delete(NS, tokens) == 5
        assert sum(nodes.shards_on(i) for i in range(14)) == 0


def test_has_reply_lists_every_index_a_node_holds(nodes: Nodes) -> None:
    """The property reads rely on: HAS names every index of a key a node holds, so a node
    holding two shards of a block (12 nodes, two down) is found holding both."""
    tokens = prompt(1, 10)
    key = block_keys(NS, tokens)[0]
    with nodes.client(nodes.map(12)) as client:
        nodes.nodes[0].kill()
        nodes.nodes[1].kill()
        client.store(NS, tokens, payloads(tokens))
    items = make_items(Op.HAS, 1, reply=False)
    items["key"] = np.frombuffer(key, "V16")
    held = [nodes.stores[i].has(T, items)["index"].tolist() for i in range(2, 12)]
    assert sorted(len(h) for h in held) == [1] * 8 + [2] * 2


def _reference_read_rows(view, keys, targets):  # type: ignore[no-untyped-def]
    """The rule of ClusterView.read_rows, one row at a time."""
    extra = [view.order(keys)]
    for placement, u in zip(view._others, view._u_others, strict=True):
        extra.append(u[placement.holders(keys)])
    both = np.concatenate(extra, axis=1)
    rows = []
    for b in range(len(keys)):
        row = targets[b].tolist()
        for x in both[b].tolist():
            if x >= 0 and x not in row:
                row.append(x)
        rows.append(row)
    out = np.full((len(keys), max(len(r) for r in rows)), -1, np.int64)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out


@pytest.mark.parametrize(
    "count, changes", [(5, True), (12, True), (16, True), (5, False), (12, False), (16, False)]
)
def test_read_rows_vectorised_equals_the_rule(count: int, changes: bool) -> None:
    from kvcache.client.view import Topology

    rng = np.random.default_rng(count)
    nodes = tuple(
        NodeInfo(id=f"n{i:02d}", data=f"tcp://127.0.0.1:{7000 + i}") for i in range(count)
    )
    known: list[NodeInfo] = []

    def add(node: NodeInfo) -> int:
        known.append(node)
        return len(known) - 1

    topo = Topology(
        Membership(ClusterMap(epoch=1, nodes=nodes)),
        width=12,
        min_write=11,
        nodes=lambda: tuple(known),
        add_node=add,
        clock=lambda: 0.0,
    )
    if changes:  # a join and a drain: kept maps and drained nodes add columns
        joined = (*nodes, NodeInfo(id="n99", data="tcp://127.0.0.1:7999"))
        topo.update(Membership(ClusterMap(epoch=2, nodes=joined)))
        drained = tuple(
            NodeInfo(id=n.id, data=n.data, state=NodeState.DRAIN) if n.id == "n01" else n
            for n in joined
        )
        topo.update(Membership(ClusterMap(epoch=3, nodes=drained)))
    view = topo.view()
    keys = [BlockKey(rng.bytes(16)) for _ in range(200)]
    for down in (0, 2):
        up = np.ones(len(view.nodes), bool)
        up[rng.choice(len(view.nodes), down, replace=False)] = False
        targets = view.targets(keys, up)[0]
        assert np.array_equal(
            view.read_rows(keys, targets), _reference_read_rows(view, keys, targets)
        )
