"""The optimizer step alone on a GPU, for a Qwen2-0.5B-shaped student's parameters: torch's AdamW
(fused and foreach) against FOAM at levels 2 and 4 and block-wise 8-bit AdamW, each through its
Triton step and its torch path; plus global-norm clipping, torch's against ours.

    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_step_gpu.py --results $OUT/results.jsonl

    # a smoke test of the script on a CPU: tiny shape, Triton's interpreter, rows to a scratch file
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_step_gpu.py \
        --device cpu --shape tiny --repeats 2 --results /tmp/optimizer_step.jsonl

    # the update an offload plan runs on the host (plan.optimizer "cpu"): one Qwen2.5-7B layer,
    # torch's AdamW against the CPU paths of 8-bit AdamW and FOAM
    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_step_gpu.py --device cpu --shape qwen2.5-7b-layer \
        --variants torch-adamw-fused,adamw8bit-torch,foam-l2-torch,foam-l4-torch --repeats 3

fp32 parameters and gradients (the trainer keeps fp32 master weights), random gradients, the
trainer's groups (weight decay 0.1 on matrices). Before anything is timed, one step of every
variant from the same parameters and gradients (at CHECK_LR) is checked against its reference (the Triton steps
against their torch paths, torch's fused and foreach AdamW against its single-tensor one, our
clipping against torch's). Then each variant's step is timed with the harness (CUDA events, median
of --repeats after --warmup steps; peak = what the timed steps allocate above what existed before
them, the states included by then). GB/s counts the fewest bytes a step must move: params read and
written and grads read once (3 x 4 B per parameter) plus every state byte read and written once;
clipping reads the grads twice and writes them once. `copy_fraction` is that against the device's
copy ceiling (harness.ceilings()). One row per variant, bench "optimizer_step",
case "<shape>/<variant>" ("cpu/<shape>/<variant>" on a CPU).
"""

from __future__ import annotations

import argparse
import os

import torch

from harness import Results, add_results_arg, ceilings, check_close, gbps, time_cpu, time_gpu
from student.config import StudentConfig
from student.host_heap import keep_freed_pieces
from student.model import Student
from student.optim.build import state_bytes
from student.optim.adam8bit import AdamW8bit
from student.optim.clip import clip_grad_norm_foreach
from student.optim.foam import FOAM, foam_param_groups

SHAPES = {
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
                       attention_bias=True),
    # one decoder layer of Qwen2.5-7B (233M parameters), the unit an offload plan updates; a token
    # table of 64 rows beside it
    "qwen2.5-7b-layer": dict(model_type="qwen2", vocab_size=64, hidden_size=3584, intermediate_size=18944,
                             num_layers=1, num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False,
                             attention_bias=True),
    # the script's CPU smoke test (odd sizes, so the 8-bit blocks and FOAM's folds have tails)
    "tiny": dict(model_type="qwen2", vocab_size=301, hidden_size=72, intermediate_size=100, num_layers=2,
                 num_heads=6, num_kv_heads=2, head_dim=12, tie_word_embeddings=True, attention_bias=True),
}
LR, BETAS, WEIGHT_DECAY, GRAD_SCALE = 1e-5, (0.9, 0.95), 0.1, 1e-3
CHECK_LR = 1e-2  # the checked step's: large enough that the update and the decay stand above rounding
# One step from a fresh state: the Triton and torch paths see identical moments, so they differ by
# rounding alone (IEEE sqrt and division in the kernels, block means summed in another order), the
# tolerances of tests/test_foam.py and tests/test_adam8bit.py scaled to gradients of GRAD_SCALE; the
# 8-bit codes may round the other way where an ulp moves a moment across a midpoint between codes.
RTOL = 1e-5
ATOL = {"param": 1e-7, "exp_avg": 1e-7 * GRAD_SCALE, "exp_avg_sq": 1e-7 * GRAD_SCALE**2, "absmax_m": 0.0,
        "absmax_r": 0.0}
CODE_STEPS = 1  # a differing code is one step away
CODES_DIFFERENT = 1e-3  # fraction of codes allowed to differ


def adamw_groups(params):
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def variants(model, params, lr):
    """name -> (make the optimizer, the variant its first step is checked against)."""
    foam = lambda level, fused: lambda: FOAM(foam_param_groups(model, weight_decay=WEIGHT_DECAY, level=level),
                                             lr=lr, betas=BETAS, fused=fused)
    adamw = lambda **kw: lambda: torch.optim.AdamW(adamw_groups(params), lr=lr, betas=BETAS, **kw)
    eight = lambda fused: lambda: AdamW8bit(adamw_groups(params), lr=lr, betas=BETAS, fused=fused)
    return {
        "torch-adamw-fused": (adamw(fused=True), "torch-adamw-single"),
        "torch-adamw-foreach": (adamw(foreach=True), "torch-adamw-single"),
        "torch-adamw-single": (adamw(foreach=False), None),  # the reference of the two above, not timed
        "foam-l2-triton": (foam(2, True), "foam-l2-torch"),
        "foam-l2-torch": (foam(2, False), None),
        "foam-l4-triton": (foam(4, True), "foam-l4-torch"),
        "foam-l4-torch": (foam(4, False), None),
        "adamw8bit-triton": (eight(True), "adamw8bit-torch"),
        "adamw8bit-torch": (eight(False), None),
    }


def one_step(make, params, start, grads):
    """(params after one step of a fresh optimizer from `start`, its state in param order)."""
    with torch.no_grad():
        for p, s, g in zip(params, start, grads):
            p.copy_(s)
            p.grad = g
    opt = make()
    opt.step()
    return [p.detach().clone() for p in params], [opt.state[p] for p in params]


def check_variant(name, got, want):
    """Refuse to time a variant whose first step differs from its reference's."""
    (params, states), (ref_params, ref_states) = got, want
    err = 0.0
    for i, (p, r) in enumerate(zip(params, ref_params)):
        err = max(err, check_close(f"{name} param {i}", p, r, atol=ATOL["param"], rtol=RTOL))
    for i, (state, ref) in enumerate(zip(states, ref_states)):
        for key in ("exp_avg", "exp_avg_sq", "absmax_m", "absmax_r"):
            if key in state:
                check_close(f"{name} {key} {i}", state[key], ref[key], atol=ATOL[key], rtol=RTOL)
        for key, signed in (("codes_m", True), ("codes_r", False)):
            if key in state:
                delta = state[key].int() - ref[key].int()
                check_close(f"{name} {key} {i}", delta, torch.zeros_like(delta), atol=CODE_STEPS)
                assert (delta != 0).float().mean().item() <= CODES_DIFFERENT, f"{name} {key} {i}: too many codes differ"
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (Triton steps need "
                                                    "TRITON_INTERPRET=1 there)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants to check and time (default: all); a checked variant's "
                         "reference runs too, untimed unless named")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    add_results_arg(ap)
    args = ap.parse_args()
    keep_freed_pieces()  # the host heap as the trainer's process sets it (its CPU updates)
    on_gpu = args.device.startswith("cuda")
    every = variants(None, [], LR)
    chosen = list(every) if args.variants is None else args.variants.split(",")
    if unknown := sorted(set(chosen) - set(every)):
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(every)}")
    if not on_gpu and any("triton" in name for name in chosen) and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the Triton steps in Triton's interpreter: set TRITON_INTERPRET=1, "
                 "or leave them out of --variants")
    results = Results(bench="optimizer_step", path=args.results)
    timer = (lambda fn: time_gpu(fn, warmup=args.warmup, repeats=args.repeats)) if on_gpu else (
        lambda fn: time_cpu(fn, warmup=1, repeats=args.repeats))
    copy_gbps = ceilings()["copy_gbps"] if on_gpu else None

    torch.manual_seed(0)
    with torch.device(args.device):
        model = Student(StudentConfig(**SHAPES[args.shape]))
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    start = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) * GRAD_SCALE for p in params]
    config = dict(shape=args.shape, params=num_params, dtype="fp32", lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                  warmup=args.warmup, repeats=args.repeats)

    # Correctness first: every variant's first step against its reference, before any timing.
    checked = variants(model, params, CHECK_LR)
    errors = {}
    for ref_name, (make_ref, parent) in checked.items():
        if parent is not None or not any(checked[name][1] == ref_name for name in chosen):
            continue
        want = one_step(make_ref, params, start, grads)
        for name, (make, ref) in checked.items():
            if ref == ref_name and name in chosen:
                errors[name] = check_variant(name, one_step(make, params, start, grads), want)
        del want
    for p, g in zip(params, grads):
        p.grad = g
    clip_ref = torch.nn.utils.clip_grad_norm_(params, 1e9)
    clip_err = check_close("clip norm", clip_grad_norm_foreach(params, 1e9), clip_ref, atol=0.0, rtol=1e-5)

    fused_ms = None
    prefix = "" if on_gpu else "cpu/"
    for name, (make, _) in variants(model, params, LR).items():
        if name == "torch-adamw-single" or name not in chosen:
            continue
        opt = make()
        timing = timer(opt.step)
        state = state_bytes(opt)
        fused_ms = timing.median_ms if name == "torch-adamw-fused" else fused_ms  # timed first when chosen
        moved = 3 * 4 * num_params + 2 * state
        figures = {**timing.figures(), "gbps": gbps(moved, timing.median_ms), "state_gib": state / 2**30,
                   "check_max_err": errors.get(name, 0.0)}
        if fused_ms is not None:
            figures["x_fused_adamw"] = timing.median_ms / fused_ms
        if copy_gbps:
            figures["copy_fraction"] = figures["gbps"] / copy_gbps
        results.add(f"{prefix}{args.shape}/{name}", figures, config)
        del opt
        if on_gpu:
            torch.cuda.empty_cache()
    for name, clip in (("clip-torch", lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)),
                       ("clip-ours", lambda: clip_grad_norm_foreach(params, 1e9))):
        timing = timer(clip)
        figures = {**timing.figures(), "gbps": gbps(3 * 4 * num_params, timing.median_ms),
                   "check_max_err": clip_err if name == "clip-ours" else 0.0}
        if copy_gbps:
            figures["copy_fraction"] = figures["gbps"] / copy_gbps
        results.add(f"{prefix}{args.shape}/{name}", figures, config)


if __name__ == "__main__":
    main()
