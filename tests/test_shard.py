"""Shard header: round trips, and untrusted bytes only ever raise typed errors."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.errors import IntegrityError, ShardFormatError
from kvcache.keys import BlockKey
from kvcache.shard import (
    HEADER_BYTES,
    HEADER_DTYPE,
    IDENTITY_BYTES,
    ShardHeader,
    build_headers,
    check_class_name,
    header_verdicts,
    identity_matches,
    identity_prefixes,
    new_stripe_id,
    payload_hash,
    shard_hash,
    shard_len_for,
    split_shard,
)

class_names = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,14}", fullmatch=True)


@st.composite
def headers(draw: st.DrawFn) -> ShardHeader:
    k = draw(st.integers(1, 254))
    m = draw(st.integers(0, 255 - k))
    created = draw(st.integers(0, 2**63))
    return ShardHeader(
        block_key=BlockKey(draw(st.binary(min_size=16, max_size=16))),
        stripe_id=draw(st.integers(0, 2**64 - 1)),
        shard_index=draw(st.integers(0, k + m - 1)),
        k=k,
        m=m,
        payload_len=draw(st.integers(1, 2**31)),
        shard_hash=draw(st.integers(0, 2**64 - 1)),
        payload_hash=draw(st.binary(min_size=16, max_size=16)),
        traffic_class=draw(class_names),
        created_ms=created,
        expiry_ms=draw(st.integers(created, 2**64 - 1)),
    )


def make_shard(body: bytes, *, index: int = 0, cls: str = "chat") -> tuple[ShardHeader, bytes]:
    header = ShardHeader(
        block_key=BlockKey(os.urandom(16)),
        stripe_id=new_stripe_id(),
        shard_index=index,
        k=10,
        m=2,
        payload_len=len(body) * 10,
        shard_hash=shard_hash(body),
        payload_hash=payload_hash(body),
        traffic_class=cls,
        created_ms=1000,
        expiry_ms=2000,
    )
    return header, header.pack() + body


@settings(derandomize=True, max_examples=300)
@given(headers())
def test_header_round_trip(header: ShardHeader) -> None:
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert ShardHeader.unpack(packed) == header
    assert ShardHeader.unpack(memoryview(packed + b"tail")) == header


@settings(derandomize=True, max_examples=500)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_format_error(data: bytes) -> None:
    with contextlib.suppress(ShardFormatError):
        ShardHeader.unpack(data)


@settings(derandomize=True, max_examples=300)
@given(headers(), st.data())
def test_truncations_and_bit_flips_are_rejected(header: ShardHeader, data: st.DataObject) -> None:
    packed = header.pack()
    cut = data.draw(st.integers(0, HEADER_BYTES - 1))
    with pytest.raises(ShardFormatError):
        ShardHeader.unpack(packed[:cut])
    pos = data.draw(st.integers(0, HEADER_BYTES - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(packed)
    flipped[pos] ^= 1 << bit
    with pytest.raises(ShardFormatError):
        ShardHeader.unpack(bytes(flipped))


def test_split_shard_checks_the_body() -> None:
    body = os.urandom(11520)
    header, record = make_shard(body)
    parsed, view = split_shard(record)
    assert parsed == header and bytes(view) == body
    damaged = bytearray(record)
    damaged[-1] ^= 0xFF
    with pytest.raises(IntegrityError) as info:
        split_shard(bytes(damaged))
    assert info.value.expected == header.shard_hash
    with pytest.raises(ShardFormatError):
        split_shard(record[:-1])


def test_wrong_version_is_named() -> None:
    _, record = make_shard(b"\x00" * 64)
    bad = bytearray(record)
    bad[4] = 9
    with pytest.raises(ShardFormatError, match="version 9"):
        ShardHeader.unpack(bytes(bad))


@pytest.mark.parametrize(
    ("payload", "k", "expected"),
    [(114688, 10, 11520), (1, 10, 64), (640, 10, 64), (641, 10, 128), (100, 1, 128)],
)
def test_shard_len(payload: int, k: int, expected: int) -> None:
    assert shard_len_for(payload, k) == expected


@pytest.mark.parametrize("bad", ["", "Chat", "a" * 16, "-x", "ü", "a b"])
def test_bad_class_names(bad: str) -> None:
    with pytest.raises(ShardFormatError):
        check_class_name(bad)


@pytest.mark.parametrize(
    "field",
    [
        {"k": 0},
        {"shard_index": 12},
        {"expiry_ms": 999},
        {"block_key": b"short"},
        {"payload_len": 0},
        {"stripe_id": -1},
    ],
)
def test_invalid_header_fields(field: dict[str, object]) -> None:
    base: dict[str, object] = dict(
        block_key=b"k" * 16,
        stripe_id=1,
        shard_index=0,
        k=10,
        m=2,
        payload_len=100,
        shard_hash=0,
        payload_hash=b"p" * 16,
        traffic_class="chat",
        created_ms=1000,
        expiry_ms=2000,
    )
    with pytest.raises(ShardFormatError):
        ShardHeader(**{**base, **field})  # type: ignore[arg-type]


def test_stripe_ids_are_nonzero_and_distinct() -> None:
    ids = {new_stripe_id() for _ in range(1000)}
    assert 0 not in ids and len(ids) == 1000


# ---------------------------------------------------------------------- one home for the rules


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A valid packed header, possibly with bytes changed (checksum recomputed or not)."""
    raw = bytearray(draw(headers()).pack())
    for _ in range(draw(st.integers(0, 3))):
        pos = draw(st.integers(0, HEADER_BYTES - 1))
        raw[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        # Re-seal: the field rules, not the checksum, must then decide.
        body = bytes(raw[: HEADER_BYTES - 4])
        raw[HEADER_BYTES - 4 :] = (xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF).to_bytes(
            4, "little"
        )
    return bytes(raw)


@settings(derandomize=True, max_examples=500)
@given(st.lists(mutated_headers(), min_size=1, max_size=6))
def test_vectorised_verdicts_agree_with_the_parser(raws: list[bytes]) -> None:
    """header_verdicts (daemon PUT checks, client reply checks) == ShardHeader.unpack."""
    records = np.frombuffer(b"".join(raws), HEADER_DTYPE)
    verdicts = header_verdicts(records)
    for raw, verdict in zip(raws, verdicts.tolist(), strict=True):
        try:
            ShardHeader.unpack(raw)
            expected = True
        except ShardFormatError:
            expected = False
        assert verdict == expected


@settings(derandomize=True, max_examples=100)
@given(headers())
def test_build_headers_packs_like_the_scalar_header(header: ShardHeader) -> None:
    built = build_headers(
        keys=np.frombuffer(header.block_key, "V16"),
        stripe_ids=np.array([header.stripe_id], np.uint64),
        k=header.k,
        m=header.m,
        payload_len=header.payload_len,
        payload_hashes=np.frombuffer(header.payload_hash, "V16"),
        shard_hashes=np.full((1, header.n), header.shard_hash, np.uint64),
        traffic_class=header.traffic_class,
        created_ms=header.created_ms,
        expiry_ms=header.expiry_ms,
    )
    assert built.shape == (1, header.n)
    assert built[0, header.shard_index].tobytes() == header.pack()


@given(
    stripe=st.integers(1, 2**64 - 1),
    index=st.integers(0, 11),
    cls=st.from_regex(r"[a-z0-9][a-z0-9_-]{0,14}", fullmatch=True),
    flips=st.lists(st.tuples(st.integers(0, IDENTITY_BYTES - 1), st.integers(1, 255)), max_size=3),
)
def test_identity_check_agrees_with_the_header_rules_on_identity_bytes(
    stripe: int, index: int, cls: str, flips: list[tuple[int, int]]
) -> None:
    """The reader's identity comparison accepts exactly the headers that pass the header
    rules and name the shard asked for, for any damage to the identity bytes (the class
    length byte aside, where it may only be more lenient: the payload hash decides)."""
    key = np.frombuffer(bytes(range(16)), "V16")
    stripes = np.array([stripe], np.uint64)
    headers = build_headers(
        keys=key, stripe_ids=stripes, k=10, m=2, payload_len=114688,
        payload_hashes=np.zeros(1, "V16"), shard_hashes=np.zeros((1, 12), np.uint64),
        traffic_class=cls, created_ms=1, expiry_ms=2,
    )  # fmt: skip
    raw = headers.view(np.uint8).reshape(12, HEADER_BYTES)[index : index + 1].copy()
    for at, mask in flips:
        raw[0, at] ^= mask
    hdr = raw.view(HEADER_DTYPE).reshape(-1)
    rules = bool(
        header_verdicts(hdr, checksum=False)[0]
        and hdr["block_key"][0] == key[0]
        and hdr["stripe_id"][0] == stripe
        and hdr["shard_index"][0] == index
        and hdr["k"][0] == 10
        and hdr["m"][0] == 2
        and hdr["payload_len"][0] == 114688
    )
    expected = identity_prefixes(key, stripes, k=10, m=2, payload_len=114688)[0, index : index + 1]
    identity = bool(identity_matches(raw, expected)[0])
    if any(at == 9 for at, _ in flips):
        assert identity or not rules
    else:
        assert identity == rules


@settings(max_examples=200, deadline=None)
@given(
    damage=st.dictionaries(st.integers(0, 11), st.tuples(st.integers(0, 103), st.integers(1, 255)),
                           max_size=11),
    missing=st.sets(st.integers(0, 11), max_size=3),
    odd_class=st.sets(st.integers(0, 11), max_size=5),
)  # fmt: skip
def test_repair_reference_never_picks_a_damaged_or_outvoted_header(
    damage: dict[int, tuple[int, int]], missing: set[int], odd_class: set[int]
) -> None:
    """Any byte of any header flipped (it then fails its checksum or a rule), some headers
    not received, a minority re-signed with another class: the reference is a received,
    intact header of the majority's class, and exactly the others received deviate."""
    from kvcache.shard import repair_reference

    digest = bytes(range(16))
    odd_class -= set(damage)
    if len(odd_class) * 2 >= 12 - len(damage) - len(missing - set(damage) - odd_class):
        odd_class = set()
    rows = [
        build_headers(
            keys=np.frombuffer(b"k" * 16, "V16"), stripe_ids=np.array([7], np.uint64), k=10, m=2,
            payload_len=4096, payload_hashes=np.frombuffer(digest, "V16"),
            shard_hashes=np.arange(12, dtype=np.uint64)[None, :], traffic_class=cls,
            created_ms=5, expiry_ms=9,
        )[0]
        for cls in ("chat", "default4")
    ]  # fmt: skip
    headers = np.where(np.isin(np.arange(12), list(odd_class)), rows[1], rows[0])
    raw = headers.view(np.uint8).reshape(12, HEADER_BYTES)
    for i, (at, mask) in damage.items():
        raw[i, at] ^= mask
    got = ~np.isin(np.arange(12), list(missing))
    ref, deviating = repair_reference(headers, got, digest)
    good = got & ~np.isin(np.arange(12), list(damage))
    majority = good & ~np.isin(np.arange(12), list(odd_class))
    if not good.any():
        assert ref is None and (deviating == got).all()
        return
    assert ref is not None and good[ref]
    if majority.sum() > (good & ~majority).sum():
        assert majority[ref]
        assert (deviating == (got & ~majority)).all()
