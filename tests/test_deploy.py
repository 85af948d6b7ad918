"""deploy/: the Dockerfile (hadolint, and parsed), the systemd unit (systemd-analyze, and its
ExecStart against ``kvcache server``'s own parser), the example node config."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.cli import build_parser
from kvcache.server.config import load_server_config, parse_admin_listen
from kvcache.testing.localcluster import DAEMON_ENV
from kvcache.wire import parse_endpoint

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
# Every Dockerfile instruction (https://docs.docker.com/reference/dockerfile/).
INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


def _tool(name: str) -> str:
    path = shutil.which(name, path=f"{Path(sys.executable).parent}:/usr/bin:/bin:/usr/local/bin")
    if path is None:
        pytest.fail(f"{name} is needed: run scripts/install.sh")
    return path


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "the file ends inside a continued instruction"
    return out


def _env_pairs(args: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(args))


def test_hadolint_passes_the_dockerfile_and_catches_a_bad_one(tmp_path: Path) -> None:
    hadolint = _tool("hadolint")
    result = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /src && pip install .\nUSER kvcache\n")
    result = subprocess.run([hadolint, str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3006" in result.stdout  # an untagged base image


def test_dockerfile_runs_kvcache_server_with_a_healthcheck() -> None:
    steps = dockerfile_instructions((DEPLOY / "Dockerfile").read_text())
    assert all(keyword in INSTRUCTIONS for keyword, _ in steps), steps
    assert steps[0][0] == "FROM"
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    final = steps[last_from:]
    by_kind: dict[str, list[str]] = {}
    for keyword, args in final:
        by_kind.setdefault(keyword, []).append(args)

    assert json.loads(by_kind["ENTRYPOINT"][-1]) == ["kvcache", "server"]
    assert "CMD" not in by_kind  # flags given to `docker run` go straight to kvcache server
    env = {k: v for args in by_kind["ENV"] for k, v in _env_pairs(args).items()}
    admin_host, admin_port = parse_admin_listen(env["KVCACHE_SERVER_ADMIN_LISTEN"])
    data_port = parse_endpoint(env["KVCACHE_SERVER_LISTEN"])[1]
    assert admin_host == "0.0.0.0"
    assert set(by_kind["EXPOSE"][-1].split()) == {str(data_port), str(admin_port)}
    assert json.loads(by_kind["VOLUME"][-1]) == [env["KVCACHE_SERVER_DATA_DIR"]]
    for name, value in DAEMON_ENV.items():
        assert env[name] == value, name

    healthcheck = by_kind["HEALTHCHECK"][-1]
    options, _, command = healthcheck.partition(" CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv = json.loads(command)
    assert argv[0] == "python" and f"http://127.0.0.1:{admin_port}/healthz" in argv[-1]
    compile(argv[-1], "<healthcheck>", "exec")  # valid Python

    # The image's environment is a valid daemon configuration.
    server_env = {k: v for k, v in env.items() if k.startswith("KVCACHE_SERVER_")}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server_env.items():
            mp.setenv(key, value)
        config, _ = load_server_config(None)
    assert str(config.data_dir) == env["KVCACHE_SERVER_DATA_DIR"]
    assert config.listen == env["KVCACHE_SERVER_LISTEN"]

    for keyword, args in steps:  # what the build copies exists, and the ignore file keeps it
        if keyword == "COPY" and not args.startswith("--from"):
            for source in shlex.split(args)[:-1]:
                assert (REPO / source).exists(), source
    kept = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert {"!pyproject.toml", "!README.md", "!kvcache/"} <= set(kept)


def _unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections[current] = []
            continue
        assert current is not None, f"setting outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not key=value: {line}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def test_systemd_unit_execstart_is_a_valid_kvcache_server_command() -> None:
    sections = _unit_sections((DEPLOY / "kvcache-server.service").read_text())
    assert set(sections) == {"Unit", "Service", "Install"}
    service = sections["Service"]
    (exec_start,) = [v for k, v in service if k == "ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/kvcache/bin/kvcache"
    args = build_parser().parse_args(argv[1:])  # exits (fails the test) on an unknown flag
    assert args.command == "server" and args.log_format == "json"
    assert args.config == Path("/etc/kvcache/node.toml")
    assert args.credentials_file == Path("/etc/kvcache/credentials.toml")
    assert args.cluster_file == Path("/etc/kvcache/cluster.toml")
    env = dict(v.split("=", 1) for k, v in service if k == "Environment")
    assert env == DAEMON_ENV
    settings = dict(service)
    assert settings["KillSignal"] == "SIGTERM" and settings["User"] == "kvcache"
    assert ("WantedBy", "multi-user.target") in sections["Install"]


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    kvcache = Path(sys.executable).parent / "kvcache"
    text = (DEPLOY / "kvcache-server.service").read_text()
    unit = tmp_path / "kvcache-server.service"
    unit.write_text(text.replace("/opt/kvcache/bin/kvcache", str(kvcache)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0 and "kvcache-server.service" not in result.stderr, result.stderr
    broken = tmp_path / "broken.service"
    broken.write_text(text.replace("/opt/kvcache/bin/kvcache", str(tmp_path / "missing")))
    result = subprocess.run([analyze, "verify", str(broken)], capture_output=True, text=True)
    assert result.returncode != 0  # the check can fail


def test_example_node_config_loads() -> None:
    config, policy = load_server_config(DEPLOY / "node.toml", environ=False)
    assert config.node_id == "ssd-07" and config.capacity_bytes == 3 << 40
    assert str(config.data_dir) == "/var/lib/kvcache"
    assert policy.ttl_s("chat") == 7 * 86400
