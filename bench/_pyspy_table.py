"""Summarise a ``py-spy record --subprocesses --format raw`` file by process role.

Roles: ``daemon`` (``kvcache.cli server``), ``io`` (``kvcache.client.pool_worker``),
``main`` (everything else). For each role: its share of all samples, then the functions
with the most samples on top of the stack (self) and anywhere in it (inclusive), as
percentages of the role's samples. Used by ``scripts/profile-gpu.sh``; kept out of CI.

Usage: python bench/_pyspy_table.py PROFILE.txt [--top N]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_PROCESS = re.compile(r'^process \d+:"(.*)"$', re.S)


def role_of(cmdline: str) -> str:
    """The role of a process, from its command line."""
    if "kvcache.cli server" in cmdline:
        return "daemon"
    if "kvcache.client.pool_worker" in cmdline:
        return "io"
    return "main"


def function_of(frame: str) -> str:
    """``name (file)`` of a ``name (file:line)`` frame: lines of one function together."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    text = Path(args.profile).read_text(encoding="utf-8", errors="replace")
    # A command line may hold newlines: a sample is a line that ends in " <count>".
    samples = re.findall(r"(.*?) (\d+)\n", text, re.S)
    self_n: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl_n: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for stack, count in samples:
        n = int(count)
        frames = stack.strip().split(";")
        role, code = "main", []
        for frame in frames:
            found = _PROCESS.match(frame)
            if found:
                role = role_of(found.group(1))
            else:
                code.append(function_of(frame))
        if not code:
            continue
        totals[role] += n
        self_n[role][code[-1]] += n
        for name in set(code):
            incl_n[role][name] += n
    everything = sum(totals.values()) or 1
    for role, total in totals.most_common():
        print(f"\n## {role}: {total} samples, {100 * total / everything:.1f}% of all")
        for title, table in (("self", self_n[role]), ("inclusive", incl_n[role])):
            print(f"\n### {role}, {title}")
            for name, n in table.most_common(args.top):
                print(f"{100 * n / total:6.1f}%  {name}")


if __name__ == "__main__":
    main()
