"""A save policy per layer: plain, keep the products, or replay all, for a budget.

The segment planner (:mod:`._chain`) chooses between keeping a layer's
activations and replaying all of it. A save policy is a third choice in between:
it keeps a part (the matrix products, say) at a fraction of the memory and
replays the rest at a fraction of the time. With per-layer choices ``c``, each
costing ``kept[i][c]`` bytes kept between forward and backward (listed by
:func:`~tf_checkpointing.saved_residuals`, which agrees with the allocator) and
``extra[i][c]`` seconds of replay (measured: the layer's ``tf.function``
training step with that choice minus the plain one), the cheapest plan within a
budget is a multiple-choice knapsack, solved exactly by dynamic programming over
memory in ``_UNITS`` steps.

The peak is modelled from the plain step's measured peak: every byte a choice
keeps less than plain is saved, and while a replayed layer runs, its working
set (what plain keeps of it, minus what the choice keeps) comes back once. The
model is for ``tf.function`` steps (what a graph keeps); a policy keeps nothing
extra in eager mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

__all__ = ["PolicyPlan", "plan_policies"]

_UNITS = 512
PLAIN = "plain"  # the choice that does not checkpoint the layer


@dataclasses.dataclass(frozen=True)
class PolicyPlan:
    """Per layer, what to keep: ``PLAIN`` (no checkpoint) or a save policy
    (``policies.nothing_saveable`` replays all of the layer)."""

    choices: tuple[Any, ...]
    budget_bytes: int
    plain_peak_bytes: int
    predicted_peak_bytes: int
    extra_seconds: float
    options: tuple[Any, ...] = dataclasses.field(repr=False, default=())
    kept_bytes: Any = dataclasses.field(repr=False, default=None)  # [layer, option]
    extra_s: Any = dataclasses.field(repr=False, default=None)  # [layer, option]

    @property
    def least_budget_bytes(self) -> int:
        """About the least budget any choice fits (rounding may need 1% more)."""
        return int(_least(self.kept_bytes, self.plain_peak_bytes))

    def replan(self, budget: int) -> PolicyPlan:
        """The plan for another budget, from the same measurements."""
        choice, predicted = _solve(self.kept_bytes, self.extra_s, self.plain_peak_bytes, budget)
        return dataclasses.replace(
            self, choices=tuple(self.options[c] for c in choice), budget_bytes=int(budget),
            predicted_peak_bytes=int(predicted),
            extra_seconds=float(sum(self.extra_s[i, c] for i, c in enumerate(choice))))

    def wrap(self, layers: Sequence[Any]) -> list[Any]:
        """The layers, each checkpointed with its choice (plain ones untouched)."""
        from tf_checkpointing import checkpointable

        return [layer if choice == PLAIN else
                checkpointable(layer, checkpoint=True, policy=choice)
                for layer, choice in zip(layers, self.choices)]

    def __str__(self) -> str:
        names = [c if c == PLAIN else getattr(c, "__name__", repr(c)) for c in self.choices]
        return (f"PolicyPlan({', '.join(names)}; predicted peak "
                f"{self.predicted_peak_bytes / 2**20:.1f} MiB of {self.budget_bytes / 2**20:.1f}"
                f" MiB, +{self.extra_seconds * 1e3:.1f} ms replay)")


def plan_policies(layers: Sequence[Any], inputs: tf.Tensor, *, budget: int,
                  candidates: Optional[Sequence[Any]] = None, repeats: int = 5,
                  **kwargs: Any) -> PolicyPlan:
    """Chooses per layer plain, a save policy or a full replay, for a budget.

    A knapsack over single layers; ``plan_sequential(..., policies=...)`` and
    ``CheckpointedSequential(budget=..., policies=...)`` make the same choice
    with multi-layer segments and nesting too, and run the plan.

    Args:
        layers: the chain (Keras layers or callables), each fed the previous output.
        inputs: the chain's input tensor at the training batch size.
        budget: bytes the ``tf.function`` training step may allocate above what is
            allocated before it.
        candidates: the policies to choose from besides plain; default
            ``(policies.dots_saveable, policies.nothing_saveable)``.
        repeats: timed runs per layer and choice (the median is used).
        **kwargs: keywords for every layer, e.g. ``training=True``.

    Returns:
        A :class:`PolicyPlan`; ``plan.wrap(layers)`` applies it.

    Raises:
        ValueError: no choice fits the budget (the message gives the least).

    Example (``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow is imported):
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing.planning import plan_policies
        >>> layers = [keras.layers.Dense(256, activation="gelu") for _ in range(4)]
        >>> plan = plan_policies(layers, tf.random.normal([512, 256]), budget=2**40)
        >>> plan.choices
        ('plain', 'plain', 'plain', 'plain')
    """
    from tf_checkpointing import policies

    if not isinstance(inputs, tf.Tensor):
        raise TypeError(
            "plan_policies: argument `inputs` must be one tensor (the chain's state); "
            f"received {type(inputs).__name__}. Chains whose state is a tuple (a U-Net's "
            "skip connections) are not supported yet: use plan_sequential for them."
        )
    candidates = tuple(candidates or (policies.dots_saveable, policies.nothing_saveable))
    state = [v for layer in layers for v in getattr(layer, "variables", ())]
    before = [v.numpy() for v in state]  # profiling advances seeds and statistics
    try:
        return _plan(layers, inputs, budget, candidates, repeats, kwargs)
    finally:
        for variable, value in zip(state, before):
            variable.assign(value)


def _plan(layers, inputs, budget, candidates, repeats, kwargs) -> PolicyPlan:
    xs = [inputs]
    for layer in layers[:-1]:
        xs.append(layer(xs[-1], **kwargs))
    options = (PLAIN, *candidates)
    kept = np.array([[_kept_bytes(layer, x, c, kwargs) for c in options]
                     for layer, x in zip(layers, xs)], dtype=np.float64)
    extra = np.array([_layer_extra_seconds(layer, x, options, kwargs, repeats)
                      for layer, x in zip(layers, xs)])
    plain_peak = _plain_peak(layers, inputs, kwargs)
    unplanned = PolicyPlan((), 0, int(plain_peak), 0, 0.0, options, kept, extra)
    return unplanned.replan(budget)


def _solve(kept: np.ndarray, extra: np.ndarray, plain_peak: float,
           budget: float) -> tuple[list[int], float]:
    """Least total extra time with ``fixed + sum(kept) + working set <= budget``."""
    fixed = plain_peak - kept[:, 0].sum()
    returned = kept[:, :1] - kept  # a replayed layer's working set (0 for plain)
    best: Optional[tuple[float, list[int], float]] = None
    for cap in sorted(set(np.round(returned.ravel(), 0))):
        room = budget - fixed - max(cap, 0.0)
        if room < 0:
            continue
        unit = max(room / _UNITS, 1.0)
        picked = _knapsack(np.ceil(kept / unit).astype(int), extra, returned <= cap,
                           int(room // unit))
        if picked is None:
            continue
        cost = float(sum(extra[i, c] for i, c in enumerate(picked)))
        peak = fixed + sum(kept[i, c] for i, c in enumerate(picked)) + max(
            [returned[i, c] for i, c in enumerate(picked)] + [0.0])
        if best is None or cost < best[0] - 1e-12:
            best = (cost, picked, peak)
    if best is None:
        least = _least(kept, plain_peak)
        raise ValueError(
            f"plan_policies: argument `budget` ({budget / 2**20:.1f} MiB) is below the "
            f"least any choice of policies needs (about {least / 2**20:.1f} MiB, plain "
            f"{plain_peak / 2**20:.1f} MiB). Pass a larger budget, or use "
            "plan_sequential, whose nested checkpoints need less."
        )
    return best[1], best[2]


def _least(kept: np.ndarray, plain_peak: float) -> float:
    """The least modelled peak: per working-set cap, the least each layer can keep."""
    fixed = plain_peak - kept[:, 0].sum()
    returned = kept[:, :1] - kept
    needs = [max(cap, 0.0) + np.where(returned <= cap, kept, np.inf).min(axis=1).sum()
             for cap in set(returned.ravel())]
    return fixed + min(needs)


def _knapsack(weights: np.ndarray, values: np.ndarray, allowed: np.ndarray,
              capacity: int) -> Optional[list[int]]:
    """Multiple-choice knapsack: one choice per row, least value, weight <= capacity."""
    n, k = weights.shape
    cost = np.full((n + 1, capacity + 1), np.inf)
    cost[0, :] = 0.0
    pick = np.zeros((n, capacity + 1), dtype=int)
    for i in range(n):
        for c in range(k):
            w = weights[i, c]
            if not allowed[i, c] or w > capacity:
                continue
            candidate = np.full(capacity + 1, np.inf)
            candidate[w:] = cost[i, : capacity + 1 - w] + values[i, c]
            better = candidate < cost[i + 1]
            cost[i + 1][better], pick[i][better] = candidate[better], c
    if not np.isfinite(cost[n, capacity]):
        return None
    chosen, m = [], capacity
    for i in reversed(range(n)):
        c = pick[i][m]
        chosen.append(int(c))
        m -= weights[i, c]
    return chosen[::-1]


def _call(layer: Any, choice: Any, kwargs: dict) -> Callable[[tf.Tensor], Any]:
    from tf_checkpointing import checkpointable

    if choice == PLAIN:
        return lambda x: layer(x, **kwargs)
    wrapped = checkpointable(layer, checkpoint=True, policy=choice)
    return lambda x: wrapped(x, **kwargs)


def _kept_bytes(layer: Any, x: tf.Tensor, choice: Any, kwargs: dict) -> int:
    """What the layer keeps, its input included (in a chain: the previous output)."""
    from tf_checkpointing import saved_residuals

    return sum(r.bytes for r in saved_residuals(_call(layer, choice, kwargs), x)
               if r.kind in ("activation", "argument"))


def _layer_extra_seconds(layer: Any, x: tf.Tensor, options: tuple, kwargs: dict,
                         repeats: int) -> list[float]:
    """Per option, the step time it adds to plain's, timed as the chain planner
    times its choices (:mod:`._choices`: a loss whose gradient depends on the
    output, paired rounds). An earlier version timed ``reduce_sum(y)``, whose
    constant gradient let the replay run beside the forward: a full replay then
    looked free (+0.3 ms per decoder block, against +13 ms in a chain)."""
    from tf_checkpointing.planning._choices import step_extra_seconds

    calls = {i: _call(layer, c, kwargs) for i, c in enumerate(options)}
    extra = step_extra_seconds(calls, x, list(getattr(layer, "trainable_variables", ())),
                           False, max(repeats, 3), reference=0)
    return [0.0] + [extra[i] for i in range(1, len(options))]


def _plain_peak(layers: Sequence[Any], x: tf.Tensor, kwargs: dict) -> int:
    from tf_checkpointing import peak_memory

    variables = [v for layer in layers for v in getattr(layer, "trainable_variables", ())]

    @tf.function
    def step(x: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            h = x
            for layer in layers:
                h = layer(h, **kwargs)
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, [x] + variables)

    _sync(step(x))
    return peak_memory(lambda: _sync(step(x)))


def _sync(values: Any) -> None:
    for value in tf.nest.flatten(values):
        if value is not None:
            np.asarray(value)
