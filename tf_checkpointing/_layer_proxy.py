"""``checkpointable(layer)``: a Keras layer instance whose calls are checkpointed.

The proxy runs Keras' own ``Layer.__call__`` with itself as ``self``, and
checkpoints only the ``call`` that ``__call__`` runs: the mechanism of
``apply_checkpointing``. Input casting, ``training`` inheritance, masks read
from the inputs and attached to the outputs, and every other piece of Keras
metadata therefore behave exactly as without checkpointing (checkpointing the
whole ``__call__`` returned new tensors without their Keras mask).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import keras
import wrapt

from tf_checkpointing._options import _OPTION_NAMES, _is_symbolic, _Options, dispatch
from tf_checkpointing.core._internals import symbolic_scope
from tf_checkpointing.core._recompute import needs_checkpoint

__all__: list[str] = []


class CheckpointedLayer(wrapt.ObjectProxy):
    """A Keras layer instance whose calls are checkpointable.

    It is the wrapped layer for ``isinstance``, attributes and variable
    tracking. A call runs Keras' own ``Layer.__call__`` with the proxy as
    ``self``, and only the ``call`` it runs is checkpointed (the mechanism of
    ``apply_checkpointing``): input casting, ``training`` inheritance, masks
    read from the inputs and attached to the outputs, and every other piece of
    Keras metadata behave exactly as without the proxy. Called on KerasTensors
    (building a functional model), the graph node records the proxy, so the
    model's calls come through it instead of bypassing it.
    """

    def __init__(self, layer: keras.layers.Layer, options: _Options) -> None:
        super().__init__(layer)
        self._self_options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in _OPTION_NAMES.intersection(kwargs)}
        if given and not needs_checkpoint() and _is_symbolic(args, kwargs):
            raise TypeError(
                f"checkpointable: call-time options {sorted(given)} cannot be given when a "
                "layer is called on KerasTensors (a functional model stores the call, "
                "not the options). Set them on the layer instead, e.g. "
                "checkpointable(layer, checkpoint=True, force_seed=True)."
            )
        stack = _pending_options()
        stack.append((self, given))
        try:
            return type(self.__wrapped__).__call__(self, *args, **kwargs)
        finally:
            stack.pop()

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped layer's ``call``, checkpointed: what Keras' ``__call__``
        runs. (Keras' output-shape inference runs it plainly.)"""
        return self._checkpointed(self.__wrapped__.call, args, kwargs)

    def quantized_call(self, *args: Any, **kwargs: Any) -> Any:
        """What Keras' ``__call__`` runs instead of ``call`` for a quantized layer
        (``layer.quantize("int8")`` and the other modes), checkpointed the same way."""
        return self._checkpointed(self.__wrapped__.quantized_call, args, kwargs)

    def _checkpointed(self, call: Any, args: tuple, kwargs: dict) -> Any:
        if _in_symbolic_scope():
            return call(*args, **kwargs)
        given: dict[str, Any] = next(
            (opts for proxy, opts in reversed(_pending_options()) if proxy is self), {})
        return dispatch(call, args, {**kwargs, **given}, self._self_options,
                        layer=self.__wrapped__)

    def __repr__(self) -> str:
        return f"<checkpointable {self.__wrapped__!r}>"

    # A copy or an unpickled layer is wrapped again, with the same options.
    def __copy__(self) -> CheckpointedLayer:
        return CheckpointedLayer(copy.copy(self.__wrapped__), self._self_options)

    def __deepcopy__(self, memo: dict) -> CheckpointedLayer:
        return CheckpointedLayer(copy.deepcopy(self.__wrapped__, memo), self._self_options)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return CheckpointedLayer, (self.__wrapped__, self._self_options)


_pending = threading.local()  # call-time options of the proxy calls this thread runs


def _pending_options() -> list[tuple[CheckpointedLayer, dict[str, Any]]]:
    if not hasattr(_pending, "stack"):
        _pending.stack = []
    return _pending.stack


def _in_symbolic_scope() -> bool:
    # Keras 3 marks its output-shape inference with this scope.
    return symbolic_scope.in_symbolic_scope()
