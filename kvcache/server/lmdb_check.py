"""Is an LMDB data file whole enough to map? Two meta pages read with plain file reads.

LMDB maps ``data.mdb`` and trusts it: a file cut short (a full disk, a bad copy, an
operator's mistake) makes the first touch of a page past its end a SIGBUS, which kills
the daemon without a word (issue 18: ``data.mdb`` truncated to half its used size or
to 8 KiB died in ``store._load_meta``; cut by one page, every PUT failed
``MDB_CORRUPTED``). So before :mod:`kvcache.server.lmdb_env` opens the environment,
:func:`check_data_file` reads the two meta pages and checks them against the file:
magic, format version and page size as LMDB writes them, the newest meta's last page
and both B-tree roots inside the file. Pure but for one ``open``/``read``/``fstat``;
the layout (LMDB 0.9, 64-bit) is pinned by a test against files LMDB itself wrote.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MetaPage", "check_data_file", "parse_meta"]

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
_P_META = 0x08
_P_INVALID = 2**64 - 1
#: Page header: pgno (8), pad (2), flags (2), lower/upper (4); then MDB_meta.
_PAGE_FLAGS = struct.Struct("<H")
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")  # pad (page size in the free DB), flags, depth, 4 counts, root
_TAIL = struct.Struct("<QQ")  # last page number, transaction id
_META_AT = 16
_DBS_AT = _META_AT + _META.size
_TAIL_AT = _DBS_AT + 2 * _DB.size
_META_BYTES = _TAIL_AT + _TAIL.size


@dataclass(frozen=True, slots=True)
class MetaPage:
    """What one meta page says (only the fields the check uses)."""

    page_size: int
    map_size: int
    last_page: int
    txnid: int
    roots: tuple[int, int]


def parse_meta(raw: bytes) -> MetaPage | str:
    """One meta page's fields, or why it is not one."""
    if len(raw) < _META_BYTES:
        return f"meta page cut short ({len(raw)} bytes)"
    (flags,) = _PAGE_FLAGS.unpack_from(raw, 10)
    magic, version, _address, map_size = _META.unpack_from(raw, _META_AT)
    if not flags & _P_META:
        return f"page flags 0x{flags:04x} are not a meta page's"
    if magic != MAGIC:
        return f"bad magic 0x{magic:08x}"
    if version != DATA_VERSION:
        return f"LMDB data version {version}, this build reads {DATA_VERSION}"
    free = _DB.unpack_from(raw, _DBS_AT)
    main = _DB.unpack_from(raw, _DBS_AT + _DB.size)
    page_size = free[0]
    if page_size < 512 or page_size > 65536 or page_size & (page_size - 1):
        return f"page size {page_size} is not a power of two in 512..65536"
    last_page, txnid = _TAIL.unpack_from(raw, _TAIL_AT)
    return MetaPage(page_size, map_size, last_page, txnid, (free[-1], main[-1]))


def check_data_file(path: str | Path) -> str | None:
    """None when ``path`` is missing, empty (LMDB starts it afresh) or whole by its
    meta pages; otherwise why it may not be mapped, in words for a log line."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        first = os.pread(fd, 4096, 0)
        meta0 = parse_meta(first)
        if isinstance(meta0, str):
            return f"meta page 0: {meta0}"
        page = meta0.page_size
        if size < 2 * page:
            return f"file is {size} bytes, shorter than its two {page}-byte meta pages"
        meta1 = parse_meta(os.pread(fd, _META_BYTES, page))
    finally:
        os.close(fd)
    if isinstance(meta1, str):
        return f"meta page 1: {meta1}"
    if meta1.page_size != page:
        return f"meta pages disagree on the page size ({page}, {meta1.page_size})"
    meta = max(meta0, meta1, key=lambda m: m.txnid)
    pages = size // page
    if meta.last_page >= pages:
        return (
            f"file has {pages} pages of {page} bytes ({size} bytes) but its newest meta "
            f"(transaction {meta.txnid}) uses pages up to {meta.last_page}: truncated"
        )
    if (meta.last_page + 1) * page > meta.map_size:
        return f"meta map size {meta.map_size} is smaller than its {meta.last_page + 1} pages"
    for name, root in zip(("free", "main"), meta.roots, strict=True):
        if root != _P_INVALID and not 2 <= root <= meta.last_page:
            return f"{name} tree root page {root} outside pages 2..{meta.last_page}"
    return None
