"""The SWA store and state naming: TTL, byte bound, LRU, exact positions, golden vectors."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from server_fixtures import FakeClock

from kvcache import DType, KVLayout, Namespace
from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey
from kvcache.swa_local import (
    StateKey,
    SwaStore,
    state_digest,
    state_namespace_id,
    window_blocks,
)

NS = b"\x01" * 8


def key(block: int, position: int = 128, ns: bytes = NS) -> StateKey:
    return StateKey(namespace=ns, block=BlockKey(block.to_bytes(16, "little")), position=position)


# ---------------------------------------------------------------------- naming


def test_golden_vectors_pin_state_namespace_and_digest() -> None:
    layout = KVLayout(
        tokens_per_block=32, bytes_per_token=64, dtype=DType.FLOAT32, layers_in_block=4
    )
    ns = Namespace(model="m", revision="r", layout=layout)
    # Changing these turns every held state and directory record into a miss: see state.py.
    assert state_namespace_id(ns).hex() == "6681a556e9dfb67b"
    assert state_digest(b"").hex() == "e76ecc6ef18b1683acf0c224b6c6a328"
    assert state_digest(b"state").hex() == "69302c3a8b53d976879a3f0ab83f2d7c"


def test_digest_does_not_depend_on_the_buffer_type() -> None:
    data = bytes(range(256)) * 10
    assert state_digest(data) == state_digest(bytearray(data)) == state_digest(memoryview(data))


@pytest.mark.parametrize(
    ("position", "window", "block", "expected"),
    [
        (96, 64, 32, (1, 3)),  # tokens 33..95: blocks 1 and 2
        (64, 64, 32, (0, 2)),  # tokens 1..63
        (32, 64, 32, (0, 1)),
        (100, 64, 32, (1, 4)),  # a partial last block counts
        (0, 64, 32, (0, 0)),
        (4096, 128, 256, (15, 16)),
    ],
)
def test_window_blocks_match_what_vllm_keeps(
    position: int, window: int, block: int, expected: tuple[int, int]
) -> None:
    assert window_blocks(position, window=window, block_size=block) == expected


def test_state_key_is_validated() -> None:
    with pytest.raises(ArgumentError, match="namespace"):
        StateKey(namespace=b"short", block=BlockKey(bytes(16)), position=1)
    with pytest.raises(ArgumentError, match="block"):
        StateKey(namespace=NS, block=BlockKey(bytes(15)), position=1)
    with pytest.raises(ArgumentError, match="position"):
        StateKey(namespace=NS, block=BlockKey(bytes(16)), position=0)
    with pytest.raises(ArgumentError, match="position"):
        StateKey(namespace=NS, block=BlockKey(bytes(16)), position=True)


# ---------------------------------------------------------------------- store, by example


def test_ttl_counts_from_creation_not_from_use() -> None:
    clock = FakeClock()
    store = SwaStore(max_bytes=1 << 20, ttl_s=180, clock=clock)
    store.put(key(1), b"x" * 100)
    clock.step(170)
    assert store.get(key(1)) is not None  # a hit does not extend its life
    clock.step(10)
    assert store.get(key(1)) is None
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["expiries"]) == (1, 1, 1)
    assert stats["bytes_held"] == 0 and stats["states"] == 0


def test_putting_again_starts_a_new_life() -> None:
    clock = FakeClock()
    store = SwaStore(max_bytes=1 << 20, ttl_s=10, clock=clock)
    store.put(key(1), b"a")
    clock.step(9)
    store.put(key(1), b"b")
    clock.step(9)
    state = store.get(key(1))
    assert state is not None and state.data == b"b"
    assert store.bytes_held == 1


def test_lru_evicts_the_least_recently_used_under_the_byte_bound() -> None:
    store = SwaStore(max_bytes=300, ttl_s=60, clock=FakeClock())
    for i in range(3):
        store.put(key(i), bytes([i]) * 100)
    assert store.get(key(0)) is not None  # 0 is now more recent than 1
    store.put(key(3), b"z" * 100)
    assert store.get(key(1)) is None
    assert store.get(key(0)) is not None and store.get(key(2)) is not None
    assert store.stats()["evictions"] == 1
    assert store.bytes_held == 300


def test_a_state_larger_than_the_bound_is_refused_and_evicts_nothing() -> None:
    store = SwaStore(max_bytes=100, clock=FakeClock())
    store.put(key(1), b"a" * 60)
    assert store.put(key(2), b"b" * 101) is None
    assert store.get(key(1)) is not None
    assert store.stats()["refused"] == 1


def test_a_state_serves_only_its_exact_position_and_namespace() -> None:
    store = SwaStore(max_bytes=1 << 20, clock=FakeClock())
    store.put(key(7, position=256), b"state")
    assert store.get(key(7, position=255)) is None
    assert store.get(key(7, position=257)) is None
    assert store.get(key(7, position=256, ns=b"\x02" * 8)) is None
    got = store.get(key(7, position=256))
    assert got is not None and got.digest == state_digest(b"state")


def test_expire_sweeps_everything_expired() -> None:
    clock = FakeClock()
    store = SwaStore(max_bytes=1 << 20, ttl_s=5, clock=clock)
    for i in range(10):
        store.put(key(i), b"s" * 10)
        clock.step(1)
    store.expire()  # t=10: the states put at t=0..5 have expired
    assert store.stats()["expiries"] == 6
    assert len(store) == 4 and store.bytes_held == 40
    assert [k for k, _ in store.live()] == [key(i) for i in range(6, 10)]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ArgumentError, match="max_bytes"):
        SwaStore(max_bytes=0)
    with pytest.raises(ArgumentError, match="ttl_s"):
        SwaStore(max_bytes=10, ttl_s=0)
    with pytest.raises(ArgumentError, match="StateKey"):
        SwaStore(max_bytes=10).put(b"not a key", b"x")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- store, by property


class StoreMachine(RuleBasedStateMachine):
    """The store against a model of what it may serve: a dict of (data, expiry)."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.max_bytes = 1000
        self.store = SwaStore(max_bytes=self.max_bytes, ttl_s=50, clock=self.clock)
        self.ever: dict[StateKey, bytes] = {}
        self.gone: set[StateKey] = set()

    keys = st.builds(
        key, st.integers(0, 5), st.sampled_from([64, 128, 192]), st.sampled_from([NS, b"\x09" * 8])
    )

    @rule(k=keys, size=st.integers(1, 600), fill=st.integers(0, 255))
    def put(self, k: StateKey, size: int, fill: int) -> None:
        data = bytes([fill]) * size
        before = {kk for kk, _ in self.store.live()}
        state = self.store.put(k, data)
        assert state is not None  # every size here fits the bound
        self.ever[k] = data
        self.gone.discard(k)
        after = {kk for kk, _ in self.store.live()}
        self.gone |= before - after - {k}

    @rule(k=keys)
    def get(self, k: StateKey) -> None:
        state = self.store.get(k)
        if state is None:
            return
        # Never served: a state never put, evicted or expired, or another key's bytes.
        assert k in self.ever and k not in self.gone
        assert state.data == self.ever[k]
        assert state.expiry > self.clock.now
        assert state.digest == state_digest(state.data)

    @rule(seconds=st.floats(0, 30))
    def wait(self, seconds: float) -> None:
        for k, state in self.store.live():
            if state.expiry <= self.clock.now + seconds:
                self.gone.add(k)
        self.clock.step(seconds)

    @precondition(lambda self: len(self.store) > 0)
    @rule()
    def sweep(self) -> None:
        self.store.expire()
        assert all(s.expiry > self.clock.now for _, s in self.store.live())

    @invariant()
    def bytes_never_exceed_the_bound(self) -> None:
        live = sum(len(s.data) for _, s in self.store.live())
        assert self.store.bytes_held <= self.max_bytes
        assert live <= self.store.bytes_held


TestStoreProperties = StoreMachine.TestCase
TestStoreProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------- config


def test_config_layers_toml_env_and_overrides(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    from kvcache.errors import ConfigError
    from kvcache.swa_local import SwaConfig

    path = Path(str(tmp_path)) / "swa.toml"
    path.write_text('[swa]\nmax_bytes = "64MiB"\nttl_s = 120\nlisten = "tcp://0.0.0.0:7100"\n')
    monkeypatch.setenv("KVCACHE_SWA_TTL_S", "90")
    config = SwaConfig.load(path, overrides={"advertise": "tcp://10.1.2.3:7100"})
    assert config.max_bytes == 64 << 20
    assert config.ttl_s == 90.0  # the environment beats the file
    assert config.advertise == "tcp://10.1.2.3:7100"
    for bad in ({"ttl_s": 0}, {"listen": "10.0.0.1:7"}, {"directory_replicas": 0}, {"nope": 1}):
        with pytest.raises(ConfigError):
            SwaConfig.load(overrides=bad)
