"""Request workloads for replaying against a cluster: the Mooncake trace format and
a seeded generator of multi-turn agent and chat conversations. Pure code.

A request is an arrival time, an input length in tokens, and one *hash id* per
512-token block of its input (the last block may be partial). A store whose blocks
are smaller (the reference layout's 128 tokens) sees 4 blocks per hash id: tokens
are synthesised per hash id, so the keys of those blocks chain exactly as the trace's. Equal ids at the
same position mean the same prefix, so tokens synthesised from the ids give the
same block keys exactly when the real prompts would share a prefix. KV payload
bytes are synthesised from each block's key, so every loaded byte can be checked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvcache.errors import ConfigError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.shard import check_class_name

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "Request",
    "WorkloadSpec",
    "block_identities",
    "generate_workload",
    "ideal_hit_blocks",
    "payload_for_key",
    "read_trace",
    "replay_keys",
    "replay_namespace",
    "tokens_for",
]

#: Tokens per hash id in the Mooncake trace format.
TRACE_BLOCK_TOKENS = 512
_VOCAB = 128_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One request of a workload."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    traffic_class: str = "chat"

    def __post_init__(self) -> None:
        if self.input_length < 0:
            raise ConfigError(
                f"request at {self.timestamp_ms} ms: input_length must be >= 0, "
                f"got {self.input_length}"
            )
        need = math.ceil(self.input_length / TRACE_BLOCK_TOKENS)
        if len(self.hash_ids) != need:
            raise ConfigError(
                f"request at {self.timestamp_ms} ms: {self.input_length} tokens need {need} "
                f"hash ids, got {len(self.hash_ids)}"
            )
        check_class_name(self.traffic_class)

    @property
    def full_blocks(self) -> int:
        """Blocks of this request that are complete (cacheable)."""
        return self.input_length // TRACE_BLOCK_TOKENS


#: Trace timestamps (ms) past this are refused: no trace spans 285,000 years, and float
#: arithmetic on them stays exact below it.
_MAX_TRACE_MS = 2**53


def read_trace(path: str | Path, *, traffic_class: str = "chat") -> Iterator[Request]:
    """Requests of a Mooncake FAST'25 JSONL trace (timestamp, input_length, output_length, hash_ids)."""
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise ConfigError(f"cannot open trace {path}: {exc}") from None
    with handle:
        lineno = 0
        while True:
            try:
                line = handle.readline()
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{path}:{lineno + 1}: not a trace: not UTF-8 text ({exc.reason})"
                ) from None
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                request = Request(
                    timestamp_ms=int(raw["timestamp"]),
                    input_length=int(raw["input_length"]),
                    output_length=int(raw.get("output_length", 0)),
                    hash_ids=tuple(int(h) for h in raw["hash_ids"]),
                    traffic_class=str(raw.get("traffic_class", traffic_class)),
                )
                if not 0 <= request.timestamp_ms < _MAX_TRACE_MS:
                    raise ValueError("timestamp out of range (0 .. 2**53 ms)")
                if request.input_length < 0 or request.output_length < 0:
                    raise ValueError("lengths must be >= 0")
                if any(not 0 <= h < 2**63 for h in request.hash_ids):
                    raise ValueError("hash ids must be 0 .. 2**63 - 1")
            except (ValueError, KeyError, TypeError, OverflowError, ConfigError) as exc:
                raise ConfigError(f"{path}:{lineno}: not a trace record: {exc}") from None
            yield request


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def tokens_for(request: Request) -> npt.NDArray[np.uint32]:
    """Deterministic token ids for a request: block j's tokens depend only on hash_ids[j]."""
    ids = np.array(request.hash_ids, dtype=np.uint64)
    pos = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)
    grid = _mix(ids[:, None] * np.uint64(TRACE_BLOCK_TOKENS) + pos[None, :] + np.uint64(1))
    tokens = (grid % np.uint64(_VOCAB)).astype(np.uint32).reshape(-1)
    return tokens[: request.input_length]


_PAYLOAD_BASE: dict[int, npt.NDArray[np.uint8]] = {}


def payload_for_key(key: bytes, payload_len: int) -> npt.NDArray[np.uint8]:
    """Deterministic KV bytes for a block key: a fixed random pattern XOR the key, tiled.

    Every byte depends on the key, so bytes of another block never pass for these.
    """
    base = _PAYLOAD_BASE.get(payload_len)
    if base is None:
        base = np.random.default_rng(20261130).integers(0, 256, payload_len, dtype=np.uint8)
        _PAYLOAD_BASE[payload_len] = base
    reps = -(-payload_len // len(key))
    tiled = np.frombuffer(key * reps, np.uint8)[:payload_len]
    return np.bitwise_xor(base, tiled)


def block_identities(request: Request, tokens_per_block: int) -> list[tuple[int, ...]]:
    """What names each full ``tokens_per_block``-token block of a request: the trace's
    hash id and the block's place inside it (a 512-token hash id holds 4 blocks of 128),
    or the run of hash ids a larger block covers."""
    per = TRACE_BLOCK_TOKENS
    if per % tokens_per_block == 0:
        inner = per // tokens_per_block
        count = request.input_length // tokens_per_block
        return [(request.hash_ids[b // inner], b % inner) for b in range(count)]
    if tokens_per_block % per == 0:
        outer = tokens_per_block // per
        count = request.input_length // tokens_per_block
        return [tuple(request.hash_ids[b * outer : (b + 1) * outer]) for b in range(count)]
    raise ConfigError(
        f"tokens_per_block={tokens_per_block} must divide the trace's {per}-token blocks "
        "or be a multiple of them"
    )


def ideal_hit_blocks(
    requests: Iterable[Request], *, tokens_per_block: int = TRACE_BLOCK_TOKENS
) -> list[int]:
    """Per request, the leading full blocks an infinite cache would have (seen before).

    Blocks are ``tokens_per_block`` tokens: with the reference layout's 128, each trace
    hash id stands for 4 blocks, and a request's last, partial hash id still gives its
    full 128-token blocks (which hit when a later request repeats that id).
    """
    seen: set[tuple[int, ...]] = set()
    out = []
    for req in requests:
        full = block_identities(req, tokens_per_block)
        hit = 0
        for ident in full:
            if ident not in seen:
                break
            hit += 1
        out.append(hit)
        seen.update(full)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadSpec:
    """Shape of a generated workload (defaults: about a minute of replay on a laptop)."""

    seed: int = 7
    conversations: int = 24
    agent_fraction: float = 0.5
    shared_prefix_tokens: int = 4096
    agent_turns: tuple[int, int] = (4, 10)
    chat_turns: tuple[int, int] = (2, 6)
    agent_first_tokens: tuple[int, int] = (6000, 16000)
    chat_first_tokens: tuple[int, int] = (1000, 6000)
    agent_growth_tokens: tuple[int, int] = (800, 4000)
    chat_growth_tokens: tuple[int, int] = (200, 1500)
    agent_gap_ms: tuple[int, int] = (2_000, 15_000)
    chat_gap_ms: tuple[int, int] = (20_000, 180_000)
    span_ms: int = 600_000


def generate_workload(spec: WorkloadSpec = WorkloadSpec()) -> list[Request]:
    """A seeded multi-turn workload of agent and chat conversations, in arrival order.

    Each turn resends the whole history plus new tokens. Agent turns come fast
    and grow by tool results; chat turns come slower. Conversations of a class
    share a system prompt, so first turns hit too.
    """
    rng = np.random.default_rng(spec.seed)
    next_id = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    shared_blocks = spec.shared_prefix_tokens // TRACE_BLOCK_TOKENS
    system = {"agent": fresh(shared_blocks), "chat": fresh(shared_blocks)}
    requests: list[Request] = []
    for _ in range(spec.conversations):
        cls = "agent" if rng.random() < spec.agent_fraction else "chat"
        agent = cls == "agent"
        turns = int(rng.integers(*(spec.agent_turns if agent else spec.chat_turns), endpoint=True))
        length = shared_blocks * TRACE_BLOCK_TOKENS + int(
            rng.integers(*(spec.agent_first_tokens if agent else spec.chat_first_tokens))
        )
        full_ids = list(system[cls])
        t = int(rng.integers(0, spec.span_ms))
        for _turn in range(turns):
            full = length // TRACE_BLOCK_TOKENS
            if full > len(full_ids):
                full_ids += fresh(full - len(full_ids))
            tail = fresh(1) if length % TRACE_BLOCK_TOKENS else []
            output = int(rng.integers(50, 400 if agent else 800))
            requests.append(
                Request(
                    timestamp_ms=t,
                    input_length=length,
                    output_length=output,
                    hash_ids=tuple(full_ids[:full] + tail),
                    traffic_class=cls,
                )
            )
            # The partial tail block's content is kept: it becomes the start of the next turn's block.
            if tail:
                full_ids = full_ids[:full]
            grow = spec.agent_growth_tokens if agent else spec.chat_growth_tokens
            length += output + int(rng.integers(*grow))
            t += int(rng.integers(*(spec.agent_gap_ms if agent else spec.chat_gap_ms)))
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def replay_namespace(block_bytes: int) -> Namespace:
    """The namespace a trace is replayed under at ``block_bytes`` a 512-token block (bf16,
    one layer group a block): the keys of :func:`replay_keys`, what ``kvcache retention
    simulate --replay-keys`` orders expiry ties by, as the daemons do."""
    if block_bytes < 1 or block_bytes % TRACE_BLOCK_TOKENS:
        raise ConfigError(
            f"a replayed block is {TRACE_BLOCK_TOKENS} tokens: block bytes must be a positive "
            f"multiple of {TRACE_BLOCK_TOKENS}, got {block_bytes}"
        )
    layout = KVLayout(tokens_per_block=TRACE_BLOCK_TOKENS,
                      bytes_per_token=block_bytes // TRACE_BLOCK_TOKENS, dtype=DType.BFLOAT16,
                      layers_in_block=1)  # fmt: skip
    return Namespace(model="trace-replay", revision="1", layout=layout)


def replay_keys(requests: Iterable[Request], namespace: Namespace) -> dict[int, bytes]:
    """The block key each hash id of ``requests`` gets when the trace is replayed under
    ``namespace`` (tokens from :func:`tokens_for`): one entry per id of a full block."""
    keys: dict[int, bytes] = {}
    for req in requests:
        ids = req.hash_ids[: req.full_blocks]
        if all(i in keys for i in ids):
            continue
        for i, key in zip(ids, block_keys(namespace, tokens_for(req), max_blocks=len(ids)),
                          strict=True):  # fmt: skip
            keys.setdefault(i, bytes(key))
    return keys
