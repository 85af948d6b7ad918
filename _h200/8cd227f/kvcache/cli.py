"""The ``kvcache`` command: one entry point, one subcommand module per area.

Each area module exposes ``register(subparsers)``, which adds its subcommands
and sets ``func`` (taking the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvcache import __version__
from kvcache.errors import KVCacheError

__all__ = ["main"]

#: Modules that add subcommands, in the order they appear in ``--help``.
_AREAS = (
    "kvcache.server.cli",
    "kvcache.client.cli",
    "kvcache.retention.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every area's subcommands."""
    parser = argparse.ArgumentParser(
        prog="kvcache",
        description="Distributed KV-cache storage for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging threshold (default INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcache`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KVCacheError as exc:
        print(f"kvcache: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
