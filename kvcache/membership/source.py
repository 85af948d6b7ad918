"""Where a client (or a daemon's repairer) gets the cluster map from, and hears of changes.

:func:`open_source` reads a cluster file: with an ``[etcd]`` table it returns
an :class:`EtcdSource` (a snapshot, then a watch: every change under the
prefix triggers a fresh snapshot, so what is delivered is always one
consistent revision), otherwise a :class:`FileSource` (the static file, read
again when it changes on disk, which is what ``kvcache node`` edits). Both run
one background thread and call ``deliver`` with a
:class:`~kvcache.client.view.Membership` on every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvcache.cluster import ClusterMap, EtcdSettings, read_cluster_file
from kvcache.errors import ClusterError, ConfigError
from kvcache.membership.model import Membership

__all__ = ["EtcdSource", "FileSource", "MapSource", "StaticSource", "open_source"]

log = logging.getLogger(__name__)

Deliver = Callable[[Membership], None]


class MapSource(Protocol):
    """A source of cluster maps (see the module docstring)."""

    def initial(self) -> Membership:
        """The membership now (blocking; ClusterError or ConfigError if there is none)."""

    def start(self, deliver: Deliver) -> None:
        """Call ``deliver`` on every later change, from a thread of the source."""

    def close(self) -> None:
        """Stop the thread."""


class StaticSource:
    """A fixed map (a test, or a caller that passed the map itself)."""

    def __init__(self, cluster: ClusterMap) -> None:
        self.cluster = cluster

    def initial(self) -> Membership:
        """The map, every node counted live."""
        return Membership(self.cluster)

    def start(self, deliver: Deliver) -> None:
        """Nothing changes."""

    def close(self) -> None:
        """Nothing to stop."""


class FileSource:
    """A static cluster file, read again when its modification time changes."""

    def __init__(self, path: Path, *, poll_s: float = 1.0) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stamp = self._mtime()

    def _mtime(self) -> int:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return 0

    def initial(self) -> Membership:
        """The file's map."""
        return Membership(ClusterMap.load(self.path))

    def start(self, deliver: Deliver) -> None:
        """Poll the file's modification time every ``poll_s``."""

        def run() -> None:
            while not self._stop.wait(self.poll_s):
                stamp = self._mtime()
                if stamp == self._stamp:
                    continue
                self._stamp = stamp
                try:
                    deliver(Membership(ClusterMap.load(self.path)))
                except ConfigError as exc:
                    log.error("cluster file changed but cannot be used (%s); keeping the map", exc)

        self._thread = threading.Thread(target=run, name="kvcache-cluster-file", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop polling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class EtcdSource:
    """Membership from etcd: a snapshot, then a snapshot after every change.

    ``fallback`` (the nodes a cluster file lists next to ``[etcd]``) is used
    when etcd cannot be reached at start. A broken watch is re-established
    after ``retry_s``; a snapshot is also taken every ``refresh_s`` in case a
    change was missed.
    """

    def __init__(
        self,
        settings: EtcdSettings,
        *,
        fallback: ClusterMap | None = None,
        refresh_s: float = 30.0,
        retry_s: float = 1.0,
        initial_timeout_s: float | None = None,
    ) -> None:
        from kvcache.membership.etcd import EtcdStore

        self.settings = settings
        self.fallback = fallback
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.initial_timeout_s = initial_timeout_s or settings.timeout_s * 2
        self._store = EtcdStore(settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvcache-etcd-watch", daemon=True)
        self._deliver: Deliver | None = None
        self._first = threading.Event()
        self._latest: Membership | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._stopping = asyncio.Event()
        #: Snapshots taken (for tests and /metrics).
        self.snapshots = 0
        self._thread.start()

    def initial(self) -> Membership:
        """The first snapshot (waits up to ``initial_timeout_s``), else the fallback."""
        if not self._first.wait(self.initial_timeout_s) or self._latest is None:
            reason = self._error or "no answer"
            if self.fallback is not None:
                log.warning(
                    "etcd %s: %s; using the nodes listed in the cluster file until it answers",
                    list(self.settings.endpoints),
                    reason,
                )
                return Membership(self.fallback)
            raise ClusterError(
                f"cannot read the cluster map from etcd {list(self.settings.endpoints)} "
                f"(prefix {self.settings.prefix}): {reason}"
            )
        return self._latest

    def start(self, deliver: Deliver) -> None:
        """Deliver every later snapshot that differs from the last one."""
        with self._lock:
            self._deliver = deliver

    def _publish(self, membership: Membership) -> None:
        with self._lock:
            if membership == self._latest:
                return
            self._latest = membership
            deliver = self._deliver
        self._first.set()
        if deliver is not None:
            deliver(membership)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            from kvcache.membership.etcd import close_loop

            close_loop(self._loop, self._store)

    async def _snapshot(self) -> int:
        snap = await self._store.snapshot()
        self.snapshots += 1
        try:
            cluster = snap.cluster
        except ConfigError as exc:
            self._error = exc
            log.info("etcd prefix %s: %s", self.settings.prefix, exc)
            return snap.revision
        self._publish(Membership(cluster, snap.live_ids))
        return snap.revision

    async def _main(self) -> None:
        stopping = self._stopping
        while not stopping.is_set():
            changed = asyncio.Event()
            watch: asyncio.Task[None] | None = None
            try:
                revision = await self._snapshot()
                watch = asyncio.create_task(self._store.watch(revision + 1, changed.set))
                while not stopping.is_set() and not watch.done():
                    change = asyncio.create_task(changed.wait())
                    stop_wait = asyncio.create_task(stopping.wait())
                    await asyncio.wait(
                        [change, stop_wait, watch],
                        timeout=self.refresh_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    change.cancel()
                    stop_wait.cancel()
                    if stopping.is_set():
                        break
                    # Events that arrive while this snapshot is read set ``changed`` again.
                    changed.clear()
                    await self._snapshot()
                if watch.done() and not stopping.is_set():
                    exc = watch.exception()
                    log.warning("etcd watch ended (%s); reconnecting", exc or "closed")
            except ClusterError as exc:
                self._error = exc
                log.warning("etcd membership: %s; retrying in %.1f s", exc, self.retry_s)
            finally:
                if watch is not None and not watch.done():
                    watch.cancel()
            if not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.retry_s)

    def close(self) -> None:
        """Stop watching and join the thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=10)


def open_source(path: str | Path) -> MapSource:
    """The source a cluster file names: etcd if it has an ``[etcd]`` table, else the file."""
    static, etcd = read_cluster_file(path)
    if etcd is not None:
        return EtcdSource(etcd, fallback=static)
    return FileSource(Path(path))
