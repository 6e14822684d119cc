"""How planning runs a plan it wants to measure, without importing the runtime.

Planning is pure: profiles in, a plan value out. Two measurements need the
plan itself run (an XLA step compiles the whole checkpointed step, so the
least plan is compiled and measured, see :mod:`._xla`): for those, the API
floor hands the planner a :data:`PlanRunner`, which turns a plan into the step
body that runs the chain or model by it. The planner calls it and never
imports the code behind it.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["PlanRunner"]

PlanRunner = Callable[[Any], Callable[[Any], Any]]
"""``runner(plan)`` -> ``body``; ``body(inputs)`` runs the chain or model by
``plan`` in training mode and returns its outputs."""
