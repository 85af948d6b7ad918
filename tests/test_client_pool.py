"""The I/O process pool through the shipped client: worker processes move the bytes of
loads and stores between the daemons and shared-memory buffers from ``alloc_buffer``."""

from __future__ import annotations

import itertools
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from server_fixtures import wait_until

from kvcache.chaos import ShardFault, plant
from kvcache.client import Client
from kvcache.errors import ClosedError, ClusterError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
P = LAYOUT.payload_bytes
CHUNK = 8 * P  # 8 blocks per chunk: a 40-block load is cut into ranges for both workers


def space(name: str) -> Namespace:
    return Namespace(model=name, revision="1", layout=LAYOUT)


def prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 64).astype(np.uint32)


def test_pooled_store_and_load_through_shared_buffers(shared_cluster: LocalCluster) -> None:
    ns, tokens = space("pool"), prompt(40, 1)
    keys = block_keys(ns, tokens)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        pids = client.io_pids
        assert len(pids) == 2 and os.getpid() not in pids
        src = client.alloc_buffer(40, P)
        for b, key in enumerate(keys):
            src[b] = payload_for_key(key, P)
        assert client.store(ns, tokens, src).written == 40
        out = client.alloc_buffer(40, P)
        ready: list[tuple[int, int]] = []
        result = client.load(
            ns, client.match_prefix(ns, tokens), out=out, on_ready=lambda a, b: ready.append((a, b))
        )
        assert result.blocks == 40
        assert np.array_equal(out, src)
        # The verified prefix is reported in order, without gaps, up to the end.
        assert ready[0][0] == 0 and ready[-1][1] == 40
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ready))
        # Each worker's next load lands its parity shards in the scratch its last one used
        # (kvcache.client.scratch), and the bytes are still right.
        before = client.counters["scratch_reused"]
        out.fill(0)
        assert client.load(ns, client.match_prefix(ns, tokens), out=out).blocks == 40
        assert np.array_equal(out, src)
        assert client.counters["scratch_reused"] >= before + 2


def test_pooled_load_stops_at_a_broken_block_and_never_reports_past_it(
    shared_cluster: LocalCluster,
) -> None:
    ns, tokens = space("pool-broken"), prompt(40, 2)
    keys = block_keys(ns, tokens)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        src = client.alloc_buffer(40, P)
        for b, key in enumerate(keys):
            src[b] = payload_for_key(key, P)
        client.store(ns, tokens, src)
        for index in (0, 5, 10):  # three bad shards: block 13 cannot be rebuilt
            plant(shared_cluster, keys[13], index, ShardFault.CORRUPT_BODY)
        out = client.alloc_buffer(40, P)
        ready: list[tuple[int, int]] = []
        match = client.match_prefix(ns, tokens)
        result = client.load(ns, match, out=out, on_ready=lambda a, b: ready.append((a, b)))
        assert result.blocks == 13
        assert np.array_equal(out[:13], src[:13])
        assert max(b for _, b in ready) == 13


def test_a_dead_io_worker_leaves_the_client_loading_and_storing_itself(
    shared_cluster: LocalCluster,
) -> None:
    """One I/O worker killed: the next call finds the pool broken, and every load and store
    from then on runs in the calling process, on the same shared buffers, exactly (they
    used to fail with a BrokenPipeError, then hang)."""
    ns, tokens = space("pool-death"), prompt(24, 5)
    keys = block_keys(ns, tokens)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        src = client.alloc_buffer(24, P)
        for b, key in enumerate(keys):
            src[b] = payload_for_key(key, P)
        assert client.store(ns, tokens, src).written == 24
        victim = client.io_pids[0]
        os.kill(victim, signal.SIGKILL)
        pool = client._pool
        assert pool is not None
        wait_until(lambda: pool.broken is not None, what="the pool to see its worker die")
        out = client.alloc_buffer(24, P)
        for _ in range(2):
            out.fill(0)
            assert client.load(ns, client.match_prefix(ns, tokens), out=out).blocks == 24
            assert np.array_equal(out, src)
        other, more = space("pool-death-2"), prompt(24, 6)
        for b, key in enumerate(block_keys(other, more)):
            src[b] = payload_for_key(key, P)
        assert client.store(other, more, src).written == 24
        assert client.load(other, client.match_prefix(other, more), out=out).blocks == 24
        assert np.array_equal(out, src)
        assert client.counters["blocks_loaded"] >= 72


def test_closing_the_client_ends_a_pooled_load_in_flight(tmp_path: Path) -> None:
    """A pooled load waiting on stopped holders when the client is closed returns (what
    was verified: nothing here) once the workers are gone; it used to wait forever."""
    cluster = LocalCluster(tmp_path / "c")
    cluster.start(nodes=12, capacity="64MiB")
    try:
        ns, tokens = space("pool-close"), prompt(16, 7)
        client = Client(cluster.client_config(io_processes=2, chunk_bytes=CHUNK, timeout_s=2.0))
        try:
            src = client.alloc_buffer(16, P)
            for b, key in enumerate(block_keys(ns, tokens)):
                src[b] = payload_for_key(key, P)
            assert client.store(ns, tokens, src).written == 16
            match = client.match_prefix(ns, tokens)
            for node in range(12):
                cluster.pause(node)
            out = client.alloc_buffer(16, P)
            done: list[object] = []

            def load() -> None:
                try:
                    done.append(client.load(ns, match, out=out).blocks)
                except ClosedError as exc:  # closed before all its ranges were posted
                    done.append(exc)

            loader = threading.Thread(target=load)
            loader.start()
            pool = client._pool
            assert pool is not None
            wait_until(lambda: bool(pool._waiting), what="the load to reach the workers")
        finally:
            client.close()
        loader.join(30)
        assert not loader.is_alive(), "the load still waits after close()"
        assert len(done) == 1 and (done[0] == 0 or isinstance(done[0], ClosedError))
    finally:
        for node in range(12):
            cluster.resume(node)
        cluster.stop()


def test_a_worker_dying_during_a_store_fails_its_range_alone(
    shared_cluster: LocalCluster,
) -> None:
    """A worker killed while a store's ranges are out: its range is reported failed, block
    by block, the other worker's range is written, and the call returns only once that
    worker is done (a failure of every request, on top of the replies that came, used to
    report written blocks failed and failed ones nowhere)."""
    ns, tokens = space("pool-death-mid-store"), prompt(24, 8)
    keys = block_keys(ns, tokens)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        src = client.alloc_buffer(24, P)
        for b, key in enumerate(keys):
            src[b] = payload_for_key(key, P)
        pool = client._pool
        assert pool is not None
        victim = client.io_pids[0]
        os.kill(victim, signal.SIGSTOP)  # it never reads its request
        results: list[object] = []
        storer = threading.Thread(target=lambda: results.append(client.store(ns, tokens, src)))
        storer.start()
        wait_until(lambda: len(pool._waiting) == 2, what="both ranges to be posted")
        os.kill(victim, signal.SIGKILL)
        storer.join(60)
        assert not storer.is_alive() and len(results) == 1
        result = results[0]
        failed = set(result.failed_blocks)  # type: ignore[attr-defined]
        assert failed in ({*range(12)}, {*range(12, 24)})
        assert result.written == 24 - len(failed) == 12  # type: ignore[attr-defined]
        # What was reported written is there, byte for byte (loaded in this process now).
        ok = sorted(set(range(24)) - failed)
        loaded = client.load_keys([keys[b] for b in ok], payload_len=P)
        assert loaded.blocks == len(ok)
        assert all(np.array_equal(loaded.payloads[j], src[b]) for j, b in enumerate(ok))


def test_an_on_ready_that_raises_ends_the_load_only_once_the_workers_are_done(
    shared_cluster: LocalCluster,
) -> None:
    """The callback's error used to end a pooled load at once, while the workers still
    wrote into ``out``; a caller reusing ``out`` then made them find "broken" stripes and
    drop healthy blocks from every holder. The error is raised once every range answered:
    nothing lands in ``out`` after it, and nothing is dropped."""
    ns, tokens = space("pool-on-ready"), prompt(40, 11)
    keys = block_keys(ns, tokens)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        src = client.alloc_buffer(40, P)
        for b, key in enumerate(keys):
            src[b] = payload_for_key(key, P)
        assert client.store(ns, tokens, src).written == 40
        expected = np.array(src)  # the shared buffer goes with the client
        out = client.alloc_buffer(40, P)

        def refuse(first: int, stop: int) -> None:
            raise RuntimeError("the engine's callback failed")

        with pytest.raises(RuntimeError, match="callback failed"):
            client.load(ns, client.match_prefix(ns, tokens), out=out, on_ready=refuse)
        out.fill(0xEE)  # the caller reuses its buffer at once
        # Each worker answers a counters request after all it was asked before.
        assert client.counters["stripes_dropped"] == 0
        assert (out == 0xEE).all()
    with Client(shared_cluster.client_config()) as fresh:
        assert fresh.match_prefix(ns, tokens).hit_blocks == 40
        loaded = fresh.load_prefix(ns, tokens)
        assert loaded.blocks == 40
        assert all(np.array_equal(p, expected[b]) for b, p in enumerate(loaded.payloads))


def test_a_worker_that_cannot_start_is_a_cluster_error_and_leaves_nothing_behind(
    shared_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker interpreter that dies at start (here: a PYTHONHOME with no standard
    library) made Client() raise ConnectionResetError and leave its threads, connections
    and the other workers behind."""
    config = shared_cluster.client_config(io_processes=2)
    with Client(config):
        pass  # warm: imports and the multiprocessing resource tracker
    threads = {t.name for t in threading.enumerate()}
    fds = len(os.listdir("/proc/self/fd"))
    children_before = _children()
    monkeypatch.setenv("PYTHONHOME", "/nonexistent-python-home")
    for _ in range(2):
        with pytest.raises(ClusterError, match="I/O worker"):
            Client(config)
    monkeypatch.delenv("PYTHONHOME")
    assert {t.name for t in threading.enumerate()} == threads
    assert len(os.listdir("/proc/self/fd")) == fds
    assert _children() == children_before


def _children() -> set[int]:
    """This process's live child processes."""
    me = os.getpid()
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(entry))
    return out


def test_a_store_whose_encoder_is_shut_down_is_a_closed_error() -> None:
    """close() shuts the client's encoder down; a multi-chunk store submitting its next
    chunk's encoding then got the executor's bare RuntimeError."""
    import concurrent.futures

    from kvcache.client.storing import _submit

    pool = concurrent.futures.ThreadPoolExecutor(1)
    assert _submit(pool, abs, -3).result() == 3
    pool.shutdown()
    with pytest.raises(ClosedError, match="closed during the store"):
        _submit(pool, abs, -3)
