"""``kvcache server``: run one storage daemon in the foreground.

Flags override environment variables (``KVCACHE_SERVER_*``), which override
the ``--config`` TOML file. SIGTERM or SIGINT finish the request in flight,
close LMDB and exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from kvcache.errors import ConfigError
from kvcache.server.config import SyncMode, load_server_config
from kvcache.server.daemon import DaemonInfo, run_daemon

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def _nonempty_path(text: str) -> Path:
    """A path flag's value; an empty one is refused (Path("") is the working directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a non-empty path is needed")
    return Path(text)


def register(subparsers: Any) -> None:
    """Add the ``server`` subcommand to the ``kvcache`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "server",
        help="run a storage daemon",
        description="Run one storage daemon (TCP data path + admin HTTP) in the foreground.",
    )
    parser.add_argument("--config", type=Path, help="TOML file with [server] and [retention]")
    parser.add_argument(
        "--data-dir", type=_nonempty_path, help="LMDB directory (created if missing)"
    )
    parser.add_argument("--listen", help="data endpoint (default tcp://127.0.0.1:7400)")
    parser.add_argument("--admin-listen", help="admin HTTP host:port (default 127.0.0.1:7480)")
    parser.add_argument("--node-id", help="node name in logs and metrics")
    parser.add_argument("--capacity", dest="capacity_bytes", help="bytes to keep, e.g. 500GiB")
    parser.add_argument(
        "--sync", choices=[m.value for m in SyncMode], help="when writes are forced to disk"
    )
    parser.add_argument(
        "--credentials",
        dest="credentials_file",
        type=Path,
        help="tenants' secrets and the admin token, mode 0600 "
        "(default: DATA_DIR/credentials.toml, generated on first start)",
    )
    parser.add_argument(
        "--tls-cert", type=Path, help="TLS certificate chain (PEM) for the data path"
    )
    parser.add_argument("--tls-key", type=Path, help="TLS private key (PEM) for the data path")
    parser.add_argument(
        "--cluster-file",
        type=Path,
        help="cluster map the admin status page (/dashboard) polls (default: this node only); "
        "when it has an [etcd] table, the daemon registers there under a lease",
    )
    parser.add_argument("--domain", help="failure domain (host, rack) registered in etcd")
    parser.add_argument("--weight", type=float, help="placement weight registered in etcd")
    parser.add_argument(
        "--lease-ttl", dest="lease_ttl_s", type=int, help="etcd lease seconds (default 10)"
    )
    parser.add_argument(
        "--advertise", help="data endpoint registered in etcd (default: the bound one)"
    )
    parser.add_argument(
        "--scrub-rate",
        dest="scrub_rate_bytes",
        help="bytes of stored shards re-verified per second, e.g. 32MiB (0: no scrub)",
    )
    parser.add_argument(
        "--scrub-interval",
        dest="scrub_interval_s",
        type=float,
        help="seconds from one scrub pass's start to the next (default 7 days)",
    )
    parser.add_argument(
        "--sendfile-min",
        dest="sendfile_min_bytes",
        help="GET replies send runs of records at least this long with sendfile, "
        "e.g. 64KiB (the default; 0: never)",
    )
    parser.add_argument(
        "--no-native-plane",
        dest="native_plane",
        action="store_const",
        const=False,
        help="answer every request in Python (default: quiet GETs and HAS in the native "
        "data plane, where it is built)",
    )
    parser.add_argument(
        "--events-listen",
        help="publish the event stream for routers here, e.g. tcp://127.0.0.1:7490 "
        "(default: off; docs/spec/events.md)",
    )
    parser.add_argument(
        "--events-replay-listen", help="the stream's replay endpoint (default: PUB port + 1)"
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        help="write {node_id, data, admin[, events, events_replay]} as JSON here once serving "
        "(for scripts and tests)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the config, serve until SIGTERM/SIGINT, return the exit code."""
    flags = {
        "data_dir": args.data_dir,
        "listen": args.listen,
        "admin_listen": args.admin_listen,
        "node_id": args.node_id,
        "capacity_bytes": args.capacity_bytes,
        "sync": args.sync,
        "credentials_file": args.credentials_file,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "cluster_file": args.cluster_file,
        "domain": args.domain,
        "weight": args.weight,
        "lease_ttl_s": args.lease_ttl_s,
        "advertise": args.advertise,
        "scrub_rate_bytes": args.scrub_rate_bytes,
        "scrub_interval_s": args.scrub_interval_s,
        "sendfile_min_bytes": args.sendfile_min_bytes,
        "native_plane": args.native_plane,
        "events_listen": args.events_listen,
        "events_replay_listen": args.events_replay_listen,
    }
    if args.ready_file is not None and (not args.ready_file.name or args.ready_file.is_dir()):
        raise ConfigError(
            f"--ready-file {str(args.ready_file)!r} must name a file (it is written when the "
            "daemon is ready), not a directory"
        )
    if args.ready_file is not None and not args.ready_file.parent.is_dir():
        raise ConfigError(
            f"--ready-file {str(args.ready_file)!r}: directory {str(args.ready_file.parent)!r} "
            "does not exist; create it first or name a file in an existing directory"
        )
    config, policy = load_server_config(args.config, flags=flags)
    log.info("effective config: %s", json.dumps(config.redacted(), sort_keys=True))
    log.info("retention policy: %s", json.dumps(policy.to_dict(), sort_keys=True))
    stop = threading.Event()
    services: list[DaemonInfo] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: finishing the request in flight and stopping", signum)
        stop.set()
        for info in services:
            info.server.wake()

    def on_ready(info: DaemonInfo) -> None:
        services.append(info)
        if args.ready_file is not None:
            tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
            tmp.write_text(info.to_json())
            os.replace(tmp, args.ready_file)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_daemon(config, stop, policy=policy, on_ready=on_ready)
    return 0
