"""Issue 18's big shapes on paper: the planner (student/planner/solve.py) on cost tables built from the
shapes and from figures measured on the H200, for Qwen2.5-14B and -32B with fp32 master weights and
AdamW or FOAM states at 8K tokens a step, under the device's GPU budget and host budgets of 111 and
120 GiB. No GPU runs here: the tables are what student/planner/profile.py would measure, by its
arithmetic, where its measurement can be reproduced (bytes), and scaled from the Llama-3.1-8B
shape's recorded profile where it cannot (seconds, allocator workspace).

Where each figure comes from:
  bytes        as step_profile counts them, from the shape: working weights (matrices bf16,
               vectors fp32), fp32 masters, the boundary (the layer's fp32 input), what autograd
               saves under bf16 autocast (`keep_bytes`: the arithmetic below), the optimizer's
               states (AdamW 8 B a parameter; FOAM 2 B a matrix parameter, 8 B for vectors, and
               plain Adam for embed_tokens and lm_head, as student/optim/foam.py groups them), the
               static part (fp32 embeddings, norm and head, their fp32 gradients, their states,
               the loss's workspace, the 512 MiB reserve)
  8B checks    the 8B table built the same way, under the profile those rows were made with (what_if
               double_count, below), reproduces, to the byte, both predicted GPU peaks
               recorded for the 8B shape (rows offload/llama-3.1-8b-T8192/planned@a2bce95 under
               the current cost model and ...-gpu40GiB/planned@7e71169 under that commit's):
               tests/test_plan_big_shapes.py holds it. The two peaks fix the sum of the layer's
               allocator workspace and the loss's (5,642,594,288 bytes), not its split
               (--loss-shares: both ends are planned, `cost_table`'s loss_share)
  seconds      the 8B layer's forward 7.77 ms and backward 16.47 ms (its profile: forward phase
               0.2485 s / 32, layer time with recompute about 0.032 s), scaled by each layer's
               matmul FLOPs (projections and causal attention); the head 0.0410 s scaled by
               vocab x hidden; the GPU update 2.45 TB/s of the bytes an update reads and writes
               (the 8B all-FOAM optimizer phase, 0.0577 s); copies 54.6 GB/s each way,
               latency 1.9e-5 s
  assumed      the host: a CPU update streams its bytes at `--cpu-gb-s` (default 20 GB/s), the
               clip pass over host gradients at `--host-gb-s` (30 GB/s). Not measured on this host.

  gradients    one micro-batch a step: a host layer's gradient is held and moved in the working
               dtypes (bf16 matrices, fp32 vectors), as the runtime does since da69470
               (the former what-if bf16_grads); before it, in fp32. A layer whose states
               are on the GPU holds it so there since e2e8b06, with one fp32 buffer
               of a layer that the updates widen it into; before it, an fp32 accumulator
               (`--fp32-gpu-grads`, `cost_table`'s fp32_gpu_grads: the 8B rows were made so)
  what-ifs     --what-ifs double_count,as_is: `cost_table` says what each changes.

    PYTHONPATH=. python tests/benchmarks/plan_big_shapes.py [--time-limit 60] [--json OUT.json]
    PYTHONPATH=. python tests/benchmarks/plan_big_shapes.py --loss-shares 0 --what-ifs double_count,as_is
    PYTHONPATH=. python tests/benchmarks/plan_big_shapes.py --shapes qwen2.5-14b --hosts 111 [--fp32-gpu-grads]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from student.planner.table import CostTable, LayerCosts
from student.offload.config import format_bytes
from student.planner.solve import BudgetError, GiB, predict, solve

TOKENS = 8192
H2D = D2H = 54.6e9
COPY_LATENCY_S = 1.9e-5
GPU_BUDGET = 142_604_386_304  # 0.95 of the H200's 150,109,880,320 bytes: the rows' default budget
RESERVE = 512 * 2**20  # ProfileSettings.reserve_bytes
# The 8B layer's profile (row offload/llama-3.1-8b-T8192/planned@a2bce95): forward phase / 32;
# a recomputed layer's time (forward, forward again, backward) about 0.032 s.
FORWARD_8B_S = 0.24854054403305056 / 32
BACKWARD_8B_S = 0.032 - 2 * FORWARD_8B_S
HEAD_8B_S = 0.040973182678222655
GPU_UPDATE_BYTES_PER_S = 2.45e12  # the 8B all-FOAM optimizer phase: 141.1e9 bytes read and written in 0.0577 s
# Workspace of one layer's forward and backward plus the loss's, the 8B shape: what its two
# recorded peaks leave (tests/test_plan_big_shapes.py). The split is not recorded: the loss's
# share is at least the head's fp32 gradients (2 x 4 x vocab x hidden) and at most those plus
# the bf16 lm-head cast, the layer's the rest.
WORKSPACE_SUM_8B = 5_642_594_288


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    qkv_bias: bool
    head_dim: int = 128

    @property
    def matrix_params(self) -> int:
        """A decoder layer's matrix parameters (q, k, v, o, gate, up, down)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.d_ff

    @property
    def vector_params(self) -> int:
        """Its vectors: two norms and, with qkv bias, the q, k, v biases."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden + (q + 2 * kv if self.qkv_bias else 0)

    @property
    def layer_params(self) -> int:
        return self.matrix_params + self.vector_params

    @property
    def static_params(self) -> int:
        """Untied embeddings and head, and the final norm."""
        return 2 * self.vocab * self.hidden + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.static_params

    def matmul_flops(self) -> float:
        """A layer's forward matmul FLOPs at TOKENS tokens: projections and causal attention."""
        return 2 * TOKENS * self.matrix_params + 2 * TOKENS * TOKENS * self.heads * self.head_dim


LLAMA_8B = Shape("llama-3.1-8b", 128_256, 4096, 32, 32, 8, 14336, qkv_bias=False)
QWEN_14B = Shape("qwen2.5-14b", 152_064, 5120, 48, 40, 8, 13824, qkv_bias=True)
QWEN_32B = Shape("qwen2.5-32b", 152_064, 5120, 64, 40, 8, 27648, qkv_bias=True)
SHAPES = (QWEN_14B, QWEN_32B)  # planned by `main`


def keep_bytes(s: Shape, tokens: int = TOKENS) -> int:
    """What a layer's forward saves for its backward under bf16 autocast (student/model.py's
    DecoderLayer; step_profile's _SavedBytes: distinct storages, parameters, cos, sin and the row
    mask left out), per token: the fp32 input, each RMSNorm's fp32 input, normalised value and rsqrt
    (x, x*r, r); the bf16 casts autocast makes of each norm's output, one per projection that
    reads it (q, k, v: 3; gate, up: 2); attention's bf16 q and k casts, v, its output (o_proj's
    input, a view) and fp32 log-sum-exp per head; the MLP's gate, up, silu and product, bf16;
    plus the attention's 16 bytes of RNG seed and offset. Checked to the byte against the 8B's
    two recorded peaks."""
    h, kv, f = s.hidden, s.kv_heads * s.head_dim, s.d_ff
    per_token = (4 * h + 4 * h + 4  # input_layernorm: x, x * rsqrt, rsqrt
                 + 3 * 2 * h  # the bf16 casts of its output for q, k and v
                 + 2 * h + 2 * kv + 2 * kv + 2 * h + 4 * s.heads  # attention: q, k casts, v, out, lse
                 + 4 * h + 4 * h + 4  # post_attention_layernorm
                 + 2 * 2 * h  # the bf16 casts for gate and up
                 + 4 * 2 * f)  # gate, up, silu(gate), silu(gate) * up
    return tokens * per_token + 16


def state_bytes(s: Shape, optimizer: str) -> tuple[int, int]:
    """(a layer's, the static part's) optimizer state bytes: AdamW 8 B a parameter; FOAM (level 2)
    2 B a matrix parameter, plain Adam (8 B) for vectors and for embed_tokens / lm_head."""
    if optimizer == "adamw":
        return 8 * s.layer_params, 8 * s.static_params
    return 2 * s.matrix_params + 8 * s.vector_params, 8 * s.static_params


def update_bytes(matrix: int, vector: int, optimizer: str) -> int:
    """Bytes an update reads and writes: parameter (read, write), gradient, states (read, write)."""
    per_matrix = 12 + 2 * (8 if optimizer == "adamw" else 2)
    return per_matrix * matrix + 28 * vector


WHAT_IFS = ("double_count", "as_is")


@dataclass(frozen=True)
class _Fp32GpuGrads(LayerCosts):
    """The cost model before e2e8b06: a layer whose states are on the GPU keeps an
    fp32 gradient accumulator there at every step, and its update widens nothing."""

    def gpu_state_bytes(self, accumulates: bool) -> int:
        return super().gpu_state_bytes(accumulates=True)

    def gpu_widened_bytes(self, accumulates: bool) -> int:
        return 0


def cost_table(s: Shape, optimizer: str, loss_share: float, cpu_bytes_per_s: float = 20e9,
               host_bytes_per_s: float = 30e9, what_if: str = "as_is", fp32_gpu_grads: bool = False) -> CostTable:
    """`s`'s CostTable as step_profile would measure it on the H200 (the module docstring says
    where each figure comes from). loss_share in [0, 1]: where the 8B's workspace split lies
    (0: the loss holds only the head's fp32 gradients; 1: those and the bf16 lm-head cast).
    what_if (WHAT_IFS): "as_is": step_profile as it is (its loss workspace is the head's allocator
    peak less the static parameters' fp32 gradients the head's backward creates, which the static
    bytes count, 2 x the static parameters' bytes); "double_count": step_profile before it took
    those gradients out of the workspace, so they counted twice (the 8B rows' predicted peaks were
    made so: tests/test_plan_big_shapes.py; the loss's workspace is then also part of the static
    bytes, summed with a layer's backward as the cost model then did). fp32_gpu_grads: the layers whose states are on the GPU
    keep fp32 gradients (`_Fp32GpuGrads`), as the runtime did when the 8B rows were made."""
    layer_state, static_state = state_bytes(s, optimizer)
    base = LLAMA_8B
    loss_8b = 8 * base.vocab * base.hidden + loss_share * 2 * base.vocab * base.hidden
    layer_ws_8b = WORKSPACE_SUM_8B - loss_8b
    # A layer's workspace holds its weight gradients and transient activation gradients: scaled by
    # weights plus saved activations.
    size = lambda x: 2 * x.matrix_params + keep_bytes(x)
    scale_layer = size(s) / size(base)
    loss_ws = int(loss_8b * s.vocab * s.hidden / (base.vocab * base.hidden))
    flops = s.matmul_flops() / base.matmul_flops()
    upd = update_bytes(s.matrix_params, s.vector_params, optimizer)
    layer = (_Fp32GpuGrads if fp32_gpu_grads else LayerCosts)(
        forward_s=FORWARD_8B_S * flops, backward_s=BACKWARD_8B_S * flops,
        weight_bytes=2 * s.matrix_params + 4 * s.vector_params, boundary_bytes=4 * TOKENS * s.hidden,
        keep_bytes=keep_bytes(s), workspace_bytes=int(layer_ws_8b * scale_layer),
        master_bytes=4 * s.layer_params, state_bytes=layer_state,
        update_gpu_s=upd / GPU_UPDATE_BYTES_PER_S,
        update_cpu_s=(upd + 6 * s.matrix_params) / cpu_bytes_per_s)  # + the cast of the staging copy
    if what_if != "double_count":
        loss_ws -= 4 * s.static_params
    static_upd = update_bytes(s.static_params - s.hidden, s.hidden, "adamw")
    # The cost model of those rows' commits held the loss's workspace in the static bytes, beside a
    # layer's backward; as it is, the peak takes the larger of the two.
    held_loss_ws = loss_ws if what_if == "double_count" else 0
    return CostTable(layers=(layer,) * s.layers, h2d_bytes_per_s=H2D, d2h_bytes_per_s=D2H,
                     static_gpu_bytes=2 * 4 * s.static_params + static_state + held_loss_ws + RESERVE,
                     loss_workspace_bytes=loss_ws - held_loss_ws,
                     # the untied input embedding's fp32 gradient (as step_profile counts it since)
                     late_grad_bytes=0 if what_if == "double_count" else 4 * s.vocab * s.hidden,
                     head_s=HEAD_8B_S * s.vocab * s.hidden / (base.vocab * base.hidden),
                     static_update_s=static_upd / GPU_UPDATE_BYTES_PER_S, micro_batches=1,
                     host_bytes_per_s=host_bytes_per_s, copy_latency_s=COPY_LATENCY_S)


def summarize(s: Shape, optimizer: str, host_gib: float, costs: CostTable, time_limit_s: float) -> dict:
    """One case: the planner's plan (or its one-line refusal) and what dominates it."""
    host = int(host_gib * GiB)
    row = dict(shape=s.name, optimizer=optimizer, host_gib=host_gib, params=s.params)
    try:
        plan = solve(costs, GPU_BUDGET, host, time_limit_s=time_limit_s)
    except BudgetError as e:
        return {**row, "feasible": False, "error": str(e), "smallest_bytes": e.smallest_bytes}
    p = plan.predicted
    c = costs.layers[0]
    host_layers = sum(lp.states == "host" for lp in plan.layers)
    count = lambda **kw: sum(all(getattr(lp, k) == v for k, v in kw.items()) for lp in plan.layers)
    compute = sum(2 * x.forward_s + x.backward_s for x in costs.layers) + costs.head_s
    a = costs.accumulates
    d2h = host_layers * (c.grad_bytes(a) + (plan.optimizer == "gpu") * (c.master_bytes + c.state_bytes + c.staging_bytes))
    h2d = (count(params="stream") * 2 * c.weight_bytes + count(activation="offload") * c.boundary_bytes
           + host_layers * (c.update_in_bytes(a) if plan.optimizer == "gpu" else 0))
    return {**row, "feasible": True, "gpu_layers": len(plan.layers) - host_layers, "step_s": p.step_s, "tflops": 6 * s.params * TOKENS / p.step_s / 1e12,
            "gpu_peak": p.gpu_peak_bytes, "host_peak": p.host_peak_bytes, "optimizer_side": plan.optimizer,
            "depth": plan.prefetch_depth, "host_layers": host_layers, "stream": count(params="stream"),
            "keep": count(activation="keep"), "recompute": count(activation="recompute"),
            "offload": count(activation="offload"), "phases": p.phase_s, "compute_s": compute,
            "d2h_s": d2h / D2H, "h2d_s": h2d / H2D}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="the solver's seconds per case")
    parser.add_argument("--cpu-gb-s", type=float, default=20.0, help="assumed: bytes a CPU update streams, GB/s")
    parser.add_argument("--host-gb-s", type=float, default=30.0, help="assumed: the host's clip pass, GB/s")
    parser.add_argument("--loss-shares", default="0,1", help="workspace splits planned (cost_table's loss_share)")
    parser.add_argument("--what-ifs", default="as_is", help=f"comma-separated, of {WHAT_IFS}")
    parser.add_argument("--shapes", default=",".join(s.name for s in SHAPES), help="comma-separated shape names")
    parser.add_argument("--hosts", default="111,120", help="comma-separated host budgets, GiB")
    parser.add_argument("--fp32-gpu-grads", action="store_true",
                        help="the cost model before e2e8b06 (the recorded 8B rows): states-on-GPU layers keep fp32 gradients")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for what_if in args.what_ifs.split(","):
        for s, optimizer in ((QWEN_14B, "adamw"), (QWEN_14B, "foam"), (QWEN_32B, "foam"), (QWEN_32B, "adamw")):
            if s.name not in args.shapes.split(","):
                continue
            for host_gib in (int(x) if x.isdigit() else float(x) for x in args.hosts.split(",")):
                for loss_share in map(float, args.loss_shares.split(",")):
                    costs = cost_table(s, optimizer, loss_share, args.cpu_gb_s * 1e9, args.host_gb_s * 1e9, what_if,
                                       fp32_gpu_grads=args.fp32_gpu_grads)
                    row = summarize(s, optimizer, host_gib, costs, args.time_limit)
                    row.update(loss_share=loss_share, what_if=what_if + ("+fp32_gpu_grads" if args.fp32_gpu_grads else ""))
                    rows.append(row)
                    print(_line(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def _line(r: dict) -> str:
    head = f"{r['what_if']}: {r['shape']:12s} {r['optimizer']:5s} host {r['host_gib']} GiB ws-split {r['loss_share']:.0f}: "
    if not r["feasible"]:
        return head + "INFEASIBLE: " + r["error"]
    ph = ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items() if v)
    return (head + f"step {r['step_s']:.3f} s, {r['tflops']:.0f} TFLOP/s, GPU {format_bytes(r['gpu_peak'])}, host "
            f"{format_bytes(r['host_peak'])}; update on {r['optimizer_side']}, depth {r['depth']}, host layers "
            f"{r['host_layers']} (gpu {r['gpu_layers']}), stream {r['stream']}, keep/rec/off {r['keep']}/{r['recompute']}/{r['offload']}; "
            f"compute {r['compute_s']:.3f} s, d2h {r['d2h_s']:.3f} s, h2d {r['h2d_s']:.3f} s; phases {ph}")


if __name__ == "__main__":
    main()
