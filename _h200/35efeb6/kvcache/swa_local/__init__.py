"""The SWA tier: sliding-window attention state kept minutes in worker RAM, served to peers.

- :mod:`.state` names a state (:class:`StateKey`) and checks it (:func:`state_digest`);
- :mod:`.store` holds states in RAM (:class:`SwaStore`: bytes bound, LRU, TTL);
- :mod:`.server` serves them to the tenant's peers over the data path's TCP framing;
- :mod:`.fetch` fetches them (:class:`PeerTransport`, :class:`TcpPeerTransport`);
- :mod:`.directory` registers and finds holders in the storage daemons' RAM;
- :mod:`.tier` puts these together for one worker (:class:`SwaTier`);
- :mod:`.replay` plans bounded replay on a miss; :mod:`.simulate` replays a trace.

See ``docs/swa.md`` and ``docs/spec/swa.md``.
"""

from kvcache.swa_local.config import SwaConfig
from kvcache.swa_local.fetch import PeerTransport, TcpPeerTransport, Wanted
from kvcache.swa_local.protocol import HolderRecord
from kvcache.swa_local.state import StateKey, state_digest, state_namespace_id, window_blocks
from kvcache.swa_local.store import DEFAULT_TTL_S, StoredState, SwaStore
from kvcache.swa_local.tier import SwaTier

__all__ = [
    "DEFAULT_TTL_S",
    "HolderRecord",
    "PeerTransport",
    "StateKey",
    "StoredState",
    "SwaConfig",
    "SwaStore",
    "SwaTier",
    "TcpPeerTransport",
    "Wanted",
    "state_digest",
    "state_namespace_id",
    "window_blocks",
]
