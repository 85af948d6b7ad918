"""Where a load's shards land, and how they become verified payloads. No I/O.

A :class:`LoadAssembly` owns the load's destination: the caller's ``out``
array (blocks × payload bytes), plus scratch for what does not belong there
(parity shards, the zero padding past a payload's end, shard headers). The
transport asks it where each GET reply's bytes go (:meth:`LoadAssembly.landing`):
a data shard's body lands straight in its place in ``out``, so a healthy load
copies nothing after the kernel. Replies are then checked as a batch
(:meth:`accept`: header rules from :func:`kvcache.shard.header_verdicts`, and
the key, stripe and index asked for).

:meth:`verify` turns a range of blocks into a verdict per block: all data
shards arrived and the payload hashes to the writer's xxh3-128 → good;
otherwise rebuild from k shards (one codec call per erasure pattern) and
check again; if that fails, drop shards whose own checksum fails, then try
other sets of k shards (with 11 or 12 shards one bad shard can be located),
and report which shards were bad so their daemons can be repaired.

The caller's buffer is written by I/O threads. :meth:`close` makes sure no
thread writes into it after the load returns: it refuses new landings and
waits for the ones in progress (aborting stalled ones through the transport).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache.erasure import Codec
from kvcache.errors import ErasureError
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE, build_headers, header_verdicts, shard_len_for

__all__ = ["BlockVerdict", "LoadAssembly", "RepairShard"]

IntArray = npt.NDArray[np.int64]
#: Most k-subsets tried per block when locating bad shards (C(12, 10) = 66).
MAX_SUBSETS = 128


@dataclass(frozen=True, slots=True)
class RepairShard:
    """A shard a holder should have (again): its header and body, for read repair."""

    block: int
    index: int
    header: bytes
    body: bytes


@dataclass(frozen=True, slots=True)
class BlockVerdict:
    """The outcome for one block: good, and which shards were found bad (for repair)."""

    good: bool
    rebuilt: bool
    bad_indices: tuple[int, ...] = ()


class LoadAssembly:
    """The destination of one load (see the module docstring)."""

    def __init__(
        self,
        *,
        key_words: npt.NDArray[np.void],
        stripes: npt.NDArray[np.uint64],
        out: npt.NDArray[np.uint8],
        k: int,
        n: int,
        payload_len: int,
        codec: Codec,
    ) -> None:
        blocks = len(key_words)
        self.k, self.n, self.m = k, n, n - k
        self.payload_len = payload_len
        self.length = length = shard_len_for(payload_len, k)
        self.inside = payload_len // length
        self.pad_len = k * length - payload_len
        self.key_words = key_words
        self.stripes = stripes
        self.out = out
        self.codec = codec
        self.pad = np.zeros((blocks, max(self.pad_len, 1)), np.uint8)
        self.parity = np.empty((blocks, max(self.m, 1), length), np.uint8)
        self.headers = np.zeros((blocks, n), HEADER_DTYPE)
        self.got = np.zeros((blocks, n), bool)
        #: Shards a holder answered NOT_FOUND for (candidates for read repair).
        self.not_found = np.zeros((blocks, n), bool)
        self._out = out.reshape(-1).data
        self._pad = self.pad.reshape(-1).data
        self._parity = self.parity.reshape(-1).data
        self._headers = self.headers.view(np.uint8).reshape(-1).data
        self._cond = threading.Condition()
        self._live = True
        self._writers = 0

    # -------------------------------------------------------------- landing (I/O threads)

    def shard_views(self, b: int, i: int) -> list[memoryview]:
        """Where shard ``i`` of block ``b`` lives: 1 view, or 2 across the payload's end."""
        length, payload = self.length, self.payload_len
        if i >= self.k:
            start = (b * self.m + i - self.k) * length
            return [self._parity[start : start + length]]
        begin = i * length
        end = begin + length
        base = b * payload
        pbase = b * self.pad_len
        if end <= payload:
            return [self._out[base + begin : base + end]]
        if begin >= payload:
            return [self._pad[pbase + begin - payload : pbase + end - payload]]
        return [self._out[base + begin : base + payload], self._pad[pbase : pbase + end - payload]]

    def landing(
        self,
        blocks: IntArray,
        indices: IntArray,
        statuses: npt.NDArray[np.uint8],
        lengths: IntArray,
    ) -> list[memoryview] | None:
        """Buffers for a GET reply's data section, or None once the load is over.

        A claim: until :meth:`landed` the load will not return (see :meth:`close`).
        """
        with self._cond:
            if not self._live:
                return None
            self._writers += 1
        record = HEADER_BYTES + self.length
        views: list[memoryview] = []
        for b, i, status, size in zip(
            blocks.tolist(), indices.tolist(), statuses.tolist(), lengths.tolist(), strict=True
        ):
            if status != 0:
                continue
            if size != record:
                views.append(memoryview(bytearray(size)))  # not what was asked: discarded
                continue
            at = (b * self.n + i) * HEADER_BYTES
            views.append(self._headers[at : at + HEADER_BYTES])
            views += self.shard_views(b, i)
        return views

    def landed(self) -> None:
        """A claimed landing is over (received, or failed)."""
        with self._cond:
            self._writers -= 1
            self._cond.notify_all()

    def close(self, abort: Callable[[], None], grace_s: float = 0.05) -> None:
        """Refuse new landings and wait for those in progress; ``abort`` cuts stalled ones."""
        with self._cond:
            self._live = False
            if not self._writers:
                return
            self._cond.wait_for(lambda: not self._writers, grace_s)
            if not self._writers:
                return
        abort()
        with self._cond:
            self._cond.wait_for(lambda: not self._writers)

    # -------------------------------------------------------------- checks (driver thread)

    def accept(
        self,
        blocks: IntArray,
        indices: IntArray,
        statuses: npt.NDArray[np.uint8],
        lengths: IntArray,
    ) -> npt.NDArray[np.bool_]:
        """Per item of a landed reply: is it exactly the shard asked for? Marks those as got."""
        missing = statuses == 1  # Status.NOT_FOUND
        if missing.any():
            self.not_found[blocks[missing], indices[missing]] = True
        ok = (statuses == 0) & (lengths == HEADER_BYTES + self.length)
        accepted = np.zeros(len(blocks), bool)
        if not ok.any():
            return accepted
        b, i = blocks[ok], indices[ok]
        hdr = self.headers[b, i]
        # The header checksum is left to _locate: a damaged header either fails the
        # checks below or its block fails the payload hash, and then every shard is checked.
        good = (
            header_verdicts(hdr, checksum=False)
            & (hdr["block_key"] == self.key_words[b])
            & (hdr["stripe_id"] == self.stripes[b])
            & (hdr["shard_index"] == i)
            & (hdr["k"] == self.k)
            & (hdr["m"] == self.m)
            & (hdr["payload_len"] == self.payload_len)
        )
        accepted[ok] = good
        self.got[b[good], i[good]] = True
        return accepted

    def verify(self, blocks: list[int]) -> list[BlockVerdict]:
        """A verdict for each of ``blocks`` (see the module docstring)."""
        k = self.k
        verdicts: dict[int, BlockVerdict] = {}
        # Fast path: every data shard arrived; one hash per block.
        for b in blocks:
            if self.got[b, :k].all() and self._matches(b):
                verdicts[b] = BlockVerdict(True, False)
        # Rebuild, grouped by erasure pattern: one codec call per pattern.
        patterns: dict[tuple[int, ...], list[int]] = {}
        for b in blocks:
            if b not in verdicts and not self.got[b, :k].all() and self.got[b].sum() >= k:
                present = tuple(np.flatnonzero(self.got[b])[:k].tolist())
                patterns.setdefault(present, []).append(b)
        for present, group in patterns.items():
            for b, ok in zip(group, self._rebuild(group, present), strict=True):
                if ok:
                    verdicts[b] = BlockVerdict(True, True)
        # What is left either failed its check or is short of shards.
        return [verdicts[b] if b in verdicts else self._locate(b) for b in blocks]

    def missing(self, b: int) -> IntArray:
        """Shard indices of block ``b`` not (validly) received."""
        return np.flatnonzero(~self.got[b]).astype(np.int64)

    def repair_shards(self, b: int, indices: tuple[int, ...]) -> list[RepairShard]:
        """Good copies of shards ``indices`` of verified block ``b``, with their headers."""
        stripe = self._reencode(b)
        ref = self.headers[b, int(np.flatnonzero(self.got[b])[0])]
        hashes = np.array(
            [xxhash.xxh3_64_intdigest(stripe[i].data) for i in range(self.n)], np.uint64
        )
        headers = build_headers(
            keys=self.key_words[b : b + 1],
            stripe_ids=self.stripes[b : b + 1],
            k=self.k,
            m=self.m,
            payload_len=self.payload_len,
            payload_hashes=np.array([ref["payload_hash"]], "V16"),
            shard_hashes=hashes[None, :],
            traffic_class=bytes(ref["traffic_class"]).rstrip(b"\0").decode("ascii"),
            created_ms=int(ref["created_ms"]),
            expiry_ms=int(ref["expiry_ms"]),
        )
        return [RepairShard(b, i, headers[0, i].tobytes(), stripe[i].tobytes()) for i in indices]

    # -------------------------------------------------------------- internals

    def _reference_hashes(self, b: int) -> list[bytes]:
        """The payload hashes the block's received headers claim, most common first."""
        claimed = self.headers[b, self.got[b]]["payload_hash"]
        values, counts = np.unique(claimed, return_counts=True)
        return [bytes(v) for v in values[np.argsort(-counts, kind="stable")]]

    def _matches(self, b: int, refs: list[bytes] | None = None) -> bool:
        digest = xxhash.xxh3_128_digest(self.out[b].data)
        if refs is None:
            # Usually every header claims the same hash: compare with the first, and
            # only if that fails with any other one claimed.
            first = self.headers[b, int(self.got[b].argmax())]["payload_hash"].tobytes()
            if digest == first:
                return True
            refs = self._reference_hashes(b)
        return digest in refs

    def _stripe_copy(self, b: int) -> npt.NDArray[np.uint8]:
        """Block ``b``'s received shards as one (n, L) array (rows not got: zeros)."""
        stripe: npt.NDArray[np.uint8] = self._stripes([b])[0]
        stripe[~self.got[b]] = 0
        return stripe

    def _stripes(self, blocks: list[int]) -> npt.NDArray[np.uint8]:
        """Blocks' shards as (blocks, n, L) stripes, gathered with a few array copies."""
        k, length, payload = self.k, self.length, self.payload_len
        idx = np.asarray(blocks, np.int64)
        stripes = np.empty((len(blocks), self.n, length), np.uint8)
        data = stripes[:, :k].reshape(len(blocks), k * length)
        data[:, :payload] = self.out[idx]
        if self.pad_len:
            data[:, payload:] = self.pad[idx, : self.pad_len]
        if self.m:
            stripes[:, k:] = self.parity[idx]
        return stripes

    def _write_back(self, b: int, stripe: npt.NDArray[np.uint8]) -> None:
        """Put a stripe's data rows where a payload is read from (out row and padding)."""
        flat = stripe[: self.k].reshape(-1)
        self.out[b] = flat[: self.payload_len]
        if self.pad_len:
            self.pad[b, : self.pad_len] = flat[self.payload_len :]

    def _rebuild(self, group: list[int], present: tuple[int, ...]) -> list[bool]:
        stripes = self._stripes(group)
        try:
            self.codec.reconstruct(stripes, present)
        except ErasureError:
            return [False] * len(group)
        good = []
        for j, b in enumerate(group):
            self._write_back(b, stripes[j])
            good.append(self._matches(b))
        return good

    def _locate(self, b: int) -> BlockVerdict:
        """Find k shards of block ``b`` that rebuild its payload; report the ones that do not fit."""
        k = self.k
        got = np.flatnonzero(self.got[b])
        if len(got) < k:
            return BlockVerdict(False, False)
        stripe = self._stripe_copy(b)
        refs = self._reference_hashes(b)
        # Shards whose header or body fails its own checksum are bad whatever else holds.
        sums = self.headers[b]["shard_hash"]
        sound = header_verdicts(self.headers[b])
        intact = [
            i
            for i in got.tolist()
            if sound[i] and xxhash.xxh3_64_intdigest(stripe[i].data) == int(sums[i])
        ]
        candidates: list[list[int]] = [intact] if len(intact) >= k else []
        for combo in itertools.islice(itertools.combinations(intact, k), MAX_SUBSETS):
            candidates.append(list(combo))
        for subset in candidates:
            trial = stripe[None].copy()
            present = tuple(subset[:k])
            try:
                self.codec.reconstruct(
                    trial, present, rows=[i for i in range(self.n) if i not in present]
                )
            except ErasureError:
                continue
            self._write_back(b, trial[0])
            if self._matches(b, refs):
                # Every received shard that differs from the verified stripe was bad.
                full = self._reencode(b)
                bad = tuple(i for i in got.tolist() if not np.array_equal(stripe[i], full[i]))
                return BlockVerdict(True, True, bad)
        return BlockVerdict(False, False, tuple(got.tolist()))

    def _reencode(self, b: int) -> npt.NDArray[np.uint8]:
        """The full stripe (n, L) of verified block ``b``, from its payload."""
        stripe = np.zeros((1, self.n, self.length), np.uint8)
        stripe[0, : self.k].reshape(-1)[: self.payload_len] = self.out[b]
        self.codec.encode(stripe)
        full: npt.NDArray[np.uint8] = stripe[0]
        return full
