"""The optimizer step alone on a GPU, for a Qwen2-0.5B-shaped student's parameters: torch's fused
AdamW against FOAM (batched Triton step) at levels 2 and 4 and block-wise 8-bit AdamW (batched
Triton step, and the plain torch path); plus the global-norm clipping, torch's against ours.

    python3 tests/benchmarks/bench_optimizer_step_gpu.py --out $OUT/optim_step.json

fp32 parameters and gradients (the trainer keeps fp32 master weights), random gradients, the
trainer's groups (weight decay 0.1 on matrices). CUDA events around optimizer.step(), median of
--repeats after --warmup steps; peak = max_memory_allocated during the timed steps minus what was
allocated before them (the states exist by then). GB/s counts the fewest bytes a step must move:
params read and written and grads read once (3 x 4 B per parameter) plus every state byte read and
written once, against a device-to-device copy measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from student.config import StudentConfig
from student.model import Student
from student.optim import state_bytes
from student.optim.adam8bit import AdamW8bit
from student.optim.clip import clip_grad_norm_foreach
from student.optim.foam import FOAM, foam_param_groups

QWEN2_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True, attention_bias=True)


def timed(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30, times


def copy_bandwidth(num_bytes: int = 2**31) -> float:
    """GB/s of a device-to-device copy of num_bytes (read + written), median of 10."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms, _, _ = timed(lambda: dst.copy_(src), 3, 10)
    del src, dst
    return 2 * num_bytes / ms / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Student(StudentConfig(**QWEN2_05B)).cuda()
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = lambda: [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    makers = {
        "torch AdamW fused": lambda: torch.optim.AdamW(groups(), lr=1e-5, betas=(0.9, 0.95), fused=True),
        "torch AdamW foreach": lambda: torch.optim.AdamW(groups(), lr=1e-5, betas=(0.9, 0.95), foreach=True),
        "FOAM level 2 (Triton)": lambda: FOAM(foam_param_groups(model, weight_decay=0.1, level=2), lr=1e-5,
                                              betas=(0.9, 0.95)),
        "FOAM level 4 (Triton)": lambda: FOAM(foam_param_groups(model, weight_decay=0.1, level=4), lr=1e-5,
                                              betas=(0.9, 0.95)),
        "AdamW 8-bit (Triton)": lambda: AdamW8bit(groups(), lr=1e-5, betas=(0.9, 0.95)),
        "AdamW 8-bit (torch)": lambda: AdamW8bit(groups(), lr=1e-5, betas=(0.9, 0.95), fused=False),
    }
    num_params = sum(p.numel() for p in params)
    copy_gbps = copy_bandwidth()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "params": num_params,
              "copy_GBps": copy_gbps, "rows": []}
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s", flush=True)
    fused_ms = None
    for name, make in makers.items():
        opt = make()
        ms, peak, times = timed(opt.step, args.warmup, args.repeats)
        state = state_bytes(opt)
        gbps = (3 * 4 * num_params + 2 * state) / ms / 1e6
        fused_ms = fused_ms or ms
        row = dict(optimizer=name, ms=ms, x_fused_adamw=ms / fused_ms, GBps=gbps, peak_extra_GiB=peak,
                   state_GiB=state / 2**30, times=times)
        report["rows"].append(row)
        print(f"{name}: {ms:.2f} ms ({ms / fused_ms:.2f}x fused AdamW), {gbps:.0f} GB/s, state "
              f"{row['state_GiB']:.3f} GiB, step peak +{peak:.3f} GiB", flush=True)
        del opt
        torch.cuda.empty_cache()
    for name, clip in (("torch clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)),
                       ("clip_grad_norm_foreach", lambda: clip_grad_norm_foreach(params, 1e9))):
        ms, peak, times = timed(clip, args.warmup, args.repeats)
        report["rows"].append(dict(optimizer=name, ms=ms, peak_extra_GiB=peak, times=times))
        print(f"{name}: {ms:.2f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
