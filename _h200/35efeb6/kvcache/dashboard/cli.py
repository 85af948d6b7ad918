"""``kvcache dashboard``: serve the cluster status page from any machine that reaches the
daemons' admin ports (each daemon also serves it at ``/dashboard``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcache.dashboard.config import load_dashboard_config
from kvcache.dashboard.serve import serve_dashboard

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``dashboard`` subcommand to the ``kvcache`` parser."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "dashboard",
        help="serve the cluster status page",
        description="Serve the cluster status page: nodes, health, capacity, hit rates, "
        "latency and errors, polled from every daemon's /stats. It needs the admin token "
        "(from the cluster's credentials.toml) unless --no-auth is given.",
    )
    parser.add_argument("--config", type=Path, help="TOML file with a [dashboard] table")
    parser.add_argument(
        "--dir", type=Path, help="local cluster directory (its cluster.toml and credentials.toml)"
    )
    parser.add_argument("--cluster", dest="cluster_file", type=Path, help="cluster file to poll")
    parser.add_argument(
        "--credentials",
        dest="credentials_file",
        type=Path,
        help="credentials file holding the admin token (default: beside the cluster file)",
    )
    parser.add_argument("--token", help="the admin token (env KVCACHE_ADMIN_TOKEN)")
    parser.add_argument("--listen", help="host:port to serve on (default 127.0.0.1:7490)")
    parser.add_argument(
        "--no-auth", action="store_const", const=True, help="serve the page without a token"
    )
    parser.add_argument("--refresh", dest="refresh_s", type=float, help="page refresh, seconds")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    cluster_file = args.cluster_file
    if cluster_file is None and args.dir is not None:
        cluster_file = args.dir / "cluster.toml"
    config = load_dashboard_config(
        args.config,
        flags={
            "cluster_file": cluster_file,
            "credentials_file": args.credentials_file,
            "token": args.token,
            "listen": args.listen,
            "no_auth": args.no_auth,
            "refresh_s": args.refresh_s,
        },
    )

    def ready(url: str) -> None:
        how = "open, no token needed" if config.no_auth else "log in with the admin token"
        print(f"status page of {config.cluster_file} at {url} ({how})", flush=True)

    serve_dashboard(config, ready)
    return 0
