"""Several runs of one benchmark, as one JSON: the median as each figure, with its range.

``scripts/engine-gpu.sh`` and ``scripts/peers-gpu.sh`` run their benchmark 3 times in one
call and combine the JSONs here. For every number ``k`` of the runs' JSON objects the result
holds ``k`` (the median over the runs that have it), ``k_runs`` (each run's value, in run
order) and ``k_range`` ([min, max]); a flag is true only if it is true in every run; a
nested object or a list of objects (one per sweep setting, say) is combined field by field
the same way; any other value is kept when every run agrees, else listed under ``k_runs``.
Each figure's median is taken on its own, so a ratio's median need not equal the ratio
of the medians. NaN (a figure a run could not measure) is left out of the median.

Usage: python bench/_runs.py --json OUT [--keys K1,K2,...] RUN1.json RUN2.json ...
(prints a table of the figures named by ``--keys``, default every top-level number).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _median(values: list[float]) -> float:
    real = [v for v in values if not math.isnan(v)]
    return float(statistics.median(real)) if real else float("nan")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One object from several: see the module docstring."""
    if not runs:
        raise ValueError("no runs to combine")
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for run in runs for k in run))
    for key in keys:
        values = [run[key] for run in runs if key in run]
        if all(_number(v) for v in values):
            floats = [float(v) for v in values]
            real = [v for v in floats if not math.isnan(v)]
            out[key] = _median(floats)
            if all(isinstance(v, int) for v in values) and out[key].is_integer():
                out[key] = int(out[key])
            out[f"{key}_runs"] = values
            out[f"{key}_range"] = [min(real), max(real)] if real else [math.nan, math.nan]
        elif all(isinstance(v, bool) for v in values):
            out[key] = all(values)
            if not all(v == values[0] for v in values):
                out[f"{key}_runs"] = values
        elif all(isinstance(v, dict) for v in values):
            out[key] = combine(values)
        elif (
            all(isinstance(v, list) for v in values)
            and len({len(v) for v in values}) == 1
            and all(isinstance(x, dict) for v in values for x in v)
        ):
            out[key] = [combine([v[i] for v in values]) for i in range(len(values[0]))]
        elif all(v == values[0] for v in values):
            out[key] = values[0]
        else:
            out[key] = values[0]
            out[f"{key}_runs"] = values
    return out


def rows(combined: dict[str, Any], keys: list[str]) -> list[list[str]]:
    """Table rows: figure, median, range, each run."""
    table = []
    for key in keys:
        if f"{key}_runs" not in combined or not _number(combined.get(key)):
            continue
        lo, hi = combined[f"{key}_range"]
        runs = ", ".join(f"{v:.2f}" for v in combined[f"{key}_runs"])
        table.append([f"`{key}`", f"{combined[key]:.2f}", f"{lo:.2f}–{hi:.2f}", runs])
    return table


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import print_table, write_json

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", type=Path, required=True, help="where the combined JSON goes")
    p.add_argument("--keys", default="", help="comma-separated figures for the printed table")
    p.add_argument("--title", default="Median and range over the runs")
    p.add_argument("runs", type=Path, nargs="+")
    args = p.parse_args()
    runs = [json.loads(path.read_text()) for path in args.runs]
    combined = combine(runs)
    combined["runs"] = len(runs)
    keys = [k for k in args.keys.split(",") if k] or [k for k, v in runs[0].items() if _number(v)]
    print_table(
        f"{args.title} ({len(runs)} runs)", ["figure", "median", "range", "runs"],
        rows(combined, keys),
    )  # fmt: skip
    write_json(args.json, combined)


if __name__ == "__main__":
    main()
