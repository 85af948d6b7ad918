"""The LMDB environment of one daemon: opening it, its databases, syncing, and its errors.

Everything here is about the file, not about shards: the data-directory lock,
the named databases, the periodic sync thread, preallocating the data file,
and turning LMDB's and the OS's exceptions into :class:`StorageError` kinds
(by exception type and errno, never by message text), so code above this
module never imports ``lmdb`` for error handling.

**Writemap.** LMDB's ``writemap`` has a write transaction change its pages in
the shared map, where without it every dirty page is a heap copy that the commit
writes back with ``pwrite``. The index's rows are small and land on random leaf
pages (block keys are hashes), so a PUT dirties about a page per shard: with
writemap, a full 512 MiB node's 128-shard PUT cost 0.65x the CPU in process
(``docs/benchmarks.md``, sixteenth pass of issue 17). Its price: LMDB sizes the
data file to the whole map (sparse) at open, and a store through the map into a
hole the file system cannot fill (a full disk) is a ``SIGBUS``, not an error.
So a write transaction begins only once the file is ``fallocate``d far enough
past LMDB's last page for every page it may add (:meth:`LmdbEnvironment.begin_write`);
if that allocation fails the write is refused as ``disk_full``. Where writemap
cannot be had (the file may not grow to the map size, or the file system has no
``fallocate``), the environment opens without it and logs why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from kvcache.errors import StorageError
from kvcache.server.config import DamagedFile, SyncMode
from kvcache.server.lmdb_check import check_data_file
from kvcache.server.segments import SEGMENT_DIR

__all__ = ["QUARANTINE_NAME", "LmdbEnvironment", "storage_error"]

log = logging.getLogger(__name__)

#: The data file is kept allocated this far past what LMDB uses (see preallocate), but at
#: most a 32nd of the map: a small store (a test's) must not take 64 MiB of disk up front.
_PREALLOCATE_BYTES = 64 << 20
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
#: Pages a write transaction may add to the file, at most, per row it changes (a row of the
#: index and one of the expiry index: a leaf, its parent and a split in each), plus a base
#: for any transaction (the free list's own pages, branch pages); generous, because the
#: price of an underestimate on a full disk is a SIGBUS. LMDB itself refuses a transaction
#: that dirties more than 2^17 - 1 pages (MDB_TXN_FULL): none can need more than that.
_PAGES_PER_ROW = 8
_BASE_PAGES = 1024
_MAX_TXN_PAGES = (1 << 17) - 1
_STRERROR = {code: os.strerror(code) for code in (*_DISK_FULL_ERRNOS, errno.EIO)}
#: LMDB's errors that mean the file itself is damaged (not full, not busy). BadTxnError
#: is among them: the store never uses a transaction after an error, and py-lmdb reports a
#: damaged page met inside one of its calls (MDB_CORRUPTED, which marks the transaction
#: failed) as MDB_BAD_TXN from that call's next step; measured on pages whose flags or
#: bounds were overwritten in a live file (tests/test_damaged_files.py).
_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.PanicError,
    lmdb.InvalidError,
    lmdb.BadTxnError,
)
#: Where a data file that failed the start-up check is moved (one kept: it replaces an older).
QUARANTINE_NAME = "data.mdb.damaged"


def storage_error(exc: BaseException, what: str) -> StorageError:
    """A StorageError of the right ``kind`` for an LMDB or OS exception.

    Kinds: ``map_full`` (the LMDB map is too small), ``disk_full`` (ENOSPC,
    EFBIG, EDQUOT), ``disk_io`` (EIO: LMDB reports a short write, which a
    filling disk causes, as EIO), ``corrupted`` (MDB_CORRUPTED, MDB_PAGE_NOTFOUND,
    MDB_PANIC, MDB_INVALID, MDB_BAD_TXN: the file is damaged, nothing written will help) and
    ``storage`` (anything else).
    """
    code = getattr(exc, "errno", None)
    if isinstance(exc, lmdb.Error):
        if len(exc.args) > 1 and isinstance(exc.args[1], int):  # py-lmdb's cffi build
            code = exc.args[1]
        else:
            # py-lmdb's C extension raises Error("<call>: <strerror>") without the errno:
            # recover it from the C library's own strerror table.
            text = str(exc)
            code = next((c for c, s in _STRERROR.items() if text.endswith(": " + s)), None)
    if isinstance(exc, lmdb.MapFullError):
        kind = "map_full"
    elif isinstance(exc, _DAMAGE):
        kind = "corrupted"
    elif isinstance(exc, lmdb.DiskError) or code in _DISK_FULL_ERRNOS:
        kind = "disk_full"
    elif code == errno.EIO:
        kind = "disk_io"
    else:
        kind = "storage"
    return StorageError(f"{what}: {exc}", kind=kind)


class LmdbEnvironment:
    """One LMDB environment in a data directory this process holds a lock on."""

    def __init__(
        self,
        path: str | Path,
        *,
        map_size: int,
        sync: SyncMode,
        sync_interval_s: float,
        max_readers: int = 256,
        damaged_file: DamagedFile = DamagedFile.QUARANTINE,
        writemap: bool = True,
    ) -> None:
        self.path = Path(path)
        #: Why the data file found at start was quarantined (None: it was whole).
        self.quarantined: str | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StorageError(
                f"data directory {self.path} exists and is not a directory", kind="storage"
            ) from None
        except OSError as exc:
            raise StorageError(
                f"cannot create data directory {self.path}: {exc.strerror or exc}",
                kind="storage",
            ) from None
        self._lockfile = _lock_dir(self.path)
        try:
            self._check_file(damaged_file)
        except BaseException:
            os.close(self._lockfile)
            raise
        #: Whether LMDB writes through the map (see the module docstring).
        self.writemap = writemap
        opening: dict[str, Any] = {
            "map_size": map_size,
            "max_dbs": 4,
            "sync": sync is SyncMode.COMMIT,
            "metasync": sync is SyncMode.COMMIT,
            "readahead": False,
            "max_readers": max_readers,
        }
        try:
            self.env = self._open(opening)
        except lmdb.Error as exc:
            os.close(self._lockfile)
            raise StorageError(
                f"cannot open LMDB environment in {self.path}: {exc}", kind="storage"
            ) from exc
        foreign = self._foreign_names()
        if foreign:
            self.env.close()
            os.close(self._lockfile)
            raise StorageError(
                f"{self.path / 'data.mdb'} is another application's LMDB file (it holds "
                f"{foreign}, which no kvcache store writes): give the daemon a data directory "
                "of its own",
                kind="storage",
            )
        # Store format v5 on: one key per (tenant, block key), a fixed-size row per shard held
        # as its sorted duplicates (kvcache.server.records). A v4 directory's `shards` and
        # `retention` databases are never opened: the store's format check refuses it.
        self.index = self.env.open_db(b"index", dupsort=True, dupfixed=True)
        # One key per (partition, expiry), the shards as fixed-size duplicates
        # (kvcache.server.records, store format v3). An older directory opens (LMDB keeps a
        # database's stored flags) and is refused by the store's format check.
        self.expiry = self.env.open_db(b"expiry", dupsort=True, dupfixed=True)
        self.meta = self.env.open_db(b"meta")
        self._sync_interval = sync_interval_s
        self.last_sync = time.monotonic()
        #: Called by the periodic sync thread instead of a plain sync (the store syncs its
        #: segment files there first, so what a synced index points at is on disk).
        self.sync_hook: Callable[[], None] | None = None
        # Periodic syncs run on their own thread: an fsync of hundreds of megabytes on
        # the service thread stalled every request behind it (tail latency spikes).
        self._stop_sync = threading.Event()
        self._syncer: threading.Thread | None = None
        if sync is SyncMode.PERIODIC:
            self._syncer = threading.Thread(
                target=self._sync_periodically, name="kvcache-lmdb-sync", daemon=True
            )
            self._syncer.start()

    def _open(self, opening: dict[str, Any]) -> lmdb.Environment:
        """Open the environment, with writemap if asked and it can be had safely; sets
        :attr:`map_size`, the data file's descriptor and what of it is allocated."""
        env: lmdb.Environment | None = None
        if self.writemap:
            try:
                env = lmdb.open(str(self.path), writemap=True, **opening)
            except lmdb.Error as exc:
                # LMDB sizes the file to the map at open: one that may not grow that far
                # (EFBIG: a file size limit, a file system's largest file) opens without it.
                log.warning("LMDB in %s opens without writemap: %s", self.path, exc)
                self.writemap = False
        if env is None:
            env = lmdb.open(str(self.path), writemap=False, **opening)
        self.map_size = int(env.info()["map_size"])
        self._page_size = int(env.stat()["psize"])
        self._last_page: Callable[[], int] = lambda: int(env.info()["last_pgno"])
        self._datafd = os.open(self.path / "data.mdb", os.O_RDWR)
        # With writemap the file's size is the map's: how much of it is allocated is known
        # once this process has allocated it (fallocate of what already is costs nothing).
        self._allocated = 0 if self.writemap else os.fstat(self._datafd).st_size
        if not self.writemap:
            return env
        try:
            self._make_room(0)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
                # A full disk at start: reads are served, writes refused until there is room.
                log.warning("LMDB file in %s: no room to allocate ahead (%s)", self.path, exc)
                return env
            # No fallocate: nothing would keep a write out of a hole on a full disk.
            log.warning("LMDB in %s opens without writemap: no fallocate (%s)", self.path, exc)
            env.close()
            os.close(self._datafd)
            self.writemap = False
            return self._open(opening)
        return env

    def _foreign_names(self) -> list[str]:
        """Keys of the main database that are not a kvcache store's (its named databases,
        of this format or an earlier one): another application's file, which the store
        adopted and wrote its databases into."""
        with self.env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        return [n.decode(errors="replace") for n in names if n not in _OWN_DATABASES]

    def _check_file(self, damaged_file: DamagedFile) -> None:
        """Refuse or quarantine a data file LMDB may not map (see kvcache.server.lmdb_check);
        called with the directory lock held, before LMDB opens anything."""
        data = self.path / "data.mdb"
        reason = check_data_file(data)
        if reason is None:
            reason = _index_lost(self.path, data)
        if reason is None:
            return
        if damaged_file is DamagedFile.REFUSE:
            log.error("LMDB file %s is damaged: %s; refusing to start (damaged_file = refuse)",
                      data, reason)  # fmt: skip
            raise StorageError(
                f"LMDB file {data} is damaged: {reason}. Move it aside (the store is a cache) "
                'or set damaged_file = "quarantine" to start empty',
                kind="corrupted",
            )
        aside = self.path / QUARANTINE_NAME
        try:
            with contextlib.suppress(FileNotFoundError):  # missing: nothing to move aside
                os.replace(data, aside)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / "lock.mdb")
        except OSError as exc:
            raise StorageError(
                f"LMDB file {data} is damaged ({reason}) and cannot be moved aside: {exc}",
                kind="corrupted",
            ) from None
        self.quarantined = reason
        log.error(
            "LMDB file %s is damaged: %s; moved to %s and starting empty (its shards are "
            "lost to this node; read repair and `kvcache repair` put them back)",
            data,
            reason,
            aside,
        )

    def _sync_periodically(self) -> None:
        while not self._stop_sync.wait(self._sync_interval):
            try:
                if self.sync_hook is not None:
                    self.sync_hook()
                else:
                    self.env.sync(True)
            except (lmdb.Error, OSError) as exc:  # reported, retried at the next interval
                log.error("periodic LMDB sync failed: %s", exc)
            self.last_sync = time.monotonic()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._lockfile < 0

    def preallocate(self, incoming: int) -> None:
        """Keep the data file allocated a chunk ahead of what LMDB uses.

        LMDB grows its file by writing past the end; ext4 then allocates
        blocks inside every such ``pwrite``. Allocating them ahead in one
        ``fallocate`` made the store's part of a first fill 15 % cheaper
        (3-8 % of a PUT end to end, measured); once the node is full LMDB
        reuses its freed pages and this does nothing. Best effort: a failure
        (disk full, no fallocate) is left to LMDB's own write to report.
        """
        if self.writemap:  # begin_write allocates, strictly
            return
        used = (int(self.env.info()["last_pgno"]) + 1) * self._page_size
        if used + 2 * incoming <= self._allocated or self._allocated >= self.map_size:
            return
        ahead = min(_PREALLOCATE_BYTES, self.map_size // 32)
        target = min(self.map_size, used + 2 * incoming + ahead)
        try:
            os.posix_fallocate(self._datafd, self._allocated, target - self._allocated)
        except OSError as exc:
            log.debug("preallocating %s to %d bytes failed: %s", self.path, target, exc)
            return
        self._allocated = target

    def begin_write(self, rows: int | None = None) -> lmdb.Transaction[bytes]:
        """A write transaction that changes at most ``rows`` rows (None: any number).

        With writemap, the file is first allocated far enough past LMDB's last page for
        every page such a transaction may add (raises OSError, ENOSPC and the like, if
        the disk cannot take them: the write is then refused, not a SIGBUS)."""
        if self.writemap:
            self._make_room(rows)
        return self.env.begin(write=True)

    def _make_room(self, rows: int | None) -> None:
        pages = _MAX_TXN_PAGES if rows is None else _BASE_PAGES + rows * _PAGES_PER_ROW
        used = (self._last_page() + 1) * self._page_size
        need = min(self.map_size, used + min(pages, _MAX_TXN_PAGES) * self._page_size)
        if need <= self._allocated:
            return
        ahead = min(_PREALLOCATE_BYTES, self.map_size // 32)
        target = min(self.map_size, need + ahead)
        if target > need and target - self._allocated > self._free_bytes() // 2:
            # A chunk ahead only out of plenty: a failed fallocate on ext4 keeps what it got,
            # so trying one the disk cannot take ate the last free space (a fresh daemon on
            # a nearly full disk then could not start), and segments need room too.
            target = need
        try:
            os.posix_fallocate(self._datafd, self._allocated, target - self._allocated)
        except OSError:
            # What the disk can still take, if it covers this transaction: the next one
            # tries again from there.
            if need > self._allocated:
                os.posix_fallocate(self._datafd, self._allocated, need - self._allocated)
            target = need
        self._allocated = target

    def _free_bytes(self) -> int:
        """Bytes the data file's filesystem has free for this process (0 if unknown)."""
        try:
            stat = os.fstatvfs(self._datafd)
        except OSError:
            return 0
        return stat.f_bavail * stat.f_frsize

    def close(self) -> None:
        """Stop the sync thread, sync, and close (idempotent)."""
        if self._lockfile < 0:
            return
        self._stop_sync.set()
        if self._syncer is not None:
            self._syncer.join()
        try:
            self.env.sync(True)
        finally:
            self.env.close()
            os.close(self._datafd)
            os.close(self._lockfile)
            self._lockfile = -1


def _lock_dir(path: Path) -> int:
    """Hold an exclusive lock on the data directory for this process's life."""
    try:
        fd = os.open(path / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError(
            f"cannot use data directory {path}: {exc.strerror or exc}", kind="storage"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StorageError(
            f"data directory {path} is in use by another daemon; give each daemon its own",
            kind="storage",
        ) from None
    return fd


#: Named databases kvcache stores have had (index, expiry, meta; shards and retention up to
#: store format v4, which the store's format check then refuses by name).
_OWN_DATABASES = frozenset({b"index", b"expiry", b"meta", b"shards", b"retention"})


def _index_lost(path: Path, data: Path) -> str | None:
    """Why an index file that is missing or empty, beside segment files holding records, is
    not a new store: LMDB would start it afresh, and the start then removed every segment
    its empty index does not name (every record, under ``damaged_file = refuse`` too)."""
    try:
        size = data.stat().st_size
    except FileNotFoundError:
        size = -1
    if size > 0:
        return None
    segs = [p for p in (path / SEGMENT_DIR).glob("*.seg") if p.stat().st_size > 0]
    if not segs:
        return None
    state = "missing" if size < 0 else "empty"
    return f"it is {state}, and {len(segs)} segment file(s) in {SEGMENT_DIR}/ hold records"
