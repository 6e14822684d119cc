"""``checkpointable``: the decorator users apply to functions, methods and layers.

It validates the decorator's options and wraps the target; each call goes
through :func:`tf_checkpointing._options.dispatch`, which decides whether to
checkpoint it.

Functions and methods are wrapped with ``wrapt.FunctionWrapper`` (so
``__name__``, ``__doc__``, ``__wrapped__`` and ``inspect.signature`` are kept
and methods bind as usual). A Keras layer *instance* is wrapped with a
``wrapt.ObjectProxy`` (:mod:`tf_checkpointing._layer_proxy`): the result is
still that layer for ``isinstance``, attribute access and Keras' variable
tracking, but its calls are checkpointed.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Optional, TypeVar, overload

import keras
import wrapt

from tf_checkpointing import policies
from tf_checkpointing._layer_proxy import CheckpointedLayer
from tf_checkpointing._options import (
    _OPTION_NAMES,
    CheckMode,
    _expect_bool,
    _expect_check,
    _Options,
    dispatch,
)
from tf_checkpointing.core._internals import autograph_config as _autograph_config

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])

_DECORATOR_OPTIONS = ("checkpoint", "force_seed", "check", "policy")

# AutoGraph must never convert the library's own code: converted, its wrappers
# would be bypassed or fail to convert (TensorFlow and Keras are listed the same way).
if not any(getattr(rule, "_prefix", None) == __package__
           for rule in _autograph_config.CONVERSION_RULES):
    _autograph_config.CONVERSION_RULES = (
        _autograph_config.DoNotConvert(__package__),) + _autograph_config.CONVERSION_RULES


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
    **unknown: Any,
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
    if unknown:
        raise _unknown_options_error(unknown)
    options = _Options(
        checkpoint=_expect_bool("checkpoint", checkpoint, "checkpointable(..., checkpoint=True)"),
        force_seed=_expect_bool("force_seed", force_seed, "checkpointable(..., force_seed=True)"),
        check=_expect_check(check),
        policy=policies.resolve(policy),
    )
    if fn is None:
        return lambda target: _wrap(target, options)
    return _wrap(fn, options)


def _unknown_options_error(unknown: dict[str, Any]) -> TypeError:
    names = sorted(unknown)
    hints = [f"did you mean `{close[0]}` instead of `{name}`?" for name in names
             for close in [difflib.get_close_matches(name.lstrip("_"), _DECORATOR_OPTIONS, n=1)]
             if close]
    return TypeError(
        f"checkpointable: unknown option(s) {names}; the accepted options are "
        f"{list(_DECORATOR_OPTIONS)}. {' '.join(hints)} Pass e.g. "
        "checkpointable(fn, checkpoint=True, force_seed=False, check=False, policy=None); "
        "call-time options (_checkpoint, _force_seed, _watch_vars, _policy) go to the call, "
        "not the decorator."
    )


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
    return CheckpointedFunction(target, options)


def _make_wrapper(options: _Options) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return dispatch(wrapped, args, kwargs, options)

    return wrapper


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

    def __init__(self, wrapped: Callable[..., Any], options: _Options) -> None:
        super().__init__(wrapped, _make_wrapper(options))
        self._self_options = options

    def __set_name__(self, owner: type, name: str) -> None:
        # AutoGraph calls an object by converting ``type(obj).__call__``'s source,
        # which would bypass this wrapper; a class whose ``__call__`` is
        # checkpointable is marked so that AutoGraph calls its instances as they are.
        if name == "__call__":
            owner.autograph_info__ = None  # type: ignore[attr-defined]

    # A function is copied as itself and pickled by reference; so is its wrapper.
    def __copy__(self) -> CheckpointedFunction:
        return self

    def __deepcopy__(self, memo: dict) -> CheckpointedFunction:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        qualname: str = getattr(self.__wrapped__, "__qualname__", "")
        found: Any = inspect.getmodule(self.__wrapped__)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is self:  # a decorated module-level function: by name, like a function
            return qualname
        return CheckpointedFunction, (self.__wrapped__, self._self_options)
