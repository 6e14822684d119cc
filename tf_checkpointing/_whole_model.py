"""The whole-model side of ``apply_checkpointing``: ``budget=`` / ``plan=``, and
the warning for per-layer selections that predictably cost memory.

Why warn? A checkpointed layer keeps its inputs for the replay. In a DAG of
small layers the plain model keeps most of those anyway (a convolution keeps
its input, a BatchNorm its input, a ReLU its output), so checkpointing single
layers saves at best the few bytes their backward kept on top, and where the
layer's backward kept *less* than its input (a ReLU keeps its output, an Add
nothing), checkpointing it adds a tensor, and the step peaks above plain (see
docs/decisions/0032-per-layer-selection-warning.md). The graph says which tensors each layer's
backward keeps, so the cost is predicted from shapes alone, before anything runs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Union

import keras
import tensorflow as tf

from tf_checkpointing._apply_arguments import expect_layer_calls
from tf_checkpointing._block_switch import switches_installed
from tf_checkpointing._graph_runner import model_runner
from tf_checkpointing.core._internals import keras_numpy_ops
from tf_checkpointing.planning._constants import COSTLY_SELECTION_RATIO
from tf_checkpointing.planning._errors import worded
from tf_checkpointing.planning.layer_graph._blocks import candidate_layers
from tf_checkpointing.planning.layer_graph._layer_graph import functional_of, read_graph
from tf_checkpointing.planning.measuring._choices import expect_policies
from tf_checkpointing.planning.measuring._modes import expect_mode
from tf_checkpointing.planning.plans._budget import expect_budget
from tf_checkpointing.planning.plans._plan import ModelPlan
from tf_checkpointing.planning.plans._reuse import remember
from tf_checkpointing.planning.solving._model_planner import plan_graph

__all__ = ["plan_model"]

_API = "apply_checkpointing"
_PLAN_MODEL = "plan_model"
_KEEP_OUTPUT = {"relu", "sigmoid", "tanh", "softmax", "elu", "relu6", "exponential"}
_KEEP_NOTHING = (
    keras.layers.Add, keras.layers.Subtract, keras.layers.Concatenate, keras.layers.Reshape,
    keras.layers.Flatten, keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D,
    keras.layers.ZeroPadding3D, keras.layers.Cropping1D, keras.layers.Cropping2D,
    keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
    keras.layers.AveragePooling1D, keras.layers.AveragePooling2D, keras.layers.Permute,
    keras.layers.Identity, keras.layers.Rescaling,
    # Op nodes of a functional graph (`x + y`, `keras.ops.concatenate`).
    keras_numpy_ops.Add, keras_numpy_ops.Subtract, keras_numpy_ops.Concatenate,
    keras_numpy_ops.Reshape, keras_numpy_ops.Transpose,
)
_KEEP_INPUT = (
    keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D, keras.layers.Conv2D,
    keras.layers.Conv3D, keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D,
    keras.layers.Conv2DTranspose, keras.layers.BatchNormalization,
    keras.layers.LayerNormalization, keras.layers.Multiply, keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D, keras.layers.GlobalMaxPooling2D, keras.layers.Dropout,
    keras.layers.Activation, keras.layers.ReLU, keras.layers.Softmax, keras_numpy_ops.Multiply,
)


def plan_model(model: Any, inputs: Any, *, budget: Union[int, float, str], mode: str = "auto",
               policies: Any = None) -> ModelPlan:
    """Plans which regions of a functional model to checkpoint for a memory budget.

    Reads the model's layer graph (functional models, ``keras.Sequential``, and
    functional models nested in them as layers), profiles each layer call on
    ``inputs`` with the device allocator (the state the layers change is put
    back), and picks the regions of consecutive calls to run checkpointed,
    with the least recomputation whose predicted peak fits ``budget`` (see
    :mod:`tf_checkpointing.planning.solving._regions` for the algorithm). The model is
    not changed: pass the plan to ``apply_checkpointing(model, plan=plan)``, or
    call ``apply_checkpointing(model, budget=...)`` with the same budget (and
    policies): its training calls run this plan where they would plan the same,
    and where they cannot plan (a ``fit`` whose batch size is unknown).

    A region of a ``tf.function`` or XLA plan may be replayed under a save
    policy: it keeps what the policy picks inside it besides its inputs, and
    its replay skips those ops. ``policies.reductions_saveable`` is always
    offered: it keeps the results of reductions (a BatchNorm's batch mean and
    variance, a LayerNorm's), which cost almost no memory, and spares the
    replay the passes over the input that made them (measured in
    docs/save-policies.md and docs/decisions/0022-reductions-saveable-per-region.md).
    ``policies`` offers more. Each distinct layer call that a policy keeps
    something of is measured under each policy (bytes kept, and its training
    step timed as the chain planner times its layers), and the program picks
    per region the fastest replay that fits; in eager mode a policy keeps
    nothing, so every region replays fully there.

    Args:
        model: a built functional or Sequential Keras model.
        inputs: a batch of its inputs at the training batch size.
        budget: bytes a training step may allocate above what is allocated
            before it (weights, inputs), or ``"min"`` for the least memory.
        mode: how the step runs: ``"eager"``, ``"graph"`` (``tf.function``,
            ``Model.fit``), ``"xla"`` (``jit_compile=True``), or ``"auto"``:
            ``"xla"`` or ``"graph"`` while such a function is traced, else
            ``"eager"``.
        policies: more save policies a region may be replayed under, besides
            ``policies.reductions_saveable``: None (the default: none more),
            ``"auto"`` (``policies.dots_saveable`` and
            ``policies.dots_with_no_batch_dims_saveable``), or a list of
            policies in which ``"auto"`` stands for those two, as for
            :func:`plan_sequential`.

    Returns:
        A :class:`ModelPlan`.

    Raises:
        ValueError: the budget is below the least any plan needs (the message
            gives it), or the model's graph cannot be read.
        TypeError: ``policies`` is not None, ``"auto"`` or a list of policies.

    Example (with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow is imported):
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing import plan_model
        >>> x = keras.Input((32,))
        >>> h = x
        >>> for _ in range(6):
        ...     h = keras.layers.Add()([h, keras.layers.Dense(32, activation="relu")(h)])
        >>> model = keras.Model(x, keras.layers.Dense(1)(h))
        >>> plan = plan_model(model, tf.random.normal([256, 32]), budget="min")
        >>> plan.predicted_peak_bytes <= plan.plain_peak_bytes
        True
    """
    with worded(_PLAN_MODEL):  # planning's errors and warnings name plan_model
        mode = expect_mode(mode)
        checked = expect_budget(budget)
        candidates = expect_policies(policies)
        graph = read_graph(model)
        _expect_inputs(model, graph, inputs)
        expect_layer_calls(graph)
        # Planning may run blocks inside calls checkpointed: switches for as long as it does.
        with switches_installed(candidate_layers(graph)):
            plan = plan_graph(graph, inputs, checked, mode=mode, runner=model_runner(graph),
                              policies=candidates)
    # apply_checkpointing(model, budget=...) runs it where it would plan the same
    # (a fit whose batch size is unknown, see planning.plans._reuse).
    remember(model, inputs, checked, candidates, plan)
    return plan


def _expect_inputs(model: Any, graph: Any, inputs: Any) -> None:
    """Refuses a batch that is not the model's inputs (Keras only warns when a
    one-input model gets a list, and the model then fails when called so)."""
    given = tf.nest.flatten(inputs)
    if len(given) == len(graph.input_keys):
        return
    wanted = [tuple(t.shape) for t in tf.nest.flatten(functional_of(model).inputs)]
    received = [tuple(getattr(t, "shape", ())) for t in given]
    raise ValueError(
        f"{_PLAN_MODEL}: argument `inputs` must be a batch of `{model.name}`'s inputs: "
        f"{len(wanted)} tensor(s) of shapes {wanted}; received {len(received)} of shapes "
        f"{received}. Pass the batch as the model is called on it, e.g. "
        f"{_PLAN_MODEL}(model, x, budget=...) with x of shape {wanted[0]} and a batch size.")


def warn_if_costly(model: Any, chosen: list[Any]) -> None:
    """Warns when checkpointing ``chosen`` layers one by one is predicted to keep
    (nearly) as many activation bytes as the plain model does: it then saves no
    memory and costs time (see docs/decisions/0032-per-layer-selection-warning.md)."""
    if functional_of(model) is None or not all(_rule(layer) for layer in chosen):
        return  # no graph, or a layer whose backward we cannot predict: no warning
    graph = read_graph(model)  # it has one (functional_of above)
    ids = {id(layer) for layer in chosen}
    plain: set[Any] = set()
    checkpointed: set[Any] = set()
    for call in graph.calls:
        rule = _rule(call.layer)
        if rule is None:
            return
        kept = set(_kept_keys(call, rule))
        plain |= kept
        checkpointed |= set(call.in_keys) if id(call.layer) in ids else kept
    sizes = {}
    for call in graph.calls:
        for t, key in zip(call.arguments.keras_tensors, call.arg_keys):
            sizes[key] = _size(t)
    before = sum(sizes.get(k, 0) for k in plain)
    after = sum(sizes.get(k, 0) for k in checkpointed)
    if before and after >= COSTLY_SELECTION_RATIO * before:
        warnings.warn(
            f"apply_checkpointing: checkpointing these {len(chosen)} layers of "
            f"`{model.name}` one by one is predicted to keep {after / before:.2f}x the "
            "activations of the plain model (a checkpointed layer keeps its inputs, which "
            "this graph's other layers mostly keep anyway), so it saves no memory and "
            "costs time. Let the library choose multi-layer regions instead: "
            "apply_checkpointing(model, budget='min') or budget=<bytes>.",
            stacklevel=3,
        )


def _rule(layer: Any) -> Optional[str]:
    """What a known Keras layer's backward keeps: "input", "output", "both" or
    "nothing"; None for other layers."""
    if isinstance(layer, _KEEP_NOTHING):
        return "nothing"
    if not isinstance(layer, _KEEP_INPUT):
        return None
    activation = getattr(getattr(layer, "activation", None), "__name__", "linear")
    if isinstance(layer, (keras.layers.Activation, keras.layers.ReLU, keras.layers.Softmax)):
        name = "softmax" if isinstance(layer, keras.layers.Softmax) else (
            "relu" if isinstance(layer, keras.layers.ReLU) else activation)
        return "output" if name in _KEEP_OUTPUT else "input"
    if isinstance(layer, keras.layers.MaxPooling2D) or activation not in ("linear", None):
        return "both"
    return "input"


def _kept_keys(call: Any, rule: str) -> list[Any]:
    keys = []
    if rule in ("input", "both"):
        keys += [k for t, k in zip(call.arguments.keras_tensors, call.arg_keys)
                 if "float" in str(t.dtype)]
    if rule in ("output", "both"):
        keys += list(call.out_keys)
    return keys


def _size(tensor: Any) -> int:
    dims = [d for d in tensor.shape if d is not None]
    return math.prod(dims) * 4
