"""The SWA_GET codec (``kvcache.swa_local.protocol``): round trips, agreement with the wire's
record types, and what a malformed reply raises."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.errors import ProtocolError
from kvcache.keys import BlockKey
from kvcache.swa_local.protocol import (
    GET_ITEM,
    GET_REPLY_ITEM,
    GetItem,
    get_reply,
    get_request,
    parse_get_reply,
    parse_get_request,
)
from kvcache.swa_local.state import StateKey
from kvcache.wire import FLAG_REPLY, HEADER_BYTES, Header, Limits, Op, Status, decode, item_dtype

keys = st.builds(
    StateKey,
    namespace=st.binary(min_size=8, max_size=8),
    block=st.binary(min_size=16, max_size=16).map(BlockKey),
    position=st.integers(1, 2**32 - 1),
)
wanted = st.lists(st.tuples(keys, st.integers(0, 2**64 - 1)), max_size=20)
answers = st.lists(
    st.one_of(
        st.tuples(
            st.just(Status.OK), st.integers(1, 2**32 - 1), st.binary(min_size=16, max_size=16)
        ),
        st.tuples(
            st.sampled_from([Status.NOT_FOUND, Status.BAD_ITEM]), st.just(0), st.just(bytes(16))
        ),
    ),
    max_size=20,
)


def test_the_structs_are_the_wires_record_types() -> None:
    assert GET_ITEM.size == item_dtype(Op.SWA_GET, reply=False).itemsize == 40
    assert GET_REPLY_ITEM.size == item_dtype(Op.SWA_GET, reply=True).itemsize == 24


@given(wanted, st.integers(0, 2**64 - 1))
def test_a_request_round_trips_and_reads_as_the_wires_records(
    pairs: list[tuple[StateKey, int]], request_id: int
) -> None:
    raw = get_request(request_id, pairs)
    message = decode(raw, limits=Limits(max_items=64))
    assert message.header.op is Op.SWA_GET and message.header.request_id == request_id
    assert not message.header.is_reply and message.header.count == len(pairs)
    records = message.items
    assert [bytes(r) for r in records["key"]] == [k.block for k, _ in pairs]
    assert records["position"].tolist() == [k.position for k, _ in pairs]
    assert [bytes(r) for r in records["state_ns"]] == [k.namespace for k, _ in pairs]
    assert records["incarnation"].tolist() == [i for _, i in pairs]
    assert parse_get_request(message.items.tobytes()) == [
        GetItem(k.block, k.position, k.namespace, i) for k, i in pairs
    ]


@given(answers, st.integers(0, 2**64 - 1))
def test_a_reply_round_trips_with_offsets_into_the_data(
    given_answers: list[tuple[Status, int, bytes]], request_id: int
) -> None:
    raw = get_reply(request_id, given_answers)
    header = Header.unpack(raw[:HEADER_BYTES])
    assert header.is_reply and header.flags == FLAG_REPLY and header.request_id == request_id
    assert header.data_len == sum(n for _, n, _ in given_answers)
    records = np.frombuffer(raw, item_dtype(Op.SWA_GET, reply=True), len(given_answers), 48)
    assert records["length"].tolist() == [n for _, n, _ in given_answers]
    parsed = parse_get_reply(memoryview(raw)[HEADER_BYTES:], len(given_answers), header.data_len)
    assert [(a.status, a.length, a.digest) for a in parsed] == given_answers
    offset = 0
    for a in parsed:
        assert a.offset == offset
        offset += a.length


def test_malformed_replies_raise_protocol_errors() -> None:
    ok = GET_REPLY_ITEM.pack(int(Status.OK), 10, bytes(16))
    with pytest.raises(ProtocolError, match="items for 2 asked"):
        parse_get_reply(ok, 2, 10)
    with pytest.raises(ProtocolError, match="add up to 10"):
        parse_get_reply(ok, 1, 11)
    with pytest.raises(ProtocolError, match="unknown item status"):
        parse_get_reply(GET_REPLY_ITEM.pack(250, 0, bytes(16)), 1, 0)
    with pytest.raises(ProtocolError, match="not OK carries bytes"):
        parse_get_reply(GET_REPLY_ITEM.pack(int(Status.NOT_FOUND), 3, bytes(16)), 1, 3)
