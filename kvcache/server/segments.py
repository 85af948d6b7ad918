"""Append-only segment files: where a daemon's shard records live (store format v4 to v6).

The LMDB index (:mod:`kvcache.server.store`) keeps, per shard, one row with
its retention and where its record is (segment, offset, length: handed here
as a :data:`LOCATION`). The record bytes are appended here, a PUT batch (or a
group commit of several) with ONE ``pwritev``, and read back as memoryviews
of a read-only ``mmap`` of the segment, which the socket loop sends as they
are. A stored byte is then copied once on its way in (the kernel's copy into
the page cache) instead of twice (LMDB's dirty page, then its write-back), and
an evicted or expired shard costs an index delete, not the freeing of three
overflow pages.

File layout (``segments/NNNNNNNN.seg``, id in hex, never reused; store format v6)::

    batch:  magic u32 | count u32 | records u64 | tenants u32 | uniform u32   (24 bytes, LE)
            tenants x tenant id (8 bytes each): the batch's tenant table
            count x (length u32 | tenant slot u16)      (6 bytes each; none when uniform)
            the count records, back to back

``uniform`` is 0, or the length of every record of a batch of one tenant: the
common PUT (one tenant's shards of one layout) then has no entry table, and a
record costs the segment nothing beyond itself (v5 spent 6 bytes on each).

Each batch names its records' storage keys, so a segment can be walked
without the index (:meth:`SegmentFiles.walk`): that is how compaction finds a
sparse segment's live records. A record's block key and shard index are in its
own header (checked when it was stored), so an entry holds only the record's
length and which of the batch's tenants wrote it (v4 spent 32 bytes a record on
the whole storage key). One batch's records are contiguous, so a GET of the
shards one PUT wrote is sent as one buffer.

Space is reclaimed per segment, never per record: the store counts each
segment's live bytes (in LMDB ``meta``, written with the index rows that
change them); a sealed segment with nothing live is unlinked, and one mostly
dead has its live records copied forward (compaction) first.

Durability: a batch is written before the index transaction that points at it
commits, and it is synced before that transaction is (``sync = commit``:
``fdatasync`` before the commit; ``periodic``: :meth:`sync` runs before each
LMDB sync); a new segment's name is made durable the same way (the directory is
synced before that commit, or before the next LMDB sync). A crash can leave bytes
past a segment's recorded end: they are overwritten, as nothing points at them.

This module does file I/O only; which records are live is the index's business.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcache.net_loop import FileRange
from kvcache.server.records import record_runs
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE

__all__ = [
    "BATCH_HEAD",
    "ENTRY",
    "ENTRY_LEN",
    "LOCATION",
    "SEGMENT_DIR",
    "SegmentFd",
    "SegmentFiles",
    "SegmentState",
    "default_segment_bytes",
]

log = logging.getLogger(__name__)

SEGMENT_DIR = "segments"
_MAGIC = 0x3653564B  # "KVS6" little-endian: a batch head of store format v6
BATCH_HEAD = struct.Struct("<IIQII")
#: A batch's entry per record: record length, slot in the batch's tenant table.
ENTRY = struct.Struct("<IH")
ENTRY_LEN = ENTRY.size
_ENTRY_DTYPE = np.dtype([("len", "<u4"), ("tenant", "<u2")])
_TENANT_LEN = 8
_KEY_AT: int = HEADER_DTYPE.fields["block_key"][1]  # type: ignore[index]
_INDEX_AT: int = HEADER_DTYPE.fields["shard_index"][1]  # type: ignore[index]
#: The index's value per shard: segment, offset, length, the record's header check.
LOCATION = np.dtype([("seg", ">u4"), ("off", ">u4"), ("len", ">u4"), ("check", ">u4")])
_LOC = struct.Struct(">IIII")
#: Offsets are u32: a segment never grows past this.
_MAX_SEGMENT = (1 << 32) - 1
#: A file kept for reuse (see SegmentFiles.drop) and not reused this long is removed.
SPARE_KEEP_S = 30.0
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def default_segment_bytes(capacity_bytes: int) -> int:
    """Segment size for a node of ``capacity_bytes``: a 64th of it, 4 MiB to 256 MiB (small
    enough that a segment empties soon after its shards expire, large enough that files are
    few)."""
    return max(4 << 20, min(256 << 20, capacity_bytes // 64))


@dataclass(slots=True)
class SegmentState:
    """One segment's bookkeeping: bytes written (its end) and what of it is live."""

    end: int = 0
    live_bytes: int = 0
    live: int = 0

    _PACK = struct.Struct(">QQQ")

    def pack(self) -> bytes:
        """The meta row's value."""
        return self._PACK.pack(self.end, self.live_bytes, self.live)

    @classmethod
    def unpack(cls, raw: bytes) -> SegmentState:
        """A meta row's value (our own disk: trusted layout)."""
        return cls(*cls._PACK.unpack(raw))


class SegmentFd:
    """An open segment file's descriptor, closed when the last holder lets go of it: the
    segment's entry and every :class:`~kvcache.net_loop.FileRange` of a reply in flight."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        """The descriptor."""
        return self.fd

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class _Segment:
    """One open segment file and its read-only map (remapped as the file grows: the file
    is never made sparse, as writes into holes cost 5x those that extend a file, measured
    on ext4)."""

    __slots__ = ("fd", "file", "map", "old", "path")

    def __init__(self, path: Path, *, create: bool) -> None:
        self.path = path
        self.file: SegmentFd | None = SegmentFd(
            os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        )
        self.fd = self.file.fd
        self.map: mmap.mmap | None = None
        #: Earlier, shorter maps of the file that replies may still hold views of.
        self.old: list[mmap.mmap] = []

    def view(self, end: int, *, check: bool = False) -> memoryview:
        """A view of the file's first ``end`` bytes at least; OSError when the file is
        shorter than that. With ``check`` the file's size is read every time: a file cut
        short from outside leaves the map longer than the file, and this process touching
        the map past the file's end is a SIGBUS that kills the daemon. Views handed to the
        kernel (GET replies) need no check: it answers EFAULT, and the connection closes."""
        stale = self.map is None or len(self.map) < end
        if check or stale:
            size = os.fstat(self.fd).st_size
            if size < end:
                raise OSError(f"segment {self.path} is {size} bytes, the index says {end}")
            if stale:
                if self.map is not None:
                    self.old.append(self.map)
                    self.old = [m for m in self.old if not _closed(m)]
                self.map = mmap.mmap(self.fd, size, access=mmap.ACCESS_READ)
        assert self.map is not None
        return memoryview(self.map)

    def unmapped(self) -> bool:
        """Close every map of the file if no view of any is left (then the file may be
        rewritten: no reply in flight can see it change)."""
        maps = [m for m in (*self.old, self.map) if m is not None]
        if not all(map(_closed, maps)):
            return False  # a reply in flight still holds a view
        self.map, self.old = None, []
        return True

    def close(self) -> None:
        # An mmap with views is left to the garbage collector: replies in flight may still
        # hold them (a mapping outlives the unlinked file); so is the descriptor, which
        # replies sending with sendfile hold (SegmentFd).
        self.map = None
        self.file = None


def _sync_directory(directory: Path) -> None:
    """``fsync`` a directory, so the names created or renamed in it survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _closed(found: mmap.mmap) -> bool:
    """Close ``found`` if nothing holds a view of it; whether it is closed."""
    try:
        found.close()
    except BufferError:
        return False
    return True


class SegmentFiles:
    """The segment files of one data directory: append, view, sync, drop.

    Owned by the store's thread, but for :meth:`sync`, which the periodic sync
    thread calls (a lock keeps it from syncing a file being closed).
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int,
        sync_each_write: bool,
        sendfile_min_bytes: int = 0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 64 << 10 <= segment_bytes <= _MAX_SEGMENT:
            raise ValueError(f"segment_bytes must be 64 KiB .. 4 GiB, not {segment_bytes}")
        if sendfile_min_bytes < 0:
            raise ValueError(f"sendfile_min_bytes must be >= 0, not {sendfile_min_bytes}")
        self._monotonic = monotonic
        #: Runs of records at least this long are handed out as FileRanges (0: never).
        self.sendfile_min_bytes = sendfile_min_bytes
        self.directory = directory / SEGMENT_DIR
        self.directory.mkdir(exist_ok=True)
        self.segment_bytes = segment_bytes
        self._sync_each = sync_each_write
        self._open: dict[int, _Segment] = {}
        self.state: dict[int, SegmentState] = {}
        self.active = -1
        self._dirty: set[int] = set()
        #: A segment file was created or renamed since the last sync (periodic mode).
        self._directory_dirty = False
        self._lock = threading.Lock()
        #: Held by the store's thread from an append to the commit of the transaction that
        #: points at it, and by the periodic sync's last step (see ShardStore), so that a
        #: synced index never points at bytes not yet synced.
        self.writing = threading.Lock()
        #: Files of dropped segments kept for reuse (see drop): path, size and when it was
        #: dropped (monotonic s), the newest last.
        self._spares: list[tuple[Path, int, float]] = []
        #: Segments started on a spare file rather than a new one (a counter).
        self.reused = 0
        #: Told of every dropped segment; True while a reader other than this object's maps
        #: (the daemon's native data plane) still sends from it, so its file is not reused.
        self.still_sending: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ opening

    def path_of(self, seg: int) -> Path:
        """The file of segment ``seg``."""
        return self.directory / f"{seg:08x}.seg"

    def on_disk(self) -> dict[int, int]:
        """Segment id → file size of every segment file in the directory."""
        out = {}
        for path in self.directory.glob("*.seg"):
            try:
                out[int(path.stem, 16)] = path.stat().st_size
            except ValueError:
                continue
        return out

    def load(self, state: dict[int, SegmentState]) -> None:
        """Take the index's view of the segments (from meta); files it does not know are
        leftovers of a crash before their first commit, and are removed. The newest known
        segment with room becomes the active one."""
        for seg in set(self.on_disk()) - set(state):
            log.info("removing segment %s: no index entry points into it", self.path_of(seg))
            self.path_of(seg).unlink(missing_ok=True)
        for spare in self.directory.glob("*.spare"):
            spare.unlink(missing_ok=True)
        self.state = dict(state)
        newest = max(state, default=-1)
        if newest >= 0 and state[newest].end < self.segment_bytes:
            self.active = newest
        else:
            self.active = newest  # the next append rolls to newest + 1

    def _segment(self, seg: int, *, create: bool = False) -> _Segment:
        found = self._open.get(seg)
        if found is None:
            found = _Segment(self.path_of(seg), create=create)
            self._open[seg] = found
        return found

    # ------------------------------------------------------------------ writing

    def append(
        self, keys: Sequence[bytes], records: Sequence[memoryview | bytes]
    ) -> tuple[int, int, SegmentState]:
        """Write one batch (keys and records) with one ``pwritev``; returns (segment, offset
        of the first record, the segment's state before, for :meth:`rewind`). The records
        follow each other from that offset. Raises OSError (disk full, I/O error)."""
        n = len(records)
        lengths = np.fromiter(map(len, records), np.int64, n)
        total = int(lengths.sum())
        tenant_ids = np.frombuffer(b"".join(k[:_TENANT_LEN] for k in keys), "<u8")
        if n and tenant_ids.min() == tenant_ids.max():  # one tenant: the usual batch
            tenants, slots = tenant_ids[:1], np.zeros(n, np.intp)
        else:
            tenants, slots = np.unique(tenant_ids, return_inverse=True)
        uniform = 0
        if len(tenants) == 1 and n and int(lengths.min()) == int(lengths.max()):
            uniform = int(lengths[0])  # every record of one length and tenant: no entries
        head_len = BATCH_HEAD.size + _TENANT_LEN * len(tenants) + (0 if uniform else ENTRY_LEN * n)
        need = head_len + total
        state = self.state.get(self.active)
        if state is None or (state.end and state.end + need > self.segment_bytes):
            self._roll(need)
            state = self.state[self.active]
        if state.end + need > _MAX_SEGMENT:
            raise OSError(f"a batch of {need} bytes does not fit a segment")
        seg = self._segment(self.active)
        buffers: list[bytes | memoryview] = [
            BATCH_HEAD.pack(_MAGIC, n, total, len(tenants), uniform),
            tenants.tobytes(),
        ]
        if not uniform:
            entries = np.empty(n, _ENTRY_DTYPE)
            entries["len"] = lengths
            entries["tenant"] = slots
            buffers.append(entries.tobytes())
        buffers.extend(records)
        before = SegmentState(state.end, state.live_bytes, state.live)
        at = state.end
        for i in range(0, len(buffers), _IOV_MAX):
            chunk = buffers[i : i + _IOV_MAX]
            want = sum(map(len, chunk))
            done = os.pwritev(seg.fd, chunk, at)
            while done < want:  # a short write: the rest, from where it stopped
                rest = b"".join(bytes(b) for b in chunk)[done:]
                done += os.pwrite(seg.fd, rest, at + done)
            at += want
        if self._sync_each:
            os.fdatasync(seg.fd)
        else:
            with self._lock:
                self._dirty.add(self.active)
        first = state.end + head_len
        state.end += need
        state.live_bytes += total
        state.live += n
        return self.active, first, before

    def rewind(self, seg: int, before: SegmentState) -> None:
        """Undo :meth:`append`'s bookkeeping after the index transaction failed (the bytes
        stay, unreferenced, and the next append overwrites them)."""
        if seg in self.state:
            self.state[seg] = before

    def _roll(self, need: int) -> None:
        seg = self.active + 1
        if self._spares:
            # A dropped segment's file, the newest first: its blocks allocated and its pages
            # likely still cached, and nothing reads it (see drop).
            spare, _size, _when = self._spares.pop()
            os.replace(spare, self.path_of(seg))
            self.reused += 1
        self._segment(seg, create=True)
        # The file's name is a directory entry: without the directory synced, a power cut
        # could keep an index that points into a segment whose name was never written.
        if self._sync_each:
            _sync_directory(self.directory)
        else:
            with self._lock:
                self._directory_dirty = True
        self.state[seg] = SegmentState()
        self.active = seg

    # ------------------------------------------------------------------ reading

    def view(self, seg: int, *, check: bool = False) -> memoryview:
        """A read-only view of segment ``seg``, its recorded end at least (raises OSError if
        the file is gone or shorter; ``check``: see :meth:`_Segment.view`, for views this
        process reads itself)."""
        state = self.state.get(seg)
        if state is None:
            raise OSError(f"no segment {seg:08x} in {self.directory}")
        return self._segment(seg).view(state.end, check=check)

    def read(self, location: bytes | memoryview) -> memoryview:
        """The record an index value points at (see :data:`LOCATION`), for this process to
        read: the file's size is checked first."""
        seg, off, length, _check = _LOC.unpack_from(location)
        return self.view(seg, check=True)[off : off + length]

    def views(self, locations: np.ndarray) -> list[memoryview | FileRange]:
        """Views of the records at ``locations`` (a :data:`LOCATION` array), in order, with
        records that follow each other in one segment joined into one view: what a GET
        reply sends. Whole-array work but for one slice per run. A run of at least
        ``sendfile_min_bytes`` comes as a :class:`~kvcache.net_loop.FileRange`, which the
        socket loop sends from the page cache with ``sendfile``: no copy through the
        daemon, and no page faults on the mapping."""
        if not len(locations):
            return []
        runs = record_runs(locations["seg"], locations["off"], locations["len"])
        return self.run_views(*runs.T.tolist())

    def run_views(
        self, segs: list[int], starts: list[int], ends: list[int]
    ) -> list[memoryview | FileRange]:
        """:meth:`views` of runs already found: run j is bytes [starts[j], ends[j]) of
        segment segs[j]."""
        out: list[memoryview | FileRange] = []
        maps: dict[int, memoryview] = {}
        least = self.sendfile_min_bytes or _MAX_SEGMENT + 1
        for s, a, b in zip(segs, starts, ends, strict=True):
            whole = maps.get(s)
            if whole is None:
                whole = maps[s] = self.view(s)
            if b - a >= least and (file := self._open[s].file) is not None:
                out.append(FileRange(file, a, whole[a:b]))
            else:
                out.append(whole[a:b])
        return out

    def walk(
        self, seg: int, start: int = 0, resume: int = 0
    ) -> Iterator[tuple[int, bytes, int, int]]:
        """(batch offset, storage key, record offset, record length) of every record of
        segment ``seg`` from the batch at ``start`` on, up to its recorded end, leaving out
        the records that begin before offset ``resume`` (a walk stopped inside a batch goes
        on from its next record). Stops (and logs) at a batch head that is not one (a
        damaged file): the rest is left to scrub."""
        state = self.state.get(seg)
        if state is None:
            return
        view = self.view(seg, check=True)  # batch heads are read here
        at = start
        while at + BATCH_HEAD.size <= state.end:
            magic, count, total, ntenants, uniform = BATCH_HEAD.unpack_from(view, at)
            table = at + BATCH_HEAD.size
            body = table + _TENANT_LEN * ntenants + (0 if uniform else ENTRY_LEN * count)
            if (
                magic != _MAGIC
                or body + total > state.end
                or (
                    uniform
                    and (ntenants != 1 or uniform < HEADER_BYTES or uniform * count != total)
                )
            ):
                log.warning("segment %s: no batch head at offset %d; not walked further",
                            self.path_of(seg), at)  # fmt: skip
                return
            tenants = [
                bytes(view[t : t + _TENANT_LEN])
                for t in range(table, table + _TENANT_LEN * ntenants, _TENANT_LEN)
            ]
            lengths: Iterable[int]
            slots: Iterable[int]
            pos = body
            if uniform:
                # Records that begin before ``resume`` are passed over by arithmetic.
                skip = min(count, -(-(resume - pos) // uniform)) if resume > pos else 0
                pos += skip * uniform
                lengths = itertools.repeat(uniform, count - skip)
                slots = itertools.repeat(0, count - skip)
            else:
                entries = np.frombuffer(view[table + _TENANT_LEN * ntenants : body], _ENTRY_DTYPE)
                if int(entries["len"].sum(dtype=np.uint64)) != total:
                    log.warning("segment %s: the entries of the batch at offset %d do not add up "
                                "to its records; not walked further", self.path_of(seg), at)  # fmt: skip
                    return
                skip = 0
                if resume > pos:
                    ends = np.cumsum(entries["len"], dtype=np.int64)
                    skip = int(np.searchsorted(pos + ends - entries["len"], resume))
                    pos += int(ends[skip - 1]) if skip else 0
                lengths = entries["len"][skip:].tolist()
                slots = entries["tenant"][skip:].tolist()
            for length, slot in zip(lengths, slots):  # noqa: B905 - counted above
                if length < HEADER_BYTES or slot >= ntenants:
                    log.warning("segment %s: a bad entry in the batch at offset %d; not walked "
                                "further", self.path_of(seg), at)  # fmt: skip
                    return
                key = (
                    tenants[slot]
                    + bytes(view[pos + _KEY_AT : pos + _KEY_AT + 16])
                    + view[pos + _INDEX_AT].to_bytes(2, "big")
                )
                yield at, key, pos, length
                pos += length
            at = body + total

    # ------------------------------------------------------------------ space and sync

    def drop(self, seg: int) -> None:
        """Forget segment ``seg`` (nothing in the index points into it): its file is kept
        for reuse by a later segment, or unlinked if a reader may still see it.

        Kept, a file's pages stay in the page cache and its blocks allocated, and the
        next segment rewrites them in place: on the 2-core VM, whose hypervisor takes back
        what the guest frees within seconds, 0.19 against 3.45 CPU-s/GB for a new file
        written after an idle (``bench/page_cache.py``). Keeping every
        dropped file never raises the files' peak on disk, since a drop moves bytes from
        the segments to the spares and a new segment moves them back; what a node that
        stopped writing keeps is given back by :meth:`release_spares`.
        """
        held = self.still_sending is not None and self.still_sending(seg)
        with self._lock:
            found = self._open.pop(seg, None)
            if found is None and self.path_of(seg).exists():
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    found = _Segment(self.path_of(seg), create=False)
            size = os.fstat(found.fd).st_size if found is not None else 0
            reusable = found is not None and not held and found.unmapped()
            if found is not None:
                found.close()
            self._dirty.discard(seg)
        self.state.pop(seg, None)
        if reusable:
            spare = self.directory / f"{seg:08x}.spare"
            try:
                os.replace(self.path_of(seg), spare)
            except FileNotFoundError:  # removed from outside: nothing to keep
                return
            self._spares.append((spare, size, self._monotonic()))
        else:
            self.path_of(seg).unlink(missing_ok=True)

    def sync(self) -> None:
        """``fdatasync`` every segment written since the last call (before an LMDB sync)."""
        # The fds are duplicated under the lock and synced outside it: an append takes the
        # lock to mark its segment dirty, and holding it through an fdatasync of seconds'
        # worth of writes stalled the daemon's loop for that long every sync interval
        # (measured on the H200 host: a 4 GiB store went from 4.3 to 0.9 GB/s).
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            fds = [os.dup(found.fd) for seg in dirty if (found := self._open.get(seg))]
            directory_dirty, self._directory_dirty = self._directory_dirty, False
        if directory_dirty:
            _sync_directory(self.directory)
        try:
            for fd in fds:
                os.fdatasync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    @property
    def file_bytes(self) -> int:
        """Bytes written to all segments (live and dead): what they take on disk."""
        return sum(s.end for s in self.state.values())

    @property
    def spare_bytes(self) -> int:
        """Bytes written to the files kept for reuse (what they take on disk, at least)."""
        return sum(size for _path, size, _when in self._spares)

    def release_spares(self, keep_s: float = SPARE_KEEP_S) -> int:
        """Remove the files kept for reuse that were dropped over ``keep_s`` ago (a node
        that stopped writing gives their disk back); returns how many."""
        cutoff = self._monotonic() - keep_s
        # Kept in the order dropped (a reuse takes the newest): the old ones lead.
        count = next((i for i, spare in enumerate(self._spares) if spare[2] > cutoff),
                     len(self._spares))  # fmt: skip
        old, self._spares = self._spares[:count], self._spares[count:]
        for path, _size, _when in old:
            path.unlink(missing_ok=True)
        return count

    @property
    def live_bytes(self) -> int:
        """Bytes of live records in all segments."""
        return sum(s.live_bytes for s in self.state.values())

    def close(self) -> None:
        """Sync and close every file (views already handed out stay valid)."""
        self.sync()
        with self._lock:
            for found in self._open.values():
                found.close()
            self._open.clear()
