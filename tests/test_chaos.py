"""kill -9 and SIGSTOP under load: no wrong bytes, and every acknowledged block survives.

A writer stores fresh prompts and a reader loads the acknowledged ones while
daemons are killed and restarted, or stopped and resumed, at most two at a
time (the redundancy of 10 + 2; :func:`kvcache.chaos.run_kill_stop`).
Afterwards, with every daemon back, every block a store acknowledged loads
whole and byte-identical. The chaos runs for a few seconds here;
``bench/reliability.py`` runs it longer.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.chaos import chaos_prompt, check_prompt, run_kill_stop
from kvcache.client import Client
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
NS = Namespace(model="chaos", revision="1", layout=LAYOUT)


def test_kill_and_stop_under_load_lose_no_acknowledged_block(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = cluster_factory()
    tally = run_kill_stop(cluster, NS, seconds=8.0, seed=2026)
    assert not tally.errors, tally.errors
    assert tally.wrong_bytes == 0
    assert tally.faults >= 3 and tally.stores > 5 and tally.acked and tally.loads > 5
    cluster.wait_healthy()
    with Client(cluster.client_config()) as client:
        for i in tally.acked:
            assert check_prompt(client, NS, chaos_prompt(i, 4, 64)) == (4, 0), i
