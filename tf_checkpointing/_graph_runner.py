"""Running a functional model's graph with some regions checkpointed.

``apply_checkpointing(model, budget=...)`` (or ``plan=``) replaces the model
instance's ``call`` with a :class:`GraphRunner`: it runs the layer calls of the
flattened graph (:mod:`tf_checkpointing.planning.layer_graph._layer_graph`) in the order Keras'
``Functional._run_through_graph`` does, with the same call-context arguments
(``training``) and masks, and each region of the plan as one
:func:`~tf_checkpointing.core._recompute.checkpointed_call` that takes every tensor
entering the region and returns every tensor of it read later (and the model
outputs it makes). The layers are called as in the plain model, so autocast,
dropout seeds and BatchNorm updates happen exactly as there, and the replay
machinery replays them. A region the plan replays under a save policy passes
it to ``checkpointed_call``, which keeps what it picks (as
``checkpointable(policy=)`` does). The layers, their weights and the saved
model do not change; only this instance runs differently.

With a budget, the plan is made on the first call that can take a gradient
and is not an inference call (``training=False`` with no tape recording:
``evaluate``, ``predict``, which run plainly until then), from that batch, in
the mode that call runs (eager, a graph while it is traced, XLA while a
``jit_compile=True`` function is), as ``CheckpointedSequential`` does, and
again for another mode or a larger batch (see
:mod:`tf_checkpointing.planning.plans._reuse`). The layers are profiled in training
mode, so a ``training=False`` step under a tape (a frozen backbone being
fine-tuned) gets a plan that predicts at least what it keeps.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Optional

import keras
import tensorflow as tf

from tf_checkpointing import policies
from tf_checkpointing._block_switch import install_switches, remove_switches, set_switches
from tf_checkpointing._fit_batches import tell_the_batch_on_fit
from tf_checkpointing.core._flags import checkpoint_scopes_entered
from tf_checkpointing.core._internals import (
    KerasTensor,
    get_keras_mask,
    set_keras_mask,
    unpack_singleton,
)
from tf_checkpointing.core._losses import AddedLosses
from tf_checkpointing.core._recompute import (
    checkpointed_call,
    frozen_weights,
    layer_state,
    needs_checkpoint,
)
from tf_checkpointing.core._state import WritesKeptOut
from tf_checkpointing.planning.layer_graph._blocks import (
    block_layers,
    inner_block_choices,
    sublayers,
)
from tf_checkpointing.planning.layer_graph._frozen import backprop_calls
from tf_checkpointing.planning.layer_graph._layer_graph import (
    Key,
    LayerGraph,
    functional_of,
    read_graph,
    run_call,
)
from tf_checkpointing.planning.measuring._allocator import in_xla_context
from tf_checkpointing.planning.plans._budget import Budget
from tf_checkpointing.planning.plans._modes import step_mode
from tf_checkpointing.planning.plans._plan import ModelPlan, PlanRunner, Segment
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


class GraphRunner:
    """The ``call`` of a model that runs its graph by a :class:`ModelPlan`."""

    def __init__(self, graph: LayerGraph, *, plan: Optional[ModelPlan] = None,
                 budget: Optional[Budget] = None, mode: str = "auto",
                 original_call: Any = None, force_seed: bool = False,
                 check: Any = False, policies: tuple[Any, ...] = (),
                 plan_cache: Any = None) -> None:
        self.graph = graph
        self.plan_cache = plan_cache  # a folder of plan files (see planning.plans._plan_files)
        self.policies = policies  # the candidates for the plan made for `budget`
        self.force_seed, self.check = force_seed, check
        self.plan = plan  # the plan of the last call (given: the only one)
        self.fixed = plan is not None
        self._warned: set[str] = set()  # modes told that the given plan is another's
        self._plans: dict[tuple, PlansByShape[ModelPlan]] = {}  # made for `budget`
        self.budget = budget
        self.mode = mode
        # The largest batch Model.fit feeds, told by its wrapper (see _fit_batches):
        # a step traced with an unknown batch size is planned for it.
        self.batch_hint: Optional[int] = None
        self.original_call = original_call
        readers = graph.consumers()
        outputs = set(graph.output_keys)
        n = len(graph.calls)
        # The last call reading each key (n: the model returns it).
        self._last = {k: n if k in outputs else max(r) for k, r in readers.items()}
        for key in outputs:
            self._last[key] = n
        # Every layer whose losses the profile could add (nested models' too).
        self._layers = list(graph.model._flatten_layers(include_self=True,  # noqa: SLF001
                                                         recursive=True))
        # The blocks inside calls a plan may checkpoint (see _block_switch).
        refs = {ref for choice in inner_block_choices(graph) for ref in choice}
        refs.update(plan.blocks if plan is not None else ())
        self.blocks = dict(zip(sorted(refs), block_layers(graph, tuple(sorted(refs)))))

    @property
    def plans(self) -> PlansByShape[ModelPlan]:
        """The plans made for ``budget`` while the same layers are frozen as now:
        unfreezing a backbone (fine-tuning's second phase) changes what a
        compiled step keeps, so the next training call is planned anew."""
        return self._plans.setdefault(backprop_calls(self.graph), PlansByShape())

    def __call__(self, inputs: Any, training: Any = None, mask: Any = None,
                 **kwargs: Any) -> Any:
        functional = functional_of(self.graph.model)
        flat = self.graph.model_inputs(inputs)
        if mask is not None:
            for x, m in zip(flat, keras.tree.flatten(mask)):
                if m is not None:
                    set_keras_mask(x, m)
        env = dict(zip(self.graph.input_keys, flat))
        context = dict(kwargs, training=training)
        n = len(self.graph.calls)
        plan = self._plan_for(inputs, training) if needs_checkpoint() else None
        set_switches(self.blocks, plan.blocks if plan is not None else ())
        if plan is None:  # nothing can take a gradient, or inference with no plan
            self._run(env, 0, n, context)
        else:
            self.plan = plan
            self._run_pieces(env, _filters_wait_under_xla(plan.pieces, self.graph), context)
        outputs = [env[k] for k in self.graph.output_keys]
        return unpack_singleton(keras.tree.pack_sequence_as(
            functional._outputs_struct, outputs))  # noqa: SLF001

    def _plan_for(self, inputs: Any, training: Any) -> Optional[ModelPlan]:
        """The given plan, or one made for a budget for this mode and batch (see
        ``PlansByShape``); None for an inference call before any plan."""
        mode = step_mode(self.mode)
        if self.fixed:
            self._expect_plan_mode(mode)
            return self.plan
        self.plans.adopt(made_ahead(self.graph.model, self.budget, self.policies))
        if self.batch_hint is not None:  # fit said how large its batches are
            inputs = with_batch(inputs, self.batch_hint)
        plan, plan_anew = self.plans.find(mode, inputs, training=training)
        if not plan_anew:
            return plan
        key = None
        if self.plan_cache is not None:
            key = plan_key(self.graph, inputs, mode=mode, budget=self.budget,
                           policies=self.policies, frozen=backprop_calls(self.graph),
                           device=device_of_step())
            plan = read_plan(self.plan_cache, key, self.graph, _API)
            if plan is not None:
                self.plans.add(mode, inputs, plan)
                return plan
        profiled = AddedLosses(self._layers)
        try:
            assert self.budget is not None  # no plan given: a budget was
            plan = plan_graph(self.graph, inputs, self.budget, mode=mode, api=_API,
                              runner=model_runner(self.graph), policies=self.policies)
        finally:  # the profile's layer calls add losses of their own
            profiled.take()
        if key is not None:
            write_plan(self.plan_cache, key, plan, _API)
        self.plans.add(mode, inputs, plan)
        return plan

    def _expect_plan_mode(self, mode: str) -> None:
        """Warns (once per mode) when the given plan was made for another kind of
        step: its regions run exactly, but what it was predicted to keep holds
        for the kind it was made for (a graph frees what an eager step keeps,
        XLA assigns buffers its own way)."""
        plan = self.plan
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

    def _run_pieces(self, env: dict[Key, Any], pieces: tuple[Segment, ...],
                    context: dict) -> None:
        """Runs the calls of ``pieces``, the checkpointed ones as one region each."""
        for piece in pieces:
            if piece.checkpointed:
                self._run_checkpointed(env, piece, context)
            else:
                self._run(env, piece.start, piece.stop, context)

    def _run(self, env: dict[Key, Any], start: int, stop: int, context: dict) -> None:
        for i in range(start, stop):
            call = self.graph.calls[i]
            run_call(call, env, context)
            self._forget(env, call.in_keys, i)

    def _forget(self, env: dict[Key, Any], keys: Any, i: int) -> None:
        """Drops values no later call reads (what the tape needs, it keeps)."""
        for key in keys:
            if self._last.get(key, -1) <= i and key in env:
                del env[key]

    def _run_checkpointed(self, env: dict[Key, Any], piece: Segment, context: dict) -> None:
        start, stop = piece.start, piece.stop
        calls = self.graph.calls[start:stop]
        made = {k for call in calls for k in call.out_keys}
        entering = list(dict.fromkeys(k for call in calls for k in call.in_keys
                                      if k not in made))
        leaving = [k for k in dict.fromkeys(k for call in calls for k in call.out_keys)
                   if self._last.get(k, -1) >= stop]
        values = [env[k] for k in entering]
        masks = [get_keras_mask(v) for v in values]
        runs: list[bool] = []  # per call of `region`: whether it ran a checkpointed call

        def region(values: list[Any], masks: list[Any]) -> tuple[list, list]:
            local = dict(zip(entering, values))
            for value, m in zip(values, masks):
                if m is not None:
                    set_keras_mask(value, m)
            # The first call is the forward; later ones are replays.
            entered = checkpoint_scopes_entered()
            with _writes_kept_out(replay=bool(runs), flat=not piece.inner and not any(runs)):
                # Nested regions are checkpointed in the replay (in the forward, which
                # runs untaped, they simply run).
                self._run_pieces(local, piece.pieces, context)
            runs.append(checkpoint_scopes_entered() != entered)
            out = [local[k] for k in leaving]
            return out, [get_keras_mask(v) for v in out]

        region.__name__ = region.__qualname__ = f"region_{calls[0].name}_to_{calls[-1].name}"
        # Outputs that are not the model's own are read only by the later layers
        # of this graph, whose gradients reach the region exactly; no user's tape
        # can ask for them, so their feeding other outputs (an encoder's skip and
        # its pooled copy) is not worth a warning. Each key is one tensor: leaf k.
        model_outputs = set(self.graph.output_keys)
        private = [k for k, key in enumerate(leaving) if key not in model_outputs]
        # State is read first in eager mode only; frozen weights matter only in a
        # graph, where a replay's backward is ordered (core._ordering).
        if tf.executing_eagerly():
            state, frozen = [v for call in calls for v in layer_state(call.layer)], []
        else:
            state, frozen = [], [w for call in calls for w in frozen_weights(call.layer)]
        out, out_masks = checkpointed_call(region, (values, masks), {},
                                           force_seed=self.force_seed, check=self.check,
                                           policy=piece.policy, private_outputs=private,
                                           state=state, frozen=frozen)
        for key, value, m in zip(leaving, out, out_masks):
            if m is not None:
                set_keras_mask(value, m)
            env[key] = value
        self._forget(env, entering, stop - 1)


_A_STEP = {"eager": "an eager", "graph": "a graph", "xla": "an XLA"}


def _filters_wait_under_xla(pieces: tuple[Segment, ...],
                            graph: LayerGraph) -> tuple[Segment, ...]:
    """Under XLA, a checkpointed plan's plain pieces that hold a filter (a
    variable of rank 3 or more) run as regions that save everything.

    Why: XLA:CPU turns each convolution's filter for its input gradient as soon
    as the filter exists, at the start of the step, and holds the copy until the
    backward. A replay's filter reads wait for its gradient
    (``core._ordering.filters_after_gradient``); a region that saves everything
    replays nothing (its forward's values are the ones kept) but its backward
    reads the filters as a replay does. What the step keeps is plain's; ResNet50's
    least plan under XLA needed 17 MiB less (docs/decisions/0004-filters-that-wait.md)."""
    if not any(piece.checkpointed for piece in pieces) or not in_xla_context():
        return pieces
    return tuple(
        Segment(piece.start, piece.stop, True, (), policies.everything_saveable)
        if not piece.checkpointed and _holds_filter(graph, piece) else piece
        for piece in pieces)


def _holds_filter(graph: LayerGraph, piece: Segment) -> bool:
    return any(len(weight.shape) >= 3 for call in graph.calls[piece.start:piece.stop]
               for weight in getattr(call.layer, "weights", ()))


def _writes_kept_out(*, replay: bool, flat: bool) -> Any:
    """For a replay, a scope in which Keras variables are read but not written.

    Why: a replay writes what its forward wrote (BatchNorm's statistics, seeds),
    and ``replayed_state`` puts the values back after it. In a graph, a variable
    write must run, so the replay and every later layer's backward that feeds its
    output gradients ran even when the step's gradient needs none of them (one
    with respect to the model's output held several times plain's memory; see
    docs/decisions/0006-replay-writes-in-a-stateless-scope.md). Kept in a stateless
    scope, the writes are values the rest of the replay reads, as the forward read
    them, and the executor prunes a replay nothing asks for. Only for a flat region: a replay
    that runs checkpointed calls (a nested region, a ``checkpointable`` layer)
    keeps real writes, which those calls' own replays may read later."""
    if not (replay and flat):
        return contextlib.nullcontext()
    return WritesKeptOut()


def model_runner(graph: LayerGraph) -> PlanRunner:
    """What the planner runs a plan of ``graph`` with (see ``planning.plans._plan``):
    a training call of the model by that plan."""
    def runner(plan: ModelPlan) -> Any:
        run = GraphRunner(graph, plan=plan)
        return lambda x: run(x, training=True)

    return runner


def install(model: Any, *, plan: Optional[ModelPlan] = None, budget: Optional[Budget] = None,
            mode: str = "auto", force_seed: bool = False, check: Any = False,
            policies: tuple[Any, ...] = (), plan_cache: Any = None) -> GraphRunner:
    """Makes ``model`` run its graph by ``plan`` (or by the plan for ``budget``
    made on its first training call): replaces the instance's ``call``."""
    graph = read_graph(model, _API)
    if plan is not None:
        names = tuple(call.name for call in graph.calls)
        # Another instance of the same architecture (its layers numbered on by
        # Keras) runs the plan too: regions are positions in the same graph. The
        # same names are not enough where the plan knows what each call computes
        # (a Conv2D "stem" of other width, a slice h[:, :1] for h[:, :64]).
        fits = (plan.call_kinds == graph.kinds() if plan.call_kinds
                else names == plan.names)
        if not fits:
            same = names == plan.names
            named = ("" if len(names) != len(plan.names)
                     else " with the same names" if same else " with other names")
            computed = ("" if not plan.call_kinds else
                        f" {'but' if same else 'and'} other layers, arguments or connections")
            raise ValueError(
                f"{_API}: argument `plan` was made for another model: it has "
                f"{len(plan.names)} layer calls, `{model.name}` has {len(names)}{named}"
                f"{computed}; {_first_difference(plan, graph)}. "
                "Make the plan with plan_model(model, inputs, budget=...) on this model."
            )
        if not all(i < len(graph.calls) and k < len(sublayers(graph.calls[i].layer))
                   for i, k in plan.blocks):
            raise ValueError(
                f"{_API}: argument `plan` checkpoints blocks inside calls that `{model.name}` "
                f"does not have ({', '.join(plan.block_names[:3])}...). Make the plan with "
                "plan_model(model, inputs, budget=...) on this model.")
    current = vars(model).get("call")
    original = current.original_call if isinstance(current, GraphRunner) else None
    if isinstance(current, GraphRunner):  # replaced: its blocks' switches go with it
        remove_switches(current.blocks.values())
    runner = GraphRunner(graph, plan=plan, budget=budget, mode=mode,
                         original_call=original or type(model).call,
                         force_seed=force_seed, check=check, policies=policies,
                         plan_cache=plan_cache)
    install_switches(runner.blocks.values(), force_seed=force_seed, check=check)
    # Plain object.__setattr__: nothing for Keras or TensorFlow to track.
    object.__setattr__(model, "call", runner)
    if plan is None and isinstance(model, keras.Model):
        tell_the_batch_on_fit(model, _tell_runner)
    return runner


def _first_difference(plan: ModelPlan, graph: LayerGraph) -> str:
    """The first layer call where ``plan`` and ``graph`` differ, in words: its
    name, or what the plan says it computes against what the model's does."""
    names = [call.name for call in graph.calls]
    kinds = graph.kinds() if plan.call_kinds else ()
    for i in range(min(len(names), len(plan.names))):
        if plan.names[i] != names[i] and not plan.call_kinds:
            return (f"the first that differs is call {i}: `{plan.names[i]}` in the plan, "
                    f"`{names[i]}` here")
        if plan.call_kinds and plan.call_kinds[i] != kinds[i]:
            ours, theirs = plan.call_kinds[i], kinds[i]
            at = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b) \
                if ours[:len(theirs)] != theirs[:len(ours)] else min(len(ours), len(theirs))
            start = max(0, at - 30)
            return (f"the first that differs is call {i}, `{names[i]}` here (`{plan.names[i]}` "
                    f"in the plan): the plan's reads ...{ours[start:at + 30]}... where this "
                    f"model's reads ...{theirs[start:at + 30]}...")
    return f"the first {min(len(names), len(plan.names))} calls are alike, then one has more"


def _tell_runner(model: Any, batch: Optional[int]) -> None:
    """What ``model.fit`` tells before it trains (see ``_fit_batches``)."""
    runner = vars(model).get("call")
    if isinstance(runner, GraphRunner):
        runner.batch_hint = batch


def with_batch(inputs: Any, batch: int) -> Any:
    """``inputs`` with each unknown first dimension ``batch``: symbolic stand-ins
    (KerasTensors) of the shapes to plan for; known shapes stay as they are."""
    def fill(leaf: Any) -> Any:
        shape = getattr(leaf, "shape", None)
        if shape is None or not len(shape) or shape[0] is not None:
            return leaf
        return KerasTensor((batch, *tuple(shape)[1:]), dtype=leaf.dtype)

    return tf.nest.map_structure(fill, inputs)
