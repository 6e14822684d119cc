"""Benchmark: the whole-model planner against the exact optimum of its problem.

    python benchmarks/milp/run.py                       # all models: results/latest/
    python benchmarks/milp/run.py --models unet gpt2 --time-limit 600 --update-results
    python benchmarks/milp/run.py --tiny                # the tiny U-Net, < 1 min

For each benchmark model (``benchmarks/whole_model/models.py``), a process of
its own plans it with ``plan_model(mode="graph")`` at its least budget and four
more up to plain's peak, recording the region program's problems
(``profiles.py``; pickled in ``--cache``, reused on the next run). Each budget's
problem (the ``RegionModel``, nested options and limit the planner solved) is
then solved by the MILP of ``regions_milp.py`` with HiGHS, with held bytes
exact and rounded up to the program's units (the problem of the program with
every step rounded up, which the planner runs beside one rounded to the nearest
unit: docs/decisions/0049), within ``--time-limit`` seconds.
Reported: the planner's predicted extra work (recomputation seconds) and peak,
the MILP optimum's, both solve times, and the predicted step time (plain's
measured step plus the extra work) of each; the target is the planner at most
5% above the optimum wherever the MILP finishes.
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402
from benchmarks.report import MIB, environment, table, write_json  # noqa: E402

TARGET = 1.05  # the planner's predicted time at most this much above the optimum
FINER = 4  # the program run again with this many times its units


def _recorded(name: str, tiny: bool, cache: Path) -> dict:
    """The planner's problems on ``name``, profiled in a fresh process once."""
    path = cache / f"{name}{'_tiny' if tiny else ''}.pkl"
    if not path.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("profiles.py")), name,
                        str(path), *(["--tiny"] if tiny else [])], check=True)
    return pickle.loads(path.read_bytes())


def compare(recorded: dict, time_limit: float, units_check: int) -> list[dict]:
    """One row per budget: the planner's plan and the MILP optimum of its problem
    (and, on models of at most ``units_check`` calls, the MILP of the program's
    own problem, held bytes in its units, which must give the program's value)."""
    from benchmarks.milp import regions_milp as rm
    from tf_checkpointing.planning._constants import REGION_UNITS
    from tf_checkpointing.planning.solving._region_solver import solve

    rows = []
    for plan in recorded["plans"]:
        row = dict(model=recorded["name"], n=recorded["n"], share=plan["share"],
                   budget_mib=plan["budget"] / MIB,
                   predicted_peak_mib=plan["predicted_peak"] / MIB,
                   planner_extra_s=plan["predicted_extra_s"], plan_s=plan["plan_s"],
                   regions=plan["regions"])
        budget_solves = [recorded["calls"][k] for k in plan["solves"]
                         if recorded["calls"][k]["limit"] is not None]
        if not budget_solves:  # plain (budget at plain's peak) or a user's selection
            row["note"] = "no region program run (plain or a block selection)"
            rows.append(row)
            continue
        call = budget_solves[-1]
        model, limit, found = call["model"], call["limit"], call["found"]
        problem = rm.region_problem(model, call["nested"])
        row.update(limit_mib=limit / MIB, steps=problem.size, dp_s=call["seconds"],
                   dp_extra_s=None if found is None else found.value,
                   dp_model_peak_mib=None if found is None else model.peak(
                       found.spans, policies=found.policies) / MIB)
        exact = rm.solve_milp(problem, limit, time_limit=time_limit)
        row.update(milp_status=exact.status, milp_s=exact.seconds, milp_extra_s=exact.value,
                   milp_gap=exact.gap, milp_regions=None if exact.solution is None
                   else len(exact.solution.spans),
                   milp_model_peak_mib=None if exact.solution is None else model.peak(
                       exact.solution.spans, policies=exact.solution.policies) / MIB)
        # The program with every step's bytes rounded up (without the run rounded to
        # the nearest unit), whose own problem the MILP solves with held bytes in units.
        up = solve(model, limit, nested=call["nested"], nearest=False)
        row["dp_up_extra_s"] = None if up is None else up.value
        if model.n <= units_check:  # the rounded-up program's own problem: the same optimum
            same = rm.solve_milp(rm.rounded(problem, limit / REGION_UNITS), limit,
                                 time_limit=time_limit)
            row.update(milp_units_status=same.status, milp_units_s=same.seconds,
                       milp_units_extra_s=same.value)
        # The rounded-up program with finer units: how much of the gap they close.
        began = time.perf_counter()
        finer = solve(model, limit, nested=call["nested"], units=FINER * REGION_UNITS,
                      nearest=False)
        row.update(dp_finer_s=time.perf_counter() - began,
                   dp_finer_extra_s=None if finer is None else finer.value)
        plain_s = recorded["plain_step_s"]
        if exact.status == "optimal" and found is not None:
            row["extra_ratio"] = found.value / exact.value if exact.value > 0 else (
                1.0 if found.value == 0 else float("inf"))
            row["step_ratio"] = (plain_s + found.value) / (plain_s + exact.value)
            row["target_met"] = row["step_ratio"] <= TARGET
        rows.append(row)
        print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(row: dict) -> str:
    return (f"{row['model']} share {row['share']:.2f}: planner {row.get('dp_extra_s')} s "
            f"({row.get('dp_s', 0):.2f} s), MILP {row.get('milp_extra_s')} s "
            f"[{row.get('milp_status')}, {row.get('milp_s', 0):.1f} s]")


def report(rows: list[dict], recorded: list[dict]) -> str:
    """The Markdown table and the target's verdict."""
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    body = [[r["model"], f"{r['share']:.2f}", fmt(r["budget_mib"], ".1f"),
             fmt(r["predicted_peak_mib"], ".1f"), fmt(r.get("dp_extra_s"), ".4f"),
             fmt(r.get("dp_s"), ".2f"), fmt(r.get("milp_extra_s"), ".4f"),
             r.get("milp_status", r.get("note", "-")), fmt(r.get("milp_s"), ".1f"),
             fmt(r.get("dp_up_extra_s"), ".4f"), fmt(r.get("milp_units_extra_s"), ".4f"),
             fmt(r.get("dp_finer_extra_s"), ".4f"),
             fmt(r.get("extra_ratio"), ".3f"),
             fmt(r.get("step_ratio"), ".3f"),
             {True: "met", False: "NOT met"}.get(r.get("target_met"), "-")] for r in rows]
    head = ["model", "share", "budget MiB", "predicted peak MiB", "planner extra s",
            "program s", "MILP extra s", "MILP", "MILP s", "rounded up: program extra s",
            "rounded up: MILP (units) extra s", f"rounded up, x{FINER} units: extra s",
            "extra ratio", "step ratio", "<= 1.05x"]
    plain = [f"{r['name']}: {r['n']} calls, plain step {r['plain_step_s'] * 1e3:.0f} ms, "
             f"plain peak {r['plain_peak'] / MIB:.1f} MiB, least budget "
             f"{r['min_budget'] / MIB:.1f} MiB" for r in recorded]
    judged = [r for r in rows if "target_met" in r]
    verdict = (f"Target (planner's predicted step time at most {TARGET}x the MILP optimum's "
               f"where the MILP finishes): met at {sum(r['target_met'] for r in judged)} of "
               f"{len(judged)} budgets; {len(rows) - len(judged)} not judged.")
    return "\n".join(["# The planner against the MILP optimum of its problem", "",
                      *[f"- {line}" for line in plain], "", table(head, body), "", verdict])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["unet", "gpt2", "mobilenetv2",
                                                        "resnet50"])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--units-check", type=int, default=60,
                        help="also solve the program's own problem (units) up to this many calls")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/tf_checkpointing_milp"))
    _cli.add_output_arguments(parser)
    args = parser.parse_args()
    if args.tiny:
        args.models = ["unet"]
    recorded = [_recorded(name, args.tiny, args.cache) for name in args.models]
    rows = [row for got in recorded for row in compare(got, args.time_limit, args.units_check)]
    out = args.out or (_cli.COMMITTED if args.update_results else _cli.LATEST)
    name = "milp_reference" + ("_tiny" if args.tiny else "")
    write_json(out / f"{name}.json", dict(environment=environment(), time_limit_s=args.time_limit,
                                          rows=rows))
    text = report(rows, recorded)
    (out / f"{name}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
