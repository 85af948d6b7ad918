"""An SGLang HiCache storage backend (L3) on a kvcache cluster.

Load it with ``--hicache-storage-backend dynamic`` and an extra config such as::

    --hicache-storage-backend-extra-config '{"backend_name": "kvcache",
        "module_path": "kvcache.engine.sglang_backend", "class_name": "KVCacheStorage",
        "cluster_file": "/etc/kvcache/cluster.toml", "traffic_class": "chat",
        "interface_v1": 1}'

SGLang names each host page by its own prefix hash (a hex string chained over
the page's tokens and everything before it). We turn that name into a kvcache
block key under a namespace of model, revision, page layout, TP rank and
tenant, so the store's prefix semantics carry over unchanged and incompatible
workers never share a key. A page's bytes are an opaque payload.

The extra config is parsed like the vLLM connector's
(:mod:`kvcache.engine.settings`): the backend's own keys, ClientConfig keys,
``swa_*`` keys, and the keys SGLang itself reads from the same JSON
(:data:`SGLANG_KEYS`); any other key is an error naming the known ones.

Sliding-window models: SGLang holds back the trailing window of a matched
prefix and re-prefills it (``swa_reprefill_tail_tokens``), because its
storage keeps no window. :meth:`KVCacheStorage.reprefill_tail_tokens` says
how many tokens that is for a hit, from the same bounded-replay plan as
everywhere else (:mod:`kvcache.swa_local.replay`): none when the state at the
hit is held, the bounded replay's ``replay`` tokens otherwise.

SGLang itself is optional: without it this class derives from a local base with
the same methods, so the backend can be built and tested without the engine.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvcache.client import Client, ClientConfig
from kvcache.engine.hints import hint_from_params
from kvcache.engine.paged import kv_dtype
from kvcache.engine.settings import EngineSettings, engine_namespace, split_engine_config
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey, Namespace
from kvcache.layout import KVLayout
from kvcache.retention.decide import Hint
from kvcache.swa_local.replay import ReplayPlan, plan_replay

__all__ = ["SGLANG_KEYS", "KVCacheStorage", "SGLangSettings", "page_key"]

#: Keys of the extra-config JSON that SGLang itself reads (the dynamic backend's name,
#: module and class, its prefetch tuning); the backend passes over them.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "canonical_dcp_size",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SGLangSettings(EngineSettings):
    """The backend's settings: the shared ones, plus the page size when SGLang's host pool
    is not registered (``page_size``), and for sliding-window models the window
    (``sliding_window``), the sliding-window layers (``swa_layers``) and the bounded replay
    length (``replay_tokens``; default ``sliding_window - 1``)."""

    page_size: int = 0
    sliding_window: int = 0
    swa_layers: int = 0
    replay_tokens: int | None = None

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        if self.page_size < 0 or self.sliding_window < 0 or self.swa_layers < 0:
            raise ConfigError("page_size, sliding_window and swa_layers must be >= 0")
        if self.sliding_window == 1 or (self.sliding_window and not self.swa_layers):
            raise ConfigError("sliding_window needs a window >= 2 and swa_layers >= 1")
        if self.replay_tokens is not None and self.replay_tokens < 1:
            raise ConfigError(f"replay_tokens must be >= 1, got {self.replay_tokens}")


log = logging.getLogger(__name__)

#: Domain tag for keys derived from SGLang's page hashes.
SGLANG_TAG = b"kvcache:sglang-page:v1\x00"

try:  # pragma: no cover - exercised only where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:

    class _Base(abc.ABC):  # type: ignore[no-redef]
        """The subset of SGLang's HiCacheStorage interface this backend implements."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        @abc.abstractmethod
        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any: ...

        @abc.abstractmethod
        def batch_get(
            self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
        ) -> Any: ...

        @abc.abstractmethod
        def set(
            self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
        ) -> bool: ...

        @abc.abstractmethod
        def batch_set(
            self,
            keys: list[str],
            values: Any = None,
            target_locations: Any = None,
            target_sizes: Any = None,
        ) -> bool: ...

        @abc.abstractmethod
        def exists(self, key: str) -> bool: ...


def page_key(namespace: Namespace, page_hash: str) -> BlockKey:
    """The kvcache block key of an SGLang page named ``page_hash`` in ``namespace``."""
    return BlockKey(xxhash.xxh3_128_digest(SGLANG_TAG + namespace.seed + page_hash.encode()))


class KVCacheStorage(_Base):  # type: ignore[misc]
    """HiCache storage on kvcache: SGLang's pages become erasure-coded kvcache blocks."""

    def __init__(
        self, storage_config: Any, kwargs: Any = None, *, client: Client | None = None
    ) -> None:
        extra: dict[str, Any] = dict(getattr(storage_config, "extra_config", None) or {})
        settings, overrides, _swa = split_engine_config(
            extra,
            SGLangSettings,
            source="--hicache-storage-backend-extra-config",
            ignored=SGLANG_KEYS,
            needs_cluster=client is None,
        )
        self.settings = settings
        self._tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self._tp_size = int(getattr(storage_config, "tp_size", 1))
        self._is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self._model = settings.model_name or str(
            getattr(storage_config, "model_name", None) or "unknown"
        )
        self._tenant = settings.tenant
        if client is None:
            client = Client(ClientConfig.load(settings.client_config, overrides=overrides))
        self._client = client
        # The client's traffic class (its config file, KVCACHE_CLIENT_*, or the extra
        # config): the same default as the vLLM connector's, and a file's choice is kept.
        self._traffic_class = str(
            overrides.get("traffic_class") or getattr(client.config, "traffic_class", "default")
        )
        self._namespace: Namespace | None = None
        self._page_bytes = 0
        self._dtype: torch.dtype | None = None
        self._page_size = settings.page_size
        self.stats: dict[str, int] = {
            "pages_hit": 0,
            "pages_loaded": 0,
            "pages_stored": 0,
            "pages_failed": 0,
            "pages_declined": 0,
            "hints_bad": 0,
        }

    # ------------------------------------------------------------ layout and keys

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page layout from SGLang's host pool (called once at start)."""
        size_per_token = getattr(mem_pool_host, "get_size_per_token", None)
        if size_per_token is None or not int(getattr(mem_pool_host, "size_per_token", 1) or 0):
            # DeepSeek V4 / V4.1: SGLang's anchor pool (LogicalHostPool) holds no bytes; the
            # KV is in named side pools that SGLang moves only through its batch v2 calls.
            raise ConfigError(
                f"SGLang registered a {type(mem_pool_host).__name__}, a host pool that holds "
                "no KV bytes (DeepSeek V4 / V4.1's anchor pool): its KV lives in side pools "
                "that SGLang reaches only through the HiCache batch v2 interface "
                "(register_mem_host_pool_v2, batch_exists_v2, batch_get_v2, batch_set_v2), "
                "which kvcache's backend does not implement; run this model without "
                "--hicache-storage-backend, or see docs/engine.md"
            )
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        per_token = int(size_per_token())
        self._configure(page_size, page_size * per_token, mem_pool_host.dtype)

    def _configure(self, page_size: int, page_bytes: int, dtype: torch.dtype) -> None:
        parallel = "mla" if self._is_mla else f"tp{self._tp_rank}of{self._tp_size}"
        layout = KVLayout(
            tokens_per_block=page_size,
            bytes_per_token=page_bytes // page_size,
            dtype=kv_dtype(dtype),
            layers_in_block=1,
        )
        if layout.payload_bytes != page_bytes:
            raise ConfigError(f"page of {page_bytes} bytes is not {page_size} equal token slices")
        self._namespace = engine_namespace(
            engine="sglang",
            model=self._model,
            revision=self.settings.model_revision,
            layout=layout,
            packing="mla-page" if self._is_mla else "host-page",
            parallel=parallel,
            tenant=self._tenant,
        )
        self._page_size, self._page_bytes, self._dtype = page_size, page_bytes, dtype

    def _require_layout(self, sample: torch.Tensor | None = None) -> Namespace:
        if self._namespace is None:
            if sample is None or not self._page_size:
                raise ConfigError(
                    "page layout unknown: register SGLang's host pool first, or give 'page_size' "
                    "in the extra config and pass a page tensor"
                )
            self._configure(self._page_size, sample.numel() * sample.element_size(), sample.dtype)
        assert self._namespace is not None
        return self._namespace

    def _keys(self, namespace: Namespace, page_hashes: Sequence[str]) -> list[BlockKey]:
        return [page_key(namespace, h) for h in page_hashes]

    # ------------------------------------------------------------ existence

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` the cluster can serve."""
        if not keys:
            return 0
        ns = self._require_layout()
        hit = self._client.match_keys(
            self._keys(ns, keys), tokens_per_block=self._page_size
        ).hit_blocks
        self.stats["pages_hit"] += hit
        return int(hit)

    def exists(self, key: str) -> bool:
        """Whether one page is stored."""
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ reads

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages in order; a page that cannot be loaded (and every page after it) is None.

        With ``target_locations`` (one host tensor per page) the bytes land there.
        """
        if not keys:
            return []
        sample = target_locations[0] if target_locations else None
        ns = self._require_layout(sample)
        payloads = self._load(ns, keys)
        out: list[torch.Tensor | None] = []
        for i in range(len(keys)):
            if i >= len(payloads):
                out.append(None)
                continue
            src = torch.from_numpy(payloads[i])
            if target_locations is not None:
                target = target_locations[i]
                _as_bytes(target).copy_(src)
                out.append(target)
            else:
                assert self._dtype is not None
                out.append(src.clone().view(self._dtype))
        return out

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """One page, or None."""
        targets = [target_location] if target_location is not None else None
        return self.batch_get([key], targets)[0]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load pages straight into SGLang's host pool at ``host_indices`` (one index per token).

        ``extra_info.extra_info["kvcache"]``, when SGLang's caller set it, is the
        request's retention hint (:mod:`kvcache.engine.hints`)."""
        pool = self._pool()
        ns = self._require_layout()
        payloads = self._load(ns, keys, self._hint(extra_info))
        for i, payload in enumerate(payloads):
            index = int(host_indices[i * self._page_size])
            page = torch.from_numpy(payload).view(pool.dtype)
            pool.set_from_flat_data_page(index, page)
        return [i < len(payloads) for i in range(len(keys))]

    def _hint(self, extra_info: Any) -> Hint | None:
        """The retention hint in a storage call's ``HiCacheStorageExtraInfo.extra_info``
        (None: the backend's class); a malformed one is logged, counted and ignored."""
        hint, error = hint_from_params(
            getattr(extra_info, "extra_info", None), request="(SGLang storage call)"
        )
        if error is not None:
            self.stats["hints_bad"] += 1
        return hint

    def _load(
        self, ns: Namespace, page_hashes: Sequence[str], hint: Hint | None = None
    ) -> list[np.ndarray]:
        match = self._client.match_keys(
            self._keys(ns, page_hashes), tokens_per_block=self._page_size
        )
        result = self._client.load_keys(
            match, payload_len=self._page_bytes, traffic_class=self._traffic_class, hint=hint
        )
        self.stats["pages_loaded"] += result.blocks
        return result.payloads

    # ------------------------------------------------------------ writes

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store pages (tensors in ``values``, or read from ``target_locations``); True if all stored."""
        pages = values if values is not None else target_locations
        if not keys:
            return True
        if pages is None or len(pages) != len(keys):
            raise ConfigError("batch_set needs one page tensor per key")
        ns = self._require_layout(pages[0])
        return all(self._store(ns, keys, [_as_bytes(p).numpy() for p in pages]))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one page."""
        page = value if value is not None else target_location
        return self.batch_set([key], [page])

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store pages read from SGLang's host pool at ``host_indices``, under the call's
        retention hint (``extra_info.extra_info["kvcache"]``); ``store: false`` stores
        nothing and answers every page done, so SGLang does not retry it."""
        hint = self._hint(extra_info)
        if hint is not None and not hint.store:
            self.stats["pages_declined"] += len(keys)
            return [True] * len(keys)
        pool = self._pool()
        ns = self._require_layout()
        pages = [
            _as_bytes(_flat_page(pool, int(host_indices[i * self._page_size]))).numpy()
            for i in range(len(keys))
        ]
        return self._store(ns, keys, pages, hint)

    def _store(
        self,
        ns: Namespace,
        page_hashes: Sequence[str],
        payloads: list[np.ndarray],
        hint: Hint | None = None,
    ) -> list[bool]:
        for p in payloads:
            if p.nbytes != self._page_bytes:
                raise ConfigError(
                    f"page of {p.nbytes} bytes; this backend stores {self._page_bytes}"
                )
        result = self._client.store_keys(
            self._keys(ns, page_hashes), payloads, payload_len=self._page_bytes,
            traffic_class=self._traffic_class, hint=hint,
        )  # fmt: skip
        failed = set(result.failed_blocks)
        self.stats["pages_stored"] += result.written + result.touched
        self.stats["pages_failed"] += len(failed)
        return [i not in failed for i in range(len(page_hashes))]

    # ------------------------------------------------------------ sliding-window models

    def replay_plan(self, hit_tokens: int, *, state_held: bool = False) -> ReplayPlan:
        """What SGLang recomputes of a hit of ``hit_tokens`` on a sliding-window model: the
        bounded replay of ``replay_tokens`` (nothing when the state at the hit is held)."""
        s = self.settings
        if not s.sliding_window:
            return ReplayPlan(hit=hit_tokens, start=hit_tokens, exact=True)
        return plan_replay(
            hit_tokens,
            window=s.sliding_window,
            swa_layers=s.swa_layers,
            replay=s.replay_tokens,
            state_held=state_held,
        )

    def reprefill_tail_tokens(self, hit_tokens: int, *, state_held: bool = False) -> int:
        """Tokens SGLang must hold back from the end of a matched prefix and re-prefill
        (its ``swa_reprefill_tail_tokens``) for a hit of ``hit_tokens``: 0 for a model
        without sliding-window layers or when the state at the hit is held."""
        return self.replay_plan(hit_tokens, state_held=state_held).tokens

    # ------------------------------------------------------------ misc

    def _pool(self) -> Any:
        pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            raise ConfigError("no SGLang host pool registered (register_mem_pool_host)")
        return pool

    def get_stats(self) -> dict[str, int]:
        """Backend counters (pages hit, loaded, stored, failed)."""
        return dict(self.stats)

    def clear(self) -> None:
        """Kept for SGLang's interface: a shared cluster is not cleared by one worker."""
        log.info("clear() ignored: the kvcache cluster is shared")

    def close(self) -> None:
        """Close the client."""
        self._client.close()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    if not t.is_contiguous():
        raise ConfigError("page tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def _flat_page(pool: Any, index: int) -> torch.Tensor:
    """One host page, flat: SGLang 0.5.23's ``get_data_page(index, flat=True)``
    (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``), or the older
    ``get_flat_data_page``."""
    getter = getattr(pool, "get_data_page", None)
    if getter is not None:
        page: torch.Tensor = getter(index, flat=True)
        return page
    flat: torch.Tensor = pool.get_flat_data_page(index)
    return flat
