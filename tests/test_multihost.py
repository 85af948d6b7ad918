"""Several hosts, for real: 4 hosts × 3 daemons, the host as failure domain.

Hosts are network namespaces this test makes (``kvcache.testing.hosts``: one
``ip netns`` per host, veth pairs on a bridge with a private /24, root as in
CI); where namespaces cannot be made, each host is a loopback address
(127.0.0.10+h) and the test says so in its output and in the report property
``host_network``. Each daemon's node in the cluster file carries its real
address and ``domain = "host-<h>"``.

**Why 8 + 4 and not the default 10 + 2.** Placement spreads a block's n = 12
shards as evenly as it can over nodes and then over failure domains: with 12
nodes, every node holds one shard, so each of the 4 hosts holds exactly 3.
Losing a host therefore loses 3 shards of *every* block, and one more daemon
elsewhere a 4th. 10 + 2 tolerates 2: under it a host loss makes every block
unreadable. Surviving "a host plus one daemon" needs m >= 3 + 1 = 4, so this
cluster runs k = 8, m = 4 (the clients' ``k``/``m``; shard headers carry them,
daemons need no setting). Writes keep going with ``min_write_shards = 11``:
the 4 shards of down holders are redirected to live nodes, within the
redirect limit ``max_redirect(n=12, q=11) = 4`` (``kvcache.placement``).
``docs/multihost.md`` has the general rule.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvcache.cli import main
from kvcache.client import Client
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.placement import Placement
from kvcache.server.probe import Probe
from kvcache.testing import HostCluster, HostNet, HostNetMode, cleanup_stale
from kvcache.workload import payload_for_key

log = logging.getLogger(__name__)

HOSTS, PER_HOST = 4, 3
K, M = 8, 4
N = K + M
DEAD_HOST = 2
#: The one more daemon that dies with the host: host 0's second daemon.
EXTRA_DEAD = (0, 1)
PROMPTS, BLOCKS = 40, 3
NEW_PROMPTS = 10
LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
P = LAYOUT.payload_bytes  # 112 KiB
SPACE = Namespace(model="multihost", revision="1", layout=LAYOUT)
#: Client settings: 8 + 4 (module docstring), a short timeout so a silent host costs
#: little, and down nodes skipped for the whole test once found.
CLIENT = {"k": K, "m": M, "min_write_shards": 11, "timeout_s": 1.0, "down_retry_s": 120.0}


def prompt(seed: int, blocks: int = BLOCKS) -> np.ndarray:
    rng = np.random.default_rng([7, seed])
    return rng.integers(0, 50_000, blocks * 64 + 5).astype(np.uint32)


def keys_of(tokens: np.ndarray) -> list[BlockKey]:
    return block_keys(SPACE, tokens)


def store(client: Client, tokens: np.ndarray) -> tuple[int, int]:
    result = client.store(SPACE, tokens, [payload_for_key(k, P) for k in keys_of(tokens)])
    return result.written + result.touched, result.failed


def load_check(client: Client, prompts: list[np.ndarray]) -> tuple[int, int, int]:
    """(blocks hit, blocks expected, wrong bytes) over ``prompts``."""
    hits = expected = wrong = 0
    for tokens in prompts:
        keys = keys_of(tokens)
        expected += len(keys)
        result = client.load_prefix(SPACE, tokens)
        hits += result.blocks
        for key, got in zip(keys, result.payloads, strict=False):
            wrong += int(np.count_nonzero(got != payload_for_key(key, P)))
    return hits, expected, wrong


@dataclass
class Census:
    """Which (shard index, stripe) each live node holds, per key (asked node by node)."""

    held: dict[str, dict[BlockKey, dict[int, int]]]

    def count(self, node_ids: list[str], keys: list[BlockKey]) -> int:
        return sum(len(self.held.get(n, {}).get(k, {})) for n in node_ids for k in keys)

    def shards(self, key: BlockKey) -> dict[int, set[int]]:
        """Stripe id -> shard indices found anywhere, for one key."""
        out: dict[int, set[int]] = {}
        for per_key in self.held.values():
            for index, stripe in per_key.get(key, {}).items():
                out.setdefault(stripe, set()).add(index)
        return out


def census(cluster: HostCluster, keys: list[BlockKey]) -> Census:
    secret = cluster.credentials().tenant("default")
    assert secret is not None
    held: dict[str, dict[BlockKey, dict[int, int]]] = {}
    for daemon in cluster.daemons:
        if not daemon.running:
            continue
        with Probe(daemon.info.data, tenant="default", secret=secret.secret, timeout_s=5) as p:
            answer = p.has(keys)
        held[daemon.info.id] = {BlockKey(k): v for k, v in answer.items()}
    return Census(held)


@dataclass
class Stored:
    cluster: HostCluster
    net: HostNet
    prompts: list[np.ndarray]
    keys: list[BlockKey]
    #: Blocks the tests wrote while hosts were down (repair must place them too).
    later: list[BlockKey]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stored]:
    """The cluster up on its hosts, the workload stored through the public client."""
    cleanup_stale()
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(HostNet(HOSTS))
        print(f"\nmultihost: {net.note}")
        if net.mode is HostNetMode.LOOPBACK:
            log.warning("multihost test: %s", net.note)
        cluster = HostCluster(
            tmp_path_factory.mktemp("multihost"),
            net,
            per_host=PER_HOST,
            capacity="64MiB",
            client_settings=CLIENT,
        )
        stack.enter_context(cluster)
        cluster.start(timeout_s=60)
        prompts = [prompt(i) for i in range(PROMPTS)]
        with Client(cluster.client_config()) as client:
            for tokens in prompts:
                assert store(client, tokens) == (BLOCKS, 0)
        yield Stored(cluster, net, prompts, [k for t in prompts for k in keys_of(t)], [])


def test_hosts_are_the_failure_domains(stored: Stored, record_property: object) -> None:
    """Every block has its 12 shards, 3 on each host, one per daemon, all of one stripe."""
    record_property("host_network", stored.net.note)  # type: ignore[operator]
    cmap = stored.cluster.cluster_map()
    assert {n.domain for n in cmap.nodes} == {f"host-{h}" for h in range(HOSTS)}
    placement = Placement(cmap, width=N)
    host_of = np.array([int(n.domain.split("-")[1]) for n in placement.nodes])
    per_host = np.stack(
        [(host_of[placement.holders(stored.keys)] == h).sum(axis=1) for h in range(HOSTS)]
    )
    assert (per_host == N // HOSTS).all()
    assert_on_holders(stored.cluster, stored.keys)


def assert_on_holders(cluster: HostCluster, keys: list[BlockKey]) -> None:
    """Every block has one stripe of all N shards, shard i on the key's i-th holder."""
    placement = Placement(cluster.cluster_map(), width=N)
    holders = placement.holders(keys)
    now = census(cluster, keys)
    for b, key in enumerate(keys):
        stripes = now.shards(key)
        assert [len(s) for s in stripes.values()] == [N], key.hex()
        (stripe,) = stripes
        for index in range(N):
            node = placement.nodes[holders[b, index]].id
            assert now.held[node][key].get(index) == stripe, (key.hex(), index, node)


def test_host_loss_plus_one_daemon(stored: Stored) -> None:
    """Kill host 2's daemons and one daemon of host 0 (crashes: 4 of 12 down): reads stay
    byte-identical, writes go on from the first one; host 2 back with its disks: its
    shards are found again."""
    cluster = stored.cluster
    host_nodes = [cluster.daemons[i].info.id for i in cluster.on_host(DEAD_HOST)]
    before = census(cluster, stored.keys).count(host_nodes, stored.keys)
    assert before == len(stored.keys) * (N // HOSTS)
    extra = cluster.on_host(EXTRA_DEAD[0])[EXTRA_DEAD[1]]
    new = [prompt(1000 + i) for i in range(NEW_PROMPTS)]
    new_keys = [k for t in new for k in keys_of(t)]

    cluster.kill_host(DEAD_HOST)
    cluster.kill(extra)
    try:
        with Client(cluster.client_config()) as client:
            hits, expected, wrong = load_check(client, stored.prompts)
            print(f"multihost: host {DEAD_HOST} + 1 daemon killed: {hits}/{expected} hits")
            assert (hits, wrong) == (expected, 0)
            for tokens in new:
                assert store(client, tokens) == (BLOCKS, 0)
            hits, expected, wrong = load_check(client, new)
            assert (hits, wrong) == (expected, 0)
        # The new blocks were written whole: all 12 shards, on the 8 live daemons.
        stored.later.extend(new_keys)
        degraded = census(cluster, new_keys)
        for key in new_keys:
            assert [len(s) for s in degraded.shards(key).values()] == [N]
    finally:
        cluster.restart_host(DEAD_HOST)
        cluster.restart([extra])
    after = census(cluster, stored.keys)
    assert after.count(host_nodes, stored.keys) == before
    for key in stored.keys:
        assert [len(s) for s in after.shards(key).values()] == [N]
    with Client(cluster.client_config()) as client:
        hits, expected, wrong = load_check(client, stored.prompts + new)
        assert (hits, wrong) == (expected, 0)


@contextlib.contextmanager
def partitioned(stored: Stored) -> Iterator[HostCluster]:
    """Host 2 cut off the network (its daemons keep running, silent to clients: no
    resets) and one daemon of host 0 killed; healed and restarted afterwards, and
    host 2 then serves every shard it had."""
    if stored.net.mode is not HostNetMode.NETNS:
        pytest.skip(f"a partition needs network namespaces ({stored.net.note})")
    cluster = stored.cluster
    host_nodes = [cluster.daemons[i].info.id for i in cluster.on_host(DEAD_HOST)]
    before = census(cluster, stored.keys).count(host_nodes, stored.keys)
    extra = cluster.on_host(EXTRA_DEAD[0])[EXTRA_DEAD[1]]
    assert stored.net.partition(DEAD_HOST)
    cluster.kill(extra)
    try:
        yield cluster
    finally:
        stored.net.heal(DEAD_HOST)
        cluster.restart([extra])
    assert census(cluster, stored.keys).count(host_nodes, stored.keys) == before
    with Client(cluster.client_config()) as client:
        hits, expected, wrong = load_check(client, stored.prompts)
        assert (hits, wrong) == (expected, 0)


def test_partitioned_host_reads(stored: Stored) -> None:
    """Host 2 silent + one more daemon down: every read byte-identical from the first one."""
    with partitioned(stored) as cluster, Client(cluster.client_config()) as client:
        hits, expected, wrong = load_check(client, stored.prompts)
        assert (hits, wrong) == (expected, 0)


def test_partitioned_host_writes(stored: Stored) -> None:
    """Host 2 silent + one more daemon down: writes go on once the client has found the
    silent nodes, and what was written loads byte-identical.

    A silent node is only known dead when a request to it times out, and a write
    round ends at that same deadline, so the round that finds it cannot send its
    shards elsewhere (``PutRound`` respills only before its deadline): that first
    store may fail (cleanly: nothing half-written is readable). Every store after
    it must succeed.
    """
    new = [prompt(2000 + i) for i in range(NEW_PROMPTS // 2)]
    with partitioned(stored) as cluster, Client(cluster.client_config()) as client:
        outcomes = [store(client, tokens) for tokens in new]
        failed = [i for i, (_, bad) in enumerate(outcomes) if bad]
        print(f"multihost: host {DEAD_HOST} cut off: stores failed {failed} of {len(new)}")
        hits, _, wrong = load_check(client, [new[i] for i in failed])
        assert wrong == 0
        written = [t for i, t in enumerate(new) if i not in failed]
        hits, expected, wrong = load_check(client, written)
        assert (hits, wrong) == (expected, 0)
        stored.later.extend(k for t in written for k in keys_of(t))
        assert failed in ([], [0])


def test_host_back_with_empty_disks_is_repaired(stored: Stored) -> None:
    """Host 2 back with empty disks: reads still whole; `kvcache repair` restores full
    stripes, every shard on its current holder."""
    cluster = stored.cluster
    cluster.kill_host(DEAD_HOST)
    cluster.restart_host(DEAD_HOST, wipe=True)
    host_nodes = [cluster.daemons[i].info.id for i in cluster.on_host(DEAD_HOST)]
    empty = census(cluster, stored.keys)
    assert empty.count(host_nodes, stored.keys) == 0
    with Client(cluster.client_config()) as client:
        hits, expected, wrong = load_check(client, stored.prompts)
        assert (hits, wrong) == (expected, 0)
    rc = main(
        [
            "repair",
            "--cluster-file",
            str(cluster.cluster_file),
            "--credentials",
            str(cluster.credentials_file),
            # The workers' settings: 8 + 4 stripes.
            "--config",
            str(cluster.client_file),
        ]
    )
    assert rc == 0
    assert_on_holders(cluster, stored.keys + stored.later)


def test_host_network_is_torn_down_and_stale_runs_are_cleaned() -> None:
    """HostNet removes its namespaces and links on close; cleanup_stale removes those of a
    run whose process is gone (pid 4999999 exceeds Linux's pid_max)."""
    with HostNet(2) as net:
        if net.mode is not HostNetMode.NETNS:
            pytest.skip(net.note)
        names = list(net.namespaces)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
        assert net.address(0) != net.address(1)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert net.bridge not in links and net.veth(0) not in links
    stale = "kvh-4999999-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in cleanup_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert stale not in listed
