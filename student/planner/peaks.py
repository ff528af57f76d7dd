"""The offload planner's memory model: the GPU and host peaks of a plan over a cost table.

`peaks` is what student/planner/costs.py's `predict` reports; student/planner/solve.py's mixed-integer
program encodes the same sums from the parts below (`in_turn`, `backward_gpu_bytes`,
`beside_backward`, `optimizer_slices`, `widened_host_bytes`), and `gpu_peak_terms` names each
term for reading a measured peak against its prediction. What each term holds is in `predict`'s
docstring ("GPU peak", "Host peak"). Below the cost model: it reads the cost table
(student/planner/table.py), not costs.py; no torch, no solver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from student.offload.plan import UPDATE_SLOTS

if TYPE_CHECKING:
    from student.offload.plan import OffloadPlan
    from student.planner.table import CostTable, LayerCosts

__all__ = ["peaks", "gpu_peak_terms", "held_activation_bytes", "in_turn", "beside_backward", "backward_gpu_bytes",
           "widened_host_bytes", "optimizer_slices"]


def peaks(costs: CostTable, plan: OffloadPlan) -> tuple[int, int]:
    """(GPU peak, host peak) bytes of `plan` (predict's docstring says what they hold)."""
    gpu = gpu_peak_terms(costs, plan)
    c, p = costs.layers, plan.layers
    host = (costs.static_host_bytes + sum(x.host_bytes(costs.accumulates) for x, lp in zip(c, p) if lp.states == "host")
            + sum(costs.offloaded_bytes(x) for x, lp in zip(c, p) if lp.activation == "offload")
            + widened_host_bytes(costs, plan.optimizer, [lp.states == "host" for lp in p]))
    return max(sum(gpu["turnaround"].values()), sum(gpu["optimizer_phase"].values())), host


def gpu_peak_terms(costs: CostTable, plan: OffloadPlan) -> dict[str, dict[str, int]]:
    """The bytes of the GPU peak's two candidates, the turnaround (end of the forward, and the
    backward it starts) and the optimizer phase, term by term (predict's docstring says what each
    holds); the peak is the larger sum. Of what the turnaround holds one after the other
    (`in_turn`) the largest counts: its activations as "activations", the rest under its own
    name. For reading a measured peak against its prediction (bench_offload_gpu rows, `distill
    plan`'s table)."""
    c, p, d = costs.layers, plan.layers, plan.prefetch_depth
    most = lambda values: max(values, default=0)
    resident = sum(x.weight_bytes for x, lp in zip(c, p) if lp.params == "resident")
    states = sum(x.gpu_state_bytes(costs.accumulates) for x, lp in zip(c, p) if lp.states == "gpu")
    ring = optimizer_slices(costs, plan.optimizer)
    parts = in_turn(costs, d, [lp.activation for lp in p])
    largest = max(parts, key=lambda name: sum(parts[name]))
    activations, held = parts[largest]
    turnaround = {
        "static": costs.static_gpu_bytes,
        "weights_held": sum(x.weight_bytes for x, lp in zip(c, p) if lp.params == "resident" or lp.activation == "keep"),
        "weights_streamed": (d + 1) * most(x.weight_bytes for x, lp in zip(c, p)
                                           if lp.params == "stream" and lp.activation != "keep"),
        "activations": activations,
        "activations_in_flight": 2 * (d + 1) * most(x.boundary_bytes for x, lp in zip(c, p) if lp.activation == "offload"),
        "gpu_states": states,
        "kv_pages": costs.kv_gpu_bytes,
        largest: held,  # the largest of what is held one after the other
        "update_ring": ring}
    optimizer_phase = {
        "static": costs.static_gpu_bytes, "weights_resident": resident, "gpu_states": states,
        "widened_gradient": most(x.gpu_widened_bytes(costs.accumulates) for x, lp in zip(c, p) if lp.states == "gpu"),
        "update_ring": ring, "embedding_update": costs.embedding_update_bytes}
    return {"turnaround": turnaround, "optimizer_phase": optimizer_phase}


def held_activation_bytes(layer: LayerCosts, activation: str) -> int:
    """What a layer's forward leaves on the GPU for its backward: its input and all it saves
    (keep: the runtime holds the input with the layer's graph; its saved tensors do not include
    it), its input (recompute), nothing (offload: its input is in host memory)."""
    return {"keep": layer.keep_bytes + layer.boundary_bytes, "recompute": layer.boundary_bytes,
            "offload": 0}[activation]


def in_turn(costs: CostTable, depth: int, activations: list[str]) -> dict[str, tuple[int, int]]:
    """What a plan of this depth (`activations`: its layers' decisions) holds at the turnaround
    and in the backward besides the static bytes and its other decisions', one after the other, as
    {name: (held activations, the rest)}: the head's input (the last layer's output) and workspace
    (while the head runs) beside every layer's held activations; the input embedding's gradient as its backward makes it (after the
    last layer's backward, while that layer's gradients may still be on their way out, beside a
    tied head's gradient waiting for it), counted beside them too; and the layer whose backward
    holds the most: its gradients (`backward_gpu_bytes`), what is beside it (`beside_backward`),
    its workspace and its activations recomputed unless it keeps them, beside the held
    activations of the layers up to it (the backward has freed those above). At one backward a
    step the static bytes' count of the embedding's .grad is taken out: its backward makes it."""
    c = costs.layers
    held = [held_activation_bytes(x, a) for x, a in zip(c, activations)]
    grads, absent = backward_gpu_bytes(costs, depth), 0 if costs.accumulates else costs.late_grad_bytes
    layers = [(sum(held[:j + 1]), grads + beside_backward(costs) + x.workspace_bytes
               + (x.keep_bytes if a != "keep" else 0)) for j, (x, a) in enumerate(zip(c, activations))]
    return {"head_workspace": (sum(held), c[-1].boundary_bytes + costs.loss_workspace_bytes - absent),
            "embedding_gradient": (sum(held), grads + costs.held_grad_bytes + costs.late_grad_bytes - absent),
            "layer_backward": max(layers, key=sum)}


def beside_backward(costs: CostTable) -> int:
    """Beside every layer's backward: a tied head's gradient waiting for the embedding's
    (`CostTable.held_grad_bytes`) and, chunk-recurrent, the next layer's attention output brought
    ahead for its recomputation (`KVPages.held_attention_bytes`); less, at one backward a step,
    the embedding's .grad the static bytes count but its backward has not made yet."""
    attention = costs.kv.held_attention_bytes if costs.kv is not None else 0
    return costs.held_grad_bytes + attention - (0 if costs.accumulates else costs.late_grad_bytes)


def backward_gpu_bytes(costs: CostTable, depth: int) -> int:
    """A layer's gradients in its backward at this depth: d+1 sums on their way out, in the working
    dtypes, and the one being formed in fp32; after the first micro-batch d+1 fp32 sums on their
    way out and d+1 accumulators on their way in, and the compute-dtype one."""
    master, weights = max(x.master_bytes for x in costs.layers), max(x.weight_bytes for x in costs.layers)
    if not costs.accumulates:  # the sums go out in the working dtypes; the one being formed is fp32
        return (depth + 1) * weights + master
    return 2 * (depth + 1) * master + weights


def widened_host_bytes(costs: CostTable, side: str, on_host: list[bool]) -> int:
    """With one micro-batch and the update on the CPU: the fp32 buffer the host layers' gradients
    are widened into for their updates, as large as the largest host layer's master."""
    if side != "cpu" or costs.accumulates:
        return 0
    return max((x.master_bytes for x, h in zip(costs.layers, on_host) if h), default=0)


def optimizer_slices(costs: CostTable, side: str) -> int:
    """The update's ring on the GPU (UPDATE_SLOTS slots of the largest layer's master, gradient,
    states and staging casts), held from the backward (the first slots load there) to the update."""
    return UPDATE_SLOTS * max(x.slot_bytes for x in costs.layers) if side == "gpu" else 0
