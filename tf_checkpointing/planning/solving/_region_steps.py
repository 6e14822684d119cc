"""The steps the region program (:mod:`._region_solver`) may take from one cut.

From cut ``a``, a step is a region ``[a, c)`` in each of its variants (replayed
fully, with checkpoints inside its replay, or under a save policy), the same
region followed by the plain call ``c`` (the call right after a region is still
held while the region replays, see :mod:`._regions`), or one plain call. Each step
is what the program needs of it: the state and cut it ends at, its need and held
bytes, its extra work, and its kind (the program's back-pointers decode it).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from tf_checkpointing.planning.solving._regions import RegionModel

__all__ = ["Steps", "steps_from"]


def _regions(model: RegionModel, nested: Optional[dict], a: int, last: int) -> np.ndarray:
    """Each region ``[a, c)`` for ``c`` in ``(a, last]``, per variant (0 flat, 1 with
    checkpoints inside its replay, 2 + p replayed under policy p), as (need,
    held bytes, extra work), indexed [quantity, variant, c - a - 1]; a variant not
    offered is all inf (no held level has room for it)."""
    ends, absent = range(a + 1, last + 1), (np.inf, np.inf, np.inf)
    live = [model.held(a, c, True) for c in ends]
    work = [model.work(a, c) for c in ends]
    nested = nested or {}
    variants = [
        list(zip([model.need(a, c, True) for c in ends], live, work)),
        [(nested[a, c][0], held, extra + nested[a, c][1]) if (a, c) in nested else absent
         for c, held, extra in zip(ends, live, work)],
    ]
    for p in range(model.num_policies):
        # A policy that keeps nothing is the same as a full replay.
        variants.append([(model.need(a, c, True, p), held + kept, model.work(a, c, p))
                         if kept > 0 else absent for c, held, kept in
                         zip(ends, live, (model.policy_kept(a, c, p) for c in ends))])
    return np.array(variants, float).reshape(len(variants), last - a, 3).transpose(2, 0, 1)


class Steps(NamedTuple):
    """The steps from one cut, each indexed [variant, row] (see :func:`steps_from`)."""

    to: np.ndarray  # the state it ends in
    end: np.ndarray  # the cut it ends at
    need: np.ndarray
    held: np.ndarray
    extra: np.ndarray  # work
    kind: np.ndarray  # see _KINDS


def steps_from(model: RegionModel, nested: Optional[dict], a: int, last: int,
               stop: int) -> Steps:
    """The steps from cut ``a``: for each ``c`` in ``(a, last]``, region ``[a, c)``
    (:func:`_regions`), then the same followed by the plain call ``c`` (if
    ``c < stop``), whose held bytes count during the region's backward (see the
    module), then one plain call (variant 0; not offered in the others)."""
    need, held, extra = _regions(model, nested, a, last)
    then = np.arange(a + 1, min(last, stop - 1) + 1)  # the calls that can follow
    f, kinds = len(then), 1 + 2 * np.arange(len(need))[:, None]
    alone = np.full((3, len(need), 1), np.inf)
    alone[:, 0, 0] = model.need(a, a + 1, False), model.held(a, a + 1, False), 0.0

    def rows(regions, followed, plain):  # [variant, row]: the three groups of rows
        return np.hstack([np.broadcast_to(group, (len(need), width))
                          for group, width in zip((regions, followed, plain), (last - a, f, 1))])

    return Steps(
        to=rows(1, 0, 0), end=rows(np.arange(a + 1, last + 1), then + 1, a + 1),
        need=rows(need, np.maximum(need[:, :f] + model.plain_held[then],
                                   held[:, :f] + model.plain_need[then]), alone[0]),
        held=rows(held, held[:, :f] + model.plain_held[then], alone[1]),
        extra=rows(extra, extra[:, :f], alone[2]), kind=rows(kinds, kinds + 1, 0))
