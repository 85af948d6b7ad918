"""RequestHandler without sockets: replies, group commit, errors and counters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_fixtures import FakeClock, block_records, get_items, put_items

from kvcache.credentials import tenant_id
from kvcache.server.handler import Reply, Request, RequestHandler
from kvcache.server.metrics import Metrics
from kvcache.server.store import ShardStore
from kvcache.wire import Frame, Header, Message, Op, Status, decode, encode, join, make_items

T = tenant_id("default")


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


@pytest.fixture
def handler(tmp_path: Path) -> Iterator[RequestHandler]:
    with ShardStore(tmp_path / "db", capacity_bytes=64 << 20, clock=FakeClock()) as store:
        yield RequestHandler(store, Metrics(), node_id="h", tenant_names={T: "default"})


def request(op: Op, request_id: int, items: Any, data: Frame = b"") -> Request:
    raw = join(encode(Header(op=op, request_id=request_id, count=len(items)), items, data))
    return Request(T, decode(raw), time.perf_counter(), len(raw))  # type: ignore[arg-type]


def parse(reply: Reply) -> Message:
    message = decode(b"".join(bytes(f) for f in reply.frames))
    reply.done()
    return message


def test_puts_share_one_transaction_and_fail_alone(handler: RequestHandler) -> None:
    groups: list[int] = []
    put_many = handler.store.put_many

    def spy(batches: Any) -> Any:
        groups.append(len(batches))
        return put_many(batches)

    handler.store.put_many = spy  # type: ignore[method-assign]
    first, second = (block_records(key(n), indices=[0, 1]) for n in (1, 2))
    replies = handler.handle_puts(
        [
            request(Op.PUT, 1, *put_items(first)),
            request(Op.PUT, 2, *put_items(second)),
        ]
    )
    assert groups == [1 + 1]
    assert [parse(r).items["status"].tolist() for r in replies] == [[0, 0], [0, 0]]
    wanted = [(k, i) for k, i, _ in first + second]
    got = parse(handler.handle(request(Op.GET, 3, get_items(wanted))))
    assert got.items["status"].tolist() == [Status.OK] * 4
    assert bytes(got.data) == b"".join(r for _, _, r in first + second)
    assert handler.stats()["requests"]["put"] == 2


def test_get_reply_holds_its_read_transaction_until_sent(handler: RequestHandler) -> None:
    shards = block_records(key(1), indices=[0])
    handler.handle_puts([request(Op.PUT, 1, *put_items(shards))])
    reply = handler.handle(request(Op.GET, 2, get_items([(key(1), 0)])))
    assert reply.release is not None and reply.nbytes == len(shards[0][2])
    assert bytes(reply.frames[-1]) == shards[0][2]  # a view into LMDB, not a copy
    reply.done()
    assert reply.release is None


def test_item_errors_are_counted_per_request(handler: RequestHandler) -> None:
    good = block_records(key(1), indices=[0])
    bad = block_records(key(2), indices=[0, 1])
    bad[1] = (key(3), 1, bad[1][2])  # stored under the wrong key
    replies = handler.handle_puts(
        [request(Op.PUT, 1, *put_items(good)), request(Op.PUT, 2, *put_items(bad))]
    )
    assert parse(replies[1]).items["status"].tolist() == [Status.OK, Status.WRONG_KEY]
    stats = handler.stats()
    assert stats["items"]["put"] == {"ok": 2, "wrong_key": 1}
    assert stats["errors"]["wrong_key"] == 1
    reply = parse(handler.handle(request(Op.STATS, 7, make_items(Op.STATS, 0, reply=False))))
    assert reply.header.status == Status.OK and reply.header.request_id == 7


def test_a_put_whose_data_does_not_match_its_items_is_refused(handler: RequestHandler) -> None:
    items, _ = put_items(block_records(key(1), indices=[0]))
    header = Header(op=Op.PUT, request_id=5, count=1, data_len=5)
    message = Message(header, items, memoryview(b"short"))  # lengths say more than 5 bytes
    (reply,) = handler.handle_puts([Request(T, message, time.perf_counter(), 0)])  # type: ignore[arg-type]
    parsed = parse(reply)
    assert parsed.header.status is Status.BAD_REQUEST and parsed.header.request_id == 5
    assert handler.stats()["errors"]["bad_request"] == 1
