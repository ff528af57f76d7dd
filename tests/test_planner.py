"""student/planner/solve.py: the cost model, the mixed-integer program against brute force on hand-made
cost tables (budget errors: tests/test_planner_budgets.py; `distill plan` itself: tests/test_plan_command.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from typing import NamedTuple

import pytest

from distill.configs import ConfigError
from student.offload.plan import LayerPlan, OffloadPlan
from student.planner.costs import embedding_on_host, pass_one_forwards, pass_one_s
from student.planner.peaks import gpu_peak_terms, in_turn
from student.planner.solve import (CHOICES, PHASES, BudgetError, CostTable, LayerCosts, SolverSettings, embedding_homes,
                                   fastest, predict, program_step_s, solve, solve_fixed)

GiB = 2**30
MS = 1e-3


def layer(**changes) -> LayerCosts:
    base = dict(forward_s=10 * MS, backward_s=20 * MS, weight_bytes=GiB, boundary_bytes=GiB // 8, keep_bytes=GiB,
                workspace_bytes=GiB // 8, master_bytes=2 * GiB, state_bytes=4 * GiB, update_gpu_s=2 * MS,
                update_cpu_s=40 * MS)
    return LayerCosts(**{**base, **changes})


def table(layers, **changes) -> CostTable:
    base = dict(layers=tuple(layers), h2d_bytes_per_s=50e9, d2h_bytes_per_s=40e9, static_gpu_bytes=2 * GiB,
                static_host_bytes=GiB, head_s=10 * MS, static_update_s=2 * MS, micro_batches=2)
    return CostTable(**{**base, **changes})


def random_table(num_layers: int, seed: int, **changes) -> CostTable:
    r = random.Random(seed)
    u = lambda lo, hi: r.uniform(lo, hi)
    return table([layer(forward_s=u(5, 20) * MS, backward_s=u(10, 40) * MS, weight_bytes=int(u(0.3, 1.0) * GiB),
                        boundary_bytes=int(u(0.05, 0.2) * GiB), keep_bytes=int(u(0.5, 2) * GiB),
                        master_bytes=int(u(0.6, 2) * GiB), state_bytes=int(u(1, 4) * GiB),
                        update_gpu_s=u(1, 5) * MS, update_cpu_s=u(5, 80) * MS) for _ in range(num_layers)],
                 **{"host_bytes_per_s": 30e9, **changes})


class _Plan(NamedTuple):
    """What `predict` reads of an OffloadPlan, without its checks (the brute force makes 10**4-10**5)."""

    layers: tuple
    prefetch_depth: int
    optimizer: str


def every_plan(num_layers: int, depths):
    layer_plans = [LayerPlan(*choice) for choice in CHOICES]
    for d, side in itertools.product(depths, ("cpu", "gpu")):
        for combo in itertools.product(layer_plans, repeat=num_layers):
            yield _Plan(layers=combo, prefetch_depth=d, optimizer=side)


def brute_force(costs: CostTable, gpu: int, host: int, depths) -> float | None:
    """The least predicted step time over every plan within the budgets (None: no plan fits)."""
    best = None
    for plan in every_plan(len(costs.layers), depths):
        p = predict(costs, plan)
        if p.gpu_peak_bytes <= gpu and p.host_peak_bytes <= host and (best is None or p.step_s < best):
            best = p.step_s
    return best


# --- the cost model -----------------------------------------------------------------------------


def test_predict_adds_recompute_and_exposed_copies_as_its_docstring_says():
    # Copies of nothing cost nothing: all kept and resident, the step is compute plus the CPU update tail.
    fast = dict(h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30, micro_batches=1, static_update_s=0.0)
    costs = table([layer(), layer()], **fast)
    kept = OffloadPlan.uniform(2, "keep", "resident", optimizer="cpu")
    compute = 2 * (10 + 20) * MS + 10 * MS
    # The CPU updates the layers one after the other once every gradient is out.
    assert predict(costs, kept).step_s == pytest.approx(compute + 2 * 40 * MS)
    # Recompute runs each layer's forward again before its backward.
    recomputed = OffloadPlan.uniform(2, "recompute", "resident", optimizer="gpu")
    assert predict(costs, recomputed).step_s == pytest.approx(compute + 2 * 10 * MS + 2 * 2 * MS)
    # Streamed weights with no lookahead: layer 0's forward waits for its copy (1 GiB at 1 GiB/s).
    slow = table([layer(), layer()], h2d_bytes_per_s=GiB, d2h_bytes_per_s=1e30, micro_batches=1, static_update_s=0.0)
    first = OffloadPlan(layers=(LayerPlan("keep", "stream"), LayerPlan("keep", "resident")), prefetch_depth=0,
                        optimizer="gpu")
    base = OffloadPlan.uniform(2, "keep", "resident", prefetch_depth=0, optimizer="gpu")
    assert predict(slow, first).step_s > predict(slow, base).step_s + 0.99
    assert predict(slow, first).layer_s[0] == pytest.approx(predict(slow, base).layer_s[0] + 1.0)


def test_predict_peaks_count_what_each_decision_holds():
    costs = table([layer(), layer(), layer(), layer()])
    kept = predict(costs, OffloadPlan.uniform(4, "keep", "resident", prefetch_depth=1))
    recomputed = predict(costs, OffloadPlan.uniform(4, "recompute", "resident", prefetch_depth=1))
    offloaded = predict(costs, OffloadPlan.uniform(4, "offload", "resident", prefetch_depth=1))
    streamed = predict(costs, OffloadPlan.uniform(4, "recompute", "stream", prefetch_depth=1))
    # Kept: 4 layers' saved activations beside their inputs; but the backward recomputes none (1
    # GiB, in the top layer's backward, the largest of what the turnaround holds one after the other).
    assert kept.gpu_peak_bytes - recomputed.gpu_peak_bytes == 4 * GiB - GiB
    assert recomputed.gpu_peak_bytes - offloaded.gpu_peak_bytes == 4 * (GiB // 8) - 2 * 2 * (GiB // 8)
    assert offloaded.host_peak_bytes - recomputed.host_peak_bytes == 4 * (GiB // 8)
    assert recomputed.gpu_peak_bytes - streamed.gpu_peak_bytes == 4 * GiB - 2 * GiB  # a ring of depth + 1 layers
    assert kept.host_peak_bytes == GiB + 4 * (2 * 2 + 4 + 1) * GiB  # master, grads, states, weight copy


def test_the_gpu_peaks_terms_name_what_each_decision_holds_and_the_larger_sum_is_the_peak():
    from student.planner.peaks import gpu_peak_terms

    costs = table([layer(), layer(), layer(), layer()], loss_workspace_bytes=20 * GiB)
    plan = OffloadPlan((LayerPlan("keep", "resident", "gpu"), LayerPlan("offload", "stream", "host"),
                        LayerPlan("recompute", "stream", "host"), LayerPlan("recompute", "resident", "host")),
                       prefetch_depth=1, optimizer="gpu")
    terms = gpu_peak_terms(costs, plan)
    turnaround, update = terms["turnaround"], terms["optimizer_phase"]
    assert turnaround["weights_held"] == 2 * GiB and turnaround["weights_streamed"] == 2 * GiB
    assert turnaround["activations"] == GiB + 3 * (GiB // 8) and turnaround["activations_in_flight"] == 2 * 2 * (GiB // 8)
    assert turnaround["head_workspace"] == 20 * GiB + GiB // 8  # and its input; larger than a layer's backward here
    assert update["weights_resident"] == 2 * GiB
    assert max(sum(turnaround.values()), sum(update.values())) == predict(costs, plan).gpu_peak_bytes
    for seed in range(20):  # the sums are the peak for any plan
        costs = random_table(3, seed, loss_workspace_bytes=(seed % 3) * 4 * GiB, late_grad_bytes=(seed % 2) * GiB)
        for plan in itertools.islice(every_plan(3, (0, 2)), seed, None, 97):
            sums = [sum(t.values()) for t in gpu_peak_terms(costs, plan).values()]
            assert max(sums) == predict(costs, plan).gpu_peak_bytes


def test_the_heads_workspace_and_a_layers_backward_are_not_held_at_once():
    """The head's workspace is freed before the layers' backward starts: the GPU peak holds the
    larger of it and a layer's backward transients, and the program prices the same peak."""
    plan = OffloadPlan.uniform(3, "recompute", "stream", prefetch_depth=1, optimizer="gpu")
    without = predict(table([layer()] * 3), plan).gpu_peak_bytes
    # A layer's backward at depth 1, two micro-batches: 4 fp32 accumulators in flight, one
    # compute-dtype gradient, its workspace and saved activations.
    transient = 2 * 2 * (2 * GiB) + GiB + GiB // 8 + GiB
    # The head's workspace is beside its input (the last layer's output, GiB // 8).
    for loss_ws, more in ((GiB, 0), (transient - GiB // 8, 0), (transient + 3 * GiB, 3 * GiB + GiB // 8)):
        costs = table([layer()] * 3, loss_workspace_bytes=loss_ws)
        assert predict(costs, plan).gpu_peak_bytes == without + more
    for seed, gpu_gib in ((0, 13.0), (1, 17.0), (2, 15.5)):  # budgets where the head's workspace binds
        costs = random_table(3, seed, loss_workspace_bytes=9 * GiB, late_grad_bytes=(seed % 2) * GiB)
        best = brute_force(costs, int(gpu_gib * GiB), 60 * GiB, (0, 1))
        found = solve(costs, int(gpu_gib * GiB), 60 * GiB, settings=SolverSettings(depths=(0, 1)))
        assert best is not None and found.predicted.step_s == pytest.approx(best, rel=1e-6)


def test_at_one_backward_the_input_embeddings_gradient_is_not_held_during_the_layers_backward():
    """The input embedding's gradient is made after the last layer's backward: at one backward a
    step its .grad (in the static bytes) is held instead of that layer's workspace and recomputed
    activations, not beside them; with several backwards a step the .grad stays from the first and
    the new gradient is made beside it."""
    plan = OffloadPlan.uniform(3, "recompute", "stream", prefetch_depth=1, optimizer="gpu")
    layer_part = GiB + GiB // 8  # a layer's workspace and recomputed activations
    for micro_batches, late, less in ((1, GiB, GiB), (1, 20 * GiB, layer_part), (2, GiB, 0),
                                      (2, 20 * GiB, layer_part - 20 * GiB)):
        base = predict(table([layer()] * 3, micro_batches=micro_batches), plan).gpu_peak_bytes
        costs = table([layer()] * 3, micro_batches=micro_batches, late_grad_bytes=late)
        assert predict(costs, plan).gpu_peak_bytes == base - less


def test_a_tied_heads_gradient_is_held_through_the_layers_backward():
    """A tied head's gradient waits for the input embedding's (`held_grad_bytes`): it adds to a
    layer's backward and to the moment the embedding's gradient is made, not to the head's
    workspace; the program prices the same peak (brute force at budgets where it binds)."""
    plan = OffloadPlan.uniform(3, "recompute", "stream", prefetch_depth=1, optimizer="gpu")
    for micro_batches in (1, 2):
        untied = table([layer()] * 3, micro_batches=micro_batches, late_grad_bytes=GiB)
        tied = dataclasses.replace(untied, held_grad_bytes=GiB)
        assert predict(tied, plan).gpu_peak_bytes - predict(untied, plan).gpu_peak_bytes == GiB
        huge_head = dataclasses.replace(untied, loss_workspace_bytes=40 * GiB)
        assert predict(dataclasses.replace(huge_head, held_grad_bytes=GiB), plan).gpu_peak_bytes == \
            predict(huge_head, plan).gpu_peak_bytes
    for seed, gpu_gib in ((3, 13.0), (4, 15.5)):
        costs = random_table(3, seed, late_grad_bytes=GiB, held_grad_bytes=2 * GiB)
        best = brute_force(costs, int(gpu_gib * GiB), 60 * GiB, (0, 1))
        found = solve(costs, int(gpu_gib * GiB), 60 * GiB, settings=SolverSettings(depths=(0, 1)))
        assert best is not None and found.predicted.step_s == pytest.approx(best, rel=1e-6)


def test_autograd_adds_a_tied_heads_gradient_only_after_every_layers_backward():
    """What `held_grad_bytes` rests on, on the Student itself: a tied embedding's gradient reaches
    the parameter once, after the first layer's backward, so the head's part waited for it; the
    profile counts it for a tied student and not for an untied one."""
    import torch

    from student.config import StudentConfig
    from student.model import Student
    from student.planner.profile import _grad_bytes_of_embedding

    for tied in (True, False):
        config = StudentConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                               num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=tied)
        torch.manual_seed(0)
        model = Student(config)
        order = []
        model.embed_tokens.weight.register_hook(lambda g: order.append("embedding"))
        def after_layer_0(module, args):  # its input's gradient: layer 0's backward is done
            args[0].register_hook(lambda g: order.append("layer 0"))

        model.layers[0].register_forward_pre_hook(after_layer_0)
        hidden = model(torch.randint(0, 64, (1, 12)))
        head = model.embed_tokens.weight if tied else model.lm_head.weight
        (hidden @ head.T).logsumexp(-1).sum().backward()
        assert order == ["layer 0", "embedding"]
        size = 64 * 16 * 4
        assert _grad_bytes_of_embedding(model) == (size, size if tied else 0)


def test_on_a_gpu_an_offloaded_input_holds_the_power_of_two_torchs_pinned_allocator_gives_it():
    """pinned_blocks (a GPU's table): an offloaded layer input of GiB + 1 bytes holds 2 GiB of host
    memory, in predict's host peak and in the program's host budget alike (its optimum is brute
    force's, rounded or not); under this host budget the rounding leaves no plan that fits."""
    odd = [layer(boundary_bytes=GiB + 1, forward_s=100 * MS, keep_bytes=6 * GiB) for _ in range(4)]
    fast = dict(d2h_bytes_per_s=400e9, h2d_bytes_per_s=400e9)
    exact, pinned = table(odd, **fast), table(odd, pinned_blocks=True, **fast)
    offload = OffloadPlan.uniform(4, "offload", "resident", prefetch_depth=0)
    assert predict(pinned, offload).host_peak_bytes - predict(exact, offload).host_peak_bytes == 4 * (GiB - 1)
    gpu, settings = 53 * GiB, SolverSettings(depths=(0,))
    for costs, host in ((exact, 6 * GiB), (pinned, 9 * GiB)):
        plan = solve(costs, gpu, host, settings=settings)
        assert plan.predicted.step_s == pytest.approx(brute_force(costs, gpu, host, (0,)), rel=1e-6)
    assert brute_force(pinned, gpu, 6 * GiB, (0,)) is None
    with pytest.raises(BudgetError):
        solve(pinned, gpu, 6 * GiB, settings=settings)


def test_predict_phases_add_up_and_charge_the_hosts_passes_over_gradients():
    """The phases sum to the step; clipping takes no time (its norms were taken on the device); the
    update on the CPU scales each host gradient first, a pass over its fp32 bytes at the host's
    rate; with micro-batches the accumulators come in before the backward adds to them; a layer
    whose states are on the GPU sends no gradient out, holds its master, gradient and states on
    the GPU and nothing on the host."""
    fast = dict(h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30, micro_batches=1, static_update_s=0.0)
    kept = OffloadPlan.uniform(2, "keep", "resident", optimizer="cpu")
    base = predict(table([layer(), layer()], **fast), kept)
    slow_host = predict(table([layer(), layer()], host_bytes_per_s=GiB, **fast), kept)
    # One micro-batch: the CPU update reads each layer's 1 GiB bf16 gradient and writes it widened
    # to 2 GiB of fp32 (scaled by the clip coefficient in the same pass); with two, it reads and
    # writes the 2 GiB fp32 sums.
    assert slow_host.step_s == pytest.approx(base.step_s + 2 * (1.0 + 2.0))
    assert slow_host.phase_s["optimizer"] == pytest.approx(base.phase_s["optimizer"] + 6.0)
    accumulated = {**fast, "micro_batches": 2}
    base2 = predict(table([layer(), layer()], **accumulated), kept)
    slow2 = predict(table([layer(), layer()], host_bytes_per_s=GiB, **accumulated), kept)
    assert slow2.phase_s["optimizer"] == pytest.approx(base2.phase_s["optimizer"] + 2 * 2 * 2.0)
    assert slow_host.phase_s["clip"] == 0.0 and base.phase_s["clip"] == 0.0
    # Two micro-batches, 2 GiB accumulators in at 1 GiB/s: the backward of each layer waits for its own.
    slow_in = {**fast, "h2d_bytes_per_s": GiB}
    one = predict(table([layer(), layer()], **slow_in), kept)
    two = predict(table([layer(), layer()], **{**slow_in, "micro_batches": 2}), kept)
    assert one.phase_s["backward"] == pytest.approx(2 * 20 * MS)
    assert two.phase_s["backward"] == pytest.approx(2 * (2 * 2.0 + 20 * MS - 10 * MS))
    for costs in (table([layer(), layer()]), table([layer(), layer()], host_bytes_per_s=5e9, micro_batches=3)):
        for plan in every_plan(2, (0, 1)):
            p = predict(costs, plan)
            assert set(p.phase_s) == set(PHASES) and sum(p.phase_s.values()) == pytest.approx(p.step_s), plan
            assert min(p.phase_s.values()) >= -1e-12

    costs = table([layer(), layer()], d2h_bytes_per_s=GiB, **{k: v for k, v in fast.items() if k != "d2h_bytes_per_s"})
    host = OffloadPlan.uniform(2, "keep", "resident", optimizer="gpu")
    gpu = OffloadPlan(layers=(LayerPlan("keep", "resident", "gpu"), LayerPlan("keep", "resident")), optimizer="gpu")
    h, g = predict(costs, host), predict(costs, gpu)
    assert h.host_peak_bytes - g.host_peak_bytes == (2 + 1 + 4 + 1) * GiB  # master, bf16 gradient, states, staging
    assert g.gpu_peak_bytes - h.gpu_peak_bytes <= (2 * 2 + 4) * GiB  # (the optimizer's slices were already there)
    # No bf16 gradient of 1 GiB out at 1 GiB/s (the last layer's, which the step waits for; one
    # micro-batch): the layer updates where it is. The update slices' copies out (master, states,
    # staging) overlap the next step here (no layer streams its weights).
    assert h.step_s - g.step_s == pytest.approx(1.0, rel=1e-6)


def test_the_update_on_the_gpu_loads_its_first_slots_in_the_backward_and_pipelines_the_rest():
    """Four host layers, 1 GiB masters, no states, copies in at 1 GiB/s, copies out free, no update
    time: the top two layers' masters come in during the backward (their gradients are on the
    device); the next two bring master and gradient (1 GiB and, one micro-batch a step, its 0.5 GiB
    bf16 gradient) once the backward is through, one after the other."""
    ring = table([layer(master_bytes=GiB, state_bytes=0, weight_bytes=GiB // 2, update_gpu_s=0.0) for _ in range(4)],
                 h2d_bytes_per_s=GiB, d2h_bytes_per_s=1e30, micro_batches=1, static_update_s=0.0)
    plan = OffloadPlan.uniform(4, "keep", "resident", optimizer="gpu")
    p = predict(ring, plan)
    # Loads end 1, 2, 3.5 and 5 s after the top layer's backward; three layers' backwards (20 ms) come after it.
    assert p.phase_s["optimizer"] == pytest.approx(5.0 - 3 * 20 * MS)
    assert program_step_s(ring, plan) == pytest.approx(p.step_s, rel=1e-9)
    # Slow copies out: a streamed bottom layer's next forward waits for its write-back (master and
    # staging copy, 1.5 GiB at 1 GiB/s after its update) and its weights' copy in (0.5 GiB).
    slow_out = dataclasses.replace(ring, d2h_bytes_per_s=GiB)
    resident, streamed = plan, OffloadPlan(layers=(LayerPlan("keep", "stream"), *plan.layers[1:]), optimizer="gpu")
    r, s = predict(slow_out, resident), predict(slow_out, streamed)
    assert r.phase_s["refresh"] == 0.0 and s.phase_s["refresh"] == pytest.approx(1.5 + 0.5)
    assert s.step_s - r.step_s == pytest.approx(0.5 + 2.0)  # (and its weights' copy in this step's forward)
    assert s.step_s == pytest.approx(program_step_s(slow_out, streamed), rel=1e-9)


def test_copies_both_ways_at_once_take_the_duplex_rate_where_both_directions_are_busy():
    """The forward of six streamed, offloaded layers, prefetch depth 0, no compute: layer i's 1 GiB
    of weights come in while layer i-1's 0.5 GiB input goes out, at 1 GiB/s each way alone. At
    0.75 GiB/s each way both at once (predict's bus), a copy in with 0.5 GiB going out beside it
    takes 1 + 0.5 (1 - 0.75) / 0.75 s: the overlapped part at 0.75, the rest at 1; the bus counts
    the inputs out of layers up to i-2 before layer i's weights are in, so 6 + 4/6 s in all, where
    the two directions independent take 6 s. Duplex rates equal to the rates alone change nothing."""
    alone = table([layer(forward_s=0.0, weight_bytes=GiB, boundary_bytes=GiB // 2) for _ in range(6)],
                  h2d_bytes_per_s=GiB, d2h_bytes_per_s=GiB, micro_batches=1)
    duplex = dataclasses.replace(alone, h2d_duplex_bytes_per_s=0.75 * GiB, d2h_duplex_bytes_per_s=0.75 * GiB)
    equal = dataclasses.replace(alone, h2d_duplex_bytes_per_s=GiB, d2h_duplex_bytes_per_s=GiB)
    plan = OffloadPlan.uniform(6, "offload", "stream", prefetch_depth=0, optimizer="cpu")
    assert predict(alone, plan).phase_s["forward"] == pytest.approx(6.0)
    assert predict(duplex, plan).phase_s["forward"] == pytest.approx(6.0 + 4 / 6)
    assert predict(equal, plan) == predict(alone, plan)
    assert program_step_s(duplex, plan) == pytest.approx(predict(duplex, plan).step_s, rel=1e-9)

    # The update's ring: loads in and copies out busy together after the backward; the slower the
    # bus both ways, the longer the update (row offload/llama-3.1-8b-T8192-gpu40GiB/planned@6a52d40).
    ring = table([layer(state_bytes=GiB, update_gpu_s=0.0) for _ in range(8)], h2d_bytes_per_s=GiB,
                 d2h_bytes_per_s=GiB, micro_batches=1, static_update_s=0.0)
    plan = OffloadPlan.uniform(8, "keep", "resident", optimizer="gpu")
    updates = [predict(dataclasses.replace(ring, h2d_duplex_bytes_per_s=rate, d2h_duplex_bytes_per_s=rate), plan)
               for rate in (None, GiB, 0.8 * GiB, 0.6 * GiB)]
    assert updates[0] == updates[1]
    optimizer = [p.phase_s["optimizer"] for p in updates]
    assert optimizer[1] < optimizer[2] < optimizer[3]
    assert updates[1].step_s < updates[2].step_s < updates[3].step_s


def test_the_program_encodes_predicts_bus_for_any_plan():
    """As test_the_program_encodes_predict_for_any_plan, with duplex rates below the rates alone
    (down to taking turns and below it), and the solver's optimum is predict's of its plan."""
    r = random.Random(11)
    for trial in range(16):
        h2d, d2h = r.choice([5e9, 50e9]), r.choice([3e9, 40e9])
        costs = random_table(4, seed=trial, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, micro_batches=r.choice([1, 3]),
                             host_bytes_per_s=r.choice([2e9, 30e9]), h2d_duplex_bytes_per_s=h2d * r.choice([0.3, 0.6, 1.0]),
                             d2h_duplex_bytes_per_s=d2h * r.choice([0.3, 0.6, 0.9]))
        plan = OffloadPlan(layers=tuple(LayerPlan(*r.choice(CHOICES)) for _ in range(4)),
                           prefetch_depth=r.choice([0, 1, 2, 3]), optimizer=r.choice(["cpu", "gpu"]))
        assert program_step_s(costs, plan) == pytest.approx(predict(costs, plan).step_s, rel=1e-7), plan
    costs = random_table(4, 3, h2d_bytes_per_s=5e9, d2h_bytes_per_s=3e9, h2d_duplex_bytes_per_s=3e9,
                         d2h_duplex_bytes_per_s=2e9)
    for side in ("cpu", "gpu"):
        found = solve_fixed(costs, 40 * GiB, 60 * GiB, depth=1, optimizer=side)
        assert found is not None and found.optimal
        assert found.step_s == pytest.approx(predict(costs, found.plan).step_s, rel=1e-7)


def test_the_profiles_duplex_rates_undo_the_later_copys_part_alone():
    """step_profile._duplex_rates on the times of two copies of n bytes each way started together,
    as the bus runs them: both at their duplex rates until the first ends, the other then alone."""
    from student.planner.profile import _duplex_rates

    n, alone, duplex = 64 * 2**20, (54e9, 55e9), (30e9, 38e9)
    t_out = n / duplex[1]  # the copy out ends first
    t_in = t_out + (n - duplex[0] * t_out) / alone[0]
    assert _duplex_rates(n, t_in, t_out, *alone) == pytest.approx(duplex, rel=1e-12)
    assert _duplex_rates(n, t_out, t_in, alone[1], alone[0]) == pytest.approx(duplex[::-1], rel=1e-12)


def test_states_on_the_gpu_take_the_room_recomputing_frees():
    """Under a budget that holds every layer kept with its states on the host, a slow CPU and
    costly slices: recomputing some layers makes room for a layer's states on the GPU, faster."""
    costs = random_table(5, seed=7)
    costs = table([dataclasses.replace(x, update_cpu_s=1.0) for x in costs.layers])
    kept = predict(costs, OffloadPlan.uniform(5, "keep", "resident", prefetch_depth=0, optimizer="gpu"))
    plan = solve(costs, kept.gpu_peak_bytes, 1000 * GiB, settings=SolverSettings(depths=(0,)))
    assert any(lp.states == "gpu" for lp in plan.layers) and any(lp.activation == "recompute" for lp in plan.layers)
    assert plan.predicted.step_s < kept.step_s and plan.predicted.gpu_peak_bytes <= kept.gpu_peak_bytes


# --- the program --------------------------------------------------------------------------------


# Budgets: tight ones sit about as far above the least peak as they did before two micro-batches
# held (d+1) accumulators more (the first three were 8.5, 11, 40; then 10, 13, 12).
@pytest.mark.parametrize("num_layers, seed, gpu_gib, depths", [
    (3, 0, 10.1, (0, 1, 2, 3)), (3, 1, 12.3, (0, 1, 2, 3)), (3, 2, 40, (0, 1, 2, 3)),
    (4, 3, 11.5, (0, 2)), (4, 4, 16.9, (1,)),
    pytest.param(5, 5, 15.8, (1,), marks=pytest.mark.slow),  # 9**5 plans on each side
])
def test_the_program_finds_the_brute_force_optimum(num_layers, seed, gpu_gib, depths):
    costs = random_table(num_layers, seed)
    gpu, host = int(gpu_gib * GiB), 60 * GiB
    best = brute_force(costs, gpu, host, depths)
    assert best is not None, "the case must be feasible"
    plan = solve(costs, gpu, host, settings=SolverSettings(depths=depths))
    assert plan.predicted == predict(costs, plan)
    assert plan.predicted.step_s == pytest.approx(best, rel=1e-6)
    assert plan.predicted.gpu_peak_bytes <= gpu and plan.predicted.host_peak_bytes <= host
    assert (plan.gpu_memory, plan.host_memory) == (gpu, host)


@pytest.mark.parametrize("depth, side", [(0, "cpu"), (1, "gpu"), (2, "cpu"), (3, "gpu")])
def test_the_programs_optimum_is_predicts_step_time_of_its_plan(depth, side):
    for seed in range(3):
        costs = random_table(4, seed, micro_batches=1 + seed)
        found = solve_fixed(costs, 40 * GiB, 60 * GiB, depth=depth, optimizer=side)  # (depth 3 on the GPU needs > 35)
        assert found is not None and found.optimal
        assert (found.plan.prefetch_depth, found.plan.optimizer) == (depth, side)
        assert found.step_s == pytest.approx(predict(costs, found.plan).step_s, rel=1e-7)


def test_the_program_encodes_predict_for_any_plan():
    """Every decision, depth and side: the program with its binaries fixed to a plan gives that
    plan's predicted step time (slow copies, so that every wait of the model binds somewhere)."""
    r = random.Random(5)
    for trial in range(24):
        costs = random_table(4, seed=trial, h2d_bytes_per_s=r.choice([5e9, 50e9]), d2h_bytes_per_s=r.choice([3e9, 40e9]),
                             micro_batches=r.choice([1, 3]), host_bytes_per_s=r.choice([2e9, 30e9]))
        plan = OffloadPlan(layers=tuple(LayerPlan(*r.choice(CHOICES)) for _ in range(4)),
                           prefetch_depth=r.choice([0, 1, 2, 3]), optimizer=r.choice(["cpu", "gpu"]))
        assert program_step_s(costs, plan) == pytest.approx(predict(costs, plan).step_s, rel=1e-7), plan


def test_plenty_of_memory_keeps_everything_on_the_gpu():
    """With room for every layer's states, nothing goes to the host; with room for the working
    weights and kept activations (every layer's states on the host) and a slow CPU, the update runs
    on the GPU, where resident weights are updated in place. (With the update on the CPU,
    streaming the last layers saves refreshing them after it: see the next test.)"""
    costs = random_table(5, seed=7)
    costs = table([dataclasses.replace(x, update_cpu_s=1.0) for x in costs.layers])
    plan = solve(costs, 1000 * GiB, 1000 * GiB)
    assert all(lp == LayerPlan("keep", "resident", "gpu") for lp in plan.layers)
    assert plan.predicted.host_peak_bytes == costs.static_host_bytes
    plan = solve(costs, 1000 * GiB, 1000 * GiB, settings=SolverSettings(states=("host",)))
    assert plan.optimizer == "gpu" and all(lp == LayerPlan("keep", "resident") for lp in plan.layers)


def test_with_the_update_on_the_cpu_the_last_layers_stream_instead_of_a_refresh():
    costs = table([layer(update_cpu_s=10 * MS, forward_s=20 * MS) for _ in range(4)], h2d_bytes_per_s=100e9)
    plan = solve(costs, 1000 * GiB, 1000 * GiB, settings=SolverSettings(depths=(1,), states=("host",)))
    assert plan.optimizer == "cpu" and all(lp.activation == "keep" for lp in plan.layers)
    assert plan.layers[-1].params == "stream" and plan.layers[0].params == "resident"


def test_a_tight_budget_recomputes_the_cheap_layer_then_offloads_then_streams():
    # Layer 2 saves much for its backward and recomputes cheaply: the first to give up "keep".
    # The update on the GPU (a slow CPU; small slices), where resident weights cost no refresh; fast
    # gradient copies. Every layer's states on the host (on the GPU they would take the room that
    # recomputing frees: the test after the next one).
    host = SolverSettings(states=("host",))
    slow_cpu = dict(update_cpu_s=1.0, master_bytes=GiB // 2, state_bytes=GiB)
    costs = table([layer(**slow_cpu), layer(**slow_cpu), layer(keep_bytes=6 * GiB, forward_s=1 * MS, **slow_cpu),
                   layer(**slow_cpu)], d2h_bytes_per_s=1e12)
    everything = predict(costs, OffloadPlan.uniform(4, "keep", "resident", prefetch_depth=0,
                                                     optimizer="gpu")).gpu_peak_bytes
    # Its backward makes its 6 GiB again, beside layers 0 and 1's kept activations: 7/8 GiB less.
    # (At depth 0: a deeper prefetch, faster here, would need more room.)
    plan = solve(costs, everything - GiB // 2, 100 * GiB, settings=dataclasses.replace(host, depths=(0,)))
    assert [lp.activation for lp in plan.layers] == ["keep", "keep", "recompute", "keep"]
    assert all(lp.params == "resident" for lp in plan.layers)

    # Below every layer recomputed with its input on the GPU, by more than streaming every layer's
    # (small) weights saves, some input must go to the host.
    light = table([layer(weight_bytes=GiB // 16, boundary_bytes=GiB // 4) for _ in range(4)])
    recomputed = predict(light, OffloadPlan.uniform(4, "recompute", "resident", prefetch_depth=0)).gpu_peak_bytes
    budget = recomputed - 3 * GiB // 16 - 1
    plan = solve(light, budget, 100 * GiB, settings=host)
    assert any(lp.activation == "offload" for lp in plan.layers)
    assert plan.predicted.gpu_peak_bytes <= budget

    # Below every layer's weights resident, some must stream.
    many = table([layer(boundary_bytes=GiB // 64) for _ in range(6)])
    resident = predict(many, OffloadPlan.uniform(6, "offload", "resident", prefetch_depth=0)).gpu_peak_bytes
    plan = solve(many, resident - 1, 100 * GiB, settings=host)
    assert any(lp.params == "stream" for lp in plan.layers)
    assert plan.predicted.gpu_peak_bytes <= resident - 1


def test_pass_one_waits_for_streamed_weights_from_empty_queues_each_forward():
    """Chunk-recurrent pass 1 (`pass_one_s`): resident weights give pass1_s as measured; streamed
    ones are waited for as the forward waits for them, each of its forwards starting from empty
    queues, the layer's seconds pass1_s spread evenly; the program encodes it for every plan."""
    costs = random_table(3, seed=8, micro_batches=8, chunks=4, pass1_s=0.6, h2d_bytes_per_s=20e9)  # 2 x 3 forwards
    resident = OffloadPlan.uniform(3, "recompute", prefetch_depth=0)
    assert pass_one_s(costs, resident) == 0.6 and pass_one_forwards(costs) == 6
    streamed = OffloadPlan.uniform(3, "recompute", "stream", prefetch_depth=0)
    f, w = 0.6 / 18, [x.weight_bytes / 20e9 for x in costs.layers]
    # depth 0: a layer's weights come in once the previous layer's forward ends, and it waits for them
    one = w[0] + f + w[1] + f + w[2] + f
    assert pass_one_s(costs, streamed) == pytest.approx(6 * one)
    unmeasured = dataclasses.replace(costs, pass1_s=0.0)  # pass 1 then waits for the weights alone
    assert pass_one_s(unmeasured, streamed) == pytest.approx(6 * sum(w))
    assert predict(costs, streamed).step_s - predict(unmeasured, streamed).step_s == pytest.approx(6 * one - 6 * sum(w))
    r = random.Random(9)
    for trial in range(12):
        chunks = r.choice([2, 4])
        chunked = random_table(3, seed=trial, chunks=chunks, micro_batches=chunks * r.choice([1, 2]),
                               pass1_s=r.choice([0.05, 0.5]), h2d_bytes_per_s=r.choice([5e9, 50e9]), accumulates=True)
        plan = OffloadPlan(layers=tuple(LayerPlan(*r.choice(CHOICES)) for _ in range(3)),
                           prefetch_depth=r.choice([0, 1, 2]), optimizer=r.choice(["cpu", "gpu"]))
        assert program_step_s(chunked, plan) == pytest.approx(predict(chunked, plan).step_s, rel=1e-7), plan


def test_a_version_1_plan_reads_as_every_layers_states_on_the_host(tmp_path):
    """Plans saved before `states` existed still train: their layers keep their states on the host."""
    v1 = {"layers": [{"activation": "keep", "params": "stream"}, {"activation": "offload", "params": "resident"}],
          "prefetch_depth": 1, "optimizer": "gpu", "version": 1,
          "predicted": {"step_s": 1.0, "gpu_peak_bytes": 2, "host_peak_bytes": 3, "layer_s": [0.5, 0.5]}}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    plan = OffloadPlan.load(tmp_path / "v1.json")
    assert [lp.states for lp in plan.layers] == ["host", "host"] and plan.version == 2
    assert plan.layers[0] == LayerPlan("keep", "stream") and plan.predicted.phase_s == {}
    with pytest.raises(ConfigError, match="version"):
        OffloadPlan.from_dict({**v1, "version": 3})
    with pytest.raises(ConfigError, match="resident there"):
        LayerPlan("keep", "stream", "gpu")


# --- chunk-recurrent training -------------------------------------------------------------------


def test_chunked_costs_add_pass_one_hold_the_pages_and_stream_weights_only_when_memory_asks():
    """A chunked table: pass 1 adds its seconds to the step and to the forward phase, the store's
    device pages add to the GPU peak, the program still encodes `predict` exactly, and the solver
    keeps every layer's weights resident when they fit (streamed ones come in again for every
    chunk's forwards, pass 1's too, and backward)."""
    whole = random_table(3, seed=5, micro_batches=8)
    chunked = dataclasses.replace(whole, chunks=4, pass1_s=70 * MS, kv_gpu_bytes=3 * GiB, chunk_tokens=512,
                                  resident_pages=96)
    plan = OffloadPlan(layers=(LayerPlan("keep"), LayerPlan("offload"), LayerPlan("recompute", states="gpu")),
                       prefetch_depth=1, optimizer="gpu")
    a, b = predict(whole, plan), predict(chunked, plan)
    assert b.step_s == pytest.approx(a.step_s + 70 * MS)
    assert b.phase_s["forward"] == pytest.approx(a.phase_s["forward"] + 70 * MS)
    assert sum(b.phase_s.values()) == pytest.approx(b.step_s)
    assert b.gpu_peak_bytes == a.gpu_peak_bytes + 3 * GiB and b.host_peak_bytes == a.host_peak_bytes
    assert program_step_s(chunked, plan) == pytest.approx(b.step_s, rel=1e-6)
    # Tight enough that the whole-sequence plan streams some layer's weights.
    gpu = predict(whole, OffloadPlan.uniform(3, "offload", "stream", prefetch_depth=0)).gpu_peak_bytes + GiB
    assert any(lp.params == "stream" for lp in solve(whole, gpu, 100 * GiB, settings=SolverSettings(depths=(0,))).layers)
    made = solve(chunked, gpu + 3 * GiB + 8 * GiB, 100 * GiB, settings=SolverSettings(depths=(0,)))
    assert all(lp.params == "resident" for lp in made.layers)
    tight = solve(chunked, gpu + 3 * GiB, 100 * GiB, settings=SolverSettings(depths=(0,)))
    assert any(lp.params == "stream" for lp in tight.layers)
    assert tight.predicted.step_s == pytest.approx(program_step_s(chunked, tight), rel=1e-6)
    assert (made.chunk_tokens, made.resident_pages) == (512, 96)
    assert made.predicted.step_s == pytest.approx(predict(chunked, made).step_s)


def test_one_micro_batch_keeps_host_gradients_in_bf16_which_makes_a_host_budget_feasible():
    """Two layers (2 GiB masters, 1 GiB bf16 working weights): with one micro-batch a step a host
    layer holds its gradient in the working dtypes (1 GiB, not 2), and the update on the CPU one fp32
    buffer of the largest host layer's gradient to widen it into. A host budget that holds both
    layers' states with bf16 gradients but not with fp32 sums is met at one micro-batch only."""
    fast = dict(h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30, static_update_s=0.0)
    one, two = (table([layer(), layer()], micro_batches=m, **fast) for m in (1, 2))
    on_host = OffloadPlan.uniform(2, "keep", "resident", optimizer="gpu")
    assert predict(two, on_host).host_peak_bytes - predict(one, on_host).host_peak_bytes == 2 * GiB
    cpu = OffloadPlan.uniform(2, "keep", "resident", optimizer="cpu")
    assert predict(one, cpu).host_peak_bytes - predict(one, on_host).host_peak_bytes == 2 * GiB  # the widening buffer
    budget = predict(one, on_host).host_peak_bytes  # GiB static + 2 x (2 + 1 + 4 + 1) GiB
    gpu_budget = 100 * GiB
    assert predict(one, solve(one, gpu_budget, budget)).host_peak_bytes <= budget
    fp32 = solve(two, gpu_budget, budget)  # fp32 sums: a layer's states must move to the GPU
    assert sum(lp.states == "gpu" for lp in fp32.layers) >= 1
    assert predict(two, on_host).host_peak_bytes > budget


def test_one_backward_holds_gpu_layers_gradients_in_the_working_dtypes_and_one_fp32_buffer_to_widen_them():
    """A layer whose states are on the GPU, a step of one backward: its gradient takes the working
    dtypes' bytes, 2 bytes a matrix parameter less than fp32 (bf16 matrices, fp32 vectors); the
    fp32 buffer of the largest such layer's master that the update widens each one's gradient into
    is made for the update, where the turnaround's fp32 sum being formed was as large: the peak
    grows by the layers' states alone. An accumulating step holds fp32 sums."""
    matrix, vector = 4096, 96
    x = layer(weight_bytes=2 * matrix + 4 * vector, master_bytes=4 * (matrix + vector), state_bytes=8 * (matrix + vector))
    assert x.gpu_state_bytes(True) - x.gpu_state_bytes(False) == 2 * matrix
    assert (x.gpu_widened_bytes(False), x.gpu_widened_bytes(True)) == (x.master_bytes, 0)
    fast = dict(h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30, micro_batches=1)
    one, summed = table([layer()] * 3, **fast), table([layer()] * 3, accumulates=True, **fast)
    assert not one.accumulates
    plan = lambda n: OffloadPlan(layers=tuple(LayerPlan("keep", "resident", "gpu" if i < n else "host") for i in range(3)),
                                 prefetch_depth=0, optimizer="cpu")
    peak = lambda costs, n: predict(costs, plan(n)).gpu_peak_bytes
    # layer(): 2 GiB masters, 1 GiB working weights (the one-backward gradient), 4 GiB states.
    assert peak(one, 1) - peak(one, 0) == (2 + 1 + 4) * GiB
    assert peak(one, 3) - peak(one, 0) == 3 * (2 + 1 + 4) * GiB
    assert peak(summed, 3) - peak(summed, 0) == 3 * (2 + 2 + 4) * GiB


@pytest.mark.parametrize("seed", [0, 1])
def test_at_one_backward_the_program_finds_the_brute_force_optimum(seed):
    """One micro-batch a step (the "gpu" layers' gradients in the working dtypes, their shared
    widening buffer in the update): under GPU budgets between the plans' peaks and a host budget that binds, the
    program's plan is the brute force's optimum and within the budgets (the program's memory rows
    are `predict`'s)."""
    costs = random_table(3, seed, micro_batches=1)
    assert not costs.accumulates
    depths = (0, 1)
    predicted = [predict(costs, plan) for plan in every_plan(3, depths)]
    mid = lambda values, q: (lambda v: (v[int(q * (len(v) - 1))] + v[int(q * (len(v) - 1)) + 1]) // 2)(sorted(set(values)))
    host = mid([p.host_peak_bytes for p in predicted], 0.6)
    fits_host = [p.gpu_peak_bytes for p in predicted if p.host_peak_bytes <= host]
    states_on_gpu = 0
    for q in (0.1, 0.3, 0.6):
        gpu = mid(fits_host, q)
        best = brute_force(costs, gpu, host, depths)
        plan = solve(costs, gpu, host, settings=SolverSettings(depths=depths))
        assert plan.predicted.step_s == pytest.approx(best, rel=1e-6), q
        assert plan.predicted.gpu_peak_bytes <= gpu and plan.predicted.host_peak_bytes <= host
        states_on_gpu += sum(lp.states == "gpu" for lp in plan.layers)
    assert states_on_gpu  # the "gpu" layers' bytes are part of some optimum's peak


# --- the input embedding in host memory -----------------------------------------------------------


def test_an_input_embedding_in_host_memory_moves_its_bytes_to_the_host_and_to_the_optimizer_phase():
    """`embedding_on_host`: master, gradient and states leave the static GPU bytes for the host, the
    backward's gradient of the matrix's size is gone from the turnaround, and the optimizer phase
    holds the three again; the rows' copies and the update's are charged on the compute queue."""
    E, S = 3 * GiB, GiB
    costs = random_table(3, seed=2, static_gpu_bytes=2 * E + S + GiB, late_grad_bytes=E, embedding_bytes=E,
                         embedding_state_bytes=S, accumulates=True)
    moved = embedding_on_host(costs)
    plan = OffloadPlan.uniform(3)
    before, after = gpu_peak_terms(costs, plan), gpu_peak_terms(moved, plan)
    assert after["turnaround"]["static"] == before["turnaround"]["static"] - 2 * E - S == GiB
    assert in_turn(moved, 0, ["recompute"] * 3)["embedding_gradient"][1] == \
        in_turn(costs, 0, ["recompute"] * 3)["embedding_gradient"][1] - E
    assert after["optimizer_phase"]["embedding_update"] == 2 * E + S and before["optimizer_phase"]["embedding_update"] == 0
    assert sum(after["optimizer_phase"].values()) == sum(before["optimizer_phase"].values())
    assert predict(moved, plan).host_peak_bytes == predict(costs, plan).host_peak_bytes + 2 * E + S
    rows = costs.layers[0].boundary_bytes
    assert moved.head_s == pytest.approx(costs.head_s + rows / costs.h2d_bytes_per_s + rows / costs.d2h_bytes_per_s)
    update = (E + S + min(E, 2 * rows)) / costs.h2d_bytes_per_s + (E + S) / costs.d2h_bytes_per_s
    assert moved.static_update_s == pytest.approx(costs.static_update_s + update)
    for side in ("cpu", "gpu"):  # the program encodes the moved table as predict does
        p = OffloadPlan.uniform(3, optimizer=side)
        assert program_step_s(moved, p) == pytest.approx(predict(moved, p).step_s, rel=1e-7)


def test_a_gpu_budget_only_the_host_embedding_meets_is_planned_with_it():
    """Between the two placements' smallest GPU budgets the planner keeps the embedding in host memory
    (and says so in the plan); with room for both it takes the faster, on the GPU; a tied head has
    no choice."""
    E, S = 3 * GiB, GiB
    costs = random_table(3, seed=4, static_gpu_bytes=2 * E + S + GiB, late_grad_bytes=E, embedding_bytes=E,
                         embedding_state_bytes=S, accumulates=True)
    assert [t.embedding for t in embedding_homes(costs)] == ["gpu", "host"]
    assert [t.embedding for t in embedding_homes(dataclasses.replace(costs, embedding_bytes=0))] == ["gpu"]
    least = {}
    for home in embedding_homes(costs):
        with pytest.raises(BudgetError) as caught:
            solve(home, GiB, 100 * GiB)
        least[home.embedding] = caught.value.smallest_bytes
    assert least["host"] < least["gpu"]
    plan, chosen = fastest(embedding_homes(costs), (least["host"] + least["gpu"]) // 2, 100 * GiB)
    assert plan.embedding == chosen.embedding == "host"
    assert [c.embedding for c in plan.chunk_choices] == ["gpu", "host"] and plan.chunk_choices[0].step_s is None
    plan, _ = fastest(embedding_homes(costs), 100 * GiB, 100 * GiB)
    assert plan.embedding == "gpu"  # no copies of rows, no update over the bus
