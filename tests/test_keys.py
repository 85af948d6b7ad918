"""Prefix keys: golden vectors, the documented construction, and prefix properties."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache
from kvcache.errors import ConfigError
from kvcache.keys import (
    BLOCK_TAG,
    BLOCK_TAG_V1,
    NAMESPACE_TAG,
    PLACEMENT_TAG_BYTES,
    Namespace,
    are_block_keys,
    as_token_array,
    block_keys,
    placement_group_blocks,
)
from kvcache.layout import DType, KVLayout

SMALL = KVLayout(tokens_per_block=4, bytes_per_token=2, dtype=DType.FLOAT16, layers_in_block=1)


def small_ns(**kw: str) -> Namespace:
    return Namespace(model="m", revision="r", layout=SMALL, **kw)


def test_golden_reference_namespace() -> None:
    # Pinned forever: changing these invalidates every stored block in every cluster.
    # (The layout is the former REFERENCE_LAYOUT, 512 tokens x 224 B, spelled out so the
    # vectors stay those of docs/spec when the reference layout moves.)
    old_reference = KVLayout(
        tokens_per_block=512, bytes_per_token=224, dtype=DType.BFLOAT16, layers_in_block=1
    )
    ns = Namespace(model="meta-llama/Llama-3.1-8B", revision="main", layout=old_reference)
    assert ns.seed.hex() == "16c407fc28494501f30a546ddf437552"
    keys = block_keys(ns, list(range(1024)) + [7] * 100)
    assert [k.hex() for k in keys] == [
        "21f56a50860cf1c3177f97a25bfafd49",
        "21f56a5021e4cba588358b7d85dbff7a",
    ]


def test_golden_small_namespace() -> None:
    ns = small_ns(parallel="tp1of2", tenant="acme")
    assert ns.seed.hex() == "e28a4e8dbfc8d79ff4e461c36bbf027f"
    assert [k.hex() for k in block_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9])] == [
        "df2d0f0300caf3a2bef3bd373bc61e12",
        "df2d0f033ba7d073bef118af7e38926a",
    ]


def test_version_1_construction_stays_pinned() -> None:
    """Version 1's keys (no placement groups) as docs/spec/hashing.md section 5 keeps them:
    the spec's construction still gives the vectors pinned when v1 was current."""
    old_reference = KVLayout(
        tokens_per_block=512, bytes_per_token=224, dtype=DType.BFLOAT16, layers_in_block=1
    )
    seed = Namespace(model="meta-llama/Llama-3.1-8B", revision="main", layout=old_reference).seed
    tokens = np.array(list(range(1024)), "<u4").tobytes()
    k0 = xxhash.xxh3_128_digest(BLOCK_TAG_V1 + seed + tokens[:2048])
    k1 = xxhash.xxh3_128_digest(BLOCK_TAG_V1 + k0 + tokens[2048:])
    assert [k0.hex(), k1.hex()] == [
        "fc495938e05f7c896a0cbf939ec95743",
        "cfa2eb1af9eaaa2215994ac942bc03f8",
    ]
    assert BLOCK_TAG_V1 != BLOCK_TAG


def test_construction_matches_spec() -> None:
    """Re-derive keys exactly as docs/spec/hashing.md writes them down."""
    ns = small_ns(parallel="tp1of2", tenant="acme")

    def field(value: str) -> bytes:
        raw = value.encode()
        return struct.pack("<I", len(raw)) + raw

    layout = "tpb=4;bpt=2;dtype=float16;layers=1"
    seed = xxhash.xxh3_128_digest(
        NAMESPACE_TAG + field("m") + field("r") + field(layout) + field("tp1of2") + field("acme")
    )
    assert seed == ns.seed
    assert BLOCK_TAG == b"kvcache:block:v2\x00" and PLACEMENT_TAG_BYTES == 4
    k0 = xxhash.xxh3_128_digest(BLOCK_TAG + seed + struct.pack("<4I", 1, 2, 3, 4))
    h1 = xxhash.xxh3_128_digest(BLOCK_TAG + k0 + struct.pack("<4I", 5, 6, 7, 8))
    k1 = k0[:4] + h1[4:]  # block 1 is in block 0's placement group (G = 64 here)
    assert block_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == [k0, k1]


@pytest.mark.parametrize(
    ("bytes_per_token", "tokens_per_block", "group"),
    [
        (2, 4, 64),  # 8-byte blocks: capped at 64
        (896, 128, 64),  # DeepSeek-V4.1's 112 KiB blocks: 73 fit 8 MiB, a power of two: 64
        (4096, 512, 4),  # Llama-3-8B's 2 MiB blocks
        (3 << 20, 1, 2),  # 3 MiB blocks: 2 fit
        (16 << 20, 1, 1),  # blocks over 8 MiB: a group each
    ],
)
def test_placement_group_size(bytes_per_token: int, tokens_per_block: int, group: int) -> None:
    layout = KVLayout(
        tokens_per_block=tokens_per_block,
        bytes_per_token=bytes_per_token,
        dtype=DType.INT8,
        layers_in_block=1,
    )
    assert placement_group_blocks(layout) == group
    assert Namespace(model="m", revision="r", layout=layout).group_blocks == group


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=700),
    block_bytes=st.sampled_from([8, 1 << 20, 2 << 20, 3 << 20, 9 << 20]),
)
def test_a_group_shares_its_first_blocks_placement_tag(tokens: list[int], block_bytes: int) -> None:
    """Key i carries the placement tag of key i - i mod G, and otherwise the chained hash
    (tags of distinct groups differ), on the native and the per-block path alike."""
    layout = KVLayout(
        tokens_per_block=4, bytes_per_token=block_bytes // 4, dtype=DType.INT8, layers_in_block=1
    )
    ns = Namespace(model="m", revision="r", layout=layout)
    group, tag = ns.group_blocks, PLACEMENT_TAG_BYTES
    keys = block_keys(ns, tokens)
    parent = ns.seed
    for i, key in enumerate(keys):
        own = xxhash.xxh3_128_digest(
            BLOCK_TAG + parent + np.array(tokens[4 * i : 4 * i + 4], "<u4").tobytes()
        )
        leader = keys[i - i % group]
        assert key[:tag] == (own[:tag] if i % group == 0 else leader[:tag])
        assert key[tag:] == own[tag:]
        parent = key
    leaders = {k[:tag] for k in keys[::group]}
    assert len(leaders) == len(keys[::group])
    # The same tokens keyed a block at a time (under the native chain's threshold).
    assert [block_keys(ns, tokens[: 4 * (i + 1)])[-1] for i in range(min(len(keys), 3))] == keys[:3]


def test_partial_last_block_gets_no_key() -> None:
    ns = small_ns()
    assert block_keys(ns, [1, 2, 3]) == []
    assert len(block_keys(ns, list(range(7)))) == 1
    assert len(block_keys(ns, list(range(8)))) == 2


@pytest.mark.parametrize(
    "field",
    [
        {"model": "other"},
        {"revision": "r2"},
        {"parallel": "tp1of8"},
        {"tenant": "t2"},
    ],
)
def test_every_namespace_field_changes_the_key(field: dict[str, str]) -> None:
    base = dict(model="m", revision="r", parallel="tp0of1", tenant="default")
    a = Namespace(layout=SMALL, **base)  # type: ignore[arg-type]
    b = Namespace(layout=SMALL, **{**base, **field})  # type: ignore[arg-type]
    assert block_keys(a, [1, 2, 3, 4]) != block_keys(b, [1, 2, 3, 4])


def test_layout_changes_the_key() -> None:
    other = KVLayout(tokens_per_block=4, bytes_per_token=2, dtype=DType.BFLOAT16, layers_in_block=1)
    a = Namespace(model="m", revision="r", layout=SMALL)
    b = Namespace(model="m", revision="r", layout=other)
    assert block_keys(a, [1, 2, 3, 4]) != block_keys(b, [1, 2, 3, 4])


def test_field_boundaries_are_unambiguous() -> None:
    assert (
        Namespace(model="ab", revision="c", layout=SMALL).seed
        != Namespace(model="a", revision="bc", layout=SMALL).seed
    )


@settings(derandomize=True, max_examples=200)
@given(
    a=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    b=st.lists(st.integers(0, 2**32 - 1), max_size=40),
)
def test_keys_are_prefix_keys(a: list[int], b: list[int]) -> None:
    """Block i of two prompts has equal keys iff their first (i+1)*B tokens are equal."""
    ns = small_ns()
    ka, kb = block_keys(ns, a), block_keys(ns, b)
    for i in range(min(len(ka), len(kb))):
        same_prefix = a[: (i + 1) * 4] == b[: (i + 1) * 4]
        assert (ka[i] == kb[i]) == same_prefix


@settings(derandomize=True, max_examples=100)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=64))
def test_list_and_array_inputs_agree(tokens: list[int]) -> None:
    ns = small_ns()
    expected = block_keys(ns, tokens)
    assert block_keys(ns, np.array(tokens, dtype=np.uint64)) == expected
    assert block_keys(ns, np.array(tokens, dtype=np.uint32)) == expected
    assert block_keys(ns, np.array(tokens, dtype=">u4")) == expected


def test_repeated_middle_segment_does_not_match() -> None:
    ns = small_ns()
    seg = [9, 9, 9, 9]
    assert block_keys(ns, [1, 1, 1, 1, *seg])[1] != block_keys(ns, [2, 2, 2, 2, *seg])[1]


def test_max_blocks() -> None:
    ns = small_ns()
    assert block_keys(ns, list(range(40)), max_blocks=3) == block_keys(ns, list(range(40)))[:3]


@pytest.mark.parametrize(
    "bad",
    [[-1], [2**32], np.array([-5], dtype=np.int64), np.array([[1, 2]]), np.array([1.5]), ["x"]],
)
def test_bad_tokens_raise_config_error(bad: object) -> None:
    with pytest.raises(ConfigError):
        as_token_array(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "x" * 2000])
def test_bad_namespace_field(bad: str) -> None:
    with pytest.raises(ConfigError):
        Namespace(model=bad, revision="r", layout=SMALL)


def test_namespace_is_frozen_and_hashable() -> None:
    ns = small_ns()
    with pytest.raises(AttributeError):
        ns.model = "x"  # type: ignore[misc]
    assert {ns: 1}[small_ns()] == 1


def test_public_names_pinned() -> None:
    assert sorted(kvcache.__all__) == sorted(
        ["REFERENCE_LAYOUT", "BlockKey", "DType", "KVLayout", "Namespace", "block_keys"]
    )


class _KeyBytes(bytes):
    """A bytes subclass, as a caller's own key type may be."""


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(min_size=14, max_size=18),
            st.binary(min_size=16, max_size=16).map(_KeyBytes),
            st.binary(min_size=16, max_size=16).map(bytearray),
            st.text(min_size=16, max_size=16),
            st.integers(),
            st.none(),
        ),
        max_size=8,
    )
)
def test_are_block_keys_is_the_per_key_rule(keys: list[object]) -> None:
    """The whole-list check says what a check of each key would: bytes of 16."""
    assert are_block_keys(keys) == all(isinstance(k, bytes) and len(k) == 16 for k in keys)
