"""Where the time of a teacher pass goes on a GPU: the model body, the lm-head matmul, the
log-softmax and the top-k, timed separately with CUDA events (medians), for the two benchmark
shapes. Run on the GPU machine:

    python tests/benchmarks/profile_teacher_head_gpu.py
"""

from __future__ import annotations

import statistics

import torch

SHAPES = {
    # name: (hidden, vocab, layers, heads, kv_heads, intermediate)
    "smollm2-135m": (576, 49152, 30, 9, 3, 1536),
    "qwen2-0.5b": (896, 151936, 24, 14, 2, 4864),
}


def bench(fn, reps=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def model_for(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    d, v, layers, heads, kv, inter = SHAPES[shape]
    common = dict(hidden_size=d, vocab_size=v, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=4096)
    if shape.startswith("qwen"):
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    return model.to("cuda", torch.bfloat16).eval()


@torch.inference_mode()
def main() -> None:
    k, batch, seq = 100, 8, 2048
    rows = []
    for shape in SHAPES:
        torch.manual_seed(0)
        model = model_for(shape)
        d, v = SHAPES[shape][:2]
        ids = torch.randint(0, v, (batch, seq), device="cuda")
        n = batch * seq
        w = model.get_output_embeddings().weight
        h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        logits = h @ w.T
        logits32 = logits.float()

        def obvious():
            out = model(ids).logits.float().log_softmax(-1)
            vals, idx = out.topk(k, dim=-1)
            return vals.cpu(), idx.cpu()

        timings = {
            "obvious pass (8x2048)": bench(obvious, reps=5),
            "model body (8x2048)": bench(lambda: model.model(ids).last_hidden_state),
            "lm-head matmul bf16": bench(lambda: h @ w.T),
            "logsumexp fp32 of bf16 logits": bench(lambda: torch.logsumexp(logits.float(), -1)),
            "log_softmax fp32 full": bench(lambda: logits.float().log_softmax(-1)),
            "topk bf16 sorted": bench(lambda: logits.topk(k, dim=-1)),
            "topk bf16 unsorted": bench(lambda: logits.topk(k, dim=-1, sorted=False)),
            "topk fp32 sorted": bench(lambda: logits32.topk(k, dim=-1)),
        }
        for name, ms in timings.items():
            rows.append((shape, name, ms, n / ms * 1e3))
        del model, logits, logits32
        torch.cuda.empty_cache()
    print(f"{'shape':14s} {'what':34s} {'ms':>9s} {'tok/s':>12s}")
    for shape, name, ms, tps in rows:
        print(f"{shape:14s} {name:34s} {ms:9.2f} {tps:12,.0f}")


if __name__ == "__main__":
    main()
