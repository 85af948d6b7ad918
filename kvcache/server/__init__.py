"""The storage daemon: shards in LMDB behind a zmq data path, with retention and admin HTTP.

:class:`ShardStore` holds all storage and retention logic and no sockets;
:class:`DataService` is the zmq front end; :func:`run_daemon` wires them with
the admin server. ``kvcache server`` runs one from the command line.
"""

from kvcache.server.config import ServerConfig, SyncMode, load_server_config
from kvcache.server.daemon import DaemonInfo, DaemonThread, run_daemon
from kvcache.server.service import DataService
from kvcache.server.store import Clock, ShardStore

__all__ = [
    "Clock",
    "DaemonInfo",
    "DaemonThread",
    "DataService",
    "ServerConfig",
    "ShardStore",
    "SyncMode",
    "load_server_config",
    "run_daemon",
]
