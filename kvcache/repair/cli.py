"""``kvcache repair``: rebuild the missing shards of live blocks onto their current holders.

One pass over every tenant of the credentials file (or ``--tenant``), then
exit; with ``--follow``, the background repairer: pass again every
``--interval`` seconds and whenever the cluster map changes, until SIGTERM
or SIGINT (the batch in hand finishes and the state file is saved first).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from kvcache.client.config import ClientConfig
from kvcache.client.core import ClientCore
from kvcache.config import parse_size
from kvcache.credentials import Credentials
from kvcache.errors import ConfigError
from kvcache.repair.run import Repairer, RepairOptions, RepairProgress
from kvcache.repair.state import RepairState

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``repair`` subcommand to the ``kvcache`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "repair",
        help="rebuild missing shards of live blocks onto their current holders",
        description="Scan every node's shards (LIST), and rebuild the shards that the blocks' "
        "current holders lack from k good ones of each stripe: after a node was replaced, "
        "wiped or set out. Rate-limited and resumable (--state).",
    )
    parser.add_argument("--cluster-file", type=Path, required=True, help="the cluster map")
    parser.add_argument(
        "--config",
        type=Path,
        help="client config whose settings the repairer uses (k, m, timeouts, TLS): the "
        "workers' client.toml when their stripes are not the default 10 + 2",
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        required=True,
        help="credentials file with the secrets of the tenants to repair (the daemons' file)",
    )
    parser.add_argument(
        "--tenant", action="append", help="repair only this tenant (repeatable; default: all)"
    )
    parser.add_argument(
        "--rate", default="200MB", help="bytes read + written per second, e.g. 200MB (0: no limit)"
    )
    parser.add_argument("--state", type=Path, help="state file: a stopped pass resumes from it")
    parser.add_argument(
        "--follow", action="store_true", help="keep repairing: pass again periodically"
    )
    parser.add_argument(
        "--interval", type=float, default=600.0, help="seconds between --follow passes"
    )
    parser.add_argument(
        "--prune", action="store_true", help="delete shard copies left off their holders"
    )
    parser.add_argument(
        "--limit", type=int, help="stop (resumably) after scanning about this many keys"
    )
    parser.add_argument("--batch", type=int, default=256, help="keys repaired together")
    parser.add_argument("--json", action="store_true", help="print each pass's result as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run repair passes; 0 when every block is whole (or repaired), 1 otherwise."""
    rate = parse_size(args.rate, what="--rate")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if not 0 < args.interval < 366 * 86_400:  # NaN fails this too (it busy-looped)
        raise ConfigError(f"--interval must be > 0 seconds and under a year, got {args.interval}")
    creds = Credentials.load(args.credentials)
    names = args.tenant or [t.name for t in creds.tenants]
    for name in names:
        if creds.tenant(name) is None:
            raise ConfigError(f"credentials file {args.credentials} has no tenant {name!r}")
    options = RepairOptions(
        rate_bytes=rate, batch_keys=args.batch, prune=args.prune, limit_keys=args.limit
    )
    state = RepairState.load(args.state)
    stop = threading.Event()
    changed = threading.Event()
    if args.follow:

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: finishing the batch in hand and stopping", signum)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    cores = {
        name: ClientCore(
            ClientConfig.load(
                args.config,
                overrides={
                    "cluster_file": args.cluster_file,
                    "tenant": name,
                    "credentials_file": args.credentials,
                    "secret": "",
                },
            )
        )
        for name in names
    }
    ok = True
    try:
        for core in cores.values():
            core.topology.subscribe(lambda _m: changed.set())
        while True:
            changed.clear()
            # With --follow the exit status is the last pass's: a node that was down
            # during one pass and repaired by the next is not a failure.
            ok = True
            for name, core in cores.items():
                if stop.is_set():
                    break
                last = [time.monotonic()]

                def show(p: RepairProgress, last: list[float] = last) -> None:
                    if not args.json and time.monotonic() - last[0] >= 2.0:
                        last[0] = time.monotonic()
                        print(p.line(), file=sys.stderr, flush=True)

                repairer = Repairer(core, tenant=name, options=options, stop=stop, on_batch=show)
                progress = repairer.run_pass(state.tenant(name), state.save)
                ok &= progress.blocks_unrecoverable == 0 and progress.blocks_failed == 0
                # A pass that reached no node checked nothing: that is no success.
                nowhere = len(progress.nodes_unreachable) >= len(core.cluster.nodes)
                if nowhere:
                    ok = False
                    print(
                        f"kvcache repair: tenant {name}: no node of the cluster could be "
                        "reached; nothing was checked",
                        file=sys.stderr,
                    )
                if args.json:
                    print(json.dumps(progress.to_dict(), sort_keys=True), flush=True)
                else:
                    print(progress.line(), flush=True)
                    if progress.nodes_unreachable:
                        print(f"  nodes not listed: {', '.join(progress.nodes_unreachable)}")
            if not args.follow or stop.is_set():
                break
            deadline = time.monotonic() + args.interval
            while not stop.is_set() and not changed.is_set() and time.monotonic() < deadline:
                stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    finally:
        for core in cores.values():
            core.close()
    return 0 if ok else 1
