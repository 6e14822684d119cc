"""The one object that makes, reuses, caches and saves a model's plans.

``apply_checkpointing(model, budget=...)`` (or ``plan=``) installs a
:class:`~tf_checkpointing._graph_runner.GraphRunner`, which only runs plans: each
call asks its :class:`PlanMaker` ``plan_for(inputs, mode, training=...)``. The
maker holds everything that decides which plan that is, in one place:

- the plan given with ``plan=`` (the only one then; a step in another mode than
  it was made for is warned about, once per mode);
- for ``budget=``, the budget and the save policies offered, and the plans made
  so far, per set of layers that take gradients, mode and batch shape
  (:class:`~tf_checkpointing.planning.plans._reuse.PlansByShape`; unfreezing a
  backbone plans anew, see docs/decisions/0031-plans-per-batch-and-mode.md);
- the plans ``plan_model`` made ahead for the same budget and policies
  (:mod:`~tf_checkpointing.planning.plans._reuse`, emptied by
  ``tf_checkpointing.planning.clear_caches()`` like every planning cache);
- the largest batch ``Model.fit`` said it feeds (:mod:`._fit_batches`), for a step
  traced with an unknown batch size;
- the ``plan_cache`` folder, read before planning and written after
  (:mod:`~tf_checkpointing.planning.plans._plan_files`).

Why one object: the runner and the planner were interleaved (the runner imported a
dozen planning names and kept plan caches, files and plans made ahead itself), so
what a call runs was spread over several places. See
docs/decisions/0040-plan-maker.md.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import keras
import tensorflow as tf

from tf_checkpointing._apply_arguments import WholeModel
from tf_checkpointing._block_switch import install_switches, remove_switches
from tf_checkpointing._fit_batches import tell_the_batch_on_fit
from tf_checkpointing._graph_runner import GraphRunner, model_runner
from tf_checkpointing.core._internals import KerasTensor
from tf_checkpointing.core._losses import AddedLosses
from tf_checkpointing.planning._errors import worded
from tf_checkpointing.planning.layer_graph._frozen import backprop_calls
from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph
from tf_checkpointing.planning.measuring._modes import Mode
from tf_checkpointing.planning.plans._budget import Budget
from tf_checkpointing.planning.plans._plan import ModelPlan
from tf_checkpointing.planning.plans._plan_files import (
    device_of_step,
    plan_key,
    read_plan,
    write_plan,
)
from tf_checkpointing.planning.plans._reuse import PlansByShape, made_ahead
from tf_checkpointing.planning.solving._model_planner import plan_graph

__all__: list[str] = []

_API = "apply_checkpointing"
_A_STEP = {Mode.EAGER: "an eager", Mode.GRAPH: "a graph", Mode.XLA: "an XLA"}


class PlanMaker:
    """Makes, reuses, caches and saves the plans of one model's graph.

    Args:
        graph: the model's layer graph.
        plan: a plan made ahead (``plan=``): the only plan, in every mode.
        budget: else, the validated budget each plan is made for.
        policies: the validated save policies a plan may choose among.
        plan_cache: a folder of plan files (validated), or None.
    """

    def __init__(self, graph: LayerGraph, *, plan: Optional[ModelPlan] = None,
                 budget: Optional[Budget] = None, policies: tuple[Any, ...] = (),
                 plan_cache: Any = None) -> None:
        self.graph = graph
        self.given = plan
        self.budget = budget
        self.policies = policies
        self.plan_cache = plan_cache
        # The largest batch Model.fit feeds, told by its wrapper (see _fit_batches):
        # a step traced with an unknown batch size is planned for it.
        self.batch_hint: Optional[int] = None
        self._plans: dict[Any, PlansByShape[ModelPlan]] = {}  # per frozen set
        self._warned: set[Mode] = set()  # modes told that the given plan is another's
        # Every layer whose losses the profile could add (nested models' too).
        self._layers = list(graph.model._flatten_layers(include_self=True,  # noqa: SLF001
                                                        recursive=True))

    @property
    def plans(self) -> PlansByShape[ModelPlan]:
        """The plans made for ``budget`` while the same layers are frozen as now:
        unfreezing a backbone (fine-tuning's second phase) changes what a
        compiled step keeps, so the next training call is planned anew."""
        return self._plans.setdefault(backprop_calls(self.graph), PlansByShape())

    def plan_for(self, inputs: Any, mode: Mode, *, training: Any) -> Optional[ModelPlan]:
        """The plan a call on ``inputs`` in ``mode`` runs: the given plan, or the
        one made for the budget for this mode and batch (made now, read from
        ``plan_cache``, or made ahead by ``plan_model``); None for an inference
        call before any plan (it runs plainly)."""
        if self.given is not None:
            self._expect_plan_mode(mode)
            return self.given
        with worded(_API):  # planning's errors, warnings and progress name it
            self.plans.adopt(made_ahead(self.graph.model, self.budget, self.policies))
            if self.batch_hint is not None:  # fit said how large its batches are
                inputs = with_batch(inputs, self.batch_hint)
            plan, plan_anew = self.plans.find(mode, inputs, training=training)
            if not plan_anew:
                return plan
            key = self._key(inputs, mode)
            plan = None if key is None else read_plan(self.plan_cache, key, self.graph)
            if plan is None:
                plan = self._make(inputs, mode)
                if key is not None:
                    write_plan(self.plan_cache, key, plan)
        self.plans.add(mode, inputs, plan)
        return plan

    def _key(self, inputs: Any, mode: Mode) -> Optional[str]:
        """The plan file's key for this question, or None without a ``plan_cache``."""
        if self.plan_cache is None:
            return None
        return plan_key(self.graph, inputs, mode=mode, budget=self.budget,
                        policies=self.policies, frozen=backprop_calls(self.graph),
                        device=device_of_step())

    def _make(self, inputs: Any, mode: Mode) -> ModelPlan:
        profiled = AddedLosses(self._layers)
        try:
            assert self.budget is not None  # no plan given: a budget was
            return plan_graph(self.graph, inputs, self.budget, mode=mode,
                              runner=model_runner(self.graph), policies=self.policies)
        finally:  # the profile's layer calls add losses of their own
            profiled.take()

    def _expect_plan_mode(self, mode: Mode) -> None:
        """Warns (once per mode) when the given plan was made for another kind of
        step: its regions run exactly, but what it was predicted to keep holds
        for the kind it was made for (a graph frees what an eager step keeps,
        XLA assigns buffers its own way)."""
        plan = self.given
        if plan is None or not any(plan.checkpointed) or plan.mode == mode or (
                mode in self._warned) or plan.predicted_peak_bytes is None:
            return
        self._warned.add(mode)
        warnings.warn(
            f"{_API}: argument `plan` was made for {plan.mode} steps (mode={plan.mode!r}) "
            f"and runs in {_A_STEP[mode]} step: gradients are exact, "
            f"but its predicted peak ({plan.predicted_peak_bytes / 2**20:.1f} MiB) holds for "
            f"{plan.mode} steps. Fix: make it with plan_model(model, x, budget=..., "
            f"mode={mode!r}) (Model.fit and tf.function: 'graph'; jit_compile=True: "
            "'xla'), or pass budget=... to plan on the first training step.",
            UserWarning, stacklevel=4)


def install(model: Any, whole: WholeModel, *, force_seed: bool = False,
            check: Any = False) -> GraphRunner:
    """Makes ``model`` run its graph by the plan given (or by the plan for the
    budget made on its first training call): replaces the instance's ``call``
    with a runner that asks a new :class:`PlanMaker`. ``whole`` holds the
    arguments ``apply_checkpointing`` checked (``_apply_arguments``)."""
    current = vars(model).get("call")
    original = current.original_call if isinstance(current, GraphRunner) else None
    if isinstance(current, GraphRunner):  # replaced: its blocks' switches go with it
        remove_switches(current.blocks.values())
    maker = PlanMaker(whole.graph, plan=whole.plan, budget=whole.budget,
                      policies=whole.policies, plan_cache=whole.plan_cache)
    runner = GraphRunner(whole.graph, maker, original_call=original or type(model).call,
                         force_seed=force_seed, check=check)
    install_switches(runner.blocks.values(), force_seed=force_seed, check=check)
    # Plain object.__setattr__: nothing for Keras or TensorFlow to track.
    object.__setattr__(model, "call", runner)
    if whole.plan is None and isinstance(model, keras.Model):
        tell_the_batch_on_fit(model, _tell_maker)
    return runner


def _tell_maker(model: Any, batch: Optional[int]) -> None:
    """What ``model.fit`` tells before it trains (see ``_fit_batches``)."""
    runner = vars(model).get("call")
    if isinstance(runner, GraphRunner) and isinstance(runner.maker, PlanMaker):
        runner.maker.batch_hint = batch


def with_batch(inputs: Any, batch: int) -> Any:
    """``inputs`` with each unknown first dimension ``batch``: symbolic stand-ins
    (KerasTensors) of the shapes to plan for; known shapes stay as they are."""
    def fill(leaf: Any) -> Any:
        shape = getattr(leaf, "shape", None)
        if shape is None or not len(shape) or shape[0] is not None:
            return leaf
        return KerasTensor((batch, *tuple(shape)[1:]), dtype=leaf.dtype)

    return tf.nest.map_structure(fill, inputs)
