"""Multi-day traces of agent and chat traffic, for the 7-days-versus-3-days question.

The shipped traces span minutes; whether chat needs 7 days or 3 is decided by
what comes back after days. This generator writes Mooncake-format requests
(``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``,
``traffic_class``) from a seeded, documented reuse model:

* **Sessions** of each class start as a Poisson process whose rate follows the
  day: ``rate × (1 + diurnal × sin(2π (t − 6 h) / 24 h))``, peaking at noon.
* **A shared prefix.** Each session starts with one of ``system_prompts``
  system prompts (``system_blocks`` blocks each), drawn Zipf(1.1): a few
  prompts serve most sessions, and their blocks are reread all the time.
* **Turns.** Every turn resends the whole history (prefix, every earlier
  turn's input and output) plus new input, so a turn's leading blocks are its
  previous turn's. Agent sessions have many turns (geometric, mean
  ``agent_turns``) seconds apart (exponential, mean ``agent_gap_s``) and grow
  fast (tool outputs, ``agent_new_blocks`` new blocks a turn); chat sessions
  have few turns (mean ``chat_turns``) minutes apart (mean ``chat_gap_s``).
* **Returns after days.** When a session ends, it comes back with probability
  ``chat_return`` (chat) or ``agent_return`` (agent) after a delay drawn
  log-uniformly from ``return_min_s`` to ``chat_return_max_s`` (chat: up to 10
  days) or ``agent_return_max_s`` (agent: up to 2 days), and continues where it
  stopped (same history). This tail of late returns is what a 7-day chat TTL
  keeps and a 3-day one loses; it is why the reference kept chat 7 days
  (cutting it to 3 days cost 0.5–1 point of hit rate there).

Block ids are chained like Mooncake's (a block's id names it and everything
before it), so equal ids mean equal prefixes. Deterministic for a seed.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from kvcache.errors import ConfigError
from kvcache.workload import TRACE_BLOCK_TOKENS, Request

__all__ = ["TraceModel", "generate_trace", "write_trace"]

DAY_S = 86_400


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceModel:
    """The reuse model's parameters (see the module docstring); rates are sessions/hour."""

    days: float = 7.0
    seed: int = 1
    agent_rate: float = 6.0
    chat_rate: float = 12.0
    diurnal: float = 0.5
    system_prompts: int = 50
    system_blocks: int = 4
    agent_turns: float = 12.0
    agent_gap_s: float = 20.0
    agent_new_blocks: int = 2
    chat_turns: float = 4.0
    chat_gap_s: float = 180.0
    chat_new_blocks: int = 3
    chat_return: float = 0.6
    agent_return: float = 0.1
    return_min_s: float = 3600.0
    chat_return_max_s: float = 10 * DAY_S
    agent_return_max_s: float = 2 * DAY_S
    max_blocks: int = 240

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"trace model: {f.name} must be a finite number, got {value!r}")
        if self.seed < 0:
            raise ConfigError(f"trace model: seed must be >= 0, got {self.seed!r}")
        for name in ("days", "agent_turns", "chat_turns", "agent_gap_s", "chat_gap_s",
                     "return_min_s", "chat_return_max_s", "agent_return_max_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ConfigError(f"trace model: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("chat_return", "agent_return", "diurnal"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(
                    f"trace model: {name} must be in 0..1, got {getattr(self, name)!r}"
                )
        if self.agent_rate < 0 or self.chat_rate < 0 or self.agent_rate + self.chat_rate <= 0:
            raise ConfigError("trace model: session rates must be >= 0 and not both 0")


@dataclass
class _Session:
    cls: str
    ids: list[int]
    turns_left: int
    returned: bool = False


def generate_trace(model: TraceModel) -> Iterator[Request]:
    """The requests of ``model``, in time order."""
    rng = np.random.default_rng(model.seed)
    end_s = model.days * DAY_S
    next_id = [1]

    def new_ids(count: int) -> list[int]:
        out = list(range(next_id[0], next_id[0] + count))
        next_id[0] += count
        return out

    prompts = [new_ids(model.system_blocks) for _ in range(model.system_prompts)]
    weights = 1.0 / np.arange(1, model.system_prompts + 1) ** 1.1
    weights /= weights.sum()
    events: list[tuple[float, int, _Session]] = []
    order = 0
    for cls, rate in (("agent", model.agent_rate), ("chat", model.chat_rate)):
        if rate <= 0:
            continue
        peak = rate * (1 + model.diurnal) / 3600  # thinning of a nonhomogeneous Poisson
        t = 0.0
        while True:
            t += float(rng.exponential(1 / peak))
            if t >= end_s:
                break
            level = 1 + model.diurnal * math.sin(2 * math.pi * (t - 6 * 3600) / DAY_S)
            if rng.random() * (1 + model.diurnal) > level:
                continue
            mean_turns = model.agent_turns if cls == "agent" else model.chat_turns
            prefix = prompts[int(rng.choice(model.system_prompts, p=weights))]
            session = _Session(cls, list(prefix), int(rng.geometric(1 / mean_turns)))
            heapq.heappush(events, (t, order, session))
            order += 1
    while events:
        t, _, s = heapq.heappop(events)
        agent = s.cls == "agent"
        s.ids += new_ids(model.agent_new_blocks if agent else model.chat_new_blocks)
        s.ids = s.ids[: model.max_blocks]
        extra = int(rng.integers(1, TRACE_BLOCK_TOKENS))  # a partial last block
        yield Request(
            timestamp_ms=int(t * 1000),
            input_length=len(s.ids) * TRACE_BLOCK_TOKENS + extra,
            output_length=int(rng.integers(50, 500)),
            hash_ids=(*s.ids, new_ids(1)[0]),
            traffic_class=s.cls,
        )
        s.turns_left -= 1
        if s.turns_left > 0:
            gap = float(rng.exponential(model.agent_gap_s if agent else model.chat_gap_s))
        elif rng.random() < (model.agent_return if agent else model.chat_return):
            high = model.agent_return_max_s if agent else model.chat_return_max_s
            gap = math.exp(rng.uniform(math.log(model.return_min_s), math.log(high)))
            mean_turns = model.agent_turns if agent else model.chat_turns
            s.turns_left = int(rng.geometric(1 / mean_turns))
        else:
            continue
        if t + gap < end_s and len(s.ids) < model.max_blocks:
            order += 1
            heapq.heappush(events, (t + gap, order, s))


def write_trace(requests: Iterator[Request], path: Path) -> int:
    """Write ``requests`` as Mooncake JSONL to ``path``; returns how many."""
    n = 0
    try:
        out = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise ConfigError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None
    with out:
        for r in requests:
            out.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                  "output_length": r.output_length, "hash_ids": list(r.hash_ids),
                                  "traffic_class": r.traffic_class}) + "\n")  # fmt: skip
            n += 1
    return n
