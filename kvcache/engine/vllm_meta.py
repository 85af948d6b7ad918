"""The vLLM connector's decisions, without vLLM and without I/O.

vLLM splits a KV connector in two: a scheduler half (in the engine-core
process) that decides what to load and save, and a worker half (in each
worker process) that moves the bytes. The halves share nothing but the
metadata the scheduler builds each step. Everything here is that planning,
as plain functions and small classes over plain data, so it is tested without
vLLM (``tests/test_engine_vllm_unit.py``); ``kvcache.engine.vllm_connector``
only translates vLLM's objects into these and does the I/O.

Rules this module enforces:

- One kvcache block is one vLLM block (``block_size`` tokens, every layer);
  only full blocks of the prompt are stored, and a hit is offered only up to
  the last full block before the prompt's last token, because vLLM must
  compute at least one token of every prompt.
- The key namespace covers the model, its revision, the KV geometry and
  packing (layout name, heads, head sizes, dtype, quantisation, block size,
  layers) and the tensor-parallel rank, so incompatible KV never shares keys.
- A load that brings back fewer blocks than planned reports every block from
  the first missing one as failed; vLLM then recomputes them. A request whose
  load failed saves nothing in that step (its newly computed KV sits on top of
  KV that never arrived).
- Fetch or recompute, per request: a hit is offered only when loading it is
  predicted to finish before recomputing it would (:class:`FetchPlanner`, from
  running estimates of this worker's load bandwidth and the engine's prefill
  rate), so a slow or degraded store makes the engine recompute, not wait.
- Hybrid models (:mod:`kvcache.engine.hybrid`): the book tracks the
  sliding-window groups' blocks too, a load may carry the state that fills
  them (:attr:`LoadSpec.swa`), and a step may take states (:attr:`StepPlan.swa_saves`).

Settings parsing and namespaces are shared with the SGLang backend
(:mod:`kvcache.engine.settings`).
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.engine.hybrid import HybridLayout, SwaLoadSpec, SwaSaveSpec, window_ids
from kvcache.engine.settings import (
    EngineSettings,
    engine_namespace,
    namespace_dict,
    namespace_from_dict,
    parallel_name,
    split_engine_config,
)
from kvcache.errors import ConfigError
from kvcache.keys import Namespace, TokenArray, as_token_array
from kvcache.layout import DType, KVLayout

__all__ = [
    "CachedReq",
    "ConnectorSettings",
    "ConnectorStats",
    "FetchPlanner",
    "LoadMode",
    "KVGeometry",
    "LoadSpec",
    "MIN_PREFILL_STEP_TOKENS",
    "NewReq",
    "PendingMatches",
    "SaveSpec",
    "SchedulerBook",
    "StepPlan",
    "external_tokens",
    "failed_block_ids",
    "loadable_blocks",
    "make_namespace",
    "namespace_dict",
    "namespace_from_dict",
    "page_ids",
    "parallel_name",
    "split_extra_config",
]

# ---------------------------------------------------------------------- settings


class LoadMode(enum.Enum):
    """When the worker half loads a hit (see ConnectorSettings.load_mode)."""

    ASYNC = "async"
    SYNC = "sync"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings(EngineSettings):
    """The connector's own settings from ``kv_connector_extra_config``.

    The fields every engine adapter shares (cluster, model name, tenant, stats,
    SWA tier) are :class:`~kvcache.engine.settings.EngineSettings`'. A fresh prefix
    lookup may block scheduling for ``match_wait_ms``; after that the
    scheduler is told to ask again next step, and after ``match_deadline_ms``
    the request is treated as a miss. Saves waiting to be written may hold at
    most ``max_pending_save_mb`` of host memory; beyond that new saves are
    dropped (a cache may forget; it must not stall the engine).
    """

    match_wait_ms: float = 20.0
    match_deadline_ms: float = 5000.0
    max_pending_save_mb: int = 256
    #: ``async``: a hit's blocks load while the request waits in WAITING_FOR_REMOTE_KVS and
    #: other requests compute; ``sync``: before the forward pass that needs them.
    load_mode: LoadMode = LoadMode.ASYNC
    #: Offer a hit only when loading it, times this margin, is predicted to take no longer
    #: than recomputing it (see FetchPlanner); 0 offers every hit.
    recompute_margin: float = 1.0
    #: Starting estimates until measured: load bandwidth of this worker (GB/s) and the
    #: engine's prefill rate (tokens/s). Unset: hits are offered until both are measured.
    load_gbps: float | None = None
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        if not (self.match_wait_ms >= 0 and self.match_deadline_ms >= self.match_wait_ms):
            raise ConfigError(
                f"need 0 <= match_wait_ms <= match_deadline_ms, got {self.match_wait_ms} and "
                f"{self.match_deadline_ms}"
            )
        if self.recompute_margin < 0:
            raise ConfigError(f"recompute_margin must be >= 0, got {self.recompute_margin}")
        for name in ("load_gbps", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 when given, got {value}")
        if self.max_pending_save_mb < 1:
            raise ConfigError(f"max_pending_save_mb must be >= 1, got {self.max_pending_save_mb}")


def split_extra_config(
    extra: Mapping[str, Any],
) -> tuple[ConnectorSettings, dict[str, Any], dict[str, Any]]:
    """Split vLLM's extra config into connector settings, ClientConfig overrides and SwaConfig
    overrides (``swa_<field>``); see :func:`kvcache.engine.settings.split_engine_config`.

    Unknown keys are errors that list every known key, so a typo in a
    deployment's config fails at start-up instead of being ignored.
    """
    return split_engine_config(extra, ConnectorSettings, source="kv_connector_extra_config")


# ---------------------------------------------------------------------- namespace


@dataclass(frozen=True, slots=True, kw_only=True)
class KVGeometry:
    """The bytes of one vLLM block, as vLLM's KV cache spec describes them.

    ``page_bytes`` is one layer's share of a block; ``packing`` names how the
    attention backend lays K and V out inside it (layout name, heads, head
    sizes, quantisation), which the bytes alone do not tell.
    """

    block_size: int
    num_layers: int
    page_bytes: int
    dtype: DType
    packing: str
    #: A group whose pages differ in size (DeepSeek V4.1's MLA group, block-outermost):
    #: the bytes of its contiguous span per block, which replace ``num_layers x page_bytes``.
    span_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "page_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        if self.span_bytes is not None and self.span_bytes < 1:
            raise ConfigError(f"KVGeometry.span_bytes must be positive, got {self.span_bytes}")
        if self.payload_bytes % self.block_size:
            raise ConfigError(
                f"a block of {self.payload_bytes} bytes does not split into {self.block_size} "
                "equal tokens; this KV cache (padded pages?) is not supported by the kvcache "
                "connector"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes of one stored block: every layer's page (or the group's span)."""
        if self.span_bytes is not None:
            return self.span_bytes
        return self.num_layers * self.page_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token, every layer."""
        return self.payload_bytes // self.block_size

    def kv_layout(self) -> KVLayout:
        """The kvcache layout of one block (part of the key namespace)."""
        return KVLayout(
            tokens_per_block=self.block_size,
            bytes_per_token=self.payload_bytes // self.block_size,
            dtype=self.dtype,
            layers_in_block=self.num_layers,
        )


def make_namespace(
    *,
    model: str,
    revision: str | None,
    geometry: KVGeometry,
    parallel: str,
    tenant: str = "default",
) -> Namespace:
    """The key namespace of one vLLM worker's KV.

    The backend's packing goes into ``revision`` next to the model revision
    (``docs/spec/hashing.md``: anything that changes the KV bytes must be in a
    namespace field), the byte geometry into ``layout``.
    """
    return engine_namespace(
        engine="vllm",
        model=model,
        revision=revision,
        layout=geometry.kv_layout(),
        packing=geometry.packing,
        parallel=parallel,
        tenant=tenant,
    )


# ---------------------------------------------------------------------- scheduler side


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


#: Steps computing fewer tokens than this are decode-sized and say little about prefill speed.
MIN_PREFILL_STEP_TOKENS = 256


class FetchPlanner:
    """Fetch or recompute: is loading a hit predicted to beat recomputing it?

    Load time is modelled as ``overhead_s + bytes / bandwidth`` and recompute
    time as ``tokens / prefill rate``, each rate a running (exponentially
    weighted) estimate: the bandwidth from this connector's finished loads,
    the prefill rate from the tokens the engine computes per step. A hit is
    offered when ``load time * margin <= recompute time``. Both times grow
    linearly with the hit, so the answer is all of it or nothing: the fixed
    overhead only matters for short hits. Until both rates are known (or
    given as starting estimates), every hit is offered.
    """

    def __init__(
        self,
        *,
        margin: float,
        load_gbps: float | None = None,
        prefill_tokens_per_s: float | None = None,
        overhead_s: float = 0.002,
        weight: float = 0.2,
        min_step_tokens: int = MIN_PREFILL_STEP_TOKENS,
    ) -> None:
        self.margin = margin
        self.load_gbps = load_gbps
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.overhead_s = overhead_s
        self._weight = weight
        self._min_step_tokens = min_step_tokens
        self.fetched = 0
        self.recomputed = 0

    def record_load(self, nbytes: int, seconds: float) -> None:
        """A finished load of ``nbytes`` took ``seconds`` (match to data in place)."""
        if nbytes <= 0 or seconds <= 0:
            return
        gbps = nbytes / seconds / 1e9
        self.load_gbps = _ewma(self.load_gbps, gbps, self._weight)

    def record_step(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` in a step of ``seconds``; decode-sized steps
        (fewer than ``min_step_tokens``) say little about prefill and are skipped."""
        if tokens < self._min_step_tokens or seconds <= 0:
            return
        self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, tokens / seconds, self._weight)

    def predicted(self, tokens: int, bytes_per_token: int) -> tuple[float, float] | None:
        """(load seconds, recompute seconds) of a ``tokens`` hit, or None when unknown."""
        if not self.load_gbps or not self.prefill_tokens_per_s:
            return None
        load_s = self.overhead_s + tokens * bytes_per_token / (self.load_gbps * 1e9)
        return load_s, tokens / self.prefill_tokens_per_s

    def fetch(self, tokens: int, bytes_per_token: int) -> bool:
        """Whether to offer a hit of ``tokens`` (counted in ``fetched`` / ``recomputed``)."""
        times = self.predicted(tokens, bytes_per_token)
        ok = times is None or self.margin == 0 or times[0] * self.margin <= times[1]
        if ok:
            self.fetched += 1
        else:
            self.recomputed += 1
        return ok


def _ewma(current: float | None, sample: float, weight: float) -> float:
    if current is None or not math.isfinite(current):
        return sample
    return (1 - weight) * current + weight * sample


class PendingMatches:
    """Prefix lookups in flight, one per waiting request: vLLM's "ask again" hook.

    ``poll`` starts a lookup the first time a request is asked about and waits
    up to ``wait_s`` for it. If it is not back, the answer is ``None`` (vLLM
    skips the request this step and asks again); once ``deadline_s`` has
    passed since the start the request counts as a miss, so a slow or dead
    store delays a request by at most that long and never stalls the engine.
    """

    def __init__(self, *, wait_s: float, deadline_s: float, clock: Callable[[], float]) -> None:
        self.wait_s = wait_s
        self.deadline_s = deadline_s
        self._clock = clock
        self._inflight: dict[str, tuple[Future[int], float]] = {}
        self.errors = 0
        self.timeouts = 0
        self.deferred = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def poll(self, req_id: str, start: Callable[[], Future[int]]) -> int | None:
        """Hit blocks for ``req_id``, or None for "not known yet, ask again"."""
        entry = self._inflight.get(req_id)
        fresh = entry is None
        if entry is None:
            entry = self._inflight[req_id] = (start(), self._clock())
        future, started = entry
        if fresh and self.wait_s > 0 and not future.done():
            with contextlib.suppress(TimeoutError):
                future.exception(timeout=self.wait_s)
        if future.done():
            try:
                return future.result()
            except Exception:  # the lookup failed: a miss, never a stalled engine
                self.errors += 1
                self._inflight[req_id] = (_done(0), started)
                return 0
        if self._clock() - started >= self.deadline_s:
            self.timeouts += 1
            future.cancel()
            self._inflight[req_id] = (_done(0), started)
            return 0
        self.deferred += 1
        return None

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s lookup (it was scheduled, finished or aborted)."""
        entry = self._inflight.pop(req_id, None)
        if entry is not None:
            entry[0].cancel()


def _done(value: int) -> Future[int]:
    fut: Future[int] = Future()
    fut.set_result(value)
    return fut


# ---------------------------------------------------------------------- worker side


def page_ids(block_ids: Sequence[int], pages_per_block: int) -> npt.NDArray[np.int64]:
    """The engine pages of each vLLM block, shape (blocks, pages_per_block).

    A backend whose kernel pages are smaller than vLLM's block (``pages_per_block``
    > 1) keeps block ``b`` in pages ``b*p .. b*p+p-1``.
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
    out: npt.NDArray[np.int64] = ids * pages_per_block + np.arange(pages_per_block)
    return out


def failed_block_ids(spec: LoadSpec, loaded: int) -> tuple[int, ...]:
    """vLLM blocks to report as failed when only ``loaded`` leading blocks of ``spec`` arrived.

    Everything from the first block that did not arrive is reported, including
    blocks after it that might have loaded: a prefix is only usable whole.
    """
    if not 0 <= loaded <= len(spec.block_ids):
        raise ValueError(f"loaded={loaded} outside 0..{len(spec.block_ids)}")
    return spec.block_ids[loaded:]


# ---------------------------------------------------------------------- stats


@dataclass
class ConnectorStats:
    """Counters one connector process keeps; written to ``stats_dir`` as JSON.

    Scheduler half: ``lookups`` (prefix lookups answered), ``lookup_deferred``
    ("ask again" answers), ``lookup_errors``/``lookup_timeouts`` (treated as
    misses), ``tokens_matched`` (tokens offered to vLLM to load),
    ``requests_matched``. Worker half: ``blocks_loaded``/``tokens_loaded``
    (verified and placed into the engine's cache), ``load_error_blocks``
    (reported to vLLM for recomputation), ``blocks_saved`` (written),
    ``blocks_save_touched`` (already stored), ``blocks_save_failed``,
    ``blocks_save_dropped`` (queue full or shutdown), ``saves_skipped``
    (saves withheld because the same step's load failed), ``save_jobs_queued`` /
    ``save_jobs_done`` (blocks and states handed to the saver thread, and finished
    with, stored or failed: equal when no save is pending), ``async_loads``
    (loads run while their request waited). Scheduler half, fetch or recompute:
    ``fetch_decisions`` (hits offered), ``recompute_decisions`` (hits declined
    because recomputing was predicted faster), ``tokens_recompute_chosen``, and the
    planner's current ``load_gbps_estimate`` and ``prefill_tokens_per_s_estimate``.

    Hybrid models, scheduler half: ``swa_hits`` (hits backed by a worker's state),
    ``swa_tokens_without_state`` (stored tokens not offered because no worker holds
    the state after them). Worker half: ``swa_states_saved`` / ``swa_state_bytes_saved``
    (states taken and held), ``swa_local_hits`` / ``swa_remote_hits`` (states loaded
    from this worker's RAM / fetched from a peer), ``swa_misses`` (states that could
    not be had: the request was recomputed), and ``swa_state_dropped`` (states whose
    window was freed before they could be taken, or refused).

    Bounded-replay models (DeepSeek V4.1), scheduler half: ``swa_state_restores`` (hits
    loaded with their window: vLLM replays nothing), ``swa_bounded_replays`` (hits loaded
    without it: vLLM replays the last window), ``swa_full_recomputes`` (loads that claimed
    the window and failed: vLLM recomputed the request whole).
    """

    role: str
    pid: int
    namespace: dict[str, Any] = field(default_factory=dict)
    lookups: int = 0
    lookup_deferred: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    requests_matched: int = 0
    tokens_matched: int = 0
    load_requests: int = 0
    blocks_loaded: int = 0
    tokens_loaded: int = 0
    load_error_blocks: int = 0
    load_failed_requests: int = 0
    blocks_saved: int = 0
    blocks_save_touched: int = 0
    blocks_save_failed: int = 0
    blocks_save_dropped: int = 0
    saves_skipped: int = 0
    save_jobs_queued: int = 0
    save_jobs_done: int = 0
    save_queue_peak_bytes: int = 0
    async_loads: int = 0
    fetch_decisions: int = 0
    recompute_decisions: int = 0
    tokens_recompute_chosen: int = 0
    load_gbps_estimate: float | None = None
    prefill_tokens_per_s_estimate: float | None = None
    swa_hits: int = 0
    swa_tokens_without_state: int = 0
    swa_states_saved: int = 0
    swa_state_bytes_saved: int = 0
    swa_local_hits: int = 0
    swa_remote_hits: int = 0
    swa_misses: int = 0
    swa_state_dropped: int = 0
    swa_state_restores: int = 0
    swa_bounded_replays: int = 0
    swa_full_recomputes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)
