"""One training step of a Qwen2-0.5B-shaped student, ours against transformers, side by side in one run.

Setup: a random-init student of the Qwen2-0.5B shape (hidden 896, 24 layers, 14 / 2 heads,
intermediate 4,864, vocab 151,936, tied embeddings, qkv bias) saved as an HF folder with a
word-level tokenizer, and a teacher cache on disk written by `CacheWriter` (parquet, k = 100,
random but valid targets: distinct ids, descending log-probabilities, 90% of the mass on the
top-k), read by `student.data.CacheBatches`. Every variant: fp32 master weights, bf16 autocast,
the optimizer `student.optim.build_optimizer` makes from the run's config (fused AdamW with the
trainer's groups), torch's clipping at 1.0, the trainer's loss settings (tail "bucket", T = 1).

Rows `train_step/T<tokens>/<variant>`, one whole step (forward, loss, backward, clip, optimizer
step, zero_grad) on batches already on the device, CUDA events, median after warm-up steps; peak
= the largest allocation during the timed steps (weights, gradients, optimizer state and
activations); TFLOP/s count 6 x parameters + causal attention (6 x layers x seq_len x hidden) per
token, against the bf16 matmul ceiling:
  ours            the trainer's step: our `Student`, its final hidden states cast to bf16 with
                  the lm-head, the fused top-k KL (`fused_topk_kl`, the Triton path on a GPU)
  ours_fp32_head  the same without the cast: the fused loss's three matmuls in fp32
  hf              transformers `Qwen2ForCausalLM` (sdpa) on the same weights; the dense top-k KL
                  (`topk_kl_dense`) on its final hidden states and lm-head: the full logits, as
                  its own lm-head computes them under autocast
  hf_liger        hf with Liger-Kernel's RMSNorm, RoPE and SwiGLU kernels (`liger_kernel`, when
                  it imports), the same dense loss
and `train_step/T<tokens>/train`: `student.trainer.train` itself for --train-steps steps, tokens/s
over its logging windows after the first (data loading and host syncs included).
Before timing, each variant's step-0 loss and lm-head gradient on one batch are checked against
hf's on the same weights.

    PYTHONPATH=. python tests/benchmarks/bench_train_step_gpu.py --results $OUT/results.jsonl

On a CPU, `--device cpu --shape tiny --seq-len 64 --batch-sizes 2,4` runs every step at a toy
size (a smoke test, not a figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from harness import Results, add_results_arg, ceilings, check_close, free_memory, tflops, time_cpu, time_gpu

from kernels.fused_topk_kl import fused_topk_kl, topk_kl_dense
from student.config import StudentConfig
from student.data import CacheBatches
from student.model import Student
from student.trainer import TrainConfig, train
from teacher_cache.reader import CacheReader
from teacher_cache.targets import TeacherTargets
from teacher_cache.writer import CacheWriter

GIB = 2**30
SHAPES = {
    "qwen2-0.5b": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                       num_kv_heads=2, head_dim=64),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16),  # CPU smoke test only
}
VARIANTS = ("ours", "ours_fp32_head", "hf", "hf_liger")


def student_config(shape: str) -> StudentConfig:
    return StudentConfig(model_type="qwen2", rope_theta=1_000_000.0, max_position_embeddings=32768,
                         tie_word_embeddings=True, attention_bias=True, extra={"bos_token_id": 1, "eos_token_id": 2},
                         **SHAPES[shape])


def make_tokenizer(folder: Path, vocab: int, num_words: int | None = None) -> dict:
    """A word-level tokenizer of at most `vocab` ids saved in `folder`; returns its identity
    (hash, vocab_size). Some transformers versions count one token more than the vocabulary
    holds (seen: 151,937 for 151,936 words), so the words are cut until it fits."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from teacher_cache.identity import tokenizer_info

    num_words = num_words or vocab
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, num_words)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    info = tokenizer_info(AutoTokenizer.from_pretrained(folder))
    if info["vocab_size"] > vocab:
        return make_tokenizer(folder, vocab, num_words - (info["vocab_size"] - vocab))
    return info


def write_cache(path: Path, tok: dict, num_seqs: int, seq_len: int, k: int, shard_size: int, seed: int = 0):
    """A parquet cache of random but valid targets over the tokenizer's ids, by the real CacheWriter;
    one already complete at `path` with this spec is kept (a --work folder used again)."""
    vocab = tok["vocab_size"]
    rng = np.random.default_rng(seed)
    spec = {
        "teacher": {"path": "synthetic", "weights_hash": "w0", "backend": "hf", "dtype": "bfloat16"},
        "tokenizer": {"hash": tok["hash"], "vocab_size": vocab, "special_ids": {"bos": 1, "eos": 2, "pad": None}},
        "data": {"source": "synthetic", "fingerprint": "f0", "sequences": num_seqs, "tokens": num_seqs * seq_len,
                 "seq_len": seq_len},
        "targets": {"k": k, "value_codec": "fp32", "temperature": 1.0},
        "storage": {"format": "parquet", "shard_size": shard_size},
    }
    with CacheWriter(path, spec) as writer:
        if writer.is_complete:
            return
        for shard in range(writer.num_shards):
            seqs, parts = [], []
            for _ in range(min(shard_size, num_seqs - shard * shard_size)):
                seqs.append(rng.integers(3, vocab, seq_len).astype(np.int32))
                offsets_K = rng.choice(vocab, k, replace=False)
                ids_LK = ((rng.integers(0, vocab, seq_len)[:, None] + offsets_K[None]) % vocab).astype(np.int32)
                logits_LK = -np.sort(-rng.standard_normal((seq_len, k)) * 2.0, axis=1)
                lp_LK = logits_LK - np.logaddexp.reduce(logits_LK, axis=1, keepdims=True) + np.log(0.9)
                target = np.full(seq_len, -6.0, np.float32)
                target[-1] = np.nan
                parts.append(TeacherTargets(ids_LK, lp_LK.astype(np.float32),
                                            np.full(seq_len, np.log(0.1), np.float32), target))
            writer.write_shard(shard, seqs, TeacherTargets.concat(parts))
        writer.finalize()


def load_model(variant: str, student_dir: Path, device: str):
    if variant.startswith("ours"):
        return Student.from_pretrained(student_dir, device=device).train()
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(student_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    if variant == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        # Patches this instance's norms and MLPs and the module's RoPE function; the loss stays ours.
        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=model)
    return model.train()


def lm_head(variant: str, model) -> torch.Tensor:
    return model.lm_head_weight if variant.startswith("ours") else model.get_output_embeddings().weight


def step_loss(variant: str, model, batch, loss_kw: dict, amp):
    """The loss of one micro-batch as each side computes it."""
    if variant.startswith("ours"):
        with amp:
            hidden = model(batch.input_ids, token_mask=batch.mask)
        hidden_ND = hidden.reshape(-1, hidden.shape[-1])
        if variant == "ours":  # as the trainer does for dtype "bfloat16": the final norm returns fp32 under autocast
            hidden_ND = hidden_ND.to(torch.bfloat16)
        weight = model.lm_head_weight.to(hidden_ND.dtype)
        return fused_topk_kl(hidden_ND, weight, batch.topk_ids, batch.topk_logprobs, batch.tail_logmass,
                             target_ids=batch.target_ids, mask=batch.mask, check_ids=False, **loss_kw)
    with amp:
        hidden = model.get_decoder()(input_ids=batch.input_ids).last_hidden_state
        weight = model.get_output_embeddings().weight.to(hidden.dtype)
        return topk_kl_dense(hidden.reshape(-1, hidden.shape[-1]), weight,
                             batch.topk_ids, batch.topk_logprobs, batch.tail_logmass, target_ids=batch.target_ids,
                             mask=batch.mask, check_ids=False, **loss_kw)


def loss_and_grad(variant: str, model, batch, loss_kw: dict, amp) -> tuple[torch.Tensor, torch.Tensor]:
    loss = step_loss(variant, model, batch, loss_kw, amp)
    loss.backward()
    grad = lm_head(variant, model).grad.detach().float().clone()
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grad


def check_against_hf(variant: str, model, batch, loss_kw, amp, reference) -> dict:
    """Step-0 loss to 1e-3 relative and the lm-head gradient to 5e-2 in relative norm (two
    implementations rounding differently under bf16 autocast) against hf on the same weights."""
    loss, grad = loss_and_grad(variant, model, batch, loss_kw, amp)
    ref_loss, ref_grad = reference
    loss_err = check_close(f"{variant} step-0 loss", loss, ref_loss, atol=0.0, rtol=1e-3)
    grad_err = ((grad - ref_grad).norm() / ref_grad.norm()).item()
    check_close(f"{variant} lm-head gradient, relative norm error", grad_err, 0.0, atol=5e-2)
    return {"step0_loss": loss.item(), "step0_loss_vs_hf": loss_err, "lm_head_grad_vs_hf": grad_err}


def time_steps(variant, model, batches, config, loss_kw, amp, device, warmup, repeats):
    """One whole step per call; (timing, absolute peak GiB)."""
    from student.optim.build import build_optimizer

    optimizer = build_optimizer(model, config.optim, device)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = config.to_flat()["clip_grad"]
    losses, calls = [], [0]

    def step():
        batch = batches[calls[0] % len(batches)]
        calls[0] += 1
        loss = step_loss(variant, model, batch, loss_kw, amp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    timing = (time_gpu if device == "cuda" else time_cpu)(step, warmup=warmup, repeats=repeats)
    peak = torch.cuda.max_memory_allocated() / GIB if device == "cuda" else 0.0
    bad = [i for i, loss in enumerate(losses) if not torch.isfinite(loss)]
    if bad:
        raise RuntimeError(f"{variant}: non-finite loss at step {bad[0]}")
    return timing, peak


def device_batches(reader, batch_size, count, device, seed=0):
    it = iter(CacheBatches(reader, list(range(reader.num_sequences)), batch_size, seed=seed))
    return [next(it).to(device) for _ in range(count)]


def train_windows(config, work: Path) -> tuple[float, list[float]]:
    """`student.trainer.train` for the config's steps; (wall seconds, tokens/s of each logging window)."""
    start = time.perf_counter()
    train(config, progress=False)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return wall, [r["tok_per_s"] for r in rows if r.get("kind") == "train" and "tok_per_s" in r]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b", choices=tuple(SHAPES))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-sizes", default="4,16", help="sequences per step (tokens = this x seq-len)")
    parser.add_argument("--variants", default="ours,hf,hf_liger", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--num-seqs", type=int, default=40, help="sequences in the cache")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=16, help="steps of the train() row (0: no such row)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--work", type=Path, default=None, help="folder for the student and the cache (default: a temp dir)")
    add_results_arg(parser)
    args = parser.parse_args()
    variants = args.variants.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if "hf_liger" in variants:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            print("hf_liger skipped: liger_kernel does not import here", flush=True)
            variants.remove("hf_liger")
    variants.sort(key=lambda v: v == "hf_liger")  # Liger's RoPE patch is module-wide: its rows last
    if args.num_seqs < 2 * max(batch_sizes) + 1:
        raise SystemExit(f"--num-seqs must hold two batches of {max(batch_sizes)} and a held-out sequence")
    import transformers

    device = args.device
    results = Results(bench="train_step", path=args.results)
    ceiling = ceilings() if device == "cuda" else None
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_train_step_"))
    torch.manual_seed(0)
    student_dir = work / "student"
    with torch.device(device):  # random init on the device: seconds instead of a minute on the host
        student = Student(student_config(args.shape))
    params = sum(p.numel() for p in student.parameters())
    student.save_pretrained(student_dir)
    del student
    tok = make_tokenizer(student_dir, SHAPES[args.shape]["vocab_size"])
    write_cache(work / "cache", tok, args.num_seqs, args.seq_len, min(100, tok["vocab_size"] // 4), shard_size=8)
    reader = CacheReader(work / "cache", expect_vocab_size=tok["vocab_size"], expect_tokenizer_hash=tok["hash"])
    config = TrainConfig.from_flat(cache=str(work / "cache"), out=str(work / "run"), student=str(student_dir),
                                   steps=max(args.train_steps, 1), batch_size=batch_sizes[0], lr=3e-4, warmup_steps=2,
                                   heldout=1, eval_every=0, eval_sequences=1, save_every=0, log_every=4, device=device,
                                   seed=0)
    flat = config.to_flat()
    cache_temperature = reader.manifest.spec.targets.temperature
    loss_kw = {"tail": flat["tail"], "ce_weight": flat["ce_weight"], "cache_temperature": cache_temperature,
               "temperature": config.loss.distillation_temperature(cache_temperature)}
    amp = torch.autocast(device, dtype=torch.bfloat16)
    shape = SHAPES[args.shape]
    base = {"shape": {**shape, "parameters": params}, "seq_len": args.seq_len, "loss": loss_kw,
            "optimizer": {key: flat[key] for key in ("optimizer", "lr", "weight_decay", "clip_grad")},
            "float32_matmul_precision": torch.get_float32_matmul_precision(), "torch": torch.__version__,
            "transformers": transformers.__version__, "ceilings": ceiling}

    check_batch = device_batches(reader, batch_sizes[0], 1, device)[0]
    hf = load_model("hf", student_dir, device)
    reference = loss_and_grad("hf", hf, check_batch, loss_kw, amp)
    del hf
    free_memory(device)
    checks = {}

    for variant in variants:
        for bs in batch_sizes:
            batches = device_batches(reader, bs, 2, device, seed=1)
            tokens = batches[0].num_tokens
            case, config_row = f"T{tokens}/{variant}", {**base, "batch_size": bs, "variant": variant}
            model = load_model(variant, student_dir, device)
            if variant not in checks and variant != "hf":
                checks[variant] = check_against_hf(variant, model, check_batch, loss_kw, amp, reference)
            try:
                timing, peak = time_steps(variant, model, batches, config, loss_kw, amp, device, args.warmup,
                                          args.repeats)
            except torch.OutOfMemoryError:
                figures = {"out_of_memory": True, "peak_gib_at_oom": torch.cuda.max_memory_allocated() / GIB}
            else:
                flops = 6 * tokens * (params + shape["num_layers"] * args.seq_len * shape["hidden_size"])
                figures = {**timing.figures(), "peak_gib": peak, "tok_s": tokens / (timing.median_ms / 1e3),
                           "tflops": tflops(flops, timing.median_ms), **checks.get(variant, {})}
                if ceiling:
                    figures["of_matmul_ceiling"] = figures["tflops"] / ceiling["matmul_bf16_tflops"]
            results.add(case, figures, config_row)
            del model, batches
            free_memory(device)

    if args.train_steps:
        wall, windows = train_windows(config, work)
        tok_s = statistics.median(windows[1:]) if len(windows) > 1 else None
        results.add(f"T{batch_sizes[0] * args.seq_len}/train",
                    {"tok_s": tok_s, "tok_s_windows": windows, "wall_s": wall},
                    {**base, "batch_size": batch_sizes[0], "steps": args.train_steps, "train_config": flat})
    if args.work is None:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
