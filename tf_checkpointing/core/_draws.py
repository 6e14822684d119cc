"""Which ops of a checkpointed call compute random numbers and nothing else.

A dropout layer draws uniform numbers and compares them with its rate; the
resulting mask is all the rest of the call reads. A save policy that keeps the
mask (``policies.random_saveable``, part of ``dots_saveable``) spares the replay
the draw, which is slow on CPU (benchmarks/results/notes/save-policies.md). ``_save_policies``
asks the policy about these results only where the rest of the call reads them
(``OpOutput.random``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

__all__: list[str] = []

_STATEFUL_DRAWS = frozenset((
    "StatefulUniform", "StatefulUniformFullInt", "StatefulUniformInt",
    "StatefulStandardNormal", "StatefulStandardNormalV2",
))


def is_draw(op_type: str) -> bool:
    """Whether the op draws random numbers (stateless or stateful)."""
    return ("Random" in op_type or "TruncatedNormal" in op_type or "Multinomial" in op_type
            or op_type in _STATEFUL_DRAWS)


def computed_from_draws(op_type: str, inputs: Sequence[Any], drawn_ops: Collection[str]) -> bool:
    """Whether an op's outputs come from random draws alone: a draw, or an op
    reading the results of draws (ops named in ``drawn_ops``) and otherwise only
    constants, scalars and shapes (``uniform * 1 + 0``, ``uniform >= rate``)."""
    if is_draw(op_type):
        return True
    from_draws = [t.op.name in drawn_ops for t in inputs]
    return any(from_draws) and all(d or _is_small(t) for d, t in zip(from_draws, inputs))


def _is_small(tensor: Any) -> bool:
    """A constant, a scalar or a shape: what turns random numbers into a mask
    (``uniform >= rate``) without bringing in an activation."""
    if tensor.op.type == "Const" or tensor.shape.num_elements() == 1:
        return True
    return tensor.dtype.is_integer and tensor.shape.rank is not None and tensor.shape.rank <= 1
