"""Training steps of students bigger than the GPU (issue 18): no offload, a fixed everything-offloaded
policy and the planner's plan, side by side in one run.

Shapes (random init, seeded; fp32 master weights, bf16 autocast, the trainer's loss on k = 32
random valid teacher targets in host memory as the trainer hands them over, one sequence of
--seq-len tokens a step):
  qwen2-0.5b    bench_long_context_gpu's (hidden 896, 24 layers, 14 / 2 heads, d_ff 4864, vocab
                151,936, tied): with --chunk-tokens, the long-context issue's small shape
  qwen2.5-3b    bench_long_context_gpu's (hidden 2048, 36 layers, 16 / 2 heads, d_ff 11008, vocab
                151,936, untied): with --chunk-tokens, the long-context issue's shape
  llama-3.1-8b  hidden 4096, 32 layers, 32 / 8 heads, d_ff 14336, vocab 128,256, untied, llama3 RoPE
  qwen2.5-7b    bench_long_context_gpu's (hidden 3584, 28 layers, 28 / 4 heads, d_ff 18944, vocab
                152,064, untied): OOMB's headline shape
  qwen2.5-14b   hidden 5120, 48 layers, 40 / 8 heads, d_ff 13824, vocab 152,064, untied, qkv bias
  qwen2.5-32b   hidden 5120, 64 layers, 40 / 8 heads, d_ff 27648, vocab 152,064, untied, qkv bias
  tiny          bench_train_step_gpu's tiny shape (CPU smoke test only)
Variants, one after the other in this process, memory freed between (an out-of-memory error
becomes a row with "oom": true):
  none          the trainer without offload: the whole student, its gradients and optimizer
                states on the device
  zero_offload  a fixed plan (the ZeRO-Offload / MegaTrain recipe): every layer's weights streamed
                (prefetch 1), every layer's input offloaded, the update on the CPU
  planned       student.planner.solve.make_plan's plan under --gpu-memory / --host-memory (when
                the planner is there; it profiles and plans against a synthetic cache this script
                writes, as `distill train-student --offload auto` would); its row adds the
                profile's copy bandwidths each way alone (h2d_gb_s, d2h_gb_s) and both at once
                (h2d_duplex_gb_s, d2h_duplex_gb_s), what a budgeted step's floor rests on
  file          the plan in --plan (e.g. one `distill plan --json` saved)
  hf_liger      bench_long_context_gpu's transformers + Liger step (bf16 weights, gradient
                checkpointing, fused AdamW; qwen2 shapes only): the long-context issue's baseline,
                so that a planned long-context row and its baseline come from one run
Each offloaded step is the trainer's: student.step.micro_batch_backward through the
student.offload.runtime.OffloadRuntime, finish_grads, the runtime's clip_grad_norm at 1.0 (the trainer's
clipping, its host layers' norms taken on the device), runtime.step, zero_grad.

Rows `offload/<shape>-T<tokens>/<variant>`: median step seconds over --repeats after --warmup
steps, and after one step of --prime-tokens tokens where given, with pages offloaded followed by
page-locking what the step's length page-locks only in its first step (`prime_pinned`; its seconds
pinned_primed_s) (CUDA events, harness.time_gpu), tokens/s, model TFLOP/s = 6 x parameters x tokens / step
time (the issue's measure; recomputation not counted) and its share of the bf16 matmul ceiling
(with --chunk-tokens, and for hf_liger, model_tflops_with_attention too: causal attention counted),
peak GPU memory (max_memory_allocated over the timed steps, and max_memory_reserved, what the
caching allocator held from the device: the allocated bytes plus its slack), the process's resident host memory
before them and its peak over them (host_rss_before_bytes, peak_host_rss_bytes: pinned memory,
the layers' host bytes, the process itself; harness.host_peak) and the host bytes of the
offloaded layers; for an offloaded variant what the host held after the timed steps
(host_parts_bytes: harness.host_parts' kernel split and torch's pinned blocks, the exact pools
student.pinned.POOLS keeps, the layers' bytes: what a host peak off its prediction was made of)
and the phases of the last timed step (phase_s: forward, head, backward, grads, clip, optimizer,
refresh, as the runtime measures them); for a planned variant the plan's predicted step time, phases and peaks beside
them (predicted / measured; the predicted host peak counts the trainer's loader, its batches and
decoded shards, which the bench does not run: predicted_loader_host_bytes of it), and the predicted GPU peak term by term (predicted_gpu_peak_terms,
offload_peaks.gpu_peak_terms), so a row says which term of the cost model is off. Before a variant is timed, its plan (its
first --check-layers layers) is checked on a student of that many layers: two steps' losses and
gradient norms against the same student trained without offload, to bf16 tolerance
(--check-layers 0: not checked, for lengths where those four steps would outlast the timed ones).
With --work the folder keeps each variant's plan and the planned variant's cost table
(planned-costs.json), what its predicted figures were computed from, and with --predict-layers N
the whole step's plan where one fits (whole-plan.json): `--variants file --plan whole-plan.json
--num-layers N` then runs the whole step without profiling its N layers.

With --trace DIR each variant runs one more step under torch.profiler, written to DIR (a Chrome /
Perfetto trace and a table of device time by kernel): where a phase's time goes when it runs
longer than the plan's prediction. With --memory-peak DIR (CUDA) each variant runs one more step
under the allocator's history (memory_peak.py): DIR/VARIANT-peak.json lists what is alive at that
step's peak by where it was allocated, where a GPU peak differs from the plan's prediction.

With --gpu-memory on a GPU, the variants that train with a plan run with torch's caching allocator
capped at the budget, as train-student caps it (student.offload.run.cap_allocator; rows
`...-capped/...`): the plan budgets allocated bytes, the cap holds the reserved ones
(max_memory_reserved) within the budget too.

With --chunk-tokens every variant's step is chunk-recurrent (student/long_context/), its pages
resident or, with --kv-offload, in pinned host memory; `planned` plans together with the chunk
engine (with --chunk-candidates the planner chooses the chunk size and where the pages live, and
the step takes its choice, as train-student does). Such rows also give model TFLOP/s counting
causal attention (bench_long_context_gpu's measure), comparable with the long_context rows. With
--sparse-pages N each chunk attends N selected past pages and its own (OOMB's page top-k; not
exact): the planner then profiles and plans the sparse step (rows `...-sparseN/...`).

    PYTHONPATH=. python tests/benchmarks/bench_offload_gpu.py --shape llama-3.1-8b --results $OUT/results.jsonl
    PYTHONPATH=. python tests/benchmarks/bench_offload_gpu.py --shape llama-3.1-8b --gpu-memory 40GiB --variants planned,none
    PYTHONPATH=. python tests/benchmarks/bench_offload_gpu.py --shape qwen2.5-14b --variants zero_offload,planned --optimizer foam
    PYTHONPATH=. python tests/benchmarks/bench_offload_gpu.py --shape qwen2.5-3b --seq-len 262144 --chunk-tokens 16384 \\
        --kv-offload --variants planned --gpu-memory 27GiB --check-layers 2

With --num-layers N the shape keeps its first N decoder layers (rows `SHAPE-LN-...`): a length
whose whole step would outlast a device command's time limit is then measured per layer (the
rates of a layer do not depend on how many there are; the head's share grows).

On a CPU, `--device cpu --shape tiny --seq-len 64` runs every variant at a toy size (a smoke test,
not a figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_long_context_gpu import random_batch
from bench_train_step_gpu import GIB, make_tokenizer, student_config, write_cache
from harness import (Results, add_results_arg, ceilings, check_close, free_memory, host_parts, host_peak,
                     reset_host_peak, tflops, time_cpu, time_gpu)

from student.config import StudentConfig
from student.host_heap import keep_freed_pieces
from student.host_threads import one_openmp_team
from student.long_context.config import chunk_bounds, kept_chunks
from student.long_context.store import store_for_model
from student.model import Student, rope_inv_freq
from student.offload.config import parse_bytes
from student.offload.plan import OffloadPlan
from student.offload.run import cap_allocator, cuda_index
from student.pinned import POOLS
from student.planner.solve import BudgetError

BENCH = "offload"
VARIANTS = ("none", "zero_offload", "planned", "file", "hf_liger")
# Two steps of a few layers, offloaded against not, both under bf16 autocast: the same roundings in
# principle, but other kernels' orders of sums (and the update of the first step feeds the second).
LOSS_RTOL, GRAD_NORM_RTOL = 1e-2, 5e-2
_STARTED = time.perf_counter()


def progress(what: str) -> None:
    """A line of where the run is, seconds since it started: what a run cut off at a command's
    time limit had got through."""
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {what}", flush=True)


def shape_config(shape: str, max_len: int = 32768) -> StudentConfig:
    qwen = dict(model_type="qwen2", rope_theta=1_000_000.0, max_position_embeddings=32768,
                tie_word_embeddings=False, attention_bias=True, extra={"bos_token_id": 1, "eos_token_id": 2})
    if shape == "tiny":
        return student_config("tiny").replace(num_layers=4)
    if shape in ("qwen2-0.5b", "qwen2.5-3b", "qwen2.5-7b"):
        from bench_long_context_gpu import shape_config as long_shape

        return long_shape(shape, max_len)
    if shape == "llama-3.1-8b":
        return StudentConfig(model_type="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
                             max_position_embeddings=131072, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             extra={"bos_token_id": 1, "eos_token_id": 2})
    layers, d_ff = {"qwen2.5-14b": (48, 13824), "qwen2.5-32b": (64, 27648)}[shape]
    return StudentConfig(vocab_size=152_064, hidden_size=5120, intermediate_size=d_ff, num_layers=layers,
                         num_heads=40, num_kv_heads=8, head_dim=128, **qwen)


def build_student(config: StudentConfig, seed: int, device: str, layers_on_host: bool) -> Student:
    """Random init (normal 0.02, as Student.reset_parameters) module by module on `device` (fast),
    the decoder layers moved to the host one at a time when `layers_on_host` (the offload runtime
    takes them from there): the device never holds more than one layer of them."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Student(config)
    for name, module in model.named_children():
        for part in (module if name == "layers" else [module]):
            part.to_empty(device=device)
            with torch.device(device):
                for sub in part.modules():  # reset_parameters' rules, on this part only
                    if isinstance(sub, (torch.nn.Linear, torch.nn.Embedding)):
                        torch.nn.init.normal_(sub.weight, std=0.02)
                        if getattr(sub, "bias", None) is not None:
                            torch.nn.init.zeros_(sub.bias)
                    elif hasattr(sub, "eps") and hasattr(sub, "weight"):
                        torch.nn.init.ones_(sub.weight)
            if name == "layers" and layers_on_host:
                part.to("cpu")
    model.inv_freq = rope_inv_freq(config).to(device)
    return model.train()


def train_config(args, work: Path, *, offload: str = "none", batch_size: int = 1):
    from student.trainer import TrainConfig

    return TrainConfig.from_flat(cache=str(work / "cache"), out=str(work / "run"), student=str(work / "student"),
                                 device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                                 optimizer=args.optimizer, clip_grad=1.0, batch_size=batch_size,
                                 seq_len=args.seq_len, offload=offload, gpu_memory=args.gpu_memory,
                                 host_memory=args.host_memory, heldout=1, chunk_tokens=args.chunk_tokens,
                                 kv_offload=args.kv_offload, page_tokens=args.page_tokens,
                                 offload_pages=args.offload_pages, sparse_pages=args.sparse_pages,
                                 chunk_candidates=args.chunk_candidates if offload == "auto" else None)


def with_plan(cfg, plan: OffloadPlan | None):
    """The config the step runs with: the plan's chunk size and page residency where the planner
    chose them, and the attention outputs pass 1 keeps (`OffloadPlan.run_settings`, as the trainer
    takes them)."""
    chosen = plan.run_settings() if plan is not None else {}
    return cfg.with_flat(**chosen) if chosen else cfg


def kept_output_blocks(model: Student, long, length: int, batch_size: int = 1) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each host block pass 1 keeps attention outputs in over a step of `length`
    tokens (the store's `_stash`): an output in the attention dtype and its fp32 lse, for each layer
    and kept chunk (`kept_chunks`, full chunks before the last)."""
    c = model.config
    kept = len(kept_chunks(len(chunk_bounds(length, long.chunk_tokens)), long.keep_attention_chunks))
    shape = (batch_size, c.num_heads, long.chunk_tokens)
    return [((*shape, c.head_dim), torch.bfloat16), (shape, torch.float32)] * (kept * c.num_layers)


def prime_pinned(model: Student, cfg, length: int) -> float:
    """Page-lock ahead, on a GPU with offloaded pages, what a step of `length` tokens page-locks the
    first time and later steps of its length reuse (notes/long-context.md, "What the planner missed
    in a sparse forward"): the key/value store's pools, which student.pinned.POOLS keeps for the
    next store of their sizes once this one is dropped, and pass 1's blocks for attention outputs,
    which torch's pinned allocator keeps once freed. The timed step is then warm in that respect,
    as the planner's figure is. Returns the seconds it took (0.0 where nothing is offloaded)."""
    long = cfg.long
    if not (torch.cuda.is_available() and long.chunk_tokens is not None and long.kv_offload):
        return 0.0
    start = time.perf_counter()
    store = store_for_model(model, cfg.batch_size, length, long, torch.bfloat16, "cuda")
    store.make_gradient_pools()
    blocks = [torch.empty(shape, dtype=dtype, pin_memory=True)
              for shape, dtype in kept_output_blocks(model, long, length, cfg.batch_size)]
    del store, blocks
    gc.collect()  # the store's pools go back to POOLS when it is collected
    return time.perf_counter() - start


def fixed_plan(num_layers: int) -> OffloadPlan:
    return OffloadPlan.uniform(num_layers, activation="offload", params="stream", prefetch_depth=1, optimizer="cpu")


def planner_plan(config: StudentConfig, args, work: Path) -> tuple[OffloadPlan, dict]:
    """What `train-student --offload auto` would train with: a config-only student folder and a
    synthetic cache of --seq-len rows for the planner to profile. Returns (plan, figures of the
    profile the floor of a budgeted step rests on: the measured copy bandwidths each way, alone and
    both at once, and the plan's predicted GPU peak term by term)."""
    from student.planner.peaks import gpu_peak_terms
    from student.planner.solve import make_plan

    folder = work / "student"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    tok = make_tokenizer(folder, config.vocab_size)
    write_cache(work / "cache", tok, num_seqs=2, seq_len=args.seq_len, k=32, shard_size=2)  # the profile reads one (heldout 1)
    progress("planned: synthetic cache written")
    cfg = train_config(args, work, offload="auto")
    budgets = {k: parse_bytes(v, k) if v else None for k, v in (("gpu_memory", args.gpu_memory),
                                                                  ("host_memory", args.host_memory))}
    plan, costs = make_plan(cfg, **budgets)
    if args.work is not None:  # what the plan was solved from, for reading a row's prediction against its phases
        (args.work / "planned-costs.json").write_text(json.dumps(dataclasses.asdict(costs), indent=1, default=str))
    whole = {}
    if args.predict_layers is not None:
        figures, whole_plan = whole_step(costs, plan.gpu_memory, plan.host_memory, args.predict_layers)
        whole = {"whole_step": figures}
        if whole_plan is not None and args.work is not None:  # to run as --variants file --num-layers N
            whole_plan.save(args.work / "whole-plan.json")
    return plan, {**whole, "h2d_gb_s": costs.h2d_bytes_per_s / 1e9, "d2h_gb_s": costs.d2h_bytes_per_s / 1e9,
                  "h2d_duplex_gb_s": costs.h2d_duplex_bytes_per_s / 1e9,
                  "d2h_duplex_gb_s": costs.d2h_duplex_bytes_per_s / 1e9, "copy_latency_s": costs.copy_latency_s,
                  "clock_factor": costs.clock_factor, "predicted_gpu_peak_terms": gpu_peak_terms(costs, plan),
                  "predicted_loader_host_bytes": costs.loader_host_bytes}


def whole_step(costs, gpu_memory: int, host_memory: int, layers: int) -> tuple[dict, OffloadPlan | None]:
    """The planner's prediction of the step with `layers` decoder layers like the profiled ones
    (`with_layers`), under the budgets (bytes), the input embedding where it fits best
    (`embedding_homes`): its step seconds and GPU and host peaks, or where no plan fits the host
    budget, the least host memory a plan needs (`smallest_budget`, pass 1 keeping no attention
    output) and that plan's figures. Returns (those figures, the plan where one fits, else None):
    a whole step planned from one profiled layer, where profiling every layer would outlast a
    command."""
    from student.planner.costs import kept_attention, with_layers
    from student.planner.solve import embedding_homes, fastest, smallest_budget, solve_kept

    table = with_layers(costs, layers)
    try:
        found, _ = fastest(embedding_homes(table), gpu_memory, host_memory)
        p = found.predicted
        return {"layers": layers, "fits": True, "step_s": p.step_s, "gpu_peak_bytes": p.gpu_peak_bytes,
                "host_peak_bytes": p.host_peak_bytes, "embedding": found.embedding}, found
    except BudgetError as e:
        if e.field != "host_memory":
            return {"layers": layers, "fits": False, "error": str(e)}, None
    table = kept_attention(table, 0) if table.kv is not None else table
    least = smallest_budget(table, "host", gpu_memory)[1]
    if least is None:
        return {"layers": layers, "fits": False, "error": "no plan fits the GPU budget"}, None
    p = solve_kept(table, gpu_memory, int(least * 1.01))[0].predicted
    return {"layers": layers, "fits": False, "host_needed_bytes": least, "step_s": p.step_s,
            "gpu_peak_bytes": p.gpu_peak_bytes, "host_peak_bytes": p.host_peak_bytes}, None


def step_fn(model: Student, plan: OffloadPlan | None, args, work: Path, batch, chunks_of: OffloadPlan | None = None):
    """The trainer's step (module docstring); returns (step, runtime, optimizer). chunks_of: the plan
    whose chunk settings a step without offload takes (default `plan`'s)."""
    from student.offload.runtime import OffloadRuntime
    from student.optim.build import build_optimizer
    from student.optim.clip import clip_grad_norm_foreach
    from student.step import micro_batch_backward, steps_accumulate

    cfg = with_plan(train_config(args, work), chunks_of or plan)
    amp = torch.bfloat16 if args.device == "cuda" else None
    runtime = (OffloadRuntime(model, plan, args.device, amp, accumulates=steps_accumulate(cfg))
               if plan is not None else None)
    optimizer = build_optimizer(model, cfg.optim, args.device)
    losses = []

    def step(batch=batch):
        loss, _ = micro_batch_backward(model, batch, cfg, amp, cache_temperature=1.0)
        if runtime is not None:
            runtime.finish_grads()
        norm = runtime.clip_grad_norm(1.0) if runtime is not None else clip_grad_norm_foreach(model.parameters(), 1.0)
        runtime.step(optimizer) if runtime is not None else optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((loss.detach().float(), norm.detach().float()))

    return step, runtime, optimizer, losses


def check_plan(name: str, plan: OffloadPlan, config: StudentConfig, args, work: Path) -> dict:
    """Two steps of the plan's first --check-layers layers against the same student without offload."""
    layers = min(args.check_layers, config.num_layers)
    small = config.replace(num_layers=layers)
    plan = dataclasses.replace(plan, layers=plan.layers[:layers])
    batch = random_batch(args.seq_len, config.vocab_size, args.device, args.seed + 1)
    results = []
    for use in (None, plan):
        model = build_student(small, args.seed, args.device, layers_on_host=use is not None)
        step, runtime, _, losses = step_fn(model, use, args, work, batch, chunks_of=plan)
        step(), step()
        results.append(torch.stack([torch.stack(pair) for pair in losses]).cpu())
        if runtime is not None:
            runtime.close()
        del model, step, runtime
        free_memory(args.device)
    (want, got) = results
    print(f"{name} check, {layers} layers: (loss, gradient norm) by step: offloaded {got.tolist()}, "
          f"without offload {want.tolist()}", flush=True)
    loss_err = check_close(f"{name} check: losses of 2 steps, {layers} layers", got[:, 0], want[:, 0], atol=0.0,
                           rtol=LOSS_RTOL)
    norm_err = check_close(f"{name} check: gradient norms", got[:, 1], want[:, 1], atol=0.0, rtol=GRAD_NORM_RTOL)
    return {"check_layers": layers, "check_loss_error": loss_err, "check_grad_norm_error": norm_err}


def trace(step, stem: Path) -> None:
    """One more step under torch.profiler: `stem`.json.gz, a Chrome / Perfetto trace (every
    kernel and copy on its stream), and `stem`.txt, the operators and kernels by their own device
    time: where a step's time goes beyond the phases."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    stem.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    raw = stem.with_name(stem.name + ".json")
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(stem.with_name(stem.name + ".json.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    stem.with_name(stem.name + ".txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=80))


def case_suffix(args, plan: OffloadPlan | None) -> str:
    """What makes a row's case other than its shape and length: a GPU budget, chunk-recurrent
    settings, a capped allocator."""
    budget = f"-gpu{args.gpu_memory}" if args.gpu_memory else ""  # a budgeted run is another case
    if args.chunk_tokens is not None:  # and so is a chunk-recurrent one
        budget += f"-chunks{args.chunk_tokens}" + ("-kvoffload" if args.kv_offload else "")
        budget += f"-sparse{args.sparse_pages}" if args.sparse_pages is not None else ""
    if capped(plan, args):  # and one whose allocator is capped
        budget += "-capped"
    return budget


def capped(plan: OffloadPlan | None, args) -> bool:
    """Whether the variant trains under the allocator's cap: with a plan and --gpu-memory on a GPU."""
    return plan is not None and args.gpu_memory is not None and args.device == "cuda"


def measure(plan: OffloadPlan | None, config: StudentConfig, params: int, args, work: Path,
            hf_liger: bool = False, name: str = "step") -> dict:
    """One variant's figures (module docstring): `plan` under the trainer's step, or with `hf_liger`
    the transformers + Liger step; with --trace, one more step traced into --trace/`name`.*."""
    model = step = runtime = optimizer = None
    pinned_s = 0.0
    losses = []
    prime = min(args.prime_tokens, args.seq_len)
    if capped(plan, args):
        cap_allocator(parse_bytes(args.gpu_memory, "gpu_memory"), args.device)
    try:
        if hf_liger:
            from bench_long_context_gpu import hf_liger_step_fn

            step = hf_liger_step_fn(config, args.seq_len, args.device, args.seed)
            if prime:
                step(prime)
        else:
            model = build_student(config, args.seed, args.device, layers_on_host=plan is not None)
            batch = random_batch(args.seq_len, config.vocab_size, args.device, args.seed + 1)
            step, runtime, optimizer, losses = step_fn(model, plan, args, work, batch)
            progress(f"{name}: student built")
            if prime:
                step(random_batch(prime, config.vocab_size, args.device, args.seed + 2))
                pinned_s = prime_pinned(model, with_plan(train_config(args, work), plan), args.seq_len)
                progress(f"{name}: primed with {prime} tokens, pinned memory page-locked ahead in {pinned_s:.1f} s")
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        host_before = reset_host_peak()
        timer = time_gpu if args.device == "cuda" else time_cpu
        timing = timer(step, warmup=args.warmup, repeats=args.repeats)
        host_peak_bytes = host_peak()
        progress(f"{name}: {args.warmup} warm-up and {args.repeats} timed steps done")
    except torch.OutOfMemoryError as error:
        return {"oom": True, "peak_gib_at_oom": torch.cuda.max_memory_allocated() / GIB,
                "error": str(error).splitlines()[0]}
    seconds = timing.median_ms / 1e3
    if not all(torch.isfinite(loss) for loss, _ in losses):
        steps = ", ".join(f"{loss.item():.4g} (norm {norm.item():.4g})" for loss, norm in losses)
        raise RuntimeError(f"a non-finite loss in the timed steps; losses step by step: {steps}")
    phases = {}
    if runtime is not None:  # the last timed step's, read once its timing is done (the host sync they need
        phases = runtime.phase_s()  # comes after it); not one more step, which at 256K costs minutes
    if args.trace is not None:
        trace(step, args.trace / name)
    peak_gpu = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    peak_reserved = torch.cuda.max_memory_reserved() if args.device == "cuda" else None
    if args.memory_peak is not None:  # after the peak is read: it resets it
        from memory_peak import record_step

        record_step(step, args.memory_peak / f"{name}-peak.json")
    figures = {"oom": False, "step_s": seconds, "min_step_s": timing.min_ms / 1e3, "repeats": len(timing.times_ms),
               "pinned_primed_s": pinned_s,
               "steps_s": [ms / 1e3 for ms in timing.times_ms],  # in the order they ran
               "tok_s": args.seq_len / seconds, "model_tflops": tflops(6 * params * args.seq_len, timing.median_ms)}
    if host_before is not None:
        figures.update(host_rss_before_bytes=host_before, peak_host_rss_bytes=host_peak_bytes)
    if runtime is not None:
        gc.collect()  # the step's store hands its pools back to POOLS when it is collected
        figures["host_parts_bytes"] = {**host_parts(), "exact_pools": POOLS.kept_bytes(),
                                       "layers": runtime.host_bytes(optimizer)}
    if args.chunk_tokens is not None or hf_liger:  # the long-context rows and their baseline, on one measure
        from bench_long_context_gpu import model_flops

        figures["model_tflops_with_attention"] = tflops(model_flops(config, params, args.seq_len), timing.median_ms)
    if runtime is not None:
        figures["host_bytes_of_layers"] = runtime.host_bytes(optimizer)
        figures["phase_s"] = phases
        runtime.close()
    if args.device == "cuda":
        figures["peak_gpu_bytes"] = peak_gpu
        figures["peak_gpu_reserved_bytes"] = peak_reserved
        figures["of_matmul_ceiling"] = figures["model_tflops"] / ceilings()["matmul_bf16_tflops"]
    if plan is not None and plan.predicted.step_s > 0:
        p = plan.predicted
        figures.update(predicted_step_s=p.step_s, predicted_gpu_peak_bytes=p.gpu_peak_bytes,
                       predicted_host_peak_bytes=p.host_peak_bytes, step_s_predicted_over_measured=p.step_s / seconds,
                       predicted_phase_s=p.phase_s)
        if "peak_gpu_bytes" in figures:
            figures["gpu_peak_predicted_over_measured"] = p.gpu_peak_bytes / figures["peak_gpu_bytes"]
    del model, step, runtime, optimizer
    free_memory(args.device)
    return figures


def main(argv=None) -> list[dict]:
    """Run the benchmark; returns the rows it appended."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=("llama-3.1-8b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-3b", "qwen2-0.5b", "tiny"))
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens a step (one sequence)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only this many of the shape's decoder layers (rows `SHAPE-LN-T...`): its rates per "
                             "layer at a length whose whole step would outlast a command's time limit")
    parser.add_argument("--variants", default="none,zero_offload,planned", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--plan", type=Path, default=None, help="a saved plan, for the variant `file`")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "foam", "adamw8bit"))
    parser.add_argument("--gpu-memory", default=None, help="the planner's GPU budget, e.g. 40GiB (default: the device's)")
    parser.add_argument("--host-memory", default=None, help="the planner's host budget (default: the host's available)")
    parser.add_argument("--check-layers", type=int, default=2, help="layers of the student each plan is checked on (0: not checked, for a length where "
                             "two unchecked steps would take longer than the timed ones)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="chunk-recurrent steps of this many tokens")
    parser.add_argument("--kv-offload", action="store_true", help="with --chunk-tokens: the pages in pinned host memory")
    parser.add_argument("--page-tokens", type=int, default=64, help="positions per page of the key/value store")
    parser.add_argument("--offload-pages", type=int, default=1024, help="pages brought to the GPU at once (--kv-offload)")
    parser.add_argument("--sparse-pages", type=int, default=None,
                        help="with --chunk-tokens: past pages a chunk attends (LongContextConfig.sparse_pages; not exact)")
    parser.add_argument("--predict-layers", type=int, default=None,
                        help="planned, with --num-layers: also the planner's prediction of the step with this many "
                             "decoder layers like those profiled (the shape's whole step, at a length where it "
                             "outlasts a command), its figures in the row's whole_step")
    parser.add_argument("--chunk-candidates", default=None,
                        help="planned: chunk sizes the planner chooses among, e.g. 8192,16384 (needs --chunk-tokens)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prime-tokens", type=int, default=0,
                        help="one untimed step of this many tokens before the warm-up and timed steps (0: none), "
                             "then, with pages offloaded, the step's first-step pinned memory page-locked; "
                             "bench_long_context_gpu's docstring says why")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--trace", type=Path, default=None,
                        help="folder for one more step of each variant under torch.profiler (VARIANT.json.gz, VARIANT.txt)")
    parser.add_argument("--memory-peak", type=Path, default=None,
                        help="(CUDA) folder for one more step of each variant under the allocator's history: "
                             "VARIANT-peak.json, what is alive at the step's peak by where it was allocated")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the planner's student and cache, each variant's plan and the planned "
                             "variant's cost table (default: a temp dir, not kept)")
    add_results_arg(parser)
    args = parser.parse_args(argv)
    keep_freed_pieces()  # the host heap and OpenMP team as the trainer's process sets them (its CPU updates)
    one_openmp_team(args.device)
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if "hf_liger" in variants and (args.shape in ("llama-3.1-8b", "tiny") or args.device != "cuda"):
        raise SystemExit("--variants hf_liger runs the qwen2 shapes on CUDA only; drop it or pick a qwen2.5 --shape")
    if "file" in variants and args.plan is None:
        raise SystemExit("--variants file needs --plan PLAN.json")
    if args.chunk_tokens is None and (args.kv_offload or args.chunk_candidates or args.sparse_pages is not None):
        raise SystemExit("--kv-offload, --sparse-pages and --chunk-candidates need --chunk-tokens")
    if args.memory_peak is not None and args.device != "cuda":
        raise SystemExit("--memory-peak records torch's CUDA allocator; drop it on --device cpu")
    if args.num_layers is not None and args.num_layers < 1:
        raise SystemExit(f"--num-layers must be >= 1, got {args.num_layers}")
    if "planned" in variants:
        try:
            import student.planner.solve  # noqa: F401
        except ImportError:
            print("planned skipped: student.planner.solve does not import here", flush=True)
            variants.remove("planned")
    config = shape_config(args.shape, args.seq_len)
    name = args.shape
    if args.num_layers is not None:
        config, name = config.replace(num_layers=args.num_layers), f"{args.shape}-L{args.num_layers}"
    with torch.device("meta"):
        params = sum(p.numel() for p in Student(config).parameters())
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_offload_"))
    results = Results(bench=BENCH, path=args.results)
    base = {"shape": {**config.to_hf_dict(), "parameters": params}, "num_layers": args.num_layers, "seq_len": args.seq_len,
            "optimizer": args.optimizer, "gpu_memory": args.gpu_memory, "host_memory": args.host_memory,
            "torch": torch.__version__, "ceilings": ceilings() if args.device == "cuda" else None,
            "chunk_tokens": args.chunk_tokens, "kv_offload": args.kv_offload, "page_tokens": args.page_tokens,
            "offload_pages": args.offload_pages, "chunk_candidates": args.chunk_candidates,
            "sparse_pages": args.sparse_pages,
            "warmup": args.warmup, "prime_tokens": args.prime_tokens}
    progress("ceilings measured")
    for variant in variants:
        profiled = {}
        if variant == "planned":
            try:
                plan, profiled = planner_plan(config, args, work / "planner")
                progress("planned: profiled and solved")
            except BudgetError as e:  # a row of what the planner said: the smallest budget, and what holds it
                print(f"planned: no plan: {e}", flush=True)
                results.add(f"{name}-T{args.seq_len}{case_suffix(args, None)}/{variant}",
                            {"no_plan": True, "error": str(e), f"smallest_{e.field.removesuffix('_memory')}_bytes":
                             e.smallest_bytes, "least_gpu_peak_terms": e.peak_terms}, {**base, "variant": variant})
                continue
        elif variant == "hf_liger":
            plan = None
        else:
            plan = {"none": lambda: None, "zero_offload": lambda: fixed_plan(config.num_layers),
                    "file": lambda: OffloadPlan.load(args.plan)}[variant]()
        if plan is not None and args.work is not None:  # kept with the work folder, to train or plan from again
            args.work.mkdir(parents=True, exist_ok=True)
            plan.save(args.work / f"{variant}-plan.json")
        checks = check_plan(variant, plan, config, args, work) if plan is not None and args.check_layers else {}
        figures = {**measure(plan, config, params, args, work, hf_liger=variant == "hf_liger", name=variant),
                   **checks, **profiled}
        free_memory(args.device)  # also after an out-of-memory error
        if capped(plan, args):  # the next variant uncapped, unless it caps again
            torch.cuda.set_per_process_memory_fraction(1.0, cuda_index(args.device))
        results.add(f"{name}-T{args.seq_len}{case_suffix(args, plan)}/{variant}", figures,
                    {**base, "variant": variant, "plan": plan.to_dict() if plan is not None else None})
    if args.work is None:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return results.rows


if __name__ == "__main__":
    main()
