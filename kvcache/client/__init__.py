"""The client library inference workers call: match a prompt's cached prefix,
load its blocks (hedged 11-of-12 reads), store new blocks (quorum writes).

``AsyncClient`` is the implementation; ``Client`` is its blocking façade.
"""

from kvcache.client.config import ClientConfig
from kvcache.client.core import AsyncClient, LoadResult, StoreResult
from kvcache.client.plan import MatchResult
from kvcache.client.sync import Client

__all__ = ["AsyncClient", "Client", "ClientConfig", "LoadResult", "MatchResult", "StoreResult"]
