"""Polling the cluster for the status page: every node's ``/stats``, at most once a second.

A :class:`Collector` belongs to one asyncio loop (the admin server's, or
``kvcache dashboard``'s). It polls only when the page asks (each open page
asks every ``refresh_s``; several viewers share one poll), so an unwatched
cluster costs nothing; the history the page draws is kept from those polls.
The cluster file is read again at every poll, so an edited map shows at once.
The node serving the page answers for itself without HTTP (``local``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvcache.cluster import ClusterMap, NodeInfo
from kvcache.dashboard.samples import ClusterSample, History, NodePoll
from kvcache.dashboard.view import ViewContext, build_view
from kvcache.errors import ConfigError

__all__ = ["Collector", "LocalNode"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalNode:
    """The daemon serving the page: its map entry (when no cluster file is configured) and
    its ``/stats`` without a round trip."""

    info: NodeInfo
    stats: Callable[[], Mapping[str, Any]]


class Collector:
    """Polls the cluster and builds the page's document (see the module docstring)."""

    def __init__(
        self,
        *,
        cluster_file: Path | None,
        local: LocalNode | None = None,
        served_by: str = "kvcache dashboard",
        refresh_s: float = 2.0,
        timeout_s: float = 1.0,
        history: History | None = None,
        clock: Callable[[], float] = time.time,
        auth: str = "token",
    ) -> None:
        if cluster_file is None and local is None:
            raise ConfigError("the status page needs a cluster file or a local node to show")
        if not refresh_s > 0 or not timeout_s > 0:
            raise ConfigError(f"refresh_s and timeout_s must be > 0, got {refresh_s}, {timeout_s}")
        self.cluster_file = cluster_file
        self.local = local
        self.served_by = served_by
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.history = history or History()
        self.auth = auth
        self._clock = clock
        self._last_seen: dict[str, float] = {}
        self._view: dict[str, Any] | None = None
        self._polled_at = float("-inf")
        self._lock: asyncio.Lock | None = None
        self._session: aiohttp.ClientSession | None = None

    async def view(self) -> dict[str, Any]:
        """The latest document, polling first if the last poll is older than half the
        refresh interval (concurrent callers share one poll)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._view is None or self._clock() - self._polled_at >= self.refresh_s / 2:
                self._view = await self._poll()
                self._polled_at = self._clock()
            return self._view

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ internals

    def _nodes(self) -> tuple[list[NodeInfo], int | None, str, str]:
        """(nodes, epoch, source, error) from the cluster file, or the local node alone."""
        if self.cluster_file is None:
            assert self.local is not None  # checked in __init__
            return [self.local.info], None, "this node only (no cluster_file configured)", ""
        try:
            cmap = ClusterMap.load(self.cluster_file)
        except ConfigError as exc:
            log.warning("status page: cannot read the cluster file: %s", exc)
            nodes = [self.local.info] if self.local is not None else []
            return nodes, None, str(self.cluster_file), str(exc)
        return list(cmap.nodes), cmap.epoch, str(self.cluster_file), ""

    async def _poll(self) -> dict[str, Any]:
        nodes, epoch, source, error = self._nodes()
        polls = list(await asyncio.gather(*(self._poll_node(n) for n in nodes)))
        now = self._clock()
        for p in polls:
            if p.ok:
                self._last_seen[p.node.id] = p.at
        view = build_view(
            polls,
            now=now,
            history=self.history,
            last_seen=self._last_seen,
            context=ViewContext(
                served_by=self.served_by,
                cluster_source=source,
                cluster_epoch=epoch,
                cluster_error=error,
                refresh_ms=int(self.refresh_s * 1000),
                auth=self.auth,
            ),
        )
        self.history.add(ClusterSample.of(now, polls))
        return view

    async def _poll_node(self, node: NodeInfo) -> NodePoll:
        started = time.perf_counter()
        if self.local is not None and node.id == self.local.info.id:
            return NodePoll(
                node=node,
                at=self._clock(),
                stats=self.local.stats(),
                seconds=time.perf_counter() - started,
            )
        if not node.admin:
            return NodePoll(node=node, at=self._clock(), error="no admin address in the map")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        try:
            async with self._session.get(f"{node.admin}/stats") as resp:
                if resp.status != 200:
                    error = f"/stats answered HTTP {resp.status}"
                    return NodePoll(node=node, at=self._clock(), error=error)
                stats = json.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            error = _describe(exc, self.timeout_s)
            return NodePoll(
                node=node, at=self._clock(), error=error, seconds=time.perf_counter() - started
            )
        if not isinstance(stats, Mapping):
            return NodePoll(node=node, at=self._clock(), error="/stats is not a JSON object")
        return NodePoll(
            node=node, at=self._clock(), stats=stats, seconds=time.perf_counter() - started
        )


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "cannot connect: connection refused (daemon not running?)"
        return f"cannot connect: {exc.os_error.strerror or exc.os_error}"
    if isinstance(exc, ValueError):
        return "/stats is not JSON"
    return f"{type(exc).__name__}: {exc}"
