"""The retention CLI against a real cluster, and the pure policy simulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache.retention.cli import main
from kvcache.retention.policy import DAY_S, RetentionPolicy
from kvcache.retention.simulate import simulate
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import Request


def req(t_s: float, ids: list[int], cls: str = "chat") -> Request:
    return Request(timestamp_ms=int(t_s * 1000), input_length=512 * len(ids), output_length=1,
                   hash_ids=tuple(ids), traffic_class=cls)  # fmt: skip


def test_simulation_expires_by_class_and_slides_on_hits() -> None:
    policy = RetentionPolicy(
        classes={"agent": 100, "chat": 300, "default": 100}, default_class="default"
    )
    trace = [
        req(0, [1, 2], "agent"),
        req(50, [1, 2, 3], "agent"),  # hits 2 blocks, slides them to 150
        req(140, [1, 2, 3], "agent"),  # all live until 150; slides to 240
        req(260, [1, 2], "agent"),  # expired at 240
        req(270, [7], "chat"),
        req(560, [7], "chat"),  # chat lives 300 s: hit
    ]
    res = simulate(trace, policy, touch_resolution_s=1)
    assert res.hit_tokens == 512 * (0 + 2 + 3 + 0 + 0 + 1)
    assert res.input_tokens == 512 * 12
    assert res.peak_blocks == 3
    assert res.expirations == 5  # 1, 2, 3 at 240 s; 1, 2 again at 360 s


def test_longer_class_wins_on_a_shared_block() -> None:
    policy = RetentionPolicy(classes={"agent": 100, "chat": 1000}, default_class="chat")
    res = simulate([req(0, [1], "chat"), req(10, [1], "agent"), req(500, [1], "agent")], policy)
    assert res.hit_tokens == 2 * 512


def test_defaults_keep_a_day_old_chat_block() -> None:
    res = simulate([req(0, [1]), req(6 * DAY_S, [1]), req(14 * DAY_S, [1])], RetentionPolicy())
    assert res.hit_tokens == 512


def test_cli_show_set_reset_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = LocalCluster(tmp_path / "c").start(nodes=3, capacity="64MiB")
    try:
        cfile = str(cluster.cluster_file)
        assert main(["show", "--cluster", cfile]) == 0
        out = capsys.readouterr().out
        assert out.count("agent=3d, chat=7d") == 3
        assert main(["set", "--cluster", cfile, "--classes", "agent=1d,chat=14d,default=1d"]) == 0
        capsys.readouterr()
        assert main(["show", "--cluster", cfile]) == 0
        assert capsys.readouterr().out.count("agent=1d, chat=14d") == 3
        # Bounds on hints' TTLs: set, kept by a later set of classes alone (a policy PUT
        # replaces the whole policy, and such a set used to erase them), shown, cleared.
        classes = ["--classes", "agent=1d,chat=14d,default=1d"]
        assert main(["set", "--cluster", cfile, *classes, "--ttl-bounds", "chat=1h..14d"]) == 0
        assert capsys.readouterr().out.count("ttl bounds: chat=1h..14d") == 3
        assert main(["set", "--cluster", cfile, "--classes", "agent=2d,chat=14d,default=1d"]) == 0
        assert main(["show", "--cluster", cfile]) == 0
        out = capsys.readouterr().out
        assert out.count("agent=2d, chat=14d") == 6 and out.count("chat=1h..14d") == 6  # set, show
        assert main(["set", "--cluster", cfile, *classes, "--ttl-bounds", "none"]) == 0
        assert "ttl bounds" not in capsys.readouterr().out
        assert main(["reset", "--cluster", cfile]) == 0
        assert capsys.readouterr().out.count("agent=3d, chat=7d") == 3
        assert main(["usage", "--cluster", cfile]) == 0
        assert "class" in capsys.readouterr().out
        assert main(["set", "--cluster", cfile, "--classes", "agent=0s"]) == 1
        # Without the admin token, nothing changes.
        assert (
            main(["set", "--cluster", cfile, "--token", "wrong" * 4, "--classes", "agent=1s"]) == 1
        )
        assert "401" in capsys.readouterr().out
        assert main(["show", "--cluster", cfile]) == 0
        assert capsys.readouterr().out.count("agent=3d, chat=7d") == 3
    finally:
        cluster.stop()


def test_cli_simulate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": t, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
            )
            for t in (0, 60_000, 7_200_000)
        )
    )
    assert main(["simulate", "--trace", str(trace), "--sweep", "1h", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rates = {r["policy"]: r["hit_rate"] for r in out["results"]}
    assert rates["all=1h"] == pytest.approx(1 / 3)
    assert rates["agent=3d,chat=7d,default=3d"] == pytest.approx(2 / 3)


BAD_INPUT = {
    "trace timestamp past any integer": (["simulate", "--trace", "{inf}"], "not a trace record"),
    "trace not UTF-8": (["simulate", "--trace", "{binary}"], "not UTF-8"),
    "trace with a negative input length": (
        ["simulate", "--trace", "{negative}"],
        "negative.jsonl:2: not a trace record: request at 5 ms: input_length must be >= 0",
    ),
    "plan of a trace not UTF-8": (["plan", "--trace", "{binary}"], "not UTF-8"),
    "cluster file not UTF-8": (["show", "--cluster", "{binary}"], "cannot read config file"),
    "high watermark 0": (
        ["plan", "--trace", "{good}", "--high-watermark", "0"],
        "watermarks must satisfy",
    ),
    "high watermark nan": (
        ["plan", "--trace", "{good}", "--high-watermark", "nan"],
        "watermarks must satisfy",
    ),
    "negative block bytes": (["plan", "--trace", "{good}", "--block-bytes", "-5"], ">= 1"),
    "negative capacity": (
        ["simulate", "--trace", "{good}", "--capacity-blocks", "-1"],
        "at least one block",
    ),
    "a class named twice": (
        ["simulate", "--trace", "{good}", "--classes", "agent=3d,agent=4d"],
        "named twice",
    ),
    "negative seed": (["generate", "--out", "{out}", "--seed", "-1"], "seed must be >= 0"),
    "output is a directory": (["generate", "--out", "{dir}"], "Is a directory"),
    "rate nan": (["generate", "--out", "{out}", "--agent-rate", "nan"], "finite"),
    "rate inf": (["generate", "--out", "{out}", "--agent-rate", "inf"], "finite"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_a_clear_error_never_a_traceback_or_a_hang(tmp_path: Path, case: str) -> None:
    """Each bad file or flag (found by a probe that crashed or hung the CLI on them) gets
    one line saying what is wrong, and exit status 1 or 2, from the installed command."""
    import subprocess
    import sys

    (tmp_path / "inf.jsonl").write_text(
        '{"timestamp": 1e400, "input_length": 512, "hash_ids": [1]}\n'
    )
    (tmp_path / "binary.bin").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "negative.jsonl").write_text(
        '{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": -5, "hash_ids": []}\n'
    )
    (tmp_path / "good.jsonl").write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}\n'
    )
    (tmp_path / "adir").mkdir()
    names = {
        "inf": tmp_path / "inf.jsonl",
        "binary": tmp_path / "binary.bin",
        "negative": tmp_path / "negative.jsonl",
        "good": tmp_path / "good.jsonl",
        "dir": tmp_path / "adir",
        "out": tmp_path / "out.jsonl",
    }
    argv, message = BAD_INPUT[case]
    args = [a.format(**names) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "retention", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("kvcache: error:") or "error:" in proc.stderr
    assert message in proc.stderr
