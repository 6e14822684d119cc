"""Show the savings: peak memory, step time, gradient error and largest batch of
gradient checkpointing strategies on three Keras models, in eager, tf.function and XLA.

Usage:
    python benchmarks/run.py                    # --quick: small shapes, ~2 min on 2 cores
    python benchmarks/run.py --full             # larger shapes, every mode
    python benchmarks/run.py --models gpt2 --modes graph,xla --strategies plain,checkpointable
    python benchmarks/run.py --tiny --out /tmp/bench   # what the tests run
    python benchmarks/run.py --rerender benchmarks/results/quick.json   # no measuring

Writes `<size>.md`, `<size>.json` and `<size>.png` to --out (default
benchmarks/results/latest/, ignored by git; --update-results writes the committed
benchmarks/results/ instead; --name changes the file name) and prints the Markdown
table. Modes: "eager", "graph" (tf.function) and "xla" (tf.function(jit_compile=True)),
as the library names them. See benchmarks/README.md.
"""

from __future__ import annotations

import os
import sys
import time

_STARTED = time.perf_counter()
import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# Sets TF_CPU_ALLOCATOR_USE_BFC and TF_CPP_MIN_LOG_LEVEL: before TensorFlow is imported.
from benchmarks import _cli  # noqa: E402

with _cli.quiet_start_up():
    import tensorflow as tf  # noqa: E402
    from tqdm import tqdm  # noqa: E402

    from benchmarks import harness, models, report, run_report  # noqa: E402
    from benchmarks.strategies import POLICIES, STRATEGIES  # noqa: E402

# What each size runs unless --models / --modes say otherwise. Tracing and graph
# optimisation, not the steps, dominate the quick run: 10-15 s per strategy for the
# 12-block decoder under tf.function on 2 shared cores; XLA compiles every step again.
# So --quick runs XLA nowhere (benchmarks/chain/core.py covers XLA on the Dense chain)
# and --full runs every mode on every model.
DEFAULT_MODES: dict[str, dict[str, tuple[str, ...]]] = {
    "tiny": {"mlp": ("eager", "graph", "xla"), "gpt2": ("graph",), "unet": ("graph",)},
    # (eager mode's peaks and times per layer: benchmarks/chain/core.py, a Dense chain)
    "quick": {"mlp": ("graph",), "gpt2": ("graph",), "unet": ("graph",)},
    "full": {m: harness.MODES for m in models.MODELS},
}
# keras.remat is tf.recompute_grad on the TensorFlow backend (keras/src/backend/
# tensorflow/core.py: `return tf.recompute_grad(f)`): same numbers, another 15 s of
# tracing for the decoder, so --quick leaves it to --full and --strategies.
# The save policies run with --full and --strategies (results: benchmarks/results/
# policies_*), as in
# `python benchmarks/run.py --models gpt2 --modes graph,xla --name policies
# --strategies plain,checkpointable,dots_saveable,dots_no_batch,qkv_mlp_out,attn_mlp_out`.
# The plans at half of plain's peak time every block with every policy: --strategies.
_PLANNED_POLICIES = ("policy_plan", "budget_replay", "budget_policies")
DEFAULT_STRATEGIES = {
    # policy_plan plans chains with one tensor state (not the U-Net): --strategies.
    # One save policy smoke-tests the policy path; the others add a third of the
    # tiny run's time (the tests run it) and only differ in what the policy picks.
    # keras_remat is tf.recompute_grad on this backend (see below): its rows would
    # repeat recompute_grad's, for another trace per model and mode.
    "tiny": tuple(s for s in STRATEGIES if s not in _PLANNED_POLICIES and s != "keras_remat"
                  and (s not in POLICIES or s == "dots_saveable")),
    # sqrt segments (a fixed schedule, between per-block and the budget plan) run with
    # --full and --strategies: the quick run stays near two minutes on 2 cores.
    "quick": tuple(s for s in STRATEGIES if s not in ("keras_remat", "sqrt_segments")
                   and s not in POLICIES and s not in _PLANNED_POLICIES),
    "full": tuple(STRATEGIES),
}
DEFAULT_REPEATS = {"tiny": 3, "quick": 5, "full": 7}
# The targets' model and mode get more rounds: on a shared 2-core machine one round's
# time ratio scatters by +-0.1, as much as the 1.35x target's margin.
TARGET_REPEATS = 15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick",
                      help="small shapes, tf.function only, strategies "
                           f"{', '.join(DEFAULT_STRATEGIES['quick'])}: about 2 minutes on "
                           "2 idle CPU cores (default)")
    size.add_argument("--full", dest="size", action="store_const", const="full",
                      help="larger shapes, every model in every mode")
    size.add_argument("--tiny", dest="size", action="store_const", const="tiny",
                      help="toy shapes, for the tests")
    parser.set_defaults(size="quick")
    parser.add_argument("--models", type=_names(models.MODELS),
                        help=f"comma-separated subset of {','.join(models.MODELS)}")
    parser.add_argument("--modes", type=_names(harness.MODES),
                        help=f"comma-separated subset of {','.join(harness.MODES)} "
                             "(default: per size: --quick graph only, --full all, --tiny "
                             "all on the MLP and graph on the others)")
    parser.add_argument("--strategies", type=_names(tuple(STRATEGIES)),
                        help=f"comma-separated subset of {','.join(STRATEGIES)}; plain "
                             "always runs (it is the baseline); default: per size. --full: "
                             f"all. --quick: {', '.join(DEFAULT_STRATEGIES['quick'])}; not "
                             "keras_remat (tf.recompute_grad on this backend), sqrt_segments, "
                             "the save policies, nor the plans at half of plain's peak "
                             f"({', '.join(_PLANNED_POLICIES)}). --tiny: "
                             f"{', '.join(DEFAULT_STRATEGIES['tiny'])}")
    parser.add_argument("--repeats", type=int, help="timed steps per strategy (>= 5 "
                        "for reported numbers; default 5 quick, 7 full; at least "
                        f"{TARGET_REPEATS} for the targets' model and mode)")
    parser.add_argument("--budget-mib", type=int,
                        help="memory budget for the largest-batch column, for every model "
                             "(default: per model and size, see models.SIZES)")
    parser.add_argument("--plan-budget-fraction", type=float, default=1 / 3,
                        help="budget_plan gets this fraction of plain's measured peak "
                             "(default 1/3, the memory target)")
    parser.add_argument("--no-batch-fit", action="store_true",
                        help="skip the largest-batch measurement")
    _cli.add_output_arguments(parser)
    parser.add_argument("--name", help="output file name without extension (default: the "
                        "size: quick, full or tiny)")
    _cli.add_rerender_argument(parser)
    return parser.parse_args(argv)


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(allowed)}; received "
                f"{text!r} (unknown: {','.join(unknown) or 'none given'})")
        return names

    return parse


def _advance(bar: tqdm) -> Callable[[str], None]:
    def advance(strategy: str) -> None:
        bar.set_postfix_str(strategy)
        bar.update()

    return advance


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rerender:
        print("Wrote", *(_shown(p) for p in run_report.rerender(args.rerender)))
        return 0
    repeats = args.repeats or DEFAULT_REPEATS[args.size]
    model_names = args.models or list(models.MODELS)
    strategy_names = ["plain"] + [s for s in (args.strategies or DEFAULT_STRATEGIES[args.size])
                                  if s != "plain"]
    plan = [(m, mode) for m in model_names
            for mode in (args.modes or DEFAULT_MODES[args.size][m])]
    header = dict(size=args.size, started=time.strftime("%Y-%m-%d %H:%M"), repeats=repeats,
                  target_repeats=max(repeats, TARGET_REPEATS),
                  command=" ".join(["python", "benchmarks/run.py", *(argv or sys.argv[1:])]),
                  plan=plan, strategies=strategy_names, budgets={}, group_seconds={},
                  plan_budget_fraction=args.plan_budget_fraction,
                  tf_import_s=time.perf_counter() - _STARTED,
                  load_average_start=list(os.getloadavg()))
    results: list[harness.RunResult] = []
    configs: dict[str, dict[str, int]] = {}
    # A progress bar on a terminal; in a log (not a terminal), one line per group instead
    # of carriage-return updates.
    interactive = sys.stderr.isatty()
    bar = tqdm(total=len(plan) * len(strategy_names), unit="run", dynamic_ncols=True,
               disable=not interactive)
    for model_name in model_names:
        modes = [mode for m, mode in plan if m == model_name]
        if not modes:
            continue
        config = dict(models.SIZES[args.size][model_name])
        if args.budget_mib:
            config["budget_mib"] = args.budget_mib
        configs[model_name] = config
        workload = models.build(model_name, config)
        header["budgets"][model_name] = workload.budget_bytes
        for mode in modes:
            bar.set_description(f"{model_name}/{mode}")
            group_started = time.perf_counter()
            is_target = (model_name, mode) == (run_report.TARGET_MODEL,
                                               run_report.TARGET_MODE)
            group = harness.run_group(
                workload, mode, strategy_names,
                repeats=max(repeats, TARGET_REPEATS) if is_target else repeats,
                batch_fit=not args.no_batch_fit,
                plan_budget_fraction=args.plan_budget_fraction,
                forward_baseline=is_target,
                on_progress=_advance(bar))
            results.extend(group.values())
            seconds = round(time.perf_counter() - group_started, 1)
            header["group_seconds"][f"{model_name}/{mode}"] = seconds
            if not interactive:
                print(f"{model_name}/{mode}: {len(strategy_names)} strategies in {seconds} s",
                      file=sys.stderr, flush=True)
        del workload
    bar.close()
    checks = run_report.check_targets(results)
    header["wall_time_s"] = time.perf_counter() - _STARTED
    header["cpu_time_s"] = sum(os.times()[:2])  # user + system of this process
    text = run_report.markdown_report(results, checks, header)
    payload = dict(header=header, environment=report.environment(), configs=configs,
                   results=[r.as_dict() for r in results], targets=checks)
    paths = run_report.write_outputs(_cli.output_dir(args), args.name or args.size, text,
                                     payload, results)
    print(text)
    print(f"Total time {time.perf_counter() - _STARTED:.1f} s (TensorFlow import "
          f"{header['tf_import_s']:.1f} s; CPU time {sum(os.times()[:2]):.0f} s; load average "
          f"{os.getloadavg()[0]:.1f}). Wrote {', '.join(_shown(p) for p in paths)}.")
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    tf.get_logger().setLevel("ERROR")
    sys.exit(main())
