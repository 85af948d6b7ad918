"""The I/O process pool through the shipped client: worker processes move the bytes of
loads and stores between the daemons and shared-memory buffers from ``alloc_buffer``."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import signal
import threading
import time
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


def _fill(buffer: np.ndarray, ns: Namespace, tokens: np.ndarray) -> None:
    for b, key in enumerate(block_keys(ns, tokens)):
        buffer[b] = payload_for_key(key, P)


def test_a_forked_child_neither_uses_nor_frees_the_parents_pool(
    shared_cluster: LocalCluster,
) -> None:
    """A child forked from a process with a pooled client: its calls are ClosedErrors (its
    requests went down the parent's worker sockets, and their replies to the parent's calls
    of the same id: wrong bytes), and neither its buffer finalizers nor its close() free
    the parent's buffers or workers (they unlinked them: the parent's loads found nothing)."""
    ns, tokens = space("pool-fork"), prompt(16, 8)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        src = client.alloc_buffer(16, P)
        _fill(src, ns, tokens)
        assert client.store(ns, tokens, src).written == 16
        match = client.match_prefix(ns, tokens)
        out = client.alloc_buffer(16, P)  # no worker has mapped it yet
        names = set(os.listdir("/dev/shm"))
        verdict_r, verdict_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: every use of the inherited client is refused
            verdict = b"ok"
            try:
                for call in ("load", "alloc", "store", "match"):
                    try:
                        if call == "load":
                            client.load(ns, match, out=out)
                        elif call == "alloc":
                            client.alloc_buffer(2, P)
                        elif call == "store":
                            client.store(ns, tokens, src)
                        else:
                            client.match_prefix(ns, tokens)
                        verdict = f"{call} ran in the child".encode()
                    except ClosedError:
                        pass
                del out, src  # their finalizers run here, in the child
                gc.collect()
                client.close()
            except BaseException as exc:
                verdict = repr(exc).encode()
            os.write(verdict_w, verdict)
            os._exit(0)
        os.close(verdict_w)
        os.waitpid(pid, 0)
        with os.fdopen(verdict_r, "rb") as fh:
            assert fh.read() == b"ok"
        assert names <= set(os.listdir("/dev/shm"))
        result = client.load(ns, match, out=out)
        assert result.blocks == 16 and np.array_equal(out, src)
        pool = client._pool
        assert pool is not None and pool.broken is None


def test_buffers_outlive_the_client_and_workers_unmap_released_ones(
    shared_cluster: LocalCluster,
) -> None:
    """close() left the caller's arrays pointing at unmapped memory (a crash on the next
    read, or writes landing in a buffer mapped later at the same address), and each worker
    kept every buffer it had ever mapped (memory and descriptors without bound)."""
    ns, tokens = space("pool-release"), prompt(16, 9)
    config = shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)
    with Client(config) as client:
        src = client.alloc_buffer(16, P)
        _fill(src, ns, tokens)
        assert client.store(ns, tokens, src).written == 16
        match = client.match_prefix(ns, tokens)
        for _ in range(8):  # each load without `out` gets a shared buffer of its own
            result = client.load(ns, match)
            assert result.blocks == 16 and np.array_equal(result.payloads[5], src[5])
            del result
            gc.collect()
        for pid in client.io_pids:
            with open(f"/proc/{pid}/maps") as fh:
                mapped = {line.split()[-2] for line in fh if "/dev/shm/" in line}
            assert len(mapped) <= 3, mapped  # src, the last load's buffer, maybe one more
        kept = client.alloc_buffer(4, P)
        kept.fill(7)
    assert int(kept[3, -1]) == 7  # still mapped after close()
    with Client(config) as other:
        fresh = other.alloc_buffer(4, P)
        fresh.fill(1)
        kept.fill(5)  # a write through the old array lands in the old array alone
        assert kept.ctypes.data != fresh.ctypes.data
        assert (fresh == 1).all() and (kept == 5).all()


def test_a_stopped_io_worker_is_killed_and_the_load_goes_on(
    shared_cluster: LocalCluster,
) -> None:
    """A SIGSTOPped worker held a pooled load for as long as it stayed stopped. Now it is
    killed after io_stall_s, its range fails as a dead worker's does, and the next loads
    run in this process."""
    ns, tokens = space("pool-stall"), prompt(24, 10)
    # The pool waits max(io_stall_s, 5 x timeout_s). A timeout of 1 s, not less: this
    # client's store and loads run on a loaded 2-core CI machine too (at 0.1 s its store
    # once took every node for down).
    config = shared_cluster.client_config(
        io_processes=2, chunk_bytes=CHUNK, io_stall_s=5.0, timeout_s=1.0
    )
    with Client(config) as client:
        src = client.alloc_buffer(24, P)
        _fill(src, ns, tokens)
        assert client.store(ns, tokens, src).written == 24
        match = client.match_prefix(ns, tokens)
        stopped = client.io_pids[1]  # the second range's worker
        os.kill(stopped, signal.SIGSTOP)
        try:
            out = client.alloc_buffer(24, P)
            started = time.monotonic()
            result = client.load(ns, match, out=out)
            assert time.monotonic() - started < 20
            assert result.blocks < 24 and np.array_equal(out[: result.blocks], src[: result.blocks])
            pool = client._pool
            assert pool is not None and pool.broken is not None
            out.fill(0)
            assert client.load(ns, match, out=out).blocks == 24
            assert np.array_equal(out, src)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)


def test_a_busy_worker_sends_heartbeats_and_an_idle_one_none() -> None:
    """A worker's store of many chunks says nothing until it is done, and the pool took a
    healthy one for a stopped one and killed it: a worker with a request now sends a
    heartbeat every quarter of the pool's stall time."""
    import multiprocessing

    from kvcache.client.pool_messages import Started
    from kvcache.client.pool_worker import _Channel

    ours, theirs = multiprocessing.Pipe()
    channel = _Channel(theirs, stall_s=0.4)
    try:
        channel.busy(True)
        beats = 0
        deadline = time.monotonic() + 10
        while beats < 3 and time.monotonic() < deadline:
            if ours.poll(1.0):
                assert isinstance(ours.recv(), Started)
                beats += 1
        assert beats == 3
        channel.busy(False)
        while ours.poll(0.3):  # one may have been on its way
            ours.recv()
        assert not ours.poll(0.5)  # idle: nothing for several heartbeats' time
    finally:
        channel.close()
        ours.close()
        theirs.close()
