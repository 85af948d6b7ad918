"""Trace hash ids mapped onto the reference layout's 128-token blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache.errors import ConfigError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.workload import (
    TRACE_BLOCK_TOKENS,
    Request,
    block_identities,
    generate_workload,
    ideal_hit_blocks,
    replay_keys,
    replay_namespace,
    tokens_for,
)


def _req(length: int, ids: tuple[int, ...]) -> Request:
    return Request(timestamp_ms=0, input_length=length, output_length=1, hash_ids=ids)


def test_a_hash_id_is_four_reference_blocks() -> None:
    assert TRACE_BLOCK_TOKENS // REFERENCE_LAYOUT.tokens_per_block == 4
    req = _req(2 * 512 + 300, (7, 8, 9))
    assert block_identities(req, 128) == [
        (7, 0), (7, 1), (7, 2), (7, 3), (8, 0), (8, 1), (8, 2), (8, 3), (9, 0), (9, 1)
    ]  # fmt: skip
    assert block_identities(req, 512) == [(7, 0), (8, 0)]
    assert block_identities(req, 1024) == [(7, 8)]
    with pytest.raises(ConfigError):
        block_identities(req, 96)


def test_ideal_hits_count_128_token_blocks_including_a_partial_ids_full_ones() -> None:
    first = _req(512 + 300, (1, 2))  # id 2 partial: 2 full 128-token blocks
    again = _req(2 * 512, (1, 2))  # the same id 2, now whole
    assert ideal_hit_blocks([first, again], tokens_per_block=128) == [0, 6]
    assert ideal_hit_blocks([first, again]) == [0, 1]


def test_ideal_hits_agree_with_the_keys_the_tokens_give() -> None:
    reqs = generate_workload()[:40]
    ideal = ideal_hit_blocks(reqs, tokens_per_block=128)
    ns = Namespace(model="w", revision="1", layout=REFERENCE_LAYOUT)
    seen: set[bytes] = set()
    for req, want in zip(reqs, ideal, strict=True):
        keys = block_keys(ns, tokens_for(req))
        hit = 0
        while hit < len(keys) and keys[hit] in seen:
            hit += 1
        assert hit == want
        seen.update(keys)
    assert np.count_nonzero(ideal) > 0


def test_replay_keys_are_the_keys_a_replay_writes_one_per_hash_id() -> None:
    reqs = [_req(2 * 512 + 10, (1, 2, 3)), _req(2 * 512, (1, 2)), _req(4 * 512, (1, 4, 5, 6))]
    ns = replay_namespace(512 * 64)
    assert ns.layout.payload_bytes == 512 * 64 and ns.tokens_per_block == TRACE_BLOCK_TOKENS
    keys = replay_keys(reqs, ns)
    assert sorted(keys) == [1, 2, 4, 5, 6]  # id 3 is a partial block: never stored
    for req in reqs:
        want = block_keys(ns, tokens_for(req))
        assert [keys[i] for i in req.hash_ids[: req.full_blocks]] == [bytes(k) for k in want]
    assert replay_keys(reqs, replay_namespace(512 * 128))[1] != keys[1]  # the layout counts
    for bad in (0, 1000, -512):
        with pytest.raises(ConfigError, match="multiple of 512"):
            replay_namespace(bad)
