"""Benchmark: whole-model checkpointing for a memory budget.

    python benchmarks/whole_model/run.py          # all models: results/latest/whole_model.*
    python benchmarks/whole_model/run.py --update-results   # the committed results
    python benchmarks/whole_model/run.py --tiny   # the U-Net at 16x16: a smoke test, < 1 min
    python benchmarks/whole_model/run.py --rerender benchmarks/results/whole_model.json

Each model runs in a subprocess of its own (a fresh allocator), as one
``tf.function`` training step (SGD), under every strategy (the plans made first,
on the fresh allocator, as on a user's first training step): plain, per-layer
selections (``apply_checkpointing(model, [cls])``), hand-written per-block
checkpointing (a plan whose regions are exactly the model's blocks, which is
what ``checkpointable`` on each block runs), ``budget="min"`` and budgets
between the least and plain; plans for an XLA step are measured under
``jit_compile=True``. Peaks come from the BFC allocator (the median of
five steps, and their largest); step times are medians, as ratios to plain
in the same process. For the decoder (gpt2), the
budget plans are also made with ``policies="auto"`` (a save policy per region),
and every ``tf.function`` strategy is timed again with plain in interleaved
rounds (the step times reported). The models: ``models.py``; the fresh process
that reads a strategy's peaks: ``peaks.py``; the table, targets and plot:
``report.py``.

``--tiny`` runs the tiny U-Net with plain and the halfway budget (``--models unet
--budgets 1 --only 'budget 0.50'`` unless given): the whole path, the least plan
made and the peaks read in fresh processes, in 30-60 s on 2 cores.

This module is both the parent process (which starts one worker process per model
and writes the report) and the worker (``--worker``): TensorFlow and the library are
imported inside the worker's functions, so the parent never loads them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

# Sets TF_CPU_ALLOCATOR_USE_BFC, TF_CPP_MIN_LOG_LEVEL and TF_ENABLE_ONEDNN_OPTS (peaks that
# do not depend on the host CPU), which the per-model subprocesses inherit.
from benchmarks import _cli  # noqa: E402
from benchmarks.report import MIB  # noqa: E402
from benchmarks.whole_model import report  # noqa: E402
from benchmarks.whole_model.models import MODELS, build, training_step  # noqa: E402
from benchmarks.whole_model.peaks import fresh_peaks  # noqa: E402

PEAK_STEPS = 5  # steps whose peaks are measured per strategy
# What --tiny runs unless --models, --budgets or --only say otherwise.
TINY = dict(models="unet", budgets=1, only="budget 0.50")
# Models whose budget plans are also made with save policies (policies="auto"):
# the decoder, where keeping the products pays (the policy target).
POLICY_MODELS = ("gpt2",)


def _batch(inputs: Any) -> int:
    import tensorflow as tf

    return int(tf.nest.flatten(inputs)[0].shape[0])


def worker(name: str, tiny: bool, budgets: int, only: str = "", rounds: int = 7) -> list[dict]:
    """Measures every strategy on one model (run in its own process); with
    ``only`` (a regular expression), the strategies whose names match it (and plain)."""
    with _cli.quiet_start_up():
        import keras

        import tf_checkpointing as tc
        from tf_checkpointing.core._memory import grow_cpu_pool

    # Before the model is built: XLA's one buffer is cut from one large region,
    # not counted as the region it would open (see _memory.grow_cpu_pool).
    grow_cpu_pool()
    model, batch_of, blocks, batch = build(name, tiny)
    x = batch_of(batch)
    model(x)
    optimizer = keras.optimizers.SGD(1e-3)
    rows: list[dict] = []
    steps: dict[bool, dict[str, Any]] = {False: {}, True: {}}  # traced steps, per jit, for
    # the interleaved timing

    def wanted(strategy: str) -> bool:
        return strategy == "plain" or not only or re.search(only, strategy) is not None

    def measure(strategy: str, spec: dict, jit: bool = False, inputs: Any = x,
                **extra: Any) -> dict:
        step = training_step(model, optimizer, jit)
        step(inputs).numpy()  # trace (and plan) outside the measurement
        # The peak in a process of its own, as a user's run (see peaks.py):
        # the median of a few steps (the executor's op order moves a U-Net step's
        # peak by up to 6 MiB of 25), and their largest (what must fit).
        # One more step traced: the peak of its tensors (requested bytes), which the
        # planner models, beside the allocator's chunks (see
        # tf_checkpointing.planning.measuring._requested).
        peaks = fresh_peaks(name, tiny, dict(spec, jit=jit, batch=_batch(inputs)),
                            1 if tiny else PEAK_STEPS, tensors=not tiny)
        tensor_mib = None if tiny else peaks.pop()
        shared = [tc.debug.measure(lambda: step(inputs).numpy()).peak_bytes / MIB
                  for _ in range(1 if tiny else 3)]
        times = []
        for _ in range(1 if tiny else 3):
            started = time.perf_counter()
            step(inputs).numpy()
            times.append(time.perf_counter() - started)
        if "plan" in spec:  # which plan it was: two strategies may have made the same one
            extra.setdefault("pieces", [piece for piece in spec["plan"]["pieces"] if piece[2]])
        row = dict(model=name, strategy=strategy, xla=jit, peak_mib=statistics.median(peaks),
                   peak_max_mib=max(peaks), peaks_mib=[round(p, 2) for p in peaks],
                   tensor_peak_mib=tensor_mib,
                   # here, after the strategies before it: the allocator's history
                   peak_shared_mib=statistics.median(shared),
                   step_s=statistics.median(times), **extra)
        if inputs is x:
            steps[jit][strategy] = (step, inputs)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        return row

    def reset() -> None:
        vars(model).pop("call", None)
        for layer in model._flatten_layers(include_self=False, recursive=True):  # noqa: SLF001
            vars(layer).pop("call", None)

    # Every plan first, while the allocator holds only the model, as on a user's first
    # training step: after other steps have run in the process the weights sit in
    # chunks scattered through the pool, the profile's per-call readings are chunks
    # larger than their tensors, and the plans come out less aggressive (ResNet50's
    # least plan predicted at 153 MiB after three plain steps, 124 before).
    plans = _plans(model, x, budgets, wanted, xla=wanted("XLA"),
                   policies=name in POLICY_MODELS)
    least = plans["graph"][0][1]
    plain = measure("plain", {})
    if name in ("resnet50", "unet") and wanted("per-layer"):
        for cls in ("Conv2D", "BatchNormalization", "Activation"):
            tc.apply_checkpointing(model, [getattr(keras.layers, cls)])
            measure(f"per-layer {cls}", dict(select=cls))
            reset()
        tc.apply_checkpointing(model, lambda layer: not isinstance(layer, keras.layers.InputLayer))
        measure("per-layer every layer", dict(select="every"))
        reset()
    # Each block as one region: the layer calls from its first layer's to its last's.
    names = list(least.names)
    hand = tc.ModelPlan.from_regions(model, [names[names.index(b[0]):names.index(b[-1]) + 1]
                                             for b in blocks])
    if wanted("hand-written per-block"):
        tc.apply_checkpointing(model, plan=hand)
        measure("hand-written per-block", dict(plan=hand.to_config()),
                regions=len(hand.regions))
    for label, plan, fraction, plan_s in plans["graph"]:
        if not wanted(label):
            continue
        tc.apply_checkpointing(model, plan=plan)
        measure(label, dict(plan=plan.to_config()), budget_mib=_budget_mib(plan),
                predicted_mib=plan.predicted_peak_bytes / MIB, fraction=fraction,
                plan_s=plan_s, regions=len(plan.regions),
                extra_forward=plan.extra_forward_layers,
                predicted_extra_ms=plan.predicted_extra_seconds * 1e3,
                policy_regions=sum(p.policy is not None for p in plan.pieces))
        if "policies" in label:
            print(plan, file=sys.stderr, flush=True)
    _interleaved(name, steps[False], rounds, rows, xla=False)
    reset()
    if not wanted("XLA"):
        return rows
    measure("plain", {}, jit=True)
    if wanted("hand-written per-block"):  # what checkpointable on each block runs, under XLA
        reset()
        tc.apply_checkpointing(model, plan=hand)
        measure("hand-written per-block", dict(plan=hand.to_config()), jit=True,
                regions=len(hand.regions))
    if "error" in plans:
        rows.append(dict(model=name, strategy="budget (XLA)", xla=True, error=plans["error"]))
    rows += [dict(row, model=name) for row in plans.get("refused", ())]
    for label, plan, fraction, _ in plans["xla"]:
        reset()
        tc.apply_checkpointing(model, plan=plan)
        measure(label, dict(plan=plan.to_config()), jit=True, budget_mib=_budget_mib(plan),
                fraction=fraction, regions=len(plan.regions),
                predicted_mib=plan.predicted_peak_bytes / MIB)
    _interleaved(name, steps[True], rounds, rows, xla=True)
    if name == "resnet50" and not tiny and wanted("budget=min, batch x2.5"):
        big = batch_of(batch * 5 // 2)
        reset()
        tc.apply_checkpointing(model, budget="min")
        measure("budget=min, batch x2.5", dict(budget="min"), inputs=big, batch=batch * 5 // 2,
                plain_batch16_peak_mib=plain["peak_mib"])
    return rows


def _budget_mib(plan: Any) -> float:
    """What a plan was made for, in MiB: its budget, or the least budget for "min"."""
    budget = plan.budget_bytes
    return (plan.min_budget_bytes if budget in (None, "min") else budget) / MIB


def _plans(model: Any, x: Any, budgets: int, wanted: Any, *, xla: bool,
           policies: bool) -> dict:
    """Every plan the worker measures, as ``(label, plan, fraction, planning s)``
    per step kind (``"graph"``, ``"xla"``): the least, ``budgets`` budgets evenly
    between the least and plain, and half of the plain step's peak ("budget 1/2
    plain", issue 50's target: at most 1.10x plain's step time, at most 0.525x its
    peak; under XLA half of the XLA step's); for the decoder also the budget plans
    made with ``policies="auto"``: at the halfway budget (beside "budget 0.50") and
    at half the plain peak (the policy target: at most 1.15x plain's step time,
    within the budget). An XLA planning error is kept as ``"error"``, a half budget
    below the least budget as a row of ``"refused"``."""
    import tf_checkpointing as tc

    fractions = [(k + 1) / (budgets + 1) for k in range(budgets)]
    out: dict = {"graph": [], "xla": []}
    started = time.perf_counter()
    least = tc.plan_model(model, x, budget="min", mode="graph")
    out["graph"].append(("budget=min", least, 0.0, time.perf_counter() - started))

    def between(plan: Any, fraction: float) -> int:
        return int(plan.min_budget_bytes + fraction * (plan.plain_peak_bytes
                                                       - plan.min_budget_bytes))

    for fraction in fractions:
        if wanted(f"budget {fraction:.2f}"):
            out["graph"].append((f"budget {fraction:.2f}", tc.plan_model(
                model, x, budget=between(least, fraction), mode="graph"), fraction, None))
    half_plain = least.plain_peak_bytes // 2
    wanted_plans = [("budget 1/2 plain", half_plain, None)]
    if policies:
        wanted_plans += [("budget 0.50 policies=auto", between(least, 0.5), "auto"),
                         ("budget 1/2 plain policies=auto", half_plain, "auto")]
    for label, budget, chosen in wanted_plans:
        if wanted(label) and budget >= least.min_budget_bytes:
            started = time.perf_counter()
            plan = tc.plan_model(model, x, budget=budget, mode="graph", policies=chosen)
            out["graph"].append((label, plan, None, time.perf_counter() - started))
        elif wanted(label):
            out.setdefault("refused", []).append(dict(strategy=label, xla=False, error=(
                f"below the least budget ({least.min_budget_bytes / 2**20:.1f} MiB)")))
    if not xla:
        return out
    try:
        xla_least = tc.plan_model(model, x, budget="min", mode="xla")
        out["xla"].append(("budget=min", xla_least, 0.0, None))
        # The least plan's numbers are the tf.function step's (ModelPlan.predicted_for); a
        # budget at plain's peak measures the XLA steps, whose least and plain it reports.
        anchored = tc.plan_model(model, x, budget=2**50, mode="xla")
        for fraction in fractions:
            out["xla"].append((f"budget {fraction:.2f}", tc.plan_model(
                model, x, budget=between(anchored, fraction), mode="xla"), fraction, None))
        half_xla = anchored.plain_peak_bytes // 2  # half of the XLA step's plain peak
        if wanted("budget 1/2 plain") and half_xla >= anchored.min_budget_bytes:
            out["xla"].append(("budget 1/2 plain", tc.plan_model(
                model, x, budget=half_xla, mode="xla"), None, None))
        elif wanted("budget 1/2 plain"):
            out.setdefault("refused", []).append(dict(strategy="budget 1/2 plain", xla=True, error=(
                f"below the least budget ({anchored.min_budget_bytes / 2**20:.1f} MiB)")))
    except Exception as error:  # noqa: BLE001 - reported in the table
        out["error"] = repr(error)
    return out


def _interleaved(name: str, steps: dict, rounds: int, rows: list[dict], xla: bool) -> None:
    """Step time x plain of every strategy of one kind (``xla``: the XLA steps,
    else the ``tf.function`` ones), timed in interleaved rounds (each round runs
    every step once, in a rotating order; the median of the per-round ratios): on
    a shared machine the one-after-another medians drift (ResNet50's halfway plan
    read 1.35x plain one after another, 1.18x interleaved with plain; the U-Net's
    halfway XLA plan 1.46x and 1.07x)."""
    names = list(steps)
    if len(names) < 2:
        return
    ratios: dict[str, list[float]] = {s: [] for s in names}
    for k in range(rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        seconds = {}
        for strategy in order:
            step, inputs = steps[strategy]
            started = time.perf_counter()
            step(inputs).numpy()
            seconds[strategy] = time.perf_counter() - started
        for strategy in names:
            ratios[strategy].append(seconds[strategy] / seconds["plain"])
    for row in rows:
        if row["model"] == name and row.get("xla", False) == xla and row["strategy"] in ratios:
            row["step_x_plain_interleaved"] = statistics.median(ratios[row["strategy"]])
            row["interleaved_rounds"] = rounds
    print(json.dumps({f"{s}{' (XLA)' if xla else ''}": round(statistics.median(r), 3)
                      for s, r in ratios.items()}), file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help=f"small shapes (smoke test); unless given: {TINY}")
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)} "
                        "(default: all)")
    parser.add_argument("--budgets", type=int, help="budgets between min and plain (default 3)")
    parser.add_argument("--only", help="a regular expression: run only the "
                        "strategies whose names match it (and plain), e.g. 'budget 0.50|"
                        "1/2 plain'; 'XLA' selects the XLA rows")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved timing rounds (step time x plain)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="models measured at once (peaks are per process; step-time "
                        "ratios scatter more on a shared machine)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    _cli.add_rerender_argument(parser)
    args = parser.parse_args()
    if args.rerender:
        rows = json.loads(args.rerender.read_text())
        report.write(rows, args.rerender.with_suffix(""), write_json=False)
        return
    defaults = TINY if args.tiny else dict(models=",".join(MODELS), budgets=3, only="")
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.worker:
        print(json.dumps(worker(args.worker, args.tiny, args.budgets, args.only,
                                args.rounds)))
        return
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")

    def measured(name: str) -> subprocess.CompletedProcess:
        command = [sys.executable, __file__, "--worker", name, "--budgets", str(args.budgets),
                   "--only", args.only, "--rounds", str(args.rounds)]
        return subprocess.run(command + (["--tiny"] if args.tiny else []), env=env,
                              capture_output=True, text=True, check=False)

    rows: list[dict] = []
    names = args.models.split(",")
    # A pool of `parallel` workers, each a process of its own; rows in model order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for name, done in zip(names, pool.map(measured, names)):
            sys.stderr.write(done.stderr)
            if done.returncode != 0:
                rows.append(dict(model=name, strategy="(failed)", error=done.stderr[-2000:]))
                continue
            rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
    report.write(rows, _cli.output_dir(args) / "whole_model", parallel=args.parallel)
    if any(r["strategy"] == "(failed)" for r in rows):
        sys.exit(1)  # in the table too; the exit status says so to a script or a test


if __name__ == "__main__":
    main()
