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
    "server: retention not a table": (
        {"s.toml": 'retention = "agent=3d"\n'},
        ["server", "--config", "s.toml", "--data-dir", "d"],
        {},
        "[retention] must be a table",
    ),
    "server: retention an empty list": (
        {"s.toml": "retention = []\n"},
        ["server", "--config", "s.toml", "--data-dir", "d"],
        {},
        "[retention] must be a table",
    ),
    "server: a high-water mark past a C int": (
        {"s.toml": "[server]\nevents_hwm = 10000000000\n"},
        ["server", "--config", "s.toml", "--data-dir", "d"],
        {},
        "events_hwm must be at most 2147483645",
    ),
    "server: a sync interval past any wait": (
        {"s.toml": "[server]\nsync_interval_s = 1e10\n"},
        ["server", "--config", "s.toml", "--data-dir", "d"],
        {},
        "sync_interval_s must be at most 31536000 s",
    ),
    "server: a replay endpoint without a stream": (
        {},
        ["server", "--data-dir", "d", "--events-replay-listen", "tcp://127.0.0.1:0"],
        {},
        "events_replay_listen is set but events_listen is not",
    ),
    "server: a replay port past the last port": (
        {},
        [
            "server",
            "--data-dir",
            "d",
            "--listen",
            "tcp://127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--events-listen",
            "tcp://127.0.0.1:65535",
        ],
        {},
        "cannot bind the replay endpoint tcp://127.0.0.1:65536",
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


def test_a_config_file_shared_with_the_other_components_starts_the_daemon(
    tmp_path: Path,
) -> None:
    """docs/dashboard.md says one file may hold every component's table; the daemon refused
    [client], [swa] and [dashboard] (it still refuses a misspelled table)."""
    shared = tmp_path / "kvcache.toml"
    shared.write_text(
        '[server]\nnode_id = "n1"\ncapacity_bytes = "64MiB"\n'
        '[retention.classes]\nagent = "3d"\n'
        "[client]\ntimeout_s = 3.0\n[swa]\nttl_s = 60\n[dashboard]\nport = 9000\n"
    )
    from kvcache.server.config import load_server_config

    config, policy = load_server_config(shared, environ=False)
    assert config.node_id == "n1" and policy.ttl_s("agent") == 3 * 86_400
    (tmp_path / "bad.toml").write_text("[sever]\nnode_id = 'x'\n")
    from kvcache.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown table\(s\) \['sever'\]"):
        load_server_config(tmp_path / "bad.toml", environ=False)


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
