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

from kvcache.server.config import SyncMode, load_server_config
from kvcache.server.daemon import DaemonInfo, run_daemon

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``server`` subcommand to the ``kvcache`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "server",
        help="run a storage daemon",
        description="Run one storage daemon (TCP data path + admin HTTP) in the foreground.",
    )
    parser.add_argument("--config", type=Path, help="TOML file with [server] and [retention]")
    parser.add_argument("--data-dir", type=Path, help="LMDB directory (created if missing)")
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
        help="cluster map the admin status page (/dashboard) polls (default: this node only)",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        help="write {node_id, data, admin} as JSON here once serving (for scripts and tests)",
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
    }
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
