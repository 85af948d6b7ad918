"""kill -9 and SIGSTOP under load: no wrong bytes, and every acknowledged block survives.

A writer stores fresh prompts and a reader loads the acknowledged ones while
daemons are killed and restarted, or stopped and resumed, at most two at a
time (the redundancy of 10 + 2). Afterwards, with every daemon back, every
block a store acknowledged loads whole and byte-identical. The chaos runs for
a few seconds here; ``bench/reliability.py`` runs it longer.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvcache.client import Client
from kvcache.client.localcluster import LocalCluster
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
NS = Namespace(model="chaos", revision="1", layout=LAYOUT)
BLOCKS = 4


def prompt(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 50_000, BLOCKS * 64).astype(np.uint32)


def payloads(tokens: np.ndarray) -> list[np.ndarray]:
    return [payload_for_key(k, LAYOUT.payload_bytes) for k in block_keys(NS, tokens)]


@dataclass
class Tally:
    acked: list[int] = field(default_factory=list)
    stores: int = 0
    loads: int = 0
    blocks_loaded: int = 0
    wrong_bytes: int = 0
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def wrong_bytes(client: Client, i: int) -> tuple[int, int]:
    tokens = prompt(i)
    result = client.load_prefix(NS, tokens)
    want = payloads(tokens)
    wrong = sum(int(np.count_nonzero(g != w)) for g, w in zip(result.payloads, want, strict=False))
    return result.blocks, wrong


def run_chaos(cluster: LocalCluster, *, seconds: float, seed: int) -> Tally:
    """Load, store and fault for ``seconds``; returns what the workers saw."""
    tally = Tally()
    stop = threading.Event()

    def writer() -> None:
        with Client(cluster.client_config(timeout_s=1.0, down_retry_s=0.5)) as client:
            i = 0
            while not stop.is_set():
                i += 1
                result = client.store(NS, prompt(i), payloads(prompt(i)))
                with tally.lock:
                    tally.stores += 1
                    if result.failed == 0:
                        tally.acked.append(i)

    def reader() -> None:
        rng = random.Random(seed)
        with Client(cluster.client_config(timeout_s=1.0, down_retry_s=0.5)) as client:
            while not stop.is_set():
                with tally.lock:
                    acked = list(tally.acked)
                if not acked:
                    stop.wait(0.01)
                    continue
                blocks, wrong = wrong_bytes(client, rng.choice(acked))
                with tally.lock:
                    tally.loads += 1
                    tally.blocks_loaded += blocks
                    tally.wrong_bytes += wrong

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # surfaced by the test
                tally.errors.append(exc)
                stop.set()

        return run

    workers = [threading.Thread(target=guarded(f)) for f in (writer, reader)]
    for w in workers:
        w.start()
    rng = random.Random(seed)
    deadline = threading.Event()
    timer = threading.Timer(seconds, deadline.set)
    timer.start()
    try:
        while not deadline.is_set() and not stop.is_set():
            victims = rng.sample(range(len(cluster.nodes)), rng.choice((1, 2)))
            how = rng.choice(("kill", "pause"))
            for v in victims:
                cluster.kill(v) if how == "kill" else cluster.pause(v)
            deadline.wait(rng.uniform(0.3, 1.0))
            for v in victims:
                if how == "kill":
                    cluster.restart(v)
                else:
                    cluster.resume(v)
            deadline.wait(rng.uniform(0.1, 0.5))
    finally:
        timer.cancel()
        stop.set()
        for w in workers:
            w.join(60)
    return tally


def test_kill_and_stop_under_load_lose_no_acknowledged_block(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = cluster_factory()
    tally = run_chaos(cluster, seconds=8.0, seed=2026)
    assert not tally.errors, tally.errors
    assert tally.wrong_bytes == 0
    assert tally.stores > 5 and tally.acked and tally.loads > 5
    cluster.wait_healthy()
    with Client(cluster.client_config()) as client:
        for i in tally.acked:
            assert wrong_bytes(client, i) == (BLOCKS, 0), i
