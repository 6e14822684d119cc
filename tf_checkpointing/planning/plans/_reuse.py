"""Which plan a call runs, when plans are made for a budget on the first calls.

``apply_checkpointing(model, budget=...)`` and ``CheckpointedSequential(budget=)``
plan from the batch of a training call, in the mode it runs. A plan is within
its budget only for that batch size and mode, so one is kept per mode and
batch shape: a call in a new mode, or with a batch larger than any planned for
its mode, is planned anew (a small warm-up batch's plan overran the budget of
the training batches, and an eager sanity step pinned an eager plan that
``Model.fit`` then ran; see docs/decisions/0031-plans-per-batch-and-mode.md). A smaller
batch keeps less, so it runs the plan of a batch at least as large. For a batch
of unknown size (traced with a None batch dimension: an epoch's last under
``reduce_retracing``) no plan can be made: it runs the largest plan whose other
dimensions are at least its own, of its mode or another, and warns that the
budget holds only for batches no larger (it used to overrun the budget
silently). Plans that ``plan_model`` made for the model, for the same budget
and policies, count as made (:func:`remember`): ``Model.fit`` on a dataset
whose batch size is unknown then runs the plan made ahead on one batch.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Generic, Optional, TypeVar

import tensorflow as tf

from tf_checkpointing.core._internals import record
from tf_checkpointing.planning._cache import registered
from tf_checkpointing.planning._errors import caller
from tf_checkpointing.planning.measuring._allocator import unknown_dimensions

__all__: list[str] = []

Plan = TypeVar("Plan")


# Plans plan_model made, per model: (budget, policies, mode, input specs, plan);
# emptied with every planning cache by clear_caches().
_MADE_AHEAD: weakref.WeakKeyDictionary = registered(weakref.WeakKeyDictionary())


def remember(model: Any, inputs: Any, budget: Any, policies: tuple, plan: Any) -> None:
    """Notes that ``plan`` was made for ``model`` on ``inputs`` for ``budget``."""
    specs = [tf.TensorSpec(leaf.shape, leaf.dtype) for leaf in tf.nest.flatten(inputs)
             if hasattr(leaf, "shape")]
    _MADE_AHEAD.setdefault(model, []).append((budget, policies, plan.mode, specs, plan))


def plans_made_ahead(model: Any, policies: tuple) -> list[tuple[str, list, Any]]:
    """``(mode, input specs, plan)`` of each plan :func:`remember` noted for
    ``model`` with these policies, for any budget: what is known of its least
    budgets before a step runs."""
    return [(mode, specs, plan) for _, chosen, mode, specs, plan
            in _MADE_AHEAD.get(model, ()) if chosen == policies]


def made_ahead(model: Any, budget: Any, policies: tuple) -> list[tuple[str, list, Any]]:
    """``(mode, input specs, plan)`` of each plan :func:`remember` noted for
    ``model`` with this budget and these policies."""
    return [(mode, specs, plan) for made_for, chosen, mode, specs, plan
            in _MADE_AHEAD.get(model, ()) if made_for == budget and chosen == policies]


class PlansByShape(Generic[Plan]):
    """The plans made so far, per mode, with the input shapes each was made for.

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing.planning.plans._reuse import PlansByShape
        >>> plans = PlansByShape()
        >>> plans.find("graph", tf.ones([32, 4]), training=True)
        (None, True)
        >>> plans.add("graph", tf.ones([32, 4]), "plan for 32")
        >>> plans.find("graph", tf.ones([8, 4]), training=True)
        ('plan for 32', False)
        >>> plans.find("graph", tf.ones([64, 4]), training=True)
        (None, True)
    """

    def __init__(self) -> None:
        self._made: dict[str, list[tuple[tuple, Plan]]] = {}
        self._warned: set[str] = set()  # modes told that an unknown batch runs a plan
        self._ahead: set[int] = set()  # ids of the plans plan_model made (adopt)

    def find(self, mode: str, inputs: Any, *, training: Any) -> tuple[Optional[Plan], bool]:
        """``(plan, plan_anew)`` for a call in ``mode`` on ``inputs``: a plan
        made for inputs at least as large, else whether to make one.

        An inference call (``training=False`` and no tape recording: evaluate,
        predict) never asks for a plan: it runs the largest one, or plainly. For
        an input of unknown batch size no plan can be made: it runs the largest
        plan made for inputs whose known dimensions are at least its own (of its
        mode, else of another), with a warning that the budget holds only if the
        batches are no larger; with none, planning raises the error that names
        the fixes."""
        shapes = _shapes(inputs)
        made = self._made.get(mode, [])
        for planned, plan in made:
            if _within(shapes, planned):
                return plan, False
        if training is False and not record.could_possibly_record():
            return (made[-1][1] if made else None), False
        if all(d is not None for shape in shapes for d in shape):
            return None, True
        fitting = ([(mode, s, p) for s, p in made if _within(shapes, s, unknown=True)]
                   or sorted(((m, s, p) for m, plans in self._made.items() if m != mode
                              for s, p in plans if _within(shapes, s, unknown=True)),
                             key=lambda entry: _elements(entry[1])))
        if not fitting:
            return None, True
        planned_mode, planned, plan = fitting[-1]
        # A plan made ahead for this mode, on the batch the user chose: as asked.
        asked = planned_mode == mode and id(plan) in self._ahead
        if mode not in self._warned and not asked:
            self._warned.add(mode)
            other = "" if planned_mode == mode else (
                f" and for {planned_mode} steps (its predicted peak is theirs)")
            batch = any(shape and shape[0] is None for shape in shapes)
            what = "batch size" if batch else "size (" + unknown_dimensions(shapes) + ")"
            known = ("every batch a known size (dataset.batch(n, drop_remainder=True))"
                     if batch else "that dimension a fixed size (pad to a fixed length)")
            warnings.warn(
                f"{caller()}: this {mode} step has an input of unknown {what} (shapes "
                f"{list(shapes)}), so no plan can be made for it; it runs the plan made "
                f"for inputs of shapes {list(planned)}{other}, whose budget holds only for "
                "inputs no larger. Fix: make the plan for the largest input first (a "
                f"first {mode} step at that size{self._plan_ahead(mode)}), or give "
                f"{known}.",
                UserWarning, stacklevel=4)
        return plan, False

    def _plan_ahead(self, mode: str) -> str:
        if caller() != "apply_checkpointing":  # the layer takes no plan
            return ""
        return (f", or plan_model(model, x[:batch_size], budget=..., mode={mode!r}) "
                "passed as plan=")

    def add(self, mode: str, inputs: Any, plan: Plan) -> None:
        """Keeps ``plan``, made in ``mode`` for ``inputs``' shapes."""
        made = self._made.setdefault(mode, [])
        made.append((_shapes(inputs), plan))
        made.sort(key=lambda entry: _elements(entry[0]))

    def adopt(self, made: list[tuple[str, Any, Plan]]) -> None:
        """Keeps the plans of ``made`` (``(mode, inputs, plan)``) not kept yet, where
        no plan is kept for the same mode and shapes (the call's own stays)."""
        kept = {id(plan) for plans in self._made.values() for _, plan in plans}
        for mode, inputs, plan in made:
            shapes = _shapes(inputs)
            if id(plan) not in kept and all(s != shapes for s, _ in self._made.get(mode, [])):
                self.add(mode, inputs, plan)
                self._ahead.add(id(plan))

    def plans(self, mode: str) -> list[Plan]:
        """The plans made in ``mode``, smallest batch first."""
        return [plan for _, plan in self._made.get(mode, [])]


def _shapes(inputs: Any) -> tuple:
    shapes = [tf.TensorShape(leaf.shape) for leaf in tf.nest.flatten(inputs)
              if hasattr(leaf, "shape")]
    return tuple(tuple(s.as_list()) if s.rank is not None else (None,) for s in shapes)


def _within(shapes: tuple, planned: tuple, unknown: bool = False) -> bool:
    """Whether every input of ``shapes`` is at most as large, dimension by
    dimension, as the planned one (a smaller batch keeps less); with
    ``unknown``, an unknown dimension is taken to be."""
    return len(shapes) == len(planned) and all(
        len(a) == len(b) and all((x is None and unknown) or (x is not None and x <= y)
                                 for x, y in zip(a, b))
        for a, b in zip(shapes, planned))


def _elements(shapes: tuple) -> int:
    return sum(math.prod(d or 0 for d in shape) for shape in shapes)
