"""TLS on the data path, end to end through the shipped client and a real cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcache.client import Client
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl, as an operator would make one)."""
    cert, key = directory / "data.crt", directory / "data.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    key.chmod(0o600)
    return cert, key


@pytest.fixture
def tls_cluster(
    tmp_path: Path, cluster_factory: Callable[..., LocalCluster]
) -> tuple[LocalCluster, Path]:
    cert, key = make_certificate(tmp_path)
    # --sendfile-min 4KiB: every GET reply's run of records is a FileRange, which a TLS
    # connection must send from the segment's mapping instead.
    cluster = cluster_factory(
        extra_args=("--tls-cert", str(cert), "--tls-key", str(key), "--sendfile-min", "4KiB")
    )
    return cluster, cert


def test_store_and_load_over_tls(tls_cluster: tuple[LocalCluster, Path]) -> None:
    cluster, cert = tls_cluster
    space = Namespace(model="tls", revision="1", layout=LAYOUT)
    tokens = np.arange(64 * 6, dtype=np.uint32)
    payloads = [payload_for_key(k, LAYOUT.payload_bytes) for k in block_keys(space, tokens)]
    with Client(cluster.client_config(tls_ca=cert)) as client:
        stored = client.store(space, tokens, payloads)
        assert stored.written == 6
        loaded = client.load_prefix(space, tokens)
        assert loaded.blocks == 6
        assert all(np.array_equal(a, b) for a, b in zip(loaded.payloads, payloads, strict=True))


def test_a_plain_client_gets_nothing_from_a_tls_daemon(
    tls_cluster: tuple[LocalCluster, Path],
) -> None:
    cluster, _cert = tls_cluster
    with Client(cluster.client_config(timeout_s=1.0)) as client:
        stats = client.stats()
        assert all("error" in entry for entry in stats.values())
        assert (
            client.match_prefix(
                Namespace(model="tls", revision="1", layout=LAYOUT), np.arange(64, dtype=np.uint32)
            ).hit_blocks
            == 0
        )


def test_a_client_that_does_not_trust_the_certificate_refuses(
    tls_cluster: tuple[LocalCluster, Path], tmp_path: Path
) -> None:
    cluster, _cert = tls_cluster
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_cert, _ = make_certificate(other_dir)
    with Client(cluster.client_config(tls_ca=other_cert, timeout_s=1.0)) as client:
        stats = client.stats()
        assert all(
            "certificate" in entry.get("error", "").lower() or "error" in entry
            for entry in stats.values()
        )
