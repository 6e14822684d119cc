"""The options of a checkpointable callable and the per-call dispatch.

:func:`dispatch` runs one call of a checkpointable function, method or layer
``call``: it takes the call-time options (``_checkpoint``, ``_force_seed``,
``_watch_vars``, ``_policy``) out of the keyword arguments, validates them, and runs the
call directly or checkpointed (:mod:`tf_checkpointing.core._recompute`). When
nothing can take a gradient of the call (eager mode, no tape recording) or
checkpointing is off, the function is called directly: one dict lookup of
overhead on the hot path of every layer call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Callable, Union

import keras
import numpy as np
import tensorflow as tf

from tf_checkpointing import policies
from tf_checkpointing.core._recompute import (
    checkpointed_call,
    frozen_weights,
    layer_state,
    needs_checkpoint,
)

__all__: list[str] = []

CheckMode = Union[bool, str]

_OPTION_NAMES = frozenset(("_checkpoint", "_watch_vars", "_force_seed", "_policy"))


@dataclasses.dataclass(frozen=True)
class _Options:
    checkpoint: bool
    force_seed: bool
    check: CheckMode
    policy: Any = None


def dispatch(fn: Callable[..., Any], args: tuple, kwargs: dict, options: _Options,
             layer: Any = None) -> Any:
    """Runs one call: directly, or checkpointed (``layer``: the Keras layer whose
    ``call`` ``fn`` is, whose state an eager forward reads first, see
    ``checkpointed_call``)."""
    checkpoint, force_seed, watch_vars = options.checkpoint, options.force_seed, ()
    policy = options.policy
    if kwargs and not _OPTION_NAMES.isdisjoint(kwargs):
        checkpoint, force_seed, watch_vars = _pop_call_options(kwargs, options)
        given = kwargs.pop("_policy", None)
        policy = policy if given is None else policies.resolve(given, "_policy")
    if policy is policies.everything_saveable:
        checkpoint = False  # keeping everything is the plain call
    if not checkpoint or not needs_checkpoint():
        if checkpoint and _is_symbolic(args, kwargs):
            raise TypeError(
                f"checkpointable: `{getattr(fn, '__qualname__', fn)}` was called on "
                "KerasTensors (building a functional model). A function's operations "
                "would be recorded into the model one by one, without the checkpoint, so "
                "nothing would be saved. Put the computation in a keras.layers.Layer and "
                "call checkpointable(layer, checkpoint=True) on the KerasTensors, or "
                "apply_checkpointing(model, [...]) after building the model."
            )
        return fn(*args, **kwargs)
    return checkpointed_call(
        fn, args, kwargs, watch_vars=watch_vars, force_seed=force_seed, check=options.check,
        policy=policy,
        state=layer_state(layer) if layer is not None and tf.executing_eagerly() else (),
        frozen=frozen_weights(layer) if layer is not None and not tf.executing_eagerly() else (),
    )


def _pop_call_options(kwargs: dict, options: _Options) -> tuple[bool, bool, tuple]:
    checkpoint = kwargs.pop("_checkpoint", None)
    force_seed = kwargs.pop("_force_seed", None)
    watch_vars = kwargs.pop("_watch_vars", None)
    checkpoint = options.checkpoint if checkpoint is None else _expect_bool(
        "_checkpoint", checkpoint, "fn(..., _checkpoint=True)")
    force_seed = options.force_seed if force_seed is None else _expect_bool(
        "_force_seed", force_seed, "fn(..., _force_seed=True)")
    return checkpoint, force_seed, _expect_variables(watch_vars)


def _expect_bool(name: str, value: Any, fix: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    hint = ""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        hint = " A tensor cannot decide at trace time whether to checkpoint."
    raise TypeError(
        f"checkpointable: argument `{name}` must be a Python bool (or None for the "
        f"default); received {value!r} of type {_type_name(value)}.{hint} Pass True "
        f"or False, e.g. {fix}."
    )


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")


def _expect_check(value: Any) -> CheckMode:
    if isinstance(value, bool) or value == "values":
        return value
    raise TypeError(
        "checkpointable: argument `check` must be False, True (compare output structure, "
        f"shapes and dtypes) or 'values' (compare values too); received {value!r}. "
        "Pass e.g. checkpointable(fn, check=True)."
    )


def _expect_variables(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (tf.Variable, keras.Variable)):
        value = (value,)
    if isinstance(value, (tf.Tensor, str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            "checkpointable: argument `_watch_vars` must be an iterable of tf.Variable or "
            f"keras.Variable; received {value!r} of type {type(value).__name__}. Pass a "
            "list, e.g. _watch_vars=[layer.kernel] or _watch_vars=model.trainable_variables."
        )
    variables = []
    for item in value:
        if isinstance(item, keras.Variable):
            item = item.value if isinstance(item.value, tf.Variable) else item._value
        if not isinstance(item, tf.Variable):
            raise TypeError(
                "checkpointable: argument `_watch_vars` must contain only tf.Variable or "
                f"keras.Variable objects; received an item {item!r} of type "
                f"{type(item).__name__}. Tensors need no watching (tensor arguments get "
                "gradients); pass variables, e.g. _watch_vars=[layer.kernel]."
            )
        variables.append(item)
    return tuple(variables)


def _is_symbolic(args: tuple, kwargs: dict) -> bool:
    """A call on KerasTensors: Keras is building a functional graph."""
    if args and isinstance(args[0], tf.Tensor):
        return False  # the common case, decided without flattening the arguments
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten((args, kwargs)))
