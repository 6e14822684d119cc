"""``RematScope``: ``keras.RematScope``'s modes and arguments, exact and working under ``fit``.

``keras.RematScope`` marks the layers *created* inside it: ``Operation.__init__``
stores the innermost scope's ``(mode, output_size_threshold, layer_names)`` in
``layer._remat_mode``, and every call of such a layer goes through
``layer.rematerialized_call(layer.call, ...)``, which wraps the call (or, in the
``"activations"`` mode, the layer's activation) in ``keras.remat``. On the
TensorFlow backend ``keras.remat`` is ``tf.recompute_grad``: inside a
``tf.function`` (every ``Model.fit``) it refuses keyword arguments, and Keras
passes ``training=`` to every layer, so ``"full"``, ``"larger_than"`` and
``"list_of_layers"`` fail with "The custom_gradient decorator currently supports
keywords arguments only when eager execution is enabled" (measured with Keras
3.15 / TF 2.21); in eager mode the replay draws other dropout masks and updates
BatchNorm statistics twice.

This scope keeps Keras' mechanism (the same stack, so it nests with
``keras.RematScope`` and ``RematScope(None)``) and replaces only what runs: its
mode is a string that equals Keras' (``"full"``...) and carries our options, and
``Layer.rematerialized_call``, Keras' hook for exactly this decision, is extended
once, on first use, to hand layers marked by this scope to :func:`checkpointable`.
Layers marked by ``keras.RematScope`` and unmarked layers go to Keras unchanged.

Differences from Keras, on purpose: in the ``"full"`` mode a ``keras.Model``
created in the scope (``Sequential``, functional, subclassed) is not checkpointed
as a whole, its layers are, one by one; and a marked layer called inside another
marked layer's checkpointed call runs plainly, since the outer checkpoint covers
it (Keras would replay it again within the outer replay).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional, Union

import keras

from tf_checkpointing._decorator import checkpointable

__all__ = ["RematScope"]

_MODES = ("full", "activations", "larger_than", "list_of_layers")
_CACHE = "_tf_checkpointing_remat_call"  # per layer: (call function, checkpointed call)
_inside = threading.local()  # depth of marked layers' checkpointed calls, per thread


class _Mode(str):
    """A Keras remat mode name that also carries this library's options."""

    force_seed: bool
    check: Any


class RematScope(keras.RematScope):
    """Checkpoints the layers created inside it: ``keras.RematScope``, done exactly.

    A drop-in replacement for ``keras.RematScope`` with the same modes and
    arguments. Like Keras', it applies to layers *created* inside the ``with``
    block, whenever they are called later. Unlike Keras' (which is
    ``tf.recompute_grad`` on this backend), it works in ``Model.fit`` and any
    ``tf.function`` and gives the gradients and state of the plain model:
    dropout masks and other random draws are replayed, BatchNorm statistics are
    updated once, ``training`` and other keyword arguments reach the layer.

    Modes:

    * ``"full"``: every layer created in the scope is checkpointed (a
      ``keras.Model`` created there is not checkpointed as a whole; its layers are).
    * ``"activations"``: only the ``activation`` function of layers that have one
      (e.g. ``Dense(..., activation="gelu")``) is checkpointed.
    * ``"larger_than"``: layers whose output has more than
      ``output_size_threshold`` elements (unknown dimensions count as 1, as in
      Keras) are checkpointed.
    * ``"list_of_layers"``: layers whose name is in ``layer_names``.
    * ``None``: layers created inside are not checkpointed (inside an outer scope).

    Args:
        mode: one of the modes above.
        output_size_threshold: for ``"larger_than"``: the number of output
            elements above which a layer is checkpointed.
        layer_names: for ``"list_of_layers"``: the names of the layers to
            checkpoint.
        force_seed: passed to :func:`checkpointable` (replay legacy ``tf.random``
            ops exactly; Keras random layers need nothing).
        check: passed to :func:`checkpointable` (verify each replay).

    Raises:
        ValueError: ``mode`` is not one of the modes above.
        TypeError: ``layer_names`` is a single string, or
            ``output_size_threshold`` is not a number.

    Example:
        >>> import keras
        >>> import numpy as np
        >>> from tf_checkpointing import RematScope       # was: from keras import RematScope
        >>> with RematScope(mode="list_of_layers", layer_names=["hidden"]):
        ...     model = keras.Sequential([
        ...         keras.Input((8,)),
        ...         keras.layers.Dense(16, activation="relu", name="hidden"),
        ...         keras.layers.Dropout(0.1),
        ...         keras.layers.Dense(1, name="head"),
        ...     ])
        >>> model.compile("sgd", "mse")
        >>> history = model.fit(np.ones((8, 8)), np.ones((8, 1)), verbose=0)
        >>> len(history.history["loss"])
        1
    """

    def __init__(
        self,
        mode: Optional[str] = "full",
        output_size_threshold: Union[int, float] = 1024,
        layer_names: Optional[Sequence[str]] = None,
        *,
        force_seed: bool = False,
        check: Any = False,
    ) -> None:
        if mode is not None and mode not in _MODES:
            raise ValueError(
                f"RematScope: invalid value received for argument `mode`: expected one of "
                f"{', '.join(map(repr, _MODES))} or None; received {mode!r}. Pass one of "
                "them, e.g. RematScope(mode='full')."
            )
        if isinstance(layer_names, str):
            raise TypeError(
                f"RematScope: argument `layer_names` must be a list of layer names; "
                f"received the string {layer_names!r}. Pass a list, e.g. "
                f"layer_names=[{layer_names!r}]."
            )
        if isinstance(output_size_threshold, bool) or not isinstance(
                output_size_threshold, (int, float)):
            raise TypeError(
                f"RematScope: argument `output_size_threshold` must be a number of "
                f"elements; received {output_size_threshold!r} of type "
                f"{type(output_size_threshold).__name__}. Pass e.g. 1024."
            )
        super().__init__(mode=None, output_size_threshold=output_size_threshold,
                         layer_names=list(layer_names or []))
        if mode is not None:
            marked = _Mode(mode)
            marked.force_seed, marked.check = force_seed, check
            self.mode = marked
        _install_hook()

    def __repr__(self) -> str:
        return (f"RematScope(mode={None if self.mode is None else str(self.mode)!r}, "
                f"output_size_threshold={self.output_size_threshold!r}, "
                f"layer_names={self.layer_names!r})")


def _install_hook() -> None:
    """Extends ``keras.layers.Layer.rematerialized_call`` once (idempotent)."""
    layer_class = keras.layers.Layer
    keras_hook = layer_class.rematerialized_call
    if getattr(keras_hook, "_tf_checkpointing", False):
        return

    @functools.wraps(keras_hook)
    def rematerialized_call(self: Any, layer_call: Callable, *args: Any, **kwargs: Any):
        remat_mode = getattr(self, "_remat_mode", None)
        mode = getattr(remat_mode, "mode", None)
        if not isinstance(mode, _Mode):
            return keras_hook(self, layer_call, *args, **kwargs)
        if getattr(_inside, "depth", 0):
            return layer_call  # an enclosing marked layer's checkpoint covers this call
        return _checkpointed(self, layer_call, remat_mode, args, kwargs)

    rematerialized_call._tf_checkpointing = True  # type: ignore[attr-defined]
    layer_class.rematerialized_call = rematerialized_call


def _checkpointed(layer: Any, layer_call: Callable, remat_mode: Any, args: tuple,
                  kwargs: dict) -> Callable:
    mode: _Mode = remat_mode.mode
    if mode == "activations":
        if getattr(layer, "activation", None) is None:
            return layer_call
        return _with_checkpointed_activation(layer, layer_call, mode)
    if mode == "full":
        chosen = not isinstance(layer, keras.Model)
    elif mode == "larger_than":
        chosen = _output_size(layer, args, kwargs) > remat_mode.output_size_threshold
    else:  # list_of_layers
        chosen = layer.name in remat_mode.layer_names
    if not chosen:
        return layer_call
    function = getattr(layer_call, "__func__", layer_call)
    cached = vars(layer).get(_CACHE)
    if cached is not None and cached[0] is function:
        return cached[1]

    @functools.wraps(layer_call)
    def marked_call(*call_args: Any, **call_kwargs: Any) -> Any:
        with _marked():
            return layer_call(*call_args, **call_kwargs)

    wrapped = checkpointable(marked_call, checkpoint=True, force_seed=mode.force_seed,
                             check=mode.check)
    object.__setattr__(layer, _CACHE, (function, wrapped))  # nothing for Keras to track
    return wrapped


def _with_checkpointed_activation(layer: Any, layer_call: Callable, mode: _Mode) -> Callable:
    """Keras' approach: the layer's activation is swapped for a checkpointed one for
    the duration of the call (``Dense``, ``Conv2D``... read ``self.activation``)."""

    @functools.wraps(layer_call)
    def call(*args: Any, **kwargs: Any) -> Any:
        activation = layer.activation
        object.__setattr__(layer, "activation", checkpointable(
            activation, checkpoint=True, force_seed=mode.force_seed, check=mode.check))
        try:
            return layer_call(*args, **kwargs)
        finally:
            object.__setattr__(layer, "activation", activation)

    return call


def _output_size(layer: Any, args: tuple, kwargs: dict) -> int:
    """Elements of the layer's output, unknown dimensions counted as 1 (as Keras
    counts them), from Keras' output spec, memoised per input shapes."""
    key = tuple(tuple(getattr(x, "shape", ())) for x in keras.tree.flatten((args, kwargs))
                if hasattr(x, "shape"))
    sizes = vars(layer).setdefault("_tf_checkpointing_output_sizes", {})
    if key not in sizes:
        spec = layer.compute_output_spec(*args, **kwargs)
        sizes[key] = sum(math.prod(d or 1 for d in s.shape)
                         for s in keras.tree.flatten(spec) if hasattr(s, "shape"))
    return sizes[key]


@contextlib.contextmanager
def _marked() -> Iterator[None]:
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
