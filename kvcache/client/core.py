"""The async client: prefix match, hedged loads and quorum stores against a cluster.

All network work runs on one asyncio loop; ``kvcache.client.sync.Client`` is the
thin blocking façade over it. Pure planning and assembly live in
``kvcache.client.plan`` and ``kvcache.client.encoding``; the operations in
``kvcache.client.reads`` and ``kvcache.client.storing`` only move messages and
keep node health (``kvcache.client.base``).
"""

from __future__ import annotations

from kvcache.client.reads import LoadResult
from kvcache.client.storing import Payloads, StoreOps, StoreResult

__all__ = ["AsyncClient", "LoadResult", "Payloads", "StoreResult"]


class AsyncClient(StoreOps):
    """A kvcache client bound to one event loop (create and use it inside that loop)."""

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
