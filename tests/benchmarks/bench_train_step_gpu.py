"""One training step of a Qwen2-0.5B-shaped student, ours against transformers, side by side in one run.

Setup, on the GPU machine: a random-init student of the Qwen2-0.5B shape (hidden 896, 24 layers,
14 / 2 heads, intermediate 4,864, vocab 151,936, tied embeddings, qkv bias) saved as an HF folder
with a word-level tokenizer of 151,936 ids, and a real on-disk teacher cache written by
``CacheWriter`` (parquet, k = 100, random but valid top-k targets: distinct ids, descending
log-probabilities, 90% of the mass on the top-k).

Variants, all on batches read from that cache by ``student.data.CacheBatches``, fp32 master
weights, bf16 autocast, fused AdamW (the trainer's groups and betas), clipping at 1.0, tail
"bucket", T = 1:
  train()       ``student.trainer.train`` itself for --train-steps steps; tok/s from its
                metrics.jsonl windows after the first (data loading, .item() syncs included)
  ours          a manual loop of the trainer's ``_step_loss`` + backward + clip + step, with the
                config as train() resolves it on a GPU (dtype "bfloat16"): the final hidden
                states, fp32 under autocast (the residual stream and the final RMSNorm stay
                fp32), are cast to bf16 with the lm-head before the fused loss, impl auto = Triton
  ours_fp32_head  the same without that cast: the fused loss and its three matmuls in fp32
                (what _step_loss did before the cast was added, and still does for dtype "auto")
  hf            transformers ``Qwen2ForCausalLM`` (sdpa) loaded from the same folder, full logits
                under autocast (bf16), the same top-k KL written on the logits (dense, autograd)
Per-step time: CUDA events around one whole step on batches already on the GPU, median after
--warmup steps. Peak: torch.cuda.max_memory_allocated over the timed steps (weights, grads,
AdamW state and activations included). Before timing, the step-0 losses of ours, ours_fp32_head
and hf on one batch with the same weights.

    PYTHONPATH=. python tests/benchmarks/bench_train_step_gpu.py --out /tmp/bench_train_step.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kernels.fused_topk_kl import fused_topk_kl
from kernels.fused_topk_kl_torch import plogp_diff, row_weights, teacher_logprobs
from student.config import StudentConfig
from student.data import CacheBatches
from student.model import Student
from student.trainer import TrainConfig, _optimizer, _step_loss, train
from teacher_cache.reader import CacheReader
from teacher_cache.targets import TeacherTargets
from teacher_cache.writer import CacheWriter

GIB = 2**30
VOCAB = 151_936
QWEN2_05B = StudentConfig(model_type="qwen2", vocab_size=VOCAB, hidden_size=896, intermediate_size=4864,
                          num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1_000_000.0,
                          max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
                          extra={"bos_token_id": 1, "eos_token_id": 2})


def make_tokenizer(folder: Path, num_words: int = VOCAB) -> dict:
    """A word-level tokenizer of at most VOCAB ids saved in `folder`; returns its identity
    (hash, vocab_size). Some transformers versions count one token more than the vocabulary
    holds (seen: 151,937 for 151,936 words), so the words are cut until it fits."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from teacher_cache.identity import tokenizer_info

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, num_words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    info = tokenizer_info(AutoTokenizer.from_pretrained(folder))
    if info["vocab_size"] > VOCAB:
        return make_tokenizer(folder, num_words - (info["vocab_size"] - VOCAB))
    return info


def write_cache(path: Path, tok: dict, num_seqs: int, seq_len: int, k: int, shard_size: int, seed: int = 0):
    """A parquet cache of random but valid targets over the tokenizer's ids, by the real CacheWriter."""
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


def hf_topk_kl(logits_NV, batch, tail="bucket"):
    """The fused loss's definition (T = 1, no CE, mean over unmasked rows) on full logits, as
    ``topk_kl_dense`` writes it; autograd differentiates."""
    z_NV = logits_NV.float()
    ids_NK = batch.topk_ids
    logq_NV = torch.log_softmax(z_NV, dim=-1)
    logp_NK, logp_tail_N = teacher_logprobs(batch.topk_logprobs, batch.tail_logmass, tail, 1.0)
    kl_N = plogp_diff(logp_NK, logq_NV.gather(1, ids_NK)).sum(-1)
    if tail == "bucket":
        kl_N = kl_N + plogp_diff(logp_tail_N, torch.logsumexp(logq_NV.scatter(1, ids_NK, float("-inf")), dim=-1))
    kl_w_N, _ = row_weights(batch.mask, None, z_NV.shape[0], 0.0, 1.0, "mean", z_NV.device)
    return torch.where(kl_w_N != 0, kl_w_N.float() * kl_N, 0).sum()


def losses(variant, model, batch, cfg, amp):
    if variant == "ours":
        return _step_loss(model, batch, dataclasses.replace(cfg, dtype="bfloat16"), amp)[0]
    if variant == "ours_fp32_head":
        with amp:
            hidden = model(batch.input_ids)
        hidden_ND = hidden.reshape(-1, hidden.shape[-1])
        return fused_topk_kl(hidden_ND, model.lm_head_weight.to(hidden_ND.dtype), batch.topk_ids, batch.topk_logprobs,
                             batch.tail_logmass, mask=batch.mask, tail=cfg.tail, check_ids=False)
    with amp:
        logits = model(input_ids=batch.input_ids).logits
    return hf_topk_kl(logits.reshape(-1, logits.shape[-1]), batch, cfg.tail)


def time_steps(variant, model, batches, cfg, warmup, repeats):
    """Median ms of one whole step, peak GiB, tokens per step."""
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    opt = _optimizer(model, cfg)
    times = []
    for i in range(warmup + repeats):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batch = batches[i % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = losses(variant, model, batch, cfg, amp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if not torch.isfinite(loss):
            raise RuntimeError(f"{variant}: loss {loss.item()} at step {i}")
        if i >= warmup:
            times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() / GIB
    del opt
    return statistics.median(times), peak, times


def fp32_matmul_flags() -> dict:
    """The process-wide switches that decide whether fp32 matmuls run in TF32 (they change speed)."""
    import os

    flags = {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
             "float32_matmul_precision": torch.get_float32_matmul_precision(),
             "env": {k: v for k, v in os.environ.items() if "TF32" in k}}
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        flags["matmul_fp32_precision"] = matmul.fp32_precision
    return flags


def gpu_batches(reader, batch_size, count, seed=0):
    data = CacheBatches(reader, list(range(reader.num_sequences)), batch_size, seed=seed)
    it = iter(data)
    return [next(it).to("cuda") for _ in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-sizes", default="4,16", help="sequences per step (tokens = this x seq-len)")
    parser.add_argument("--variants", default="ours,ours_fp32_head,hf")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=16)
    parser.add_argument("--work", default=None, help="folder for the student and the cache (default: a temp dir)")
    args = parser.parse_args()
    import transformers
    from transformers import Qwen2ForCausalLM

    report = dict(args=vars(args), device=torch.cuda.get_device_name(), torch=torch.__version__,
                  transformers=transformers.__version__)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_train_step_"))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    student_dir = work / "student"
    Student(QWEN2_05B).save_pretrained(student_dir)
    tok = make_tokenizer(student_dir)
    report["tokenizer_vocab_size"] = tok["vocab_size"]
    write_cache(work / "cache", tok, args.num_seqs, args.seq_len, 100, shard_size=8)
    report["setup_s"] = time.perf_counter() - t0
    print(f"student + cache written in {report['setup_s']:.1f} s", flush=True)
    reader = CacheReader(work / "cache", expect_vocab_size=tok["vocab_size"], expect_tokenizer_hash=tok["hash"])
    bs0 = int(args.batch_sizes.split(",")[0])
    report["fp32_flags"] = {"start": fp32_matmul_flags()}
    cfg = TrainConfig(cache=str(work / "cache"), out=str(work / "run"), student=str(student_dir),
                      steps=args.train_steps, batch_size=bs0, lr=3e-4, warmup_steps=2, heldout=1, eval_every=0,
                      eval_sequences=1, save_every=0, log_every=4, device="cuda", seed=0)

    # the manual loop once before train(), to see that train() leaves no process state behind
    model = Student.from_pretrained(student_dir, device="cuda")
    ms, _, _ = time_steps("ours", model, gpu_batches(reader, bs0, 2, seed=1), cfg, args.warmup, args.repeats)
    report["ours_before_train_ms"] = ms
    print(f"ours before train(): {ms:.1f} ms per step", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()

    # train() itself
    t0 = time.perf_counter()
    train(cfg, progress=False)
    report["train_wall_s"] = time.perf_counter() - t0
    report["fp32_flags"]["after_train"] = fp32_matmul_flags()
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    windows = [r["tok_per_s"] for r in rows if r["kind"] == "train"]
    report["train_tok_per_s_windows"] = windows
    report["train_tok_per_s"] = statistics.median(windows[1:]) if len(windows) > 1 else None
    print(f"train(): {args.train_steps} steps of {bs0} x {args.seq_len} in {report['train_wall_s']:.1f} s "
          f"(eval, checkpoint and student save included); tok/s per window {[round(w) for w in windows]}",
          flush=True)
    gc.collect()
    torch.cuda.empty_cache()

    # step-0 losses on the same weights and batch
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    batch = gpu_batches(reader, bs0, 1)[0]
    ours = Student.from_pretrained(student_dir, device="cuda")
    hf = Qwen2ForCausalLM.from_pretrained(student_dir, dtype=torch.float32, attn_implementation="sdpa").cuda()
    with torch.no_grad():
        report["step0_loss"] = {"ours": losses("ours", ours, batch, cfg, amp).item(),
                                "ours_fp32_head": losses("ours_fp32_head", ours, batch, cfg, amp).item(),
                                "hf": losses("hf", hf, batch, cfg, amp).item()}
    report["fp32_flags"]["after_hf_load"] = fp32_matmul_flags()
    print("step-0 losses:", report["step0_loss"], flush=True)
    print("fp32 matmul flags:", report["fp32_flags"], flush=True)
    del ours, hf, batch
    gc.collect()
    torch.cuda.empty_cache()

    results = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batches = gpu_batches(reader, bs, 2, seed=1)
        tokens = int(batches[0].num_tokens)
        for variant in args.variants.split(","):
            row = dict(variant=variant, batch=bs, seq_len=args.seq_len, tokens=tokens)
            model = None
            try:
                if variant == "hf":
                    model = Qwen2ForCausalLM.from_pretrained(student_dir, dtype=torch.float32,
                                                             attn_implementation="sdpa").cuda()
                else:
                    model = Student.from_pretrained(student_dir, device="cuda")
                model.train()
                ms, peak, times = time_steps(variant, model, batches, cfg, args.warmup, args.repeats)
                row.update(ms=ms, times_ms=times, peak_GiB=peak, tok_per_s=tokens / (ms * 1e-3))
            except torch.OutOfMemoryError:
                row.update(ms=None, error="OOM", peak_GiB=torch.cuda.max_memory_allocated() / GIB)
            del model
            gc.collect()
            torch.cuda.empty_cache()
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "times_ms"}), flush=True)
        del batches
    report["results"] = results
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))

    print(f"\ntrain(): median tok/s over windows 2.. = {report['train_tok_per_s']}")
    print("\n| tokens/step | variant | median ms | tok/s | peak GiB |")
    print("|---|---|---|---|---|")
    for r in results:
        if r["ms"] is None:
            print(f"| {r['tokens']:,} | {r['variant']} | {r['error']} | | >= {r['peak_GiB']:.1f} |")
        else:
            print(f"| {r['tokens']:,} | {r['variant']} | {r['ms']:.1f} | {r['tok_per_s']:,.0f} | {r['peak_GiB']:.1f} |")


if __name__ == "__main__":
    main()
