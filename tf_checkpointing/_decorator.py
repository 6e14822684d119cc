"""``checkpointable``: the decorator users apply to functions, methods and layers.

It decides per call whether to checkpoint (``_checkpoint``), validates the
call-time options, and hands the call to :mod:`tf_checkpointing._recompute`.
When nothing can take a gradient of the call (eager mode, no tape recording)
or checkpointing is off, the function is called directly: one dict lookup of
overhead on the hot path of every layer call.

Functions and methods are wrapped with ``wrapt.FunctionWrapper`` (so
``__name__``, ``__doc__``, ``__wrapped__`` and ``inspect.signature`` are kept
and methods bind as usual). A Keras layer *instance* is wrapped with a
``wrapt.ObjectProxy``: the result is still that layer for ``isinstance``,
attribute access and Keras' variable tracking, but its calls are checkpointed.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from typing import Any, Callable, Optional, TypeVar, Union, overload

import keras
import tensorflow as tf
import wrapt

from tf_checkpointing import policies
from tf_checkpointing._recompute import checkpointed_call, needs_checkpoint

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])
CheckMode = Union[bool, str]

_OPTION_NAMES = frozenset(("_checkpoint", "_watch_vars", "_force_seed", "_policy"))


@dataclasses.dataclass(frozen=True)
class _Options:
    checkpoint: bool
    force_seed: bool
    check: CheckMode
    policy: Any = None


@overload
def checkpointable(
    fn: F, *, checkpoint: bool = False, force_seed: bool = False, check: CheckMode = False,
    policy: Optional[policies.Policy] = None,
) -> F: ...


@overload
def checkpointable(
    fn: None = None, *, checkpoint: bool = False, force_seed: bool = False,
    check: CheckMode = False, policy: Optional[policies.Policy] = None,
) -> Callable[[F], F]: ...


def checkpointable(
    fn: Optional[Any] = None,
    *,
    checkpoint: bool = False,
    force_seed: bool = False,
    check: CheckMode = False,
    policy: Optional[policies.Policy] = None,
) -> Any:
    """Makes a function, method or Keras layer checkpointable.

    A checkpointed call keeps only its inputs during the forward pass and
    replays itself during backprop to rebuild what the gradient needs: activation
    memory for one extra forward. Gradients are exactly those of the plain call,
    for positional and keyword tensor arguments, nested structures, every
    floating dtype, and the variables read inside (found automatically); random
    ops and variable updates (dropout, BatchNorm statistics) are replayed as the
    forward ran them.

    Args:
        fn: a function, a bound method, or a ``keras.layers.Layer`` instance. If
            omitted, returns a decorator configured with the options below.
        checkpoint: whether calls are checkpointed when the call does not say
            (``_checkpoint=None``). Default False: opt in per call.
        force_seed: default for ``_force_seed``: replay legacy stateful random
            ops (``tf.random.uniform`` without a seed, ``tf.nn.dropout``) exactly.
        check: verify each replay against its forward: True compares output
            structure, shapes and dtypes, ``"values"`` compares values too
            (keeps the outputs alive until backprop). The environment variable
            ``TF_CHECKPOINTING_CHECK=1`` (or ``values``) turns it on everywhere.
        policy: a save policy from :mod:`tf_checkpointing.policies` (or any
            callable taking a ``policies.OpOutput`` and returning a bool): also
            keep the results it picks (e.g. ``policies.dots_saveable``: matrix
            products and convolutions) so that the replay reuses them instead of
            recomputing them. None (default) keeps only the inputs.

    Call-time keywords, consumed by the wrapper and never passed on:
        _checkpoint: bool, or None for the decorator's default.
        _watch_vars: extra ``tf.Variable`` / ``keras.Variable`` objects to
            differentiate (variables read inside are already captured).
        _force_seed: bool, or None for the decorator's default.
        _policy: a save policy, or None for the decorator's default.

    Returns:
        The wrapped callable (for a layer: the same layer, checkpointed).

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing import checkpointable
        >>> @checkpointable
        ... def block(x, scale, training=False):
        ...     y = tf.nn.gelu(x) * scale
        ...     return tf.nn.dropout(y, 0.1) if training else y
        >>> x = tf.ones([2, 3])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = block(x, 2.0, training=False, _checkpoint=True)
        >>> tape.gradient(y, x).shape
        TensorShape([2, 3])
    """
    options = _Options(
        checkpoint=_expect_bool("checkpoint", checkpoint, "checkpointable(..., checkpoint=True)"),
        force_seed=_expect_bool("force_seed", force_seed, "checkpointable(..., force_seed=True)"),
        check=_expect_check(check),
        policy=policies.resolve(policy),
    )
    if fn is None:
        return lambda target: _wrap(target, options)
    return _wrap(fn, options)


def _wrap(target: Any, options: _Options) -> Any:
    if isinstance(target, keras.layers.Layer):
        return CheckpointedLayer(target, options)
    if isinstance(target, (CheckpointedFunction, wrapt.BoundFunctionWrapper)):
        return target  # already checkpointable
    if not callable(target) or isinstance(target, type):
        raise TypeError(
            "checkpointable: argument `fn` must be a function, a method or a Keras layer "
            f"instance; received {target!r} of type {type(target).__name__}. Pass the "
            "callable itself, e.g. checkpointable(my_block) or "
            "checkpointable(keras.layers.Dense(64))."
        )
    return CheckpointedFunction(target, _make_wrapper(options))


def _make_wrapper(options: _Options) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return dispatch(wrapped, args, kwargs, options)

    return wrapper


def dispatch(fn: Callable[..., Any], args: tuple, kwargs: dict, options: _Options) -> Any:
    """Runs one call: directly, or checkpointed."""
    checkpoint, force_seed, watch_vars = options.checkpoint, options.force_seed, ()
    policy = options.policy
    if kwargs and not _OPTION_NAMES.isdisjoint(kwargs):
        checkpoint, force_seed, watch_vars = _pop_call_options(kwargs, options)
        given = kwargs.pop("_policy", None)
        policy = policy if given is None else policies.resolve(given, "_policy")
    if not checkpoint or not needs_checkpoint() or policy is policies.everything_saveable:
        return fn(*args, **kwargs)
    return checkpointed_call(
        fn, args, kwargs, watch_vars=watch_vars, force_seed=force_seed, check=options.check,
        policy=policy,
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
    if isinstance(value, bool):
        return value
    hint = ""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        hint = " A tensor cannot decide at trace time whether to checkpoint."
    raise TypeError(
        f"checkpointable: argument `{name}` must be a Python bool (or None for the "
        f"default); received {value!r} of type {type(value).__name__}.{hint} Pass True "
        f"or False, e.g. {fix}."
    )


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


class _BoundCheckpointedFunction(wrapt.BoundFunctionWrapper):
    """A checkpointable method bound to an instance. Bound to a Keras layer (the
    decorated ``call`` of a Layer subclass), its signature also lists the
    call-time options, because Keras checks call arguments against it."""

    # AutoGraph would warn on every trace that it cannot convert a wrapt wrapper,
    # then call it as it is; this attribute says so up front. The body runs as
    # written, like a Keras layer's call: use tf.cond for tensor conditions.
    autograph_info__ = None

    @property
    def __func__(self) -> Any:
        func = self.__wrapped__.__func__  # type: ignore[attr-defined]
        if not isinstance(self._self_instance, keras.layers.Layer):
            return func
        # inspect.signature() reads a bound method's signature from __func__.
        sig = inspect.signature(func)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        var_kw = [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
            for name in sorted(_OPTION_NAMES) if name not in sig.parameters
        ]

        def with_call_options(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        with_call_options.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=params + extra + var_kw)
        return with_call_options




class CheckpointedFunction(wrapt.FunctionWrapper):
    """A function or method made checkpointable (see :func:`checkpointable`)."""

    autograph_info__ = None  # runs as written under AutoGraph (see above)

    __bound_function_wrapper__ = _BoundCheckpointedFunction


class CheckpointedLayer(wrapt.ObjectProxy):
    """A Keras layer instance whose calls are checkpointable.

    It is the wrapped layer for ``isinstance``, attributes and variable
    tracking; only ``__call__`` is intercepted. Called on KerasTensors (building
    a functional model, or a Sequential with an ``Input``), it runs Keras' own
    ``__call__`` with the proxy as ``self``: the graph node then records the
    proxy, so the model's calls come through it instead of bypassing it.
    """

    def __init__(self, layer: keras.layers.Layer, options: _Options) -> None:
        super().__init__(layer)
        self._self_options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not needs_checkpoint() and _is_symbolic(args, kwargs):
            given = sorted(_OPTION_NAMES.intersection(kwargs))
            if given:
                raise TypeError(
                    f"checkpointable: call-time options {given} cannot be given when a "
                    "layer is called on KerasTensors (a functional model stores the call, "
                    "not the options). Set them on the layer instead, e.g. "
                    "checkpointable(layer, checkpoint=True, force_seed=True)."
                )
            return type(self.__wrapped__).__call__(self, *args, **kwargs)
        return dispatch(self.__wrapped__, args, kwargs, self._self_options)

    def __repr__(self) -> str:
        return f"<checkpointable {self.__wrapped__!r}>"


def _is_symbolic(args: tuple, kwargs: dict) -> bool:
    """A call on KerasTensors: Keras is building a functional graph."""
    if args and isinstance(args[0], tf.Tensor):
        return False  # the common case, decided without flattening the arguments
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten((args, kwargs)))
