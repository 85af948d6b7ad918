"""End to end: retention hints per request inside one real vLLM engine (CPU tier).

One engine runs four requests in one ``generate`` call, each with its own
``kv_transfer_params={"kvcache": {...}}``: class ``agent`` with a 2 h TTL, class
``agent`` with a TTL past its class's bound (clamped by the daemons), ``store: false``,
and a malformed hint (logged, counted, ignored: the request is served under the
connector's class). Every daemon must then hold each stored request's blocks under
its own class and expiry, and nothing of the ``store: false`` one; the engine's
output is unchanged by any of it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator

import pytest
from retention_fixtures import shard_retention
from vllm_e2e.harness import E2E, EngineRun, build_vllm_python, engine_spec
from vllm_e2e.harness import run as run_cmd

from kvcache.engine.vllm_meta import namespace_from_dict
from kvcache.keys import block_keys
from kvcache.retention.decide import write_expiry
from kvcache.testing.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

DAY_MS = 86_400_000
rng = random.Random(20261202)
PROMPTS = {
    "agent": [rng.randrange(3, 1024) for _ in range(100)],
    "agent_long": [rng.randrange(3, 1024) for _ in range(100)],
    "declined": [rng.randrange(3, 1024) for _ in range(100)],
    "bad": [rng.randrange(3, 1024) for _ in range(100)],
}
HINTS = {
    "agent": {"kvcache": {"traffic_class": "agent", "ttl": "2h"}},
    "agent_long": {"kvcache": {"traffic_class": "agent", "ttl": "30d"}},  # bound: 3 d
    "declined": {"kvcache": {"store": False}},
    "bad": {"kvcache": {"ttl": "soon"}},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("vllm-hints"))
    c.start(nodes=12, capacity="256MiB")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def engine(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[EngineRun, int, int]:
    python = build_vllm_python()
    work = tmp_path_factory.mktemp("vllm-hints-run")
    model = work / "model"
    run_cmd([str(python), str(E2E / "make_model.py"), str(model)], work / "build.log", 300)
    spec_path, out = engine_spec(model, work, "hints", {}, cluster, max_tokens=8)
    spec = json.loads(spec_path.read_text())  # connector class: "chat" (the harness's)
    spec["phases"] = [
        {
            "name": "mixed",
            "prompts": list(PROMPTS.values()),
            "kv_transfer_params": [HINTS[name] for name in PROMPTS],
            "max_tokens": 8,
        }
    ]
    spec_path.write_text(json.dumps(spec))
    before = int(time.time() * 1000)
    run_cmd([str(python), str(E2E / "run_engine.py"), str(spec_path), str(out)],
            work / "hints.log", 900)  # fmt: skip
    return EngineRun.read(out), before, int(time.time() * 1000)


def stored(
    cluster: LocalCluster, run: EngineRun, name: str
) -> dict[bytes, list[tuple[str, int, str]]]:
    ns = namespace_from_dict(run.final["worker"]["namespace"])
    keys = block_keys(ns, PROMPTS[name])
    return shard_retention(cluster, keys)


def test_each_request_keeps_its_own_class_and_expiry(
    cluster: LocalCluster, engine: tuple[EngineRun, int, int]
) -> None:
    run, before, after = engine
    for name, cls, ttl_ms in (
        ("agent", "agent", 2 * 3_600_000),
        ("agent_long", "agent", 3 * DAY_MS),  # clamped to the class's TTL
        ("bad", "chat", 7 * DAY_MS),  # the hint ignored: the connector's class
    ):
        held = stored(cluster, run, name)
        assert all(len(shards) == 12 for shards in held.values()), name
        for shards in held.values():
            for _node, expiry, got in shards:
                assert got == cls, name
                assert before + ttl_ms <= expiry <= write_expiry(after, ttl_ms // 1000), name
    assert all(not shards for shards in stored(cluster, run, "declined").values())


def test_hints_are_counted_and_never_fail_a_request(
    cluster: LocalCluster, engine: tuple[EngineRun, int, int]
) -> None:
    run, _, _ = engine
    assert run.final["scheduler"]["hints_bad"] == 1
    assert run.final["scheduler"]["saves_declined"] >= 1
    assert len(run.phases["mixed"]["tokens"]) == 4
    assert all(len(t) == 8 for t in run.phases["mixed"]["tokens"])
    clamped = sum(s["gc"]["hints_clamped"] for s in cluster.node_stats())
    assert clamped >= 12  # every daemon clamped agent_long's 30 d
