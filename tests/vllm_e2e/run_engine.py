"""Run one vLLM engine on the CPU, greedy-decode prompts in phases, report JSON.

Run with the vLLM venv's python (``scripts/vllm-venv.sh``), never the
project's: ``python run_engine.py SPEC.json OUT.json``. SPEC holds::

    {"model": DIR, "connector": {extra config} | null, "stats_dir": DIR | null,
     "hold": bool, "phases": [{"name": str, "prompts": [[token ids]], "max_tokens": int,
                               "kv_transfer_params": [dict | null] (optional, per prompt)}]}

Each phase is one ``LLM.generate`` call. With a connector, the connector's
stats files (``stats_dir``) are read before and after each phase (after the
worker's saves of the phase are done: saves run behind the forward pass, so
``generate`` returns before they finish), and once more after the engine is
shut down. OUT
receives ``{"phases": [{"name", "tokens", "num_cached_tokens", "stats_delta"}],
"final_stats"}``; ``num_cached_tokens`` is vLLM's own count of prompt tokens it
did not compute.

With ``"kv_events": true`` the engine publishes vLLM's KV events (``kv_events_config``,
zmq) to a SUB socket this script binds on loopback; OUT's ``kv_events`` lists every event
decoded with vLLM's own ``KVEventBatch`` (block hashes in hex), in the order received.

With ``hold``, the engine prints ``KVCACHE-ENGINE-READY`` on its stdout once
the phases are done and waits for a line on its stdin before shutting down:
meanwhile its connector keeps serving its SWA states to other engines.

The caller must set VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1; this
script refuses to start without them rather than let vLLM phone home.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REQUIRED_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def read_stats(stats_dir: Path | None) -> dict[str, dict[str, Any]]:
    """The connector counters by role, summed over processes (one file per process)."""
    out: dict[str, dict[str, Any]] = {}
    if stats_dir is None or not stats_dir.exists():
        return out
    for path in sorted(stats_dir.glob("kvcache-*.json")):
        data = json.loads(path.read_text())
        role = out.setdefault(data["role"], {"namespace": data["namespace"]})
        for key, value in data.items():
            if isinstance(value, bool):
                continue
            if isinstance(value, int) and key != "pid":
                role[key] = role.get(key, 0) + value
            elif isinstance(value, float):  # an estimate: the last process's
                role[key] = value
    return out


def saves_settled(stats_dir: Path | None, timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
    """The stats once every queued save is done (the worker's ``save_jobs_done`` has
    caught up with ``save_jobs_queued``); raises after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read_stats(stats_dir)
        worker = stats.get("worker", {})
        if worker.get("save_jobs_done", 0) >= worker.get("save_jobs_queued", 0):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"saves still pending after {timeout_s} s: {worker}")
        time.sleep(0.05)  # polling the stats files the saver thread writes


def delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per role, how much each counter grew."""
    out: dict[str, Any] = {}
    for role, counters in after.items():
        base = before.get(role, {})
        out[role] = {k: v - base.get(k, 0) for k, v in counters.items() if isinstance(v, int)}
    return out


class EventCollector:
    """A SUB socket on a loopback port and a thread decoding what vLLM publishes to it."""

    def __init__(self) -> None:
        import threading

        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            _topic, seq, payload = self._sock.recv_multipart()
            for event in decoder.decode(payload).events:
                row = {f: getattr(event, f) for f in event.__struct_fields__}
                row["type"] = type(event).__name__
                for name in ("block_hashes", "parent_block_hash"):
                    value = row.get(name)
                    if isinstance(value, bytes):
                        row[name] = value.hex()
                    elif isinstance(value, list):
                        row[name] = [v.hex() if isinstance(v, bytes) else v for v in value]
                row["seq"] = int.from_bytes(seq, "big")
                self.events.append(row)

    def stop(self) -> list[dict[str, Any]]:
        time.sleep(1.0)  # the publisher thread sends what the last steps queued
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
        return self.events


def main() -> None:
    for key, value in REQUIRED_ENV.items():
        if os.environ.get(key) != value:
            sys.exit(f"refusing to start vLLM: {key}={value} must be set")
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    stats_dir = Path(spec["stats_dir"]) if spec.get("stats_dir") else None

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.usage.usage_lib import is_usage_stats_enabled

    if is_usage_stats_enabled():
        sys.exit("refusing to start vLLM: it would send usage statistics")

    kwargs: dict[str, Any] = {}
    collector = None
    if spec.get("kv_events"):
        from vllm.config.kv_events import KVEventsConfig

        collector = EventCollector()
        # A tcp://host:port without "*" makes vLLM's PUB connect: to this loopback SUB.
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=collector.endpoint
        )
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "kvcache.engine.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=512,
        seed=0,
        disable_log_stats=False,  # so each output reports its prefix-cache hit
        **kwargs,
    )
    phases = []
    for phase in spec["phases"]:
        before = read_stats(stats_dir)
        # Optional per-prompt kv_transfer_params (how a request carries its kvcache hint).
        per_prompt = phase.get("kv_transfer_params") or [None] * len(phase["prompts"])
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=phase["max_tokens"],
                ignore_eos=True,
                extra_args=None if kv is None else {"kv_transfer_params": kv},
            )
            for kv in per_prompt
        ]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        phases.append(
            {
                "name": phase["name"],
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "num_cached_tokens": [o.num_cached_tokens for o in outputs],
                "stats_delta": delta(before, saves_settled(stats_dir)),
            }
        )
    if collector is not None:
        # The worker reports a store once it reached the cluster, and vLLM takes the
        # worker's events after each step: a store that finished after the last step of
        # the phases waits for the next one (docs/engine.md). A serving engine keeps
        # stepping; here one more request shorter than a block (it stores nothing) is
        # that next step.
        llm.generate(
            [TokensPrompt(prompt_token_ids=[1, 2, 3])],
            SamplingParams(temperature=0.0, max_tokens=1),
            use_tqdm=False,
        )
    if spec.get("hold"):
        print("KVCACHE-ENGINE-READY", flush=True)
        sys.stdin.readline()
    # A graceful shutdown lets the worker's connector drain its queued saves.
    llm.llm_engine.engine_core.shutdown()
    result: dict[str, Any] = {"phases": phases, "final_stats": read_stats(stats_dir)}
    if collector is not None:
        result["kv_events"] = collector.stop()
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
