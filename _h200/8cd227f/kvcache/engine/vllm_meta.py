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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.client.config import ClientConfig
from kvcache.config import build_config
from kvcache.errors import ConfigError
from kvcache.keys import Namespace, TokenArray, as_token_array
from kvcache.layout import DType, KVLayout

__all__ = [
    "CachedReq",
    "ConnectorSettings",
    "ConnectorStats",
    "KVGeometry",
    "LoadSpec",
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

_CLIENT_FIELDS = frozenset(ClientConfig.__dataclass_fields__)


# ---------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings:
    """The connector's own settings from ``kv_connector_extra_config``.

    ``client_config`` names a TOML file for :class:`~kvcache.client.ClientConfig`;
    ClientConfig fields given directly in the extra config (``cluster_file``,
    ``traffic_class``, ``timeout_s``...) override it. ``model_name`` and
    ``model_revision`` replace vLLM's model path and revision in the key
    namespace (a path says little about the weights behind it). A fresh prefix
    lookup may block scheduling for ``match_wait_ms``; after that the
    scheduler is told to ask again next step, and after ``match_deadline_ms``
    the request is treated as a miss. ``stats_dir`` receives one JSON file of
    counters per connector process. Saves waiting to be written may hold at
    most ``max_pending_save_mb`` of host memory; beyond that new saves are
    dropped (a cache may forget; it must not stall the engine).
    """

    client_config: Path | None = None
    model_name: str | None = None
    model_revision: str | None = None
    tenant: str = "default"
    stats_dir: Path | None = None
    match_wait_ms: float = 20.0
    match_deadline_ms: float = 5000.0
    max_pending_save_mb: int = 256

    def __post_init__(self) -> None:
        if not (self.match_wait_ms >= 0 and self.match_deadline_ms >= self.match_wait_ms):
            raise ConfigError(
                f"need 0 <= match_wait_ms <= match_deadline_ms, got {self.match_wait_ms} and "
                f"{self.match_deadline_ms}"
            )
        if self.max_pending_save_mb < 1:
            raise ConfigError(f"max_pending_save_mb must be >= 1, got {self.max_pending_save_mb}")
        for name in ("model_name", "model_revision"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ConfigError(f"{name} must not be empty when given")


def split_extra_config(
    extra: Mapping[str, Any],
) -> tuple[ConnectorSettings, dict[str, Any]]:
    """Split vLLM's extra config into connector settings and ClientConfig overrides.

    Unknown keys are errors that list every known key, so a typo in a
    deployment's config fails at start-up instead of being ignored.
    """
    own_fields = set(ConnectorSettings.__dataclass_fields__)
    own: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for key, value in extra.items():
        name = key.replace("-", "_")
        if name in own_fields:
            own[name] = value
            if name == "tenant":  # the namespace's tenant is the one the client authenticates as
                client[name] = value
        elif name in _CLIENT_FIELDS:
            client[name] = value
        else:
            known = ", ".join(sorted(own_fields | _CLIENT_FIELDS))
            raise ConfigError(
                f"kv_connector_extra_config: unknown key {key!r} for the kvcache connector; "
                f"known: {known}"
            )
    settings = build_config(ConnectorSettings, own, source="kv_connector_extra_config")
    if settings.client_config is None and "cluster_file" not in client:
        raise ConfigError(
            "kv_connector_extra_config needs 'cluster_file' (the cluster map written by "
            "`kvcache up`) or 'client_config' (a client TOML file naming one)"
        )
    return settings, client


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

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "page_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        if (self.num_layers * self.page_bytes) % self.block_size:
            raise ConfigError(
                f"a block of {self.num_layers} layers x {self.page_bytes} bytes does not split "
                f"into {self.block_size} equal tokens; this KV cache (padded pages?) is not "
                "supported by the kvcache connector"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes of one stored block: every layer's page."""
        return self.num_layers * self.page_bytes

    def kv_layout(self) -> KVLayout:
        """The kvcache layout of one block (part of the key namespace)."""
        return KVLayout(
            tokens_per_block=self.block_size,
            bytes_per_token=self.payload_bytes // self.block_size,
            dtype=self.dtype,
            layers_in_block=self.num_layers,
        )


def parallel_name(*, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The namespace's ``parallel`` field: ``tp{r}of{n}``, with ``-pp{r}of{n}`` under PP."""
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ConfigError(f"bad parallel rank: tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size}")
    name = f"tp{tp_rank}of{tp_size}"
    return name if pp_size == 1 else f"{name}-pp{pp_rank}of{pp_size}"


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
    rev = f"{revision or 'unversioned'};engine=vllm;kv={geometry.packing}"
    return Namespace(
        model=model, revision=rev, layout=geometry.kv_layout(), parallel=parallel, tenant=tenant
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
    """Load these blocks from the store into vLLM's blocks before the forward pass."""


@dataclass(frozen=True, slots=True)
class SaveSpec(BlockSpan):
    """Save these blocks from vLLM's blocks into the store after the forward pass."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the worker half does in one engine step: loads before, saves after the forward."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class NewReq:
    """A request scheduled for the first time (vLLM's NewRequestData, reduced)."""

    req_id: str
    prompt: Sequence[int] | None
    block_ids: Sequence[int]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class CachedReq:
    """A request scheduled before (vLLM's CachedRequestData, one row)."""

    req_id: str
    resumed: bool
    new_block_ids: Sequence[int] | None
    num_computed_tokens: int


@dataclass
class _Tracked:
    tokens: TokenArray
    block_ids: list[int] = field(default_factory=list)


class SchedulerBook:
    """The scheduler half's state: each live request's prompt and blocks, and planned loads.

    vLLM sends a request's full block list when it is first scheduled (or
    resumed after preemption) and only the new blocks afterwards; the book
    keeps the list so each step's plan can name the blocks it touches.
    """

    def __init__(self, *, block_size: int, load: bool = True, save: bool = True) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.load = load
        self.save = save
        self._reqs: dict[str, _Tracked] = {}
        self._pending: dict[str, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def on_alloc(
        self, req_id: str, prompt: Sequence[int], *, local_tokens: int, external: int
    ) -> None:
        """vLLM allocated blocks for ``req_id``; ``external`` tokens after ``local_tokens`` are to load."""
        if not self.load or external <= 0:
            self._pending.pop(req_id, None)
            return
        b = self.block_size
        if local_tokens % b or external % b:
            raise ConfigError(
                f"request {req_id}: local {local_tokens} and external {external} tokens must be "
                f"multiples of the block size {b}"
            )
        self._reqs.setdefault(req_id, _Tracked(as_token_array(prompt)))
        self._pending[req_id] = (local_tokens // b, (local_tokens + external) // b)

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
            begins[r.req_id] = r.num_computed_tokens
        for c in cached:
            tracked = self._reqs.get(c.req_id)
            if tracked is None:
                continue
            if c.resumed:
                tracked.block_ids = list(c.new_block_ids or ())
            elif c.new_block_ids:
                tracked.block_ids.extend(c.new_block_ids)
            begins[c.req_id] = c.num_computed_tokens
        loads = []
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
        return StepPlan(tuple(loads), tuple(saves))

    def _completed(self, begin: int, end: int, tracked: _Tracked) -> tuple[int, int]:
        """Prompt blocks that become complete when tokens ``begin..end`` are computed."""
        b = self.block_size
        prompt_blocks = len(tracked.tokens) // b
        stop = min(end // b, prompt_blocks, len(tracked.block_ids))
        return begin // b, stop


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
    (saves withheld because the same step's load failed).
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
    save_queue_peak_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)


def namespace_dict(ns: Namespace) -> dict[str, Any]:
    """A namespace as JSON (for stats and logs): every field, and the seed in hex."""
    return {
        "model": ns.model,
        "revision": ns.revision,
        "layout": {
            "tokens_per_block": ns.layout.tokens_per_block,
            "bytes_per_token": ns.layout.bytes_per_token,
            "dtype": ns.layout.dtype.value,
            "layers_in_block": ns.layout.layers_in_block,
        },
        "parallel": ns.parallel,
        "tenant": ns.tenant,
        "seed": ns.seed.hex(),
    }


def namespace_from_dict(data: Mapping[str, Any]) -> Namespace:
    """Inverse of :func:`namespace_dict` (checks the seed, so a mismatch cannot go unnoticed)."""
    layout = data["layout"]
    ns = Namespace(
        model=data["model"],
        revision=data["revision"],
        layout=KVLayout(
            tokens_per_block=int(layout["tokens_per_block"]),
            bytes_per_token=int(layout["bytes_per_token"]),
            dtype=DType(layout["dtype"]),
            layers_in_block=int(layout["layers_in_block"]),
        ),
        parallel=data["parallel"],
        tenant=data["tenant"],
    )
    if "seed" in data and ns.seed.hex() != data["seed"]:
        raise ConfigError(f"namespace seed {ns.seed.hex()} differs from recorded {data['seed']}")
    return ns
