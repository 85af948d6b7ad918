"""The data-path wire protocol, without I/O: bytes in, typed messages out.

Requests and replies travel over one TCP stream per connection (after the
session handshake of :mod:`kvcache.session`), each as three sections::

    [header (48 bytes)] [items: count fixed-size records] [data: data_len bytes]

The header is versioned and fixed and says how long the two other sections
are, so a receiver knows where every byte goes *before* it reads it: the
client receives shard bodies straight into the caller's buffer
(``recvmsg_into``), the daemon sends stored records straight out of its LMDB
map (``sendmsg``). The item record type depends on the op and direction
(``ITEM_DTYPES``); the data section carries the raw bytes the items point
into (shards for PUT requests and GET replies, JSON for STATS, an error text
for failed replies). Records are numpy structured arrays so a batch of
thousands of items is built and parsed without a Python loop per item.
``docs/spec/wire.md`` is the normative description.

Parsing takes untrusted bytes and raises only :class:`ProtocolError`: never
an assert, never another exception.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ProtocolError, ShardFormatError
from kvcache.shard import MAX_CLASS_NAME, check_class_name

__all__ = [
    "COUNT_AT",
    "DATA_LEN_AT",
    "FLAG_PIN",
    "FLAG_REPLY",
    "FLAG_TTL",
    "GET_REFRESHED",
    "HEADER_BYTES",
    "LIST_INCLUSIVE",
    "LIST_MAX_PAGE",
    "DIR_ANSWER_DTYPE",
    "DIR_RECORD_DTYPE",
    "ITEM_DTYPES",
    "MAGIC",
    "NO_INDEX",
    "NO_RETAIN",
    "REQUEST_ID_AT",
    "VERSION",
    "Frame",
    "Header",
    "Retain",
    "Limits",
    "Message",
    "MessageReader",
    "Op",
    "Status",
    "check_message",
    "data_offsets",
    "decode",
    "encode",
    "error_reply",
    "item_dtype",
    "items_nbytes",
    "join",
    "make_items",
    "pack_header",
    "parse_endpoint",
    "plain_request",
]

MAGIC = b"KV"
VERSION = 2
FLAG_REPLY = 0x1
#: Request flag (PUT, GET, TOUCH): the header's ``ttl_s`` field (the former reserved
#: field) carries the request's TTL hint in seconds (docs/spec/retention.md, Hints).
FLAG_TTL = 0x2
#: Request flag (PUT, TOUCH): pin the written or touched shards (docs/spec/retention.md).
FLAG_PIN = 0x4
_KNOWN_FLAGS = FLAG_REPLY | FLAG_TTL | FLAG_PIN
#: Ops whose requests may carry FLAG_TTL, and FLAG_PIN.
_TTL_OPS = frozenset({1, 2, 4})  # PUT, GET, TOUCH
_PIN_OPS = frozenset({1, 4})  # PUT, TOUCH
#: ``index`` value in DELETE items meaning "every shard of the key on this node".
NO_INDEX = 0xFFFF
#: Most shards one LIST reply carries; a request asking for more is refused.
LIST_MAX_PAGE = 4096
#: LIST request flag: start AT (key, index) instead of after it (the first page).
LIST_INCLUSIVE = 0x1

# magic, version, op, flags, status, request id, count, ttl_s (was reserved), data length, class
_HEADER = struct.Struct("<2sBBHHQIIQ16s")
HEADER_BYTES = _HEADER.size  # 48
#: Where a header's request id (u64) and item count (u32) lie: a caller that sends many
#: requests alike packs one header and writes these fields into copies of it.
REQUEST_ID_AT = struct.calcsize("<2sBBHH")
COUNT_AT = REQUEST_ID_AT + 8
#: And its data section's length (u64).
DATA_LEN_AT = struct.calcsize("<2sBBHHQII")
#: The header's traffic-class field when the message names no class.
_NO_CLASS = bytes(1 + MAX_CLASS_NAME)
#: Class fields already found valid, with the names they carry: a daemon sees the same few
#: on every request, and a field is checked (decode, pattern) once. Bounded: a peer that
#: sends many names fills it once and is checked in full ever after.
_VALID_CLASS_FIELDS: dict[bytes, str] = {}
_MAX_VALID_CLASS_FIELDS = 256


def _class_field(name: str) -> bytes:
    raw = name.encode("ascii")
    return bytes([len(raw)]) + raw.ljust(MAX_CLASS_NAME, b"\x00")


Frame = bytes | bytearray | memoryview


class Op(enum.IntEnum):
    """What a request asks for. Every op is batched."""

    PUT = 1
    GET = 2
    HAS = 3
    TOUCH = 4
    DELETE = 5
    STATS = 6
    #: Register SWA-state holder records (an inference worker to a storage daemon).
    DIR_PUT = 7
    #: HAS, plus the SWA holder records of the same keys in the reply's data section.
    HAS_DIR = 8
    #: Fetch SWA states (an inference worker from the worker that holds them).
    SWA_GET = 9
    #: A page of the caller tenant's stored shards, in storage-key order (repair's scan).
    LIST = 10


class Status(enum.IntEnum):
    """Per-item (< 16) and per-message (>= 16) outcomes."""

    OK = 0
    NOT_FOUND = 1
    BAD_ITEM = 2
    CHECKSUM = 3
    WRONG_KEY = 4
    NO_SPACE = 5
    INTERNAL = 6
    #: PUT: a live shard of another stripe is stored and the item did not name it.
    CONFLICT = 7
    #: PUT: the tenant is at its byte quota and its own shards could not make room.
    QUOTA = 8
    BAD_REQUEST = 16
    UNAUTHORIZED = 17
    TOO_LARGE = 18
    UNAVAILABLE = 19


#: Op and Status by wire value (a dict lookup; calling the enum costs microseconds).
_OPS: dict[int, Op] = {int(op): op for op in Op}
#: A HAS (or HAS_DIR) reply carries an item per live shard of each asked key, and a stripe
#: has at most 255 shards (k + m <= 255): its item count is bounded by this many times the
#: request's, so readers allow that many times ``max_items`` in it.
HAS_REPLY_ITEMS_PER_KEY = 255
_STATUSES: dict[int, Status] = {int(st): st for st in Status}


_KEY = ("key", "V16")

#: One SWA holder record: who holds the sliding-window state taken at ``position`` after the
#: prefix named by block ``key``, in state namespace ``state_ns``, and for how long
#: (``ttl_ms``: asked for in DIR_PUT, remaining in a HAS_DIR answer). See docs/spec/swa.md.
DIR_RECORD_DTYPE: np.dtype[np.void] = np.dtype(
    [
        _KEY,
        ("position", "<u4"),
        ("ttl_ms", "<u4"),
        ("incarnation", "<u8"),
        ("state_ns", "V8"),
        ("nbytes", "<u8"),
        ("digest", "V16"),
        ("endpoint", "S64"),
    ]
)
#: A HAS_DIR reply's data section: records, each with the ordinal of the request item it answers.
DIR_ANSWER_DTYPE: np.dtype[np.void] = np.dtype(
    [("ordinal", "<u4"), ("pad", "V4"), ("record", DIR_RECORD_DTYPE)]
)
#: A GET reply item's flag: this hit moved the shard's expiry (a slide was due). The reader
#: then refreshes the block's shards it did not ask for (``kvcache.client.loading``), so every
#: shard of a block that is read keeps the block's expiry, not only the ones read.
GET_REFRESHED = 1
#: Record type per (op, is_reply).
ITEM_DTYPES: dict[tuple[Op, bool], np.dtype[np.void]] = {
    # expect: the stripe id the writer saw stored (0: none); see docs/spec/wire.md, PUT.
    (Op.PUT, False): np.dtype(
        [_KEY, ("index", "<u2"), ("pad", "<u2"), ("length", "<u4"), ("expect", "<u8")]
    ),
    (Op.PUT, True): np.dtype([("status", "u1")]),
    # stripe: the stripe id wanted (0: any).
    (Op.GET, False): np.dtype([_KEY, ("index", "<u2"), ("pad", "V6"), ("stripe", "<u8")]),
    # flags: GET_REFRESHED when this hit moved the shard's expiry (see docs/spec/wire.md).
    (Op.GET, True): np.dtype([("status", "u1"), ("flags", "u1"), ("pad", "V2"), ("length", "<u4")]),
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
    (Op.DIR_PUT, False): DIR_RECORD_DTYPE,
    (Op.DIR_PUT, True): np.dtype([("status", "u1")]),
    (Op.HAS_DIR, False): np.dtype([_KEY]),
    (Op.HAS_DIR, True): np.dtype(
        [("ordinal", "<u4"), ("index", "<u2"), ("pad", "<u2"), ("stripe", "<u8")]
    ),
    # The state wanted: after block ``key``, at ``position``, of the holder's ``incarnation``.
    (Op.SWA_GET, False): np.dtype(
        [_KEY, ("position", "<u4"), ("pad", "V4"), ("state_ns", "V8"), ("incarnation", "<u8")]
    ),
    (Op.SWA_GET, True): np.dtype(
        [("status", "u1"), ("pad", "V3"), ("length", "<u4"), ("digest", "V16")]
    ),
    # One item: list from (key, index) on, exclusive unless flags has LIST_INCLUSIVE.
    (Op.LIST, False): np.dtype(
        [_KEY, ("index", "<u2"), ("flags", "<u2"), ("limit", "<u4"), ("pad", "V8")]
    ),
    # One record per live shard: where it is (key, index), its stripe, its stored record's
    # length (header + body), the payload length its header claims, its expiry and class.
    (Op.LIST, True): np.dtype(
        [
            _KEY,
            ("index", "<u2"),
            ("pad", "V2"),
            ("length", "<u4"),
            ("stripe", "<u8"),
            ("payload_len", "<u8"),
            ("expiry_ms", "<u8"),
            ("traffic_class", "S16"),
        ]
    ),
}

#: Ops whose items carry a ``length`` each, pointing consecutively into the data section.
_LENGTH_ITEMS = {(Op.PUT, False), (Op.GET, True), (Op.SWA_GET, True)}


def item_dtype(op: Op, *, reply: bool) -> np.dtype[np.void]:
    """The record type of ``op``'s items in a request (or reply)."""
    return ITEM_DTYPES[(op, reply)]


def items_nbytes(op: Op, count: int, *, reply: bool) -> int:
    """Bytes of the items section of ``count`` records of ``op``."""
    return count * ITEM_DTYPES[(op, reply)].itemsize


def make_items(op: Op, count: int, *, reply: bool) -> npt.NDArray[np.void]:
    """A zeroed record array for ``count`` items of ``op``."""
    dtype = item_dtype(op, reply=reply)
    # Zeroed bytes viewed as records: np.zeros of a structured dtype costs ~50 µs a call.
    items: npt.NDArray[np.void] = np.zeros(count * dtype.itemsize, np.uint8).view(dtype)
    return items


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Hard bounds on what a peer may send; a header past them is refused unread."""

    max_items: int = 16384
    max_data_bytes: int = 256 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Retain:
    """A request's retention hint as the wire carries it (FLAG_TTL, FLAG_PIN).

    ``ttl_s`` 0 means the class's own TTL; the daemon clamps a nonzero one into
    its class's bounds. ``pin`` asks that the shards be kept out of eviction.
    """

    ttl_s: int = 0
    pin: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, int):
            raise ProtocolError(f"retain ttl_s must be an int, got {self.ttl_s!r}")
        if not 0 <= self.ttl_s <= 0xFFFF_FFFF:
            raise ProtocolError(f"retain ttl_s {self.ttl_s} does not fit the u32 header field")

    @property
    def flags(self) -> int:
        """The header flags that announce this hint."""
        return (FLAG_TTL if self.ttl_s else 0) | (FLAG_PIN if self.pin else 0)


NO_RETAIN = Retain()


def pack_header(
    op: Op,
    request_id: int,
    count: int,
    *,
    data_len: int = 0,
    status: Status = Status.OK,
    flags: int = 0,
    ttl_s: int = 0,
    traffic_class: str = "",
) -> bytes:
    """The 48-byte header of these fields, as :meth:`Header.pack` gives it (``flags`` as they
    go on the wire, FLAG_TTL and FLAG_PIN included), without building a Header: for the
    per-message paths that send one small request or reply and wait on it."""
    return _HEADER.pack(
        MAGIC,
        VERSION,
        op,
        flags,
        status,
        request_id,
        count,
        ttl_s,
        data_len,
        _class_field(traffic_class) if traffic_class else _NO_CLASS,
    )


def plain_request(raw: Frame, op: Op, limits: Limits) -> tuple[int, int] | None:
    """(request id, item count) when the 48 bytes ``raw`` are the header of a plain ``op``
    request: status OK, no flags, no TTL, no traffic class, no data section, items within
    ``limits``. None for anything else, which :meth:`Header.unpack` then checks in full.

    For a server's short path for the one request shape it answers most (the SWA peer's
    SWA_GET): recognising that shape costs one ``unpack`` and a comparison, where building
    a checked :class:`Header` costs several microseconds of a fetch that waits on it."""
    magic, version, got, flags, status, request_id, count, ttl, data_len, name = _HEADER.unpack(raw)
    if (
        (magic, version, got, flags, status, ttl, data_len) != (MAGIC, VERSION, op, 0, 0, 0, 0)
        or name != _NO_CLASS
        or count > limits.max_items
    ):
        return None
    return request_id, count


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """The fixed first section of every message."""

    op: Op
    request_id: int
    count: int
    data_len: int = 0
    status: Status = Status.OK
    flags: int = 0
    traffic_class: str = ""
    #: The request's retention hint; its flags are added to ``flags`` when packed.
    retain: Retain = NO_RETAIN

    @property
    def is_reply(self) -> bool:
        """Whether this header belongs to a reply."""
        return bool(self.flags & FLAG_REPLY)

    @property
    def items_len(self) -> int:
        """Bytes of the items section that follows."""
        return items_nbytes(self.op, self.count, reply=self.is_reply)

    def pack(self) -> bytes:
        """The 48-byte header."""
        retain = self.retain
        return pack_header(
            self.op,
            self.request_id,
            self.count,
            data_len=self.data_len,
            status=self.status,
            flags=self.flags | retain.flags if retain is not NO_RETAIN else self.flags,
            ttl_s=retain.ttl_s,
            traffic_class=self.traffic_class,
        )

    @classmethod
    def unpack(cls, raw: Frame, limits: Limits | None = None) -> Header:
        """Parse an untrusted header, and check it against ``limits`` when given."""
        if len(raw) != HEADER_BYTES:
            raise ProtocolError(f"header is {len(raw)} bytes, expected {HEADER_BYTES}")
        (
            magic,
            version,
            op,
            flags,
            status,
            request_id,
            count,
            reserved,
            data_len,
            cls_field,
        ) = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ProtocolError(
                f"unsupported protocol version {version}; this build speaks {VERSION}"
            )
        op_value = _OPS.get(op)
        if op_value is None:
            raise ProtocolError(f"unknown op {op}")
        status_value = _STATUSES.get(status)
        if status_value is None:
            raise ProtocolError(f"unknown status {status}")
        if flags & ~_KNOWN_FLAGS:
            raise ProtocolError(f"unknown flags 0x{flags:04x}")
        if flags & FLAG_TTL:
            if flags & FLAG_REPLY or op not in _TTL_OPS:
                raise ProtocolError(
                    f"a TTL hint is only for PUT, GET and TOUCH requests, not op {op}"
                )
            if not reserved:
                raise ProtocolError("FLAG_TTL set with a TTL of 0 s")
        elif reserved:
            raise ProtocolError(f"ttl field is {reserved} without FLAG_TTL; it must be 0")
        if flags & FLAG_PIN and (flags & FLAG_REPLY or op not in _PIN_OPS):
            raise ProtocolError(f"a pin is only for PUT and TOUCH requests, not op {op}")
        name = ""
        if cls_field != _NO_CLASS:
            cached = _VALID_CLASS_FIELDS.get(cls_field)
            if cached is not None:
                name = cached
            else:
                name_len = cls_field[0]
                if name_len > MAX_CLASS_NAME or cls_field[1 + name_len :].strip(b"\x00"):
                    raise ProtocolError("malformed traffic class field")
                try:
                    name = check_class_name(cls_field[1 : 1 + name_len].decode("ascii"))
                except (UnicodeDecodeError, ShardFormatError) as exc:
                    raise ProtocolError(f"bad traffic class in header: {exc}") from None
                if len(_VALID_CLASS_FIELDS) < _MAX_VALID_CLASS_FIELDS:
                    _VALID_CLASS_FIELDS[cls_field] = name
        header = cls(
            op=op_value,
            request_id=request_id,
            count=count,
            data_len=data_len,
            status=status_value,
            flags=flags & ~(FLAG_TTL | FLAG_PIN),
            traffic_class=name,
            retain=Retain(ttl_s=reserved, pin=bool(flags & FLAG_PIN))
            if flags & (FLAG_TTL | FLAG_PIN)
            else NO_RETAIN,
        )
        if limits is not None:
            most = limits.max_items
            if flags & FLAG_REPLY and op_value in (Op.HAS, Op.HAS_DIR):
                most *= HAS_REPLY_ITEMS_PER_KEY
            if count > most:
                raise ProtocolError(f"{count} items exceed the limit of {most}")
            if data_len > limits.max_data_bytes:
                raise ProtocolError(
                    f"data section of {data_len} bytes exceeds the limit of {limits.max_data_bytes}"
                )
        return header


@dataclass(frozen=True, slots=True)
class Message:
    """A parsed request or reply: header, item records and the data section."""

    header: Header
    items: npt.NDArray[np.void]
    data: memoryview

    def error_text(self) -> str:
        """The error text of a failed reply (its data section)."""
        return bytes(self.data).decode("utf-8", "replace")


def encode(
    header: Header,
    items: npt.NDArray[np.void] | None = None,
    data: Frame | None = None,
) -> list[Frame]:
    """The three sections of a message, ready for ``sendmsg`` (no copies of items or data).

    ``header.data_len`` is filled in from ``data``; ``header.count`` must equal
    the number of items.
    """
    expected = item_dtype(header.op, reply=header.is_reply)
    if items is None:
        items = make_items(header.op, 0, reply=header.is_reply)
    if items.dtype != expected or items.ndim != 1:
        raise ProtocolError(f"items for {header.op.name} must be a 1-d array of {expected}")
    if len(items) != header.count:
        raise ProtocolError(f"header count {header.count} != {len(items)} items")
    payload: Frame = b"" if data is None else data
    size = memoryview(payload).nbytes
    if size != header.data_len:
        header = Header(
            op=header.op,
            request_id=header.request_id,
            count=header.count,
            data_len=size,
            status=header.status,
            flags=header.flags,
            traffic_class=header.traffic_class,
            retain=header.retain,
        )
    return [header.pack(), np.ascontiguousarray(items).view(np.uint8).data, payload]


def check_message(header: Header, items: npt.NDArray[np.void], data_len: int) -> None:
    """Raise ProtocolError unless item lengths add up to the data section (where they must)."""
    if (header.op, header.is_reply) in _LENGTH_ITEMS and header.status == Status.OK:
        total = int(items["length"].sum(dtype=np.uint64)) if header.count else 0
        if total != data_len:
            raise ProtocolError(f"item lengths add up to {total}, data section is {data_len}")
    answers = header.op is Op.HAS_DIR and header.is_reply and header.status == Status.OK
    if answers and data_len % DIR_ANSWER_DTYPE.itemsize:
        raise ProtocolError(
            f"HAS_DIR answer of {data_len} bytes is not whole "
            f"{DIR_ANSWER_DTYPE.itemsize}-byte records"
        )


def decode(raw: Frame, *, limits: Limits = Limits()) -> Message:
    """Parse one whole message held in ``raw``; raise ProtocolError.

    For tests and tools that hold a complete message; the daemon and the client
    read streams with :class:`MessageReader` and their own scatter reads.
    """
    view = memoryview(raw).cast("B")
    if len(view) < HEADER_BYTES:
        raise ProtocolError(f"message of {len(view)} bytes is shorter than a header")
    header = Header.unpack(view[:HEADER_BYTES], limits)
    items_end = HEADER_BYTES + header.items_len
    if len(view) != items_end + header.data_len:
        raise ProtocolError(
            f"message is {len(view)} bytes, its header says {items_end + header.data_len}"
        )
    items = _items(header, view[HEADER_BYTES:items_end])
    data = view[items_end:]
    check_message(header, items, len(data))
    return Message(header, items, data)


def _items(header: Header, raw: memoryview) -> npt.NDArray[np.void]:
    dtype = item_dtype(header.op, reply=header.is_reply)
    if not header.count:
        return np.zeros(0, dtype)
    return np.frombuffer(raw, dtype=dtype)


class MessageReader:
    """Cuts a byte stream into messages, and says where the next received bytes go.

    Sans I/O: the owner receives into :meth:`recv_buffer`, reports the count
    with :meth:`commit`, and takes finished messages from :meth:`next_message`.
    Headers, items and small data sections collect in a reused chunk buffer
    (several small requests per ``recv``); a data section larger than what is
    buffered gets a buffer of its own that the rest is received into directly,
    so a large PUT is copied once, by the kernel.

    Any violation raises ProtocolError; the stream cannot be resynchronised
    after that and the connection must be closed.
    """

    def __init__(self, *, limits: Limits, replies: bool = False, chunk: int = 64 << 10) -> None:
        self._limits = limits
        self._replies = replies
        self._chunk = max(chunk, HEADER_BYTES)
        self._buf = bytearray(self._chunk)
        self._start = 0
        self._end = 0
        self._header: Header | None = None
        self._items: npt.NDArray[np.void] | None = None
        self._data: npt.NDArray[np.uint8] | None = None
        self._data_got = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes of a large data section received so far for the message in progress (what
        it holds in memory: its declared length is only reserved, never counted)."""
        return 0 if self._data is None else self._data_got

    @property
    def idle(self) -> bool:
        """No partial message is buffered."""
        return self._header is None and self._start == self._end

    def release(self) -> bytes | None:
        """Hand the stream over (to a daemon's native data plane): the bytes received past
        the last whole message, the reader then empty; None, reader untouched, while a
        message is partly parsed (its header is in)."""
        if self._header is not None or self._data is not None:
            return None
        rest = bytes(self._buf[self._start : self._end])
        self._start = self._end = 0
        return rest

    def prime(self, data: bytes | bytearray | memoryview) -> None:
        """Take over a stream whose first bytes another reader received: ``data`` as if
        received here. Only when nothing is buffered (raises ValueError otherwise)."""
        if not self.idle:
            raise ValueError("prime() of a reader that holds bytes")
        if len(data) > len(self._buf):
            self._buf = bytearray(len(data))
        self._buf[: len(data)] = data
        self._start, self._end = 0, len(data)

    def recv_buffer(self) -> memoryview:
        """Where the next received bytes go (never empty)."""
        if self._data is not None:
            return self._data.data[self._data_got :]
        if self._end == len(self._buf):
            if self._start:
                pending = self._end - self._start
                self._buf[:pending] = self._buf[self._start : self._end]
                self._start, self._end = 0, pending
            else:  # a header plus items larger than the chunk: grow (bounded by the limits)
                self._buf.extend(bytes(len(self._buf)))
        return memoryview(self._buf)[self._end :]

    def commit(self, count: int) -> None:
        """``count`` bytes were received into the last :meth:`recv_buffer`."""
        if self._data is not None:
            self._data_got += count
        else:
            self._end += count

    def next_message(self) -> Message | None:
        """The next complete message, or None until more bytes arrive."""
        if self._data is not None:
            if self._data_got < len(self._data):
                return None
            return self._finish(self._data.data)
        if self._header is None:
            if self._end - self._start < HEADER_BYTES:
                return None
            raw = bytes(self._buf[self._start : self._start + HEADER_BYTES])
            header = Header.unpack(raw, self._limits)
            if header.is_reply != self._replies:
                raise ProtocolError(
                    "expected a reply" if self._replies else "a request must not be a reply"
                )
            self._start += HEADER_BYTES
            self._header = header
            if header.items_len > len(self._buf):
                grown = bytearray(header.items_len + HEADER_BYTES)
                pending = self._end - self._start
                grown[:pending] = self._buf[self._start : self._end]
                self._buf, self._start, self._end = grown, 0, pending
        header = self._header
        if self._items is None:
            size = header.items_len
            if self._end - self._start < size:
                return None
            raw_items = self._buf[self._start : self._start + size]  # a copy, the message's own
            self._start += size
            self._items = _items(header, memoryview(raw_items))
        buffered = self._end - self._start
        if header.data_len <= buffered:
            data = memoryview(bytes(self._buf[self._start : self._start + header.data_len]))
            self._start += header.data_len
            return self._finish(data)
        own = np.empty(header.data_len, np.uint8)
        own[:buffered] = np.frombuffer(self._buf, np.uint8, buffered, self._start)
        self._start = self._end = 0
        self._data, self._data_got = own, buffered
        return None

    def _finish(self, data: memoryview) -> Message:
        header, items = self._header, self._items
        assert header is not None and items is not None  # set before any data is read
        self._header = self._items = self._data = None
        self._data_got = 0
        if self._start == self._end:
            self._start = self._end = 0
        if len(self._buf) > self._chunk and self._end - self._start <= self._chunk:
            # Grown for a message of many items: back to a chunk, so a connection that sent
            # one such request does not hold megabytes while it idles (300 idle connections
            # after one 16,384-item request each held 2 MiB apiece, issue 18's probe).
            rest = self._buf[self._start : self._end]
            self._buf = bytearray(self._chunk)
            self._buf[: len(rest)] = rest
            self._start, self._end = 0, len(rest)
        check_message(header, items, len(data))
        return Message(header, items, data)


def data_offsets(items: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """Start offset of each item's bytes in the data section (items with a ``length``)."""
    lengths = items["length"].astype(np.int64)
    offsets = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=offsets[1:])
    return offsets


def error_reply(request: Header | None, status: Status, text: str) -> list[Frame]:
    """Sections of a failed reply: no items, the error text as data."""
    header = Header(
        op=request.op if request else Op.STATS,
        request_id=request.request_id if request else 0,
        count=0,
        status=status,
        flags=FLAG_REPLY,
    )
    return encode(header, None, text.encode("utf-8"))


def join(frames: list[Frame]) -> bytes:
    """The sections of a message as one bytes object (tests and tools)."""
    return b"".join(bytes(f) for f in frames)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` → (host, port)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint must look like tcp://host:port, got {endpoint!r}")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"endpoint must look like tcp://host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)
