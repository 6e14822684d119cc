"""Checkpointed regions named by layer, as a user writes them, checked against the graph.

``ModelPlan.from_regions(model, [["conv1", "bn1"], ["conv2", ["bn2", "relu2"]]])``
fixes a plan by hand: each region is a run of consecutive layer calls, a nested
list a region checkpointed inside its replay. This module finds each run in
the model's call order and says exactly what is wrong when it is not one.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, Optional

from tf_checkpointing import policies as save_policies
from tf_checkpointing.planning._errors import PlanningTypeError, PlanningValueError

__all__ = ["spans_by_name"]


def spans_by_name(names: Sequence[str], regions: Any,
                  policies: Optional[Sequence[Any]]) -> tuple[tuple, tuple]:
    """``regions`` (lists of layer-call names) as ``(start, stop, inner)`` spans
    over ``names``, and the policy of each (None: a full replay).

    Raises:
        PlanningTypeError, PlanningValueError: what is wrong with ``regions`` or
            ``policies``, and the fix (the API called names itself)."""
    if isinstance(regions, (str, bytes)) or not isinstance(regions, Sequence):
        raise PlanningTypeError(
            "argument `regions` must be a list of regions, each a list of layer "
            f"names; received {regions!r} of type {type(regions).__name__}. Pass e.g. "
            f"regions=[[{', '.join(map(repr, names[:2]))}]].")
    chosen = _expect_policies(policies, len(regions))
    spans = []
    at = 0
    for k, region in enumerate(regions):
        span = _span(names, region, at, f"regions[{k}]")
        spans.append(span)
        at = span[1]
    return tuple(spans), chosen


def _span(names: Sequence[str], region: Any, at: int, where: str) -> tuple:
    """The span of ``region`` at or after call ``at``."""
    if isinstance(region, (str, bytes)) or not isinstance(region, Sequence) or not region:
        raise PlanningTypeError(
            f"{where} must be a non-empty list of layer names; received "
            f"{region!r}. Wrap a single layer in a list: [{region!r}].")
    flat = _flatten(region)
    for name in flat:
        if name not in names:
            close = difflib.get_close_matches(str(name), names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise PlanningValueError(
                f"{where} names a layer the model does not call: {name!r}.{hint} "
                f"The model calls {len(names)} layers, in order: "
                f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''} "
                "(plan_model(...).names lists them all).")
    for start in range(at, len(names) - len(flat) + 1):
        if list(names[start:start + len(flat)]) == flat:
            break
    else:
        first = names.index(flat[0])
        raise PlanningValueError(
            f"{where} must be consecutive layer calls in run order, after the "
            f"previous region; received {flat!r}, but from {flat[0]!r} the model calls "
            f"{list(names[first:first + len(flat)])!r}. List the layers as the model "
            "calls them, regions in order and not overlapping.")
    stop = start + len(flat)
    inner = []
    pos = start
    for item in region:
        if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
            span = _span(names, item, pos, where + " (inner)")
            inner.append(span)
            pos = span[1]
        else:
            pos += 1
    return start, stop, tuple(inner)


def _flatten(region: Sequence[Any]) -> list:
    out: list = []
    for item in region:
        if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
            out.extend(_flatten(item))
        else:
            out.append(item)
    return out


def _expect_policies(policies: Optional[Sequence[Any]], count: int) -> tuple:
    if policies is None:
        return ()
    if isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence) or (
            len(policies) != count):
        raise PlanningValueError(
            f"argument `policies` must list one save policy (or None) per region: "
            f"{count} of them; received {policies!r}. Pass e.g. policies=[None] * {count}.")
    for policy in policies:
        problem = save_policies.not_a_policy(policy, "policies")
        if problem is not None:
            raise PlanningTypeError(problem)
    return tuple(save_policies.resolve(p, "policies") for p in policies)
