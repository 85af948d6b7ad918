"""The shard format: a fixed, versioned header in front of each shard's bytes.

A block's payload is cut into k data shards and m parity shards; each shard
travels and rests as ``header || body``. The header names the block (key), the
write (stripe id), the shard's place in the stripe and the checksums a reader
needs to never hand on wrong bytes. Layout and rules: ``docs/spec/shard-layout.md``.

Parsing takes untrusted bytes and raises only :class:`ShardFormatError`
(malformed) or :class:`IntegrityError` (a checksum does not match).
"""

from __future__ import annotations

import re
import secrets
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache import native
from kvcache.errors import IntegrityError, ShardFormatError
from kvcache.keys import KEY_BYTES, BlockKey

__all__ = [
    "HEADER_BYTES",
    "HEADER_DTYPE",
    "MAGIC",
    "MAX_CLASS_NAME",
    "SHARD_ALIGNMENT",
    "VERSION",
    "ShardHeader",
    "build_headers",
    "check_class_name",
    "fill_header_checks",
    "header_checks",
    "header_verdicts",
    "identity_matches",
    "identity_prefixes",
    "IDENTITY_BYTES",
    "new_stripe_id",
    "payload_hash",
    "repair_reference",
    "shard_hash",
    "shard_len_for",
    "split_shard",
]

MAGIC = b"KVSH"
VERSION = 1
#: Shards are ``ceil(payload_len / k)`` bytes rounded up to this many (format v1).
SHARD_ALIGNMENT = 64
MAX_CLASS_NAME = 15
_CLASS_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,14}\Z")

# magic, version, header_len, k, m, shard_index, class_len, reserved,
# payload_len, shard_len, stripe_id, block_key, payload_hash, shard_hash,
# created_ms, expiry_ms, class_name
_BODY = struct.Struct("<4sBBBBBBHIIQ16s16sQQQ16s")
_CHECK = struct.Struct("<I")
HEADER_BYTES = _BODY.size + _CHECK.size  # 104

#: The same 104-byte header as a numpy record, for building and reading many at once.
HEADER_DTYPE = np.dtype(
    [
        ("magic", "S4"),
        ("version", "u1"),
        ("header_len", "u1"),
        ("k", "u1"),
        ("m", "u1"),
        ("shard_index", "u1"),
        ("class_len", "u1"),
        ("reserved", "<u2"),
        ("payload_len", "<u4"),
        ("shard_len", "<u4"),
        ("stripe_id", "<u8"),
        ("block_key", "V16"),
        ("payload_hash", "V16"),
        ("shard_hash", "<u8"),
        ("created_ms", "<u8"),
        ("expiry_ms", "<u8"),
        ("traffic_class", "S16"),
        ("header_check", "<u4"),
    ]
)
_NAME_AT: int = HEADER_DTYPE.fields["traffic_class"][1]  # type: ignore[index]


def check_class_name(name: str) -> str:
    """Return ``name`` if it is a valid traffic-class name, else raise ShardFormatError."""
    if not isinstance(name, str) or not _CLASS_RE.match(name):
        raise ShardFormatError(
            f"traffic class {name!r} is invalid: use 1-{MAX_CLASS_NAME} characters of "
            "a-z, 0-9, '_' or '-', starting with a letter or digit"
        )
    return name


def shard_len_for(payload_len: int, k: int) -> int:
    """Length of each shard of a ``payload_len``-byte block cut into ``k`` data shards."""
    per = -(-payload_len // k)
    return -(-per // SHARD_ALIGNMENT) * SHARD_ALIGNMENT


def new_stripe_id() -> int:
    """A fresh random nonzero 64-bit stripe id, one per write of a block (0 means "any")."""
    return secrets.randbits(64) or 1


def payload_hash(payload: bytes | memoryview) -> bytes:
    """xxh3-128 of a whole block payload (16 bytes)."""
    return xxhash.xxh3_128_digest(payload)


def shard_hash(body: bytes | memoryview) -> int:
    """xxh3-64 of one shard's bytes."""
    return int(xxhash.xxh3_64_intdigest(body))


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardHeader:
    """The header of one shard; validates itself when built."""

    block_key: BlockKey
    stripe_id: int
    shard_index: int
    k: int
    m: int
    payload_len: int
    shard_hash: int
    payload_hash: bytes
    traffic_class: str
    created_ms: int
    expiry_ms: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_key, bytes) or len(self.block_key) != KEY_BYTES:
            raise ShardFormatError(f"block key must be {KEY_BYTES} bytes, got {self.block_key!r}")
        if not isinstance(self.payload_hash, bytes) or len(self.payload_hash) != 16:
            raise ShardFormatError("payload hash must be 16 bytes")
        _check_range("k", self.k, 1, 255)
        _check_range("m", self.m, 0, 255 - self.k)
        _check_range("shard_index", self.shard_index, 0, self.k + self.m - 1)
        _check_range("payload_len", self.payload_len, 1, 0xFFFFFFFF)
        _check_range("stripe_id", self.stripe_id, 0, 2**64 - 1)
        _check_range("shard_hash", self.shard_hash, 0, 2**64 - 1)
        _check_range("created_ms", self.created_ms, 0, 2**64 - 1)
        _check_range("expiry_ms", self.expiry_ms, self.created_ms, 2**64 - 1)
        check_class_name(self.traffic_class)
        if self.shard_len > 0xFFFFFFFF:
            raise ShardFormatError(f"shard length {self.shard_len} does not fit 32 bits")

    @property
    def n(self) -> int:
        """Shards in the stripe (k + m)."""
        return self.k + self.m

    @property
    def shard_len(self) -> int:
        """Bytes in this shard's body."""
        return shard_len_for(self.payload_len, self.k)

    def pack(self) -> bytes:
        """The header's bytes (``HEADER_BYTES`` long)."""
        name = self.traffic_class.encode("ascii")
        body = _BODY.pack(
            MAGIC,
            VERSION,
            HEADER_BYTES,
            self.k,
            self.m,
            self.shard_index,
            len(name),
            0,
            self.payload_len,
            self.shard_len,
            self.stripe_id,
            self.block_key,
            self.payload_hash,
            self.shard_hash,
            self.created_ms,
            self.expiry_ms,
            name.ljust(16, b"\x00"),
        )
        return body + _CHECK.pack(_header_check(body))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> ShardHeader:
        """Parse the first ``HEADER_BYTES`` of untrusted ``data``; raise ShardFormatError."""
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if len(view) < HEADER_BYTES:
            raise ShardFormatError(
                f"shard header truncated: {len(view)} bytes, need {HEADER_BYTES}"
            )
        if view[:4] != MAGIC:
            raise ShardFormatError(f"bad shard magic {bytes(view[:4])!r}, expected {MAGIC!r}")
        if view[4] != VERSION:
            raise ShardFormatError(
                f"unsupported shard format version {view[4]}; this build reads {VERSION}"
            )
        (
            _magic,
            _version,
            header_len,
            k,
            m,
            shard_index,
            class_len,
            reserved,
            payload_len,
            shard_len,
            stripe_id,
            block_key,
            p_hash,
            s_hash,
            created_ms,
            expiry_ms,
            name,
        ) = _BODY.unpack_from(view)
        (check,) = _CHECK.unpack_from(view, _BODY.size)
        if header_len != HEADER_BYTES:
            raise ShardFormatError(f"shard header length {header_len}, expected {HEADER_BYTES}")
        if check != _header_check(view[: _BODY.size]):
            raise ShardFormatError("shard header checksum mismatch: header corrupted")
        if reserved != 0:
            raise ShardFormatError(f"reserved header field is {reserved}, must be 0")
        if not 1 <= class_len <= MAX_CLASS_NAME or any(name[class_len:]):
            raise ShardFormatError(f"bad traffic class field (length {class_len})")
        try:
            traffic_class = name[:class_len].decode("ascii")
        except UnicodeDecodeError as exc:
            raise ShardFormatError("traffic class is not ASCII") from exc
        header = cls(
            block_key=BlockKey(block_key),
            stripe_id=stripe_id,
            shard_index=shard_index,
            k=k,
            m=m,
            payload_len=payload_len,
            shard_hash=s_hash,
            payload_hash=p_hash,
            traffic_class=traffic_class,
            created_ms=created_ms,
            expiry_ms=expiry_ms,
        )
        if shard_len != header.shard_len:
            raise ShardFormatError(
                f"shard length {shard_len} does not match payload {payload_len} / k {k} "
                f"(expected {header.shard_len})"
            )
        return header

    def verify_body(self, body: bytes | memoryview) -> None:
        """Raise if ``body`` is not this shard's bytes (wrong length or checksum)."""
        if len(body) != self.shard_len:
            raise ShardFormatError(
                f"shard {self.shard_index} body is {len(body)} bytes, header says {self.shard_len}"
            )
        actual = shard_hash(body)
        if actual != self.shard_hash:
            raise IntegrityError(
                f"shard {self.shard_index} of block {self.block_key.hex()} fails its checksum",
                expected=self.shard_hash,
                actual=actual,
            )


def split_shard(data: bytes | memoryview) -> tuple[ShardHeader, memoryview]:
    """Parse ``header || body`` and check the body; returns the header and a view of the body."""
    header = ShardHeader.unpack(data)
    body = memoryview(data)[HEADER_BYTES:]
    header.verify_body(body)
    return header, body


def fill_header_checks(records: npt.NDArray[np.void]) -> None:
    """Compute ``header_check`` for HEADER_DTYPE records whose other fields are filled."""
    records["header_check"] = header_checks(records)


def header_checks(records: npt.NDArray[np.void]) -> npt.NDArray[np.uint32]:
    """The ``header_check`` each of HEADER_DTYPE ``records`` must carry (low 32 bits of
    XXH3-64 of its first 100 bytes): one batched hash call for all of them."""
    flat = np.ascontiguousarray(records.reshape(-1))
    if not native.AVAILABLE:
        raw = flat.view(np.uint8).reshape(len(flat), HEADER_BYTES)
        digest = xxhash.xxh3_64_intdigest
        values = np.fromiter(
            (digest(raw[i, : _BODY.size].data) for i in range(len(flat))), np.uint64, len(flat)
        )
    else:
        base = native.addresses_of(flat) if len(flat) else 0
        addrs = base + np.arange(len(flat), dtype=np.uint64) * np.uint64(HEADER_BYTES)
        values = native.xxh3_64_many(addrs, np.uint64(_BODY.size))
    checks: npt.NDArray[np.uint32] = (values & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return checks.reshape(records.shape)


def build_headers(
    *,
    keys: npt.NDArray[np.void],
    stripe_ids: npt.NDArray[np.uint64],
    k: int,
    m: int,
    payload_len: int,
    payload_hashes: npt.NDArray[np.void],
    shard_hashes: npt.NDArray[np.uint64],
    traffic_class: str,
    created_ms: int,
    expiry_ms: int,
) -> npt.NDArray[np.void]:
    """Headers of every shard of a batch of blocks, shape (blocks, k + m), checks filled.

    The vectorised twin of :meth:`ShardHeader.pack` (the differential test in
    ``tests/test_shard.py`` holds them byte-identical): ``keys``,
    ``stripe_ids`` and ``payload_hashes`` have one entry per block,
    ``shard_hashes`` one per shard.
    """
    blocks, n = len(keys), k + m
    check_class_name(traffic_class)
    name = traffic_class.encode("ascii")
    headers = np.zeros((blocks, n), HEADER_DTYPE)
    headers["magic"] = MAGIC
    headers["version"] = VERSION
    headers["header_len"] = HEADER_BYTES
    headers["k"] = k
    headers["m"] = m
    headers["shard_index"] = np.arange(n)[None, :]
    headers["class_len"] = len(name)
    headers["payload_len"] = payload_len
    headers["shard_len"] = shard_len_for(payload_len, k)
    headers["stripe_id"] = stripe_ids[:, None]
    headers["block_key"] = keys[:, None]
    headers["payload_hash"] = payload_hashes[:, None]
    headers["shard_hash"] = shard_hashes
    headers["created_ms"] = created_ms
    headers["expiry_ms"] = expiry_ms
    headers["traffic_class"] = name
    fill_header_checks(headers.reshape(-1))
    return headers


_NAME_FIRST = np.zeros(256, dtype=bool)
_NAME_REST = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyz0123456789":
    _NAME_FIRST[_c] = _NAME_REST[_c] = True
for _c in b"_-":
    _NAME_REST[_c] = True


#: Bytes 0..IDENTITY_BYTES of a header say which shard it is (magic, version, header
#: length, k, m, shard index, payload and shard lengths, stripe id, block key); only the
#: class name length (byte 9) among them varies between writers of the same shard.
IDENTITY_BYTES: int = HEADER_DTYPE.fields["payload_hash"][1]  # type: ignore[index]
_CLASS_LEN_AT: int = HEADER_DTYPE.fields["class_len"][1]  # type: ignore[index]


def identity_prefixes(
    keys: npt.NDArray[np.void], stripe_ids: npt.NDArray[np.uint64], *, k: int, m: int,
    payload_len: int,
) -> npt.NDArray[np.uint8]:  # fmt: skip
    """(blocks, k + m, IDENTITY_BYTES): the identity bytes every shard's header must carry,
    class length zeroed. A reader compares received headers against them with
    :func:`identity_matches` instead of running every rule of :func:`header_verdicts`:
    a header that equals the identity of the shard asked for passes those rules' parts on
    these fields by construction, and whatever else is wrong shows in the payload hash."""
    blocks, n = len(keys), k + m
    headers = np.zeros((blocks, n), HEADER_DTYPE)
    headers["magic"] = MAGIC
    headers["version"] = VERSION
    headers["header_len"] = HEADER_BYTES
    headers["k"] = k
    headers["m"] = m
    headers["shard_index"] = np.arange(n)[None, :]
    headers["payload_len"] = payload_len
    headers["shard_len"] = shard_len_for(payload_len, k)
    headers["stripe_id"] = stripe_ids[:, None]
    headers["block_key"] = keys[:, None]
    raw = headers.view(np.uint8).reshape(blocks, n, HEADER_BYTES)[:, :, :IDENTITY_BYTES]
    return np.ascontiguousarray(raw)


def identity_matches(
    received: npt.NDArray[np.uint8], expected: npt.NDArray[np.uint8]
) -> npt.NDArray[np.bool_]:
    """Per row: do the received headers' identity bytes (rows of at least IDENTITY_BYTES)
    equal the expected ones, with a class length in 1..MAX_CLASS_NAME?"""
    head = received[:, :IDENTITY_BYTES]
    class_len = head[:, _CLASS_LEN_AT]
    same = head[:, :_CLASS_LEN_AT] == expected[:, :_CLASS_LEN_AT]
    rest = head[:, _CLASS_LEN_AT + 1 :] == expected[:, _CLASS_LEN_AT + 1 :]
    ok: npt.NDArray[np.bool_] = (
        same.all(axis=1) & rest.all(axis=1) & (class_len >= 1) & (class_len <= MAX_CLASS_NAME)
    )
    return ok


def header_verdicts(
    headers: npt.NDArray[np.void], *, checksum: bool = True
) -> npt.NDArray[np.bool_]:
    """Per record: does :meth:`ShardHeader.unpack` accept this header? Without a Python
    object per record: every rule is a column expression, only the header checksum is
    computed record by record. The one vectorised home of the header rules; the
    daemon's PUT checks and the client's reply checks both use it.

    ``checksum=False`` skips the header checksum: a reader that verifies the whole
    payload against its hash (and checks the checksums only when that fails) need
    not pay ~1 µs per shard for it.
    """
    hdr = headers.reshape(-1)
    k = hdr["k"].astype(np.int64)
    m = hdr["m"].astype(np.int64)
    payload_len = hdr["payload_len"].astype(np.int64)
    per = -(-payload_len // np.maximum(k, 1))
    shard_len = -(-per // SHARD_ALIGNMENT) * SHARD_ALIGNMENT
    class_len = hdr["class_len"].astype(np.int64)
    raw = hdr.view(np.uint8).reshape(len(hdr), HEADER_BYTES)
    names = raw[:, _NAME_AT : _NAME_AT + MAX_CLASS_NAME + 1]
    col = np.arange(names.shape[1])
    inside = col[None, :] < class_len[:, None]
    allowed = np.where(col[None, :] == 0, _NAME_FIRST[names], _NAME_REST[names])
    names_ok = np.where(inside, allowed, names == 0).all(axis=1)
    ok = (
        (hdr["magic"] == MAGIC)
        & (hdr["version"] == VERSION)
        & (hdr["header_len"] == HEADER_BYTES)
        & (hdr["reserved"] == 0)
        & (k >= 1)
        & (m <= 255 - k)
        & (hdr["shard_index"].astype(np.int64) < k + m)
        & (payload_len >= 1)
        & (hdr["expiry_ms"] >= hdr["created_ms"])
        & (shard_len <= 0xFFFFFFFF)
        & (hdr["shard_len"].astype(np.int64) == shard_len)
        & (class_len >= 1)
        & (class_len <= MAX_CLASS_NAME)
        & names_ok
    )
    if checksum and ok.any():
        ok &= header_checks(hdr) == hdr["header_check"]
    result: npt.NDArray[np.bool_] = ok.reshape(headers.shape)
    return result


_HASH_AT: int = HEADER_DTYPE.fields["payload_hash"][1]  # type: ignore[index]
_CREATED_AT: int = HEADER_DTYPE.fields["created_ms"][1]  # type: ignore[index]
_CHECK_AT: int = HEADER_DTYPE.fields["header_check"][1]  # type: ignore[index]


def _claims(raw: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Per header row: the bytes every shard of one write carries alike (payload hash,
    times, class name and its length), as one contiguous row each."""
    return np.ascontiguousarray(
        np.concatenate(
            [
                raw[:, _CLASS_LEN_AT : _CLASS_LEN_AT + 1],
                raw[:, _HASH_AT : _HASH_AT + 16],
                raw[:, _CREATED_AT:_CHECK_AT],
            ],
            axis=1,
        )
    )


def repair_reference(
    headers: npt.NDArray[np.void], got: npt.NDArray[np.bool_], digest: bytes
) -> tuple[int | None, npt.NDArray[np.bool_]]:
    """Which received header of one verified block a repair may copy its fields from.

    ``headers`` are the block's k + m header records, ``got`` marks the ones received
    (their identity already matched), ``digest`` is the xxh3-128 of the verified payload.
    A candidate passes every rule of :func:`header_verdicts`, checksum included, and
    claims ``digest``; among candidates the claims (class, times) most of them carry win.
    Returns (that header's position or None when no header qualifies, a mask of the
    received shards whose header deviates from it: damaged, or claiming another payload
    hash, class or time: bad records to repair like a bad body).
    """
    hdr = headers.reshape(-1)
    raw = hdr.view(np.uint8).reshape(len(hdr), HEADER_BYTES)
    sound = header_verdicts(hdr) & got.reshape(-1)
    sound &= (raw[:, _HASH_AT : _HASH_AT + 16] == np.frombuffer(digest, np.uint8)).all(axis=1)
    deviating = got.reshape(-1).copy()
    candidates = np.flatnonzero(sound)
    if not len(candidates):
        return None, deviating
    claims = _claims(raw)
    rows = claims[candidates].view(f"V{claims.shape[1]}").reshape(-1)
    _values, first, counts = np.unique(rows, return_index=True, return_counts=True)
    best = int(candidates[first[np.argmax(counts)]])
    same = (claims == claims[best]).all(axis=1)
    deviating &= ~(sound & same)
    return best, deviating


def _header_check(body: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(body)) & 0xFFFFFFFF


def _check_range(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ShardFormatError(f"shard header field {name}={value!r} outside {low}..{high}")
