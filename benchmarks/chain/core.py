"""The core benchmark: `checkpointable` vs plain TF vs `tf.recompute_grad`.

A chain of 32 `Dense(256, activation="gelu")` layers on a batch of 8192, each layer
checkpointed separately, in eager, tf.function and XLA: peak memory and step time
of one training step (forward + backward), measured by `benchmarks.harness` (same
weights and batch for every strategy; timing in rounds, one step per strategy per
round). Then the cost of the decorator when no tape records: a `Dense(64)` on a
[32, 64] input, called bare and wrapped by `checkpointable(..., checkpoint=True)`,
in alternating blocks of calls, median over blocks of the paired ratio.

Targets: peak memory <= 1.02x `tf.recompute_grad`'s in every mode; step time
<= 1.35x plain under tf.function (mode "graph"); no-tape overhead <= 5%.

Usage:
    python benchmarks/chain/core.py               # the full shapes, ~3-5 min on 2 cores
    python benchmarks/chain/core.py --tiny --out /tmp/core   # toy shapes, ~20 s
    python benchmarks/chain/core.py --rerender benchmarks/results/core.json

Prints the tables with pass/fail and writes `core.json` (and `core.md`) to --out
(default benchmarks/results/latest/, ignored by git; --update-results: the committed
benchmarks/results/).
"""

from __future__ import annotations

import sys
import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

# Sets TF_CPU_ALLOCATOR_USE_BFC and TF_CPP_MIN_LOG_LEVEL: before TensorFlow is imported.
from benchmarks import _cli  # noqa: E402

with _cli.quiet_start_up():
    import keras  # noqa: E402
    import tensorflow as tf  # noqa: E402

    from benchmarks import harness  # noqa: E402
from benchmarks.models import Workload  # noqa: E402
from benchmarks.report import MIB, cell, environment, table, write_json  # noqa: E402
from tf_checkpointing import checkpointable  # noqa: E402

STRATEGIES = ("plain", "recompute_grad", "checkpointable")
# Shapes and repeats: the committed run's, and toy ones that run in seconds (the tests).
SIZES: dict[str, dict[str, Any]] = {
    "full": dict(layers=32, width=256, batch=8192, modes="eager,graph,xla", repeats=7,
                 overhead_samples=201),
    "tiny": dict(layers=3, width=32, batch=64, modes="eager,graph", repeats=2,
                 overhead_samples=3),
}
MEMORY_VS_RECOMPUTE_GRAD = 1.02
TIME_VS_PLAIN = 1.35
NO_TAPE_OVERHEAD = 0.05


def dense_chain(layers: int, width: int, batch: int, seed: int = 0) -> Workload:
    """`layers` x Dense(width, gelu); loss: mean of the squared output."""
    keras.utils.set_random_seed(seed)
    blocks = [keras.layers.Dense(width, activation="gelu", name=f"dense_{i}")
              for i in range(layers)]

    def make_batch(n: int) -> tuple[tf.Tensor, tf.Tensor]:
        x = tf.random.Generator.from_seed(n).normal([n, width])
        return x, tf.zeros([n], tf.int32)

    def head_loss(h: tf.Tensor, targets: tf.Tensor, training: Any) -> tf.Tensor:
        return tf.reduce_mean(tf.square(h))

    workload = Workload(
        "dense_chain", dict(layers=layers, width=width, batch=batch, budget_mib=1),
        lambda x, training: x, blocks, head_loss, make_batch,
        lambda: [tf.TensorSpec([None, width], tf.float32), tf.TensorSpec([None], tf.int32)],
        blocks)
    x, _ = make_batch(1)
    for block in blocks:
        x = block(x)
    return workload


def no_tape_overhead(calls: int = 50, samples: int = 201) -> dict[str, Any]:
    """Per-call time of Dense(64) on [32, 64], bare vs checkpointable, no tape.

    Samples of `calls` calls alternate between the two (and which goes first); the
    overhead is the median over samples of the paired ratio, minus 1. The same
    measurement of the bare layer against a second bare Dense(64) (an A/A test)
    gives the noise floor of this machine.
    """
    layer = keras.layers.Dense(64)
    twin = keras.layers.Dense(64)
    wrapped = checkpointable(layer, checkpoint=True)
    x = tf.random.normal([32, 64])
    layer(x), twin(x), wrapped(x)  # build, warm up

    def per_call(fn: Any) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        return (time.perf_counter() - start) / calls

    def paired(a: Any, b: Any) -> tuple[list[float], list[float]]:
        times_a, times_b = [], []
        for i in range(samples):
            if i % 2:
                times_a.append(per_call(a))
                times_b.append(per_call(b))
            else:
                times_b.append(per_call(b))
                times_a.append(per_call(a))
        return times_a, times_b

    wrapped_times, bare_times = paired(wrapped, layer)
    twin_times, bare_again = paired(twin, layer)
    return dict(calls_per_sample=calls, samples=samples,
                bare_us=statistics.median(bare_times) * 1e6,
                wrapped_us=statistics.median(wrapped_times) * 1e6,
                overhead=statistics.median(w / b for w, b in zip(wrapped_times, bare_times))
                - 1.0,
                noise_floor=statistics.median(t / b for t, b in zip(twin_times, bare_again))
                - 1.0,
                wrapper_us=_wrapper_cost_us())


def _wrapper_cost_us(calls: int = 20000) -> float:
    """The decorator's own cost per no-tape call, free of the layer's noise: a
    wrapped identity function vs the bare one."""
    def identity(v: Any) -> Any:
        return v

    wrapped = checkpointable(identity, checkpoint=True)
    best = []
    for fn in (identity, wrapped):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn(1)
            runs.append((time.perf_counter() - start) / calls)
        best.append(min(runs))
    return (best[1] - best[0]) * 1e6


def check_targets(results: list[harness.RunResult], overhead: dict[str, Any]) -> list[dict]:
    by_key = {(r.mode, r.strategy): r for r in results}
    checks = []
    for mode in dict.fromkeys(r.mode for r in results):
        ours, peer = by_key.get((mode, "checkpointable")), by_key.get((mode, "recompute_grad"))
        ratio = None
        if ours and peer and ours.peak_bytes and peer.peak_bytes:
            ratio = ours.peak_bytes / peer.peak_bytes
        checks.append(_check(f"peak memory ({mode})",
                             f"<= {MEMORY_VS_RECOMPUTE_GRAD}x tf.recompute_grad's", ratio,
                             ratio is not None and ratio <= MEMORY_VS_RECOMPUTE_GRAD))
    ours = by_key.get(("graph", "checkpointable"))
    value = ours.time_ratio if ours else None
    check = _check("step time (graph)", f"<= {TIME_VS_PLAIN}x plain (median over rounds)",
                   value, value is not None and value <= TIME_VS_PLAIN)
    if ours and ours.time_ratio_quartiles:
        check["shown"] += " (quartiles {:.2f}-{:.2f})".format(*ours.time_ratio_quartiles)
    checks.append(check)
    checks.append(_check("no-tape call overhead", f"<= {NO_TAPE_OVERHEAD:.0%}",
                         overhead["overhead"], overhead["overhead"] <= NO_TAPE_OVERHEAD,
                         fmt="{:+.1%}"))
    return checks


def _check(name: str, wanted: str, value: Any, passed: bool, fmt: str = "{:.3f}") -> dict:
    return dict(target=name, wanted=wanted, measured=value,
                shown="-" if value is None else fmt.format(value),
                passed=None if value is None else bool(passed))


def markdown(results: list[harness.RunResult], overhead: dict[str, Any], checks: list[dict],
             config: dict[str, int]) -> str:
    peers = {r.mode: r for r in results if r.strategy == "recompute_grad"}

    def cells(r: harness.RunResult) -> list[str]:
        peer = peers.get(r.mode)
        vs_peer = (r.peak_bytes / peer.peak_bytes if peer and peer.peak_bytes
                   and r.peak_bytes else None)
        return [r.mode, r.strategy, cell(r.peak_bytes and r.peak_bytes / MIB, "{:.1f}"),
                cell(r.memory_ratio, "{:.3f}"), cell(vs_peer, "{:.3f}"),
                cell(r.step_time_s and r.step_time_s * 1e3, "{:.0f}"),
                cell(r.time_ratio, "{:.2f}"), cell(r.grad_error, "{:.1e}"),
                r.note if r.status == "ok" else f"{r.status}: {r.note}"]

    def result(c: dict) -> str:
        return "n/a" if c["passed"] is None else ("PASS" if c["passed"] else "FAIL")

    lines = [f"## Core benchmark: {config['layers']} x Dense({config['width']}, gelu), "
             f"batch {config['batch']}", "",
             table(["mode", "strategy", "peak MiB", "memory x plain",
                    "memory x recompute_grad", "step ms", "time x plain", "grad err",
                    "notes"], (cells(r) for r in results)),
             "", f"No-tape call of Dense(64) on [32, 64]: bare {overhead['bare_us']:.1f} us, "
                 f"checkpointable {overhead['wrapped_us']:.1f} us "
                 f"({overhead['overhead']:+.1%}, median of {overhead['samples']} paired "
                 f"samples of {overhead['calls_per_sample']} calls; the same measurement "
                 f"of two bare Dense(64), the noise floor: {overhead['noise_floor']:+.1%}). "
                 f"The decorator's own cost per call, on an identity function: "
                 f"{overhead['wrapper_us']:.2f} us.",
             "",
             "### Targets", "",
             table(["target", "wanted", "measured", "result"],
                   ([c["target"], c["wanted"], c["shown"], result(c)] for c in checks))]
    return "\n".join(lines) + "\n"


def rerender(json_path: Path) -> Path:
    """Writes `core.md` again from a finished run's `core.json`, without measuring."""
    payload = json.loads(Path(json_path).read_text())
    results = [harness.RunResult.from_dict(r) for r in payload["results"]]
    md = Path(json_path).with_suffix(".md")
    md.write_text(markdown(results, payload["no_tape_overhead"], payload["targets"],
                           payload["config"]))
    return md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help=f"toy shapes, for the tests: {SIZES['tiny']}")
    full = SIZES["full"]
    parser.add_argument("--layers", type=int, help=f"default {full['layers']}")
    parser.add_argument("--width", type=int, help=f"default {full['width']}")
    parser.add_argument("--batch", type=int, help=f"default {full['batch']}")
    parser.add_argument("--modes", help="comma-separated subset of "
                        f"{','.join(harness.MODES)} (default {full['modes']})")
    parser.add_argument("--repeats", type=int,
                        help=f"timed steps per strategy (default {full['repeats']})")
    parser.add_argument("--overhead-samples", type=int,
                        help=f"default {full['overhead_samples']}")
    _cli.add_output_arguments(parser)
    _cli.add_rerender_argument(parser)
    args = parser.parse_args(argv)
    if args.rerender:
        print(f"Wrote {rerender(args.rerender)}.")
        return 0
    for name, default in SIZES["tiny" if args.tiny else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.out = _cli.output_dir(args)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in harness.MODES]
    if unknown:
        parser.error(f"--modes: expected a subset of {','.join(harness.MODES)}; received "
                     f"{args.modes!r}")
    workload = dense_chain(args.layers, args.width, args.batch)
    results: list[harness.RunResult] = []
    for mode in modes:
        print(f"{mode} ...", file=sys.stderr, flush=True)
        group = harness.run_group(workload, mode, list(STRATEGIES), repeats=args.repeats,
                                  batch_fit=False, forward_baseline=True)
        results.extend(group.values())
    print("no-tape overhead ...", file=sys.stderr, flush=True)
    overhead = no_tape_overhead(samples=args.overhead_samples)
    checks = check_targets(results, overhead)
    config = dict(layers=args.layers, width=args.width, batch=args.batch)
    text = markdown(results, overhead, checks, config)
    payload = dict(config=config, repeats=args.repeats, environment=environment(),
                   results=[r.as_dict() for r in results], no_tape_overhead=overhead,
                   targets=checks, wall_time_s=time.perf_counter() - _STARTED)
    write_json(args.out / "core.json", payload)
    (args.out / "core.md").write_text(text)
    print(text)
    print(f"Total time {time.perf_counter() - _STARTED:.1f} s. Wrote "
          f"{args.out / 'core.json'} and {args.out / 'core.md'}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
