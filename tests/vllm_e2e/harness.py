"""Running vLLM engine processes from the tests: the venv, the environment, one engine run.

Runs in the project's venv (pytest's); the engines run in the vLLM venv that
``scripts/vllm-venv.sh`` builds, each in a fresh process
(``tests/vllm_e2e/run_engine.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from kvcache.testing.localcluster import LocalCluster

__all__ = [
    "ENGINE_TIMEOUT_S",
    "VLLM_ENV",
    "EngineRun",
    "HeldEngine",
    "build_vllm_python",
    "engine_spec",
    "run",
    "run_engine",
    "vllm_env",
    "vllm_ipc_dir",
]

REPO = Path(__file__).resolve().parent.parent.parent
E2E = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 300
READY = "KVCACHE-ENGINE-READY"

#: vLLM must never post usage statistics or reach a hub from a test.
VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


_ipc_dir: Path | None = None


def vllm_ipc_dir() -> Path:
    """Where this test session's vLLM processes put their ZMQ IPC sockets
    (``VLLM_RPC_BASE_PATH``; by default the temp dir itself, where every engine run left
    a few uuid-named sockets behind). Removed when the session ends."""
    global _ipc_dir
    if _ipc_dir is None:
        _ipc_dir = Path(tempfile.mkdtemp(prefix="kvcache-vllm-ipc-"))
        atexit.register(shutil.rmtree, _ipc_dir, ignore_errors=True)
    return _ipc_dir


def vllm_env() -> dict[str, str]:
    """The environment of every vLLM process: ours, without the project venv, plus VLLM_ENV
    and the session's IPC socket directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(VLLM_ENV)
    env["VLLM_RPC_BASE_PATH"] = str(vllm_ipc_dir())
    return env


def build_vllm_python() -> Path:
    """The vLLM venv's python, built by scripts/vllm-venv.sh if it is not there yet."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "vllm-venv.sh")],
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=1500,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            "scripts/vllm-venv.sh could not build the vLLM venv this tier needs "
            f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    python = Path(proc.stdout.strip().splitlines()[-1])
    assert python.exists(), python
    return python


def run(cmd: list[str], log: Path, timeout: int) -> None:
    """Run ``cmd`` to the end, its output in ``log``; a failure fails the test with the tail."""
    with log.open("wb") as fh:
        proc = subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=vllm_env(), timeout=timeout, check=False
        )
    if proc.returncode != 0:
        fail(cmd, proc.returncode, log)


def fail(cmd: list[str], code: int | None, log: Path) -> None:
    tail = log.read_bytes()[-6000:].decode(errors="replace")
    pytest.fail(f"{cmd[1]} exited with {code}; log {log}:\n{tail}")


@dataclass
class EngineRun:
    """What one engine process reported."""

    phases: dict[str, dict[str, Any]]
    final: dict[str, dict[str, Any]]

    def tokens(self, phase: str) -> list[int]:
        toks: list[int] = self.phases[phase]["tokens"][0]
        return toks

    def delta(self, phase: str, role: str) -> dict[str, int]:
        out: dict[str, int] = self.phases[phase]["stats_delta"][role]
        return out

    @classmethod
    def read(cls, path: Path) -> EngineRun:
        result = json.loads(path.read_text())
        return cls({p["name"]: p for p in result["phases"]}, result["final_stats"])


def engine_spec(
    model: Path,
    workdir: Path,
    name: str,
    prompts: dict[str, list[int]],
    cluster: LocalCluster | None,
    *,
    max_tokens: int,
    hold: bool = False,
    kv_events: bool = False,
    **settings: Any,
) -> tuple[Path, Path]:
    """Write one engine run's spec; (spec path, output path). ``settings`` are added to the
    connector's extra config; ``kv_events`` turns vLLM's KV events on (run_engine.py)."""
    stats_dir = workdir / f"{name}-stats"
    connector = None
    if cluster is not None:
        connector = {
            "cluster_file": str(cluster.cluster_file),
            "credentials_file": str(cluster.credentials_file),
            "traffic_class": "chat",
            "timeout_s": 5.0,
            "stats_dir": str(stats_dir),
            **settings,
        }
    spec = {
        "model": str(model),
        "connector": connector,
        "stats_dir": str(stats_dir) if connector else None,
        "hold": hold,
        "kv_events": kv_events,
        "phases": [
            {"name": key, "prompts": [prompt], "max_tokens": max_tokens}
            for key, prompt in prompts.items()
        ],
    }
    spec_path = workdir / f"{name}-spec.json"
    spec_path.write_text(json.dumps(spec))
    return spec_path, workdir / f"{name}-out.json"


def run_engine(
    python: Path,
    model: Path,
    workdir: Path,
    name: str,
    prompts: dict[str, list[int]],
    cluster: LocalCluster | None,
    *,
    max_tokens: int,
    **settings: Any,
) -> EngineRun:
    """One engine process over ``prompts`` (one generate call each), with or without the
    connector, to its end."""
    spec, out = engine_spec(
        model, workdir, name, prompts, cluster, max_tokens=max_tokens, **settings
    )
    run(
        [str(python), str(E2E / "run_engine.py"), str(spec), str(out)],
        workdir / f"{name}.log",
        ENGINE_TIMEOUT_S,
    )
    return EngineRun.read(out)


class HeldEngine:
    """An engine process that ran its phases and stays up (serving its SWA states to peers)
    until :meth:`release`; it says it is ready on its stdout, so no test waits by sleeping."""

    def __init__(
        self,
        python: Path,
        model: Path,
        workdir: Path,
        name: str,
        prompts: dict[str, list[int]],
        cluster: LocalCluster,
        *,
        max_tokens: int,
        **settings: Any,
    ) -> None:
        spec, self.out = engine_spec(
            model, workdir, name, prompts, cluster, max_tokens=max_tokens, hold=True, **settings
        )
        self.log = workdir / f"{name}.log"
        self.cmd = [str(python), str(E2E / "run_engine.py"), str(spec), str(self.out)]
        self._log = self.log.open("wb")
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=vllm_env(),
        )
        assert self.proc.stdout is not None
        ready = False
        # An engine that hangs before it is ready is killed, which ends the read below.
        watchdog = threading.Timer(ENGINE_TIMEOUT_S, self.proc.kill)
        watchdog.start()
        try:
            for line in self.proc.stdout:  # ends when the process exits
                self._log.write(line)
                if line.strip() == READY.encode():
                    ready = True
                    break
        finally:
            watchdog.cancel()
        if not ready:
            self.proc.wait(ENGINE_TIMEOUT_S)
            self._log.close()
            fail(self.cmd, self.proc.returncode, self.log)
        self._drain = threading.Thread(
            target=_copy, args=(self.proc.stdout, self._log), daemon=True
        )
        self._drain.start()

    def release(self) -> EngineRun:
        """Let the engine shut down; what it reported."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()
        code = self.proc.wait(ENGINE_TIMEOUT_S)
        self._drain.join(10)
        self._log.close()
        if code != 0:
            fail(self.cmd, code, self.log)
        return EngineRun.read(self.out)

    def kill(self) -> None:
        """Stop the engine process we started (teardown after a failure)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if not self._log.closed:
            self._log.close()


def _copy(src: IO[bytes], dst: IO[bytes]) -> None:
    for line in src:
        if not dst.closed:
            dst.write(line)
