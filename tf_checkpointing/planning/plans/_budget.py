"""The one validator of ``budget=``: bytes a training step may allocate, or ``"min"``.

Every API that plans for memory (``plan_sequential``, ``plan_model``,
``checkpoint_sequential``, ``CheckpointedSequential``, ``apply_checkpointing``)
takes its budget through :func:`expect_budget`, once, where the user passes it,
so the type is one (:data:`Budget`) and the errors say the same thing; the API
called puts its name in front (``planning._errors.worded``).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

import numpy as np

# _LEAST_BYTES: a smaller budget is a unit slip (MiB, GiB), not bytes.
from tf_checkpointing.planning._constants import HEADROOM, LEAST_BUDGET_SLACK, XLA_HEADROOM
from tf_checkpointing.planning._constants import LEAST_BYTES as _LEAST_BYTES
from tf_checkpointing.planning._errors import PlanningTypeError, PlanningValueError

__all__ = ["Budget", "LEAST", "below_least", "expect_budget", "model_headroom", "plain_fits"]

LEAST = "min"
"""The budget that asks for the least memory any plan needs."""

Budget = Union[int, Literal["min"]]
"""A validated budget: bytes, or ``"min"``."""

_MODEL_APIS = ("apply_checkpointing", "plan_model")
_LEAST = ', or budget="min" for the least memory'
# What else each API that validates a budget here accepts: only the chain APIs
# take segments=, and apply_checkpointing takes select= instead of a budget.
_BUDGET_ALTERNATIVES = {
    "checkpoint_sequential": ', budget="min", or no budget (segments=k, fixed segments)',
    "CheckpointedSequential": ', budget="min", or no budget (segments=k, fixed segments)',
    "apply_checkpointing": ', budget="min", or no budget (select=[...layer names...] to '
                           'choose the layers yourself)',
}


def below_least(budget: int, min_budget: int) -> bool:
    """Whether a budget of bytes is refused against a plan's least budget
    (``min_budget_bytes``): below it by more than ``LEAST_BUDGET_SLACK``, since a
    least reported in one process reads a few percent apart in another. A budget
    within the slack gets the least plan (docs/decisions/0046-least-budget-slack.md).

        >>> from tf_checkpointing.planning.plans._budget import below_least
        >>> below_least(97 * 2**20, 100 * 2**20), below_least(94 * 2**20, 100 * 2**20)
        (False, True)
    """
    return budget < min_budget * (1 - LEAST_BUDGET_SLACK)


def model_headroom(mode: str) -> float:
    """The share of a budget a whole-model plan for a step of ``mode`` keeps free:
    ``HEADROOM`` for the allocator's chunks, which no profile sees; under XLA
    (``mode`` "xla") only ``XLA_HEADROOM``, for every plan compared with the budget
    there is a compiled step whose one buffer was measured to the byte
    (docs/decisions/0053-xla-plans-keep-less-headroom.md).

        >>> from tf_checkpointing.planning.plans._budget import model_headroom
        >>> model_headroom("graph"), model_headroom("xla")
        (0.1, 0.05)
    """
    return XLA_HEADROOM if mode == "xla" else HEADROOM


def plain_fits(budget: int, plain_peak: int, mode: str) -> bool:
    """Whether the plain step is the plan for a budget of bytes: its measured
    peak within the budget, and in a ``tf.function`` step (``mode`` "graph")
    within the share of it every plan keeps free (``HEADROOM``). A graph's steps
    peak where the executor's order puts them, and that moves the plain step as
    much as a checkpointed one; an XLA step's one buffer, and an eager step's
    readings, are the same in every step
    (docs/decisions/0047-plain-keeps-the-headroom-in-a-graph.md).

        >>> from tf_checkpointing.planning.plans._budget import plain_fits
        >>> plain_fits(100, 95, "xla"), plain_fits(100, 95, "graph")
        (True, False)
    """
    return budget * (1 - HEADROOM if mode == "graph" else 1) >= plain_peak


def expect_budget(budget: Any) -> Budget:
    """``budget=`` validated, for every API that takes one: bytes as an int, or
    ``"min"`` (the least-memory plan).

    Raises:
        PlanningValueError, PlanningTypeError: what is wrong and the fix; the
            API called names itself and the alternatives it takes (``worded``).

        >>> from tf_checkpointing.planning.plans._budget import expect_budget
        >>> expect_budget(2**20), expect_budget("min")
        (1048576, 'min')
    """
    if isinstance(budget, str):
        if budget == LEAST:
            return LEAST
        raise PlanningValueError(
            f"argument `budget` must be a number of bytes or \"min\"; received "
            f"budget={budget!r}. Pass e.g. budget=512 * 2**20 for 512 MiB, or "
            "budget=\"min\" for the least memory."
        )
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer,
                                                          np.floating)):
        raise PlanningTypeError(
            f"argument `budget` must be a number of bytes or \"min\"; received "
            f"{budget!r} of type {type(budget).__name__}. Pass e.g. budget=512 * 2**20 for "
            "512 MiB, or budget=\"min\" for the least memory."
        )
    if not (budget > 0 and math.isfinite(budget)):
        raise PlanningValueError(
            f"argument `budget` must be a positive, finite number of bytes; "
            f"received budget={budget!r}. Pass e.g. budget=512 * 2**20 for 512 MiB",
            fix=_alternatives)
    if budget < 1:
        # A fraction of plain (budget=0.5) would be truncated to 0 bytes and
        # fail only inside the first training step, naming budget=0.
        raise PlanningValueError(
            f"argument `budget` is a number of bytes, not a fraction of the "
            f"plain step's peak; received budget={budget!r}. For a fraction of plain, "
            "read plain's peak from a plan: plan = ",
            fix=lambda api: f"{_planner(api)}, budget='min'); then "
                            f"budget=int({budget!r} * plan.plain_peak_bytes).")
    if budget < _LEAST_BYTES:
        # No training step fits in a few bytes: budget=2.5 meant MiB or GiB, and
        # would fail only inside the first training step.
        raise PlanningValueError(
            f"argument `budget` is a number of bytes; received budget={budget!r}, "
            f"less than {_LEAST_BYTES} bytes, which no training step fits in. Pass "
            f"e.g. budget={budget!r} * 2**20 for {budget!r} MiB, or "
            f"budget={budget!r} * 2**30 for GiB", fix=_alternatives)
    return int(budget)


def _alternatives(api: str) -> str:
    """The end of a budget message: what else ``api`` accepts instead."""
    return f"{_BUDGET_ALTERNATIVES.get(api, _LEAST)}."


def _planner(api: str) -> str:
    """How a plan of plain's peak is made, for a model or for a chain."""
    return "plan_model(model, x" if api in _MODEL_APIS else "plan_sequential(layers, x"
