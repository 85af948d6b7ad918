"""The small items of issue 18, point 10: each mistake gets a clear error, not a traceback,
a quiet miss or a success it did not earn."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache.cli import main
from kvcache.client import Client
from kvcache.errors import ClosedError, ConfigError
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster

SMALL = KVLayout(tokens_per_block=16, bytes_per_token=64, dtype=DType.INT8, layers_in_block=1)


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("three-nodes"))
    cluster.start(nodes=3, capacity="16MiB")
    yield cluster
    cluster.stop()


def _server(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "server", "--data-dir", str(tmp_path / "data"),
         "--listen", "tcp://127.0.0.1:0", "--admin-listen", "127.0.0.1:0", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_ready_file_in_a_missing_directory_is_refused_before_serving(tmp_path: Path) -> None:
    done = _server(tmp_path, "--ready-file", str(tmp_path / "missing" / "ready.json"))
    assert done.returncode == 1
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "missing").exists()


def test_credentials_without_tenants_are_refused(tmp_path: Path) -> None:
    creds = tmp_path / "creds.toml"
    creds.write_text('admin_token = "' + "a" * 32 + '"\n')
    os.chmod(creds, 0o600)
    done = _server(tmp_path, "--credentials", str(creds))
    assert done.returncode == 1
    assert "no tenant" in done.stderr and "Traceback" not in done.stderr


def test_missing_tls_ca_is_a_config_error(three_nodes: LocalCluster, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_ca"):
        Client(three_nodes.client_config(tls_ca=str(tmp_path / "no-such-ca.pem")))


@pytest.mark.parametrize("field", ["tenant", "model", "revision", "parallel"])
def test_namespace_fields_of_the_wrong_type_are_config_errors(field: str) -> None:
    kwargs: dict[str, object] = {"model": "m", "revision": "1", field: 5}
    with pytest.raises(ConfigError, match=f"Namespace.{field} must be a str"):
        Namespace(layout=SMALL, **kwargs)  # type: ignore[arg-type]


def test_calls_after_close_raise(three_nodes: LocalCluster) -> None:
    ns = Namespace(model="closed", revision="1", layout=SMALL)
    toks = np.arange(32, dtype=np.uint32)
    client = Client(three_nodes.client_config(k=2, m=1, min_write_shards=3))
    payloads = [np.zeros(SMALL.payload_bytes, np.uint8)] * 2
    assert client.store(ns, toks, payloads).written == 2
    client.close()
    for call in (
        lambda: client.match_prefix(ns, toks),
        lambda: client.load_prefix(ns, toks),
        lambda: client.store(ns, toks, payloads),
        lambda: client.touch(ns, toks),
        lambda: client.delete(ns, toks),
    ):
        with pytest.raises(ClosedError, match="after close"):
            call()
    client.close()  # still idempotent


def test_repair_fails_when_no_node_is_reachable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = LocalCluster(tmp_path / "gone")
    cluster.start(nodes=1, capacity="16MiB")
    cluster.stop()
    code = main(["repair", "--cluster-file", str(cluster.cluster_file),
                 "--credentials", str(cluster.credentials_file)])  # fmt: skip
    assert code == 1
    assert "no node of the cluster could be reached" in capsys.readouterr().err
