"""DataService without sockets: several requests at once, PUTs grouped into one transaction."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_fixtures import FakeClock, block_records, get_items, put_items

from kvcache.server.config import ServerConfig
from kvcache.server.metrics import Metrics
from kvcache.server.service import DataService
from kvcache.server.store import ShardStore
from kvcache.wire import Frame, Header, Op, Status, decode, encode, make_items


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[DataService]:
    config = ServerConfig(node_id="svc", data_dir=tmp_path, capacity_bytes=64 << 20)
    with ShardStore(tmp_path / "db", capacity_bytes=64 << 20, clock=FakeClock()) as store:
        yield DataService(store, config, Metrics())


def request(op: Op, request_id: int, items: Any, data: Frame = b"") -> list[Frame]:
    return encode(Header(op=op, request_id=request_id, count=len(items)), items, data)


def spy_groups(service: DataService) -> list[int]:
    """Record how many PUT requests each store transaction took."""
    sizes: list[int] = []
    put_many = service.store.put_many

    def spy(batches: Any) -> Any:
        sizes.append(len(batches))
        return put_many(batches)

    service.store.put_many = spy  # type: ignore[method-assign]
    return sizes


def test_requests_are_answered_in_order_and_puts_share_a_transaction(
    service: DataService,
) -> None:
    groups = spy_groups(service)
    first, second, third = (block_records(key(n), indices=[0, 1]) for n in (1, 2, 3))
    wanted = [(k, i) for k, i, _ in first + second]
    short_items, _ = put_items(third)
    replies = service.handle_many(
        [
            request(Op.PUT, 1, *put_items(first)),
            request(Op.PUT, 2, *put_items(second)),
            request(Op.GET, 3, get_items(wanted)),  # sees both PUTs before it
            [b"garbage"],
            request(Op.PUT, 5, *put_items(third)),
            request(Op.PUT, 6, short_items, b"too short"),  # refused alone
        ]
    )
    assert groups == [2, 1]
    messages = [decode(r) for r in replies]
    assert [m.header.request_id for m in messages] == [1, 2, 3, 0, 5, 6]
    assert [m.header.status for m in messages] == [Status.OK] * 3 + [
        Status.BAD_REQUEST,
        Status.OK,
        Status.BAD_REQUEST,
    ]
    assert messages[0].items["status"].tolist() == [Status.OK] * 2
    assert messages[2].items["status"].tolist() == [Status.OK] * 4
    assert bytes(messages[2].data) == b"".join(r for _, _, r in first + second)
    assert service.stats()["requests"]["put"] == 3
    assert service.stats()["errors"]["bad_request"] == 2


def test_a_group_is_bounded_by_bytes(service: DataService) -> None:
    groups = spy_groups(service)
    batches = [put_items(block_records(key(n), body_len=1024, indices=[0])) for n in range(4)]
    size = sum(len(f) for f in request(Op.PUT, 1, *batches[0]))
    replies = service.handle_many(
        [request(Op.PUT, n, *b) for n, b in enumerate(batches)], group_bytes=2 * size
    )
    assert groups == [2, 2]
    assert [decode(r).items["status"].tolist() for r in replies] == [[Status.OK]] * 4
    service.handle_many([request(Op.PUT, 9, *batches[0])], group_bytes=1)  # one always goes
    assert groups == [2, 2, 1]


def test_item_errors_are_counted_per_request_in_a_group(service: DataService) -> None:
    good = block_records(key(1), indices=[0])
    bad = block_records(key(2), indices=[0, 1])
    bad[1] = (key(3), 1, bad[1][2])  # stored under the wrong key
    replies = service.handle_many(
        [request(Op.PUT, 1, *put_items(good)), request(Op.PUT, 2, *put_items(bad))]
    )
    assert decode(replies[1]).items["status"].tolist() == [Status.OK, Status.WRONG_KEY]
    stats = service.stats()
    assert stats["items"]["put"] == {"ok": 2, "wrong_key": 1}
    assert stats["errors"]["wrong_key"] == 1
    reply = decode(service.handle(request(Op.STATS, 7, make_items(Op.STATS, 0, reply=False))))
    assert reply.header.status == Status.OK and reply.header.request_id == 7
