"""Which plan a call runs, when plans are made for a budget on the first calls.

``apply_checkpointing(model, budget=...)`` and ``CheckpointedSequential(budget=)``
plan from the batch of a training call, in the mode it runs. A plan is within
its budget only for that batch size and mode, so one is kept per mode and
batch shape: a call in a new mode, or with a batch larger than any planned for
its mode, is planned anew (a batch-4 warm-up step, then batch-32 training, ran
the batch-4 plan at 1.42x the budget; an eager sanity step pinned an eager plan
that ``Model.fit`` then ran). A smaller batch keeps less, so it runs the plan
of a batch at least as large; a batch of unknown size (an epoch's last, traced
by ``Model.fit`` with a None batch dimension) runs the largest one's.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Generic, Optional, TypeVar

import tensorflow as tf
from tensorflow.python.eager import record

__all__: list[str] = []

Plan = TypeVar("Plan")


class PlansByShape(Generic[Plan]):
    """The plans made so far, per mode, with the input shapes each was made for.

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing.planning._reuse import PlansByShape
        >>> plans = PlansByShape()
        >>> plans.find("graph", tf.ones([32, 4]), training=True)
        (None, True)
        >>> plans.add("graph", tf.ones([32, 4]), "plan for 32")
        >>> plans.find("graph", tf.ones([8, 4]), training=True)
        ('plan for 32', False)
        >>> plans.find("graph", tf.ones([64, 4]), training=True)
        (None, True)
    """

    def __init__(self, api: str = "apply_checkpointing") -> None:
        self.api = api
        self._made: dict[str, list[tuple[tuple, Plan]]] = {}
        self._warned: set[str] = set()  # modes told that another mode's plan runs

    def find(self, mode: str, inputs: Any, *, training: Any) -> tuple[Optional[Plan], bool]:
        """``(plan, plan_anew)`` for a call in ``mode`` on ``inputs``: a plan
        made for a batch at least as large (or, for a batch of unknown size or
        an inference call, the largest batch's), else whether to make one.
        An inference call (``training=False`` and no tape recording: evaluate,
        predict) never asks for a plan; with none made it runs plainly."""
        shapes = _shapes(inputs)
        made = self._made.get(mode, [])
        for planned, plan in made:
            if _within(shapes, planned):
                return plan, False
        known = all(d is not None for shape in shapes for d in shape)
        inference = training is False and not record.could_possibly_record()
        if made and (inference or not known):
            return made[-1][1], False
        others = [(m, plans[-1][1]) for m, plans in self._made.items() if plans and m != mode]
        if not known and not inference and others:
            # No plan can be made for an unknown batch: rather than fail a step that
            # an earlier plan can run exactly, run it and say the budget may not hold.
            other_mode, plan = others[-1]
            if mode not in self._warned:
                self._warned.add(mode)
                warnings.warn(
                    f"{self.api}: this {mode} step has an input of unknown batch size "
                    f"(shapes {list(shapes)}), so no plan can be made for it; it runs the "
                    f"plan made for {other_mode} steps, whose predicted peak may not hold "
                    f"in {mode} steps. Fix: let the first {mode} step see a known batch "
                    "size, or plan ahead for this mode (plan_model(..., mode=...) / "
                    "plan_sequential(..., mode=...)) and pass the plan.",
                    UserWarning, stacklevel=4)
            return plan, False
        return None, not inference

    def add(self, mode: str, inputs: Any, plan: Plan) -> None:
        """Keeps ``plan``, made in ``mode`` for ``inputs``' shapes."""
        made = self._made.setdefault(mode, [])
        made.append((_shapes(inputs), plan))
        made.sort(key=lambda entry: _elements(entry[0]))

    def plans(self, mode: str) -> list[Plan]:
        """The plans made in ``mode``, smallest batch first."""
        return [plan for _, plan in self._made.get(mode, [])]


def _shapes(inputs: Any) -> tuple:
    shapes = [tf.TensorShape(leaf.shape) for leaf in tf.nest.flatten(inputs)
              if hasattr(leaf, "shape")]
    return tuple(tuple(s.as_list()) if s.rank is not None else (None,) for s in shapes)


def _within(shapes: tuple, planned: tuple) -> bool:
    """Whether every input of ``shapes`` is at most as large, dimension by
    dimension, as the planned one (a smaller batch keeps less)."""
    return len(shapes) == len(planned) and all(
        len(a) == len(b) and all(x is not None and x <= y for x, y in zip(a, b))
        for a, b in zip(shapes, planned))


def _elements(shapes: tuple) -> int:
    return sum(math.prod(d or 0 for d in shape) for shape in shapes)
