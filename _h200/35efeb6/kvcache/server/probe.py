"""A minimal blocking client for one daemon: tests, benchmarks and smoke checks.

This is not the cluster client (``kvcache.client``: placement, hedging,
erasure coding); it speaks the wire protocol to a single node, one request at
a time, and exposes the raw connection so tests can send malformed bytes.
"""

from __future__ import annotations

import itertools
import json
import socket
import ssl
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.errors import NodeError, NodeTimeoutError, ProtocolError
from kvcache.net import open_session
from kvcache.shard import ShardHeader, new_stripe_id, payload_hash, shard_hash
from kvcache.wire import (
    Frame,
    Header,
    Limits,
    Message,
    MessageReader,
    Op,
    Status,
    data_offsets,
    encode,
    join,
    make_items,
)

__all__ = ["NodeRefusedError", "Probe", "fake_shard"]


def fake_shard(
    key: bytes,
    index: int,
    body: bytes,
    *,
    traffic_class: str = "chat",
    stripe_id: int | None = None,
    k: int = 10,
    m: int = 2,
    created_ms: int = 0,
) -> bytes:
    """A well-formed ``header || body`` record for ``body`` (no real erasure coding).

    ``len(body)`` must be a multiple of 64; the header claims a payload of
    ``k * len(body)`` bytes, so the record passes every check a daemon makes.
    """
    header = ShardHeader(
        block_key=key,  # type: ignore[arg-type]
        stripe_id=stripe_id if stripe_id is not None else new_stripe_id(),
        shard_index=index,
        k=k,
        m=m,
        payload_len=k * len(body),
        shard_hash=shard_hash(body),
        payload_hash=payload_hash(body),
        traffic_class=traffic_class,
        created_ms=created_ms,
        expiry_ms=created_ms,
    )
    return header.pack() + body


class Probe:
    """One authenticated connection to one daemon; requests are answered in order."""

    def __init__(
        self,
        endpoint: str,
        *,
        tenant: str,
        secret: bytes,
        timeout_s: float = 10.0,
        limits: Limits | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.limits = limits or Limits()
        self._ids = itertools.count(1)
        self._sock = open_session(
            endpoint, tenant=tenant, secret=secret, timeout_s=timeout_s, node=endpoint, tls=tls
        )
        self._sock.settimeout(timeout_s)
        self._reader = MessageReader(limits=self.limits, replies=True)

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ raw access

    @property
    def sock(self) -> socket.socket:
        """The connection (for tests that send malformed bytes)."""
        return self._sock

    def send_raw(self, data: bytes) -> None:
        """Send any bytes, well-formed or not."""
        self._sock.sendall(data)

    def recv_message(self, timeout_s: float | None = None) -> Message | None:
        """The next reply, or None after ``timeout_s`` or when the daemon closed the connection."""
        self._sock.settimeout(self.timeout_s if timeout_s is None else timeout_s)
        while True:
            message = self._reader.next_message()
            if message is not None:
                return message
            try:
                buf = self._reader.recv_buffer()
                n = self._sock.recv_into(buf)
            except TimeoutError:
                return None
            except OSError:
                return None
            if n == 0:
                return None
            self._reader.commit(n)

    def request(
        self,
        op: Op,
        items: npt.NDArray[np.void] | None = None,
        data: Frame = b"",
        *,
        traffic_class: str = "",
    ) -> Message:
        """Send one request and wait for its reply (NodeTimeoutError, ProtocolError)."""
        if items is None:
            items = make_items(op, 0, reply=False)
        request_id = next(self._ids)
        header = Header(op=op, request_id=request_id, count=len(items), traffic_class=traffic_class)
        self._sock.sendall(join(encode(header, items, data)))
        reply = self.recv_message()
        if reply is None:
            raise NodeTimeoutError(
                f"no reply to {op.name}#{request_id} from {self.endpoint} "
                f"within {self.timeout_s} s (or the connection closed)",
                node=self.endpoint,
            )
        if reply.header.request_id != request_id and reply.header.status == Status.OK:
            raise ProtocolError(
                f"reply to request {reply.header.request_id}, expected {request_id}"
            )
        return reply

    # ------------------------------------------------------------------ ops

    def put(
        self, shards: Sequence[tuple[bytes, int, bytes]], *, expect: Sequence[int] | None = None
    ) -> npt.NDArray[np.uint8]:
        """Store (key, index, record) triples (``expect``: stripe each may replace); statuses."""
        items = make_items(Op.PUT, len(shards), reply=False)
        items["key"] = [s[0] for s in shards]
        items["index"] = [s[1] for s in shards]
        items["length"] = [len(s[2]) for s in shards]
        if expect is not None:
            items["expect"] = list(expect)
        reply = self._ok(self.request(Op.PUT, items, b"".join(s[2] for s in shards)))
        return np.asarray(reply.items["status"])

    def get(
        self,
        wanted: Sequence[tuple[bytes, int]],
        *,
        traffic_class: str = "",
        stripe: Sequence[int] | None = None,
    ) -> tuple[npt.NDArray[np.uint8], list[bytes | None]]:
        """Fetch (key, index) shards (of ``stripe`` ids, 0: any): statuses and each record
        (None when not OK)."""
        items = make_items(Op.GET, len(wanted), reply=False)
        items["key"] = [w[0] for w in wanted]
        items["index"] = [w[1] for w in wanted]
        if stripe is not None:
            items["stripe"] = list(stripe)
        reply = self._ok(self.request(Op.GET, items, traffic_class=traffic_class))
        offsets = data_offsets(reply.items)
        records: list[bytes | None] = [
            bytes(reply.data[o : o + n]) if s == Status.OK else None
            for s, o, n in zip(
                reply.items["status"].tolist(),
                offsets.tolist(),
                reply.items["length"].tolist(),
                strict=True,
            )
        ]
        return np.asarray(reply.items["status"]), records

    def has(self, keys: Sequence[bytes]) -> dict[bytes, dict[int, int]]:
        """For each key: {shard index: stripe id} of the live shards this node holds."""
        items = make_items(Op.HAS, len(keys), reply=False)
        items["key"] = list(keys)
        reply = self._ok(self.request(Op.HAS, items))
        out: dict[bytes, dict[int, int]] = {key: {} for key in keys}
        for ordinal, index, stripe in zip(
            reply.items["ordinal"].tolist(),
            reply.items["index"].tolist(),
            reply.items["stripe"].tolist(),
            strict=True,
        ):
            out[keys[ordinal]][index] = stripe
        return out

    def touch(self, keys: Sequence[bytes], *, traffic_class: str = "") -> npt.NDArray[np.uint8]:
        """Slide the expiry of every shard of each key; per-key statuses."""
        items = make_items(Op.TOUCH, len(keys), reply=False)
        items["key"] = list(keys)
        reply = self._ok(self.request(Op.TOUCH, items, traffic_class=traffic_class))
        return np.asarray(reply.items["status"])

    def delete(self, wanted: Sequence[tuple[bytes, int, int]]) -> npt.NDArray[np.uint8]:
        """Delete (key, stripe or 0, index or NO_INDEX); per-item statuses."""
        items = make_items(Op.DELETE, len(wanted), reply=False)
        items["key"] = [w[0] for w in wanted]
        items["stripe"] = [w[1] for w in wanted]
        items["index"] = [w[2] for w in wanted]
        reply = self._ok(self.request(Op.DELETE, items))
        return np.asarray(reply.items["status"])

    def stats(self) -> dict[str, Any]:
        """The daemon's STATS JSON."""
        reply = self._ok(self.request(Op.STATS))
        result: dict[str, Any] = json.loads(bytes(reply.data))
        return result

    def _ok(self, reply: Message) -> Message:
        if reply.header.status != Status.OK:
            raise NodeRefusedError(reply.header.status, reply.error_text(), node=self.endpoint)
        return reply


class NodeRefusedError(NodeError):
    """The daemon answered a whole request with an error status."""

    def __init__(self, status: Status, text: str, *, node: str) -> None:
        super().__init__(f"{node} refused the request: {status.name}: {text}", node=node)
        self.status = status
        self.text = text
