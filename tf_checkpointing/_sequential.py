"""Checkpointing a chain of layers: ``checkpoint_sequential`` and ``CheckpointedSequential``.

Most models are, at some level, a chain: a stack of transformer blocks, the
stages of a residual network, the layers of an MLP. Checkpointing each layer separately
keeps every layer's input (``N`` inputs) and saves little when layers are
cheap (keras #20743); checkpointing the whole chain keeps nothing but makes the
replay hold every activation at once. Segments in between are the point: ``k``
segments keep ``k`` inputs plus one segment's activations, least at
``k ~ sqrt(N)`` (Chen et al. 2016), for one extra forward. With a byte
``budget`` the planner (:mod:`tf_checkpointing.planning.solving._chain`) places segments, and
segments inside segments, on the measured layers.

Unlike ``torch.utils.checkpoint.checkpoint_sequential``, the input may be any
nested structure of tensors, keyword arguments reach exactly the layers whose
call takes them, and each segment is a
:func:`~tf_checkpointing.core._recompute.checkpointed_call`: dropout masks and
BatchNorm statistics are replayed as the forward ran them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import tensorflow as tf

from tf_checkpointing import policies as save_policies
from tf_checkpointing.core._recompute import checkpointed_call, frozen_weights, needs_checkpoint
from tf_checkpointing.planning._errors import PlanningTypeError, PlanningValueError, worded
from tf_checkpointing.planning.layer_graph._calling import (
    layer_names,
    route_keywords,
    validate_layers,
)
from tf_checkpointing.planning.layer_graph._frozen import tape_reaches
from tf_checkpointing.planning.measuring._choices import expect_policies
from tf_checkpointing.planning.measuring._modes import expect_mode
from tf_checkpointing.planning.plans._budget import expect_budget
from tf_checkpointing.planning.plans._plan import PlanRunner, Segment, SequentialPlan, even_plan
from tf_checkpointing.planning.solving._chain import cached_plan

__all__ = ["checkpoint_sequential", "plan_sequential", "run_plan"]

Segments = Union[int, str]
_API = "checkpoint_sequential"


@tf.autograph.experimental.do_not_convert
def checkpoint_sequential(
    layers: Sequence[Any],
    inputs: Any,
    *,
    segments: Segments = "sqrt",
    budget: Optional[Union[float, str]] = None,
    policy: Optional[save_policies.Policy] = None,
    policies: Any = None,
    **kwargs: Any,
) -> Any:
    """Runs ``layers`` one after another, checkpointing segments of them.

    Each checkpointed segment keeps only its input during the forward pass and
    runs its layers again in backprop; gradients are exactly the plain chain's.
    With ``segments=k`` the chain is cut into ``k`` nearly equal pieces and all
    but the last are checkpointed (the last one's replay would begin right
    away, saving nothing). With ``budget`` the chain is profiled once, on the
    first call for these shapes, and the schedule with the least recomputation
    within the budget is used (see :func:`plan_sequential`); called while a
    ``tf.function`` is traced, it plans for what a graph keeps. With
    ``policies`` as well, the plan also chooses per layer among save policies.

    Args:
        layers: the chain: Keras layers or callables; the first receives
            ``inputs`` as one argument, each next one the previous output.
        inputs: a tensor or a nested structure of tensors.
        segments: number of pieces, from 1 (no checkpointing) to ``len(layers)``,
            or ``"sqrt"`` for ``round(sqrt(len(layers)))``.
        budget: bytes the training step may allocate above what is allocated
            before it, or ``"min"`` for the least memory; instead of ``segments``.
        policy: a save policy (:mod:`tf_checkpointing.policies`) for every
            checkpointed segment: also keep what it picks, replay the rest.
        policies: with ``budget``, the save policies the plan may choose per
            layer (see :func:`plan_sequential`): ``"auto"`` for
            ``dots_saveable`` and ``dots_with_no_batch_dims_saveable``, or a
            list of policies (``"auto"`` among them stands for those two).
        **kwargs: keywords for the layers, e.g. ``training=True``; each layer
            gets those its call accepts (``Dropout`` gets ``training``,
            ``LayerNormalization`` and ``tf.nn.relu`` do not). Tensors among them
            get gradients.

    Returns:
        The last layer's output.

    Example:
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing import checkpoint_sequential
        >>> layers = [keras.layers.Dense(32, activation="relu") for _ in range(9)]
        >>> x = tf.random.normal([4, 32])
        >>> with tf.GradientTape() as tape:
        ...     y = checkpoint_sequential(layers, x, segments=3, training=True)
        ...     loss = tf.reduce_sum(y)
        >>> len(tape.gradient(loss, [v for l in layers for v in l.trainable_variables]))
        18
    """
    with worded(_API):  # planning's errors, warnings and progress name it
        layers = validate_layers(layers)
        candidates = _expect_choice(policy, policies, budget)
        policy = save_policies.resolve(policy, api=_API)
        routed = route_keywords(layers, kwargs)
        if budget is None:
            count = expect_segments(segments, len(layers))
        else:
            budget = expect_budget(budget)
            if not isinstance(segments, str) or segments != "sqrt":
                raise PlanningValueError(
                    "pass either `segments` or `budget`, not both; received "
                    f"segments={segments!r} and budget={budget!r}. Drop segments= to plan "
                    "for the budget, or drop budget= for fixed segments."
                )
        if not needs_checkpoint():  # eager with no tape: nothing to plan or keep
            return _run_layers(layers, routed, 0, len(layers), inputs)
        if budget is None:
            plan = even_plan(layer_names(layers), count)
        else:
            plan = cached_plan(layers, inputs, budget, kwargs, routed,
                               runner=chain_runner(layers, kwargs, routed),
                               policies=candidates, input_grad=tape_reaches(inputs))
    return run_plan(layers, plan, inputs, kwargs, routed, policy=policy)


def plan_sequential(layers: Any, inputs: Any, *, budget: Union[float, str],
                    mode: str = "auto", policies: Any = None,
                    **kwargs: Any) -> SequentialPlan:
    """Plans the checkpoints of a chain of layers for a memory budget.

    Profiles the chain once on ``inputs`` (each layer's forward and backward,
    measured with the device allocator; the state the layers change is put
    back), then finds the schedule, nested checkpoints included, that
    recomputes the least while its peak stays within ``budget``. A budget at
    or above the plain step's peak recomputes nothing.

    With ``policies``, a layer may also run as a checkpointed call of its own
    that keeps what a save policy picks (the matrix products, say) and replays
    the rest: less memory than plain, less time than a full replay. The plan
    then takes, per layer, the cheapest of plain, a full replay (alone or in a
    segment) and each policy: the same choice as ``torch.compile``'s
    ``activation_memory_budget`` makes per op, with the layer as the unit and
    JAX's policies as the options. Each layer's ``tf.function`` training step
    is timed plain, fully replayed and with each policy (in interleaved rounds;
    identical layers once), so planning takes longer; in eager mode a policy
    keeps nothing (see ``docs/save-policies.md``), so ``policies`` is unused
    there.

    Args:
        layers: the chain: Keras layers or callables, each fed the previous output.
        inputs: the chain's input, a tensor or a nested structure of tensors, at
            the batch size training uses (the plan is for these shapes).
        budget: bytes the training step may allocate on top of what is allocated
            before it (weights, inputs): activations, stored checkpoints,
            gradients; or ``"min"``: the schedule with the least peak (least
            recomputation among those), as ``plan_model`` takes it.
        mode: how the training step runs, which decides what backprop keeps:
            ``"eager"``; ``"graph"`` for a ``tf.function`` (``Model.fit``
            included), whose graph keeps fewer intermediates, so the same budget
            leaves more layers un-checkpointed; ``"auto"`` (the default):
            ``"graph"`` when called while a ``tf.function`` is being traced,
            else ``"eager"``; ``"xla"`` for a ``jit_compile=True`` step (also
            chosen by ``"auto"`` while one is traced): a graph profile whose
            peaks are mapped onto the measured XLA steps of the plain chain and of
            its least-memory plan (XLA keeps buffers checkpointing does not shrink).
        policies: the save policies a layer may keep its activations with:
            None (the default: plain or full replays only); ``"auto"``:
            ``policies.dots_saveable`` and
            ``policies.dots_with_no_batch_dims_saveable``; or a list of
            policies, in which ``"auto"`` stands for those two
            (``["auto", policies.save_only_these_names("mlp_out")]``).
        **kwargs: keywords for the layers, e.g. ``training=True``; each layer gets
            those its call accepts, as in :func:`checkpoint_sequential`.

    Returns:
        A :class:`SequentialPlan`; pass its ``budget`` to
        :func:`checkpoint_sequential` or read ``segments``, ``predicted_peak_bytes``
        and ``extra_forward_layers``; ``str(plan)`` shows each segment and its policy.

    Raises:
        ValueError: the budget is below the least memory any schedule needs (the
            message gives it), or not a positive number.
        TypeError: ``policies`` is not None, ``"auto"`` or a list of policies.

    Example (on CPU, with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow
    is imported):
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing.plans import plan_sequential
        >>> layers = [keras.layers.Dense(64, activation="relu") for _ in range(16)]
        >>> x = tf.random.normal([1024, 64])
        >>> plan = plan_sequential(layers, x, budget=4 * 2**20)
        >>> plan.predicted_peak_bytes <= 4 * 2**20 < plan.plain_peak_bytes
        True
        >>> plan.segments[0][0], plan.segments[-1][1], plan.extra_forward_layers > 0
        (0, 16, True)
        >>> mixed = plan_sequential(layers, x, budget=4 * 2**20, mode="graph",
        ...                         policies="auto")
        >>> mixed.predicted_peak_bytes <= 4 * 2**20
        True
        >>> print(mixed)  # doctest: +ELLIPSIS
        SequentialPlan (graph): 16 layers, budget 4.00 MiB -> ...
    """
    with worded("plan_sequential"):  # planning's errors, warnings and progress name it
        layers = validate_layers(layers)
        checked = expect_budget(budget)
        candidates = expect_policies(policies)
        mode = expect_mode(mode)
        routed = route_keywords(layers, kwargs)
        return cached_plan(layers, inputs, checked, kwargs, routed,
                           runner=chain_runner(layers, kwargs, routed), mode=mode,
                           policies=candidates)


def chain_runner(layers: Sequence[Any], kwargs: dict[str, Any],
                 routed: list[dict]) -> PlanRunner:
    """What the planner runs a plan of ``layers`` with (see ``planning.plans._plan``)."""
    return lambda plan: lambda x: run_plan(layers, plan, x, kwargs, routed)



def _expect_choice(policy: Any, candidates: Any, budget: Any) -> tuple[Any, ...]:
    """``policies=`` validated: it needs a budget, and excludes ``policy=`` (the
    chain API called words the errors, see ``planning._errors.worded``)."""
    chosen = expect_policies(candidates)
    if candidates is not None and budget is None:
        raise PlanningValueError(
            f"argument `policies` chooses a policy per layer for a memory budget, "
            f"but no budget was given; received policies={candidates!r} and budget=None. "
            "Pass budget=... (bytes), or policy=... for one policy on every segment."
        )
    if candidates is not None and policy is not None:
        raise PlanningValueError(
            f"pass either `policy` (one policy for every checkpointed segment) or "
            f"`policies` (the planner chooses per layer), not both; received "
            f"policy={policy!r} and policies={candidates!r}. Drop one of them."
        )
    return chosen


def expect_segments(segments: Any, num_layers: int) -> int:
    """``segments`` as a count in ``[1, num_layers]``, or a clear error (worded by
    the chain API called)."""
    if isinstance(segments, str) and segments == "sqrt":
        return max(1, round(math.sqrt(num_layers)))
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise PlanningTypeError(
            f"argument `segments` must be an int or 'sqrt'; received "
            f"{segments!r} of type {type(segments).__name__}. Pass e.g. segments=4 or "
            "segments='sqrt'."
        )
    if not 1 <= segments <= num_layers:
        raise PlanningValueError(
            f"argument `segments` must be between 1 and the number of layers "
            f"({num_layers}); received segments={segments}. Pass a count in that range, "
            "or segments='sqrt'."
        )
    return segments


@tf.autograph.experimental.do_not_convert
def run_plan(layers: Sequence[Any], plan: SequentialPlan, inputs: Any,
             kwargs: dict[str, Any], routed: list[dict], policy: Any = None) -> Any:
    """Runs the chain as ``plan`` says. ``kwargs`` (all keywords) go to each
    checkpointed call, so tensors among them get gradients; ``routed`` says
    which of them each layer receives."""
    if not needs_checkpoint():  # nothing can take a gradient: no checkpoints
        return _run_layers(layers, routed, 0, len(layers), inputs)
    return _run_pieces(layers, routed, plan.pieces, inputs, kwargs, policy)


def _run_layers(layers, routed, start, stop, x):
    for k in range(start, stop):
        x = layers[k](x, **routed[k])
    return x


def _run_pieces(layers, routed, pieces: Sequence[Segment], x, kwargs, policy=None):
    for piece in pieces:
        # A policy the plan chose for this segment, else the one for every segment.
        chosen = policy if piece.policy is None else piece.policy
        if piece.checkpointed and chosen is not save_policies.everything_saveable:
            # The keywords go in as arguments (their tensors get gradients);
            # the segment routes the values it receives, fresh in the replay.
            x = checkpointed_call(_segment(layers, routed, piece, policy), (x,), dict(kwargs),
                                  policy=chosen, frozen=[] if tf.executing_eagerly() else [
                                      w for layer in layers[piece.start:piece.stop]
                                      for w in frozen_weights(layer)])
        else:
            x = _run_layers(layers, routed, piece.start, piece.stop, x)
    return x


def _segment(layers, routed, piece: Segment, policy=None):
    def segment(x, /, **kwargs):
        routed_now = [{k: kwargs[k] for k in r} for r in routed]
        return _run_pieces(layers, routed_now, piece.pieces, x, kwargs, policy)

    segment.__name__ = segment.__qualname__ = f"layers_{piece.start}_to_{piece.stop}"
    return segment

