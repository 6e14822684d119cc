"""The dynamic program that picks the checkpointed regions (see :mod:`._regions`).

``solve`` runs the program over cut positions on a :class:`RegionModel`, with
a budget (least recomputation that fits) or without (least peak);
``nested_options`` offers each short region also with checkpoints inside its
replay, one level deep. With save policies on the model (``RegionModel`` with
``policy_kept``), every region is also offered replayed under each policy: it
holds its live outputs plus what the policy keeps, and costs the policy's
replay time.

The program runs on NumPy arrays (the pure-Python loop over cuts, ends and
steps took seconds on a ResNet50): the steps from one cut are offered together,
and ``nested_options`` runs its programs from every start at once (see
:func:`_tables`); the plans are those of that loop, ties included. The steps
from a cut are made by :mod:`._region_steps`. The program skips the steps that cannot
win, under a bound on the peak (the least plan) or on the work (a limit), and
finds the same plans (:func:`_least`, :func:`_bounded`; see
docs/decisions/0052-region-program-skips-steps-that-cannot-win.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tf_checkpointing.planning._constants import (
    NESTED_MAX_LEN,
    NESTED_MIN_LEN,
    NESTED_NEED_RATIO,
    NESTED_UNITS,
)
from tf_checkpointing.planning._constants import REGION_NEAREST_TRIES as _NEAREST_TRIES
from tf_checkpointing.planning._constants import REGION_UNITS as _UNITS
from tf_checkpointing.planning.solving._region_steps import Steps, steps_from
from tf_checkpointing.planning.solving._regions import RegionModel

__all__ = ["NO_POLICY", "Solution", "nested_options", "solve"]

# _UNITS: the program's memory units (see docs/decisions/0015-region-program.md).


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
          unit: Optional[float] = None, nearest: bool = True,
          base_policies: Optional[int] = None,
          known: Optional[Solution] = None) -> Optional[Solution]:
    """With ``limit``: the least recomputation whose modelled peak fits it, or
    None. Without: the least peak (ties: least work).

    ``[start, stop)`` restricts the calls (a replay's, for nesting), ``max_len``
    the length of a region, and ``nested[(a, c)] = (need, work, inner)`` offers
    each region also with checkpoints inside its replay.

    The program counts held bytes in ``units`` of the limit. Rounding every
    step's bytes up never exceeds the limit, but overstates a plan of a hundred
    steps by tens of units, and left budgets unused (see
    docs/decisions/0049-region-program-rounds-to-the-nearest.md). So with a limit
    (and ``nearest``), the program also runs with each step's bytes rounded to the
    nearest unit, its plan checked against the model's own peak (one above the
    limit: run again, the limit lowered by the excess), and the plan of least
    work that fits is taken, ties to the rounded-up program's.

    Rounded, the program is not exact, and a choice space with more options can
    land on a plan that replays more than a smaller space's. With a limit and
    ``base_policies``, the plan offering only the model's first
    ``base_policies`` policies is solved too, and the better taken (ties: the
    smaller space's): offering more policies never costs replay time (see
    docs/decisions/0050-more-policies-never-cost-replay.md).

    A ``known`` plan (with a limit) is one the caller prefers at equal work: a
    plan of more work than it is not returned (None instead), and the programs
    skip the steps that cannot beat it (see :func:`_bounded`), which finds the
    same plans sooner.
    """
    if limit is not None and base_policies is not None and (
            base_policies < model.num_policies):
        kwargs = dict(start=start, stop=stop, max_len=max_len, nested=nested, units=units,
                      unit=unit, nearest=nearest)
        # The smaller space's plan first: of equal work, it wins (a policy that
        # spares no replay is not worth keeping its tensors for).
        smaller = solve(model.with_policies(base_policies), limit, known=known, **kwargs)
        plans = [smaller, solve(model, limit, known=smaller or known, **kwargs)]
        fits = [plan for plan in plans if plan is not None]
        return min(fits, key=lambda plan: plan.value) if fits else None
    stop = model.n if stop is None else stop

    def run(cap: Optional[float], rounded_nearest: bool, units: int = units,
            unit: Optional[float] = unit, bound: float = np.inf) -> Optional[Solution]:
        size = unit or max(cap if cap is not None else model.peak(()), 1.0) / units

        def steps(a: int) -> Steps:
            return steps_from(model, nested, a,
                          stop if max_len is None else min(stop, a + max_len), stop)

        tables = _tables(steps, cap, np.array([start]), np.array([stop]), units, size,
                         rounded_nearest, bound)
        return _best(tables, 0, cap, start, stop, nested)

    if limit is None:
        return _least(run, units, unit)
    # Every step rounded up: never above the limit (of more work than `known`:
    # it would lose to it, so it is not kept).
    found = [_bounded(run, limit, False, known, exact=False)]
    cap = limit
    for _ in range(_NEAREST_TRIES if nearest else 0):
        plan = _bounded(run, cap, True, found[0] or known)
        if plan is None:
            break
        excess = model.peak(plan.spans, start, stop, plan.policies) - limit
        if excess <= 0:
            found.append(plan)
            break
        cap -= excess + cap / units
    fits = [plan for plan in found if plan is not None
            and (known is None or plan.value < known.value)]
    return min(fits, key=lambda plan: plan.value) if fits else None


def _least(run, units: int, unit: Optional[float]) -> Optional[Solution]:
    """The least-peak program, run in two passes that find what one finds.

    A plan's peak only grows along its steps, so cells whose peak is above the
    least peak never lead to it, and the program skips every step above a
    ``bound`` on it. The bound is the least peak of the program in a unit eight
    times coarser (each step's bytes rounded up to it: the coarse plan's peak in
    the fine unit is at most its coarse peak, so the fine least is too). The fine
    program with the bound fills every cell well below it exactly as without it
    (a skipped step could only beat or tie a cell within 1e-9 of the bound), so a
    plan found at most at the coarse least peak is the plan the program finds
    without a bound, ties included; else (a coarse least rounded below the fine
    one) the program runs again without one."""
    coarse_units = max(units // _COARSE, 1)
    coarse = run(None, False, units=coarse_units,
                 unit=None if unit is None else unit * units / coarse_units)
    if coarse is None:  # (held bytes beyond the coarse table: no bound to take)
        return run(None, False)
    bound = coarse.value * (1 + _BOUND_SLACK)
    found = run(None, False, bound=bound)
    if found is not None and found.value <= coarse.value:
        return found
    return run(None, False)


def _bounded(run, cap: float, rounded_nearest: bool, known: Optional[Solution],
             exact: bool = True) -> Optional[Solution]:
    """``run(cap, rounded_nearest)``, first with the ``known`` plan's work as a
    bound. Work only grows along a plan's steps, and a step is taken only where it
    is strictly better, so the bounded program fills every cell of at most the
    known work as the program does without a bound: a plan found within it is
    the program's, ties included (the nearest rounding usually finds one: it
    counts fewer bytes than the rounded-up program). Else the plan is of more
    work than ``known``: None, or with ``exact`` the program without a bound."""
    if known is None:
        return run(cap, rounded_nearest)
    plan = run(cap, rounded_nearest, bound=known.value * (1 + _BOUND_SLACK))
    if plan is not None and plan.value <= known.value:
        return plan
    return run(cap, rounded_nearest) if exact else None


_COARSE = 8  # the bound's program counts in units this many times coarser
# The bound above the coarse least peak by far more than the ties' 1e-9 (see _relax):
# no skipped step beats or ties a cell at or below the coarse least.
_BOUND_SLACK = 1e-6


# A step's kind, in the program's back-pointers: 0 is one plain call; a region
# is 1 + 2 * variant + followed, variant 0 flat, 1 nested, 2 + p replayed under
# policy p, ``followed`` when the plain call right after it is stepped with it.
_KINDS = 2**16  # a back-pointer is _KINDS * source cell + kind (room for 32766 policies)


def _decode(kind: int) -> tuple[int, bool]:
    """(variant, followed) of a region's kind."""
    return (kind - 1) // 2, bool((kind - 1) % 2)


def _tables(steps, limit, starts, stops, units, unit, nearest=False, bound=np.inf):
    """The programs from cut ``starts[w]`` to ``stops[w]`` for each window ``w``,
    with ``steps(a)`` the steps from cut ``a``: tables (value, work, came_from)
    indexed by (window; state: 0 after a plain call or at the start, 1 after a
    region; cut less the window's start; held units). A step's held bytes are
    rounded up to whole units, or under ``nearest`` to the nearest. A step whose
    peak (without a limit) or work (with one) is above ``bound`` is not offered
    (see :func:`_least` and :func:`_bounded`).

    A step lands on a later cut, so the rows at a cut are final when it is
    reached, and its steps (every window's at once) are offered together, as
    arrays. A step is taken where it is better than what its target holds *then*
    (within ``1e-9``, so the order sets the ties): the steps that share a target
    are offered in the order of a loop over source state and variant, one batch
    each, which holds at most one step per target row."""
    size, span = units + 1, int(np.max(stops - starts, initial=0))
    # Cut span + 1 is padding: a target row read whole past its end stays inside.
    shape = (len(starts), 2, span + 2, size)
    # value: least peak, or with a limit least work: the same as work, one table.
    value = np.full(shape, np.inf)
    work = value if limit is not None else np.full(shape, np.inf)
    # came_from: the source cell (cut less the start, state, held units) and the
    # step's kind, as one number (see _KINDS): one scatter, not four.
    came_from = np.full(shape, -1, np.int64)
    value[:, 0, 0, 0] = work[:, 0, 0, 0] = 0.0
    held_bytes = np.arange(size) * unit
    flat = (value.reshape(-1), work.reshape(-1), came_from.reshape(-1))
    flat += tuple(sliding_window_view(table, size) for table in flat[:2])  # [start of a row]
    scratch: list = [np.empty(0)]

    def row(window, state, cut):  # where a (window, state, cut) row starts, flat
        return ((window * 2 + state) * (span + 2) + cut) * size

    for d in range(span):
        windows = np.nonzero(starts + d < stops)[0]
        found = [steps(a) for a in starts[windows] + d]
        to, end, need, held, extra, kind = (np.hstack(field) for field in zip(*found))
        window = np.repeat(windows, [s.to.shape[1] for s in found])
        if scratch[0].size < to.shape[1] * size:
            # Room for one batch's arrays: fresh ones this large cost more to map than to fill.
            scratch = [np.empty(to.shape[1] * size, t) for t in [float] * 3 + [bool] * 3]
        add = np.floor(held / unit + 0.5) if nearest else np.ceil(held / unit - 1e-9)
        # The source levels a step may leave from are those below its `cap`: it
        # lands in the table, within the window, its value is finite and with a
        # limit, the level's held bytes plus its need fit.
        cap = np.where((add < size) & (end <= stops[window]), size - np.minimum(add, size), 0)
        if limit is None:
            cap[~(need < np.inf)] = 0
            if bound < np.inf:
                cap = np.minimum(cap, np.searchsorted(held_bytes, bound - need, side="right"))
        else:
            cap = np.minimum(cap, np.searchsorted(held_bytes, limit - need, side="right"))
            cap[~np.isfinite(extra)] = 0
        base = row(window, to, end - starts[window]) + np.minimum(add, size).astype(np.int64)
        for source in (0, 1):
            # Only the held levels reached at the cut can step on (most are not).
            reached = np.nonzero(np.isfinite(value[windows, source, d]).any(axis=0))[0]
            if not reached.size:
                continue
            levels = (int(reached[0]), int(reached[-1]) + 1)
            # Each step's source row (one window: one row for all, broadcast).
            one = len(windows) == 1
            frm = row(windows if one else window, source, d)
            # With a limit and a bound, the steps whose extra work takes even the
            # least work at the cut above the bound are not offered.
            room = (bound - np.min(value[windows, source, d, levels[0]:levels[1]])
                    if limit is not None and bound < np.inf else np.inf)
            for v in range(len(to)):
                # (a region's next plain call is stepped with the region)
                rows = np.nonzero((cap[v] > levels[0]) & ((kind[v] > 0) | (source == 0))
                                  & (extra[v] <= room))[0]
                if rows.size:
                    _relax(flat, scratch, ((d * 2 + source) * size, frm if one else frm[rows]),
                           levels, (base[v, rows], need[v, rows], extra[v, rows],
                                    kind[v, rows], cap[v, rows]), limit, held_bytes)
    return value, work, came_from


def _relax(flat, scratch, source, levels, step, limit, held_bytes) -> None:
    """Offers steps at the held ``levels`` (``[low, high)``) below each one's
    ``cap``: ``step`` holds arrays, one target row each, landing at ``base``
    (flat) plus the level, from ``source``: its cell (as in ``came_from``) and
    its rows in the flat tables.

    A level not reached (inf) is offered too, and is never better: its value and
    work are inf, and so is any value they make (``_tables`` offers no step with an
    infinite need or, with a limit, extra work)."""
    value, work, came_from, value_rows, work_rows = flat
    (low, high), width = levels, levels[1] - levels[0]
    base, need, extra, kind, cap = (x[:, None] for x in step)
    new_value, new_work, bound, better, tie, less = (
        s[:len(base) * width].reshape(len(base), width) for s in scratch)
    # The target rows, `width` levels each (not the whole row's: a smaller copy).
    targets = base[:, 0] + low
    if limit is None:
        np.maximum(np.add(held_bytes[low:high], need, out=new_value),
                   value_rows[source[1] + low][:, :width], out=new_value)
        np.add(work_rows[source[1] + low][:, :width], extra, out=new_work)
        old_value = sliding_window_view(value, width)[targets]
        old_work = sliding_window_view(work, width)[targets]
        np.less(new_value, np.multiply(old_value, 1 - 1e-9, out=bound), out=better)
        np.less_equal(new_value, np.multiply(old_value, 1 + 1e-9, out=bound), out=tie)
        better |= np.logical_and(tie, np.less(new_work, old_work, out=less), out=tie)
    else:
        # Value is work: "below by 1e-9, or within it and of less work" is "less",
        # exactly (work is never negative).
        new_work = np.add(value_rows[source[1] + low][:, :width], extra, out=new_value)
        np.less(new_value, sliding_window_view(value, width)[targets], out=better)
    if cap.min() < high:  # the levels where it does not fit
        better &= np.arange(low, high) < cap
    taken = np.flatnonzero(better)
    if taken.size:
        # Step g at a level is entry taken = g * width + level - low.
        g, shift = taken // width, np.arange(len(base), dtype=np.int64) * width - low
        where = taken + (base[:, 0] - shift)[g]
        value[where] = new_value.reshape(-1)[taken]
        if work is not value:
            work[where] = new_work.reshape(-1)[taken]
        came_from[where] = (taken + source[0]) * _KINDS + (kind[:, 0] - shift * _KINDS)[g]


def _best(tables, window, limit, start, stop, nested) -> Optional[Solution]:
    """The best plan of ``[start, stop)`` in ``tables`` of ``window`` (from ``start``)."""
    value, work, came_from = (table[window] for table in tables)
    final = value[:, stop - start]
    if not np.isfinite(final).any():
        return None
    ties = np.flatnonzero(final <= np.min(final) * (1 + 1e-9))  # (state, h), in order
    state, h = divmod(int(ties[np.argmin(work[:, stop - start].take(ties))]), final.shape[1])
    result = float(final[state, h]) if limit is None else float(work[state, stop - start, h])
    spans, policies, c = [], [], stop - start
    while c > 0:
        cell, kind = divmod(int(came_from[state, c, h]), _KINDS)
        (a, state), h = divmod(cell // value.shape[2], 2), cell % value.shape[2]
        if kind:
            variant, followed = _decode(kind)
            a_, end = start + a, start + (c - 1 if followed else c)
            spans.append((a_, end, nested[(a_, end)][2] if variant == 1 else ()))
            policies.append(variant - 2 if variant >= 2 else NO_POLICY)
        c = a
    return Solution(result, tuple(reversed(spans)), tuple(reversed(policies)))


def nested_options(model: RegionModel, max_len: int = NESTED_MAX_LEN,
                   units: int = NESTED_UNITS) -> dict:
    """For each region ``[a, c)`` of at most ``max_len`` calls, the least peak of
    its replay when the replay checkpoints regions of its own (one level), as
    ``(need, extra work, inner spans)``; only where that is clearly below the flat
    need. Regions too short to hold a sub-region worth nesting are skipped, and a
    gain within the model's error is not offered (see docs/decisions/0016-nesting.md)."""
    options: dict = {}
    replay = model.in_replay()  # the sub-regions' plain calls run inside the replay
    unit = max(float(np.nanmax(np.where(np.isfinite(model.bwd_region), model.bwd_region, 0))),
               1.0) / units
    # The programs from every start run at once, and share the steps from each
    # cut (as far as any of them reaches; each takes those within its stop).
    steps = functools.cache(
        lambda a: steps_from(replay, None, a, min(model.n, a + max_len), model.n))
    starts = np.arange(model.n)
    stops = np.minimum(model.n, starts + max_len)
    tables = _tables(steps, None, starts, stops, units, unit)
    for a in range(model.n):
        for c in range(a + NESTED_MIN_LEN, int(stops[a]) + 1):
            flat = model.need(a, c, True)
            inner = _best(tables, a, None, a, c, None)
            if inner is None or not inner.spans:
                continue
            need = model.replay_need(a, c, inner.value)
            if need < flat * NESTED_NEED_RATIO:
                inner_work = sum(model.cost_prefix[e] - model.cost_prefix[s]
                                 for s, e, _ in inner.spans)
                options[(a, c)] = (need, inner_work, inner.spans)
    return options
