"""LIST pages in, complete keys out: the merge of every node's listing. No I/O.

Each daemon lists a tenant's shards in the same order (block key, then shard
index), a page at a time (``docs/spec/wire.md``, LIST). To plan a block the
repairer needs what *every* node holds of it, so :class:`ListingMerge` keeps
one buffer per node and releases a key only once every node still listing
has listed past it: keys below the smallest "last key listed" of the nodes
not yet exhausted are complete. A node whose buffer holds no complete key
asks for its next page (:meth:`ListingMerge.wanted`).

The merge's :attr:`~ListingMerge.cursor` is where a resumed pass starts:
every key below it has been released.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ProtocolError
from kvcache.wire import LIST_INCLUSIVE, LIST_MAX_PAGE, Op, make_items

__all__ = ["Held", "ListingMerge", "list_request", "parse_listing"]

KEY_LEN = 16


@dataclass(frozen=True, slots=True)
class Held:
    """One shard a node listed."""

    node: int
    index: int
    stripe: int
    payload_len: int
    expiry_ms: int


def list_request(
    start: bytes, index: int = 0, *, inclusive: bool, limit: int = LIST_MAX_PAGE
) -> npt.NDArray[np.void]:
    """The one item of a LIST request: shards from (``start``, ``index``) on."""
    if len(start) != KEY_LEN:
        raise ProtocolError(f"a LIST cursor key is {KEY_LEN} bytes, got {len(start)}")
    if not 1 <= limit <= LIST_MAX_PAGE:
        raise ProtocolError(f"LIST limit must be 1..{LIST_MAX_PAGE}, got {limit}")
    items = make_items(Op.LIST, 1, reply=False)
    items["key"] = start
    items["index"] = index
    items["flags"] = LIST_INCLUSIVE if inclusive else 0
    items["limit"] = limit
    return items


def parse_listing(
    items: npt.NDArray[np.void], *, after: tuple[bytes, int, bool] | None = None
) -> list[tuple[bytes, int, int, int, int]]:
    """A LIST reply's records as (key, index, stripe, payload_len, expiry_ms) tuples.

    Untrusted: records must come in strictly increasing (key, index) order, and
    after the cursor ``after`` = (key, index, inclusive) asked with; else
    ProtocolError (a merge over a disordered listing would release keys early).
    """
    rows = list(
        zip(
            [bytes(k) for k in items["key"].tolist()],
            items["index"].tolist(),
            items["stripe"].tolist(),
            items["payload_len"].tolist(),
            items["expiry_ms"].tolist(),
            strict=True,
        )
    )
    prev = None if after is None else (after[0], after[1])
    strict = after is None or not after[2]
    for row in rows:
        here = (row[0], row[1])
        if prev is not None and (here < prev or (strict and here == prev)):
            raise ProtocolError(f"LIST records out of order at key {row[0].hex()} index {row[1]}")
        prev, strict = here, True
    return rows


class ListingMerge:
    """Per-node LIST pages merged into complete keys (see the module docstring)."""

    def __init__(
        self, nodes: list[int], *, start: bytes = bytes(KEY_LEN), page: int = LIST_MAX_PAGE
    ) -> None:
        self.page = page
        self.cursor = start
        self._rows: dict[int, list[tuple[bytes, int, int, int, int]]] = {n: [] for n in nodes}
        self._next: dict[int, tuple[bytes, int, bool]] = {n: (start, 0, True) for n in nodes}
        self._exhausted: set[int] = set()
        self.failed: set[int] = set()

    @property
    def done(self) -> bool:
        """Every node is exhausted and every key released."""
        return len(self._exhausted) == len(self._rows) and not any(self._rows.values())

    def wanted(self) -> list[tuple[int, tuple[bytes, int, bool]]]:
        """(node, (key, index, inclusive)) of each node that must list its next page."""
        out = []
        for node, rows in self._rows.items():
            if node in self._exhausted:
                continue
            if not rows or rows[0][0] == rows[-1][0]:
                out.append((node, self._next[node]))
        return out

    def add(self, node: int, rows: list[tuple[bytes, int, int, int, int]]) -> None:
        """A page ``node`` listed (parsed, in order, after its cursor)."""
        self._rows[node].extend(rows)
        if len(rows) < self.page:
            self._exhausted.add(node)
        if rows:
            self._next[node] = (rows[-1][0], rows[-1][1], False)

    def fail(self, node: int) -> None:
        """``node`` could not list: what it holds is unknown from here on."""
        self.failed.add(node)
        self._exhausted.add(node)
        self._rows[node] = []

    def release(self) -> list[tuple[bytes, list[Held]]]:
        """Keys every node has listed past (all of them once every node is exhausted), in
        order, each with what every node holds of it; advances :attr:`cursor`."""
        if self.wanted():
            return []
        boundary = self._boundary()
        found: dict[bytes, list[Held]] = {}
        for node, rows in self._rows.items():
            cut = 0
            while cut < len(rows) and (boundary is None or rows[cut][0] < boundary):
                key, index, stripe, payload_len, expiry = rows[cut]
                found.setdefault(key, []).append(Held(node, index, stripe, payload_len, expiry))
                cut += 1
            del rows[:cut]
        out = sorted(found.items())
        if boundary is not None:
            self.cursor = boundary
        elif out:
            self.cursor = out[-1][0]
        return out

    def _boundary(self) -> bytes | None:
        """The smallest last-listed key of the nodes still listing (None: no such node)."""
        lasts = [rows[-1][0] for node, rows in self._rows.items() if node not in self._exhausted]
        return min(lasts) if lasts else None
