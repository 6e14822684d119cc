"""Measures one model in one execution mode under every strategy.

For each strategy the same model (same weights) runs the same training step,
forward and backward under a `tf.GradientTape`, on the same batch:

1. check step: BatchNorm statistics and dropout seed states are first put back to
   their values after model construction, so every strategy starts from the same
   state and draws the same dropout masks as plain. Its gradients are compared
   with plain's (per variable: largest absolute difference over the largest
   magnitude of plain's gradient of that variable, floored at 1e-3 of the
   largest gradient of any variable; the table shows the worst variable) and
   so is the state after the step (BatchNorm statistics, relative to plain's
   update; dropout seed states must be equal). This call also traces / compiles.
2. timing: `repeats` rounds; in each round every strategy runs one step, in turn,
   so that load from other processes hits all strategies alike. Each step is timed
   and its peak memory read with `tf_checkpointing.debug.measure`. Reported:
   median time, median peak (peaks scatter by a few MiB from step to step because
   independent ops run in parallel in varying order), and the time ratio to plain as the median over
   rounds of (this step / plain's step in the same round), with its quartiles.
   The order of the strategies rotates from round to round.
3. batch fit: three more steps at half the batch (after an unmeasured call, which
   compiles under XLA). Peak memory is linear in the batch for these models, so
   the median peaks at the two sizes give `peak(b) = fixed + per_sample * b`, and
   the largest batch within the budget is `(budget - fixed) // per_sample`.
   Extrapolated, not searched: far beyond the measured sizes it is a projection.

Example:
    >>> from benchmarks import models
    >>> workload = models.build("mlp", models.SIZES["tiny"]["mlp"])
    >>> results = run_group(workload, "eager", ["plain", "recompute_grad"], repeats=2)
    >>> results["recompute_grad"].status, results["recompute_grad"].grad_error < 1e-5
    ('ok', True)
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from benchmarks.models import Workload
from benchmarks.strategies import STRATEGIES
from tf_checkpointing.core._memory import grow_cpu_pool
from tf_checkpointing.debug import ChainedOutputWarning, measure

# The U-Net's down blocks return (pooled, skip) with pooled computed from skip. The
# benchmark takes gradients for the weights only, never for a block's output, so the
# warning about gradients with respect to such an output does not apply here.
warnings.filterwarnings("ignore", category=ChainedOutputWarning)

# As the library names them (plan_sequential's `mode`): eager steps, tf.function steps
# ("graph") and tf.function(jit_compile=True) steps ("xla").
MODES = ("eager", "graph", "xla")
_SEED_STATE = "seed_generator_state"
_ERROR_FLOOR = 1e-3
_BATCH_FIT_STEPS = 3


@dataclasses.dataclass
class RunResult:
    """What one (model, mode, strategy) run measured. Ratios are vs plain, same run."""

    model: str
    mode: str
    strategy: str
    status: str = "ok"  # ok | skipped | error
    note: str = ""
    first_call_s: Optional[float] = None
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    peaks_bytes: list[int] = dataclasses.field(default_factory=list)
    grad_error: Optional[float] = None
    none_grads: int = 0
    state_error: Optional[float] = None
    rng_state_equal: Optional[bool] = None
    batch_peaks: dict[int, int] = dataclasses.field(default_factory=dict)
    budget_bytes: Optional[int] = None
    max_batch: Optional[int] = None
    memory_ratio: Optional[float] = None
    time_ratio: Optional[float] = None
    time_ratio_quartiles: Optional[tuple[float, float]] = None  # spread over rounds
    batch_ratio: Optional[float] = None
    forward_times_s: list[float] = dataclasses.field(default_factory=list)
    forward_share: Optional[float] = None  # plain only: forward (no tape) / full step

    @property
    def step_time_s(self) -> Optional[float]:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def peak_bytes(self) -> Optional[int]:
        """Median over the timed steps (the highest is in `peaks_bytes`)."""
        return int(statistics.median(self.peaks_bytes)) if self.peaks_bytes else None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["step_time_s"] = self.step_time_s
        out["peak_bytes"] = self.peak_bytes
        out["batch_peaks"] = {str(k): v for k, v in self.batch_peaks.items()}
        return out

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RunResult:
        """A run read back from its JSON (the inverse of `as_dict`)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in row.items() if k in fields}
        kwargs["batch_peaks"] = {int(k): v for k, v in kwargs.get("batch_peaks", {}).items()}
        return cls(**kwargs)


def make_step(workload: Workload, chain: Callable[[Any], Any], mode: str) -> Callable:
    """One training step (forward + backward, no optimizer), compiled for `mode`."""
    variables = workload.trainable_variables

    def step(inputs: tf.Tensor, targets: tf.Tensor) -> list[Any]:
        with tf.GradientTape() as tape:
            state = workload.stem(inputs, training=True)
            state = chain(state)
            loss = workload.head_loss(state, targets, training=True)
        return tape.gradient(loss, variables)

    if mode == "eager":
        return step
    if mode not in MODES:
        raise ValueError(f"Invalid value received for argument `mode`: expected one of "
                         f"{MODES}, received {mode!r}.")
    return tf.function(step, input_signature=workload.input_signature(), autograph=False,
                       jit_compile=(mode == "xla"))


def make_forward(workload: Workload, mode: str) -> Callable:
    """The plain forward pass alone, no tape: the work a full replay repeats."""
    def forward(inputs: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
        state = workload.stem(inputs, training=True)
        for block in workload.blocks:
            state = block(state, training=True)
        return workload.head_loss(state, targets, training=True)

    if mode == "eager":
        return forward
    return tf.function(forward, input_signature=workload.input_signature(), autograph=False,
                       jit_compile=(mode == "xla"))


def run_group(workload: Workload, mode: str, strategy_names: list[str], *, repeats: int = 5,
              batch_fit: bool = True, plan_budget_fraction: float = 1 / 3,
              forward_baseline: bool = False,
              on_progress: Callable[[str], None] = lambda _: None) -> dict[str, RunResult]:
    """Runs every strategy on `workload` in `mode`; returns results keyed by strategy.

    "plain" is always run first: it is the reference for errors and ratios. With
    `forward_baseline`, the plain forward alone (no tape) is timed in the same rounds
    and `results["plain"].forward_share` is its time over the full step's: replaying
    every block costs about that much on top of plain, whoever implements it.
    """
    # Before any step runs: an XLA step's buffer is then cut from one large region,
    # not counted as the whole region it would open (see _memory.grow_cpu_pool).
    grow_cpu_pool()
    names = ["plain"] + [n for n in strategy_names if n != "plain"]
    results = {n: RunResult(workload.name, mode, n) for n in names}
    initial_state = [v.numpy() for v in workload.state_variables]
    inputs = workload.make_batch(workload.batch)
    base_options = _options(workload, mode)
    steps: dict[str, Callable] = {}
    reference: dict[str, Any] = {}
    for name in names:
        result = results[name]
        reason = STRATEGIES[name].unavailable_reason()
        if reason:
            result.status, result.note = "skipped", reason
            on_progress(name)
            continue
        try:
            options = dict(base_options)
            if name != "plain" and "plain" in results and results["plain"].peak_bytes:
                options["plan_budget_bytes"] = int(plan_budget_fraction *
                                                   results["plain"].peak_bytes)
                options["plain_peak_bytes"] = results["plain"].peak_bytes
            chain = STRATEGIES[name].build(workload.blocks, options)
            result.note = getattr(chain, "note", "")
            step = make_step(workload, chain, mode)
            _check_step(workload, step, inputs, initial_state, result, reference)
            if name == "plain":  # the budget plan needs plain's peak before it is built
                result.peaks_bytes.append(measure(step, *inputs).peak_bytes)
            steps[name] = step
        except Exception as error:  # a peer failing is a result, not a crash
            result.status, result.note = "error", _describe(error)
        on_progress(name)
    forward = make_forward(workload, mode) if forward_baseline and "plain" in steps else None
    if forward is not None:
        forward(*inputs)  # trace / compile outside the rounds
    _time_round_robin(steps, inputs, results, repeats, forward)
    if batch_fit:
        for name, step in steps.items():
            _fit_batch(workload, step, results[name], mode)
    _restore(workload, initial_state)
    _fill_ratios(results)
    return results


def _options(workload: Workload, mode: str) -> dict[str, Any]:
    """What strategies may need: the chain's input at the base batch (eager), and
    the mode the step runs in (the budget plan is made for it)."""
    inputs, _ = workload.make_batch(workload.batch)
    sample = workload.stem(inputs, training=True)
    return {"tuple_state": isinstance(sample, tuple), "sample_state": sample, "mode": mode}


def _check_step(workload: Workload, step: Callable, inputs: tuple, initial_state: list,
                result: RunResult, reference: dict[str, Any]) -> None:
    _restore(workload, initial_state)
    start = time.perf_counter()
    grads = step(*inputs)
    result.first_call_s = time.perf_counter() - start
    grads = [None if g is None else tf.convert_to_tensor(g).numpy() for g in grads]
    after = [v.numpy() for v in workload.state_variables]
    if result.strategy == "plain":
        reference["grads"], reference["state"] = grads, after
    _compare(workload, grads, after, initial_state, reference, result)


def _compare(workload: Workload, grads: list, after: list, before: list,
             reference: dict[str, Any], result: RunResult) -> None:
    worst, nones = 0.0, 0
    largest = max((float(np.max(np.abs(r))) for r in reference["grads"] if r is not None),
                  default=0.0)
    for g, r in zip(grads, reference["grads"]):
        if g is None or r is None:
            nones += int((g is None) != (r is None))
            continue
        # A variable whose gradient is ~0 in exact arithmetic (e.g. attention key bias)
        # is compared against 1e-3 of the largest gradient, not against its noise.
        scale = max(float(np.max(np.abs(r))), _ERROR_FLOOR * largest) or 1.0
        worst = max(worst, float(np.max(np.abs(g - r))) / scale)
    result.grad_error, result.none_grads = worst, nones
    state_worst, rng_equal, has_float_state = 0.0, True, False
    for var, a, r, b in zip(workload.state_variables, after, reference["state"], before):
        if _SEED_STATE in var.path:
            rng_equal = rng_equal and bool(np.array_equal(a, r))
            continue
        has_float_state = True
        update = float(np.max(np.abs(r - b))) or 1.0
        state_worst = max(state_worst, float(np.max(np.abs(a - r))) / update)
    result.state_error = state_worst if has_float_state else None
    result.rng_state_equal = rng_equal


def _time_round_robin(steps: dict[str, Callable], inputs: tuple,
                      results: dict[str, RunResult], repeats: int,
                      forward: Optional[Callable] = None) -> None:
    names = list(steps)
    for round_ in range(repeats):
        if forward is not None:
            start = time.perf_counter()
            forward(*inputs)
            results["plain"].forward_times_s.append(time.perf_counter() - start)
        shift = round_ % len(names)  # rotate the order: no strategy always runs first
        for name in names[shift:] + names[:shift]:
            step = steps[name]
            if results[name].status != "ok":
                continue
            try:
                start = time.perf_counter()
                stats = measure(step, *inputs)
                results[name].step_times_s.append(time.perf_counter() - start)
                results[name].peaks_bytes.append(stats.peak_bytes)
                del stats
            except Exception as error:
                results[name].status, results[name].note = "error", _describe(error)


def _fit_batch(workload: Workload, step: Callable, result: RunResult, mode: str) -> None:
    if result.status != "ok" or result.peak_bytes is None:
        return
    high, low = workload.batch, max(1, workload.batch // 2)
    small = workload.make_batch(low)
    if mode == "xla":
        step(*small)  # compiles for the new shape; not measured
    # Peaks scatter from step to step (independent ops run in parallel, in varying
    # order), so both points are medians of several steps.
    low_peak = int(statistics.median(measure(step, *small).peak_bytes
                                     for _ in range(_BATCH_FIT_STEPS)))
    result.batch_peaks = {low: low_peak, high: int(result.peak_bytes)}
    per_sample = (result.batch_peaks[high] - result.batch_peaks[low]) / (high - low)
    fixed = result.batch_peaks[high] - per_sample * high
    result.budget_bytes = workload.budget_bytes
    if per_sample <= 0:
        result.note = _join(result.note, "peak did not grow with the batch")
        return
    result.max_batch = max(0, int((workload.budget_bytes - fixed) // per_sample))


def _fill_ratios(results: dict[str, RunResult]) -> None:
    """Memory and batch: ratio to plain. Time: median over rounds of the ratio to
    plain's step in the same round (paired, so load from other processes that
    changes between rounds cancels out)."""
    plain = results["plain"]
    if plain.forward_times_s and plain.step_times_s:
        plain.forward_share = statistics.median(
            f / p for f, p in zip(plain.forward_times_s, plain.step_times_s))
        plain.note = _join(plain.note, f"forward alone (no tape): {plain.forward_share:.2f} "
                                       f"of this step")
    for result in results.values():
        if result.status != "ok":
            continue
        if plain.peak_bytes and result.peak_bytes is not None:
            result.memory_ratio = result.peak_bytes / plain.peak_bytes
        ratios = [t / p for t, p in zip(result.step_times_s, plain.step_times_s)]
        if ratios:
            result.time_ratio = statistics.median(ratios)
            result.time_ratio_quartiles = _quartiles(ratios)
        if plain.max_batch and result.max_batch is not None:
            result.batch_ratio = result.max_batch / plain.max_batch
        if result.none_grads:
            result.note = _join(result.note, f"{result.none_grads} gradients None")
        if result.rng_state_equal is False:
            result.note = _join(result.note, "dropout seed state differs from plain")


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _restore(workload: Workload, values: list) -> None:
    for variable, value in zip(workload.state_variables, values):
        variable.assign(value)


def _describe(error: BaseException) -> str:
    """One line: the error type, its first informative line, where it was raised."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line and not line.startswith("Exception encountered")]
    where = traceback.extract_tb(error.__traceback__)[-1]
    first = lines[0] if lines else ""
    return f"{type(error).__name__}: {first[:200]} ({where.filename.split('/')[-1]}:{where.lineno})"


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
