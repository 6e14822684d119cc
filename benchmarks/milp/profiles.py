"""The planner's problems on the benchmark models, recorded for the MILP.

One process per model (a fresh allocator, as the whole-model benchmark): the
model of ``benchmarks/whole_model/models.py`` is planned with ``plan_model`` in
``mode="graph"`` for its least plan and five budgets from the least to plain's
peak, and every call of the region program is recorded: the exact
``RegionModel``, nested options and limit the planner solved, with the program's
answer and time. The recording is pickled, so that the MILP (``run.py``) runs
on the planner's own problems without profiling the model again.

    python benchmarks/milp/profiles.py unet /tmp/milp/unet.pkl
"""

from __future__ import annotations

import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402
from benchmarks.whole_model.models import build, training_step  # noqa: E402

# Budgets as shares of the way from the least budget accepted to plain's peak.
SHARES = (0.0, 0.25, 0.5, 0.75, 0.95)


def record(name: str, tiny: bool = False) -> dict:
    """The planner's problems on model ``name`` (see the module)."""
    with _cli.quiet_start_up():
        import keras

        import tf_checkpointing as tc
        from tf_checkpointing.planning.solving import _planning

    model, batch_of, _, batch = build(name, tiny)
    x = batch_of(batch)
    model(x)
    calls: list[dict] = []
    solve, nested_options = _planning.solve, _planning.nested_options

    def recorded_solve(region_model: Any, limit: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        found = solve(region_model, limit, **kwargs)
        calls.append(dict(model=region_model, limit=limit, nested=kwargs.get("nested"),
                          found=found, seconds=time.perf_counter() - began))
        return found

    def timed_nested(region_model: Any, *args: Any, **kwargs: Any) -> dict:
        began = time.perf_counter()
        options = nested_options(region_model, *args, **kwargs)
        timings["nested_s"] = time.perf_counter() - began
        return options

    timings: dict = {}
    _planning.solve, _planning.nested_options = recorded_solve, timed_nested
    plans = []
    try:
        began = time.perf_counter()
        least = tc.plan_model(model, x, budget="min", mode="graph")
        timings["least_plan_s"] = time.perf_counter() - began
        for share in SHARES:
            budget = int(least.min_budget_bytes
                         + share * (least.plain_peak_bytes - least.min_budget_bytes))
            began, before = time.perf_counter(), len(calls)
            plan = tc.plan_model(model, x, budget=budget, mode="graph")
            plans.append(dict(share=share, budget=budget, plan_s=time.perf_counter() - began,
                              predicted_peak=plan.predicted_peak_bytes,
                              predicted_extra_s=plan.predicted_extra_seconds,
                              regions=len(plan.regions), solves=list(range(before, len(calls)))))
    finally:
        _planning.solve, _planning.nested_options = solve, nested_options
    step = training_step(model, keras.optimizers.SGD(1e-3), jit=False)
    step(x).numpy()
    times = []
    for _ in range(5):
        began = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - began)
    return dict(name=name, n=len(least.names), plain_peak=least.plain_peak_bytes,
                min_budget=least.min_budget_bytes, least_peak=least.predicted_peak_bytes,
                plain_step_s=statistics.median(times), plans=plans, calls=calls, **timings)


if __name__ == "__main__":
    out = Path(sys.argv[2])
    got = record(sys.argv[1], tiny="--tiny" in sys.argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(pickle.dumps(got))
    print(f"{sys.argv[1]}: {got['n']} calls, {len(got['calls'])} solves -> {out}")
