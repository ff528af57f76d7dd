"""The offload planner (LazyTrain, arXiv 2608.11919 §3.2): measure a step, solve for the fastest plan.

`profile` (student/step_profile.py) times one real micro-batch of the student layer by layer and
measures bytes and copy bandwidths into a `CostTable`; `predict` is the cost model of a plan (student/offload_plan.py says
what each decision means); `solve` finds the plan of least predicted step time under a GPU and a
host memory budget with a mixed-integer program (scipy.optimize.milp, HiGHS) that encodes `predict`
exactly, so the program's optimum is `predict`'s step time of the plan it returns.
`plan_for_training` does all three for a TrainConfig (`distill plan`, `train-student --offload auto`).

LazyTrain places activation checkpoints on a recomputation path and charges the transfer traffic a
compute window cannot hide (its eq. 5). Here the windows are the layers' forward and backward
compute, and the traffic is the runtime's own: streamed weights, offloaded layer inputs, gradients
and the optimizer's states. Instead of assigning bytes to windows, the program holds the event
times of the runtime's three queues (compute, host->device copies, device->host copies) as
continuous variables with "starts after" constraints: the least solution of such constraints is the
simulation `predict` runs, so minimising the step time over the binaries is minimising `predict`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

from distill.configs import ConfigError
from student.offload_plan import UPDATE_SLOTS, LayerPlan, OffloadPlan, Predicted
from student.step_profile import ProfileSettings, profile

__all__ = ["PHASES", "LayerCosts", "CostTable", "SolverSettings", "BudgetError", "ProfileSettings", "predict", "solve",
           "smallest_budget", "program_step_s", "profile", "make_plan", "plan_for_training", "plan_table"]

logger = logging.getLogger(__name__)

ACTIVATIONS = ("keep", "recompute", "offload")
HOMES = (("resident", "host"), ("stream", "host"), ("resident", "gpu"))  # (params, states) a layer may take
CHOICES = tuple((a, p, st) for a in ACTIVATIONS for p, st in HOMES)  # one binary per layer and choice in the program
OPTIMIZER_SIDES = ("cpu", "gpu")
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
GiB = 2**30


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


@dataclass(frozen=True)
class SolverSettings:
    """How `solve` searches; the defaults are the production settings."""

    depths: tuple[int, ...] = (0, 1, 2, 3)  # prefetch depths tried (one program per depth and optimizer side)
    mip_rel_gap: float = 1e-7  # HiGHS stops within this relative gap of the proven optimum
    # Tie-break among plans of equal step time, in seconds per unit: prefer keep over recompute over
    # offload, resident over stream (LazyTrain's lambda_z: no needless checkpoints or traffic).
    tie_break_s: float = 1e-9
    # Where a layer's fp32 master, gradient and optimizer states may live: ("host",) plans as plan
    # version 1 did (every layer's on the host), e.g. to compare against it.
    states: tuple[str, ...] = ("host", "gpu")


class BudgetError(ConfigError):
    """A memory budget no plan meets; `smallest_bytes` is the smallest that one plan does."""

    def __init__(self, field_name: str, budget: int, smallest: int):
        self.budget, self.smallest_bytes = budget, smallest
        super().__init__(field_name, f"{format_bytes(budget)} cannot hold this student's step; the smallest that "
                                     f"can is {format_bytes(smallest)}")


def format_bytes(n: int) -> str:
    """Bytes as GiB (or MiB, KiB below one) with one decimal, rounded up: the text given back as a
    budget (`parse_bytes` reads it) is never below `n`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size or unit == "KiB":
            return f"{math.ceil(n / size * 10 - 1e-9) / 10:.1f} {unit}"
    raise AssertionError("unreachable")


# --- the cost model -----------------------------------------------------------------------------


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


# --- the mixed-integer program ------------------------------------------------------------------


@dataclass
class _Program:
    """A MILP under construction: columns, rows `lb <= sum(coef * x) <= ub`, a linear objective.
    Times are in milliseconds and bytes in `_memory_unit`s inside the program, for the solver's
    tolerances."""

    objective: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def var(self, *, binary: bool = False, cost: float = 0.0) -> int:
        self.objective.append(cost)
        self.integer.append(int(binary))
        return len(self.objective) - 1

    def at_least(self, x: int, after: int | None, duration: dict) -> None:
        """x >= after + duration, where duration is {column: coef, None: constant} (ms)."""
        coefs = {x: 1.0}
        if after is not None:
            coefs[after] = coefs.get(after, 0.0) - 1.0
        for col, coef in duration.items():
            if col is not None:
                coefs[col] = coefs.get(col, 0.0) - coef
        self.rows.append((coefs, duration.get(None, 0.0), math.inf))

    def at_most(self, terms: dict, bound: float) -> None:
        """sum(terms) + terms[None] <= bound."""
        coefs = {col: coef for col, coef in terms.items() if col is not None}
        self.rows.append((coefs, -math.inf, bound - terms.get(None, 0.0)))

    def solve(self, time_limit_s: float, mip_rel_gap: float):
        import numpy as np
        from scipy.optimize import LinearConstraint, milp
        from scipy.sparse import coo_array

        cols = len(self.objective)
        r, c, v = zip(*[(i, col, coef) for i, (coefs, _, _) in enumerate(self.rows) for col, coef in coefs.items()])
        A = coo_array((v, (r, c)), shape=(len(self.rows), cols)).tocsr()
        lb, ub = np.array([row[1] for row in self.rows]), np.array([row[2] for row in self.rows])
        integer = np.array(self.integer)
        upper = np.where(integer == 1, 1.0, np.inf)
        from scipy.optimize import Bounds

        return milp(np.array(self.objective), constraints=LinearConstraint(A, lb, ub), integrality=integer,
                    bounds=Bounds(np.zeros(cols), upper),
                    options={"time_limit": max(time_limit_s, 1e-3), "mip_rel_gap": mip_rel_gap})


def _add(*terms: dict) -> dict:
    out: dict = {}
    for t in terms:
        for k, v in t.items():
            out[k] = out.get(k, 0.0) + v
    return out


@dataclass(frozen=True)
class ProgramResult:
    """One program's answer: the plan it chose and its optimum (the step time, seconds)."""

    plan: OffloadPlan
    step_s: float
    objective: float  # the step time plus the tie-break, seconds
    optimal: bool  # False: the time limit stopped HiGHS with a feasible plan


def _horizon_ms(costs: CostTable) -> float:
    """More milliseconds than any event of a step's program can need at its least: every duration
    of the program added up, twice."""
    total = costs.head_s + costs.static_update_s
    for x in costs.layers:
        moved = 2 * (x.weight_bytes + x.boundary_bytes + x.master_bytes) + x.update_in_bytes + x.staging_bytes + x.state_bytes
        total += (2 * x.forward_s + x.backward_s + x.update_gpu_s + x.update_cpu_s
                  + moved / min(costs.h2d_bytes_per_s, costs.d2h_bytes_per_s) + 2 * x.master_bytes / costs.host_bytes_per_s)
    return 2e3 * total + 1.0


def _build(costs: CostTable, depth: int, optimizer: str, settings: SolverSettings):
    """The program of `predict` for a fixed prefetch depth and optimizer side, without budgets.
    Returns (program, choice columns y[i][k], step-time expression, GPU peak rows, host expression):
    each GPU row is an expression that must stay under the GPU budget."""
    ms, per_byte = 1e3, 1.0 / _memory_unit(costs)
    prog, L, d, c = _Program(), len(costs.layers), depth, costs.layers
    h2d = lambda n: n / costs.h2d_bytes_per_s * ms
    d2h = lambda n: n / costs.d2h_bytes_per_s * ms
    host_pass = lambda n: n / costs.host_bytes_per_s * ms
    # Less traffic and less GPU memory first: keep < recompute < offload, resident < stream < states on the GPU.
    tie = lambda a, p, st: 2 * ACTIVATIONS.index(a) + (p == "stream") + 6 * (st == "gpu")
    y = [[prog.var(binary=True, cost=tie(*k) * settings.tie_break_s * ms) for k in CHOICES] for _ in range(L)]
    for i in range(L):
        prog.rows.append(({col: 1.0 for col in y[i]}, 1.0, 1.0))
        for col, (_, p, st) in zip(y[i], CHOICES):
            # Chunk-recurrent training keeps the weights resident: streamed ones would come in again
            # for every chunk's forward and backward, and pass 1's, which the model does not charge.
            if st not in settings.states or (p == "stream" and costs.chunks > 1):
                prog.rows.append(({col: 1.0}, 0.0, 0.0))
    pick = lambda i, scale, act=None, par=None, st=None: {
        y[i][j]: scale for j, (a, p, s) in enumerate(CHOICES) if act in (None, a) and par in (None, p) and st in (None, s)}
    const = lambda v: {None: v}
    prev = lambda seq, j: seq[j] if 0 <= j < L else None

    FE, XF, OF = [prog.var() for _ in range(L)], [prog.var() for _ in range(L)], [prog.var() for _ in range(L)]
    for i in range(L):
        weights_in = pick(i, h2d(c[i].weight_bytes), par="stream")
        prog.at_least(XF[i], prev(XF, i - 1), weights_in)
        prog.at_least(XF[i], prev(FE, i - d - 1), weights_in)
        fwd = const(c[i].forward_s * ms)
        for before in (prev(FE, i - 1), XF[i], prev(OF, i - d - 1)):
            prog.at_least(FE[i], before, fwd)
        out = pick(i, d2h(c[i].boundary_bytes), act="offload")
        prog.at_least(OF[i], prev(OF, i - 1), out)
        prog.at_least(OF[i], FE[i], out)

    BE, XB, GB = ([prog.var() for _ in range(L)] for _ in range(3))
    accumulated = costs.micro_batches > 1
    for i in reversed(range(L)):
        copy = _add(pick(i, h2d(c[i].weight_bytes), act="recompute", par="stream"),
                    pick(i, h2d(c[i].weight_bytes), act="offload", par="stream"),
                    pick(i, h2d(c[i].boundary_bytes), act="offload"),
                    pick(i, accumulated * h2d(c[i].master_bytes), st="host"))
        prog.at_least(XB[i], XB[i + 1] if i + 1 < L else XF[-1], copy)
        prog.at_least(XB[i], BE[i + d + 1] if i + d + 1 < L else FE[-1], copy)
        bwd = _add(const((c[i].backward_s + c[i].forward_s) * ms), pick(i, -c[i].forward_s * ms, act="keep"))
        if i + 1 < L:
            prog.at_least(BE[i], BE[i + 1], bwd)
        else:
            prog.at_least(BE[i], FE[-1], _add(bwd, const(costs.head_s * ms)))
        prog.at_least(BE[i], XB[i], bwd)
        if i + d + 1 < L:
            prog.at_least(BE[i], GB[i + d + 1], bwd)
        grad = pick(i, d2h(c[i].master_bytes), st="host")
        prog.at_least(GB[i], GB[i + 1] if i + 1 < L else OF[-1], grad)
        prog.at_least(GB[i], BE[i], grad)
    T, T2 = prog.var(cost=(costs.micro_batches - 1)), prog.var(cost=1.0)
    for end in (BE[0], XB[0], GB[0]):
        prog.at_least(T, end, {})
    prog.at_least(T2, T, {})
    device_update = _add(const(costs.static_update_s * ms), *[pick(i, c[i].update_gpu_s * ms, st="gpu")
                                                               for i in range(L)])
    if optimizer == "cpu":
        start = prog.var()  # every gradient on the host
        for end in (BE[0], GB[0]):
            prog.at_least(start, end, {})
        U, R = [prog.var() for _ in range(L)], [prog.var() for _ in range(L)]
        for i in range(L):
            prog.at_least(U[i], U[i - 1] if i else start,
                          pick(i, c[i].update_cpu_s * ms + host_pass(2 * c[i].master_bytes), st="host"))
            refresh = pick(i, h2d(c[i].weight_bytes), par="resident", st="host")
            prog.at_least(R[i], R[i - 1] if i else XB[0], refresh)
            prog.at_least(R[i], U[i], refresh)
        prog.at_least(T2, U[-1], {})
        prog.at_least(T2, R[-1], {})
        prog.at_least(T2, start, device_update)
    else:  # `_ring`: positions k of the order, layer L-1-k
        LD, UP, WB = ([prog.var() for _ in range(L)] for _ in range(3))
        big = _horizon_ms(costs)
        for k in range(L):
            i = L - 1 - k
            if k < UPDATE_SLOTS:
                load = pick(i, h2d(c[i].master_bytes + c[i].state_bytes), st="host")
                waits = (BE[i],)
            else:
                load = pick(i, h2d(c[i].update_in_bytes), st="host")
                waits = (GB[i], WB[k - UPDATE_SLOTS])
            for before in (LD[k - 1] if k else None, *waits):
                prog.at_least(LD[k], before, load)
            update = pick(i, c[i].update_gpu_s * ms, st="host")
            for before in (UP[k - 1] if k else BE[0], LD[k]):
                prog.at_least(UP[k], before, update)
            out = pick(i, d2h(c[i].master_bytes + c[i].state_bytes + c[i].staging_bytes), st="host")
            for before in (WB[k - 1] if k else None, UP[k]):
                prog.at_least(WB[k], before, out)
            # A streamed host layer's next forward waits for its copies out (big M: no bound otherwise).
            ahead = h2d(c[i].weight_bytes) - sum(x.forward_s for x in c[:i]) * ms
            prog.at_least(T2, WB[k], _add({None: ahead - big}, pick(i, big, par="stream", st="host")))
        prog.at_least(T2, UP[-1], device_update)
    step = {T: (costs.micro_batches - 1) / ms, T2: 1.0 / ms}  # seconds

    # Memory (in units): the two GPU peaks of `_peaks` and the host's.
    MW, MA = prog.var(), prog.var()
    for i in range(L):
        prog.at_least(MW, None, _add(pick(i, c[i].weight_bytes * per_byte, "recompute", "stream"),
                                     pick(i, c[i].weight_bytes * per_byte, "offload", "stream")))
        prog.at_least(MA, None, pick(i, c[i].boundary_bytes * per_byte, act="offload"))
    resident = [pick(i, c[i].weight_bytes * per_byte, par="resident") for i in range(L)]
    states = [pick(i, c[i].update_in_bytes * per_byte, st="gpu") for i in range(L)]
    turnaround = _add(const((costs.static_gpu_bytes + _fixed_gpu_bytes(costs, d) + _optimizer_slices(costs, optimizer))
                            * per_byte),
                      {MW: d + 1.0, MA: 2.0 * (d + 1)}, *resident, *states,
                      *[pick(i, c[i].weight_bytes * per_byte, "keep", "stream") for i in range(L)],
                      *[pick(i, c[i].keep_bytes * per_byte, act="keep") for i in range(L)],
                      *[pick(i, c[i].boundary_bytes * per_byte, act="recompute") for i in range(L)])
    optimizer_phase = _add(const((costs.static_gpu_bytes + _optimizer_slices(costs, optimizer)) * per_byte),
                           *resident, *states)
    host = _add(const(costs.static_host_bytes * per_byte),
                *[pick(i, c[i].host_bytes * per_byte, st="host") for i in range(L)],
                *[pick(i, c[i].boundary_bytes * per_byte, act="offload") for i in range(L)])
    return prog, y, step, (turnaround, optimizer_phase), host


# Budgets shrink by this many memory units inside the program: ten times HiGHS's feasibility
# tolerance (1e-6), so a plan the program accepts is within the budget in whole bytes too.
_BUDGET_SLACK = 1e-5


def _memory_unit(costs: CostTable) -> float:
    """Bytes per unit of memory in the program: all the bytes a step could hold, so one unit of
    the solver's tolerance is a small share of any budget."""
    return float(costs.static_gpu_bytes + costs.static_host_bytes
                 + sum(x.weight_bytes + x.keep_bytes + x.boundary_bytes + x.workspace_bytes + x.host_bytes
                       for x in costs.layers))


def solve_fixed(costs: CostTable, gpu_memory: int | None, host_memory: int | None, *, depth: int, optimizer: str,
                time_limit_s: float = 60.0, settings: SolverSettings = SolverSettings()) -> ProgramResult | None:
    """The fastest plan at this prefetch depth and optimizer side under the budgets (bytes; None:
    unbounded); None when no plan meets them (or the time limit found none)."""
    prog, y, step, gpu_rows, host = _build(costs, depth, optimizer, settings)
    unit = _memory_unit(costs)
    for row in gpu_rows:
        if gpu_memory is not None:
            prog.at_most(row, gpu_memory / unit - _BUDGET_SLACK)
    if host_memory is not None:
        prog.at_most(host, host_memory / unit - _BUDGET_SLACK)
    result = prog.solve(time_limit_s, settings.mip_rel_gap)
    if result.x is None:
        return None
    plan = _plan_of(result.x, y, depth, optimizer)
    step_s = sum(coef * result.x[col] for col, coef in step.items()) + costs.pass1_s
    return ProgramResult(plan, step_s, result.fun / 1e3 + costs.pass1_s, optimal=result.status == 0)


def program_step_s(costs: CostTable, plan: OffloadPlan) -> float:
    """The program's step time with every binary fixed to `plan` (no budgets): equal to
    `predict(costs, plan).step_s` when the program encodes the cost model exactly (tests hold it)."""
    prog, y, step, _, _ = _build(costs, plan.prefetch_depth, plan.optimizer, SolverSettings(tie_break_s=0.0))
    for cols, lp in zip(y, plan.layers):
        for col, choice in zip(cols, CHOICES):
            value = float(choice == (lp.activation, lp.params, lp.states))
            prog.rows.append(({col: 1.0}, value, value))
    result = prog.solve(60.0, 0.0)
    assert result.status == 0, result.message
    return sum(coef * result.x[col] for col, coef in step.items()) + costs.pass1_s


def _plan_of(x, y, depth: int, optimizer: str) -> OffloadPlan:
    layers = []
    for cols in y:
        a, p, st = CHOICES[max(range(len(CHOICES)), key=lambda j: x[cols[j]])]
        layers.append(LayerPlan(activation=a, params=p, states=st))
    return OffloadPlan(layers=tuple(layers), prefetch_depth=depth, optimizer=optimizer)


def smallest_budget(costs: CostTable, which: str, other_budget: int | None, *, time_limit_s: float = 60.0,
                    settings: SolverSettings = SolverSettings()) -> tuple[OffloadPlan, int]:
    """(a plan, its peak): the plan of least GPU peak (which="gpu") under the host budget
    `other_budget`, or of least host peak (which="host") under that GPU budget. Prefetch depth 0
    and the CPU optimizer hold the least, so the program fixes them."""
    prog, y, _, gpu_rows, host = _build(costs, 0, "cpu", settings)
    unit = _memory_unit(costs)
    prog.objective = [0.0] * len(prog.objective)
    if which == "gpu":
        peak = prog.var(cost=1.0)
        for row in gpu_rows:
            prog.at_least(peak, None, row)
        if other_budget is not None:
            prog.at_most(host, other_budget / unit - _BUDGET_SLACK)
    else:
        for col, coef in host.items():
            if col is not None:
                prog.objective[col] += coef
        for row in gpu_rows:
            if other_budget is not None:
                prog.at_most(row, other_budget / unit - _BUDGET_SLACK)
    result = prog.solve(time_limit_s, settings.mip_rel_gap)
    if result.x is None:
        return None, None
    plan = _plan_of(result.x, y, 0, "cpu")
    gpu_peak, host_peak = _peaks(costs, plan)
    return plan, gpu_peak if which == "gpu" else host_peak


def solve(costs: CostTable, gpu_memory: int, host_memory: int, *, time_limit_s: float = 60.0,
          settings: SolverSettings = SolverSettings()) -> OffloadPlan:
    """The plan of least predicted step time whose peaks fit `gpu_memory` and `host_memory` (bytes),
    over every per-layer choice, the prefetch depths of `settings` and both optimizer sides (with
    chunk-recurrent costs, resident weights only). The plan carries `predict`'s figures, the
    budgets and the chunk engine's chunk size and resident pages as measured. A budget no plan meets raises BudgetError
    naming the option and the smallest budget that one plan meets (under the other budget)."""
    runs = [(d, side) for d in settings.depths for side in OPTIMIZER_SIDES]
    best = None
    for d, side in runs:
        found = solve_fixed(costs, gpu_memory, host_memory, depth=d, optimizer=side,
                            time_limit_s=time_limit_s / len(runs), settings=settings)
        if found is not None and (best is None or found.objective < best.objective - 1e-12):
            best = found
    if best is None:
        _raise_budget_error(costs, gpu_memory, host_memory, time_limit_s, settings)
    if not best.optimal:
        logger.warning("the planner's solver hit its time limit; using the best plan it found (predicted step "
                       "%.4g s)", best.step_s)
    return replace(best.plan, gpu_memory=gpu_memory, host_memory=host_memory, predicted=predict(costs, best.plan),
                   chunk_tokens=costs.chunk_tokens, resident_pages=costs.resident_pages)


def _raise_budget_error(costs, gpu_memory, host_memory, time_limit_s, settings):
    slack = math.ceil(2 * _BUDGET_SLACK * _memory_unit(costs))
    least = lambda which, other: smallest_budget(costs, which, other, time_limit_s=time_limit_s, settings=settings)[1]
    least_host = least("host", gpu_memory)  # states on the GPU where its budget allows take the least host memory
    if least_host is not None and least_host + slack > host_memory:
        raise BudgetError("host_memory", host_memory, _rounded_up(least_host + slack))
    least_gpu = least("gpu", host_memory if least_host is not None else None)
    if least_gpu is None:
        least_gpu = least("gpu", None)
    if least_gpu is None or least_gpu + slack <= gpu_memory:
        raise ConfigError("gpu_memory", f"is {format_bytes(gpu_memory)}: the planner found no plan within its time "
                                        "limit; give more memory or plan again")
    raise BudgetError("gpu_memory", gpu_memory, _rounded_up(least_gpu + slack))


def _rounded_up(n: int) -> int:
    from student.offload_plan import parse_bytes

    return parse_bytes(format_bytes(n).replace(" ", ""))


# --- planning a training run ---------------------------------------------------------------------


def make_plan(config, gpu_memory: int | None = None, host_memory: int | None = None, *,
              time_limit_s: float = 60.0) -> tuple[OffloadPlan, CostTable]:
    """Profile `config`'s step and solve for its plan under the budgets (bytes; None: config.offload's
    when TrainConfig has that part and it sets one, else `default_budgets`). Returns (plan, costs)."""
    from distill.devices import resolve_device
    from student.offload_plan import parse_bytes
    from student.step_profile import default_budgets, profile

    offload = getattr(config, "offload", None)
    if gpu_memory is None and offload is not None and offload.gpu_memory is not None:
        gpu_memory = parse_bytes(offload.gpu_memory, "gpu_memory")
    if host_memory is None and offload is not None and offload.host_memory is not None:
        host_memory = parse_bytes(offload.host_memory, "host_memory")
    default_gpu, default_host = default_budgets(resolve_device(config.device))
    costs = profile(config)
    plan = solve(costs, gpu_memory or default_gpu, host_memory or default_host, time_limit_s=time_limit_s)
    return plan, costs


def plan_for_training(config, gpu_memory: int | None = None, host_memory: int | None = None) -> OffloadPlan:
    """The plan `train-student --offload auto` trains with: `make_plan` without the costs."""
    return make_plan(config, gpu_memory, host_memory)[0]


def plan_table(plan: OffloadPlan, costs: CostTable) -> str:
    """The plan as a table a person reads: per layer its decisions, bytes and predicted time; then
    the step's totals against the budgets."""
    import io

    from rich.console import Console
    from rich.table import Table

    size = lambda n: format_bytes(n) if n else "-"
    table = Table(title=f"offload plan: prefetch depth {plan.prefetch_depth}, optimizer update on the "
                        f"{plan.optimizer.upper()}, {costs.micro_batches} micro-batch(es) a step")
    for column in ("layer", "activation", "params", "states", "weights", "input", "kept for backward", "predicted"):
        table.add_column(column, justify="left" if column in ("activation", "params", "states") else "right")
    predicted = plan.predicted
    for i, (lp, c) in enumerate(zip(plan.layers, costs.layers)):
        kept = {"keep": c.keep_bytes, "recompute": c.boundary_bytes, "offload": 0}[lp.activation]
        seconds = f"{predicted.layer_s[i] * 1e3:.2f} ms" if predicted.layer_s else "-"
        table.add_row(str(i), lp.activation, lp.params, lp.states, size(c.weight_bytes), size(c.boundary_bytes),
                      size(kept), seconds)
    console = Console(file=io.StringIO(), width=110, color_system=None, force_terminal=False)
    console.print(table)
    budget = lambda n: f" of {format_bytes(n)}" if n is not None else ""
    lines = [f"predicted step time {predicted.step_s * 1e3:.2f} ms (compute, recompute and the transfers it "
             "cannot hide; per layer: all micro-batches)",
             "phases: " + ", ".join(f"{name} {predicted.phase_s.get(name, 0.0) * 1e3:.2f} ms" for name in PHASES),
             *([f"chunk-recurrent: {plan.chunk_tokens} tokens a chunk, {costs.chunks} chunks a micro-batch "
                f"(each a micro-batch above; pass 1 {costs.pass1_s * 1e3:.2f} ms a step); {plan.resident_pages} "
                f"key/value pages resident on the GPU ({format_bytes(costs.kv_gpu_bytes)}), "
                f"{format_bytes(costs.static_host_bytes)} on the host"] if plan.chunk_tokens is not None else []),
             f"peak GPU memory {format_bytes(predicted.gpu_peak_bytes)}{budget(plan.gpu_memory)}; "
             f"peak host memory {format_bytes(predicted.host_peak_bytes)}{budget(plan.host_memory)}",
             f"measured: host->device {costs.h2d_bytes_per_s / 1e9:.1f} GB/s, device->host "
             f"{costs.d2h_bytes_per_s / 1e9:.1f} GB/s, host passes over gradients "
             f"{costs.host_bytes_per_s / 1e9:.1f} GB/s; static GPU bytes {format_bytes(costs.static_gpu_bytes)}"]
    return console.file.getvalue() + "\n".join(lines)
