"""Membership in a real etcd: daemons register under leases, clients watch the map.

Each test starts its own etcd process and 12 (or 13) ``kvcache server``
processes through :class:`LocalCluster` (``kvcache up --etcd``), and talks to
them through the shipped client and the ``kvcache node`` command.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache.cli import main as kvcache_main
from kvcache.client import Client
from kvcache.cluster import NodeState
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.membership.localetcd import etcd_binary
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=512, dtype=DType.BFLOAT16, layers_in_block=4)
P = LAYOUT.payload_bytes
TTL_S = 2

try:
    etcd_binary()
    HAVE_ETCD = True
except Exception:
    HAVE_ETCD = False

pytestmark = pytest.mark.skipif(
    not HAVE_ETCD, reason="etcd is not installed (scripts/install.sh installs etcd-server)"
)


def ns(name: str) -> Namespace:
    return Namespace(model=name, revision="1", layout=LAYOUT)


def prompt(blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, blocks * LAYOUT.tokens_per_block).astype(np.uint32)


def payloads(space: Namespace, tokens: np.ndarray) -> list[np.ndarray]:
    return [payload_for_key(k, P) for k in block_keys(space, tokens)]


def assert_identical(client: Client, space: Namespace, tokens: np.ndarray, blocks: int) -> None:
    result = client.load_prefix(space, tokens)
    assert result.blocks == blocks
    for got, want in zip(result.payloads, payloads(space, tokens), strict=False):
        assert np.array_equal(got, want)


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> float:
    """Poll ``cond`` until true; seconds it took (fails the test after ``timeout_s``)."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "cluster").start(
        nodes=12, capacity="64MiB", etcd=True, lease_ttl_s=TTL_S
    )
    try:
        yield cluster
    finally:
        cluster.stop()


def node_live(client: Client, node_id: str) -> bool:
    view = client.core.view()
    return any(n.id == node_id and bool(view.live[i]) for i, n in enumerate(view.nodes))


def test_kill_drain_out_in(etcd_cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = etcd_cluster
    space = ns("membership")
    a, b, c = prompt(30, 1), prompt(30, 2), prompt(20, 3)
    with Client(cluster.client_config()) as client:
        # The map came from etcd: 12 members, all live.
        assert len(client.core.cluster.nodes) == 12
        assert all(node_live(client, f"node-{i:02d}") for i in range(12))
        assert client.store(space, a, payloads(space, a)).written == 30

        # kill -9: the lease runs out, etcd deletes the registration, the client's watch
        # sees it and the node stops being used; no map change.
        epoch = client.core.cluster.epoch
        cluster.kill(3)
        took = wait_for("node-03 to turn not live", lambda: not node_live(client, "node-03"))
        assert took <= TTL_S + 2.0, f"took {took:.2f} s with a {TTL_S} s lease"
        assert client.core.cluster.epoch == epoch

        # Writes go on: node-03's shards go to the next node in each key's order.
        before = client.counters["shards_redirected"]
        stored = client.store(space, b, payloads(space, b))
        assert (stored.written, stored.failed) == (30, 0)
        assert client.counters["shards_redirected"] > before
        assert_identical(client, space, a, 30)
        assert_identical(client, space, b, 30)

        # Back with its data: it registers again and is used again.
        cluster.restart(3)
        wait_for("node-03 live again", lambda: node_live(client, "node-03"))
        assert_identical(client, space, a, 30)
        assert_identical(client, space, b, 30)

        # drain through the CLI: a map change every client sees without a restart.
        cf = str(cluster.cluster_file)
        assert kvcache_main(["node", "drain", "node-05", "--cluster-file", cf]) == 0
        wait_for("the drain to reach the client", lambda: client.core.cluster.epoch > epoch)
        drained = {n.id: n.state for n in client.core.cluster.nodes}
        assert drained["node-05"] is NodeState.DRAIN
        node5 = client.core.view().nodes.index(
            next(n for n in client.core.view().nodes if n.id == "node-05")
        )
        targets, _redirected, _order = client.core.view().targets(
            block_keys(space, c), np.ones(len(client.core.view().nodes), bool)
        )
        assert not (targets == node5).any(), "a drained node got new shards"
        assert client.store(space, c, payloads(space, c)).written == 20
        for tokens, blocks in ((a, 30), (b, 30), (c, 20)):
            assert_identical(client, space, tokens, blocks)

        # out: not read either; blocks lose at most one shard and stay readable.
        assert kvcache_main(["node", "out", "node-05", "--cluster-file", cf]) == 0
        wait_for(
            "out to reach the client",
            lambda: {n.id: n.state for n in client.core.cluster.nodes}["node-05"] is NodeState.OUT,
        )
        for tokens, blocks in ((a, 30), (b, 30), (c, 20)):
            assert_identical(client, space, tokens, blocks)
        assert kvcache_main(["node", "in", "node-05", "--cluster-file", cf]) == 0
        wait_for(
            "in to reach the client",
            lambda: {n.id: n.state for n in client.core.cluster.nodes}["node-05"] is NodeState.UP,
        )
        assert client.counters["map_changes"] >= 3

    # The CLI's list shows the states and liveness etcd holds.
    capsys.readouterr()
    assert kvcache_main(["node", "list", "--cluster-file", cf]) == 0
    listing = capsys.readouterr().out
    assert "node-05" in listing and "up" in listing
    # Removing a node that is up is refused with a message saying what to do.
    assert kvcache_main(["node", "remove", "node-07", "--cluster-file", cf]) != 0
    assert "take it out first" in capsys.readouterr().err


def test_join_re_places_without_restart(etcd_cluster: LocalCluster) -> None:
    cluster = etcd_cluster
    space = ns("join")
    prompts = [prompt(8, 100 + i) for i in range(12)]
    with Client(cluster.client_config()) as client:
        for tokens in prompts:
            assert client.store(space, tokens, payloads(space, tokens)).written == 8
        changes = client.counters["map_changes"]
        joined = cluster.add_node()
        wait_for(
            "the 13th node in the client's map",
            lambda: any(n.id == joined.id for n in client.core.cluster.nodes),
        )
        assert client.counters["map_changes"] > changes
        # Every block is still found: reads ask the holders under the previous map too.
        for tokens in prompts:
            assert_identical(client, space, tokens, 8)
        # New writes use the new node.
        fresh = [prompt(8, 200 + i) for i in range(12)]
        for tokens in fresh:
            assert client.store(space, tokens, payloads(space, tokens)).written == 8
        keys = [k for tokens in fresh for k in block_keys(space, tokens)]
        view = client.core.view()
        new_index = next(i for i, n in enumerate(view.nodes) if n.id == joined.id)
        assert (view.holders(keys) == new_index).any()
        for tokens in fresh:
            assert_identical(client, space, tokens, 8)


class _Relay:
    """A node that holds no secret: it passes each client's handshake on to a real daemon
    (the HELLO as the daemon sent it, or announcing itself), and records what the daemon
    answered and what the client sent it afterwards."""

    def __init__(self, real: str, *, announce: str | None) -> None:
        import socket
        import threading

        self.real = real
        self.announce = announce
        self.connections = 0
        self.results: list[bytes] = []
        self.after: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        import threading

        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.connections += 1
            thread = threading.Thread(target=self._relay, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _relay(self, conn: object) -> None:
        import socket

        from kvcache.net import recv_exact
        from kvcache.session import AUTH_BYTES, HELLO_BYTES, MAX_NODE_ID, RESULT_BYTES

        assert isinstance(conn, socket.socket)
        host, port = self.real.removeprefix("tcp://").rsplit(":", 1)
        try:
            with conn, socket.create_connection((host, int(port)), timeout=5) as up:
                conn.settimeout(5)
                hello = recv_exact(up, HELLO_BYTES, "real")
                if self.announce is not None:
                    name = self.announce.encode()
                    hello = (hello[:5] + bytes([len(name)]) + hello[6:40]
                             + name.ljust(MAX_NODE_ID, b"\0"))  # fmt: skip
                conn.sendall(hello)
                up.sendall(recv_exact(conn, AUTH_BYTES, "client"))
                result = recv_exact(up, RESULT_BYTES, "real")
                self.results.append(result)
                conn.sendall(result)
                conn.settimeout(1)
                while chunk := conn.recv(1 << 16):
                    self.after.append(chunk)
        except Exception:  # the client hung up, or refused us: what was recorded stands
            return

    def close(self) -> None:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(timeout=10)
        self._listener.close()


@pytest.mark.parametrize("announce", [None, "evil"], ids=["real-hello", "forged-hello"])
def test_a_node_registered_without_the_secret_cannot_relay_sessions(
    tmp_path: Path, announce: str | None
) -> None:
    """Anyone who can write to etcd can register a node; one without the tenant's secret
    used to pass clients' handshakes on to a real daemon, be taken for a daemon, receive
    shard bytes and keep a session on the real daemon as the client's tenant. The proofs
    are bound to the node id the daemon announces, and a client with an etcd map refuses a
    daemon that is not the node it dialed: the relay gets no session and no bytes."""
    from kvcache.membership.agent import Registrar
    from kvcache.membership.model import Registration

    cluster = LocalCluster(tmp_path / "cluster").start(
        nodes=3, capacity="64MiB", etcd=True, lease_ttl_s=TTL_S
    )
    relay = _Relay(cluster.nodes[0].data, announce=announce)
    registrar = Registrar(cluster.etcd_settings, Registration(id="evil", data=relay.endpoint))
    try:
        assert registrar.start(wait_s=10)
        config = cluster.client_config(k=2, m=1, min_write_shards=3, timeout_s=1.0)
        space = Namespace(model="relay", revision="1", layout=LAYOUT)
        tokens = prompt(24, 7)
        with Client(config) as client:
            wait_for("the map to list evil", lambda: node_live(client, "evil"))
            stored = client.store(space, tokens, payloads(space, tokens))
            assert stored.failed == 0 and stored.written == 24
            assert_identical(client, space, tokens, 24)
        relay.close()  # its threads joined: what it saw is all recorded
        assert relay.connections, "the client never tried the relay"
        # Forwarding the real HELLO: the client stops before its AUTH; announcing itself:
        # the real daemon refuses the client's proof (made for "evil").
        if announce is None:
            assert relay.results == []
        else:
            assert relay.results and all(r[:4] == b"KVNO" for r in relay.results)
        assert b"".join(relay.after) == b""  # not one request byte reached it
    finally:
        registrar.stop()
        relay.close()
        cluster.stop()


def test_a_second_daemon_with_a_taken_id_does_not_take_it_and_a_lost_key_comes_back(
    tmp_path: Path,
) -> None:
    """Two daemons given one node_id used to take the id from each other: the second's
    registration replaced the first's, and when the second died its lease took the key with
    it, leaving the first out of the map for good while it answered /healthz. The second now
    waits for the first's registration to end; and a registration replaced anyway (written
    by hand here, under another lease that then ends) is published again by its daemon."""
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    from kvcache.membership.etcd import EtcdStore, fetch_map
    from kvcache.membership.model import Registration
    from kvcache.testing.localcluster import free_ports

    cluster = LocalCluster(tmp_path / "cluster").start(
        nodes=3, capacity="64MiB", etcd=True, lease_ttl_s=TTL_S
    )
    settings = cluster.etcd_settings
    original = cluster.nodes[1].data

    def live_address() -> str | None:
        reg = fetch_map(settings).live.get("node-01")
        return None if reg is None else reg.data

    dup = None
    try:
        data_port, admin_port = free_ports(2)
        ready = tmp_path / "dup.ready"
        dup = subprocess.Popen(
            [sys.executable, "-m", "kvcache.cli", "server", "--node-id", "node-01",
             "--data-dir", str(tmp_path / "dup"), "--listen", f"tcp://127.0.0.1:{data_port}",
             "--admin-listen", f"127.0.0.1:{admin_port}", "--capacity", "64MiB",
             "--credentials", str(cluster.credentials_file.resolve()),
             "--cluster-file", str(cluster.cluster_file.resolve()),
             "--lease-ttl", str(TTL_S), "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        wait_for("the duplicate daemon to serve", ready.exists)
        # It waits for the id (a warning in its log) instead of taking it over.
        wait_for("the duplicate's warning", lambda: "not registering" in _log_so_far(dup))
        assert live_address() == original
        os.kill(dup.pid, signal.SIGKILL)
        dup.wait()
        dup = None
        assert live_address() == original

        # A registration replaced under another lease, which then ends: the key is gone
        # with it, and node-01's own registrar publishes it again.
        async def replace_and_end() -> None:
            store = EtcdStore(settings)
            try:
                lease = await store.grant(TTL_S)
                await store.put_live(Registration(id="node-01", data="tcp://127.0.0.1:1"), lease)
                await store.revoke(lease)
            finally:
                await store.close()

        asyncio.run(replace_and_end())
        wait_for("node-01's registration to come back", lambda: live_address() == original)
    finally:
        if dup is not None:
            os.kill(dup.pid, signal.SIGKILL)
            dup.wait()
        cluster.stop()


_LOGS: dict[int, bytearray] = {}


def _log_so_far(proc: object) -> str:
    """What a subprocess wrote to its stderr pipe so far (read without blocking)."""
    import os
    import subprocess

    assert isinstance(proc, subprocess.Popen) and proc.stderr is not None
    buf = _LOGS.setdefault(proc.pid, bytearray())
    os.set_blocking(proc.stderr.fileno(), False)
    try:
        while chunk := proc.stderr.read(65536):
            buf += chunk
    except BlockingIOError:
        pass
    return buf.decode(errors="replace")
