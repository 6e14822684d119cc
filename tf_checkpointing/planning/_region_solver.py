"""The dynamic program that picks the checkpointed regions (see :mod:`._regions`).

``solve`` runs the program over cut positions on a :class:`RegionModel`, with
a budget (least recomputation that fits) or without (least peak);
``nested_options`` offers each short region also with checkpoints inside its
replay, one level deep. With save policies on the model (``RegionModel`` with
``policy_kept``), every region is also offered replayed under each policy: it
holds its live outputs plus what the policy keeps, and costs the policy's
replay time.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from tf_checkpointing.planning._constants import (
    NESTED_MAX_LEN,
    NESTED_MIN_LEN,
    NESTED_NEED_RATIO,
    NESTED_UNITS,
)
from tf_checkpointing.planning._constants import REGION_UNITS as _UNITS
from tf_checkpointing.planning._regions import RegionModel

__all__ = ["NO_POLICY", "Solution", "nested_options", "solve"]

# _UNITS: the program's memory units (see docs/design.md#region-program).


Span = tuple  # (start, stop, inner spans): a checkpointed region, nested checkpoints inside
NO_POLICY = -1  # in ``Solution.policies``: the region is replayed fully


class Solution(NamedTuple):
    """A plan the program found.

    Attributes:
        value: without a limit, its modelled peak; with one, its extra work.
        spans: its checkpointed regions, ``(start, stop, inner)`` triples.
        policies: per span, the index of the save policy it is replayed under
            (:data:`NO_POLICY`: a full replay).
    """

    value: float
    spans: tuple
    policies: tuple[int, ...]


def solve(model: RegionModel, limit: Optional[float], *, start: int = 0,
          stop: Optional[int] = None, max_len: Optional[int] = None,
          nested: Optional[dict] = None, units: int = _UNITS,
          unit: Optional[float] = None) -> Optional[Solution]:
    """With ``limit``: the least recomputation whose modelled peak fits it, or
    None. Without: the least peak (ties: least work).

    ``[start, stop)`` restricts the calls (a replay's, for nesting), ``max_len``
    the length of a region, and ``nested[(a, c)] = (need, work, inner)`` offers
    each region also with checkpoints inside its replay."""
    stop = model.n if stop is None else stop
    unit = unit or max(limit if limit is not None else model.peak(()), 1.0) / units
    tables = _tables(model, limit, start, stop, max_len, nested, units, unit)
    return _best(tables, limit, start, stop, nested)


# A step's kind, in the program's back-pointers: 0 is one plain call; a region
# is 1 + 2 * variant + followed, variant 0 flat, 1 nested, 2 + p replayed under
# policy p, ``followed`` when the plain call right after it is stepped with it.
def _kind(variant: int, followed: bool) -> int:
    return 1 + 2 * variant + int(followed)


def _decode(kind: int) -> tuple[int, bool]:
    """(variant, followed) of a region's kind."""
    return (kind - 1) // 2, bool((kind - 1) % 2)


def _tables(model, limit, start, stop, max_len, nested, units, unit):
    """The program's tables from cut ``start``: (value, work, came_from), each
    indexed by (state: 0 after a plain call or at the start, 1 after a region;
    cut; held units)."""
    size = units + 1
    # value: least work (with a limit) or least peak so far.
    value = np.full((2, stop + 1, size), np.inf)
    work = np.full((2, stop + 1, size), np.inf)
    # came_from: (source state, source cut, source held units, step kind of _options)
    came_from = np.full((2, stop + 1, size, 4), -1, np.int32)
    value[0, start, 0] = work[0, start, 0] = 0.0
    held_bytes = np.arange(size) * unit
    for a in range(start, stop):
        for source in (0, 1):
            reached = np.nonzero(np.isfinite(value[source, a]))[0]
            if not reached.size:
                continue
            # Only the held levels reached at cut `a` can step on: the step is
            # offered over [low, high) alone (most levels are unreached).
            levels = (int(reached[0]), int(reached[-1]) + 1)
            last = stop if max_len is None else min(stop, a + max_len)
            for c in range(a + 1, last + 1):
                for kind, end, need, held, extra in _options(model, a, c, stop, nested):
                    if kind == 0 and source == 1:
                        continue  # a region's next plain call is stepped with the region
                    add = int(np.ceil(held / unit - 1e-9))
                    if add < size:
                        after_region = kind > 0 and not _decode(kind)[1]
                        _relax((value, work, came_from), (source, a), (int(after_region), end),
                               add, need, extra, kind, held_bytes, limit, levels)
    return value, work, came_from


def _relax(tables, frm, to, add, need, extra, kind, held_bytes, limit, levels) -> None:
    """Offers the step ``frm -> to`` (``(state, cut)`` pairs) at every held level
    in ``levels`` (``[low, high)``) that has room for ``add`` more units."""
    value, work, came_from = tables
    low, high = levels[0], min(levels[1], value.shape[2] - add)
    if limit is not None:  # a level fits while its held bytes plus `need` do
        high = min(high, int(np.searchsorted(held_bytes, limit - need, side="right")))
    if high <= low:
        return
    if limit is None:
        new_value = np.maximum(value[frm][low:high], held_bytes[low:high] + need)
    else:
        new_value = value[frm][low:high] + extra
    new_work = work[frm][low:high] + extra
    old_value, old_work = value[to][low + add:high + add], work[to][low + add:high + add]
    better = np.isfinite(new_value) & (
        (new_value < old_value * (1 - 1e-9))
        | ((new_value <= old_value * (1 + 1e-9)) & (new_work < old_work)))
    idx = np.nonzero(better)[0]
    if idx.size:
        at = low + add + idx
        value[to][at] = new_value[idx]
        work[to][at] = new_work[idx]
        origin = came_from[to]
        origin[at, 0], origin[at, 1], origin[at, 3] = frm[0], frm[1], kind
        origin[at, 2] = low + idx


def _best(tables, limit, start, stop, nested) -> Optional[Solution]:
    """The best plan of ``[start, stop)`` in ``tables``."""
    value, work, came_from = tables
    final = value[:, stop]
    if not np.isfinite(final).any():
        return None
    ties = np.argwhere(final <= np.min(final) * (1 + 1e-9))
    state, h = (int(v) for v in ties[np.argmin(work[:, stop][tuple(ties.T)])])
    result = float(value[state, stop, h]) if limit is None else float(work[state, stop, h])
    spans, policies, c = [], [], stop
    while c > start:
        state, a, h, kind = (int(v) for v in came_from[state, c, h])
        if kind:
            variant, followed = _decode(kind)
            end = c - 1 if followed else c
            spans.append((a, end, nested[(a, end)][2] if variant == 1 else ()))
            policies.append(variant - 2 if variant >= 2 else NO_POLICY)
        c = a
    return Solution(result, tuple(reversed(spans)), tuple(reversed(policies)))


def _options(model: RegionModel, a: int, c: int, stop: int, nested: Optional[dict]):
    """The steps from cut ``a`` that run ``[a, c)``, as (kind, end cut, need, held
    bytes, extra work): 0 plain (one call), else a region (see :func:`_kind`):
    checkpointed, with checkpoints inside its replay, or replayed under a
    policy; each also followed by the plain call ``c``, whose held bytes count
    during the region's backward (see the module)."""
    if c == a + 1:
        yield 0, c, model.need(a, c, False), model.held(a, c, False), 0.0
    work = model.work(a, c)
    live = model.held(a, c, True)
    regions = [(0, model.need(a, c, True), live, work)]
    if nested is not None and (a, c) in nested:
        need, inner_work, _ = nested[(a, c)]
        regions.append((1, need, live, work + inner_work))
    for p in range(model.num_policies):
        kept = model.policy_kept(a, c, p)
        if kept > 0:  # else the same as a full replay
            regions.append((2 + p, model.need(a, c, True, p), live + kept, model.work(a, c, p)))
    for variant, need, held, extra in regions:
        yield _kind(variant, False), c, need, held, extra
        if c < stop:
            then = model.plain_held[c]
            yield (_kind(variant, True), c + 1, max(need + then, held + model.plain_need[c]),
                   held + then, extra)


def nested_options(model: RegionModel, max_len: int = NESTED_MAX_LEN,
                   units: int = NESTED_UNITS) -> dict:
    """For each region ``[a, c)`` of at most ``max_len`` calls, the least peak of
    its replay when the replay checkpoints regions of its own (one level), as
    ``(need, extra work, inner spans)``; only where that is clearly below the flat
    need. Regions too short to hold a sub-region worth nesting are skipped, and a
    gain within the model's error is not offered (see docs/design.md#nesting)."""
    options: dict = {}
    replay = model.in_replay()  # the sub-regions' plain calls run inside the replay
    unit = max(float(np.nanmax(np.where(np.isfinite(model.bwd_region), model.bwd_region, 0))),
               1.0) / units
    for a in range(model.n):
        stop = min(model.n, a + max_len)
        tables = _tables(replay, None, a, stop, None, None, units, unit)
        for c in range(a + NESTED_MIN_LEN, stop + 1):
            flat = model.need(a, c, True)
            inner = _best(tables, None, a, c, None)
            if inner is None or not inner.spans:
                continue
            need = model.replay_need(a, c, inner.value)
            if need < flat * NESTED_NEED_RATIO:
                inner_work = sum(model.cost_prefix[e] - model.cost_prefix[s]
                                 for s, e, _ in inner.spans)
                options[(a, c)] = (need, inner_work, inner.spans)
    return options
