"""The region program's problem as a MILP: an exact reference for the dynamic program.

The whole-model planner chooses a sequence of regions of consecutive layer calls
(``tf_checkpointing.planning.solving._regions``) with a dynamic program over cut
positions and held memory units (``_region_solver.solve``). This module states the
same problem, over the same choice space and the same :class:`RegionModel` tables,
as a mixed-integer linear program solved by HiGHS (``scipy.optimize.milp``), so
that the program's optimum can be checked against an independent solver, with its
held bytes exact (no units) or rounded up to the program's units (the program's
own problem, which the two must solve to the same optimum).

The steps are the program's: from cut ``a``, one plain call ``a``; a
checkpointed region ``[a, c)`` replayed flat, with sub-regions (a ``nested``
option) or under a save policy, ending "after a region"; or the same region
followed by the plain call ``c``, one step whose need counts that call's held
bytes during the region's backward. A plain call may not follow a region
directly. A plan is a path of steps from cut 0 to cut ``n``:

    x_e in {0, 1}       step e is taken
    y_e >= 0            bytes held for the backward when step e starts (0 if not taken)
    flow:   sum_{e ends at c} x_e - sum_{e starts at c} x_e = -1 (c = 0), 1 (c = n), else 0
    held:   sum_{e ends at c} (y_e + held_e x_e) = sum_{e starts at c} y_e     (0 < c < n)
    fit:    y_e + max(need_e, held_e) x_e <= limit x_e  (held after e: the program's
            tables end at the limit)
    state:  x_{plain a} + sum_{region e without its plain call, ends at a} x_e <= 1
    minimise sum_e work_e x_e     (or, without a limit, the least peak P >= y_e + need_e x_e,
                                   with y_e <= bound x_e)

Held bytes carried per step (a single-commodity flow), not per cut, give a
tighter relaxation: a step's fit row scales with ``x_e``, so a fractional path
cannot average a full held sum with a small one (the first formulation, one
``H_c`` per cut, took seconds on graphs of 17 calls). Scipy is imported here
only: a benchmark and test extra, never a dependency of the package.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import NamedTuple, Optional

import numpy as np

from tf_checkpointing.planning.solving._region_solver import NO_POLICY, Solution
from tf_checkpointing.planning.solving._regions import RegionModel, pieces

__all__ = ["RegionProblem", "Result", "region_problem", "solve_milp"]

FLAT, NESTED = -2, -3  # a step's variant besides a policy index (>= 0); plain: None


@dataclasses.dataclass
class RegionProblem:
    """The steps of the program, as arrays (one entry per step)."""

    n: int
    start: np.ndarray
    end: np.ndarray
    need: np.ndarray
    held: np.ndarray
    work: np.ndarray
    variant: list  # None for a plain call, FLAT, NESTED or a policy index
    followed: np.ndarray  # a region stepped with the plain call after it
    inner: list  # a nested step's inner spans, else ()

    @property
    def size(self) -> int:
        return len(self.start)

    def index(self) -> dict:
        """``(start, end, variant, followed) -> step``: to find a plan's steps."""
        return {(int(a), int(c), v, bool(f)): e for e, (a, c, v, f) in enumerate(
            zip(self.start, self.end, self.variant, self.followed))}


class Result(NamedTuple):
    """What the MILP found: ``value`` is the work (with a limit) or the least
    peak (without), None where HiGHS proved no plan fits or found none in time."""

    value: Optional[float]
    solution: Optional[Solution]
    seconds: float
    status: str  # "optimal", "infeasible" or "time limit"
    gap: Optional[float]  # HiGHS' relative MIP gap at the end


def region_problem(model: RegionModel, nested: Optional[dict] = None) -> RegionProblem:
    """Every step of the program on ``model`` (with the ``nested`` options of
    ``_region_solver.nested_options``), from the model's public tables: a second
    reading of the choice space, not the program's own list of steps."""
    rows: list = []
    nested = nested or {}
    for a in range(model.n):
        rows.append((a, a + 1, model.need(a, a + 1, False), model.held(a, a + 1, False), 0.0,
                     None, False, ()))
        for c in range(a + 1, model.n + 1):
            live = model.held(a, c, True)
            variants = [(FLAT, model.need(a, c, True), live, model.work(a, c), ())]
            if (a, c) in nested:
                need, work, inner = nested[(a, c)]
                variants.append((NESTED, need, live, model.work(a, c) + work, inner))
            for p in range(model.num_policies):
                if model.policy_kept(a, c, p) > 0:  # else the same as a full replay
                    variants.append((p, model.need(a, c, True, p), model.held(a, c, True, p),
                                     model.work(a, c, p), ()))
            for variant, need, held, work, inner in variants:
                if not (np.isfinite(need) and np.isfinite(work)):
                    continue
                rows.append((a, c, need, held, work, variant, False, inner))
                if c < model.n:  # with the plain call c, held during the replay
                    rows.append((a, c + 1, max(need + model.plain_held[c],
                                               held + model.plain_need[c]),
                                 held + model.plain_held[c], work, variant, True, inner))
    start, end, need, held, work, variant, followed, inner = zip(*rows)
    problem = RegionProblem(model.n, np.array(start), np.array(end), np.array(need, float),
                            np.array(held, float), np.array(work, float), list(variant),
                            np.array(followed), list(inner))
    if problem.need.min() < 0:  # the need rows without big-M rely on it
        raise ValueError(f"a step needs {problem.need.min()} bytes; expected needs >= 0")
    return problem


def rounded(problem: RegionProblem, unit: float) -> RegionProblem:
    """The problem with each step's held bytes rounded up to ``unit`` s, as the
    program counts them (its ``ceil(held / unit - 1e-9)``)."""
    units = np.ceil(problem.held / unit - 1e-9)
    return dataclasses.replace(problem, held=units * unit)


def _matrices(problem: RegionProblem, limit: Optional[float], scale: float):
    """Objective, bounds and constraints over ``[x (steps), y (steps), P]``,
    bytes divided by ``scale``: ``y_e`` is what is held when step ``e`` starts
    (0 where it is not taken). Without a limit, P (the peak) is minimised."""
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import coo_matrix

    n, m = problem.n, problem.size
    steps, p = np.arange(m), 2 * m
    need, held = problem.need / scale, problem.held / scale
    entries: list = []  # (row, column, value) blocks
    lower: list = []
    upper: list = []

    def rows(count, low, high):  # the next ``count`` rows, from the first
        first = len(lower)
        lower.extend(np.broadcast_to(low, count))
        upper.extend(np.broadcast_to(high, count))
        return first

    def block(row, column, value):
        entries.append(tuple(np.broadcast_arrays(row, column, np.asarray(value, float))))

    # flow at cuts 0..n: in - out = -1 at 0, 1 at n, else 0
    flow = np.zeros(n + 1)
    flow[0], flow[n] = -1, 1
    at = rows(n + 1, flow, flow)
    block(at + problem.end, steps, 1.0)
    block(at + problem.start, steps, -1.0)
    # held at cuts 1..n-1: what enters with the steps ending there leaves with the next
    at = rows(n - 1, 0.0, 0.0) - 1
    inner = problem.end < n
    block(at + problem.end[inner], m + steps[inner], 1.0)
    block(at + problem.end[inner], steps[inner], held[inner])
    later = problem.start > 0
    block(at + problem.start[later], m + steps[later], -1.0)
    # per step: held before it plus its need (and held after it) within the limit
    # (or within the peak P; then y_e <= bound * x_e keeps y_e at 0 off the path)
    top = np.maximum(need, held)
    least_held = np.zeros(m)
    if limit is not None:
        least_held, top = _tightened(problem, need, held, limit / scale)
    if limit is None:
        bound = float(held[[v is None for v in problem.variant]].sum() + need.max())
        at = rows(m, -np.inf, 0.0)
        block(at + steps, m + steps, 1.0)
        block(at + steps, steps, top)
        block(at + steps, p, -1.0)
        at = rows(m, -np.inf, 0.0)
        block(at + steps, m + steps, 1.0)
        block(at + steps, steps, -bound)
    else:
        at = rows(m, -np.inf, 0.0)
        block(at + steps, m + steps, 1.0)
        block(at + steps, steps, top - limit / scale)
        at = rows(m, -np.inf, 0.0)  # y_e >= least_held_e x_e
        block(at + steps, m + steps, -1.0)
        block(at + steps, steps, least_held)
    # state at cuts 1..n-1: a plain call a may not follow a region ending at a
    at = rows(n - 1, -np.inf, 1.0) - 1
    plain = np.array([v is None for v in problem.variant])
    pick = plain & later
    block(at + problem.start[pick], steps[pick], 1.0)
    pick = ~plain & ~problem.followed & inner
    block(at + problem.end[pick], steps[pick], 1.0)
    r, c, v = (np.concatenate(part) for part in zip(*entries))
    matrix = coo_matrix((v, (r, c)), shape=(len(lower), 2 * m + 1)).tocsr()
    objective = np.zeros(2 * m + 1)
    if limit is None:
        objective[p] = 1.0
    else:
        objective[:m] = problem.work / max(problem.work.max(), 1e-12)
    # A step that cannot fit is never taken; none starting at cut 0 holds anything before.
    x_upper = np.where(least_held + top <= (np.inf if limit is None else limit / scale), 1.0, 0.0)
    y_upper = np.where(problem.start == 0, 0.0, np.inf)
    bounds = Bounds(np.zeros(2 * m + 1), np.concatenate([x_upper, y_upper, [np.inf]]))
    integrality = np.concatenate([np.ones(m), np.zeros(m + 1)])
    return objective, integrality, bounds, LinearConstraint(matrix, lower, upper)


def _tightened(problem: RegionProblem, need: np.ndarray, held: np.ndarray,
               limit: float) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the least any path holds when it starts, and what it needs on
    top of that to the end of any path after it: its own need and held bytes,
    and its held bytes plus the least need of the rest (two passes over the
    cuts, ignoring the state rows: bounds, valid for every plan, that the
    relaxation does not find by itself)."""
    n, top = problem.n, np.maximum(need, held)
    by_end = [np.flatnonzero(problem.end == c) for c in range(n + 1)]
    by_start = [np.flatnonzero(problem.start == c) for c in range(n + 1)]
    least = np.full(n + 1, np.inf)  # least held at each cut, over paths that fit so far
    least[0] = 0.0
    for c in range(1, n + 1):
        e = by_end[c]
        fits = least[problem.start[e]] + top[e] <= limit
        least[c] = np.min(least[problem.start[e]][fits] + held[e][fits], initial=np.inf)
    rest = np.full(n + 1, np.inf)  # least need, above what is held at a cut, of the rest
    rest[n] = 0.0
    for c in reversed(range(n)):
        e = by_start[c]
        rest[c] = np.min(np.maximum(top[e], held[e] + rest[problem.end[e]]), initial=np.inf)
    return least[problem.start], np.maximum(top, held + rest[problem.end])


def solve_milp(problem: RegionProblem, limit: Optional[float], *,
               time_limit: float = 600.0, gap: float = 1e-7) -> Result:
    """The least work of a plan whose modelled peak fits ``limit`` (bytes), or
    without a limit the least peak, solved by HiGHS within ``time_limit`` s."""
    from scipy.optimize import milp

    scale = limit if limit is not None else max(float(problem.need.max()), 1.0)
    objective, integrality, bounds, constraints = _matrices(problem, limit, scale)
    began = time.perf_counter()
    found = milp(objective, integrality=integrality, bounds=bounds, constraints=constraints,
                 options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False})
    seconds = time.perf_counter() - began
    status = {0: "optimal", 2: "infeasible"}.get(found.status, "time limit")
    if found.x is None:
        return Result(None, None, seconds, status, None)
    x = found.x[:problem.size] > 0.5
    solution = decode(problem, x)
    if limit is None:
        value = float(found.x[-1]) * scale
    else:
        value = float(problem.work[x].sum())
    return Result(value, solution._replace(value=value), seconds, status,
                  getattr(found, "mip_gap", None))


def decode(problem: RegionProblem, x: np.ndarray) -> Solution:
    """The plan (spans and policies) of the steps taken, ``x``."""
    spans, policies = [], []
    for e in sorted(np.flatnonzero(x), key=lambda e: problem.start[e]):
        variant = problem.variant[e]
        if variant is None:
            continue
        a, c = int(problem.start[e]), int(problem.end[e]) - int(problem.followed[e])
        spans.append((a, c, problem.inner[e] if variant == NESTED else ()))
        policies.append(variant if variant >= 0 else NO_POLICY)
    return Solution(math.nan, tuple(spans), tuple(policies))


def steps_of(problem: RegionProblem, solution: Solution) -> np.ndarray:
    """The steps (a 0/1 vector) of a plan of the program: its pieces, each
    region with the plain call after it as one step."""
    index, x = problem.index(), np.zeros(problem.size)
    cover = pieces(0, problem.n, solution.spans, solution.policies)
    k = 0
    while k < len(cover):
        a, c, checkpointed, inner, policy = cover[k]
        if not checkpointed:
            x[index[(a, c, None, False)]] = 1
            k += 1
            continue
        variant = policy if policy >= 0 else (NESTED if inner else FLAT)
        followed = k + 1 < len(cover) and not cover[k + 1][2]
        x[index[(a, c + followed, variant, followed)]] = 1
        k += 1 + followed
    return x


def violation(problem: RegionProblem, x: np.ndarray, limit: float) -> float:
    """How far (bytes) the steps ``x`` overshoot ``limit`` at their worst cut
    (<= 0: they fit), after checking they form a path from cut 0 to cut n."""
    taken = sorted(np.flatnonzero(x > 0.5), key=lambda e: problem.start[e])
    at, held, worst, after_region = 0, 0.0, -np.inf, False
    for e in taken:
        if problem.start[e] != at:
            raise ValueError(f"step {e} starts at cut {problem.start[e]}, the path is at {at}")
        if problem.variant[e] is None and after_region:
            raise ValueError(f"plain call {at} follows a region directly")
        worst = max(worst, held + problem.need[e] - limit)
        held += problem.held[e]
        at = int(problem.end[e])
        after_region = problem.variant[e] is not None and not problem.followed[e]
    if at != problem.n:
        raise ValueError(f"the path ends at cut {at}, not {problem.n}")
    return float(worst)
