"""The offload planner (LazyTrain, arXiv 2608.11919 §3.2): measure a step, solve for the fastest plan.

`profile` (student/planner/profile.py) times one real micro-batch of the student layer by layer and
measures bytes and copy bandwidths into a `CostTable`; `predict` (student/planner/costs.py) is the cost
model of a plan (student/offload/plan.py says what each decision means); `solve` finds the plan of least predicted step time under a GPU and a
host memory budget with a mixed-integer program (scipy.optimize.milp, HiGHS) that encodes `predict`
exactly, so the program's optimum is `predict`'s step time of the plan it returns.
`plan_for_training` does all three for a TrainConfig (`distill plan`, `train-student --offload auto`;
student/planner/report.py prints a plan).

LazyTrain places activation checkpoints on a recomputation path and charges the transfer traffic a
compute window cannot hide (its eq. 5). Here the windows are the layers' forward and backward
compute, and the traffic is the runtime's own: streamed weights, offloaded layer inputs, gradients
and the optimizer's states. Instead of assigning bytes to windows, the program holds the event
times of the runtime's three queues (compute, host->device copies, device->host copies) as
continuous variables with "starts after" constraints: the least solution of such constraints is the
simulation `predict` runs, so minimising the step time over the binaries is minimising `predict`.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field, replace

import numpy as np

from distill.configs import ConfigError
from distill.devices import resolve_device
from student.planner.costs import (PHASES, embedding_on_host, kept_attention, kv_options, kv_residency, pass_one_forwards,
                                   predict)
from student.planner.peaks import (backward_gpu_bytes, beside_backward, gpu_peak_terms, held_activation_bytes, in_turn,
                                   optimizer_slices, peaks, widened_host_bytes)
from student.offload.config import format_bytes, parse_bytes
from student.offload.plan import UPDATE_SLOTS, ChunkChoice, LayerPlan, OffloadPlan
from student.planner.profile import ProfileSettings, default_budgets, profile
from student.planner.table import CostTable, LayerCosts
from teacher_cache.reader import CacheReader

__all__ = ["PHASES", "LayerCosts", "CostTable", "SolverSettings", "BudgetError", "ProfileSettings", "predict", "solve",
           "solve_kept", "smallest_budget", "program_step_s", "profile", "choose_chunks", "embedding_homes", "fastest",
           "make_plan", "plan_for_training"]

logger = logging.getLogger(__name__)

ACTIVATIONS = ("keep", "recompute", "offload")
HOMES = (("resident", "host"), ("stream", "host"), ("resident", "gpu"))  # (params, states) a layer may take
CHOICES = tuple((a, p, st) for a in ACTIVATIONS for p, st in HOMES)  # one binary per layer and choice in the program
OPTIMIZER_SIDES = ("cpu", "gpu")
GiB = 2**30


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
    # The longest one search for the smallest budget a plan meets runs (`smallest_budget`: what a
    # budget error names, and pass 1's kept chunks). Its best plan comes early and the rest of the
    # search proves it least (notes/long-context.md, "The host-budget refusal at 28 layers").
    budget_search_s: float = 5.0


class BudgetError(ConfigError):
    """A memory budget no plan meets; `smallest_bytes` is the smallest that one plan does. For the GPU
    budget, `peak_terms` is that plan's predicted GPU peak term by term (`gpu_peak_terms`): what
    holds the memory no plan can move."""

    def __init__(self, field_name: str, budget: int, smallest: int, peak_terms: dict | None = None, why: str = ""):
        self.budget, self.smallest_bytes, self.peak_terms = budget, smallest, peak_terms
        super().__init__(field_name, f"{format_bytes(budget)} cannot hold this student's step; the smallest that "
                                     f"can is {format_bytes(smallest)}{why}")


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
        # scipy takes most of a second to import: the trainer imports this module (student/offload/run.py)
        # on every run, and only a run that plans solves a program
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array

        cols = len(self.objective)
        r, c, v = zip(*[(i, col, coef) for i, (coefs, _, _) in enumerate(self.rows) for col, coef in coefs.items()])
        A = coo_array((v, (r, c)), shape=(len(self.rows), cols)).tocsr()
        lb, ub = np.array([row[1] for row in self.rows]), np.array([row[2] for row in self.rows])
        integer = np.array(self.integer)
        upper = np.where(integer == 1, 1.0, np.inf)
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
        moved = 2 * (x.weight_bytes + x.boundary_bytes + x.master_bytes) + x.slot_bytes + x.state_bytes
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
        for col, (_, _, st) in zip(y[i], CHOICES):
            if st not in settings.states:
                prog.rows.append(({col: 1.0}, 0.0, 0.0))
    pick = lambda i, scale, act=None, par=None, st=None: {
        y[i][j]: scale for j, (a, p, s) in enumerate(CHOICES) if act in (None, a) and par in (None, p) and st in (None, s)}
    const = lambda v: {None: v}
    prev = lambda seq, j: seq[j] if 0 <= j < L else None
    delay_in, delay_out = (x * ms for x in costs.duplex_delays())  # ms a byte of the other direction

    def bus(ends: list[int], order, start: int | None, step) -> None:
        """predict's bus: ends[k] >= start + step(k') summed over the positions k' of `order` up to k.
        No rows where the delays are zero (the queues' own constraints imply them)."""
        if delay_in == 0.0 and delay_out == 0.0:
            return
        for k in order:
            total = prog.var()
            prog.at_least(total, start, step(k))
            prog.at_least(ends[k], total, {})
            start = total

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
    input_out = lambda j: pick(j, c[j].boundary_bytes * delay_in, act="offload") if j >= 0 else {}
    bus(XF, range(L), None, lambda i: _add(pick(i, h2d(c[i].weight_bytes), par="stream"), input_out(i - 2 * d - 2)))
    bus(OF, range(L), None, lambda i: _add(pick(i, d2h(c[i].boundary_bytes), act="offload"),
                                           pick(i, c[i].weight_bytes * delay_out, par="stream")))

    BE, XB, GB = ([prog.var() for _ in range(L)] for _ in range(3))
    accumulated = costs.micro_batches > 1
    moved_in = lambda i, per_byte: _add(pick(i, c[i].weight_bytes * per_byte, act="recompute", par="stream"),
                                        pick(i, c[i].weight_bytes * per_byte, act="offload", par="stream"),
                                        pick(i, c[i].boundary_bytes * per_byte, act="offload"),
                                        pick(i, accumulated * c[i].master_bytes * per_byte, st="host"))
    grad_out = lambda i, per_byte: pick(i, c[i].grad_bytes(costs.accumulates) * per_byte, st="host") if i < L else {}
    for i in reversed(range(L)):
        copy = moved_in(i, ms / costs.h2d_bytes_per_s)
        prog.at_least(XB[i], XB[i + 1] if i + 1 < L else XF[-1], copy)
        prog.at_least(XB[i], BE[i + d + 1] if i + d + 1 < L else FE[-1], copy)
        bwd = _add(const((c[i].backward_s + c[i].recompute_s) * ms), pick(i, -c[i].recompute_s * ms, act="keep"))
        if i + 1 < L:
            prog.at_least(BE[i], BE[i + 1], bwd)
        else:
            prog.at_least(BE[i], FE[-1], _add(bwd, const(costs.head_s * ms)))
        prog.at_least(BE[i], XB[i], bwd)
        if i + d + 1 < L:
            prog.at_least(BE[i], GB[i + d + 1], bwd)
        grad = pick(i, d2h(c[i].grad_bytes(costs.accumulates)), st="host")
        prog.at_least(GB[i], GB[i + 1] if i + 1 < L else OF[-1], grad)
        prog.at_least(GB[i], BE[i], grad)
    bus(XB, reversed(range(L)), FE[-1], lambda i: _add(moved_in(i, ms / costs.h2d_bytes_per_s),
                                                       grad_out(i + 2 * d + 2, delay_in)))
    bus(GB, reversed(range(L)), FE[-1], lambda i: _add(grad_out(i, ms / costs.d2h_bytes_per_s), moved_in(i, delay_out)))
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
                          pick(i, c[i].update_cpu_s * ms + host_pass(c[i].grad_bytes(costs.accumulates)
                                                                      + c[i].master_bytes), st="host"))
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
                load = pick(i, h2d(c[i].update_in_bytes(costs.accumulates)), st="host")
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
        ring_in = lambda i, per_byte: pick(i, c[i].update_in_bytes(costs.accumulates) * per_byte, st="host")
        ring_out = lambda i, per_byte: pick(i, (c[i].master_bytes + c[i].state_bytes + c[i].staging_bytes) * per_byte,
                                            st="host")
        R = UPDATE_SLOTS
        bus(LD, range(R, L), BE[0], lambda k: _add(ring_in(L - 1 - k, ms / costs.h2d_bytes_per_s),
                                                   ring_out(L - 1 - k + R, delay_in)))
        bus(WB, range(L), BE[0], lambda k: _add(ring_out(L - 1 - k, ms / costs.d2h_bytes_per_s),
                                                ring_in(L - 1 - k, delay_out) if k >= R else {}))
    step = {T: (costs.micro_batches - 1) / ms, T2: 1.0 / ms}  # seconds
    # Pass 1 (`pass_one_s`): its forwards from empty queues, a layer's seconds spread evenly, a
    # streamed layer's weights coming in when the forward depth + 1 places before it ends.
    n1 = pass_one_forwards(costs)
    if n1:
        P1, Y1 = [prog.var() for _ in range(L)], [prog.var() for _ in range(L)]
        pass1 = const(costs.pass1_s / (n1 * L) * ms)
        for i in range(L):
            weights_in = pick(i, h2d(c[i].weight_bytes), par="stream")
            prog.at_least(Y1[i], prev(Y1, i - 1), weights_in)
            prog.at_least(Y1[i], prev(P1, i - d - 1), weights_in)
            for before in (prev(P1, i - 1), Y1[i]):
                prog.at_least(P1[i], before, pass1)
        prog.objective[P1[-1]] += n1
        step[P1[-1]] = n1 / ms

    # Memory (in units): the two GPU peaks of `peaks` and the host's.
    MW, MA = prog.var(), prog.var()
    for i in range(L):
        prog.at_least(MW, None, _add(pick(i, c[i].weight_bytes * per_byte, "recompute", "stream"),
                                     pick(i, c[i].weight_bytes * per_byte, "offload", "stream")))
        prog.at_least(MA, None, pick(i, c[i].boundary_bytes * per_byte, act="offload"))
    resident = [pick(i, c[i].weight_bytes * per_byte, par="resident") for i in range(L)]
    states = [pick(i, c[i].gpu_state_bytes(costs.accumulates) * per_byte, st="gpu") for i in range(L)]
    # The device's fp32 buffer the "gpu" layers' one-backward gradients are widened into in the update: the largest one's.
    MS = prog.var()
    for i in range(L):
        prog.at_least(MS, None, pick(i, c[i].gpu_widened_bytes(costs.accumulates) * per_byte, st="gpu"))
    # What the turnaround holds one after the other (`in_turn`), the largest: every layer's held
    # activations beside the head's workspace or beside the embedding's gradient, or layer j's
    # backward (recomputing its activations unless it keeps them) beside those of layers 0..j.
    held = [_add(*[pick(i, held_activation_bytes(c[i], a) * per_byte, act=a) for a in ACTIVATIONS]) for i in range(L)]
    apart = in_turn(costs, d, ["keep"] * L)
    MT, beside = prog.var(), backward_gpu_bytes(costs, d) + beside_backward(costs)
    up_to = None  # at least the held activations of layers 0..j (a chain of variables keeps the program sparse)
    for j in range(L):
        up_to, before = prog.var(), up_to
        prog.at_least(up_to, before, held[j])
        prog.at_least(MT, up_to, _add(const((beside + c[j].workspace_bytes) * per_byte),
                                      *[pick(j, c[j].keep_bytes * per_byte, act=a) for a in ("recompute", "offload")]))
    for name in ("head_workspace", "embedding_gradient"):
        prog.at_least(MT, up_to, const(apart[name][1] * per_byte))
    turnaround = _add(const((costs.static_gpu_bytes + costs.kv_gpu_bytes + optimizer_slices(costs, optimizer))
                            * per_byte),
                      {MW: d + 1.0, MA: 2.0 * (d + 1), MT: 1.0}, *resident, *states,
                      *[pick(i, c[i].weight_bytes * per_byte, "keep", "stream") for i in range(L)])
    optimizer_phase = _add(const((costs.static_gpu_bytes + optimizer_slices(costs, optimizer) + costs.embedding_update_bytes)
                                 * per_byte),
                           {MS: 1.0}, *resident, *states)
    # The fp32 buffer the update on the CPU widens gradients into: the largest host layer's master.
    MH = prog.var()
    if widened_host_bytes(costs, optimizer, [True] * L):
        for i in range(L):
            prog.at_least(MH, None, pick(i, c[i].master_bytes * per_byte, st="host"))
    host = _add(const(costs.static_host_bytes * per_byte), {MH: 1.0},
                *[pick(i, c[i].host_bytes(costs.accumulates) * per_byte, st="host") for i in range(L)],
                *[pick(i, costs.offloaded_bytes(c[i]) * per_byte, act="offload") for i in range(L)])
    return prog, y, step, (turnaround, optimizer_phase), host


# Budgets shrink by this many memory units inside the program: ten times HiGHS's feasibility
# tolerance (1e-6), so a plan the program accepts is within the budget in whole bytes too.
_BUDGET_SLACK = 1e-5


def _memory_unit(costs: CostTable) -> float:
    """Bytes per unit of memory in the program: all the bytes a step could hold, so one unit of
    the solver's tolerance is a small share of any budget."""
    return float(costs.static_gpu_bytes + costs.loss_workspace_bytes + costs.static_host_bytes
                 + sum(x.weight_bytes + x.keep_bytes + x.boundary_bytes + x.workspace_bytes
                       + x.host_bytes(costs.accumulates) for x in costs.layers))


def solve_fixed(costs: CostTable, gpu_memory: int | None, host_memory: int | None, *, depth: int, optimizer: str,
                time_limit_s: float = 60.0, settings: SolverSettings = SolverSettings()) -> ProgramResult | None:
    """The fastest plan at this prefetch depth and optimizer side under the budgets (bytes; None:
    unbounded); None when no plan meets them (or the time limit found none)."""
    prog, y, step, gpu_rows, host = _build(costs, depth, optimizer, settings)
    unit = _memory_unit(costs)
    for row in gpu_rows:
        if gpu_memory is not None:
            prog.at_most(row, (gpu_memory - costs.gpu_reserve_bytes) / unit - _BUDGET_SLACK)
    if host_memory is not None:
        prog.at_most(host, host_memory / unit - _BUDGET_SLACK)
    result = prog.solve(time_limit_s, settings.mip_rel_gap)
    if result.x is None:
        return None
    plan = _plan_of(result.x, y, depth, optimizer)
    step_s = sum(coef * result.x[col] for col, coef in step.items())
    return ProgramResult(plan, step_s, result.fun / 1e3, optimal=result.status == 0)


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
    return sum(coef * result.x[col] for col, coef in step.items())


def _plan_of(x, y, depth: int, optimizer: str) -> OffloadPlan:
    layers = []
    for cols in y:
        a, p, st = CHOICES[max(range(len(CHOICES)), key=lambda j: x[cols[j]])]
        layers.append(LayerPlan(activation=a, params=p, states=st))
    return OffloadPlan(layers=tuple(layers), prefetch_depth=depth, optimizer=optimizer)


@functools.lru_cache(maxsize=32)  # a refusal asks again for what choosing pass 1's kept chunks asked
def smallest_budget(costs: CostTable, which: str, other_budget: int | None, *, time_limit_s: float = 60.0,
                    settings: SolverSettings = SolverSettings()) -> tuple[OffloadPlan, int]:
    """(a plan, its peak): the plan of least GPU peak (which="gpu") under the host budget
    `other_budget`, or of least host peak (which="host") under that GPU budget, the best found in
    settings.budget_search_s (at most `time_limit_s`). Prefetch depth 0 and the CPU optimizer hold
    the least, so the program fixes them."""
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
                prog.at_most(row, (other_budget - costs.gpu_reserve_bytes) / unit - _BUDGET_SLACK)
    result = prog.solve(min(time_limit_s, settings.budget_search_s), settings.mip_rel_gap)
    if result.x is None and result.status == 1 and time_limit_s > settings.budget_search_s:  # no plan yet: all of it
        result = prog.solve(time_limit_s, settings.mip_rel_gap)
    if result.x is None:
        return None, None
    plan = _plan_of(result.x, y, 0, "cpu")
    gpu_peak, host_peak = peaks(costs, plan)
    return plan, gpu_peak if which == "gpu" else host_peak


def solve(costs: CostTable, gpu_memory: int, host_memory: int, *, time_limit_s: float = 60.0,
          settings: SolverSettings = SolverSettings()) -> OffloadPlan:
    """The plan of least predicted step time whose peaks fit `gpu_memory` and `host_memory` (bytes),
    over every per-layer choice, the prefetch depths of `settings` and both optimizer sides. The plan
    carries `predict`'s figures, the budgets and the chunk engine's chunk size and key/value
    residency as in `costs`. A budget no plan meets raises BudgetError naming the option and the
    smallest budget that one plan meets (under the other budget)."""
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
    kv = costs.kv
    return replace(best.plan, gpu_memory=gpu_memory, host_memory=host_memory, predicted=predict(costs, best.plan),
                   chunk_tokens=costs.chunk_tokens, resident_pages=costs.resident_pages,
                   kv_offload=kv.kv_offload if kv else None, offload_pages=kv.offload_pages if kv else None,
                   keep_attention_chunks=kv.keep_chunks if kv else None, embedding=costs.embedding)


def solve_kept(costs: CostTable, gpu_memory: int, host_memory: int, *, time_limit_s: float = 60.0,
               settings: SolverSettings = SolverSettings()) -> tuple[OffloadPlan, CostTable]:
    """`solve`, and when `costs` is chunk-recurrent on a GPU and was measured keeping every chunk's
    attention output (the run set no --keep-attention-chunks), the most kept chunks whose outputs
    fit the host budget: keeping one saves pass 2 an attention forward, so more is faster, and the
    outputs are pinned host memory (at a million tokens, more than the pages). Every chunk's when
    that plan fits; else N from the least host peak any plan has with none kept (`smallest_budget`)
    plus N chunks' outputs (the kept bytes are a constant of the host peak), one chunk fewer than
    all; none when even that plan does not fit. Returns (plan, its costs as `kept_attention`
    priced them)."""
    kv = costs.kv
    try:
        return solve(costs, gpu_memory, host_memory, time_limit_s=time_limit_s, settings=settings), costs
    except BudgetError as e:
        if e.field != "host_memory" or kv is None or kv.keep_chunks is not None or not kv.offloadable or kv.chunks < 2:
            raise
    none_kept = kept_attention(costs, 0)
    least = smallest_budget(none_kept, "host", gpu_memory, time_limit_s=time_limit_s, settings=settings)[1]
    per_chunk = kv.kept_chunk_bytes
    slack = math.ceil(2 * _BUDGET_SLACK * _memory_unit(costs))
    keep = 0 if least is None else min(max((host_memory - slack - least) // per_chunk, 0), kv.chunks - 2)
    for n in dict.fromkeys((keep, 0)):  # N, else none kept (whose failure is the error to give)
        kept = kept_attention(costs, n)
        try:
            plan = solve(kept, gpu_memory, host_memory, time_limit_s=time_limit_s, settings=settings)
        except BudgetError:
            if n == 0:
                raise
            continue
        logger.info("pass 1 keeps the attention outputs of the last %d of %d chunks (--keep-attention-chunks) to "
                    "fit --host-memory %s", n, kv.chunks - 1, format_bytes(host_memory))
        return plan, kept


def _raise_budget_error(costs, gpu_memory, host_memory, time_limit_s, settings):
    slack = math.ceil(2 * _BUDGET_SLACK * _memory_unit(costs))
    least = lambda which, other: smallest_budget(costs, which, other, time_limit_s=time_limit_s, settings=settings)[1]
    least_host = least("host", gpu_memory)  # states on the GPU where its budget allows take the least host memory
    if least_host is not None and least_host + slack > host_memory:
        loader = costs.loader_host_bytes
        why = (f" (the loader's batches and decoded shards hold {format_bytes(loader)} of it: --loader-shards 1 keeps "
               "fewer decoded shards, and a cache of fewer sequences a shard, cache-teacher --shard-size, holds "
               "less)" if loader >= least_host / 10 else "")
        raise BudgetError("host_memory", host_memory, _rounded_up(least_host + slack), why=why)
    plan, least_gpu = smallest_budget(costs, "gpu", host_memory if least_host is not None else None,
                                      time_limit_s=time_limit_s, settings=settings)
    if least_gpu is None:
        plan, least_gpu = smallest_budget(costs, "gpu", None, time_limit_s=time_limit_s, settings=settings)
    if least_gpu is not None:  # a budget holds the peak and the allocator's reserve
        least_gpu += costs.gpu_reserve_bytes
    if least_gpu is None or least_gpu + slack <= gpu_memory:
        raise ConfigError("gpu_memory", f"is {format_bytes(gpu_memory)}: the planner found no plan within its time "
                                        "limit; give more memory or plan again")
    raise BudgetError("gpu_memory", gpu_memory, _rounded_up(least_gpu + slack), gpu_peak_terms(costs, plan))


def _rounded_up(n: int) -> int:
    return parse_bytes(format_bytes(n).replace(" ", ""))


# --- the chunk size and the key/value pages ------------------------------------------------------


def choose_chunks(tables: dict[int, CostTable], gpu_memory: int, host_memory: int, *, time_limit_s: float = 60.0,
                  settings: SolverSettings = SolverSettings()) -> tuple[OffloadPlan, CostTable]:
    """The fastest plan over chunk sizes and key/value residencies: `tables` holds, per candidate
    chunk size, its measured chunk-recurrent CostTable (a size the micro-batch fits in whole: its
    whole-sequence table). Each table is priced with every residency of `kv_options` (`kv_residency`)
    and both homes of an untied input embedding (`embedding_homes`), and solved under the budgets
    (`fastest`). Returns the plan of least predicted step time that fits, every choice considered
    in its chunk_choices, and its costs."""
    priced = []
    for size, costs in tables.items():
        if costs.kv is None:
            priced.append(replace(costs, chunk_tokens=size))
        else:
            priced += [kv_residency(costs, *option) for option in kv_options(costs.kv)]
    return fastest([home for costs in priced for home in embedding_homes(costs)], gpu_memory, host_memory,
                   time_limit_s=time_limit_s, settings=settings)


def embedding_homes(costs: CostTable) -> list[CostTable]:
    """`costs`, and for an untied input embedding on the GPU the same with it in host memory
    (`embedding_on_host`)."""
    return [costs, embedding_on_host(costs)] if costs.embedding_bytes and costs.embedding == "gpu" else [costs]


def fastest(priced: list[CostTable], gpu_memory: int, host_memory: int, *, time_limit_s: float = 60.0,
            settings: SolverSettings = SolverSettings()) -> tuple[OffloadPlan, CostTable]:
    """The plan of least predicted step time over the tables in `priced` (`solve_kept` of each, the
    time limit shared evenly), every table considered in its chunk_choices, and its costs. When none
    fits, the BudgetError of the table that comes closest (the least smallest GPU budget, else host
    budget)."""
    choices, best, errors = [], None, []
    for costs in priced:
        try:
            plan, costs = solve_kept(costs, gpu_memory, host_memory, time_limit_s=time_limit_s / len(priced),
                                     settings=settings)
        except ConfigError as e:
            plan = None
            errors.append(e)
        kv, p = costs.kv, plan.predicted if plan is not None else None
        figures = dict(step_s=p.step_s, gpu_peak_bytes=p.gpu_peak_bytes, host_peak_bytes=p.host_peak_bytes) if p else {}
        choices.append(ChunkChoice(chunk_tokens=costs.chunk_tokens, kv_offload=kv.kv_offload if kv else False,
                                   offload_pages=kv.offload_pages if kv else None, resident_pages=costs.resident_pages,
                                   keep_attention_chunks=kv.keep_chunks if kv else None, embedding=costs.embedding,
                                   **figures))
        if p is not None and (best is None or p.step_s < best[0].predicted.step_s):
            best = plan, costs
    if best is None:
        budget_errors = [e for e in errors if isinstance(e, BudgetError)]
        if not budget_errors:
            raise errors[0]
        raise min(budget_errors, key=lambda e: (e.field != "gpu_memory", e.smallest_bytes))
    return replace(best[0], chunk_choices=tuple(choices)), best[1]


def _chunk_candidates(config) -> tuple[int, ...] | None:
    """config's --chunk-candidates, checked against its --chunk-tokens and sequence length."""
    candidates = config.offload.candidates
    if candidates is None:
        return None
    text, chunk = config.offload.chunk_candidates, config.long.chunk_tokens
    if chunk is not None and chunk not in candidates:
        raise ConfigError("chunk_candidates", f"is {text!r}, without the run's --chunk-tokens {chunk}; add it to the "
                                              "candidates, or drop --chunk-tokens to let the planner choose")

    length = max(CacheReader(cache).manifest.spec.data.seq_len for cache in config.cache)
    length = min(length, config.seq_len) if config.seq_len is not None else length
    if candidates[-1] > length:
        raise ConfigError("chunk_candidates", f"is {text!r}: {candidates[-1]} is longer than the sequences trained "
                                              f"({length} tokens: --seq-len, else the cache's); give chunk sizes up "
                                              f"to {length}")
    return candidates


# --- planning a training run ---------------------------------------------------------------------


def make_plan(config, gpu_memory: int | None = None, host_memory: int | None = None, *,
              time_limit_s: float = 60.0) -> tuple[OffloadPlan, CostTable]:
    """Profile `config`'s step and solve for its plan under the budgets (bytes; None: config.offload's
    when TrainConfig has that part and it sets one, else `default_budgets`). With chunk_candidates
    (OffloadConfig) the step is profiled at each candidate chunk size and `choose_chunks` chooses
    the chunk size and key/value residency too. Returns (plan, costs)."""
    offload = getattr(config, "offload", None)
    if gpu_memory is None and offload is not None:
        gpu_memory = offload.gpu_memory_bytes
    if host_memory is None and offload is not None:
        host_memory = offload.host_memory_bytes
    default_gpu, default_host = default_budgets(resolve_device(config.device))
    gpu_memory, host_memory = gpu_memory or default_gpu, host_memory or default_host
    candidates = _chunk_candidates(config)
    if candidates is not None:
        tables = {size: profile(config.with_flat(chunk_tokens=size)) for size in candidates}
        return choose_chunks(tables, gpu_memory, host_memory, time_limit_s=time_limit_s)
    plan, costs = fastest(embedding_homes(profile(config)), gpu_memory, host_memory, time_limit_s=time_limit_s)
    return replace(plan, chunk_choices=()), costs


def plan_for_training(config, gpu_memory: int | None = None, host_memory: int | None = None) -> OffloadPlan:
    """The plan `train-student --offload auto` trains with: `make_plan` without the costs."""
    return make_plan(config, gpu_memory, host_memory)[0]
