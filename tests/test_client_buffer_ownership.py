"""Who writes into a load's ``out``, and when: a cancelled asyncio call returns only once its
thread is done, and a load whose blocks stop verifying because the caller wrote into ``out``
meanwhile keeps the stripes (it dropped healthy stripes from every holder)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from kvcache.client import AsyncClient, Client
from kvcache.client.client import _to_thread_whole
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=256, dtype=DType.INT8, layers_in_block=1)
P = LAYOUT.payload_bytes


def _stored(client: Client, name: str, blocks: int) -> tuple[Namespace, np.ndarray, np.ndarray]:
    ns = Namespace(model=name, revision="1", layout=LAYOUT)
    tokens = np.arange(blocks * 16, dtype=np.uint32) + 7
    src = np.stack([payload_for_key(k, P) for k in block_keys(ns, tokens)])
    assert client.store(ns, tokens, src).written == blocks
    return ns, tokens, src


def test_a_cancelled_call_propagates_only_once_its_thread_is_done() -> None:
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def work() -> int:
        started.set()
        release.wait(30)
        finished.append(True)
        return 1

    async def scenario() -> list[bool]:
        task = asyncio.ensure_future(_to_thread_whole(work))
        await asyncio.to_thread(started.wait, 30)
        task.cancel()
        threading.Timer(0.2, release.set).start()  # the work ends a little after the cancel
        with pytest.raises(asyncio.CancelledError):
            await task
        return list(finished)  # what had finished when the cancellation arrived

    assert asyncio.run(scenario()) == [True]


def test_a_cancelled_load_leaves_the_buffer_and_the_blocks_alone(
    shared_cluster: LocalCluster,
) -> None:
    """Cancelled loads used to keep landing shards in ``out`` after CancelledError; a caller
    that refilled its buffer then made them drop every block's healthy stripe."""
    with Client(shared_cluster.client_config()) as client:
        ns, tokens, _ = _stored(client, "cancelled-load", 1024)

    async def scenario() -> int:
        async with AsyncClient(shared_cluster.client_config()) as aclient:
            for trial in range(4):
                match = await aclient.match_prefix(ns, tokens)
                out = np.full((1024, P), 0xEE, np.uint8)
                task = asyncio.ensure_future(aclient.load(ns, match, out=out))
                await asyncio.sleep(0.003 * (trial + 1))  # a cancel at some point of the load
                task.cancel()
                try:
                    result = await task
                    assert result.blocks == 1024
                    continue
                except asyncio.CancelledError:
                    pass
                out.fill(0x11)  # the caller owns its buffer again
                again = await aclient.load(ns, match, out=np.empty((1024, P), np.uint8))
                assert again.blocks == 1024
                assert int(np.count_nonzero(out != 0x11)) == 0, trial
            return (await aclient.match_prefix(ns, tokens)).hit_blocks

    assert asyncio.run(scenario()) == 1024


def test_a_buffer_written_during_the_load_keeps_the_stripes(shared_cluster: LocalCluster) -> None:
    """The caller writes into ``out`` from a callback of the load itself, past the verified
    prefix: blocks whose shards had landed then fail to verify. The load stops there, and
    the stripes, which verify alone, stay (they were dropped from every holder)."""
    config = shared_cluster.client_config(chunk_bytes=4 * P)
    with Client(config) as client:
        ns, tokens, src = _stored(client, "written-during-load", 64)
        for _ in range(8):
            out = np.zeros((64, P), np.uint8)
            calls: list[tuple[int, int]] = []

            def on_ready(
                first: int, stop: int, out: np.ndarray = out, calls: list[tuple[int, int]] = calls
            ) -> None:
                calls.append((first, stop))
                out[stop:] = 0x11

            result = client.load(ns, client.match_prefix(ns, tokens), out=out, on_ready=on_ready)
            assert np.array_equal(out[: result.blocks], src[: result.blocks])
        assert client.counters["blocks_corrupt"] == 0
        assert client.match_prefix(ns, tokens).hit_blocks == 64
        out = np.zeros((64, P), np.uint8)
        assert client.load(ns, client.match_prefix(ns, tokens), out=out).blocks == 64
        assert np.array_equal(out, src)
