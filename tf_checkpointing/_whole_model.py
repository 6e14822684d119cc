"""The whole-model side of ``apply_checkpointing``: ``budget=`` / ``plan=``, and
the warning for per-layer selections that predictably cost memory.

Why warn? A checkpointed layer keeps its inputs for the replay. In a DAG of
small layers the plain model keeps most of those anyway (a convolution keeps
its input, a BatchNorm its input, a ReLU its output), so checkpointing single
layers saves at best the few bytes their backward kept on top, and where the
layer's backward kept *less* than its input (a ReLU keeps its output, an Add
nothing), checkpointing it adds a tensor: every ``Activation`` of ResNet50
checkpointed peaks at 1.42x plain. The graph says which tensors each layer's
backward keeps, so the cost is predicted from shapes alone, before anything runs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import keras

from tf_checkpointing._graph_runner import install
from tf_checkpointing.planning._choices import expect_policies
from tf_checkpointing.planning._graph import functional_of, read_graph
from tf_checkpointing.planning._model import expect_model_budget
from tf_checkpointing.planning._plan import ModelPlan

__all__: list[str] = []

_API = "apply_checkpointing"
_KEEP_OUTPUT = {"relu", "sigmoid", "tanh", "softmax", "elu", "relu6", "exponential"}
_KEEP_NOTHING = (
    keras.layers.Add, keras.layers.Subtract, keras.layers.Concatenate, keras.layers.Reshape,
    keras.layers.Flatten, keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D,
    keras.layers.ZeroPadding3D, keras.layers.Cropping1D, keras.layers.Cropping2D,
    keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
    keras.layers.AveragePooling1D, keras.layers.AveragePooling2D, keras.layers.Permute,
    keras.layers.Identity, keras.layers.Rescaling,
)
_KEEP_INPUT = (
    keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D, keras.layers.Conv2D,
    keras.layers.Conv3D, keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D,
    keras.layers.Conv2DTranspose, keras.layers.BatchNormalization,
    keras.layers.LayerNormalization, keras.layers.Multiply, keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D, keras.layers.GlobalMaxPooling2D, keras.layers.Dropout,
    keras.layers.Activation, keras.layers.ReLU, keras.layers.Softmax,
)


def checkpoint_whole_model(model: Any, *, budget: Any = None,
                           plan: Optional[ModelPlan] = None, force_seed: bool = False,
                           check: Any = False, policies: Any = None) -> None:
    """Installs the graph runner on ``model`` for ``plan``, or for ``budget``
    (planned on the first training call, choosing among ``policies``)."""
    if plan is not None and not isinstance(plan, ModelPlan):
        raise TypeError(
            f"{_API}: argument `plan` must be a ModelPlan from plan_model; received "
            f"{plan!r} of type {type(plan).__name__}. Make one with "
            "plan_model(model, inputs, budget=...)."
        )
    candidates = expect_policies(policies, _API)
    if plan is not None and candidates:
        raise TypeError(
            f"{_API}: argument `policies` chooses save policies while planning for a "
            f"budget, but a plan was given (its regions' policies are in it); received "
            f"policies={policies!r} with plan. Pass plan_model(model, inputs, budget=..., "
            "policies=...) as plan=, or budget=... with policies=..."
        )
    bytes_ = None if plan is not None else expect_model_budget(budget, _API)
    install(model, plan=plan, budget=bytes_, force_seed=force_seed, check=check,
            policies=candidates)


def warn_if_costly(model: Any, chosen: list[Any]) -> None:
    """Warns when checkpointing ``chosen`` layers one by one is predicted to keep
    at least as many activation bytes as the plain model does."""
    if functional_of(model) is None or not all(_rule(layer) for layer in chosen):
        return  # no graph, or a layer whose backward we cannot predict: no warning
    graph = read_graph(model, _API)
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
    if before and after >= 0.97 * before:
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
