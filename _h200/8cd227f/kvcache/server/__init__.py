"""The storage daemon: tenant-scoped shards in LMDB behind a TCP data path, with retention
and admin HTTP.

:class:`ShardStore` holds all storage and retention logic and no sockets;
:class:`RequestHandler` answers requests without I/O; :class:`DataServer` is
the socket loop; :func:`run_daemon` wires them with the admin server.
``kvcache server`` runs one from the command line.
"""

from kvcache.server.config import ServerConfig, SyncMode, load_server_config
from kvcache.server.daemon import DaemonInfo, DaemonThread, run_daemon
from kvcache.server.handler import RequestHandler
from kvcache.server.loop import DataServer
from kvcache.server.store import Clock, ShardStore

__all__ = [
    "Clock",
    "DaemonInfo",
    "DaemonThread",
    "DataServer",
    "RequestHandler",
    "ServerConfig",
    "ShardStore",
    "SyncMode",
    "load_server_config",
    "run_daemon",
]
