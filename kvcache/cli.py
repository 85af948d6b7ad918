"""The ``kvcache`` command: one entry point, one subcommand module per area.

Each area module exposes ``register(subparsers)``, which adds its subcommands
and sets ``func`` (taking the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvcache import __version__
from kvcache.errors import KVCacheError
from kvcache.logs import add_logging_flags, configure_logging

__all__ = ["main"]

#: Modules that add subcommands, in the order they appear in ``--help``.
_AREAS = (
    "kvcache.server.cli",
    "kvcache.client.cli",
    "kvcache.retention.cli",
    "kvcache.dashboard.cli",
    "kvcache.swa_local.cli",
    "kvcache.membership.cli",
    "kvcache.repair.cli",
    "kvcache.sim.cli",
    "kvcache.events.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every area's subcommands."""
    parser = argparse.ArgumentParser(
        prog="kvcache",
        description="Distributed KV-cache storage for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    add_logging_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    _inherit_logging_flags(parser)
    return parser


def _inherit_logging_flags(parser: argparse.ArgumentParser) -> None:
    """Accept ``--log-level`` / ``--log-format`` after any subcommand too
    (``kvcache server --log-format json``), as a service unit writes them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                add_logging_flags(subparser, inherited=True)
                _inherit_logging_flags(subparser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcache`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        configure_logging(args.log_level, args.log_format)
        return int(args.func(args))
    except KVCacheError as exc:
        print(f"kvcache: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
