"""The data-path wire protocol, without I/O: frames in, typed messages out.

Every request and reply is a multipart zmq message of three frames, plus a
fourth when authenticated::

    [header (36 bytes)] [items: count fixed-size records] [data] ([mac (32 bytes)])

The header is versioned and fixed; the item record type depends on the op and
direction (see ``ITEM_DTYPES``); the data frame carries the raw bytes the items
point into (shards for PUT requests and GET replies, JSON for STATS, an error
text for failed replies). Records are numpy structured arrays so a batch of
thousands of items is encoded and parsed without a Python loop per item.
``docs/spec/wire.md`` is the normative description.

Decoding takes untrusted frames and raises only :class:`ProtocolError`
(or :class:`AuthError` for a bad MAC): never an assert, never another exception.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import AuthError, ProtocolError, ShardFormatError
from kvcache.shard import MAX_CLASS_NAME, check_class_name

__all__ = [
    "FLAG_MAC",
    "FLAG_REPLY",
    "HEADER_BYTES",
    "ITEM_DTYPES",
    "MAC_BYTES",
    "MAGIC",
    "NO_INDEX",
    "VERSION",
    "Frame",
    "Header",
    "Limits",
    "Message",
    "Op",
    "Status",
    "data_offsets",
    "decode",
    "encode",
    "error_reply",
    "item_dtype",
    "make_items",
]

MAGIC = b"KV"
VERSION = 1
FLAG_REPLY = 0x1
FLAG_MAC = 0x2
_KNOWN_FLAGS = FLAG_REPLY | FLAG_MAC
MAC_BYTES = 32
#: ``index`` value in DELETE items meaning "every shard of the key on this node".
NO_INDEX = 0xFFFF

_HEADER = struct.Struct("<2sBBHHQI16s")
HEADER_BYTES = _HEADER.size  # 36

Frame = bytes | bytearray | memoryview


class Op(enum.IntEnum):
    """What a request asks for. Every op is batched."""

    PUT = 1
    GET = 2
    HAS = 3
    TOUCH = 4
    DELETE = 5
    STATS = 6


class Status(enum.IntEnum):
    """Per-item (< 16) and per-message (>= 16) outcomes."""

    OK = 0
    NOT_FOUND = 1
    BAD_ITEM = 2
    CHECKSUM = 3
    WRONG_KEY = 4
    NO_SPACE = 5
    INTERNAL = 6
    BAD_REQUEST = 16
    UNAUTHORIZED = 17
    TOO_LARGE = 18
    UNAVAILABLE = 19


_KEY = ("key", "V16")
#: Record type per (op, is_reply).
ITEM_DTYPES: dict[tuple[Op, bool], np.dtype[np.void]] = {
    (Op.PUT, False): np.dtype([_KEY, ("index", "<u2"), ("pad", "<u2"), ("length", "<u4")]),
    (Op.PUT, True): np.dtype([("status", "u1")]),
    (Op.GET, False): np.dtype([_KEY, ("index", "<u2"), ("pad", "V6")]),
    (Op.GET, True): np.dtype([("status", "u1"), ("pad", "V3"), ("length", "<u4")]),
    (Op.HAS, False): np.dtype([_KEY]),
    # One record per shard held: which request item (ordinal), shard index, stripe id.
    (Op.HAS, True): np.dtype(
        [("ordinal", "<u4"), ("index", "<u2"), ("pad", "<u2"), ("stripe", "<u8")]
    ),
    (Op.TOUCH, False): np.dtype([_KEY]),
    (Op.TOUCH, True): np.dtype([("status", "u1")]),
    (Op.DELETE, False): np.dtype([_KEY, ("stripe", "<u8"), ("index", "<u2"), ("pad", "V6")]),
    (Op.DELETE, True): np.dtype([("status", "u1")]),
    (Op.STATS, False): np.dtype([("pad", "u1")]),
    (Op.STATS, True): np.dtype([("pad", "u1")]),
}

#: Ops whose items carry a ``length`` each, pointing consecutively into the data frame.
_LENGTH_ITEMS = {(Op.PUT, False), (Op.GET, True)}


def item_dtype(op: Op, *, reply: bool) -> np.dtype[np.void]:
    """The record type of ``op``'s items in a request (or reply)."""
    return ITEM_DTYPES[(op, reply)]


def make_items(op: Op, count: int, *, reply: bool) -> npt.NDArray[np.void]:
    """A zeroed record array for ``count`` items of ``op``."""
    return np.zeros(count, dtype=item_dtype(op, reply=reply))


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Hard bounds on what a peer may send; anything larger is refused unread."""

    max_items: int = 16384
    max_data_bytes: int = 256 << 20

    @property
    def max_frame_bytes(self) -> int:
        """Largest single frame (what ``ZMQ_MAXMSGSIZE`` is set to)."""
        widest = max(dt.itemsize for dt in ITEM_DTYPES.values())
        return max(self.max_data_bytes, self.max_items * widest, HEADER_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """The fixed first frame of every message."""

    op: Op
    request_id: int
    count: int
    status: Status = Status.OK
    flags: int = 0
    traffic_class: str = ""

    @property
    def is_reply(self) -> bool:
        """Whether this header belongs to a reply."""
        return bool(self.flags & FLAG_REPLY)

    def pack(self) -> bytes:
        """The 36-byte header frame."""
        name = self.traffic_class.encode("ascii")
        return _HEADER.pack(
            MAGIC,
            VERSION,
            int(self.op),
            self.flags,
            int(self.status),
            self.request_id,
            self.count,
            bytes([len(name)]) + name.ljust(MAX_CLASS_NAME, b"\x00"),
        )

    @classmethod
    def unpack(cls, frame: Frame) -> Header:
        """Parse an untrusted header frame."""
        if len(frame) != HEADER_BYTES:
            raise ProtocolError(f"header frame is {len(frame)} bytes, expected {HEADER_BYTES}")
        magic, version, op, flags, status, request_id, count, cls_field = _HEADER.unpack(frame)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ProtocolError(
                f"unsupported protocol version {version}; this build speaks {VERSION}"
            )
        try:
            op_value = Op(op)
        except ValueError:
            raise ProtocolError(f"unknown op {op}") from None
        try:
            status_value = Status(status)
        except ValueError:
            raise ProtocolError(f"unknown status {status}") from None
        if flags & ~_KNOWN_FLAGS:
            raise ProtocolError(f"unknown flags 0x{flags:04x}")
        name_len = cls_field[0]
        if name_len > MAX_CLASS_NAME or any(cls_field[1 + name_len :]):
            raise ProtocolError("malformed traffic class field")
        name = ""
        if name_len:
            try:
                name = check_class_name(cls_field[1 : 1 + name_len].decode("ascii"))
            except (UnicodeDecodeError, ShardFormatError) as exc:
                raise ProtocolError(f"bad traffic class in header: {exc}") from None
        return cls(
            op=op_value,
            request_id=request_id,
            count=count,
            status=status_value,
            flags=flags,
            traffic_class=name,
        )


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded request or reply: header, item records and the raw data frame."""

    header: Header
    items: npt.NDArray[np.void]
    data: memoryview

    def error_text(self) -> str:
        """The error text of a failed reply (its data frame)."""
        return bytes(self.data).decode("utf-8", "replace")


def encode(
    header: Header,
    items: npt.NDArray[np.void] | None = None,
    data: Frame | None = None,
    *,
    token: bytes | None = None,
) -> list[Frame]:
    """Frames for a message; ``token`` adds an HMAC-SHA256 frame over all of them."""
    expected = item_dtype(header.op, reply=header.is_reply)
    if items is None:
        items = make_items(header.op, 0, reply=header.is_reply)
    if items.dtype != expected or items.ndim != 1:
        raise ProtocolError(f"items for {header.op.name} must be a 1-d array of {expected}")
    if len(items) != header.count:
        raise ProtocolError(f"header count {header.count} != {len(items)} items")
    flags = header.flags | (FLAG_MAC if token else 0)
    if flags != header.flags:
        header = Header(
            op=header.op,
            request_id=header.request_id,
            count=header.count,
            status=header.status,
            flags=flags,
            traffic_class=header.traffic_class,
        )
    frames: list[Frame] = [
        header.pack(),
        np.ascontiguousarray(items).view(np.uint8).data,
        b"" if data is None else data,
    ]
    if token:
        frames.append(_mac(token, frames))
    return frames


def decode(
    frames: Sequence[Frame],
    *,
    limits: Limits = Limits(),
    token: bytes | None = None,
) -> Message:
    """Parse an untrusted multipart message; raise ProtocolError or AuthError."""
    if len(frames) not in (3, 4):
        raise ProtocolError(f"message has {len(frames)} frames, expected 3 or 4")
    header = Header.unpack(frames[0])
    has_mac = bool(header.flags & FLAG_MAC)
    if has_mac != (len(frames) == 4):
        raise ProtocolError("MAC flag and frame count disagree")
    if token is not None:
        if not has_mac:
            raise AuthError("message carries no MAC but a token is configured")
        if not hmac.compare_digest(bytes(frames[3]), _mac(token, frames[:3])):
            raise AuthError("message MAC does not match: wrong token or altered message")
    if header.count > limits.max_items:
        raise ProtocolError(f"{header.count} items exceed the limit of {limits.max_items}")
    dtype = item_dtype(header.op, reply=header.is_reply)
    raw_items = memoryview(frames[1]).cast("B")
    if len(raw_items) != header.count * dtype.itemsize:
        raise ProtocolError(
            f"items frame is {len(raw_items)} bytes, expected {header.count} x {dtype.itemsize}"
        )
    data = memoryview(frames[2]).cast("B")
    if len(data) > limits.max_data_bytes:
        raise ProtocolError(f"data frame of {len(data)} bytes exceeds {limits.max_data_bytes}")
    items = np.frombuffer(raw_items, dtype=dtype) if header.count else np.zeros(0, dtype)
    if (header.op, header.is_reply) in _LENGTH_ITEMS and header.status == Status.OK:
        total = int(items["length"].sum(dtype=np.uint64)) if header.count else 0
        if total != len(data):
            raise ProtocolError(f"item lengths add up to {total}, data frame is {len(data)}")
    return Message(header, items, data)


def data_offsets(items: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """Start offset of each item's bytes in the data frame (items with a ``length``)."""
    lengths = items["length"].astype(np.int64)
    offsets = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=offsets[1:])
    return offsets


def error_reply(
    request: Header | None, status: Status, text: str, *, token: bytes | None = None
) -> list[Frame]:
    """Frames of a failed reply: no items, the error text as data (MAC'd with ``token``)."""
    header = Header(
        op=request.op if request else Op.STATS,
        request_id=request.request_id if request else 0,
        count=0,
        status=status,
        flags=FLAG_REPLY,
    )
    return encode(header, None, text.encode("utf-8"), token=token)


def _mac(token: bytes, frames: Sequence[Frame]) -> bytes:
    mac = hmac.new(token, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.digest()
