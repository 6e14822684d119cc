"""Layer calls that no gradient reaches: a frozen backbone's.

``Model.fit``'s tape (and a usual custom step's) differentiates the trainable
variables, not the model's inputs. A call with no trainable weights that reads
only the model's inputs or other such calls (a backbone set ``trainable =
False`` under a trainable head, a ``Rescaling`` before the first convolution)
is on no path to them: a ``tf.function`` step's backward graph, built for
those variables only, does not read what it made, so it keeps nothing for the
backward, runs no backward, and a region around it recomputes nothing. (An
eager step is different: its tape records every op that reads a watched
variable, and Keras' frozen variables are still trainable for TensorFlow, so
it keeps a frozen backbone's tensors, nearly as many as a trained one's. Eager
plans count every call as reached.)

Each call's profile reading is taken with its inputs watched (a reading does
not depend on the plan), so it describes such a call as backprop would run
it. :func:`without_backward` corrects that: without it a frozen backbone was
modelled at several times its measured plain peak, and the planner
checkpointed it and refused budgets plain would have met (see
docs/decisions/0030-frozen-layers.md).

The model's inputs are taken as not differentiated: a custom step that
watches them (``tape.watch(x)``) and asks for their gradient runs the frozen
calls' backward too, and keeps more than planned.

A chain (``CheckpointedSequential``, ``checkpoint_sequential``) is the same
with one path: :func:`frozen_prefix` is the number of leading layers no
gradient reaches, when no tape differentiates the chain's input (read from the
tapes at the call), and :func:`chain_without_backward` gives them their real
costs; without it the chain planner overestimated plain and its least plan
replayed the frozen layers too (see docs/decisions/0030-frozen-layers.md).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_checkpointing.core._internals import record
from tf_checkpointing.planning._errors import caller
from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph
from tf_checkpointing.planning.measuring._layer_profile import ChainProfile
from tf_checkpointing.planning.measuring._lifetimes import GraphCosts

__all__: list[str] = []


def backprop_calls(graph: LayerGraph, mode: str = "graph") -> tuple[bool, ...]:
    """Per call, whether the backward of a ``mode`` step reaches it: it has
    trainable weights or reads a tensor made by a call that backprop reaches
    (never a model input); in an eager step every call (see the module).

    Example:
        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._frozen import backprop_calls
        >>> from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
        >>> x = keras.Input((4,))
        >>> frozen = keras.layers.Dense(4, trainable=False)
        >>> h = keras.layers.Dense(4)(keras.layers.ReLU()(frozen(x)))
        >>> backprop_calls(read_graph(keras.Model(x, h)))
        (False, False, True)
    """
    if mode == "eager":
        return (True,) * len(graph.calls)
    made = graph.producers()
    reached: list[bool] = []
    for call in graph.calls:
        trainable = bool(trained_variables(call.layer))
        reached.append(trainable or any(made[k] >= 0 and reached[made[k]]
                                        for k in call.in_keys))
    return tuple(reached)


def without_backward(costs: GraphCosts, reached: tuple[bool, ...]) -> GraphCosts:
    """``costs`` with the calls backprop does not reach run as they do: each
    keeps only its outputs (until their last reader, or a later backward that
    reads them), peaks as its untaped forward, runs no backward and makes no
    gradients, and no gradient flows through the tensors it makes (nor through
    the model's inputs) at any cut."""
    outside = ~np.array(reached, bool)
    if not outside.any():
        return costs
    n = costs.n
    made_by = costs.producer
    out_bytes = np.zeros(n)
    np.add.at(out_bytes, made_by[made_by >= 0], costs.size[made_by >= 0])
    # Gradient bytes at each cut of the tensors no gradient flows through.
    no_grad = np.zeros(n + 1)
    for size, p, last, floating in zip(costs.size, made_by, costs.last, costs.floating):
        if floating and (p < 0 or outside[p]):
            no_grad[p + 1:last + 1] += size
    savers = None if costs.savers is None else [
        [s for s in saving if s >= n or not outside[s]] for saving in costs.savers]
    zero = lambda values: np.where(outside, 0.0, values)  # noqa: E731
    return dataclasses.replace(
        costs,
        kept=np.where(outside, out_bytes, costs.kept),
        fwd=np.where(outside, costs.fwd0, costs.fwd),
        bwd=zero(costs.bwd), wgrad=zero(costs.wgrad),
        own_wgrad=None if costs.own_wgrad is None else zero(costs.own_wgrad),
        bwd_alone=None if costs.bwd_alone is None else zero(costs.bwd_alone),
        dx=np.maximum(costs.dx - no_grad, 0.0),
        savers=savers)


def trained_variables(layer: Any) -> Any:
    """The variables of ``layer`` (and its sublayers) that training updates,
    read from each variable's own flag, as ``model.trainable_variables`` (what
    ``Model.fit`` trains) reads them; None for a callable that is not a layer.

    Not ``layer.trainable_weights``: that is empty for a layer set ``trainable =
    False`` before it was built, while the sublayers it creates in ``build``
    stay trainable and are trained (a keras_hub ``TransformerEncoder`` frozen so:
    its 16 variables trained, its ``trainable_weights`` empty).
    """
    weights = getattr(layer, "weights", None)
    if weights is None:
        return None
    return [v for v in weights if getattr(v, "trainable", False)]


def warn_eager_frozen(graph: LayerGraph) -> None:
    """Warns that an eager plan of a model with frozen layers may keep more than
    predicted: the eager tape holds what the frozen calls made until the whole
    backward ends, which the model does not describe: such a plan can measure
    about twice its prediction (see docs/decisions/0030-frozen-layers.md)."""
    # Frozen: weights, and trainable=False (a Normalization layer's weights are not
    # trainable to TensorFlow either, so the tape never watches them).
    frozen = [call.name for call in graph.calls
              if getattr(call.layer, "trainable", True) is False
              and getattr(call.layer, "weights", None) and not trained_variables(call.layer)]
    if not frozen:
        return
    shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
    warnings.warn(
        f"{caller()}: `{graph.model.name}` has frozen layers ({shown}) and the plan is for an "
        "eager step, whose tape keeps what frozen layers make until the whole backward "
        "ends; the planner does not model that, and such a plan measured up to 2.1x its "
        "predicted peak. Fix: train in a tf.function (Model.fit does by default), where "
        "frozen layers are planned as they run, or unfreeze the layers.",
        UserWarning, stacklevel=5)


def frozen_prefix(layers: Sequence[Any], *, input_grad: bool, mode: str) -> int:
    """How many leading ``layers`` of a chain the backward of a ``mode`` step
    does not reach: none in an eager step or when ``input_grad`` (a tape
    differentiates the chain's input), else those before the first layer with
    trainable weights. A callable that is not a Keras layer may read variables
    the planner cannot see, and a layer not built yet has no weights to show
    (``checkpoint_sequential`` on fresh layers): either counts as reached.

    Example:
        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._frozen import frozen_prefix
        >>> layers = [keras.layers.Dense(4, trainable=False), keras.layers.ReLU(),
        ...           keras.layers.Dense(4), keras.layers.Dense(4, trainable=False)]
        >>> for layer in layers:
        ...     layer.build((None, 4))
        >>> frozen_prefix(layers, input_grad=False, mode="graph")
        2
        >>> frozen_prefix(layers, input_grad=True, mode="graph")
        0
    """
    if mode == "eager" or input_grad:
        return 0
    count = 0
    for layer in layers:
        weights = trained_variables(layer)
        if weights is None or weights or not getattr(layer, "built", True):
            break
        count += 1
    return count


def tape_reaches(inputs: Any) -> bool:
    """Whether a tape recording now differentiates any of ``inputs``' floating
    tensors (watched, or computed from what a tape watches)."""
    leaves = [t for t in tf.nest.flatten(inputs)
              if isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_complex)]
    return bool(leaves) and bool(record.should_record_backprop(leaves))


def chain_without_backward(profile: ChainProfile, prefix: int) -> ChainProfile:
    """``profile`` with the first ``prefix`` layers run as the step runs them
    when no gradient reaches them: each holds only its input while it runs and
    its output until the next layer reads it (the last one's, the rest of the
    chain's input, until the step's end: counted as kept), keeps nothing for a
    backward, runs none, and no gradient flows into the tensors they read.

    They also run plainly in every plan (``frozen_prefix``): checkpointing them
    saves nothing, and a checkpointed segment that starts among them would keep
    its input, which a plain run of them frees."""
    if prefix == 0:
        return profile
    x = profile.boundary_bytes
    layers = list(profile.layers)
    for k in range(prefix):
        layers[k] = dataclasses.replace(
            layers[k],
            kept_bytes=x[prefix] if k == prefix - 1 else 0,
            forward_peak_bytes=(x[k] if k > 0 else 0) + layers[k].untaped_peak_bytes,
            backward_peak_bytes=0, weight_grad_bytes=0)
    grads = (0,) * (prefix + 1) + tuple(profile.boundary_grad_bytes[prefix + 1:])
    return dataclasses.replace(profile, layers=tuple(layers), boundary_grad_bytes=grads,
                               frozen_prefix=prefix)
