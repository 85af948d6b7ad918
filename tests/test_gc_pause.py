"""kvcache.gc_pause: the cyclic collector is held off while data-path calls run, counted
across threads, and always handed back; and the real client uses it around its calls."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvcache import gc_pause
from kvcache.client import Client
from kvcache.gc_pause import MAX_PAUSE_S, gc_paused
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    """Every test starts and ends with the collector on and no pause held."""
    was = gc.isenabled()
    gc.enable()
    yield
    assert gc_pause._state.active == 0
    assert gc.isenabled()
    if not was:
        gc.disable()


def test_pause_switches_the_collector_off_and_back_on() -> None:
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_disabled_pause_leaves_the_collector_alone() -> None:
    with gc_paused(False):
        assert gc.isenabled()


def test_nested_pauses_end_with_the_outermost() -> None:
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_exception_still_hands_the_collector_back() -> None:
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("call failed")
    assert gc.isenabled()


def test_a_collector_the_host_switched_off_stays_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_calls_in_threads_keep_it_off_until_the_last_ends() -> None:
    first_in, second_in, first_may_leave = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with gc_paused():
            first_in.set()
            first_may_leave.wait(10)
        seen["after_first"] = gc.isenabled()
        second_in.set()

    thread = threading.Thread(target=first)
    with gc_paused():
        thread.start()
        assert first_in.wait(10)
        first_may_leave.set()
        assert second_in.wait(10)
        assert not gc.isenabled()  # this call still runs
    thread.join(10)
    assert seen["after_first"] is False
    assert gc.isenabled()


def test_overlapping_calls_still_collect_every_max_pause() -> None:
    now = [0.0]
    collections_before = sum(s["collections"] for s in gc.get_stats())
    full_before = gc.get_stats()[2]["collections"]

    def clock() -> float:
        return now[0]

    with gc_paused(clock=clock):
        with gc_paused(clock=clock):
            now[0] = MAX_PAUSE_S / 2
        assert sum(s["collections"] for s in gc.get_stats()) == collections_before
        with gc_paused(clock=clock):
            now[0] = MAX_PAUSE_S + 1
        # The inner call ended past the limit while the outer still runs: a full pass ran.
        assert gc.get_stats()[2]["collections"] == full_before + 1
        assert not gc.isenabled()
    assert gc.isenabled()


LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=256, dtype=DType.BFLOAT16, layers_in_block=2)


@pytest.mark.parametrize("pause_gc", [True, False])
def test_the_client_holds_the_collector_off_during_its_calls(
    shared_cluster: LocalCluster, pause_gc: bool
) -> None:
    space = Namespace(model=f"gc-pause-{pause_gc}", revision="1", layout=LAYOUT)
    tokens = np.arange(8 * 16, dtype=np.uint32)
    payloads = [payload_for_key(k, LAYOUT.payload_bytes) for k in block_keys(space, tokens)]
    during: list[bool] = []
    with Client(shared_cluster.client_config(pause_gc=pause_gc)) as client:
        assert client.store(space, tokens, payloads).written == 8
        assert gc.isenabled()
        match = client.match_prefix(space, tokens)
        result = client.load(
            space, match, on_ready=lambda first, stop: during.append(gc.isenabled())
        )
        assert result.blocks == 8
        assert all(np.array_equal(a, b) for a, b in zip(result.payloads, payloads, strict=True))
    assert during and all(on is not pause_gc for on in during)
    assert gc.isenabled()
