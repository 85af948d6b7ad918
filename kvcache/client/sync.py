"""The blocking façade: the async client's methods, run on a private event-loop thread.

There is one implementation (``AsyncClient``); this class only forwards calls
and waits for them, so the two can never drift apart.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache.client.config import ClientConfig
from kvcache.client.core import AsyncClient, LoadResult, Payloads, StoreResult
from kvcache.client.plan import MatchResult
from kvcache.cluster import ClusterMap
from kvcache.keys import BlockKey, Namespace

__all__ = ["Client"]

T = TypeVar("T")
Tokens = Sequence[int] | npt.NDArray[np.integer]


class Client:
    """Blocking kvcache client; safe to call from any thread, one call at a time per thread."""

    def __init__(self, config: ClientConfig, *, cluster: ClusterMap | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvcache-client", daemon=True
        )
        self._thread.start()
        self._closed = False

        async def make() -> AsyncClient:
            return AsyncClient(config, cluster=cluster)

        self.aclient = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def config(self) -> ClientConfig:
        """The client's configuration."""
        return self.aclient.config

    @property
    def counters(self) -> dict[str, int]:
        """Client-side counters (hedges, node errors, blocks loaded/written...)."""
        return dict(self.aclient.counters)

    def match_prefix(
        self, namespace: Namespace, tokens: Tokens, *, max_blocks: int | None = None
    ) -> MatchResult:
        """See :meth:`AsyncClient.match_prefix`."""
        return self._run(self.aclient.match_prefix(namespace, tokens, max_blocks=max_blocks))

    def match_keys(self, keys: Sequence[BlockKey], *, tokens_per_block: int = 1) -> MatchResult:
        """See :meth:`AsyncClient.match_keys`."""
        return self._run(self.aclient.match_keys(keys, tokens_per_block=tokens_per_block))

    def load_keys(
        self,
        match: MatchResult,
        *,
        payload_len: int,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
    ) -> LoadResult:
        """See :meth:`AsyncClient.load_keys`."""
        return self._run(
            self.aclient.load_keys(
                match, payload_len=payload_len, out=out, traffic_class=traffic_class
            )
        )

    def store_keys(
        self,
        keys: Sequence[BlockKey],
        payloads: Payloads,
        *,
        payload_len: int,
        traffic_class: str | None = None,
    ) -> StoreResult:
        """See :meth:`AsyncClient.store_keys`."""
        return self._run(
            self.aclient.store_keys(
                keys, payloads, payload_len=payload_len, traffic_class=traffic_class
            )
        )

    def load(
        self,
        namespace: Namespace,
        match: MatchResult,
        *,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
    ) -> LoadResult:
        """See :meth:`AsyncClient.load`."""
        return self._run(self.aclient.load(namespace, match, out=out, traffic_class=traffic_class))

    def load_prefix(
        self,
        namespace: Namespace,
        tokens: Tokens,
        *,
        out: npt.NDArray[np.uint8] | None = None,
        traffic_class: str | None = None,
    ) -> LoadResult:
        """See :meth:`AsyncClient.load_prefix`."""
        return self._run(
            self.aclient.load_prefix(namespace, tokens, out=out, traffic_class=traffic_class)
        )

    def store(
        self,
        namespace: Namespace,
        tokens: Tokens,
        payloads: Payloads,
        *,
        traffic_class: str | None = None,
        first_block: int = 0,
    ) -> StoreResult:
        """See :meth:`AsyncClient.store`."""
        return self._run(
            self.aclient.store(
                namespace, tokens, payloads, traffic_class=traffic_class, first_block=first_block
            )
        )

    def touch(
        self, namespace: Namespace, tokens: Tokens, *, traffic_class: str | None = None
    ) -> int:
        """See :meth:`AsyncClient.touch`."""
        return self._run(self.aclient.touch(namespace, tokens, traffic_class=traffic_class))

    def delete(self, namespace: Namespace, tokens: Tokens) -> int:
        """See :meth:`AsyncClient.delete`."""
        return self._run(self.aclient.delete(namespace, tokens))

    def stats(self) -> dict[str, Any]:
        """See :meth:`AsyncClient.stats`."""
        return self._run(self.aclient.stats())

    def close(self) -> None:
        """Close the sockets and stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        self._run(self.aclient.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
