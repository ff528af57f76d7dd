"""Generation throughput of `distill generate`'s student backend against transformers' `generate`
on a GPU (issue 44's goal: at least 3x its tokens/s for the same student, batch and lengths).

Per shape (a random-weight HF folder, bench_teacher_gpu.save_random_model, bf16): B prompts of P
random ids, N new tokens each, temperature 1, top-p 1, no stop id (every row writes N tokens).
  ours          the student backend's decoder (pipelines/generate/decode.py: rows batched, keys
                and values in buffers allocated once, each step one CUDA graph), as StudentSampler
                calls it, its per-row uniforms drawn on the host included
  transformers  AutoModelForCausalLM (bf16) .generate(do_sample=True, top_k=0, max_new_tokens=N)
                with its defaults otherwise (dynamic cache, sdpa, no compile); top_k=0 because its
                default top-k 50 would sample another distribution than ours
Before timing: ours with and without the graph draws the same tokens, and its log-probabilities
equal one full forward of the sampled sequences (prompts of mixed lengths, so the padding is
checked too).

The floor: a decode step must read every weight once and each row's keys and values so far, so
one step takes at least (weight bytes + the mean step's key/value bytes) / the copy bandwidth
measured in the same run (harness.ceilings; read + write bytes); tokens/s at the floor is B over
that time. kernels_per_step (profiled on the eager step) says what bounds a step instead when
the model is small: its kernels run one after another, each too short to fill the GPU.

Rows `generate_gpu/<shape>-B<B>-P<P>-N<N>/<ours|transformers>`: tokens_per_s, ms_per_step,
peak_gib (above the weights), and for ours speedup (over transformers), of_bandwidth_floor and
kernels_per_step.

    python tests/benchmarks/bench_generate_gpu.py --shapes smollm2-135m,qwen2-0.5b --batch 64
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch
from bench_teacher_gpu import SHAPES, save_random_model
from harness import Results, add_results_arg, ceilings, check_close, time_gpu

from pipelines.generate.decode import BatchDecoder
from pipelines.generate.samplers import draw_tokens, nucleus_logprobs
from student.model import Student


def our_decoder(model: Student, cuda_graph: bool = True) -> BatchDecoder:
    return BatchDecoder(model, lambda logits: nucleus_logprobs(logits, 1.0, 1.0), draw_tokens, (), cuda_graph)


def uniforms(rows: int, new: int) -> torch.Tensor:
    """As StudentSampler draws them: one host generator a row."""
    return torch.stack([torch.rand(new, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
                        for r in range(rows)])


@torch.inference_mode()
def check(model: Student, vocab: int, new: int) -> dict:
    """Graph vs eager on 8 rows of mixed prompt lengths, and the log-probs vs one full forward."""
    gen = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(0, vocab, (20 - 3 * r,), generator=gen).tolist()) for r in range(6)]
    draws = uniforms(len(prompts), new)
    graphed = our_decoder(model).decode(prompts, draws)
    eager = our_decoder(model, cuda_graph=False).decode(prompts, draws)
    same_tokens = float((graphed.tokens == eager.tokens).float().mean())
    assert same_tokens == 1.0, f"graph and eager decoding drew other tokens ({same_tokens:.3f} equal)"
    worst = 0.0
    for prompt, tokens, logprobs in zip(prompts, graphed.tokens, graphed.logprobs):
        ids = torch.tensor([*prompt, *tokens.tolist()], device="cuda")[None]
        logits = model.logits(model(ids))[0, len(prompt) - 1:-1]
        want = nucleus_logprobs(logits, 1.0, 1.0).gather(1, tokens.cuda()[:, None])[:, 0].cpu()
        worst = max(worst, check_close("decoded log-probs vs a full forward", logprobs, want, atol=0.05))
    return {"graph_equals_eager_tokens": same_tokens, "logprob_vs_forward_max_abs": worst}


def kernels_per_step(model: Student) -> float:
    """GPU kernels one eager decode step launches (profiled: 12 new tokens less 4, over 8); the graph
    replays the same kernels without the host between them."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [tuple(range(1, 9))] * 4
    counts = {}
    for new in (4, 12):
        draws = uniforms(len(prompts), new)
        our_decoder(model, cuda_graph=False).decode(prompts, draws)  # warm
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            our_decoder(model, cuda_graph=False).decode(prompts, draws)
            torch.cuda.synchronize()
        counts[new] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return (counts[12] - counts[4]) / 8


def floor_ms(model: Student, rows: int, prompt: int, new: int, copy_gbps: float) -> float:
    c = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mean_keys = prompt + new / 2
    kv_bytes = 2 * c.num_layers * rows * c.num_kv_heads * c.head_dim * mean_keys * 2  # bf16
    return (weight_bytes + kv_bytes) / (copy_gbps * 1e9) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,qwen2-0.5b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    add_results_arg(ap)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    results = Results(bench="generate_gpu", path=args.results)
    ceiling = ceilings()
    config = {"batch": args.batch, "prompt": args.prompt, "new_tokens": args.new, "temperature": 1.0, "top_p": 1.0,
              "dtype": "bfloat16", "repeats": args.repeats}
    for shape in args.shapes.split(","):
        vocab = SHAPES[shape][1]
        case = f"{shape}-B{args.batch}-P{args.prompt}-N{args.new}"
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_random_model(shape, Path(tmp) / shape, "cuda")
            ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
            tokens = args.batch * args.new

            model = Student.from_pretrained(folder, dtype=torch.bfloat16, device="cuda").eval()
            checks = check(model, vocab, 24)
            checks["kernels_per_step"] = kernels_per_step(model)
            prompts = [tuple(row) for row in ids.tolist()]
            decoder = our_decoder(model)
            ours = time_gpu(lambda: decoder.decode(prompts, uniforms(args.batch, args.new)), warmup=1,
                            repeats=args.repeats)
            floor = floor_ms(model, args.batch, args.prompt, args.new, ceiling["copy_gbps"])
            del model, decoder
            gc.collect()
            torch.cuda.empty_cache()

            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
            hf.generation_config.eos_token_id = None
            inputs = ids.cuda()

            def hf_generate():
                with torch.inference_mode():
                    out = hf.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=True, top_k=0,
                                      temperature=1.0, top_p=1.0, max_new_tokens=args.new,
                                      pad_token_id=0)
                assert out.shape == (args.batch, args.prompt + args.new), out.shape
            theirs = time_gpu(hf_generate, warmup=1, repeats=args.repeats)
            del hf
            gc.collect()
            torch.cuda.empty_cache()

        def figures(timing) -> dict:
            return {"tokens_per_s": tokens / (timing.median_ms / 1e3), "ms_per_step": timing.median_ms / args.new,
                    "peak_gib": timing.peak_gib, **timing.figures()}
        results.add(f"{case}/transformers", figures(theirs), {**config, "shape": shape})
        mine = figures(ours)
        mine.update(speedup=theirs.median_ms / ours.median_ms, floor_ms_per_step=floor,
                    of_bandwidth_floor=floor / mine["ms_per_step"], copy_gbps=ceiling["copy_gbps"], **checks)
        results.add(f"{case}/ours", mine, {**config, "shape": shape})
        print(f"{case}: ours {mine['tokens_per_s']:,.0f} tok/s, transformers {tokens / theirs.median_ms * 1e3:,.0f} "
              f"({mine['speedup']:.2f}x); floor share {mine['of_bandwidth_floor']:.3f}", flush=True)


if __name__ == "__main__":
    main()
