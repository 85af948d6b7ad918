"""The scheduler half's plan of the vLLM connector, without vLLM and without I/O.

What the scheduler half sends the worker halves each step (:class:`StepPlan`: loads
before the forward pass, saves and states after it) and the book it keeps to build it
(:class:`SchedulerBook`: each live request's prompt and blocks, per KV cache group).

- One kvcache block is one vLLM block (``block_size`` tokens, every layer of the
  store's group); only full blocks of the prompt are stored, and a hit is offered
  only up to the last full block before the prompt's last token, because vLLM must
  compute at least one token of every prompt.
- A request whose load failed saves nothing in that step (its newly computed KV sits
  on top of KV that never arrived); blocks that came from the store are not saved
  again, also when vLLM replays their last tokens (bounded replay), until a load fails.
- Hybrid models (:mod:`kvcache.engine.hybrid`): the book tracks the sliding-window and
  ring groups' blocks too, a load may carry the state that fills them
  (:attr:`LoadSpec.swa`), and a step may take states (:attr:`StepPlan.swa_saves`).

Tested without vLLM (``tests/test_engine_vllm_unit.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvcache.engine.hybrid import HybridLayout, SwaLoadSpec, SwaSaveSpec, window_ids
from kvcache.errors import ConfigError
from kvcache.keys import TokenArray, as_token_array
from kvcache.retention.decide import Hint

__all__ = [
    "BlockSpan",
    "CachedReq",
    "LoadSpec",
    "NewReq",
    "SaveSpec",
    "SchedulerBook",
    "StepPlan",
    "external_tokens",
    "loadable_blocks",
]


def loadable_blocks(*, prompt_tokens: int, num_tokens: int, block_size: int) -> int:
    """How many leading prompt blocks may come from the store.

    Only full prompt blocks are stored, and vLLM must compute at least one
    token itself, so a hit ends at the last full block before token
    ``num_tokens - 1`` (``num_tokens`` counts output tokens of a resumed request too).
    """
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    return max(0, min(prompt_tokens, num_tokens - 1)) // block_size


def external_tokens(*, hit_blocks: int, local_tokens: int, loadable: int, block_size: int) -> int:
    """Tokens to load beyond the ``local_tokens`` vLLM already has (block-aligned)."""
    local_blocks = local_tokens // block_size
    usable = min(hit_blocks, loadable)
    return max(0, usable - local_blocks) * block_size


@dataclass(frozen=True, slots=True)
class BlockSpan:
    """Prompt blocks ``first_block ..`` of request ``req_id`` and their vLLM blocks ``block_ids``.

    ``tokens`` holds exactly the prompt tokens up to the last block covered:
    block keys chain over everything before them.
    """

    req_id: str
    tokens: TokenArray
    first_block: int
    block_ids: tuple[int, ...]

    @property
    def end_block(self) -> int:
        """One past the last prompt block this span covers."""
        return self.first_block + len(self.block_ids)


@dataclass(frozen=True, slots=True)
class LoadSpec(BlockSpan):
    """Load these blocks from the store into vLLM's blocks: before the forward pass, or
    (``asynchronous``) in the background while the request waits for them. For a hybrid
    model, ``swa`` fills the sliding-window groups from a state; the load succeeds only
    when both arrive."""

    asynchronous: bool = False
    swa: SwaLoadSpec | None = None


@dataclass(frozen=True, slots=True)
class SaveSpec(BlockSpan):
    """Save these blocks from vLLM's blocks into the store after the forward pass."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the worker half does in one engine step: loads before, saves after the forward."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    #: Tokens the engine computes in this step (all requests): the worker times prefill-sized
    #: steps so the scheduler learns the engine's prefill rate (FetchPlanner.record_step).
    step_tokens: int = 0
    #: Sliding-window states to take after the forward pass (hybrid models).
    swa_saves: tuple[SwaSaveSpec, ...] = ()
    #: Retention hints of this step's requests that have one (request id -> hint).
    hints: Mapping[str, Hint] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NewReq:
    """A request scheduled for the first time (vLLM's NewRequestData, reduced).

    ``block_ids`` are the full-attention group's; ``swa_block_ids`` each
    sliding-window group's (hybrid models).
    """

    req_id: str
    prompt: Sequence[int] | None
    block_ids: Sequence[int]
    num_computed_tokens: int
    swa_block_ids: Sequence[Sequence[int]] = ()


@dataclass(frozen=True, slots=True)
class CachedReq:
    """A request scheduled before (vLLM's CachedRequestData, one row)."""

    req_id: str
    resumed: bool
    new_block_ids: Sequence[int] | None
    num_computed_tokens: int
    new_swa_block_ids: Sequence[Sequence[int]] | None = None


@dataclass
class _Tracked:
    tokens: TokenArray
    block_ids: list[int] = field(default_factory=list)
    swa_ids: list[list[int]] = field(default_factory=list)
    #: Whether this request's state was taken (once per scheduling, not again per step).
    swa_taken: bool = False
    #: Prompt blocks that came from the store (or vLLM's cache) at allocation: never saved
    #: again, also when vLLM replays their last tokens (bounded replay leaves them as stored).
    loaded_blocks: int = 0


class SchedulerBook:
    """The scheduler half's state: each live request's prompt and blocks, and planned loads.

    vLLM sends a request's full block list when it is first scheduled (or
    resumed after preemption) and only the new blocks afterwards; the book
    keeps the list so each step's plan can name the blocks it touches. With a
    ``hybrid`` layout it keeps each sliding-window group's list as well (block
    ``i`` at index ``i``; vLLM puts the null block where it freed one) and plans
    each request's state in the step that completes it (``hybrid`` module).
    """

    def __init__(
        self,
        *,
        block_size: int,
        load: bool = True,
        save: bool = True,
        hybrid: HybridLayout | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.load = load
        self.save = save
        self.hybrid = hybrid
        self._reqs: dict[str, _Tracked] = {}
        self._pending: dict[str, tuple[int, int]] = {}
        self._async: list[LoadSpec] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def on_alloc(
        self,
        req_id: str,
        prompt: Sequence[int],
        *,
        local_tokens: int,
        external: int,
        block_ids: Sequence[int] | None = None,
        swa: SwaLoadSpec | None = None,
    ) -> None:
        """vLLM allocated blocks for ``req_id``; ``external`` tokens after ``local_tokens`` are to load.

        With ``block_ids`` (the request's blocks, for an asynchronous load) the load
        is planned for the next step whether or not the request is scheduled in it:
        vLLM schedules it only once the load has finished. ``swa`` (hybrid models,
        asynchronous loads only) fills the sliding-window groups.
        """
        if not self.load or external <= 0:
            self._pending.pop(req_id, None)
            return
        b = self.block_size
        if local_tokens % b or external % b:
            raise ConfigError(
                f"request {req_id}: local {local_tokens} and external {external} tokens must be "
                f"multiples of the block size {b}"
            )
        first, end = local_tokens // b, (local_tokens + external) // b
        tracked = self._reqs.setdefault(req_id, _Tracked(as_token_array(prompt)))
        if self.hybrid is not None and self.hybrid.replay_tokens:
            # Bounded replay recomputes loaded blocks' last tokens: do not save them again.
            # (Elsewhere vLLM recomputes loaded blocks only after a failed load, reported per
            # block, and those recomputed blocks must be stored again.)
            tracked.loaded_blocks = end
        if block_ids is None:
            if swa is not None:
                raise ConfigError(f"request {req_id}: a state is loaded only asynchronously")
            self._pending[req_id] = (first, end)
            return
        if end > len(block_ids):
            raise ConfigError(
                f"request {req_id}: a load of blocks {first}..{end - 1} but vLLM gave only "
                f"{len(block_ids)} blocks"
            )
        tracked.block_ids = list(block_ids)
        self._async.append(
            LoadSpec(
                req_id,
                tracked.tokens[: end * b],
                first,
                tuple(block_ids[first:end]),
                asynchronous=True,
                swa=swa,
            )
        )

    def on_load_failed(self, req_id: str) -> None:
        """``req_id``'s load failed: vLLM recomputes it, and its blocks are saved again."""
        tracked = self._reqs.get(req_id)
        if tracked is not None:
            tracked.loaded_blocks = 0

    def on_finished(self, req_id: str) -> None:
        """Forget a finished or aborted request."""
        self._reqs.pop(req_id, None)
        self._pending.pop(req_id, None)

    def plan_step(
        self,
        new: Iterable[NewReq],
        cached: Iterable[CachedReq],
        scheduled: Mapping[str, int],
        spec_tokens: Mapping[str, int] | None = None,
    ) -> StepPlan:
        """This step's loads and saves; ``scheduled`` is tokens per request, ``spec_tokens``
        the speculative tokens among them (their KV may be rejected, so never saved)."""
        spec_tokens = spec_tokens or {}
        begins: dict[str, int] = {}
        for r in new:
            if r.prompt is None:  # prompt embeddings: no token ids to key on
                self.on_finished(r.req_id)
                continue
            tracked = self._reqs.get(r.req_id)
            if tracked is None:
                tracked = self._reqs[r.req_id] = _Tracked(as_token_array(r.prompt))
            tracked.block_ids = list(r.block_ids)
            tracked.swa_ids = [list(ids) for ids in r.swa_block_ids]
            tracked.swa_taken = False
            begins[r.req_id] = r.num_computed_tokens
        for c in cached:
            tracked = self._reqs.get(c.req_id)
            if tracked is None:
                continue
            if c.resumed:
                tracked.block_ids = list(c.new_block_ids or ())
                tracked.swa_ids = [list(ids) for ids in c.new_swa_block_ids or ()]
                tracked.swa_taken = False
            else:
                if c.new_block_ids:
                    tracked.block_ids.extend(c.new_block_ids)
                for group_ids, added in zip(
                    tracked.swa_ids, c.new_swa_block_ids or (), strict=False
                ):
                    group_ids.extend(added)
            begins[c.req_id] = c.num_computed_tokens
        loads, self._async = list(self._async), []
        for req_id, (first, end) in list(self._pending.items()):
            tracked = self._reqs.get(req_id)
            if tracked is None or req_id not in begins:
                continue  # not scheduled this step: keep the plan for when it is
            del self._pending[req_id]
            if end > len(tracked.block_ids):
                raise ConfigError(
                    f"request {req_id}: a load of blocks {first}..{end - 1} but vLLM gave only "
                    f"{len(tracked.block_ids)} blocks"
                )
            loads.append(
                LoadSpec(
                    req_id,
                    tracked.tokens[: end * self.block_size],
                    first,
                    tuple(tracked.block_ids[first:end]),
                )
            )
        saves = []
        swa_saves = []
        if self.save:
            for req_id, begin in begins.items():
                tracked = self._reqs[req_id]
                real = scheduled.get(req_id, 0) - spec_tokens.get(req_id, 0)
                first, stop = self._completed(begin, begin + real, tracked)
                if stop > first:
                    saves.append(
                        SaveSpec(
                            req_id,
                            tracked.tokens[: stop * self.block_size],
                            first,
                            tuple(tracked.block_ids[first:stop]),
                        )
                    )
                state = self._state(req_id, begin, begin + real, tracked)
                if state is not None:
                    swa_saves.append(state)
        return StepPlan(
            tuple(loads),
            tuple(saves),
            step_tokens=sum(scheduled.values()),
            swa_saves=tuple(swa_saves),
        )

    def _state(self, req_id: str, begin: int, end: int, tracked: _Tracked) -> SwaSaveSpec | None:
        """The state to take after this step: at the end of the prompt's last full block,
        in the step whose tokens complete it, while its window's blocks are all held."""
        layout = self.hybrid
        if layout is None or tracked.swa_taken:
            return None
        position = (len(tracked.tokens) // self.block_size) * self.block_size
        if not position or not begin <= position <= end:
            return None
        first, stop = layout.window_blocks(position)
        ids = window_ids(tracked.swa_ids, first, stop, rings=len(layout.ring_groups))
        if ids is None or len(ids) != len(layout.state_groups):
            return None
        tracked.swa_taken = True
        return SwaSaveSpec(req_id, tracked.tokens[:position], position, first, ids)

    def _completed(self, begin: int, end: int, tracked: _Tracked) -> tuple[int, int]:
        """Prompt blocks that become complete when tokens ``begin..end`` are computed."""
        b = self.block_size
        prompt_blocks = len(tracked.tokens) // b
        stop = min(end // b, prompt_blocks, len(tracked.block_ids))
        return max(begin // b, tracked.loaded_blocks), stop
