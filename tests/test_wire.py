"""The wire codec: round trips per op, MACs, limits, and a fuzz of the decoder."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import wire
from kvcache.errors import AuthError, ProtocolError
from kvcache.wire import (
    FLAG_MAC,
    FLAG_REPLY,
    HEADER_BYTES,
    ITEM_DTYPES,
    Header,
    Limits,
    Op,
    Status,
    data_offsets,
    decode,
    encode,
    error_reply,
    make_items,
)

TOKEN = b"test-token-0123"


def _fill(items: np.ndarray, rng: np.random.Generator) -> None:
    raw = rng.integers(0, 256, items.nbytes, dtype=np.uint8)
    items.view(np.uint8)[:] = raw


@pytest.mark.parametrize(("op", "reply"), sorted(ITEM_DTYPES, key=lambda t: (t[0], t[1])))
@pytest.mark.parametrize("token", [None, TOKEN])
def test_round_trip_every_op(op: Op, reply: bool, token: bytes | None) -> None:
    rng = np.random.default_rng(int(op) * 2 + reply)
    items = make_items(op, 7, reply=reply)
    _fill(items, rng)
    data = b""
    if "length" in items.dtype.names:
        items["length"] = rng.integers(0, 50, len(items))
        data = rng.integers(0, 256, int(items["length"].sum()), dtype=np.uint8).tobytes()
    header = Header(
        op=op,
        request_id=12345,
        count=len(items),
        flags=FLAG_REPLY if reply else 0,
        traffic_class="agent",
    )
    frames = encode(header, items, data, token=token)
    assert len(frames) == (4 if token else 3)
    assert len(frames[0]) == HEADER_BYTES
    message = decode(frames, token=token)
    assert message.header.op is op
    assert message.header.request_id == 12345
    assert message.header.traffic_class == "agent"
    assert message.header.is_reply is reply
    assert bool(message.header.flags & FLAG_MAC) is bool(token)
    assert message.items.tobytes() == items.tobytes()
    assert bytes(message.data) == data


def test_data_offsets_point_at_each_item() -> None:
    items = make_items(Op.PUT, 4, reply=False)
    items["length"] = [3, 0, 5, 2]
    assert data_offsets(items).tolist() == [0, 3, 3, 8]


def test_error_reply_decodes_with_status_and_text() -> None:
    request = Header(op=Op.GET, request_id=9, count=0)
    message = decode(error_reply(request, Status.TOO_LARGE, "too big"))
    assert message.header.status is Status.TOO_LARGE
    assert message.header.request_id == 9
    assert message.error_text() == "too big"


def test_mac_is_checked() -> None:
    header = Header(op=Op.HAS, request_id=1, count=1)
    frames = encode(header, make_items(Op.HAS, 1, reply=False), token=TOKEN)
    with pytest.raises(AuthError):
        decode(frames, token=b"another-token")
    unsigned = encode(header, make_items(Op.HAS, 1, reply=False))
    with pytest.raises(AuthError):
        decode(unsigned, token=TOKEN)
    tampered = list(frames)
    tampered[1] = b"\x01" * 16
    with pytest.raises(AuthError):
        decode(tampered, token=TOKEN)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda h: b"XX" + h[2:], "magic"),
        (lambda h: h[:2] + b"\x09" + h[3:], "version"),
        (lambda h: h[:3] + b"\x63" + h[4:], "unknown op"),
        (lambda h: h[:4] + b"\x80\x00" + h[6:], "flags"),
        (lambda h: h[:6] + b"\x63\x00" + h[8:], "status"),
        (lambda h: h[:-1], "header frame"),
    ],
)
def test_bad_headers_are_protocol_errors(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    frames = encode(Header(op=Op.HAS, request_id=1, count=0))
    with pytest.raises(ProtocolError, match=needle):
        decode([mutate(bytes(frames[0])), *frames[1:]])


def test_limits_are_enforced() -> None:
    limits = Limits(max_items=4, max_data_bytes=100)
    items = make_items(Op.HAS, 5, reply=False)
    with pytest.raises(ProtocolError, match="exceed"):
        decode(encode(Header(op=Op.HAS, request_id=1, count=5), items), limits=limits)
    put = make_items(Op.PUT, 1, reply=False)
    put["length"] = 101
    frames = encode(Header(op=Op.PUT, request_id=1, count=1), put, b"x" * 101)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(frames, limits=limits)
    assert limits.max_frame_bytes >= 100


def test_counts_and_lengths_must_agree() -> None:
    put = make_items(Op.PUT, 2, reply=False)
    put["length"] = [4, 4]
    frames = encode(Header(op=Op.PUT, request_id=1, count=2), put, b"x" * 7)
    with pytest.raises(ProtocolError, match="add up"):
        decode(frames)
    header = bytearray(frames[0])
    struct.pack_into("<I", header, 16, 3)  # count field says 3, items frame holds 2
    with pytest.raises(ProtocolError, match="items frame"):
        decode([bytes(header), *frames[1:]])
    with pytest.raises(ProtocolError, match="frames"):
        decode(frames[:2])


# ---------------------------------------------------------------------- fuzz

_frame = st.binary(max_size=200)


@st.composite
def _near_valid(draw: st.DrawFn) -> list[bytes]:
    """A valid message with some bytes flipped, frames cut or frames added."""
    op = draw(st.sampled_from(list(Op)))
    reply = draw(st.booleans())
    n = draw(st.integers(0, 4))
    items = make_items(op, n, reply=reply)
    items.view(np.uint8)[:] = np.frombuffer(
        draw(st.binary(min_size=items.nbytes, max_size=items.nbytes)), np.uint8
    )
    data = b""
    if "length" in items.dtype.names:
        items["length"] = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)) if n else []
        data = draw(
            st.binary(min_size=int(items["length"].sum()), max_size=int(items["length"].sum()))
        )
    header = Header(
        op=op, request_id=draw(st.integers(0, 2**64 - 1)), count=n, flags=FLAG_REPLY if reply else 0
    )
    token = draw(st.sampled_from([None, TOKEN]))
    frames = [bytes(f) for f in encode(header, items, data, token=token)]
    for _ in range(draw(st.integers(0, 3))):
        which = draw(st.integers(0, len(frames) - 1))
        frame = bytearray(frames[which])
        if frame and draw(st.booleans()):
            pos = draw(st.integers(0, len(frame) - 1))
            frame[pos] ^= draw(st.integers(1, 255))
        else:
            frame = frame[: draw(st.integers(0, len(frame)))]
        frames[which] = bytes(frame)
    if draw(st.booleans()):
        frames.append(draw(_frame))
    return frames


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    frames=st.one_of(st.lists(_frame, max_size=6), _near_valid()),
    token=st.sampled_from([None, TOKEN]),
)
def test_decoder_fuzz_returns_message_or_protocol_error(
    frames: list[bytes], token: bytes | None
) -> None:
    try:
        message = decode(frames, limits=Limits(max_items=64, max_data_bytes=4096), token=token)
    except (ProtocolError, AuthError):
        return
    assert isinstance(message, wire.Message)
    assert len(message.items) == message.header.count
    # A message that decodes re-encodes to the same bytes (nothing was guessed).
    again = encode(message.header, np.array(message.items), bytes(message.data))
    assert bytes(again[0]) == frames[0]
    assert bytes(again[1]) == bytes(frames[1])
    assert bytes(again[2]) == bytes(frames[2])


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES))
def test_header_fuzz(raw: bytes) -> None:
    try:
        header = Header.unpack(raw)
    except ProtocolError:
        return
    assert header.pack() == raw
