"""``kvcache events``: print a storage daemon's event stream, one line per event.

    kvcache events --follow --cluster-file kvcache-local/cluster.toml \\
        --credentials kvcache-local/credentials.toml --tenant default
    kvcache events --endpoint tcp://127.0.0.1:7490 --credentials creds.toml --from-seq 0

Endpoints come from ``--endpoint`` (the PUB endpoint; replay: ``--replay-endpoint``, in the
same order, default the PUB port + 1) or from each node's admin ``/stats`` in
``--cluster-file``. Without ``--follow`` it prints the batches the daemons still keep (from
``--from-seq``) and exits; with it, it goes on with live events, filling gaps from replay
and printing a ``RESYNC`` line when a daemon no longer keeps what was missed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, TextIO

from kvcache.cluster import read_cluster_file
from kvcache.credentials import Credentials
from kvcache.errors import ClusterError, ConfigError
from kvcache.events.format import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.events.subscriber import Delivery, Resync, Subscriber

__all__ = ["format_event", "register", "run"]

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``events`` subcommand to the ``kvcache`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "events",
        help="print the daemons' event stream (stores, expiries, evictions, SWA records)",
        description=(
            "Print storage daemons' event streams (vLLM KV events: docs/spec/events.md), one "
            "line per event: node, tenant, sequence, event, medium, cause, blocks."
        ),
    )
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep printing live events (default: print what is kept, exit)")  # fmt: skip
    parser.add_argument("--endpoint", action="append", default=[],
                        help="a daemon's events PUB endpoint (repeatable)")  # fmt: skip
    parser.add_argument("--replay-endpoint", action="append", default=[],
                        help="its replay endpoint, in --endpoint order (default: PUB port + 1)")  # fmt: skip
    parser.add_argument("--cluster-file", type=Path,
                        help="find every node's endpoints through its admin /stats")  # fmt: skip
    parser.add_argument("--credentials", type=Path,
                        help="credentials file holding the tenant's secret (or the admin token)")  # fmt: skip
    parser.add_argument("--tenant", default="default", help="whose events (default: default)")
    parser.add_argument("--token", help="the tenant's events token instead of --credentials")
    parser.add_argument("--admin", action="store_true",
                        help="every tenant's events, with the admin token of --credentials")  # fmt: skip
    parser.add_argument("--no-auth", action="store_true",
                        help="connect without credentials (a daemon with events_auth = false)")  # fmt: skip
    parser.add_argument("--from-seq", type=_non_negative, default=None,
                        help="replay from this sequence number first (default: 0 without "
                        "--follow, live only with it)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--count", type=_non_negative, default=0,
                        help="stop after this many events (default 0: no limit)")  # fmt: skip
    parser.set_defaults(func=run)


def _non_negative(text: str) -> int:
    """An argparse type: an integer >= 0 (a sequence number or a count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Follow (or dump) the streams; returns the exit code: 0, or 1 when a dump (no
    ``--follow``) had a daemon whose replay endpoint never answered, so that a script can tell
    "no events" from "no daemon"."""
    out = out or sys.stdout
    endpoints = _endpoints(args)
    auth = _auth(args)
    start = args.from_seq if args.from_seq is not None else (None if args.follow else 0)
    subs = [
        (node, Subscriber(pub, replay, start_seq=start, **auth)) for node, pub, replay in endpoints
    ]
    printed = 0
    try:
        idle_since = time.monotonic()
        while True:
            got = False
            for node, sub in subs:
                for item in sub.poll(0.05):
                    got = True
                    for line in _lines(node, item, as_json=args.json):
                        out.write(line + "\n")
                        printed += 1
                        if args.count and printed >= args.count:
                            out.flush()
                            return 0
            out.flush()
            if got:
                idle_since = time.monotonic()
            elif not args.follow and time.monotonic() - idle_since > 0.5:
                return _dump_status(subs)
    except KeyboardInterrupt:
        return 130
    finally:
        for _, sub in subs:
            sub.close()


def _dump_status(subs: list[tuple[str, Subscriber]]) -> int:
    silent = [node for node, sub in subs if sub.counters["replay_timeouts"]]
    for node in silent:
        print(f"kvcache events: {node}: its replay endpoint never answered (is the daemon up, "
              "are these its endpoints, are the credentials right?)", file=sys.stderr)  # fmt: skip
    return 1 if silent else 0


def _auth(args: argparse.Namespace) -> dict[str, Any]:
    if args.no_auth:
        return {"tenant": args.tenant}
    if args.token:
        return {"tenant": args.tenant, "token": args.token}
    if args.credentials is None:
        raise ConfigError("kvcache events: give --credentials FILE, --token or --no-auth")
    creds = Credentials.load(args.credentials)
    if args.admin:
        if creds.admin_token is None:
            raise ConfigError(f"{args.credentials} holds no admin_token")
        return {"admin_token": creds.admin_token}
    tenant = creds.tenant(args.tenant)
    if tenant is None:
        raise ConfigError(f"{args.credentials} has no tenant {args.tenant!r}")
    return {"tenant": tenant.name, "secret": tenant.secret}


def _check_endpoint(endpoint: str, flag: str) -> None:
    """A ZeroMQ endpoint a subscriber can connect to: tcp://host:port (port 1-65535) or
    ipc://path; anything else is refused here, not by zmq with a traceback."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if (
        not endpoint.startswith("tcp://")
        or not sep
        or not host
        or not port.isdigit()
        or not (0 < int(port) < 65536)
    ):
        raise ConfigError(f"{flag} {endpoint!r} must be tcp://host:port (1-65535) or ipc://path")


def _endpoints(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(node label, PUB endpoint, replay endpoint) per daemon."""
    if args.endpoint:
        replays = list(args.replay_endpoint) + [None] * len(args.endpoint)
        out = []
        for pub, replay in zip(args.endpoint, replays, strict=False):
            _check_endpoint(pub, "--endpoint")
            if replay is None:
                base, _, port = pub.rpartition(":")
                if not port.isdigit() or int(port) >= 65535:
                    raise ConfigError(f"--endpoint {pub!r}: give --replay-endpoint too")
                replay = f"{base}:{int(port) + 1}"
            _check_endpoint(replay, "--replay-endpoint")
            out.append((pub.removeprefix("tcp://"), pub, replay))
        return out
    if args.cluster_file is None:
        raise ConfigError("kvcache events: give --endpoint or --cluster-file")
    static, _etcd = read_cluster_file(args.cluster_file)
    if static is None:
        raise ConfigError(f"{args.cluster_file} lists no nodes")
    found = []
    for node in static.nodes:
        try:
            with urllib.request.urlopen(node.admin + "/stats", timeout=5) as resp:
                stats = json.loads(resp.read())
            events = stats.get("events") if isinstance(stats, dict) else None
            if events and not (
                isinstance(events, dict)
                and isinstance(events.get("endpoint"), str)
                and isinstance(events.get("replay_endpoint"), str | None)
            ):
                raise ValueError(f"its events entry is not what a daemon reports: {events!r}")
        except (OSError, ValueError) as exc:
            log.warning("%s: no usable /stats (%s): skipped", node.id, exc)
            continue
        if events:
            found.append((node.id, events["endpoint"], events.get("replay_endpoint")))
    if not found:
        raise ClusterError(f"no node of {args.cluster_file} publishes events (events_listen)")
    return found


def _lines(node: str, item: Delivery | Resync, *, as_json: bool) -> list[str]:
    if isinstance(item, Resync):
        tenant = item.topic.decode(errors="replace")
        if as_json:
            return [json.dumps({"node": node, "topic": tenant, "resync": True,
                                "missing_from": item.missing_from, "resume_at": item.resume_at,
                                "reason": item.reason})]  # fmt: skip
        return [f"{node} {tenant} RESYNC batches {item.missing_from}..{item.resume_at - 1} "
                f"lost: {item.reason}"]  # fmt: skip
    tenant = item.tenant or "?"
    return [
        format_event(node, tenant, item.seq, event, as_json=as_json) for event in item.batch.events
    ]


def format_event(
    node: str,
    tenant: str,
    seq: int,
    event: BlockStored | BlockRemoved | AllBlocksCleared,
    *,
    as_json: bool = False,
) -> str:
    """One line for one event."""
    name = type(event).__name__
    if isinstance(event, AllBlocksCleared):
        fields: dict[str, Any] = {}
    else:
        fields = {
            "medium": event.medium,
            "keys": [h.hex() if isinstance(h, bytes) else h for h in event.block_hashes],
            "shards": event.kvcache_shards,
            "holders": event.kvcache_holders,
            "class": event.kvcache_class,
        }
        if isinstance(event, BlockRemoved):
            fields["cause"] = event.kvcache_cause
    if as_json:
        doc = {"node": node, "tenant": tenant, "seq": seq, "event": name}
        doc |= {k: v for k, v in fields.items() if v is not None}
        return json.dumps(doc)
    parts = [node, tenant, f"#{seq}", name]
    if fields:
        parts.append(str(fields["medium"]))
        if fields.get("cause"):
            parts.append(str(fields["cause"]))
        if fields["class"]:
            parts.append(f"class={fields['class']}")
        keys = fields["keys"]
        shown = " ".join(str(k) for k in keys[:3])
        parts.append(f"n={len(keys)} {shown}" + (f" +{len(keys) - 3}" if len(keys) > 3 else ""))
        if fields["holders"]:
            parts.append("holder=" + ",".join(fields["holders"]))
    return " ".join(parts)
