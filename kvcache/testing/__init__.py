"""Test and benchmark scaffolding that needs real processes: simulated hosts and clusters on them.

* :mod:`kvcache.testing.localcluster`: :class:`LocalCluster`, N daemons on loopback with
  their cluster, credentials and client files (what ``kvcache up`` and ``kvcache demo``
  start, and what the tests and benchmarks run against).
* :mod:`kvcache.testing.hosts`: :class:`HostNet`, one network namespace (or one
  loopback address) per simulated host, and :func:`cleanup_stale`.
* :mod:`kvcache.testing.hostcluster`: :class:`HostCluster`, storage daemons
  spread over those hosts with the host as failure domain.
"""

from __future__ import annotations

from kvcache.testing.hostcluster import HostCluster, HostDaemon
from kvcache.testing.hosts import HostNet, HostNetMode, cleanup_stale

__all__ = ["HostCluster", "HostDaemon", "HostNet", "HostNetMode", "cleanup_stale"]
