"""The wire codec and the session handshake: round trips, limits, stream cutting, fuzz."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import wire
from kvcache.credentials import Credentials, TenantCredentials
from kvcache.errors import AuthError, ProtocolError
from kvcache.session import ClientHandshake, ServerHandshake
from kvcache.wire import (
    FLAG_REPLY,
    HEADER_BYTES,
    ITEM_DTYPES,
    Header,
    Limits,
    MessageReader,
    Op,
    Status,
    data_offsets,
    decode,
    encode,
    error_reply,
    join,
    make_items,
)


def _fill(items: np.ndarray, rng: np.random.Generator) -> None:
    raw = rng.integers(0, 256, items.nbytes, dtype=np.uint8)
    items.view(np.uint8)[:] = raw


def _message(op: Op, reply: bool, count: int, seed: int) -> tuple[bytes, np.ndarray, bytes]:
    rng = np.random.default_rng(seed)
    items = make_items(op, count, reply=reply)
    _fill(items, rng)
    data = b""
    if "length" in (items.dtype.names or ()):
        items["length"] = rng.integers(0, 50, len(items))
        data = rng.integers(0, 256, int(items["length"].sum()), dtype=np.uint8).tobytes()
    header = Header(
        op=op,
        request_id=12345 + seed,
        count=len(items),
        flags=FLAG_REPLY if reply else 0,
        traffic_class="agent",
    )
    return join(encode(header, items, data)), items, data


@pytest.mark.parametrize(("op", "reply"), sorted(ITEM_DTYPES, key=lambda t: (t[0], t[1])))
def test_round_trip_every_op(op: Op, reply: bool) -> None:
    raw, items, data = _message(op, reply, 7, int(op) * 2 + reply)
    assert len(raw) == HEADER_BYTES + items.nbytes + len(data)
    message = decode(raw)
    assert message.header.op is op
    assert message.header.request_id == 12345 + int(op) * 2 + reply
    assert message.header.traffic_class == "agent"
    assert message.header.is_reply is reply
    assert message.header.data_len == len(data)
    assert message.items.tobytes() == items.tobytes()
    assert bytes(message.data) == data


def test_data_offsets_point_at_each_item() -> None:
    items = make_items(Op.PUT, 4, reply=False)
    items["length"] = [3, 0, 5, 2]
    assert data_offsets(items).tolist() == [0, 3, 3, 8]


def test_error_reply_decodes_with_status_and_text() -> None:
    request = Header(op=Op.GET, request_id=9, count=0)
    message = decode(join(error_reply(request, Status.TOO_LARGE, "too big")))
    assert message.header.status is Status.TOO_LARGE
    assert message.header.request_id == 9
    assert message.error_text() == "too big"


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda h: b"XX" + h[2:], "magic"),
        (lambda h: h[:2] + b"\x09" + h[3:], "version"),
        (lambda h: h[:3] + b"\x63" + h[4:], "unknown op"),
        (lambda h: h[:4] + b"\x80\x00" + h[6:], "flags"),
        (lambda h: h[:6] + b"\x63\x00" + h[8:], "status"),
        (lambda h: h[:20] + b"\x01" + h[21:], "without FLAG_TTL"),
        (lambda h: h[:-1], "header"),
    ],
)
def test_bad_headers_are_protocol_errors(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    raw = join(encode(Header(op=Op.HAS, request_id=1, count=0)))
    with pytest.raises(ProtocolError, match=needle):
        Header.unpack(mutate(raw[:HEADER_BYTES]))


def test_limits_are_enforced_from_the_header_alone() -> None:
    limits = Limits(max_items=4, max_data_bytes=100)
    items = make_items(Op.HAS, 5, reply=False)
    with pytest.raises(ProtocolError, match="exceed"):
        decode(join(encode(Header(op=Op.HAS, request_id=1, count=5), items)), limits=limits)
    # A header announcing a huge data section is refused before any of it is read.
    huge = Header(op=Op.PUT, request_id=1, count=0, data_len=1 << 40).pack()
    with pytest.raises(ProtocolError, match="exceeds"):
        Header.unpack(huge, limits)
    reader = MessageReader(limits=limits)
    reader.recv_buffer()[:HEADER_BYTES] = huge
    reader.commit(HEADER_BYTES)
    with pytest.raises(ProtocolError, match="exceeds"):
        reader.next_message()
    # A HAS reply carries an item per live shard of each asked key: up to 255 a key.
    for op in (Op.HAS, Op.HAS_DIR):
        has = Header(op=op, request_id=1, count=4 * 255, flags=FLAG_REPLY).pack()
        assert Header.unpack(has, limits).count == 4 * 255
        too_many = Header(op=op, request_id=1, count=4 * 255 + 1, flags=FLAG_REPLY).pack()
        with pytest.raises(ProtocolError, match="exceed"):
            Header.unpack(too_many, limits)
    get = Header(op=Op.GET, request_id=1, count=5, flags=FLAG_REPLY).pack()
    with pytest.raises(ProtocolError, match="exceed"):
        Header.unpack(get, limits)


def test_counts_and_lengths_must_agree() -> None:
    put = make_items(Op.PUT, 2, reply=False)
    put["length"] = [4, 4]
    raw = join(encode(Header(op=Op.PUT, request_id=1, count=2), put, b"x" * 7))
    with pytest.raises(ProtocolError, match="add up"):
        decode(raw)
    header = bytearray(raw[:HEADER_BYTES])
    struct.pack_into("<I", header, 16, 3)  # count says 3, the message holds 2 items
    with pytest.raises(ProtocolError, match="bytes"):
        decode(bytes(header) + raw[HEADER_BYTES:])


# ---------------------------------------------------------------------- stream cutting


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    cuts=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    chunk=st.sampled_from([48, 64, 200, 4096]),
)
def test_reader_cuts_any_byte_stream_into_the_same_messages(
    sizes: list[int], cuts: list[int], chunk: int
) -> None:
    """However the bytes arrive, the reader yields exactly the messages that were sent."""
    msgs = [_message(Op.PUT, False, n, seed) for seed, n in enumerate(sizes)]
    stream = b"".join(raw for raw, _i, _d in msgs)
    reader = MessageReader(limits=Limits(), chunk=chunk)
    got = []
    pos = 0
    cut = 0
    while pos < len(stream) or (reader.idle is False):
        buf = reader.recv_buffer()
        step = min(len(buf), cuts[cut % len(cuts)], len(stream) - pos)
        cut += 1
        if step == 0:
            break
        buf[:step] = stream[pos : pos + step]
        reader.commit(step)
        pos += step
        while (message := reader.next_message()) is not None:
            got.append(message)
    assert len(got) == len(msgs)
    for message, (_raw, items, data) in zip(got, msgs, strict=True):
        assert message.items.tobytes() == items.tobytes()
        assert bytes(message.data) == data
    assert reader.idle
    # A buffer grown for a message of many items went back to a chunk: an idle connection
    # holds no more than that.
    assert len(reader.recv_buffer()) == max(chunk, HEADER_BYTES)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    cuts=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    handovers=st.lists(st.booleans(), min_size=1, max_size=40),
)
def test_a_stream_handed_between_readers_yields_the_same_messages(
    sizes: list[int], cuts: list[int], handovers: list[bool]
) -> None:
    """A daemon hands a connection between its Python reader and its native data plane
    (kvcache.server.native_plane): whatever a reader releases, primed into a fresh one,
    continues the stream exactly; a reader in the middle of a message releases nothing."""
    msgs = [_message(Op.PUT, False, n, seed) for seed, n in enumerate(sizes)]
    stream = b"".join(raw for raw, _i, _d in msgs)
    reader = MessageReader(limits=Limits(), chunk=64)
    got = []
    pos = 0
    turn = 0
    while pos < len(stream):
        buf = reader.recv_buffer()
        step = min(len(buf), cuts[turn % len(cuts)], len(stream) - pos)
        buf[:step] = stream[pos : pos + step]
        reader.commit(step)
        pos += step
        while (message := reader.next_message()) is not None:
            got.append(message)
        if handovers[turn % len(handovers)]:
            rest = reader.release()
            if rest is not None:
                assert reader.idle
                reader = MessageReader(limits=Limits(), chunk=64)
                reader.prime(rest)
                while (message := reader.next_message()) is not None:
                    got.append(message)
        turn += 1
    assert [m.items.tobytes() for m in got] == [items.tobytes() for _r, items, _d in msgs]
    assert [bytes(m.data) for m in got] == [data for _r, _i, data in msgs]
    assert reader.idle


def test_a_reader_that_holds_bytes_cannot_be_primed() -> None:
    reader = MessageReader(limits=Limits())
    reader.prime(b"KV")
    with pytest.raises(ValueError, match="holds bytes"):
        reader.prime(b"more")


def test_reader_refuses_a_reply_where_a_request_belongs() -> None:
    raw, _items, _data = _message(Op.HAS, True, 1, 0)
    reader = MessageReader(limits=Limits(), replies=False)
    reader.recv_buffer()[: len(raw)] = raw
    reader.commit(len(raw))
    with pytest.raises(ProtocolError, match="reply"):
        reader.next_message()


# ---------------------------------------------------------------------- fuzz


@st.composite
def _near_valid(draw: st.DrawFn) -> bytes:
    """A valid message with some bytes flipped, cut or appended."""
    op = draw(st.sampled_from(list(Op)))
    raw, _items, _data = _message(
        op, draw(st.booleans()), draw(st.integers(0, 4)), draw(st.integers(0, 99))
    )
    data = bytearray(raw)
    for _ in range(draw(st.integers(0, 3))):
        if data and draw(st.booleans()):
            pos = draw(st.integers(0, len(data) - 1))
            data[pos] ^= draw(st.integers(1, 255))
        else:
            data = data[: draw(st.integers(0, len(data)))]
    if draw(st.booleans()):
        data += draw(st.binary(max_size=60))
    return bytes(data)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(raw=st.one_of(st.binary(max_size=300), _near_valid()))
def test_decoder_fuzz_returns_message_or_protocol_error(raw: bytes) -> None:
    try:
        message = decode(raw, limits=Limits(max_items=64, max_data_bytes=4096))
    except ProtocolError:
        return
    assert isinstance(message, wire.Message)
    assert len(message.items) == message.header.count
    # A message that decodes re-encodes to the same bytes (nothing was guessed).
    assert join(encode(message.header, np.array(message.items), bytes(message.data))) == raw


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(raw=st.one_of(st.binary(max_size=300), _near_valid()))
def test_stream_reader_fuzz_never_raises_anything_but_protocol_errors(raw: bytes) -> None:
    reader = MessageReader(limits=Limits(max_items=64, max_data_bytes=4096), replies=False)
    pos = 0
    try:
        while pos < len(raw):
            buf = reader.recv_buffer()
            step = min(len(buf), len(raw) - pos, 17)
            buf[:step] = raw[pos : pos + step]
            reader.commit(step)
            pos += step
            while reader.next_message() is not None:
                pass
    except ProtocolError:
        return


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES))
def test_header_fuzz(raw: bytes) -> None:
    try:
        header = Header.unpack(raw)
    except ProtocolError:
        return
    assert header.pack() == raw


@st.composite
def _headers(draw: st.DrawFn) -> bytes:
    """Header bytes near a plain request: valid headers of any shape, some bytes flipped."""
    header = Header(
        op=draw(st.sampled_from(list(Op))),
        request_id=draw(st.integers(0, 2**64 - 1)),
        count=draw(st.sampled_from([0, 1, 64, 65, 2**32 - 1])),
        data_len=draw(st.sampled_from([0, 0, 1])),
        status=draw(st.sampled_from([Status.OK, Status.OK, Status.NOT_FOUND])),
        flags=draw(st.sampled_from([0, 0, FLAG_REPLY])),
        traffic_class=draw(st.sampled_from(["", "", "chat"])),
    )
    raw = bytearray(header.pack())
    for _ in range(draw(st.integers(0, 1))):
        raw[draw(st.integers(0, HEADER_BYTES - 1))] ^= draw(st.integers(1, 255))
    return bytes(raw)


@settings(max_examples=400, deadline=None)
@given(raw=st.one_of(_headers(), st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES)))
def test_a_plain_request_is_recognised_exactly(raw: bytes) -> None:
    """plain_request says yes only to a header that Header.unpack accepts as a request of
    that op with nothing but an id and a count, and to every such header."""
    limits = Limits(max_items=64)
    try:
        header: Header | None = Header.unpack(raw, limits)
    except ProtocolError:
        header = None
    for op in (Op.SWA_GET, Op.GET):
        plain = header is not None and header == Header(
            op=op, request_id=header.request_id, count=header.count
        )
        got = wire.plain_request(raw, op, limits)
        assert got == ((header.request_id, header.count) if plain and header else None)


# ---------------------------------------------------------------------- session


def _server(creds: Credentials) -> ServerHandshake:
    return ServerHandshake(creds.tenant)


def test_handshake_authenticates_the_tenant_both_ways() -> None:
    creds = Credentials.generate(("default", "search"))
    server = _server(creds)
    secret = creds.tenant("search").secret  # type: ignore[union-attr]
    client = ClientHandshake(tenant="search", secret=secret)
    result, tenant = server.answer(client.auth(server.hello()))
    assert tenant is not None and tenant.name == "search"
    client.check(result)


@pytest.mark.parametrize("case", ["wrong secret", "unknown tenant", "other tenant's secret"])
def test_handshake_refuses_bad_credentials_alike(case: str) -> None:
    creds = Credentials.generate(("default", "search"))
    server = _server(creds)
    secret = {
        "wrong secret": b"x" * 32,
        "unknown tenant": creds.tenant("default").secret,  # type: ignore[union-attr]
        "other tenant's secret": creds.tenant("default").secret,  # type: ignore[union-attr]
    }[case]
    name = "nobody" if case == "unknown tenant" else "search"
    client = ClientHandshake(tenant=name, secret=secret)
    result, tenant = server.answer(client.auth(server.hello()))
    assert tenant is None
    with pytest.raises(AuthError, match="refused"):
        client.check(result)


def test_a_recorded_handshake_cannot_be_replayed() -> None:
    creds = Credentials.generate()
    first = _server(creds)
    client = ClientHandshake(tenant="default", secret=creds.tenant("default").secret)  # type: ignore[union-attr]
    recorded = client.auth(first.hello())
    assert first.answer(recorded)[1] is not None
    # A new connection gets a fresh nonce: the recorded AUTH no longer proves anything.
    assert _server(creds).answer(recorded)[1] is None


def test_client_refuses_a_server_that_does_not_know_the_secret() -> None:
    creds = Credentials.generate()
    impostor = _server(Credentials(tenants=(TenantCredentials(name="default", secret=b"y" * 32),)))
    client = ClientHandshake(tenant="default", secret=creds.tenant("default").secret)  # type: ignore[union-attr]
    result, tenant = impostor.answer(client.auth(impostor.hello()))
    assert tenant is None  # the impostor cannot check our proof either
    with pytest.raises(AuthError):
        client.check(result)


def test_a_clients_proof_is_good_for_the_node_that_announced_itself_only() -> None:
    """The proofs cover the node id the HELLO announced: a node without the secret that
    passes a client's handshake on to a real daemon (a relay) cannot use the client's proof
    there, whether it forwards the real daemon's HELLO (the client, which knows whom it
    dialed, refuses it) or announces itself (the real daemon refuses the proof)."""
    creds = Credentials.generate()
    secret = creds.tenant("default").secret  # type: ignore[union-attr]
    real = ServerHandshake(creds.tenant, node_id="node-03")
    # The relay forwards the real HELLO to a client that dialed "evil".
    with pytest.raises(AuthError, match="says it is node 'node-03'"):
        ClientHandshake(tenant="default", secret=secret, expect_node="evil").auth(real.hello())
    # The relay rewrites the HELLO to announce "evil": the proof is for "evil", not node-03.
    forged = ServerHandshake(creds.tenant, node_id="evil", nonce=real.nonce).hello()
    client = ClientHandshake(tenant="default", secret=secret, expect_node="evil")
    result, tenant = real.answer(client.auth(forged))
    assert tenant is None and result[:4] == b"KVNO"
    # The node it dialed, announcing itself: accepted both ways, bound to its id.
    client = ClientHandshake(tenant="default", secret=secret, expect_node="node-03")
    result, tenant = real.answer(client.auth(real.hello()))
    assert tenant is not None and client.node_id == "node-03"
    client.check(result)
    # A server proof made for another node id fails the client's check.
    client = ClientHandshake(tenant="default", secret=secret)
    other = ServerHandshake(creds.tenant, node_id="node-04", nonce=real.nonce)
    client.auth(real.hello())
    result, _ = other.answer(
        ClientHandshake(tenant="default", secret=secret, nonce=client.nonce).auth(other.hello())
    )
    with pytest.raises(AuthError):
        client.check(result)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: h[:5] + bytes([200]) + h[6:], "node id field"),  # length past the field
        (lambda h: h[:-1] + b"x", "node id field"),  # bytes after the id
        (lambda h: h[:6] + b"\x01\x00" + h[8:], "node id field"),  # reserved set
        (lambda h: h[:5] + bytes([2]) + h[6:40] + b"\xff\xfe" + h[42:], "not UTF-8"),
        (lambda h: h[:4] + bytes([1]) + h[5:], "session version 1"),
    ],
)
def test_a_malformed_hello_is_a_protocol_error(mutate: object, message: str) -> None:
    hello = ServerHandshake(Credentials.generate().tenant, node_id="").hello()
    client = ClientHandshake(tenant="default", secret=b"s" * 32)
    with pytest.raises(ProtocolError, match=message):
        client.auth(mutate(hello))  # type: ignore[operator]


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_server_handshake_fuzz(raw: bytes) -> None:
    creds = Credentials.generate()
    result, tenant = _server(creds).answer(raw)
    assert tenant is None and result[:4] == b"KVNO"


@given(
    op=st.sampled_from([Op.PUT, Op.GET, Op.TOUCH]),
    ttl=st.integers(0, 2**32 - 1),
    pin=st.booleans(),
)
def test_a_retention_hint_round_trips(op: Op, ttl: int, pin: bool) -> None:
    from kvcache.wire import Retain

    pin = pin and op is not Op.GET
    header = Header(op=op, request_id=3, count=0, retain=Retain(ttl_s=ttl, pin=pin))
    back = Header.unpack(header.pack())
    assert back.retain == Retain(ttl_s=ttl, pin=pin)
    assert back.flags == 0  # the hint's flags live in retain, not in flags


@pytest.mark.parametrize(
    ("op", "flags", "ttl", "needle"),
    [
        (Op.HAS, 0x2, 60, "only for PUT, GET and TOUCH"),
        (Op.GET, 0x4, 0, "pin is only for PUT and TOUCH"),
        (Op.PUT, 0x2, 0, "TTL of 0"),
        (Op.GET, 0x3, 60, "only for PUT, GET and TOUCH"),  # a reply with a hint
    ],
)
def test_misplaced_retention_hints_are_protocol_errors(
    op: Op, flags: int, ttl: int, needle: str
) -> None:
    raw = bytearray(Header(op=op, request_id=1, count=0).pack())
    raw[4:6] = flags.to_bytes(2, "little")
    raw[20:24] = ttl.to_bytes(4, "little")
    with pytest.raises(ProtocolError, match=needle):
        Header.unpack(bytes(raw))


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=0, max_size=20),
    damage=st.one_of(st.none(), st.tuples(st.integers(0, 15), st.integers(1, 255))),
)
def test_a_class_field_unpacks_the_same_the_first_time_and_after(
    name: str, damage: tuple[int, int] | None
) -> None:
    """Headers remember the class fields they found valid; a field unpacks to the same
    name, or fails the same way, however often it is seen."""
    raw = bytearray(join(encode(Header(op=Op.HAS, request_id=1, count=0)))[:HEADER_BYTES])
    field_at = HEADER_BYTES - 16
    field = bytearray(16)
    encoded = name.encode("ascii")
    field[0] = min(len(encoded), 255)
    field[1 : 1 + min(len(encoded), 15)] = encoded[:15]
    if damage is not None:
        field[damage[0]] ^= damage[1]
    raw[field_at:] = field

    def outcome() -> str:
        try:
            return "ok:" + Header.unpack(bytes(raw)).traffic_class
        except ProtocolError as exc:
            return "refused:" + str(exc)

    first = outcome()
    assert outcome() == first == outcome()
    if first.startswith("ok:"):  # what was taken is a valid name, never a damaged one
        got = first[3:]
        assert got == "" or (len(got) <= 15 and got == got.strip() and got[0].isalnum())
