"""The client library inference workers call: match a prompt's cached prefix,
load its blocks (hedged 11-of-12 reads, straight into the caller's buffer),
store new blocks (quorum writes).

``Client`` is the implementation (blocking, thread-safe); ``AsyncClient`` runs
its calls off an asyncio loop.
"""

from kvcache.client.client import AsyncClient, Client
from kvcache.client.config import ClientConfig
from kvcache.client.loading import LoadResult
from kvcache.client.plan import MatchResult
from kvcache.client.storing import StoreResult

__all__ = ["AsyncClient", "Client", "ClientConfig", "LoadResult", "MatchResult", "StoreResult"]
