"""The kinds of training step a plan is made for: :class:`Mode`.

What backprop keeps depends on how the step runs: an eager step keeps what the
tape recorded, a ``tf.function`` graph (``Model.fit``) frees what its executor
can prove unused, and XLA (``jit_compile=True``) assigns one buffer of its own.
The names are the same in the API, the plans, the docs, the tests and the
benchmarks: ``"eager"``, ``"graph"`` and ``"xla"``; ``"auto"`` (the public
default, resolved at the front by :func:`step_mode`) picks the step being
traced. ``Mode`` is a ``str`` enum, so ``mode == "graph"``, plan files and
``mode="graph"`` keep working; planning and measuring take one ``mode: Mode``
instead of the ``compiled=`` / ``xla=`` booleans they used to derive from it.
"""

from __future__ import annotations

import enum
from typing import Union

import tensorflow as tf

from tf_checkpointing.planning._errors import PlanningValueError
from tf_checkpointing.planning.measuring._allocator import in_xla_context

__all__ = ["AUTO", "MODES", "Mode", "expect_mode", "step_mode"]


class Mode(str, enum.Enum):
    """How a training step runs: eagerly, as a ``tf.function`` graph, or
    compiled by XLA.

    Example:
        >>> from tf_checkpointing.planning.measuring._modes import Mode
        >>> Mode("graph") is Mode.GRAPH, Mode.XLA == "xla", Mode.XLA.compiled
        (True, True, True)
        >>> f"{Mode.EAGER}", repr(Mode.GRAPH)
        ('eager', "'graph'")
    """

    EAGER = "eager"
    GRAPH = "graph"
    XLA = "xla"

    # Read as the plain string everywhere (messages, plan files, reprs of plans).
    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def compiled(self) -> bool:
        """Whether the step is a graph (``tf.function``, with or without XLA)."""
        return self is not Mode.EAGER


MODES = tuple(m.value for m in Mode)
AUTO = "auto"


def expect_mode(mode: object) -> Union[Mode, str]:
    """``mode=`` validated: a :class:`Mode`, or ``"auto"``.

    Raises:
        PlanningValueError: for anything else (the API layer names itself)."""
    if mode == AUTO:
        return AUTO
    if isinstance(mode, str) and mode in MODES:
        return Mode(mode)
    choices = ", ".join(map(repr, (AUTO, *MODES)))
    raise PlanningValueError(
        f"argument `mode` must be one of {choices}; received mode={mode!r}. "
        "Pass mode='graph' for a tf.function or Model.fit step, mode='xla' for "
        "jit_compile=True, mode='eager' for an eager step."
    )


def step_mode(mode: Union[Mode, str] = AUTO) -> Mode:
    """``"auto"`` resolved: ``Mode.XLA`` while a ``jit_compile=True`` function is
    traced, ``Mode.GRAPH`` while another ``tf.function`` is, else ``Mode.EAGER``."""
    if mode != AUTO:
        return Mode(mode)
    if not tf.inside_function():
        return Mode.EAGER
    return Mode.XLA if in_xla_context() else Mode.GRAPH
