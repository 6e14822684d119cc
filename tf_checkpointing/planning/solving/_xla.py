"""Plans for an XLA step: the planners' model anchored at two measured XLA steps.

Why a plan made from a graph profile overshoots under ``jit_compile=True``
(read from XLA's own buffer assignment, ``XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text``): XLA allocates one buffer for all of a step's
temporaries, and its live bytes at the peak are the activations the graph
model predicts *plus* buffers that do not shrink with checkpointing: the
weights transposed for the backward convolutions (about the size of all
weights) and, for a MaxPool the plan leaves plain, the index arrays of its
gradient, which XLA's scheduler computes as soon as their inputs exist and
keeps until the backward reads them. The replays are not merged into the
forward. A planner that scales the per-layer numbers to the XLA plain step
treats that constant part as proportional, and predicts the plans that keep
little far too low.

So for an XLA step the planners compile and measure one more step, the
least-memory plan, and map their model's peak ``g`` through the line that
takes the model's least and plain peaks to the measured ones: the constant
part is the intercept, the activations the slope. A budget is met when the
mapped peak fits it.

The relation between ``g`` and XLA's peak is not a line, and depends on the
model: plans between the least and plain can measure far above the line, and
plans of equal ``g`` apart. So a whole-model plan for a budget is
measured before it is taken: a budget climbs a fixed ladder of plans, from the
one that recomputes least, compiling and measuring each until one fits
(:func:`plan_within`). The plan's predicted peak is then its own measurement;
each measurement also becomes one more point of the mapping (a monotone
piecewise-linear curve through every point measured for the profile), which
predicts the plans not measured (a user's selections).

Each XLA step is measured by the bytes it requests (:mod:`..measuring._requested`),
not by the allocator's chunks, which depend on the free chunks the profile
left in the pool; and as a training step (a loss's gradient, an SGD update:
``measuring._whole_step.graph_plain_step``), which XLA schedules otherwise than a
backward with a constant output gradient and gradients only summed.

The measurements behind all of this: docs/decisions/0023-xla-plans.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

from tf_checkpointing.core._state import StateRecorder
from tf_checkpointing.planning._cache import registered
from tf_checkpointing.planning._constants import XLA_ANCHOR_CACHE_SIZE as _CACHE_SIZE
from tf_checkpointing.planning._constants import XLA_LADDER_RUNGS as _RUNGS
from tf_checkpointing.planning.layer_graph._frozen import backprop_calls
from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph
from tf_checkpointing.planning.measuring import _progress
from tf_checkpointing.planning.measuring._allocator import (
    concrete_inputs,
    in_fresh_thread,
    memory_device,
)
from tf_checkpointing.planning.measuring._whole_step import (
    StepReading,
    eager_plain_peak,
    graph_steps,
)
from tf_checkpointing.planning.plans._plan import ModelPlan, PlanRunner, pieces_of_spans
from tf_checkpointing.planning.solving._region_solver import Solution

__all__: list[str] = []

_model_anchors: dict[Any, XlaAnchor] = registered({})  # per profile key: the measured least plan


@dataclasses.dataclass(frozen=True)
class XlaAnchor:
    """The model's peaks of the least and the plain plan, the XLA steps', and
    any further plans measured (``points``: ``(model bytes, XLA bytes)``).

    The mapping is the monotone piecewise-linear curve through all of them
    (each measured peak raised to the largest measured at a smaller model
    peak, so that a plan the model says needs more is never predicted to need
    less); with no further points, the line through the two anchors.

    Example:
        >>> from tf_checkpointing.planning.solving._xla import XlaAnchor
        >>> anchor = XlaAnchor(model_least=100, model_plain=400, least_bytes=250,
        ...                    plain_bytes=400)
        >>> anchor.predict(100), anchor.predict(400), anchor.predict(250)
        (250.0, 400.0, 325.0)
        >>> anchor.model_limit(325.0)
        250.0
        >>> bent = anchor.with_point(200, 370)   # a plan measured above the line
        >>> bent.predict(200), bent.predict(150), bent.model_limit(310.0)
        (370.0, 310.0, 150.0)
    """

    model_least: float
    model_plain: float
    least_bytes: int
    plain_bytes: int
    points: tuple[tuple[float, float], ...] = ()
    plain_seconds: Optional[float] = None
    least_seconds: Optional[float] = None
    # Every plan measured for a budget: (spans, policies, model bytes, XLA bytes).
    plans: tuple[tuple[tuple, tuple, float, float], ...] = ()

    @property
    def helps(self) -> bool:
        """Whether the least plan peaks below plain under XLA at all."""
        return self.least_bytes < self.plain_bytes and self.model_least < self.model_plain

    @property
    def slope(self) -> float:
        """The slope of the line through the two anchors (1 if it does not help)."""
        if not self.helps:
            return 1.0
        return (self.plain_bytes - self.least_bytes) / (self.model_plain - self.model_least)

    def with_point(self, model_bytes: float, xla_bytes: float) -> XlaAnchor:
        """The anchor with one more plan measured (not below the least plan: the
        least plan's peak, and so the least budget, stays the measured one)."""
        if model_bytes <= self.model_least:
            return self
        return dataclasses.replace(self, points=(*self.points, (float(model_bytes),
                                                                float(xla_bytes))))

    def with_plan(self, found: Solution, xla_bytes: float) -> XlaAnchor:
        """:meth:`with_point` for the plan ``found`` (its ``value`` its model
        peak), the plan kept too: a later budget it fits can take it unmeasured."""
        anchor = self.with_point(found.value, xla_bytes)
        return dataclasses.replace(anchor, plans=(
            *anchor.plans, (found.spans, found.policies, float(found.value), float(xla_bytes))))

    def measured(self, spans: tuple, policies: tuple) -> Optional[float]:
        """The XLA peak measured for the plan of ``spans`` under ``policies``, or None."""
        return next((xla for s, p, _, xla in self.plans if (s, p) == (spans, policies)), None)

    def _curve(self) -> tuple[list[float], list[float]]:
        """The curve's knots: model peaks (increasing) and XLA peaks (non-decreasing)."""
        knots = sorted({(float(self.model_least), float(self.least_bytes)),
                        (float(self.model_plain), float(self.plain_bytes)), *self.points})
        xs: list[float] = []
        ys: list[float] = []
        for x, y in knots:
            y = max(y, ys[-1]) if ys else y
            if xs and x == xs[-1]:
                ys[-1] = max(ys[-1], y)
            else:
                xs.append(x)
                ys.append(y)
        return xs, ys

    def predict(self, model_bytes: float) -> float:
        """The XLA peak of a plan the model predicts ``model_bytes`` for."""
        if not self.helps:
            return float(self.least_bytes + (model_bytes - self.model_least))
        xs, ys = self._curve()
        if model_bytes <= xs[0]:  # below the least plan: the anchors' slope
            return ys[0] + self.slope * (model_bytes - xs[0])
        if model_bytes >= xs[-1]:
            return ys[-1] + self.slope * (model_bytes - xs[-1])
        k = next(i for i in range(1, len(xs)) if model_bytes <= xs[i])
        return ys[k - 1] + (ys[k] - ys[k - 1]) * (model_bytes - xs[k - 1]) / (xs[k] - xs[k - 1])

    def model_limit(self, xla_bytes: float) -> float:
        """The largest model peak whose mapped XLA peak is at most ``xla_bytes``."""
        if not self.helps:
            return float(self.model_least + (xla_bytes - self.least_bytes))
        xs, ys = self._curve()
        if xla_bytes < ys[0]:
            return xs[0] + (xla_bytes - ys[0]) / self.slope
        if xla_bytes >= ys[-1]:
            return xs[-1] + (xla_bytes - ys[-1]) / self.slope
        k = next(i for i in range(1, len(xs)) if xla_bytes < ys[i])
        return xs[k - 1] + (xs[k] - xs[k - 1]) * (xla_bytes - ys[k - 1]) / (ys[k] - ys[k - 1])


def measure_xla_step(run: Callable[[Any], Any], inputs: Any,
                     variables: Sequence[Any] = (),
                     trainable: Optional[Sequence[Any]] = None,
                     jit: Optional[bool] = True) -> StepReading:
    """Peak of ``run``'s forward and backward as one
    ``tf.function`` compiled with ``jit_compile=jit`` (each gradient consumed at
    once, as an optimizer in the step does), or run eagerly (``jit=None``: the
    gradients held until an optimizer would apply them), on ``inputs`` in a
    thread of its own; the state it writes (BatchNorm statistics, seeds) and
    ``variables`` are put back."""
    (reading,) = measure_xla_steps([run], inputs, variables, trainable, jit)
    return reading


def measure_xla_steps(runs: Sequence[Callable[[Any], Any]], inputs: Any,
                      variables: Sequence[Any] = (),
                      trainable: Optional[Sequence[Any]] = None,
                      jit: Optional[bool] = True, timed: bool = False) -> list[StepReading]:
    """:func:`measure_xla_step` of each of ``runs``, in one thread, and under
    ``timed`` their times, taken in alternation (see ``_whole_step.graph_steps``;
    an eager step is not timed)."""

    def measure() -> list[StepReading]:
        x = concrete_inputs(inputs)
        device = memory_device(x)
        saved = [v.numpy() for v in variables]
        recorder = StateRecorder()
        with recorder:
            try:
                if jit is None:
                    return [StepReading(eager_plain_peak([run], x, device, trainable))
                            for run in runs]
                return graph_steps([[run] for run in runs], x, device, jit, applied=True,
                                   trainable=trainable, timed=timed)
            finally:
                recorder.restore_before()
                for v, value in zip(variables, saved):
                    v.assign(value)

    return [StepReading(int(reading.peak_bytes), reading.seconds)
            for reading in in_fresh_thread(measure)]


def model_anchor(key: Any, graph: Any, inputs: Any, least_spans: tuple, runner: PlanRunner, *,
                 model_least: float, model_plain: float,
                 least_policies: tuple = ()) -> XlaAnchor:
    """The anchor of a whole-model plan for an XLA step: its plain step and its
    least plan (``least_spans``, its regions under ``least_policies``) compiled
    and measured, once per profile ``key``, and timed in alternation (the time
    model reads the difference of their times)."""
    if key not in _model_anchors:
        plans = [((), ())] + ([(least_spans, least_policies)] if least_spans else [])
        readings = measure_plans(graph, inputs, runner, plans, timed=True)
        plain, least = readings[0], readings[-1]  # the plain step is the least if none helps
        _model_anchors[key] = XlaAnchor(model_least=model_least, model_plain=model_plain,
                                        least_bytes=least.peak_bytes,
                                        plain_bytes=plain.peak_bytes,
                                        plain_seconds=plain.seconds,
                                        least_seconds=least.seconds)
        while len(_model_anchors) > _CACHE_SIZE:
            _model_anchors.pop(next(iter(_model_anchors)))
    return _model_anchors[key]


def measure_plan(graph: LayerGraph, inputs: Any, runner: PlanRunner, spans: tuple,
                 region_policies: tuple = (), mode: str = "xla",
                 blocks: tuple = ()) -> StepReading:
    """The peak of the step (``mode``: ``"eager"``, ``"graph"`` or ``"xla"``) of
    ``graph``'s model run (by ``runner``) by the plan of ``spans`` and of the
    ``blocks`` inside its calls (see ``ModelPlan.blocks``)."""
    (reading,) = measure_plans(graph, inputs, runner, [(spans, region_policies)], mode,
                               blocks=blocks)
    return reading


def measure_plans(graph: LayerGraph, inputs: Any, runner: PlanRunner,
                  plans: Sequence[tuple[tuple, tuple]], mode: str = "xla",
                  blocks: tuple = (), timed: bool = False) -> list[StepReading]:
    """:func:`measure_plan` of each ``(spans, region_policies)`` of ``plans``,
    timed in alternation under ``timed``."""
    names = tuple(call.name for call in graph.calls)
    runs = []
    for spans, region_policies in plans:
        plan = ModelPlan(names, pieces_of_spans(0, len(names), spans, region_policies),
                         mode=mode, blocks=tuple(blocks))
        _progress.step(_MEASURING[mode])
        runs.append(runner(plan))
    return measure_xla_steps(runs, inputs, graph.model.non_trainable_variables,
                             jit=None if mode == "eager" else mode == "xla",
                             trainable=fit_sources(graph, mode), timed=timed)


_MEASURING = {"eager": "measuring eager steps", "graph": "compiling and measuring graph steps",
              "xla": "compiling and measuring XLA steps"}


def fit_sources(graph: LayerGraph, mode: str) -> Optional[Sequence[Any]]:
    """What a whole-model step is differentiated for: the model's trainable
    variables, as ``Model.fit`` differentiates them, under XLA or where backprop
    does not reach every call (a frozen backbone); else None (the inputs too, as
    the graph profile was validated). XLA compiles the step as one program, so a
    measured step should be the program ``fit`` runs: with the inputs' gradient
    it held one convolution more (the first layer's input gradient, which nobody
    reads)."""
    if mode == "xla" or not all(backprop_calls(graph, mode)):
        return graph.model.trainable_variables
    return None


def forget_model_anchor(key: Any) -> Optional[XlaAnchor]:
    """Drops the anchor measured for profile ``key`` (its profile was replaced)."""
    return _model_anchors.pop(key, None)


class XlaChoice(NamedTuple):
    """What :func:`plan_within` chose: the plan (None: none fit, take the least
    plan), its measured XLA peak (None: not measured, a plan of no region), and
    the anchor with every measured plan added."""

    solution: Optional[Solution]
    measured_bytes: Optional[int]
    anchor: XlaAnchor


def plan_within(key: Any, anchor: XlaAnchor, usable: float,
                solve_for: Callable[[float], Optional[Solution]],
                measure_spans: Callable[[tuple, tuple], int], *, rungs: int = _RUNGS,
                work: Optional[Callable[[tuple, tuple], float]] = None) -> XlaChoice:
    """The plan for an XLA budget of ``usable`` bytes: the first plan of the
    profile's :func:`ladder` whose compiled step measures within it.

    ``solve_for(limit)`` returns the plan with the least recomputation whose
    model peak (its ``value``) fits ``limit``, or None; ``measure_spans``
    compiles and measures a plan's XLA step. The ladder's plans are measured in
    order of recomputation, least first, until one fits; each measured plan is
    kept with the anchor (for ``key``): another budget on the same profile takes
    it unmeasured, and it becomes a point of the curve that predicts other plans.
    None when no plan of the ladder fits (the caller takes the least plan).

    Why a fixed ladder and not a search aimed at the budget: XLA's peak is not a
    smooth function of the regions, so a search whose candidates depend on the
    budget can take, for a higher budget, a plan that peaks lower than a lower
    budget's. The ladder depends only on the profile, so the first plan that fits
    a higher budget fits it no later than a lower budget's does: on one profile,
    the measured peak never rises as the budget falls. (Another process, whose
    per-call times differ, can climb another ladder; see
    docs/decisions/0048-xla-budgets-climb-a-ladder.md.)"""
    for found in ladder(anchor, solve_for, rungs, work):
        measured = anchor.measured(found.spans, found.policies)
        if measured is None:
            measured = measure_spans(found.spans, found.policies)
            anchor = anchor.with_plan(found, measured)
            if key in _model_anchors:
                _model_anchors[key] = anchor
        if measured <= usable:
            return XlaChoice(found, int(measured), anchor)
    return XlaChoice(None, None, anchor)


def ladder(anchor: XlaAnchor, solve_for: Callable[[float], Optional[Solution]],
           rungs: int = _RUNGS,
           work: Optional[Callable[[tuple, tuple], float]] = None) -> list[Solution]:
    """The plans an XLA budget chooses from: the least recomputation at ``rungs``
    model peaks evenly spaced between the least plan's and plain's (plans of no
    region and repeats dropped), ordered by ``work`` (a plan's recomputation),
    least first; without ``work``, by model peak, highest first.

    Example:
        >>> from tf_checkpointing.planning.solving._region_solver import Solution
        >>> from tf_checkpointing.planning.solving._xla import XlaAnchor, ladder
        >>> anchor = XlaAnchor(model_least=100, model_plain=400, least_bytes=250,
        ...                    plain_bytes=400)
        >>> def solve_for(limit):  # plans at model peaks 100, 150, ..., 350
        ...     g = min(350, 100 + 50 * int((limit - 100) // 50))
        ...     return Solution(g, ((0, g, ()),), ())
        >>> [plan.value for plan in ladder(anchor, solve_for, rungs=4)]
        [300, 250, 200, 150]
    """
    span = anchor.model_plain - anchor.model_least
    found: dict[tuple, tuple[int, Solution]] = {}
    for k in range(rungs, 0, -1):
        plan = solve_for(anchor.model_least + span * k / (rungs + 1))
        if plan is not None and plan.spans:
            found.setdefault((plan.spans, plan.policies), (len(found), plan))
    ordered = sorted(found.values(), key=lambda item: (
        0.0 if work is None else work(item[1].spans, item[1].policies), item[0]))
    return [plan for _, plan in ordered]
