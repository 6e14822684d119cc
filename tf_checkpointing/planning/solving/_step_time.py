"""How long a whole-model plan's training step takes, predicted from the profile.

A checkpointed region replays its forward in backprop and does nothing else
differently, so a plan's step is the plain step plus its replays:

    predicted step = plain step + replay_scale * (forward seconds replayed)

The plain step is measured in the plan's mode while planning (the step the
memory model is calibrated on, ``measuring._whole_step.graph_plain_step``;
under XLA the plain step the anchor compiles, ``_xla.model_anchor``). The
forward seconds replayed are the region program's own unit
(:meth:`~._regions.RegionModel.extra_work`: each call's forward timed as a
``tf.function`` of its own, a policy's replay as its measured share of it).
``replay_scale`` maps that unit onto what a replay adds to the step in the
plan's mode; how it is chosen, and the measurements behind it:
docs/decisions/0039-step-time-model.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import numpy as np

from tf_checkpointing.planning.layer_graph._blocks import BlockRef, block_layers

__all__ = ["StepTime", "block_work", "replay_scale", "step_time"]

# The range a measured replay scale is kept in: outside it, a reading failed (a
# least plan that measured faster than plain on a loaded machine).
_SCALE_RANGE = (0.1, 4.0)


class StepTime(NamedTuple):
    """The time model of one profiled model in one mode.

    Example:
        >>> from tf_checkpointing.planning.solving._step_time import StepTime
        >>> StepTime(plain_seconds=0.100, replay_scale=0.5).predict(0.040)
        0.12
    """

    plain_seconds: float
    replay_scale: float = 1.0

    def predict(self, replay_seconds: float) -> float:
        """The step time of a plan that replays ``replay_seconds`` (profile unit)."""
        return round(self.plain_seconds + self.replay_scale * max(0.0, replay_seconds), 9)


def step_time(plain_seconds: Optional[float], replay_scale: float = 1.0) -> Optional[StepTime]:
    """The time model for a plain step of ``plain_seconds`` (None where the
    plain step was not timed: an eager profile)."""
    if plain_seconds is None or not np.isfinite(plain_seconds) or plain_seconds <= 0:
        return None
    return StepTime(float(plain_seconds), float(replay_scale))


def replay_scale(plain_seconds: Optional[float], least_seconds: Optional[float],
                 least_replay: float) -> float:
    """What a profile second of replay adds to the step: 1 unless a least plan
    replaying ``least_replay`` profile seconds was timed (``least_seconds``,
    beside the plain step's ``plain_seconds``), then the measured ratio, kept
    within a sane range.

        >>> from tf_checkpointing.planning.solving._step_time import replay_scale
        >>> replay_scale(0.100, 0.130, least_replay=0.060), replay_scale(0.1, None, 0.06)
        (0.5, 1.0)
    """
    if not plain_seconds or not least_seconds or least_replay <= 0:
        return 1.0
    low, high = _SCALE_RANGE
    return round(min(high, max(low, (least_seconds - plain_seconds) / least_replay)), 9)


def block_work(graph: Any, cost: Sequence[float], blocks: tuple[BlockRef, ...]) -> float:
    """The forward seconds replayed by checkpointing ``blocks`` (sublayers of
    the graph's calls, see ``ModelPlan.blocks``) one by one: per call, its
    forward seconds times the share of its layer's weights that the blocks
    hold. The profile times calls, not what runs inside them, and a block's
    matrix products (which its weights size) are most of its time: a stack of
    eight equal blocks replays eight eighths of its call, a ViT encoder its
    blocks but not its last normalization."""
    total = 0.0
    for call in sorted({i for i, _ in blocks}):
        refs = tuple(ref for ref in blocks if ref[0] == call)
        held = sum(_weight_count(layer) for layer in block_layers(graph, refs))
        whole = _weight_count(graph.calls[call].layer)
        share = 1.0 if whole <= 0 else min(1.0, held / whole)
        total += float(cost[call]) * share
    return total


def _weight_count(layer: Any) -> int:
    """Scalars in ``layer``'s weights (trainable or not), each weight once."""
    seen: dict[int, int] = {}
    for weight in getattr(layer, "weights", ()):
        shape = tuple(int(d) for d in weight.shape)
        seen.setdefault(id(weight), int(np.prod(shape)) if shape else 1)
    return sum(seen.values())
