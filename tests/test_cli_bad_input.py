"""Bad files, flags and environment values given to the shipped ``kvcache`` commands: each
is one line saying what is wrong and a nonzero exit, never a traceback, a hang, or a value
quietly bent into another (a probe of every command found these)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NODE = 'epoch = 1\n[[nodes]]\nid = "node-00"\ndata = "tcp://127.0.0.1:1"\n'

#: name -> (files to write, argv, extra environment, what the error must say)
CASES: dict[str, tuple[dict[str, str], list[str], dict[str, str], str]] = {
    "cluster file: nodes not tables": (
        {"c.toml": "epoch = 1\nnodes = [1, 2]\n"},
        ["node", "list", "--cluster-file", "c.toml"],
        {},
        "a node entry must be a table",
    ),
    "cluster file: admin not a string": (
        {"c.toml": NODE + "admin = 5\n"},
        ["node", "list", "--cluster-file", "c.toml"],
        {},
        "admin address 5",
    ),
    "cluster file: weight not a number": (
        {"c.toml": NODE + 'weight = "heavy"\n'},
        ["node", "list", "--cluster-file", "c.toml"],
        {},
        "weight must be a number",
    ),
    "cluster file: epoch not an integer": (
        {"c.toml": NODE.replace("epoch = 1", 'epoch = "abc"')},
        ["node", "list", "--cluster-file", "c.toml"],
        {},
        "epoch must be an integer",
    ),
    "cluster file: fractional epoch": (
        {"c.toml": NODE.replace("epoch = 1", "epoch = 1.7")},
        ["node", "list", "--cluster-file", "c.toml"],
        {},
        "epoch must be an integer",
    ),
    "cluster file: domain not a string": (
        {"c.toml": NODE + "domain = 5\n"},
        ["node", "list", "--cluster-file", "c.toml"],
        {},
        "domain must be a string",
    ),
    "cluster file: etcd port out of range": (
        {"c.toml": '[etcd]\nendpoints = ["http://127.0.0.1:99999"]\n'},
        ["node", "list", "--cluster-file", "c.toml"],
        {},
        "must look like http://host:port",
    ),
    "local cluster: damaged process records": (
        {
            "d/cluster.toml": NODE + 'admin = "http://127.0.0.1:1"\n',
            "d/nodes.json": '{"node-00": {"pid": "abc"}}',
        },
        ["status", "--dir", "d"],
        {},
        "process records",
    ),
    "server: sync interval infinite": (
        {},
        [
            "server",
            "--data-dir",
            "data",
            "--listen",
            "tcp://127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        {"KVCACHE_SERVER_SYNC_INTERVAL_S": "inf"},
        "finite",
    ),
    "server: replace_after_s not a number": (
        {},
        [
            "server",
            "--data-dir",
            "data",
            "--listen",
            "tcp://127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        {"KVCACHE_SERVER_REPLACE_AFTER_S": "nan"},
        "finite",
    ),
    "server: a fraction where an integer belongs": (
        {"s.toml": "[server]\nmax_items = 1.5\n"},
        ["server", "--config", "s.toml", "--data-dir", "data"],
        {},
        "must be int",
    ),
    "server: an empty data directory": (
        {},
        ["server", "--data-dir", ""],
        {},
        "non-empty path is needed",
    ),
    "server: ready file is a directory": (
        {"adir/keep": ""},
        ["server", "--data-dir", "data", "--ready-file", "adir"],
        {},
        "must name a file",
    ),
    "up: negative failure domains": (
        {},
        ["up", "--nodes", "2", "--domains", "-1", "--dir", "c"],
        {},
        "--domains must be >= 1",
    ),
    "demo: a negative limit": (
        {},
        ["demo", "--nodes", "2", "--limit", "-1", "--dir", "c"],
        {},
        "--limit must be >= 1",
    ),
    "demo: --json is a directory": (
        {"adir/keep": ""},
        ["demo", "--nodes", "2", "--limit", "3", "--json", "adir", "--dir", "c"],
        {},
        "is a directory",
    ),
    "sim: no repair bandwidth": (
        {},
        [
            "sim",
            "durability",
            "--nodes",
            "13",
            "--keys",
            "100",
            "--durability-nodes",
            "13",
            "--per-node-gbps",
            "0",
        ],
        {},
        "must be > 0",
    ),
    "sim: a lifetime that is not a number": (
        {},
        [
            "sim",
            "durability",
            "--nodes",
            "13",
            "--keys",
            "100",
            "--durability-nodes",
            "13",
            "--lifetime-days",
            "nan",
        ],
        {},
        "finite number",
    ),
    "events: a replay endpoint that is no endpoint": (
        {},
        ["events", "--endpoint", "tcp://127.0.0.1:7", "--replay-endpoint", "bogus", "--no-auth"],
        {},
        "must be tcp://host:port",
    ),
    "dashboard: a misspelled table": (
        {"d.toml": "[dashbord]\nport = 9000\n"},
        ["dashboard", "--config", "d.toml"],
        {},
        "unknown table(s) ['dashbord']",
    ),
    "events: a daemon that never answers": (
        {},
        ["events", "--endpoint", "tcp://127.0.0.1:1", "--no-auth"],
        {},
        "never answered",
    ),
    "events: a negative count": (
        {},
        ["events", "--endpoint", "tcp://127.0.0.1:1", "--no-auth", "--count", "-3"],
        {},
        "-3 is negative",
    ),
    "events: a negative sequence number": (
        {},
        ["events", "--endpoint", "tcp://127.0.0.1:1", "--no-auth", "--from-seq", "-1"],
        {},
        "-1 is negative",
    ),
    "swa simulate: a timestamp past any clock": (
        {"t.jsonl": '{"timestamp": 1' + "0" * 400 + ', "input_length": 512, "hash_ids": [1]}\n'},
        ["swa", "simulate", "--trace", "t.jsonl"],
        {},
        "timestamp out of range",
    ),
    "swa simulate: a trace out of arrival order": (
        {
            "t.jsonl": '{"timestamp": 5000, "input_length": 512, "hash_ids": [1]}\n'
            '{"timestamp": 10, "input_length": 512, "hash_ids": [2]}\n'
        },
        ["swa", "simulate", "--trace", "t.jsonl"],
        {},
        "give the requests in arrival order",
    ),
    "swa simulate: a negative timestamp": (
        {"t.jsonl": '{"timestamp": -1000, "input_length": 512, "hash_ids": [1]}\n'},
        ["swa", "simulate", "--trace", "t.jsonl"],
        {},
        "timestamp out of range",
    ),
    "repair: interval not a number": (
        {"c.toml": NODE},
        [
            "repair",
            "--cluster-file",
            "c.toml",
            "--credentials",
            "creds.toml",
            "--follow",
            "--interval",
            "nan",
        ],
        {},
        "--interval must be",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_clear_error(tmp_path: Path, case: str) -> None:
    files, argv, env, message = CASES[case]
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", *argv],
        cwd=tmp_path,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "data.mdb").exists()  # nothing written into the working directory


def test_a_tenant_named_admin_is_refused_at_the_daemons_start(tmp_path: Path) -> None:
    """``admin`` is the event stream's superuser: a tenant of that name read every tenant's
    events (its own events token logged it in as the superuser when the cluster had no admin
    token). The name is reserved, and a daemon given such a file says so and does not start."""
    creds = tmp_path / "creds.toml"
    creds.write_text(f'[tenants.admin]\nsecret = "{"ab" * 32}"\n')
    creds.chmod(0o600)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcache.cli",
            "server",
            "--data-dir",
            str(tmp_path / "data"),
            "--credentials",
            str(creds),
            "--listen",
            "tcp://127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "tenant name 'admin' is reserved" in proc.stderr, proc.stderr
