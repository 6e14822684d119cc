"""The errors planning raises, worded without the public function's name.

Planning is reached from several public functions (``apply_checkpointing``,
``plan_model``, ``CheckpointedSequential``, ...), and an error should name the
one the user called. Rather than threading that name through every planning
signature, planning raises a :class:`PlanningError` whose message starts with
what is wrong (``argument `budget` ...``), and the API layer that the user
called adds its name in front (:func:`worded`), keeping the type, the
attributes and the rest of the message. What planning tells without raising
(a warning, a progress line) names the function too: :func:`worded` also holds
the name, for as long as the call runs, where :func:`caller` reads it (a
context variable, so a call in another thread or a nested public call names
its own).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Callable, Optional

import tensorflow as tf

__all__ = ["BudgetTooLow", "PlanningError", "PlanningRuntimeError", "PlanningTypeError",
           "PlanningValueError", "caller", "worded"]

# The public function whose call is running (set by `worded`); outside any, the
# package's name (planning's own functions called directly, as tests do).
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar(
    "tf_checkpointing_caller", default="tf_checkpointing")


class PlanningError(Exception):
    """An error of planning, worded by the API layer (see :func:`worded`).

    Args:
        message: what is wrong, and the fix, without the public function's name.
        fix: where the fix depends on the function called (an argument only
            some take), what to add to the message for it: ``fix(api)``.
    """

    def __init__(self, message: str, *, fix: Optional[Callable[[str], str]] = None) -> None:
        super().__init__(message)
        self.fix = fix


class PlanningValueError(PlanningError, ValueError):
    """A value planning cannot use (a budget, a mode, a model's graph)."""


class PlanningTypeError(PlanningError, TypeError):
    """An argument of a type planning cannot use."""


class PlanningRuntimeError(PlanningError, RuntimeError):
    """Planning cannot measure here (the allocator's statistics are off)."""


class BudgetTooLow(PlanningValueError):
    """The budget is below the least memory any plan needs (a ``ValueError``;
    while a ``tf.function`` is traced the API raises it as a plain one, see
    :func:`worded`).

    Attributes:
        budget: the budget asked for, in bytes (None for ``"min"``: the least
            plan found keeps no less than plain).
        least: the least any plan is predicted to need, in bytes.
    """

    def __init__(self, message: str, *, budget: Optional[int] = None,
                 least: Optional[int] = None) -> None:
        super().__init__(message)
        self.budget, self.least = budget, least


def caller() -> str:
    """The public function the user called, for planning's warnings and progress
    lines: the ``api`` of the innermost :func:`worded` running.

    Example:
        >>> from tf_checkpointing.planning._errors import caller, worded
        >>> with worded("plan_model"):
        ...     print(caller())
        plan_model
    """
    return _CALLER.get()


@contextlib.contextmanager
def worded(api: str) -> Iterator[None]:
    """Inside, a :class:`PlanningError` not yet worded gets ``api`` in front of
    its message (the same exception, re-raised), and :func:`caller` is ``api``.

    While a ``tf.function`` is traced, it raises the builtin kind instead
    (``ValueError``, ``TypeError``, ``RuntimeError``) from the planning error:
    AutoGraph rebuilds only the builtin kinds (adding where in the user's code),
    and would turn a subclass into a ``StagingError``.

    Example:
        >>> from tf_checkpointing.planning._errors import PlanningValueError, worded
        >>> try:
        ...     with worded("plan_model"):
        ...         raise PlanningValueError("argument `budget` must be ...")
        ... except ValueError as error:
        ...     print(error)
        plan_model: argument `budget` must be ...
    """
    token = _CALLER.set(api)
    try:
        yield
    except PlanningError as error:
        if not getattr(error, "worded", False):
            fix = getattr(error, "fix", None)
            message = f"{api}: {error.args[0] if error.args else ''}{fix(api) if fix else ''}"
            error.args = (message, *error.args[1:])
            error.worded = True  # type: ignore[attr-defined]  # an outer API keeps it
        if tf.inside_function():
            builtin = next(kind for kind in type(error).__mro__
                           if kind in (ValueError, TypeError, RuntimeError))
            raise builtin(*error.args) from error
        raise
    finally:
        _CALLER.reset(token)
