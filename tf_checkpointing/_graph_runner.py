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

The runner only runs: which plan a call runs (given, made, reused, read from a
plan file) is its plan source's answer, a
:class:`~tf_checkpointing._plan_maker.PlanMaker` for ``apply_checkpointing``, a
:class:`OnePlan` where the planner runs a plan to measure it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Protocol

import keras
import tensorflow as tf

from tf_checkpointing import policies
from tf_checkpointing._block_switch import set_switches
from tf_checkpointing.core._flags import checkpoint_scopes_entered
from tf_checkpointing.core._internals import get_keras_mask, set_keras_mask, unpack_singleton
from tf_checkpointing.core._recompute import (
    checkpointed_call,
    frozen_weights,
    layer_state,
    needs_checkpoint,
)
from tf_checkpointing.core._state import WritesKeptOut
from tf_checkpointing.planning.layer_graph._blocks import (
    block_layers,
    holds_filter,
    inner_block_choices,
)
from tf_checkpointing.planning.layer_graph._layer_graph import (
    Key,
    LayerGraph,
    functional_of,
    run_call,
)
from tf_checkpointing.planning.measuring._allocator import in_xla_context
from tf_checkpointing.planning.measuring._modes import Mode, step_mode
from tf_checkpointing.planning.plans._plan import ModelPlan, PlanRunner, Segment

__all__: list[str] = []


class PlanSource(Protocol):
    """What a :class:`GraphRunner` asks for the plan of each call."""

    given: Optional[ModelPlan]  # the one plan, where one was given (its blocks switch)

    def plan_for(self, inputs: Any, mode: Mode, *,
                 training: Any) -> Optional[ModelPlan]: ...  # pragma: no cover


class OnePlan:
    """A plan source that answers ``plan`` for every call."""

    def __init__(self, plan: ModelPlan) -> None:
        self.given = plan

    def plan_for(self, inputs: Any, mode: Mode, *, training: Any) -> ModelPlan:
        return self.given


class GraphRunner:
    """The ``call`` of a model that runs its graph by the plans ``maker`` gives."""

    def __init__(self, graph: LayerGraph, maker: PlanSource, *, original_call: Any = None,
                 force_seed: bool = False, check: Any = False) -> None:
        self.graph = graph
        self.maker = maker
        self.force_seed, self.check = force_seed, check
        self.plan: Optional[ModelPlan] = maker.given  # the plan of the last call
        self.original_call = original_call
        readers = graph.consumers()
        outputs = set(graph.output_keys)
        n = len(graph.calls)
        # The last call reading each key (n: the model returns it).
        self._last = {k: n if k in outputs else max(r) for k, r in readers.items()}
        for key in outputs:
            self._last[key] = n
        # The blocks inside calls a plan may checkpoint (see _block_switch).
        refs = {ref for choice in inner_block_choices(graph) for ref in choice}
        refs.update(maker.given.blocks if maker.given is not None else ())
        self.blocks = dict(zip(sorted(refs), block_layers(graph, tuple(sorted(refs)))))

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
        plan = (self.maker.plan_for(inputs, step_mode(), training=training)
                if needs_checkpoint() else None)
        set_switches(self.blocks, plan.blocks if plan is not None else ())
        if plan is None:  # nothing can take a gradient, or inference with no plan
            self._run(env, 0, n, context)
        else:
            self.plan = plan
            self._run_pieces(env, _filters_wait_under_xla(plan.pieces, self.graph), context)
        outputs = [env[k] for k in self.graph.output_keys]
        return unpack_singleton(keras.tree.pack_sequence_as(
            functional._outputs_struct, outputs))  # noqa: SLF001

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
        if not piece.checkpointed and holds_filter(graph, piece.start, piece.stop) else piece
        for piece in pieces)


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
        run = GraphRunner(graph, OnePlan(plan))
        return lambda x: run(x, training=True)

    return runner
