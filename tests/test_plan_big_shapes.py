"""tests/benchmarks/plan_big_shapes.py: its cost tables are step_profile's arithmetic. The 8B shape's
table, built the same way, gives both GPU peaks the planner predicted from the 8B's real profile on
the H200 (recorded in tests/benchmarks/results.jsonl), to the byte, under the profile and the runtime
of those rows' commits (the head's gradients counted twice: `what_if="double_count"`; the layers whose
states are on the GPU with fp32 gradients: `fp32_gpu_grads`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import plan_big_shapes as big  # noqa: E402

from student.planner.costs import predict  # noqa: E402
from student.offload.plan import LayerPlan, OffloadPlan  # noqa: E402


def plan_of(codes: str, depth: int, optimizer: str) -> OffloadPlan:
    """k/r/o: keep / recompute / offload; upper case: states on the GPU (resident), lower case
    states on the host, s: streamed (else resident)."""
    layers = []
    for code in codes.split():
        activation = {"k": "keep", "r": "recompute", "o": "offload"}[code[0].lower()]
        layers.append(LayerPlan(activation, "stream" if code.endswith("s") else "resident",
                                "gpu" if code[0].isupper() else "host"))
    return OffloadPlan(layers=tuple(layers), prefetch_depth=depth, optimizer=optimizer)


def test_the_8b_table_gives_the_peak_the_planner_predicted_from_its_profile():
    # offload/llama-3.1-8b-T8192/planned@a2bce95: FOAM, every layer's states on the GPU, 15 kept.
    plan = plan_of("R R R R R K R R R K K R K R R K K R R R K K K K K K K R K R K R", 0, "cpu")
    costs = big.cost_table(big.LLAMA_8B, "foam", 0.0, what_if="double_count", fp32_gpu_grads=True)
    # That commit's model did not count a kept layer's input, which the runtime holds with its graph.
    kept_inputs = 15 * costs.layers[0].boundary_bytes
    assert predict(costs, plan).gpu_peak_bytes - kept_inputs == 142_031_005_936


def test_the_8b_table_gives_the_40gib_peak_under_that_plans_cost_model():
    # offload/llama-3.1-8b-T8192-gpu40GiB/planned@7e71169, whose peak was the turnaround of that
    # commit's student/planner/solve.py: (d + 1) fp32 gradients in flight, no ring in the turnaround.
    plan = plan_of("O o os rs os os os os os os os os os os os os os O os O os os O os O os os os os os os o", 1, "gpu")
    costs = big.cost_table(big.LLAMA_8B, "foam", 1.0, what_if="double_count", fp32_gpu_grads=True)
    c, d = costs.layers[0], plan.prefetch_depth
    lp = plan.layers
    held = sum(c.weight_bytes for x in lp if x.params == "resident" or x.activation == "keep")
    ring = (d + 1) * c.weight_bytes * any(x.params == "stream" and x.activation != "keep" for x in lp)
    acts = sum(c.keep_bytes if x.activation == "keep" else c.boundary_bytes for x in lp if x.activation != "offload")
    in_flight = 2 * (d + 1) * c.boundary_bytes * any(x.activation == "offload" for x in lp)
    states = sum(c.gpu_state_bytes(costs.accumulates) for x in lp if x.states == "gpu")
    fixed = (d + 1) * c.master_bytes + c.weight_bytes + c.workspace_bytes + c.keep_bytes
    assert costs.static_gpu_bytes + held + ring + acts + in_flight + states + fixed == 42_655_361_024


def test_one_backward_saves_two_bytes_a_matrix_parameter_of_each_gpu_layer_at_the_peak():
    """The 14B FOAM table at one micro-batch: a layer whose states are on the GPU holds 2 bytes a
    matrix parameter less than with fp32 gradients (bf16 matrices' gradients), and so does the GPU
    peak (the fp32 buffer their update widens them into is made in the update, below it)."""
    new, old = (big.cost_table(big.QWEN_14B, "foam", 0.0, fp32_gpu_grads=fp32) for fp32 in (False, True))
    assert not new.accumulates
    assert old.layers[0].gpu_state_bytes(False) - new.layers[0].gpu_state_bytes(False) == 2 * big.QWEN_14B.matrix_params
    for gpu_layers, side in ((1, "cpu"), (31, "cpu"), (31, "gpu")):
        plan = plan_of(" ".join(["R"] * gpu_layers + ["rs"] * (48 - gpu_layers)), 1, side)
        saved = predict(old, plan).gpu_peak_bytes - predict(new, plan).gpu_peak_bytes
        assert saved == gpu_layers * 2 * big.QWEN_14B.matrix_params


def test_the_shapes_parameter_counts_are_the_models():
    assert big.LLAMA_8B.params == 8_030_261_248  # the rows' config
    assert big.QWEN_14B.params == 14_770_033_664
    assert big.QWEN_32B.params == 32_763_876_352
