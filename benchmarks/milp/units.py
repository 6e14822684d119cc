"""Benchmark: what the region program's memory units cost, on the planner's own problems.

    python benchmarks/milp/units.py                         # ResNet50, MobileNetV2: results/latest/
    python benchmarks/milp/units.py --update-results        # results/region_units.md
    python benchmarks/milp/units.py --models unet --tiny    # < 1 min

The table of docs/decisions/0049-region-program-rounds-to-the-nearest.md. For
each model, a process of its own records the problem ``plan_model(mode="graph")``
solves (``profiles.py``; pickled in ``--cache``, shared with ``run.py``): the
``RegionModel`` and nested options of its profile. The program is then solved at
limits a share of the way from the least plan's model peak to plain's, in three
ways: every step's held bytes rounded up to 400 units of the limit (before
decision 0049), the planner's own (800 units, rounded to the nearest and checked),
and rounded up to 6400 units. Reported per way: the forward seconds the plan
replays (the program's objective), its model peak over the limit, and the
seconds the program took. No MILP runs here; ``run.py`` has it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402
from benchmarks.milp.run import _recorded  # noqa: E402
from benchmarks.report import environment, table, write_json  # noqa: E402

SHARES = (0.95, 0.9, 0.75, 0.5, 0.25, 0.1, 0.03)
# (label, keyword arguments of solve): the program before decision 0049, the planner's, finer.
WAYS = (("400 units, rounded up", dict(units=400, nearest=False)),
        ("800 units, nearest, checked (the planner)", dict()),
        ("6400 units, rounded up", dict(units=6400, nearest=False)))


def rows_of(recorded: dict) -> list[dict]:
    """One row per share: each way's replay seconds, peak over the limit, solve seconds."""
    from tf_checkpointing.planning.solving._region_solver import solve

    call = recorded["calls"][0]  # every call of one process solves the same profile's model
    model, nested = call["model"], call["nested"]
    least, plain = solve(model, None, nested=nested).value, model.peak(())
    rows = []
    for share in SHARES:
        limit = least + share * (plain - least)
        row: dict[str, Any] = dict(model=recorded["name"], calls=model.n, share=share,
                                   limit_mib=limit / 2**20)
        for label, kwargs in WAYS:
            began = time.perf_counter()
            found = solve(model, limit, nested=nested, **kwargs)
            row[label] = None if found is None else dict(
                replay_ms=found.value * 1e3, seconds=time.perf_counter() - began,
                peak_over_limit=model.peak(found.spans, policies=found.policies) / limit)
        rows.append(row)
        print(f"{row['model']} {share}: " + ", ".join(
            f"{row[label]['replay_ms']:.1f} ms" for label, _ in WAYS if row[label]),
            file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict]) -> str:
    def cell(got: Any) -> str:
        if got is None:
            return "no plan"
        return f"{got['replay_ms']:.2f} ms, {got['peak_over_limit']:.3f}, {got['seconds']:.1f} s"

    body = [[r["model"], str(r["calls"]), f"{r['share']:.2f}", f"{r['limit_mib']:.1f}",
             *(cell(r[label]) for label, _ in WAYS)] for r in rows]
    head = ["model", "calls", "share", "limit MiB", *(label for label, _ in WAYS)]
    return "\n".join([
        "# The region program's memory units", "",
        "Each cell: the forward seconds the plan replays, its model peak over the limit, the",
        "seconds the program took. Limits a share of the way from the least plan's model peak",
        "to plain's (`benchmarks/milp/units.py`).", "", table(head, body)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["resnet50", "mobilenetv2"])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/tf_checkpointing_milp"))
    _cli.add_output_arguments(parser)
    args = parser.parse_args()
    rows = [row for name in args.models for row in rows_of(_recorded(name, args.tiny,
                                                                    args.cache))]
    out = args.out or (_cli.COMMITTED if args.update_results else _cli.LATEST)
    name = "region_units" + ("_tiny" if args.tiny else "")
    write_json(out / f"{name}.json", dict(environment=environment(), rows=rows))
    text = report(rows)
    (out / f"{name}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
