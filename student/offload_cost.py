"""The offload planner's cost model (LazyTrain, arXiv 2608.11919 §3.2): what a plan's step costs.

`LayerCosts` and `CostTable` hold a student's measured step (student/step_profile.py fills them);
`predict` runs the runtime's queues in order (student/offload.py carries a plan out,
student/offload_plan.py says what each decision means) and gives the step time, its phases and
the peak memory on each side. student/planner.py's mixed-integer program encodes `predict`
exactly; `_peaks`' parts (`_fixed_gpu_bytes`, `_optimizer_slices`) are shared with it.
A leaf beside offload_plan: no torch, no solver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from student.offload_plan import UPDATE_SLOTS, OffloadPlan, Predicted

__all__ = ["PHASES", "LayerCosts", "CostTable", "predict"]


# The phases of a step, in order, as `predict` returns them and OffloadRuntime.phase_s measures them:
#   forward   the decoder layers' forwards (every micro-batch), with their waits for copies in
#   head      the embeddings, final norm, head and loss, forward and backward
#   backward  the decoder layers' backwards, recomputation and waits for copies in
#   grads     after the backward until the host has the gradients it reads (the update on the CPU:
#             the copies out the backward did not hide; on the GPU: none)
#   clip      the trainer's clipping by the global norm (the norms were taken on the device in the
#             backward: the total and the coefficient)
#   optimizer the update (on the CPU: the host layers one after another; on the GPU: the ring of
#             slots until the compute stream is through, the device parameters after)
#   refresh   after the update until the resident working weights are on the GPU again (the update
#             on the CPU), or until what the next step waits for is there (on the GPU: gradients
#             still on their way out, a streamed layer's write-back)
PHASES = ("forward", "head", "backward", "grads", "clip", "optimizer", "refresh")


@dataclass(frozen=True)
class LayerCosts:
    """What one decoder layer costs, for one micro-batch (seconds, bytes)."""

    forward_s: float  # the layer's forward
    backward_s: float  # its backward from kept activations (a recompute adds forward_s)
    weight_bytes: int  # working weights in the compute dtype; also its weight gradient on the device
    boundary_bytes: int  # the layer's input (what "recompute" keeps and "offload" moves)
    keep_bytes: int  # every tensor the forward saves for the backward when kept, the input included
    workspace_bytes: int  # transient memory of its forward + backward beyond the saved tensors
    master_bytes: int  # fp32 master weights on the host (the fp32 gradient accumulator is as large)
    state_bytes: int  # the optimizer's states of the layer, on the host
    update_gpu_s: float  # one optimizer update of the layer on the GPU (its slice is there)
    update_cpu_s: float  # the same on the CPU, with the cast of its staging copy

    @property
    def staging_bytes(self) -> int:
        """The host copy of the working weights that copies to the device read, when their dtype is
        not the masters' fp32 (else the masters are read)."""
        return self.weight_bytes if self.weight_bytes < self.master_bytes else 0

    @property
    def host_bytes(self) -> int:
        """Master weights, gradient accumulator, optimizer states and the staging copy."""
        return 2 * self.master_bytes + self.state_bytes + self.staging_bytes

    @property
    def update_in_bytes(self) -> int:
        """What a GPU update brings to the device: master, gradient accumulator, states; also what a
        layer whose states live on the GPU holds there beside its working weights."""
        return 2 * self.master_bytes + self.state_bytes


@dataclass(frozen=True)
class CostTable:
    """Measured costs of a student's training step (`profile`), the input of `predict` and `solve`."""

    layers: tuple[LayerCosts, ...]
    h2d_bytes_per_s: float  # host->device copy bandwidth (pinned host memory)
    d2h_bytes_per_s: float  # device->host
    # Always on the GPU: embeddings, final norm and head with their gradients and optimizer states,
    # the loss's workspace and a runtime reserve (allocator slack).
    static_gpu_bytes: int
    static_host_bytes: int = 0  # on the host beside the layers' bytes
    head_s: float = 0.0  # embeddings, final norm, head and loss, forward and backward, one micro-batch
    static_update_s: float = 0.0  # the optimizer update of the static parameters (on the GPU)
    # Micro-batches per optimizer step (grad_accum); with chunk-recurrent training each chunk's
    # forward and backward (pass 2) counts as one: grad_accum x chunks.
    micro_batches: int = 1
    # Host memory streaming rate (bytes read plus written a second) of a host pass over fp32
    # gradients: the update on the CPU scales each host layer's gradient by the clip coefficient.
    host_bytes_per_s: float = math.inf
    # Chunk-recurrent training (student/long_context.py; the layers' costs are then a chunk's):
    chunks: int = 1  # chunks per micro-batch (1: whole sequences)
    pass1_s: float = 0.0  # pass 1 of the step's micro-batches: the no-grad forwards of all chunks but the last
    kv_gpu_bytes: int = 0  # the key/value store's pages (and gradient pages) on the GPU; its host bytes are static_host_bytes
    chunk_tokens: int | None = None  # the chunk size measured (None: whole sequences)
    resident_pages: int | None = None  # key/value pages (of every row) on the GPU at once, over all layers

    def __post_init__(self):
        assert self.layers and self.micro_batches >= 1 and self.chunks >= 1 and self.h2d_bytes_per_s > 0 and self.d2h_bytes_per_s > 0
        assert self.host_bytes_per_s > 0



def predict(costs: CostTable, plan: OffloadPlan) -> Predicted:
    """Step time, its phases (PHASES) and peak memory of `plan`, by running the runtime's queues in order.

    Assumptions (student/offload.py carries the plan out; this is what it is modelled as):
    - Three device queues, each in order: compute, host->device copies (H2D), device->host copies
      (D2H); and the host. A copy takes bytes / measured bandwidth; the two directions run at once;
      compute does not slow copies down nor copies compute (no contention is modelled). A host
      pass over gradients takes the bytes it reads and writes / host_bytes_per_s.
    - Forward, layer i: its weights (params "stream") are copied when layer i-d-1's forward ends
      (d = prefetch_depth; at the start for the first d+1 layers), and its forward waits for them.
      An "offload" layer's input is copied out after its forward; the forward of layer i+d+1 waits
      until that copy is done (at most d+1 offloaded inputs are on the GPU at once).
    - Then the head (embeddings, norm, head, loss; `head_s`), then the backward, layers in reverse:
      layer i's weights (stream, unless kept since the forward: "keep") and its input (offload) are
      copied in when the backward of layer i+d+1 ends (at the end of the forward for the top d+1
      layers); its backward waits for them and runs the forward again first unless "keep". A
      layer whose states are on the host sends its weight gradient sum out in fp32 after its
      backward (the backward of layer i-d-1 waits until that copy is done); with more than one
      micro-batch its accumulator comes in with its other copies first (the sum is formed on the
      device; so in every micro-batch, the first's too: a little pessimistic). The gradients'
      norms are taken on the device meanwhile (not timed); a "gpu" layer accumulates there.
    - Micro-batches run one after another, each starting on empty queues; the step is
      (micro_batches - 1) x one micro-batch + the last one. Clipping takes no time of its own (the
      norms are known; the coefficient is applied inside the update). Then the optimizer:
      "cpu": once every gradient is on the host, the host layers update on the CPU one after
      another (each scaling its gradient by the coefficient first: a pass of 2 x its fp32 bytes;
      then the cast of its staging copy), each resident one's working weights going to the GPU
      after its update; the static parameters and the "gpu" layers update on the GPU meanwhile.
      "gpu": the host layers, last to first, through a ring of UPDATE_SLOTS slots, on three
      queues of their own (copies in, compute, copies out; `_ring`): the layer in position k of
      that order loads its master, gradient and states once the copies out of position
      k - UPDATE_SLOTS are done and its gradient is on the host; the first UPDATE_SLOTS positions
      load master and states right after their backward (their gradient is on the device); each
      updates once loaded, then master, states and staging copy go out. Then the static
      parameters and the "gpu" layers update. The copies out overlap the next step: the step ends
      when the compute queue is through, unless the next step's forward of a streamed host layer
      would wait for its copy out (its weights come in after it, and the layers before it take at
      least their forward time), which delays that step as much.
    - Chunk-recurrent training: pass 1 (`pass1_s`, no-grad forwards, the weights resident) runs
      before the chunks' forwards and backwards, which are the micro-batches above; the key/value
      store's device bytes are held at the turnaround.
    - GPU peak: the larger of the turnaround (end of the forward) and the optimizer phase.
      Turnaround: static + weights of resident and kept layers + master, gradient and states of
      "gpu" layers + (d+1) buffers of the largest streamed layer + kept activations (keep:
      everything saved; recompute: the input) + 2 (d+1) of the largest offloaded input (copies
      out and back in flight) + (d+1) fp32 gradients (2 (d+1) with more than one micro-batch:
      accumulators coming in) and one compute-dtype gradient of the largest layer + the largest
      layer's workspace and recomputed activations + with the update on the GPU its ring (the
      first slots fill in the backward). Optimizer phase: static + resident weights + "gpu"
      layers' state + the ring.
    - Host peak: static + the host layers' master, gradient accumulator, states and staging copy +
      the offloaded inputs of one micro-batch.
    - Not modelled: the copy back of an offloaded input waiting for its copy out (the forward and
      backward between them hide it); the update's copies in sharing the bus with the backward's
      (the first slots' loads); the ring waiting on a "gpu" layer's position as if it had a slot.
    """
    L, d, m = len(costs.layers), plan.prefetch_depth, costs.micro_batches
    assert len(plan.layers) == L, f"the plan has {len(plan.layers)} layers, the cost table {L}"
    h2d = lambda n: n / costs.h2d_bytes_per_s
    d2h = lambda n: n / costs.d2h_bytes_per_s
    host_pass = lambda n: n / costs.host_bytes_per_s
    c, p = costs.layers, plan.layers
    keep = [lp.activation == "keep" for lp in p]
    offload = [lp.activation == "offload" for lp in p]
    stream = [lp.params == "stream" for lp in p]
    on_host = [lp.states == "host" for lp in p]
    backward = [c[i].backward_s + (0.0 if keep[i] else c[i].forward_s) for i in range(L)]

    # Forward: copy_in / copy_out are the ends of the H2D and D2H queues, so far.
    copy_in = copy_out = 0.0
    fwd_end, out_end, stall = [0.0] * L, [0.0] * L, [0.0] * L
    for i in range(L):
        issue = fwd_end[i - d - 1] if i - d - 1 >= 0 else 0.0
        copy_in = max(copy_in, issue) + stream[i] * h2d(c[i].weight_bytes)
        ready = fwd_end[i - 1] if i else 0.0
        start = max(ready, copy_in, out_end[i - d - 1] if i - d - 1 >= 0 else 0.0)
        stall[i] += start - ready
        fwd_end[i] = start + c[i].forward_s
        copy_out = max(copy_out, fwd_end[i]) + offload[i] * d2h(c[i].boundary_bytes)
        out_end[i] = copy_out

    # Backward, top layer first.
    compute = fwd_end[-1] + costs.head_s
    accumulated = costs.micro_batches > 1  # a host layer's sum so far comes in before its gradient is added
    bwd_end, grad_end = [0.0] * L, [0.0] * L
    for i in reversed(range(L)):
        issue = bwd_end[i + d + 1] if i + d + 1 < L else fwd_end[-1]
        copy_in = max(copy_in, issue) + h2d(stream[i] * (not keep[i]) * c[i].weight_bytes
                                            + offload[i] * c[i].boundary_bytes + accumulated * on_host[i] * c[i].master_bytes)
        start = max(compute, copy_in, grad_end[i + d + 1] if i + d + 1 < L else 0.0)
        stall[i] += start - compute
        bwd_end[i] = compute = start + backward[i]
        copy_out = max(copy_out, compute) + on_host[i] * d2h(c[i].master_bytes)
        grad_end[i] = copy_out
    micro_batch = max(compute, copy_in, copy_out)

    # The optimizer, after the clipping (the norms were taken in the backward: no time of its own).
    device_update = costs.static_update_s + sum(x.update_gpu_s for x, h in zip(c, on_host) if not h)
    if plan.optimizer == "cpu":  # once every gradient is on the host
        cpu = start = max(compute, copy_out)
        for i in range(L):
            cpu += on_host[i] * (c[i].update_cpu_s + host_pass(2 * c[i].master_bytes))
            copy_in = max(copy_in, cpu) + (on_host[i] and not stream[i]) * h2d(c[i].weight_bytes)
        updated = max(cpu, start + device_update)
        last = max(micro_batch, updated, copy_in)
    else:
        start = compute
        updated, wb_end = _ring(costs, plan, start, bwd_end, grad_end)
        updated += device_update
        last = max(micro_batch, updated, *[wb_end[i] + h2d(c[i].weight_bytes) - sum(x.forward_s for x in c[:i])
                                           for i in range(L) if on_host[i] and stream[i]])
    step_s = (m - 1) * micro_batch + last + costs.pass1_s
    phase_s = dict(forward=m * fwd_end[-1] + costs.pass1_s, head=m * costs.head_s, backward=m * (compute - fwd_end[-1] - costs.head_s),
                   grads=(m - 1) * (micro_batch - compute) + start - compute, clip=0.0, optimizer=updated - start,
                   refresh=last - updated)

    gpu_peak, host_peak = _peaks(costs, plan)
    layer_s = tuple(m * (c[i].forward_s + backward[i] + stall[i]) for i in range(L))
    return Predicted(step_s=step_s, gpu_peak_bytes=gpu_peak, host_peak_bytes=host_peak, layer_s=layer_s,
                     phase_s=phase_s)


def _ring(costs: CostTable, plan: OffloadPlan, start: float, bwd_end: list[float], grad_end: list[float]
          ) -> tuple[float, list[float]]:
    """The update on the GPU through the ring of UPDATE_SLOTS slots (predict's docstring): (end of
    the host layers' updates on the compute queue, per layer the end of the copies-out queue after
    it). Three queues, layers last to first; a layer that stays on the GPU passes through in no
    time (but the queues' ends carry over it)."""
    c, L, R = costs.layers, len(costs.layers), UPDATE_SLOTS
    h2d = lambda n: n / costs.h2d_bytes_per_s
    d2h = lambda n: n / costs.d2h_bytes_per_s
    load, update, written, wb_end = 0.0, start, [], [0.0] * L
    for k, i in enumerate(reversed(range(L))):
        host = plan.layers[i].states == "host"
        if k < R:  # loads in the backward: master and states; the gradient is on the device
            load = max(load, bwd_end[i]) + host * h2d(c[i].master_bytes + c[i].state_bytes)
        else:
            load = max(load, grad_end[i], written[k - R]) + host * h2d(c[i].update_in_bytes)
        update = max(update, load) + host * c[i].update_gpu_s
        wb = max(written[-1] if written else 0.0, update) + host * d2h(c[i].master_bytes + c[i].state_bytes
                                                                        + c[i].staging_bytes)
        written.append(wb)
        wb_end[i] = wb
    return update, wb_end


def _peaks(costs: CostTable, plan: OffloadPlan) -> tuple[int, int]:
    """(GPU peak, host peak) bytes of `plan` (predict's docstring says what they hold)."""
    c, p, d = costs.layers, plan.layers, plan.prefetch_depth
    most = lambda values: max(values, default=0)
    held = sum(x.weight_bytes for x, lp in zip(c, p) if lp.params == "resident" or lp.activation == "keep")
    ring = (d + 1) * most(x.weight_bytes for x, lp in zip(c, p) if lp.params == "stream" and lp.activation != "keep")
    acts = sum(x.keep_bytes if lp.activation == "keep" else x.boundary_bytes
               for x, lp in zip(c, p) if lp.activation != "offload")
    in_flight = 2 * (d + 1) * most(x.boundary_bytes for x, lp in zip(c, p) if lp.activation == "offload")
    states = sum(x.update_in_bytes for x, lp in zip(c, p) if lp.states == "gpu")
    turnaround = (costs.static_gpu_bytes + held + ring + acts + in_flight + states + _fixed_gpu_bytes(costs, d)
                  + _optimizer_slices(costs, plan.optimizer))
    resident = sum(x.weight_bytes for x, lp in zip(c, p) if lp.params == "resident")
    optimizer_phase = costs.static_gpu_bytes + resident + states + _optimizer_slices(costs, plan.optimizer)
    host = (costs.static_host_bytes + sum(x.host_bytes for x, lp in zip(c, p) if lp.states == "host")
            + sum(x.boundary_bytes for x, lp in zip(c, p) if lp.activation == "offload"))
    return max(turnaround, optimizer_phase), host


def _fixed_gpu_bytes(costs: CostTable, depth: int) -> int:
    """What every plan of this depth holds at the turnaround: the key/value store's device pages, gradients (d+1 fp32 sums on their way
    out, the one being widened in the compute dtype; after the first micro-batch d+1 accumulators
    more on their way in) and one layer's backward (its workspace and recomputed activations)."""
    sums = (depth + 1) * (2 if costs.micro_batches > 1 else 1)
    return (sums * max(x.master_bytes for x in costs.layers) + max(x.weight_bytes for x in costs.layers)
            + max(x.workspace_bytes + x.keep_bytes for x in costs.layers) + costs.kv_gpu_bytes)


def _optimizer_slices(costs: CostTable, side: str) -> int:
    """The update's ring on the GPU (UPDATE_SLOTS slots of the largest layer's master, gradient,
    states and staging casts), held from the backward (the first slots load there) to the update."""
    return UPDATE_SLOTS * max(x.update_in_bytes + x.staging_bytes for x in costs.layers) if side == "gpu" else 0
