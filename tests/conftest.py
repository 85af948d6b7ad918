"""Shared fixtures: real local clusters of storage daemons on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcache.testing.localcluster import LocalCluster


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Start local clusters under tmp_path; every one is stopped at teardown."""
    started: list[LocalCluster] = []

    def make(nodes: int = 12, **kwargs: object) -> LocalCluster:
        cluster = LocalCluster(tmp_path / f"cluster-{len(started)}")
        started.append(cluster)
        return cluster.start(nodes=nodes, capacity="256MiB", **kwargs)  # type: ignore[arg-type]

    yield make
    for cluster in started:
        cluster.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One healthy 12-node cluster for tests that do not harm it."""
    cluster = LocalCluster(tmp_path_factory.mktemp("shared-cluster"))
    cluster.start(nodes=12, capacity="512MiB")
    yield cluster
    cluster.stop()
