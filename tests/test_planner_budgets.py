"""student/planner/solve.py's budget errors and its searches for the smallest budget a plan meets, on
the hand-made cost tables of tests/test_planner.py (checked against every plan there)."""

from __future__ import annotations

import pytest

from student.offload.config import parse_bytes
from student.planner.peaks import peaks
from student.planner.solve import BudgetError, SolverSettings, predict, smallest_budget, solve
from test_planner import GiB, every_plan, random_table


def test_a_budget_no_plan_meets_names_the_option_and_the_smallest_that_works():
    costs = random_table(3, seed=11)
    least_gpu = min(predict(costs, p).gpu_peak_bytes for p in every_plan(3, (0,)))
    with pytest.raises(BudgetError) as caught:
        solve(costs, least_gpu - GiB // 4, 60 * GiB)
    error = caught.value
    assert error.field == "gpu_memory" and "\n" not in str(error)
    assert f"the smallest that can is {error.smallest_bytes / GiB:.1f} GiB" in str(error)
    assert least_gpu <= error.smallest_bytes <= least_gpu + GiB // 10 + 2**21
    assert parse_bytes(str(error).rsplit(" is ", 1)[1]) == error.smallest_bytes
    plan = solve(costs, error.smallest_bytes, 60 * GiB)  # the smallest budget itself is met
    assert plan.predicted.gpu_peak_bytes <= error.smallest_bytes

    least_host = min(predict(costs, p).host_peak_bytes for p in every_plan(3, (0,)))
    with pytest.raises(BudgetError, match="host_memory.*cannot hold") as caught:
        solve(costs, 100 * GiB, least_host - 1)
    assert least_host <= caught.value.smallest_bytes <= least_host + GiB // 10 + 2**21
    assert "loader" not in str(caught.value)  # a table without a loader's bytes
    solve(costs, 100 * GiB, caught.value.smallest_bytes)


def test_the_allocator_reserve_is_kept_beside_the_predicted_peak_not_in_it():
    """A GPU budget holds the plan's predicted peak (what max_memory_allocated measures) plus the
    table's gpu_reserve_bytes; the smallest budget a refusal names includes the reserve."""
    reserve = GiB // 2
    plain, reserved = random_table(3, seed=11), random_table(3, seed=11, gpu_reserve_bytes=reserve)
    least_gpu = min(predict(plain, p).gpu_peak_bytes for p in every_plan(3, (0,)))
    with pytest.raises(BudgetError) as caught:
        solve(reserved, least_gpu + reserve // 2, 60 * GiB)  # enough for the peak, not for the reserve beside it
    assert least_gpu + reserve <= caught.value.smallest_bytes <= least_gpu + reserve + GiB // 10 + 2**21
    plan = solve(reserved, caught.value.smallest_bytes, 60 * GiB)
    assert plan.predicted.gpu_peak_bytes + reserve <= caught.value.smallest_bytes
    assert plan.predicted == predict(plain, plan)  # the reserve is not in the prediction


def test_the_smallest_gpu_budget_respects_the_host_budget():
    # With little host memory nothing can be offloaded, so the least GPU peak is higher.
    costs = random_table(3, seed=12)
    _, free = smallest_budget(costs, "gpu", None)
    everything_on_host = costs.static_host_bytes + sum(x.host_bytes(costs.micro_batches) for x in costs.layers)
    plan, bounded = smallest_budget(costs, "gpu", everything_on_host + 2**24)
    assert bounded > free and all(lp.activation != "offload" for lp in plan.layers)


def test_a_budget_search_cut_short_still_names_a_budget_its_plan_meets():
    """settings.budget_search_s cuts the search for the smallest budget short: its answer is the
    best plan found by then (never None while one exists) and that plan's own peak, at least the least."""
    costs = random_table(4, seed=13)
    for which, other, peak_of in (("gpu", None, 0), ("host", 60 * GiB, 1)):
        least = smallest_budget(costs, which, other)[1]
        plan, named = smallest_budget(costs, which, other, settings=SolverSettings(budget_search_s=1e-9))
        assert plan is not None and named >= least
        assert named == peaks(costs, plan)[peak_of]
