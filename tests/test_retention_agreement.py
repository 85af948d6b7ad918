"""The trace simulator predicts what a daemon's store does, block by block.

Both apply :mod:`kvcache.retention.decide`; these tests replay random traces
through a real :class:`ShardStore` (LMDB in a temp dir, stepped clock) the way
the client drives it (HAS, GET the leading hits, PUT every block after them
with a stripe of the request's own, HAS and TOUCH the ones that came back
CONFLICT, background work after each PUT) and through
:func:`simulate`, and require the same live blocks with the same expiry and
class after every request, the same hits, and the same evictions.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import FakeClock, block_records, get_items, keys_items, put_items

from kvcache.credentials import tenant_id
from kvcache.retention import RetentionPolicy
from kvcache.retention.simulate import simulate
from kvcache.server.store import ShardStore
from kvcache.wire import Op, Status
from kvcache.workload import Request

T = tenant_id("default")
T0 = 1_700_000_000.0
POLICY = RetentionPolicy(
    classes={"agent": 300, "chat": 900, "default": 300}, default_class="default"
)


def key(block: int) -> bytes:
    return block.to_bytes(16, "big")  # the simulator's tie_key: ties evict alike


class StoreReplay:
    """Drives one store as the client would for each request; one shard (index 0) a block."""

    def __init__(self, store: ShardStore, clock: FakeClock) -> None:
        self.store, self.clock = store, clock
        self.hit_tokens = 0
        self.record_len = 0
        self.requests = 0

    def background(self) -> None:
        for _ in range(1000):
            if not self.store.maintain():
                return
        raise AssertionError("maintain() never settled")

    def request(self, req: Request) -> None:
        self.clock.now = req.timestamp_ms / 1000
        self.requests += 1
        self.background()  # the daemon's sweeper has run up to now
        full = req.hash_ids[: req.full_blocks]
        held = self.has(list(dict.fromkeys(full)))
        run = 0
        for b in full:
            if b not in held:
                break
            run += 1
        self.hit_tokens += min(run * 512, req.input_length)
        hits = list(dict.fromkeys(full[:run]))
        if hits:
            result = self.store.get(T, get_items([(key(b), 0) for b in hits]), req.traffic_class)  # type: ignore[arg-type]
            assert result.items["status"].tolist() == [Status.OK] * len(hits)
            result.release()
        # The client stores every block after the leading run, each write a stripe of its
        # own: a live block comes back CONFLICT; the client then asks (HAS), touches the
        # ones still held and writes the ones the drain took meanwhile.
        conflicted = self.put(list(dict.fromkeys(full[run:])), req.traffic_class)
        self.background()
        if conflicted:
            still = self.has(conflicted)
            present = [b for b in conflicted if b in still]
            if present:
                self.store.touch(
                    T, keys_items(Op.TOUCH, [key(b) for b in present]), req.traffic_class
                )  # type: ignore[arg-type]
            assert self.put([b for b in conflicted if b not in still], req.traffic_class) == []
            self.background()

    def has(self, blocks: list[int]) -> set[int]:
        if not blocks:
            return set()
        reply = self.store.has(T, keys_items(Op.HAS, [key(b) for b in blocks]))  # type: ignore[arg-type]
        return {blocks[i] for i in reply["ordinal"].tolist()}

    def put(self, blocks: list[int], traffic_class: str) -> list[int]:
        """PUT ``blocks`` (one shard each, this request's stripe); the ones answered CONFLICT."""
        if not blocks:
            return []
        shards = [
            s for b in blocks for s in block_records(key(b), traffic_class=traffic_class,
                                                     indices=[0], body_len=640,
                                                     seed=self.requests)
        ]  # fmt: skip
        self.record_len = len(shards[0][2])
        items, data = put_items(shards)
        status = self.store.put(T, items, data)["status"].tolist()  # type: ignore[arg-type]
        assert set(status) <= {Status.OK, Status.CONFLICT}, status
        return [b for b, st in zip(blocks, status, strict=True) if st == Status.CONFLICT]

    def state(self, blocks: set[int]) -> dict[int, tuple[int, str]]:
        now = self.store.now_ms()
        out = {}
        for b in blocks:
            got = self.store.expiry_of(T, key(b), 0)
            if got is not None and got[0] > now:
                out[b] = got
        return out


def trace_strategy() -> st.SearchStrategy[list[Request]]:
    step = st.integers(0, 400)  # seconds between requests: slides, expiries, ties
    request = st.tuples(
        step,
        st.lists(st.integers(0, 12), min_size=1, max_size=6),
        st.sampled_from(["agent", "chat", "other"]),
    )

    def build(raw: list[tuple[int, list[int], str]]) -> list[Request]:
        out, t = [], T0
        for gap, ids, cls in raw:
            t += gap
            out.append(
                Request(timestamp_ms=int(t * 1000), input_length=512 * len(ids) + 100,
                        output_length=1, hash_ids=(*ids, 99_999), traffic_class=cls)
            )  # fmt: skip
        return out

    return st.lists(request, min_size=1, max_size=25).map(build)


def replay_both(
    tmp: Path, trace: list[Request], *, capacity_blocks: int | None = None, single_class: bool
) -> int:
    if single_class:
        trace = [
            Request(timestamp_ms=r.timestamp_ms, input_length=r.input_length,
                    output_length=1, hash_ids=r.hash_ids, traffic_class="chat")
            for r in trace
        ]  # fmt: skip
    clock = FakeClock(T0)
    probe = block_records(key(0), indices=[0], body_len=640)[0][2]
    options: dict[str, object] = {}
    if capacity_blocks is not None:
        options["capacity_bytes"] = capacity_blocks * len(probe)
    else:
        options["capacity_bytes"] = 64 << 20
    with ShardStore(tmp, clock=clock, policy=POLICY, touch_resolution_s=60.0,
                    sweep_batch=4, **options) as store:  # type: ignore[arg-type]  # fmt: skip
        replay = StoreReplay(store, clock)
        seen: set[int] = set()

        def observe(req: Request, state: Mapping[int, tuple[int, str]]) -> None:
            replay.request(req)
            seen.update(req.hash_ids[: req.full_blocks])
            assert replay.state(seen) == dict(state), f"after the request at {req.timestamp_ms}"

        res = simulate(trace, POLICY, touch_resolution_s=60.0, capacity_blocks=capacity_blocks,
                       observe=observe, tie_key=key)  # fmt: skip
        assert replay.hit_tokens == res.hit_tokens
        assert store.counters["evicted_shards"] == res.evicted_before_ttl
        if capacity_blocks is None:
            assert res.evicted_before_ttl == 0
        return res.evicted_before_ttl


def test_a_full_store_evicts_the_same_blocks_in_both(tmp_path: Path) -> None:
    trace = [
        Request(timestamp_ms=int((T0 + 10 * i) * 1000), input_length=512 * 3, output_length=1,
                hash_ids=(3 * i, 3 * i + 1, 3 * i + 2), traffic_class="chat")
        for i in range(8)
    ]  # fmt: skip
    assert replay_both(tmp_path / "db", trace, capacity_blocks=10, single_class=True) > 0


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(trace=trace_strategy())
def test_simulator_equals_store_without_capacity_limit(tmp_path_factory, trace) -> None:  # type: ignore[no-untyped-def]
    replay_both(tmp_path_factory.mktemp("db"), trace, single_class=False)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(trace=trace_strategy(), capacity=st.sampled_from([10, 20]), one=st.booleans())
def test_simulator_equals_store_under_capacity_pressure(
    tmp_path_factory, trace, capacity, one
) -> None:  # type: ignore[no-untyped-def]
    replay_both(tmp_path_factory.mktemp("db"), trace, capacity_blocks=capacity, single_class=one)


def test_classes_that_expire_in_the_same_second_are_evicted_alike(tmp_path: Path) -> None:
    """A chat write (900 s) and an agent write 600 s later (300 s) expire in the same second:
    under pressure a daemon takes that second partition by partition, in class-name order
    (agent before chat), whatever the keys, and so does the simulator."""

    def at(t: int, ids: list[int], cls: str) -> Request:
        return Request(timestamp_ms=int((T0 + t) * 1000), input_length=512 * len(ids),
                       output_length=1, hash_ids=tuple(ids), traffic_class=cls)  # fmt: skip

    for first, second in (([1, 2, 3, 4], [0, 5, 6, 7]), ([0, 2, 3, 4], [1, 5, 6, 7])):
        trace = [at(0, first, "chat"), at(600, second, "agent"), at(601, [20, 21], "chat")]
        assert replay_both(tmp_path / f"db{first[0]}", trace, capacity_blocks=10,
                           single_class=False) > 0  # fmt: skip


def test_a_short_slide_is_not_written_in_either() -> None:
    # 50 s after a write, a hit would move a 300 s expiry by 50 s < the 60 s resolution.
    reqs = [
        Request(timestamp_ms=0, input_length=512, output_length=1, hash_ids=(1,),
                traffic_class="agent"),
        Request(timestamp_ms=50_000, input_length=512, output_length=1, hash_ids=(1,),
                traffic_class="agent"),
        Request(timestamp_ms=310_000, input_length=512, output_length=1, hash_ids=(1,),
                traffic_class="agent"),
    ]  # fmt: skip
    assert simulate(reqs, POLICY).hit_tokens == 512  # the third request misses
    assert simulate(reqs, POLICY, touch_resolution_s=1).hit_tokens == 1024
