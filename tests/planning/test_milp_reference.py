"""The region program against an exact reference: the same problem as a MILP.

``benchmarks/milp/regions_milp.py`` states the whole-model planner's problem
(the choice space and ``RegionModel`` tables of ``planning/solving/_regions.py``)
as a mixed-integer program solved by HiGHS. On small graphs (a chain of Dense
blocks, a residual CNN, a U-Net, with made-up costs and one save policy, regions
offered nested too) the dynamic program must find the MILP's optimum of its own
problem (held bytes rounded up to its units) exactly, its plans must fit the
MILP's constraints, and the exact-bytes optimum must lie between the program's
value at the budget and at the budget less one unit per step. The planner's
program (also rounded to the nearest unit, and checked) fits the exact problem,
at most the rounded-up program's work.
"""

import ast
from pathlib import Path

import numpy as np
import pytest

from benchmarks.milp import regions_milp as rm  # imports scipy only when it solves
from benchmarks.milp.synthetic import GRAPHS, _residual, region_model
from tf_checkpointing.planning._constants import REGION_UNITS
from tf_checkpointing.planning.solving import _region_solver
from tf_checkpointing.planning.solving._region_solver import nested_options, solve

SHARES = (0.15, 0.6)  # budgets from the least peak towards plain's


def _close(a, b):
    return a is not None and b is not None and np.isclose(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_the_program_finds_the_milp_optimum(graph):
    pytest.importorskip("scipy")  # the test and bench extras' (HiGHS, through scipy)
    model = region_model(GRAPHS[graph](), seed=1)
    nested = nested_options(model)
    problem = rm.region_problem(model, nested)
    least = solve(model, None, nested=nested)
    # The least peak: the program's (held rounded up to its units of plain's peak).
    plain = model.peak(())
    assert _close(rm.solve_milp(rm.rounded(problem, plain / REGION_UNITS), None).value,
                  least.value)
    assert rm.solve_milp(problem, None).value <= least.value * (1 + 1e-6)
    for share in SHARES:
        limit = least.value + share * (plain - least.value)
        unit = limit / REGION_UNITS
        found = solve(model, limit, nested=nested, nearest=False)
        assert found is not None, share
        # The program's own problem: the same optimum, and its plan fits the MILP's rows.
        assert _close(rm.solve_milp(rm.rounded(problem, unit), limit).value, found.value)
        steps = rm.steps_of(problem, found)
        assert rm.violation(problem, steps, limit) <= 1e-9 * limit
        assert np.isclose(problem.work @ steps, found.value)
        # Exact bytes: at most the program's work, and the program with one unit
        # per step more does at least as well.
        exact = rm.solve_milp(problem, limit).value
        assert exact <= found.value * (1 + 1e-6)
        tighter = rm.solve_milp(problem, limit - model.n * unit).value
        if tighter is not None:
            assert found.value <= tighter * (1 + 1e-6)
        # The planner's program (each step also rounded to the nearest unit, and
        # checked): within the limit, between the exact optimum and the rounded-up one.
        planned = solve(model, limit, nested=nested)
        assert model.peak(planned.spans, policies=planned.policies) <= limit * (1 + 1e-9)
        assert exact * (1 - 1e-6) <= planned.value <= found.value * (1 + 1e-6)
        assert np.isclose(model.extra_work(planned.spans, planned.policies), planned.value)


def test_a_long_graphs_plan_keeps_close_to_its_limit():
    """Rounding each of a plan's steps up adds up over a long graph (here 81 calls):
    that program's plan keeps 95% of the limit, and the planner's, rounded to the
    nearest and checked, keeps 99% and recomputes a quarter less (decision 0049)."""
    from benchmarks.milp.synthetic import _residual

    model = region_model(_residual(20), seed=3)
    nested = nested_options(model)
    least, plain = solve(model, None, nested=nested).value, model.peak(())
    limit = least + 0.9 * (plain - least)
    up = solve(model, limit, nested=nested, nearest=False)
    planned = solve(model, limit, nested=nested)
    assert model.peak(up.spans, policies=up.policies) < 0.96 * limit
    assert 0.99 * limit <= model.peak(planned.spans, policies=planned.policies) <= limit
    assert planned.value < 0.75 * up.value


def test_offering_a_policy_never_costs_replay(monkeypatch):
    """Rounded to the nearest unit, the program is not exact: on this 49-call
    graph, with two tries rounded to the nearest (before decision 0051; six
    find a plan here, but nothing promises they always do), offering a save
    policy lands it on a plan that replays 6% more than without one. With
    ``base_policies`` the plan without is a candidate too (decision 0050)."""
    monkeypatch.setattr(_region_solver, "_NEAREST_TRIES", 2)
    model = region_model(_residual(12), seed=22)
    nested = nested_options(model)
    least, plain = solve(model, None, nested=nested).value, model.peak(())
    limit = least + 0.9 * (plain - least)
    without = solve(model.with_policies(0), limit, nested=nested)
    offered = solve(model, limit, nested=nested)
    assert offered.value > 1.05 * without.value  # the program alone
    planned = solve(model, limit, nested=nested, base_policies=0)
    assert planned.value == without.value
    assert model.peak(planned.spans, policies=planned.policies) <= limit
    # At other limits too, the better of the two plans.
    for share in (0.1, 0.3, 0.5, 0.7):
        limit = least + share * (plain - least)
        both = [solve(model.with_policies(0), limit, nested=nested),
                solve(model, limit, nested=nested)]
        planned = solve(model, limit, nested=nested, base_policies=0)
        assert planned.value == min(plan.value for plan in both), share


@pytest.mark.parametrize("seed", range(4))
def test_the_bounded_program_finds_the_plans_of_the_unbounded_one(monkeypatch, seed):
    """Decision 0052: the program skips steps above a bound (a coarser program's
    least peak; a known plan's work), and finds the very plans it finds without
    one, ties included, at every limit from below the least to above plain, with
    and without the smaller choice of policies solved first. An infinite slack
    turns the bounds off."""
    model = region_model(_residual(10 + 3 * seed), seed=seed)
    nested = nested_options(model)
    least = solve(model, None, nested=nested).value
    limits = [least + f * (model.peak(()) - least) for f in np.linspace(-0.05, 1.05, 9)]

    def plans() -> list:
        return [solve(model, None, nested=nested)] + [
            solve(model, limit, nested=nested, base_policies=base)
            for limit in limits for base in (None, 0)]

    bounded = plans()
    monkeypatch.setattr(_region_solver, "_BOUND_SLACK", np.inf)
    assert plans() == bounded
    assert sum(plan is not None and bool(plan.spans) for plan in bounded) >= 10


def test_the_milp_plan_is_a_plan_of_the_program():
    pytest.importorskip("scipy")
    model = region_model(GRAPHS["residual"](), seed=0)
    problem = rm.region_problem(model)
    least = rm.solve_milp(problem, None)
    assert least.status == "optimal" and least.value <= solve(model, None).value * (1 + 1e-6)
    limit = (least.value + model.peak(())) / 2
    result = rm.solve_milp(problem, limit)
    assert result.status == "optimal" and result.solution.spans
    steps = rm.steps_of(problem, result.solution)  # decoded and encoded again
    assert rm.violation(problem, steps, limit) <= 1e-9 * limit
    assert np.isclose(problem.work @ steps, result.value)
    # The same plan, modelled by RegionModel itself, fits and costs the same.
    spans, policies = result.solution.spans, result.solution.policies
    assert model.peak(spans, policies=policies) <= limit * (1 + 1e-9)
    assert np.isclose(model.extra_work(spans, policies), result.value)
    # A budget no plan fits: HiGHS proves it.
    assert rm.solve_milp(problem, 0.99 * least.value).status == "infeasible"


def test_the_package_never_imports_scipy():
    # scipy is a test and benchmark extra (the MILP reference), not a dependency.
    package = Path(rm.__file__).resolve().parents[2] / "tf_checkpointing"
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "scipy" for n in names), path
