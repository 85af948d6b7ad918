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

from kvcache import native
from kvcache.client.scratch import ScratchCache
from kvcache.erasure import Codec
from kvcache.errors import ErasureError, KVCacheError
from kvcache.shard import (
    HEADER_BYTES,
    HEADER_DTYPE,
    IDENTITY_BYTES,
    MAX_CLASS_NAME,
    build_headers,
    header_verdicts,
    identity_matches,
    identity_prefixes,
    repair_reference,
    shard_len_for,
)

__all__ = ["BlockVerdict", "LoadAssembly", "RepairShard", "Verdicts"]

_STRIPE_AT: int = HEADER_DTYPE.fields["stripe_id"][1]  # type: ignore[index]
_CLASS_LEN_AT: int = HEADER_DTYPE.fields["class_len"][1]  # type: ignore[index]

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


@dataclass(frozen=True, slots=True)
class Verdicts:
    """The outcomes for a batch of blocks, as arrays in the batch's order."""

    good: npt.NDArray[np.bool_]
    rebuilt: npt.NDArray[np.bool_]
    #: Verified blocks (by block index) with shards found bad; blocks without are absent.
    bad: dict[int, tuple[int, ...]]


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
        scratch: ScratchCache | None = None,
    ) -> None:
        blocks = len(key_words)
        self.k, self.n, self.m = k, n, n - k
        self.payload_len = payload_len
        self.length = length = shard_len_for(payload_len, k)
        self.inside = payload_len // length
        self.pad_len = k * length - payload_len
        self.key_words = key_words
        #: Each block's stripe id; 0 where the caller did not know it (a load of known keys
        #: without a match): then the stripe most of its shards carry is adopted on arrival.
        self.stripes = np.array(stripes, np.uint64)
        self._unknown = self.stripes == 0
        self.out = out
        self.codec = codec
        self.pad = np.zeros((blocks, max(self.pad_len, 1)), np.uint8)
        # Parity rows in scratch pages an earlier load faulted in, where the cache has some.
        self._scratch = scratch
        parity_bytes = blocks * max(self.m, 1) * length
        self._parity_buffer, self.scratch_reused = (
            scratch.take(parity_bytes)
            if scratch is not None
            else (np.empty(parity_bytes, np.uint8), False)
        )
        self.parity = self._parity_buffer[:parity_bytes].reshape(blocks, max(self.m, 1), length)
        self.headers = np.zeros((blocks, n), HEADER_DTYPE)
        self.got = np.zeros((blocks, n), bool)
        #: Shards a holder answered NOT_FOUND for (candidates for read repair).
        self.not_found = np.zeros((blocks, n), bool)
        #: Shards that arrived but are not the shard asked for (wrong length or header).
        self.rejected = np.zeros((blocks, n), bool)
        #: The headers of records of another length than a shard's (rejected on arrival):
        #: what they were stored as (see loading._stored_payload_len).
        self.odd_headers = np.zeros((blocks, n), HEADER_DTYPE)
        self._last_digest = b""
        self._headers = self.headers.view(np.uint8).reshape(-1).data
        self._out_at = np.uint64(native.addresses_of(out))
        self._pad_at = np.uint64(native.addresses_of(self.pad))
        self._parity_at = np.uint64(native.addresses_of(self.parity))
        self._headers_at = np.uint64(native.addresses_of(self.headers))
        #: What kv_landing_segments needs to know (its last entry, scratch, is per reply).
        self._geometry = np.array(
            [
                length,
                payload_len,
                k,
                n,
                self.pad_len,
                HEADER_BYTES,
                self._out_at,
                self._pad_at,
                self._parity_at,
                self._headers_at,
                0,
                native.addresses_of(self.odd_headers),
            ],
            np.uint64,
        )
        self._header_rows = self.headers.view(np.uint8).reshape(blocks * n, HEADER_BYTES)
        self._identities = identity_prefixes(
            key_words, stripes, k=k, m=n - k, payload_len=payload_len
        ).reshape(blocks * n, -1)
        # The lock alone on the per-reply paths (a Condition's own __enter__ is Python);
        # the condition only for close(), which waits for landings in progress.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._live = True
        self._writers = 0
        #: Blocks the driver is verifying or has verified: replies for them (late answers
        #: to abandoned asks) are discarded, never written over what was checked.
        self.sealed = np.zeros(blocks, bool)
        #: Landings in progress per block.
        self._writing = np.zeros(blocks, np.int64)
        # What the native accept reads and marks, by address (C-contiguous, one
        # byte per bool, alive as long as this assembly): ctypes' argument conversions
        # cost more than the checks themselves.
        self._accept_geometry = np.array(
            [n, HEADER_BYTES + self.length, HEADER_BYTES, IDENTITY_BYTES, _CLASS_LEN_AT,
             _STRIPE_AT, MAX_CLASS_NAME],
            np.uint64,
        )  # fmt: skip
        self._accept_at: tuple[int, ...] = ()
        self._land_at: tuple[int, int, int] = (0, 0, 0)
        self._burst_target: npt.NDArray[np.uint64] | None = None
        self._burst_target_at = 0
        if native.AVAILABLE:
            self._land_at = (
                native.addresses_of(self.sealed),
                native.addresses_of(self._writing),
                native.addresses_of(self._geometry),
            )
            self._accept_at = tuple(
                native.addresses_of(a)
                for a in (
                    self.sealed,
                    self._unknown,
                    self.got,
                    self.rejected,
                    self.not_found,
                    self._header_rows,
                    self._identities,
                    self._accept_geometry,
                )
            )

    # -------------------------------------------------------------- landing (I/O threads)

    def landing(
        self,
        blocks: IntArray,
        indices: IntArray,
        statuses: npt.NDArray[np.uint8],
        lengths: IntArray,
    ) -> tuple[native.Segments, IntArray] | None:
        """Where a GET reply's data section goes and the blocks it writes, or None once
        the load is over. Shards of sealed blocks go to scratch buffers (discarded).

        A claim: until :meth:`landed` the load will not return (see :meth:`close`).
        """
        with self._cond:
            if not self._live:
                return None
            self._writers += 1
            live = ~self.sealed[blocks]
            ok = statuses == 0
            writing = live & ok
            writes = blocks[writing]
            np.add.at(self._writing, writes, 1)
        return self._segments(blocks, indices, statuses, lengths, live, ok), writes

    def land_reply(
        self,
        blocks: IntArray,
        indices: IntArray,
        shard_at: tuple[int, int],
        items: npt.NDArray[np.void],
    ) -> native.GetLanding | tuple[native.Segments, IntArray] | None:
        """:meth:`landing` of a GET reply from its own items (C-contiguous wire records,
        one per shard asked): one native call when every OK record is a shard of an open
        block, which also says where :meth:`accept_reply` puts its verdicts. ``shard_at``:
        the addresses of ``blocks`` and ``indices`` (C-contiguous int64, alive as long as
        the reply is received)."""
        if native.AVAILABLE and items.flags.c_contiguous and len(items):
            sealed_at, writing_at, geometry_at = self._land_at
            items_at = native.addresses_of(items)
            with self._lock:
                if not self._live:
                    return None
                landed = native.land_get_reply(
                    items_at, len(blocks), *shard_at, sealed_at, writing_at, geometry_at, self
                )
                if landed is not None:
                    self._writers += 1
                    return landed
        return self.landing(blocks, indices, items["status"], items["length"].astype(np.int64))

    def _segments(
        self,
        blocks: IntArray,
        indices: IntArray,
        statuses: npt.NDArray[np.uint8],
        lengths: IntArray,
        live: npt.NDArray[np.bool_],
        ok: npt.NDArray[np.bool_] | None = None,
    ) -> native.Segments:
        """The reply's data section as segments (see :meth:`_segments_numpy`)."""
        if not native.AVAILABLE:
            return self._segments_numpy(blocks, indices, statuses, lengths, live)
        if ok is None:
            ok = statuses == 0
        # Records not asked for (a length other than a shard's) or too late: scratch.
        scratch_rows = ok & ~((lengths == HEADER_BYTES + self.length) & live)
        scratch: npt.NDArray[np.uint8] | None = None
        geometry = self._geometry
        if scratch_rows.any():
            scratch = np.empty(max(int(lengths[scratch_rows].sum()), 1), np.uint8)
            geometry = geometry.copy()
            geometry[10] = native.addresses_of(scratch)
        return native.landing_segments(
            blocks, indices, statuses, lengths, live, geometry, (self, scratch)
        )

    def _segments_numpy(
        self,
        blocks: IntArray,
        indices: IntArray,
        statuses: npt.NDArray[np.uint8],
        lengths: IntArray,
        live: npt.NDArray[np.bool_],
    ) -> native.Segments:
        """The reply's data section as segments, computed over the whole reply: per item a
        header and a body (one part in ``out``, one in the pad, or one in parity), or one
        scratch segment for a record not asked for or too late. Items not OK send nothing.
        The native library's ``kv_landing_segments`` makes the same segments."""
        length, payload, k = self.length, self.payload_len, self.k
        count = len(blocks)
        record = HEADER_BYTES + length
        ok = statuses == 0
        wanted = ok & (lengths == record) & live
        scratch_rows = ok & ~wanted
        scratch: npt.NDArray[np.uint8] | None = None
        addrs = np.zeros((count, 4), np.uint64)
        lens = np.zeros((count, 4), np.uint64)
        if scratch_rows.any():
            # A record of another length for an open block: its header to the odd headers
            # table, the rest (and any record of a sealed block) to scratch.
            odd = scratch_rows & live & (lengths >= HEADER_BYTES)
            if odd.any():
                rows = np.flatnonzero(odd)
                at = blocks[odd].astype(np.uint64) * np.uint64(self.n) + indices[odd].astype(
                    np.uint64
                )
                addrs[rows, 1] = native.addresses_of(self.odd_headers) + at * np.uint64(
                    HEADER_BYTES
                )
                lens[rows, 1] = HEADER_BYTES
            sizes = lengths[scratch_rows].astype(np.uint64) - np.where(
                odd[scratch_rows], np.uint64(HEADER_BYTES), np.uint64(0)
            )
            scratch = np.empty(max(int(sizes.sum()), 1), np.uint8)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
            addrs[scratch_rows, 2] = native.addresses_of(scratch) + starts
            lens[scratch_rows, 2] = sizes
        if wanted.any():
            b = blocks[wanted].astype(np.uint64)
            i = indices[wanted].astype(np.uint64)
            rows = np.flatnonzero(wanted)
            addrs[rows, 0] = self._headers_at + (b * np.uint64(self.n) + i) * np.uint64(
                HEADER_BYTES
            )
            lens[rows, 0] = HEADER_BYTES
            data = i < k
            # A data shard: [begin, end) of the payload, the part past its end in the pad.
            begin = i * np.uint64(length)
            in_out = np.clip(np.int64(payload) - begin.astype(np.int64), 0, length).astype(
                np.uint64
            )
            in_out = np.where(data, in_out, 0).astype(np.uint64)
            addrs[rows, 1] = self._out_at + b * np.uint64(payload) + begin
            lens[rows, 1] = in_out
            pad_start = np.maximum(begin.astype(np.int64) - payload, 0).astype(np.uint64)
            addrs[rows, 2] = self._pad_at + b * np.uint64(self.pad_len) + pad_start
            lens[rows, 2] = np.where(data, np.uint64(length) - in_out, 0)
            parity_row = b * np.uint64(self.m) + np.where(data, 0, i - np.uint64(k))
            addrs[rows, 3] = self._parity_at + parity_row * np.uint64(length)
            lens[rows, 3] = np.where(data, 0, length)
        return native.Segments.of(addrs, lens, (self, scratch))

    def burst_target(self) -> int | None:
        """The address of the tables a native burst lands and accepts replies with (those
        of :meth:`land_reply`, then those of :meth:`accept_reply`: ``kv_burst_target`` in
        kvfast.c), or None once the load is over (or without the native library). A reply a
        burst lands but does not finish is then claimed with :meth:`claim_landing`."""
        if not native.AVAILABLE:
            return None
        with self._lock:
            if not self._live:
                return None
        if self._burst_target is None:
            self._burst_target = np.array([*self._land_at, *self._accept_at[1:]], np.uint64)
            self._burst_target_at = native.addresses_of(self._burst_target)
        return self._burst_target_at

    def claim_landing(self) -> None:
        """A native burst landed a reply here (on the thread that drives this load, before
        it verifies anything): counted as :meth:`land_reply` counts its own."""
        with self._lock:
            self._writers += 1

    def landed(self, writes: IntArray, writes_at: int = 0) -> None:
        """A claimed landing of ``writes`` blocks is over (received, or failed);
        ``writes_at``: their address, where a native landing gave one."""
        with self._lock:
            self._writers -= 1
            if writes_at:
                native.add_at(self._land_at[1], writes_at, len(writes), -1)
            else:
                np.subtract.at(self._writing, writes, 1)
            if not self._live:  # close() may be waiting for this landing
                self._cond.notify_all()

    def seal(self, blocks: IntArray) -> bool:
        """From now on no reply writes into ``blocks``; True once no landing already
        writing into them is left (then the driver may verify them; else it tries again
        when the next reply is in, and the I/O threads never wait for it)."""
        with self._cond:
            self.sealed[blocks] = True
            return not self._writing[blocks].any()

    def unseal(self, blocks: IntArray) -> None:
        """Let replies land in ``blocks`` again (their asks were escalated)."""
        with self._cond:
            self.sealed[blocks] = False

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

    def release(self) -> None:
        """Give the parity scratch back to its cache: the load is over (closed: nothing
        lands any more) and nothing reads its parity rows again."""
        if self._live:
            raise KVCacheError(
                "release() of a load assembly before close(): replies may still land"
            )
        if self._scratch is not None:
            scratch, self._scratch = self._scratch, None
            scratch.give(self._parity_buffer)

    # -------------------------------------------------------------- checks (driver thread)

    def accept(
        self,
        blocks: IntArray,
        indices: IntArray,
        statuses: npt.NDArray[np.uint8],
        lengths: IntArray,
    ) -> npt.NDArray[np.bool_]:
        """Per item of a landed reply: is it exactly the shard asked for? Marks those as got.

        Items of sealed blocks are ignored: their bytes went to scratch.
        """
        if native.AVAILABLE:
            return native.accept_items(blocks, indices, statuses, lengths, self._accept_at)
        return self._accept_numpy(blocks, indices, statuses, lengths)

    def accept_reply(
        self,
        blocks: IntArray,
        indices: IntArray,
        shard_at: tuple[int, int],
        items: npt.NDArray[np.void],
        landed: native.GetLanding | None = None,
    ) -> npt.NDArray[np.bool_]:
        """:meth:`accept` of a landed GET reply from its own items (see :meth:`land_reply`;
        ``landed``: its native landing, whose buffer takes the verdicts)."""
        if landed is not None:
            native.accept_get_reply(
                native.addresses_of(items), len(blocks), *shard_at, self._accept_at,
                landed.accepted_at,
            )  # fmt: skip
            return landed.accepted
        return self.accept(blocks, indices, items["status"], items["length"].astype(np.int64))

    def _accept_numpy(
        self,
        blocks: IntArray,
        indices: IntArray,
        statuses: npt.NDArray[np.uint8],
        lengths: IntArray,
    ) -> npt.NDArray[np.bool_]:
        """:meth:`accept` without the native library (the same verdicts and marks)."""
        open_ = ~self.sealed[blocks]
        blocks, indices = blocks[open_], indices[open_]
        statuses, lengths = statuses[open_], lengths[open_]
        if not open_.all():
            accepted_all = np.zeros(len(open_), bool)
            accepted_all[open_] = self._accept_numpy(blocks, indices, statuses, lengths)
            return accepted_all
        missing = statuses == 1  # Status.NOT_FOUND
        if missing.any():
            self.not_found[blocks[missing], indices[missing]] = True
        ok = (statuses == 0) & (lengths == HEADER_BYTES + self.length)
        accepted = np.zeros(len(blocks), bool)
        if not ok.any():
            wrong_length = statuses == 0
            self.rejected[blocks[wrong_length], indices[wrong_length]] = True
            return accepted
        b, i = blocks[ok], indices[ok]
        flat = b * self.n + i
        # Exactly the shard asked for: its identity bytes are what they must be. The rest
        # of the header (claims, checksum) is left to the payload hash and _locate: a
        # damaged claim fails the block's check, and then every shard is examined.
        received = self._header_rows.take(flat, axis=0)
        expected = self._identities.take(flat, axis=0)
        unknown = self._unknown[b]
        if unknown.any():  # any stripe will do for now; verify() settles on one per block
            expected[unknown, _STRIPE_AT : _STRIPE_AT + 8] = received[
                unknown, _STRIPE_AT : _STRIPE_AT + 8
            ]
        good = identity_matches(received, expected)
        accepted[ok] = good
        self.got[b[good], i[good]] = True
        self.rejected[b[~good], i[~good]] = True
        wrong_length = (statuses == 0) & ~ok
        if wrong_length.any():
            self.rejected[blocks[wrong_length], indices[wrong_length]] = True
        return accepted

    def bad_shards(self, b: int, verdict: BlockVerdict) -> set[int]:
        """Shards of verified block ``b`` its holders have wrong: rejected on arrival, found
        bad, or with a header a repair may not copy (damaged, or claiming another payload
        hash, class or time than the block's own: :func:`~kvcache.shard.repair_reference`).
        Only blocks a repair is due for come here, so the healthy load never pays for it."""
        _ref, deviating = self._reference(b)
        return (
            set(verdict.bad_indices)
            | set(np.flatnonzero(self.rejected[b]).tolist())
            | set(np.flatnonzero(deviating).tolist())
        )

    def _reference(self, b: int) -> tuple[int | None, npt.NDArray[np.bool_]]:
        digest = xxhash.xxh3_128_digest(self.out[b].data)
        return repair_reference(self.headers[b], self.got[b], digest)

    def verify(self, blocks: list[int]) -> list[BlockVerdict]:
        """A verdict for each of ``blocks`` (see the module docstring)."""
        verdicts = self.verify_arrays(np.asarray(blocks, np.int64))
        return [
            BlockVerdict(bool(g), bool(r), verdicts.bad.get(b, ()))
            for b, g, r in zip(
                blocks, verdicts.good.tolist(), verdicts.rebuilt.tolist(), strict=True
            )
        ]

    def verify_arrays(self, blocks: IntArray) -> Verdicts:
        """:meth:`verify` as arrays over ``blocks`` (distinct): a healthy load's check
        builds no object per block."""
        idx = np.asarray(blocks, np.int64)
        if self._unknown.any():
            self._settle_stripes(idx)
        k = self.k
        good = np.zeros(len(idx), bool)
        rebuilt = np.zeros(len(idx), bool)
        bad: dict[int, tuple[int, ...]] = {}
        # Fast path: every data shard arrived; one batched hash call for all such blocks.
        fast, digests, at = self._fast_matches(idx)
        good[at] = True
        bad.update(self._wrong_claims(fast, digests))
        if good.all():
            return Verdicts(good, rebuilt, bad)
        # Rebuild every block that lost a data shard, whatever its erasure pattern, in one
        # codec call.
        got = self.got[idx]
        degraded = np.flatnonzero(~good & ~got[:, :k].all(axis=1) & (got.sum(axis=1) >= k))
        if len(degraded):
            ok = self._rebuild(idx[degraded])
            good[degraded] = ok
            rebuilt[degraded] = ok
        # What is left either failed its check or is short of shards.
        for j in np.flatnonzero(~good).tolist():
            b = int(idx[j])
            verdict = self._locate(b)
            good[j], rebuilt[j] = verdict.good, verdict.rebuilt
            if verdict.bad_indices:
                bad[b] = verdict.bad_indices
        return Verdicts(good, rebuilt, bad)

    def _settle_stripes(self, blocks: IntArray) -> None:
        """Blocks loaded without a known stripe take the one most of their received shards
        carry; shards of any other stripe are rejected (a reader never mixes stripes)."""
        idx = np.asarray(blocks, np.int64)
        idx = idx[self._unknown[idx] & self.got[idx].any(axis=1)]
        if not len(idx):
            return
        got = self.got[idx]
        ids = self.headers["stripe_id"][idx]
        low = np.where(got, ids, np.uint64(2**64 - 1)).min(axis=1)
        high = np.where(got, ids, np.uint64(0)).max(axis=1)
        chosen = low.copy()
        for j in np.flatnonzero(low != high).tolist():  # shards of two stripes: rare
            values, counts = np.unique(ids[j][got[j]], return_counts=True)
            chosen[j] = values[np.argmax(counts)]
        other = got & (ids != chosen[:, None])
        if other.any():
            rows, cols = np.nonzero(other)
            self.got[idx[rows], cols] = False
            self.rejected[idx[rows], cols] = True
        self.stripes[idx] = chosen
        self._unknown[idx] = False
        identities = self._identities.reshape(len(self.key_words), self.n, -1)
        identities[idx, :, _STRIPE_AT : _STRIPE_AT + 8] = (
            chosen.astype("<u8").view(np.uint8).reshape(len(idx), 1, 8)
        )

    def missing(self, b: int) -> IntArray:
        """Shard indices of block ``b`` not (validly) received."""
        return np.flatnonzero(~self.got[b]).astype(np.int64)

    def repair_shards(self, b: int, indices: tuple[int, ...]) -> list[RepairShard]:
        """Good copies of shards ``indices`` of verified block ``b``, with their headers.

        The headers' class and times are copied from a received header that passes every
        rule and claims the verified payload (:func:`~kvcache.shard.repair_reference`),
        never from an unchecked one; with no such header there is nothing to copy from
        and nothing is repaired (an empty list).
        """
        at, _deviating = self._reference(b)
        if at is None:
            return []
        stripe = self._reencode(b)
        ref = self.headers[b, at]
        # Only the shards put back need their hash (each header carries its own shard's).
        hashes = np.zeros(self.n, np.uint64)
        for i in indices:
            hashes[i] = xxhash.xxh3_64_intdigest(stripe[i].data)
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

    def _wrong_claims(
        self, blocks: IntArray, digests: npt.NDArray[np.void]
    ) -> dict[int, tuple[int, ...]]:
        """Verified blocks with received shards whose header claims a payload hash other
        than the block's (their bodies may be fine, their headers are not): those shards."""
        if not len(blocks):
            return {}
        idx = np.asarray(blocks, np.int64)
        claims = self.headers["payload_hash"][idx].view(np.uint64).reshape(len(idx), self.n, 2)
        truth = np.ascontiguousarray(digests).view(np.uint64).reshape(len(idx), 1, 2)
        wrong = self.got[idx] & (claims != truth).any(axis=2)
        if not wrong.any():
            return {}
        return {
            int(idx[j]): tuple(np.flatnonzero(wrong[j]).tolist())
            for j in np.flatnonzero(wrong.any(axis=1)).tolist()
        }

    def _fast_matches(self, idx: IntArray) -> tuple[IntArray, npt.NDArray[np.void], IntArray]:
        """Blocks of ``idx`` whose data shards all arrived and whose payload hashes to a
        hash their headers claim, with those digests (V16) and their positions in ``idx``.
        The hashes are taken in one call; a block whose first header's claim differs is
        checked against every claim (:meth:`_matches`)."""
        if not len(idx):
            return idx, np.empty(0, "V16"), idx
        at = np.flatnonzero(self.got[idx, : self.k].all(axis=1))
        complete = idx[at]
        if not len(complete):
            return complete, np.empty(0, "V16"), at
        addrs = self._out_at + complete.astype(np.uint64) * np.uint64(self.payload_len)
        digests = native.xxh3_128_many(addrs, np.uint64(self.payload_len))
        first = self.got[complete].argmax(axis=1)
        same = digests == self.headers["payload_hash"][complete, first]
        if not same.all():
            for j in np.flatnonzero(~same).tolist():  # a claim that differs: rare
                same[j] = self._matches(int(complete[j]))
            return complete[same], digests[same], at[same]
        return complete, digests, at

    def _matches(self, b: int, refs: list[bytes] | None = None) -> bool:
        digest = self._last_digest = xxhash.xxh3_128_digest(self.out[b].data)
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

    def _rebuild(self, idx: IntArray) -> npt.NDArray[np.bool_]:
        """Rebuild the missing data rows of blocks ``idx`` (each from its k lowest received
        shards) where they are read from, then check each block's payload hash; a verdict
        per block."""
        k, length, payload = self.k, self.length, self.payload_len
        rows = self._row_addresses(idx)
        present = self.got[idx]
        # The data row that crosses the payload's end is split between out and the pad:
        # the codec gets a contiguous copy of it (and it is split back if rebuilt).
        cut = self.inside if self.inside < k and self.inside * length < payload else None
        scratch = None
        head = 0
        if cut is not None:
            head = payload - cut * length
            scratch = np.zeros((len(idx), length), np.uint8)
            have = idx[present[:, cut]]
            scratch[present[:, cut], :head] = self.out[have, cut * length :]
            scratch[present[:, cut], head:] = self.pad[have, : length - head]
            rows[:, cut] = np.uint64(native.addresses_of(scratch)) + np.arange(
                len(idx), dtype=np.uint64
            ) * np.uint64(length)
        try:
            written = self.codec.reconstruct_rows_many(rows, length, present)
        except ErasureError:
            return np.zeros(len(idx), bool)
        if cut is not None and scratch is not None:
            back = written[:, cut]
            if back.any():
                again = idx[back]
                self.out[again, cut * length :] = scratch[back, :head]
                self.pad[again, : length - head] = scratch[back, head:]
        ok: npt.NDArray[np.bool_] = self._hash_matches(idx)
        return ok & (written.any(axis=1) | present[:, :k].all(axis=1))

    def _row_addresses(self, idx: IntArray) -> npt.NDArray[np.uint64]:
        """(blocks, n) addresses of each shard row where a load keeps it: data rows in
        ``out`` (or wholly in the pad), parity rows in the parity scratch. The one data row
        that crosses the payload's end has no single address: its entry is 0."""
        k, n, length, payload = self.k, self.n, self.length, self.payload_len
        b = idx.astype(np.uint64)[:, None]
        rows = np.zeros((len(idx), n), np.uint64)
        begin = np.arange(k, dtype=np.uint64) * np.uint64(length)
        inside = begin + np.uint64(length) <= np.uint64(payload)
        past = begin >= np.uint64(payload)
        rows[:, :k][:, inside] = self._out_at + b * np.uint64(payload) + begin[inside]
        if past.any():
            rows[:, :k][:, past] = (
                self._pad_at + b * np.uint64(self.pad_len) + (begin[past] - np.uint64(payload))
            )
        if self.m:
            rows[:, k:] = self._parity_at + (
                b * np.uint64(self.m) + np.arange(self.m, dtype=np.uint64)
            ) * np.uint64(length)
        return rows

    def _hash_matches(self, idx: IntArray) -> npt.NDArray[np.bool_]:
        """Per block: does its payload hash to what its headers claim? One batched hash
        call; a block whose first received header claims otherwise is checked against
        every claim (:meth:`_matches`)."""
        if not len(idx):
            return np.zeros(0, bool)
        addrs = self._out_at + idx.astype(np.uint64) * np.uint64(self.payload_len)
        digests = native.xxh3_128_many(addrs, np.uint64(self.payload_len))
        first = self.got[idx].argmax(axis=1)
        same: npt.NDArray[np.bool_] = digests == self.headers["payload_hash"][idx, first]
        for j in np.flatnonzero(~same).tolist():  # a claim that differs: rare
            same[j] = self._matches(int(idx[j]))
        return same

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
                bad = tuple(
                    i
                    for i in got.tolist()
                    if i not in intact or not np.array_equal(stripe[i], full[i])
                )
                return BlockVerdict(True, True, bad)
        # Put the received data rows back: the trials overwrote them, and an escalation
        # retries with them and the shards it adds.
        self._write_back(b, stripe)
        return BlockVerdict(False, False, tuple(got.tolist()))

    def _reencode(self, b: int) -> npt.NDArray[np.uint8]:
        """The full stripe (n, L) of verified block ``b``, from its payload."""
        stripe = np.zeros((1, self.n, self.length), np.uint8)
        stripe[0, : self.k].reshape(-1)[: self.payload_len] = self.out[b]
        self.codec.encode(stripe)
        full: npt.NDArray[np.uint8] = stripe[0]
        return full
