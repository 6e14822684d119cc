"""How a plan reads when printed: a summary line, then one line per piece.

The summary says what the plan was made for and what it predicts (peak, step
time, recomputation); the pieces below it show each region's layers, nested
by indentation, with the save policy a region keeps under. Kept apart from the
plan types (:mod:`._plan`), which only hold and convert plans.

    >>> from tf_checkpointing.plans import Segment, SequentialPlan
    >>> print(SequentialPlan(names=("a", "b", "c"),
    ...                      pieces=(Segment(0, 2, True), Segment(2, 3, False))))
    SequentialPlan: 3 layers; 1 checkpointed region, 2 extra layer forwards (1.67x forward)
      [0, 2) checkpointed (2 layers: a, b)
      [2, 3) plain (1 layer: c)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from tf_checkpointing.planning._constants import HEADROOM, LEAST_BUDGET_SLACK
from tf_checkpointing.planning.plans._budget import model_headroom

__all__ = ["model_plan_text", "plan_text", "policy_name"]


def plan_text(plan: Any, headroom: float = HEADROOM) -> str:
    """``str(plan)`` of a :class:`~._plan.Plan`: its summary line and its pieces
    (``headroom``: the share of its budget the plan kept free)."""
    head = f"{type(plan).__name__}"
    head += f" ({plan.mode})" if plan.mode else ""
    head += f": {_count_of(plan.num_layers, 'layer')}"
    if plan.budget_bytes is not None:
        head += _budget_text(plan, headroom)
    regions = sum(p.checkpointed for p in plan.pieces)
    head += (f"; {_count_of(regions, 'checkpointed region')}, "
             f"{_count_of(plan.extra_forward_layers, 'extra layer forward')} "
             f"({sum(plan.forward_counts) / max(plan.num_layers, 1):.2f}x forward)")
    if plan.policies:
        head += f"; policies to choose from: {', '.join(map(policy_name, plan.policies))}"
    if plan.predicted_extra_seconds:
        head += f"; predicted replay time {_duration(plan.predicted_extra_seconds)} per step"
    elif plan.extra_forward_layers and plan.predicted_extra_seconds is not None:
        head += "; replay time not measured"
    return "\n".join([head] + _describe(plan.names, plan.pieces, "  "))


def model_plan_text(plan: Any) -> str:
    """``str(plan)`` of a :class:`~._plan.ModelPlan`: a plan's, with the blocks
    inside layer calls and the predicted step time added to its summary."""
    head, _, rest = plan_text(plan, model_headroom(plan.mode)).partition("\n")
    if plan.blocks:
        shown = list(plan.block_names[:3]) + (["..."] if len(plan.block_names) > 3 else [])
        head += (f"; {_count_of(len(plan.blocks), 'block')} inside layer calls "
                 f"checkpointed one by one ({', '.join(shown)})")
    if plan.predicted_step_seconds is not None:
        head += f"; predicted step {_seconds(plan.predicted_step_seconds)}"
        if plan.plain_step_seconds:
            head += (f", {plan.predicted_step_seconds / plan.plain_step_seconds:.2f}x "
                     f"the plain step's measured {_seconds(plan.plain_step_seconds)}")
    return head + ("\n" + rest if rest else "")


def policy_name(policy: Any) -> str:
    """How a plan shows a policy: its function's name (with the names a name
    policy keeps), else its repr."""
    config = getattr(policy, "_config", None)
    if config:
        return f"{config[0]}({', '.join(map(repr, config[1]))})"
    return getattr(policy, "__name__", None) or repr(policy)


def _budget_text(plan: Any, headroom: float) -> str:
    """The budget, the predicted peak against plain's, and the least budget."""
    budget = "min" if plan.budget_bytes == "min" else _mib(plan.budget_bytes)
    text = f", budget {budget} -> predicted peak {_mib(plan.predicted_peak_bytes)}"
    if plan.predicted_peak_bytes and plan.plain_peak_bytes:
        text += (f" ({plan.predicted_peak_bytes / plan.plain_peak_bytes:.2f}x the "
                 f"plain step's measured {_mib(plan.plain_peak_bytes)})")
    else:
        text += f" (plain step {_mib(plan.plain_peak_bytes)})"
    return text + (f"; least budget {_mib(plan.min_budget_bytes)} (a plan's predicted peak "
                   f"stays within {1 - headroom:.0%} of its budget; up to "
                   f"{LEAST_BUDGET_SLACK:.0%} below it, the least plan)")


def _mib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**20:.2f} MiB"


def _duration(seconds: float) -> str:
    """Seconds as ms, or as µs below a millisecond (a replay of small layers)."""
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def _seconds(seconds: float) -> str:
    """A step's time: seconds with three decimals, or ms below a tenth of a second."""
    return f"{seconds:.3f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _describe(names: Sequence[str], pieces: tuple[Any, ...], indent: str) -> list[str]:
    """A line per piece, its inner pieces below it, indented."""
    lines = []
    for p in pieces:
        shown = list(names[p.start:p.stop])
        shown = shown if len(shown) <= 4 else shown[:2] + ["..."] + shown[-1:]
        kind = "checkpointed" if p.checkpointed else "plain"
        if p.checkpointed and p.policy is not None:
            kind += f" with {policy_name(p.policy)}"
        lines.append(f"{indent}[{p.start}, {p.stop}) {kind} "
                     f"({_count_of(p.stop - p.start, 'layer')}: {', '.join(shown)})")
        lines.extend(_describe(names, p.inner, indent + "  "))
    return lines
