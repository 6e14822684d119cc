"""How each layer of a chain is profiled: the entry point of the measurements.

:func:`profile_chain` measures each call of a chain with the device allocator
(:mod:`._allocator`): eagerly as plain eager backprop runs it
(:mod:`._layer_profile`), or, for a ``tf.function`` or XLA step, each layer's
forward and backward as one graph and the plain step as a whole
(:mod:`._step_profile`). The state the profile runs change (dropout seeds,
BatchNorm statistics) is put back afterwards, and it runs in a thread of its
own, so no tape of the caller records it. How layers are called is
:mod:`..layer_graph._calling`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_checkpointing.core._state import StateRecorder
from tf_checkpointing.planning.measuring._allocator import (
    concrete_inputs,
    in_fresh_thread,
    memory_device,
)
from tf_checkpointing.planning.measuring._layer_profile import (
    ChainProfile,
    taped_pass,
    untaped_pass,
)
from tf_checkpointing.planning.measuring._modes import Mode
from tf_checkpointing.planning.measuring._step_profile import graph_profile

__all__: list[str] = []


def profile_chain(calls: Sequence[Callable[[Any], Any]], inputs: Any, *,
                  names: Sequence[str], mode: Mode = Mode.EAGER,
                  same_as: Optional[Sequence[int]] = None, applied: bool = False,
                  layer_keys: Optional[Sequence[Any]] = None,
                  trainable: Optional[Sequence[Any]] = None) -> ChainProfile:
    """Runs the chain ``calls`` on ``inputs`` and measures each layer.

    ``calls[i](x)`` runs layer ``i`` (with its keywords bound). Runs eagerly in
    a thread of its own, so the caller's tape records none of it; called while
    a ``tf.function`` is traced, it runs on synthetic inputs of the traced
    shapes (which must then be fully known).

    In a compiled ``mode`` (graph or XLA), the profile is of a training step
    that is a ``tf.function``: each layer's forward and backward run as one
    graph, read between the two (a graph keeps only the intermediates its
    backward reads, and frees them as the backward goes), and
    ``plain_peak_bytes`` is the whole chain's, measured as one graph (compiled
    by XLA in ``Mode.XLA``).
    ``same_as[i] = j < i`` says call ``i`` is the same computation as call
    ``j`` (same layer configuration on the same shapes: a residual network
    repeats its blocks): its graph is not traced and measured again, it gets
    ``j``'s readings. With ``applied`` (a compiled mode), the
    plain step consumes each weight gradient as soon as it is made, as an
    optimizer inside the step does (``Model.fit``: the executor runs each
    variable's update when its gradient is ready, and frees the gradient), so
    the weight gradients are not all held at the end. Instead of ``same_as``,
    ``layer_keys`` (equal for layers of the same class, configuration and
    weight shapes, e.g. from :func:`layer_key`) make the calls whose keys and
    input shapes are equal share one reading: a transformer's identical blocks
    are traced and measured once. Given ``trainable`` (a compiled mode), the
    plain step differentiates only those variables, not the inputs, as
    ``Model.fit`` does (a graph then keeps nothing for a frozen backbone's
    calls); each call's own readings are taken with its inputs watched either way.
    """
    return in_fresh_thread(_profile, calls, inputs, names, Mode(mode), same_as,
                           applied, layer_keys, trainable)


def configuration(layer: Any) -> Optional[list]:
    """``layer``'s configuration but its name, as sorted items (two instances of
    one architecture differ in their names only); None for a layer without one.

    Example:
        >>> import keras
        >>> from tf_checkpointing.planning.measuring._profile import configuration
        >>> a, b = keras.layers.Dense(4, name="a"), keras.layers.Dense(4, name="b")
        >>> configuration(a) == configuration(b), configuration(object())
        (True, None)
    """
    try:
        config = dict(layer.get_config())
        config.pop("name", None)
        return sorted(config.items())
    except Exception:  # noqa: BLE001 - not a Keras layer, or no config
        return None


def layer_key(layer: Any, keywords: Any = None) -> Any:
    """What makes two layers compute the same thing on the same input shapes:
    class, configuration but the name, weight shapes and call keywords (a
    layer without a configuration is only itself)."""
    config = configuration(layer)
    try:
        described = repr((config, sorted((keywords or {}).items())))
    except Exception:  # noqa: BLE001 - keywords that do not sort
        config = None
    if config is None:
        return ("unique", id(layer))
    weights = tuple(tuple(v.shape) for v in getattr(layer, "weights", ()))
    return type(layer), described, weights


def _profile(calls, inputs, names, mode: Mode, same_as=None,
             applied=False, layer_keys=None, trainable=None) -> ChainProfile:
    x = concrete_inputs(inputs)
    device = memory_device(x)
    recorder = StateRecorder()
    with recorder:  # records, eagerly, the state the layers write, to put it back
        try:
            keys: list[Any] = []
            for i, call in enumerate(calls):  # build the layers (and inner tf.functions)
                if layer_keys is not None:
                    keys.append((layer_keys[i], tuple(
                        (tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(x)
                        if hasattr(t, "dtype"))))
                x = call(x)
            if layer_keys is not None and same_as is None:
                first: dict[Any, int] = {}
                same_as = [first.setdefault(key, i) for i, key in enumerate(keys)]
            x = concrete_inputs(inputs)
            if mode.compiled:
                return graph_profile(calls, x, device, names,
                                     same_as or list(range(len(calls))), mode, applied,
                                     trainable)
            untaped, seconds, sizes = untaped_pass(calls, x, device)
            return taped_pass(calls, x, device, names, untaped, seconds, sizes)
        finally:
            recorder.restore_before()
