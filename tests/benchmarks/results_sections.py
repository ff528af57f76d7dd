"""The results page as data: its header, and each section's tables, columns, goals, prose and
notes file (results_model.py has the parts; render_results.py renders them)."""

from __future__ import annotations

from results_model import (
    ADAMW_14B,
    FOAM_14B,
    PAIR_05B,
    PAIR_3B,
    ROW_IDS,
    Check,
    Col,
    Goal,
    Line,
    Section,
    Table,
    attention_rate,
    budget,
    by_arm,
    by_bench,
    by_last_part,
    by_length,
    by_seed,
    by_sparsity,
    by_variant,
    fig,
    figure,
    first_of,
    gpu_gib,
    joined,
    kilo,
    label,
    length,
    mean_over,
    mean_sd,
    name,
    num,
    oom_or,
    over,
    rate,
    seeds_gap,
    shape,
    variant,
    with_ratio,
    within,
)

# ---- the page ----------------------------------------------------------------------------------

HEADER = (
    "Current numbers, rendered from `results.jsonl` by `render_results.py` (do not edit this page: append rows or "
    "edit the script's declarations, then run it). A table shows the newest row of each case it selects and names it "
    "(`bench/case@commit`: figures, settings, machine, command); goals are checked against the rows. The story and "
    "why the defaults are what they are: `notes/README.md`. GPU: one H200; CPU: a shared 2-core EPYC."
)

# The on-policy table's students (bench_on_policy.py's arms) and the one its goals check
ON_POLICY_ARMS = {"start": "start (the quickstart's student)", "off": "off-policy: +80 steps on the static cache",
                  "on-w0.75-clip2": "rounds as the recipe: static share 0.75, ratio clip 2",
                  "on": "rounds, static share 0.5, no clip", "on-forward_kl": "rounds, forward KL (top-64), seed 0"}
ON_POLICY_GOAL_ARM = "on-w0.75-clip2"  # pipelines/recipes/rounds.toml's settings

SECTIONS: tuple[Section, ...] = (
    Section(
        "Fused top-k KL loss", "kernels.md",
        "`bench_fused_kl_gpu.py`, forward + backward: d 2048, k 100, bf16, tail \"unnormalized\", median of 5. bare: "
        "the three matmuls alone; Liger: `LigerFusedLinearCrossEntropyLoss` (plain CE, the closest fused peer); "
        "dense: torch's logits and top-k KL; extra: peak memory beyond inputs and outputs.",
        tables=(Table(
            ("fused_kl/*-N8192/*", "fused_kl/*-N131072/*"),  # N 32,768 too: the goal's, notes/kernels.md
            (label("V", lambda key: f"{int(key[1:].split('-')[0]):,}"),
             label("N", lambda key: f"{int(key.split('-N')[1]):,}"),
             fig("bare ms", "median_ms", of="bare"),
             with_ratio("ours ms (x bare)", "median_ms", "x_bare", "{:.1f}", of="ours"),
             with_ratio("Liger ms (x bare)", "median_ms", "x_bare", "{:.1f}", of="liger"),
             oom_or(fig("dense ms", "median_ms", of="dense"), "dense"),
             joined("extra GiB, ours / Liger / dense", "extra_gib", ("ours", "liger", "dense"), "{:.2f}"),
             ROW_IDS),
            line=by_variant),),
        goals=(Goal("ours within 1.1x the bare matmuls at every shape", (
            Check("worst", lambda rows: max(f["x_bare"] for f in rows.all("fused_kl/*/ours@*")), "<=", 1.1,
                  "{:.3f}x"),)),),
    ),
    Section(
        "Training step", "kernels.md",
        "`bench_train_step_gpu.py`: a random-init Qwen2-0.5B-shaped student (fp32 weights, bf16 autocast), "
        "2,048-token sequences of a k-100 cache, fused AdamW, one step, median of 8; transformers: "
        "`Qwen2ForCausalLM`, full logits, dense top-k KL, with or without Liger's kernels; step-0 loss and gradient "
        "checked against theirs first.",
        tables=(Table(
            ("train_step/*",),
            (label("tokens / step", lambda key: f"{int(key.split('/')[0][1:]):,}"), label("variant", variant),
             oom_or(fig("median ms", "median_ms")), fig("tokens/s", "tok_s", "{:,.0f}"),
             Col("peak GiB", lambda line: num(line.fig("peak_gib"), "{:.1f}")
                 or num(line.fig("peak_gib_at_oom"), "{:.1f} at the OOM")),
             ROW_IDS)),),
    ),
    Section(
        "Long context", "long-context.md",
        "One sequence a step against transformers' Qwen2 with Liger's patch, gradient checkpointing, bf16 weights, "
        "fused AdamW. Ours: fp32 masters, 8-bit AdamW, chunks of 16,384, pages of 64, cuDNN page attention; offload: "
        "pages in host memory; sparse: `--sparse-pages 128` (not exact); planned: under a GPU budget. Warm or primed "
        "steps; 1 layer: with the embedding and head. TFLOP/s: 6 x parameters + attention.",
        tables=(
            Table(
                ("long_context/qwen2-0.5b-T524288/ours_offload@ba4977c", "long_context/*-T1048576/*@2323375",
                 "long_context/*-L1-T4194304/*", PAIR_05B.format("-capped/planned"), PAIR_05B.format("/hf_liger"),
                 PAIR_3B.format("*"), "offload/qwen2.5-7b-T196608/*@*", "offload/qwen2.5-7b-L1-T262144*/planned@*"),
                (label("shape", lambda key: shape(key) + (", 1 layer" if "-L1-" in key else "")),
                 label("tokens", length), label("variant", variant),
                 label("GPU budget", lambda key: budget(key) if key.endswith("planned") else ""),
                 fig("s/step", "step_s", "{:.2f}"), fig("tok/s", "tok_s", "{:,.0f}"), attention_rate(),
                 gpu_gib(), ROW_IDS)),
        ),
        goals=(
            Goal("0.5B at 128K: transformers + Liger's speed in at most half its GPU memory", (
                Check("speed", over(PAIR_05B.format("-capped/planned"), PAIR_05B.format("/hf_liger")), ">=", 1.0),
                Check("memory", over(PAIR_05B.format("-capped/planned"), PAIR_05B.format("/hf_liger"),
                                     "peak_gpu_bytes"), "<=", 0.5))),
            Goal("0.5B at 512K, dense, warm", (Check(
                "tokens/s", figure("long_context/qwen2-0.5b-T524288/ours_offload@ba4977c", "tok_s"), ">=", 3900,
                "{:,.0f}"),)),
            Goal("sparse pages at least 4x dense at 1M, the whole 0.5B", (Check(
                "speed", over("long_context/qwen2-0.5b-T1048576/ours_sparse@*",
                              "long_context/qwen2-0.5b-T1048576/ours_offload@*"), ">=", 4.0),)),
            Goal("sparse pages at 8K no worse than dense on dense evaluation, the 8-layer pruned student over two seeds "
                 "(`bench_sparse_pages_quality.py`, H100)", tuple(
                Check(f"KL vs dense, {budget} past pages",
                      mean_over(f"sparse_pages_quality/seed*/sparse_{budget}@408083b", "kl_cost_vs_dense"), "<=", 0.0,
                      "{:+.3f}") for budget in (8, 32))),
            Goal("3B at 256K: transformers + Liger's speed in at most a third of its memory", (
                Check("speed", over(PAIR_3B.format("planned"), PAIR_3B.format("hf_liger")), ">=", 1.0),
                Check("memory", over(PAIR_3B.format("planned"), PAIR_3B.format("hf_liger"), "peak_gpu_bytes"),
                      "<=", 1 / 3))),
        ),
    ),
    Section(
        "Offloaded training", "offload.md",
        "`bench_offload_gpu.py` (the planner): random-init students, fp32 masters, 8,192 tokens a step, FOAM states "
        "unless said; planned: under the budget, the allocator capped there; 3B at 1M: one layer against the "
        "hand-set best. Exact clipping holds every update until the backward ends: that bounds 8B and 14B.",
        tables=(
            Table(
                ("offload/llama-3.1-8b-T8192/none@*", "offload/llama-3.1-8b-T8192/planned@*",
                 "offload/llama-3.1-8b-T8192-gpu40GiB-capped/planned@*", "offload/*/zero_offload@*", FOAM_14B,
                 ADAMW_14B, "offload/qwen2.5-3b-L1-T1048576-*/*"),
                (Col("shape", lambda line: shape(line.key) + (", 1 layer, 1M" if "-L1-" in line.key else "")
                     + (f", {name(line.row()['config']['optimizer'])}" if "14b" in line.key else "")),
                 label("GPU budget", budget), label("variant", variant), fig("s/step", "step_s", "{:.3f}"),
                 fig("tok/s", "tok_s", "{:,.0f}"),
                 first_of("TFLOP/s", ("model_tflops_with_attention", "model_tflops"), "{:.0f}"),
                 fig("peak GPU GB", "peak_gpu_bytes", "{:.1f}", scale=1e-9),
                 with_ratio("predicted s/step", "predicted_step_s", "step_s_predicted_over_measured", "{:.3f}",
                            "{:.2f}"),
                 with_ratio("predicted GPU GB", "predicted_gpu_peak_bytes", "gpu_peak_predicted_over_measured",
                            "{:.1f}", "{:.2f}", scale=1e-9),
                 ROW_IDS)),
        ),
        goals=(
            Goal("8B under 40 GiB at 0.85x the speed without offload", (Check(
                "speed", over("offload/llama-3.1-8b-T8192-gpu40GiB-capped/planned@*",
                              "offload/llama-3.1-8b-T8192/none@*"), ">=", 0.85),)),
            Goal("every planned row's predicted step time within 10%",
                 within("predicted / measured", "step_s_predicted_over_measured", 0.9, 1.1)),
            Goal("every planned row's predicted GPU peak an upper bound within 10%",
                 within("predicted / measured", "gpu_peak_predicted_over_measured", 1.0, 1.1)),
            Goal("14B at 380 TFLOP/s with FOAM states, 350 with fp32 AdamW", (
                Check("FOAM", figure(FOAM_14B, "model_tflops"), ">=", 380, "{:.0f}"),
                Check("AdamW", figure(ADAMW_14B, "model_tflops"), ">=", 350, "{:.0f}"))),
        ),
    ),
    Section(
        "Page attention", "kernels.md",
        "`bench_page_attention_gpu.py`: a chunk's queries over earlier keys and its own, bf16, pages of 64, forward "
        "+ backward. Ours: pages gathered, cuDNN attention on past and own keys, LSE-merged, gradients into fp32 "
        "page pools (all timed); flex: compiled FlexAttention on a contiguous copy; sdpa: aten's flash on the same "
        "two parts.",
        tables=(Table(
            ("page_attention/*-Tq16384-Tk131072/*",),
            (label("queries, past keys", lambda key: f"{length(key.replace('Tq', 'T'))}, "
                   f"{kilo(int(key.split('-Tk')[1].split('/')[0]))}"),
             label("variant", variant), fig("fwd+bwd ms", "median_ms"), fig("fwd ms", "fwd_ms"),
             rate("TFLOP/s (of ceiling)", "tflops"), ROW_IDS)),),
    ),
    Section(
        "Optimizers", "kernels.md, quality.md",
        "Step alone (`bench_optimizer_step_gpu.py`: Qwen2-0.5B, median of 20; CPU: a Qwen2.5-7B layer, of 3; GB/s: "
        "12 B a parameter plus state); state: matrices folded, not the embedding; convergence: held-out KL, one seed; "
        "CPU: quickstart student, 80 steps; H200: SmolLM2-135M, 300; lr 1e-3 unless said.",
        tables=(
            Table(
                ("optimizer_step/qwen2-0.5b/*torch-adamw*", "optimizer_step/qwen2-0.5b/*-triton@*",
                 "optimizer_step/cpu/qwen2.5-7b-layer/torch-adamw-fused@9bc49c1*",
                 "optimizer_step/cpu/qwen2.5-7b-layer/adamw8bit-torch@9bc49c1*"),
                (label("optimizer", lambda key: ("CPU, a 7B layer: " if key.startswith("cpu/") else "") + variant(key)),
                 fig("step ms", "median_ms", "{:.2f}"),
                 fig("x fused AdamW", "x_fused_adamw", "{:.2f}"),
                 with_ratio("GB/s (of copy ceiling)", "gbps", "copy_fraction", "{:,.0f}", "{:.2f}"),
                 fig("state GiB", "state_gib", "{:.3f}"), ROW_IDS)),
            Table(
                ("optimizer_state/*/adamw*", "optimizer_state/*/foam-l2@*", "optimizer_state/*/foam-l4@*"),
                (label("optimizer", name),)
                + tuple(col for s in ("qwen2-0.5b", "qwen2-1.5b") for col in (
                    fig(f"{name(s)}: folded vs AdamW", "folded_matrices_vs_adamw", "{:.3f}", of=s),
                    with_ratio(f"{name(s)}: whole GiB (vs AdamW)", "whole_model_gib", "whole_model_vs_adamw",
                               "{:.3f}", of=s)))
                + (ROW_IDS,),
                line=by_last_part),
            Table(
                ("optimizer_convergence*/adamw@*", "optimizer_convergence*/foam_?@*",
                 "optimizer_convergence*/adamw8bit@*",
                 "optimizer_convergence*/*_lr4e-3@*"),
                (label("optimizer", name),)
                + tuple(col for bench, where in (("optimizer_convergence", "CPU"),
                                                 ("optimizer_convergence_gpu", "H200"))
                        for col in (fig(f"{where} KL", "heldout_kl", "{:.3f}", of=bench),
                                    fig(f"{where} CE", "heldout_ce", "{:.3f}", of=bench),
                                    fig(f"{where} state MiB", "optimizer_state_mib", "{:,.1f}", of=bench)))
                + (ROW_IDS,),
                line=by_bench),
        ),
    ),
    Section(
        "Sparse FFN", "sparse-ffn.md",
        "TwELL kernels against the dense gated FFN in one call (H200, median of 20) on synthetic activations (d "
        "2048, d_ff 5632, 131,072 tokens) and trained ones (L1 5e-4). Students: held-out KL, one seed; H200: 300 "
        "steps; CPU: the quickstart's, 80. They pay only at such sparsity on large calls: `--sparse-kernel` defaults "
        "to dense.",
        tables=(
            Table(
                ("twell_ffn/*", "sparse_ffn_real/*/layer1@*"),
                (label("activations", lambda key: f"synthetic, {float(key[1:]):.1%}" if key.startswith("s")
                       else f"trained, {key.split('/')[1]}"),
                 Col("non-zeros / token", lambda line: num(line.fig("nonzeros_per_token")
                                                           or line.fig("nnz_mean", "twell/fwd"), "{:.1f}")),
                 Col("dense fwd / fwd+bwd ms", lambda line: twell_pair(line, "dense")),
                 Col("TwELL fwd / fwd+bwd ms (x dense)", lambda line: twell_pair(line, "twell")),
                 joined("saved GiB, dense / TwELL", "saved_gib", ("dense/fwd", "twell/fwd"), "{:.2f}"),
                 ROW_IDS),
                line=by_sparsity),
            Table(
                ("sparse_ffn_real/d2048/*", "sparse_ffn_real/*/trainer-*", "sparse_ffn_cpu/dense@*",
                 "sparse_ffn_cpu/sparse_l1_0@*", "sparse_ffn_cpu/sparse_l1_1e-3@*"),
                (Col("student", lambda line: ("CPU, " if "cpu" in line.row()["bench"] else "H200, ")
                     + variant(line.key.split("@")[0])),
                 fig("held-out KL", "heldout_kl", "{:.4g}"), fig("held-out CE", "heldout_ce", "{:.3f}"),
                 Col("FFN sparsity %", lambda line: ", ".join(f"{v:.1f}" for v in line.fig("ffn_sparsity_pct_by_layer"))
                     if line.fig("ffn_sparsity_pct_by_layer") else ""),
                 first_of("tokens/s", ("tok_s", "tok_s_median"), "{:,.0f}"), ROW_IDS)),
        ),
    ),
    Section(
        "Teacher capture", "capture.md",
        "Stage one end to end (`bench_teacher_gpu.py`): random weights, 1,024 x 2,048 token ids, k 100; "
        "`build_cache` to a finished cache on disk against the plain transformers pass of the same run.",
        tables=(
            Table(
                ("teacher_gpu/*/plain@*", "teacher_gpu/*/default@*", "teacher_gpu/*/rs12@*"),
                (label("shape", shape), label("variant", variant), fig("tokens/s", "tok_s", "{:,.0f}"),
                 fig("x plain pass", "x_plain", "{:.2f}"),
                 fig("teacher alone tokens/s", "teacher_only_tok_s", "{:,.0f}"),
                 fig("writer wait s", "writer_wait_s", "{:.2f}"), ROW_IDS)),
            Table(
                ("capture_scaling/*",),
                (label("shape", shape), label("GPUs", lambda key: key.split("/gpus")[1]),
                 fig("tokens/s", "tok_per_s", "{:,.0f}"), fig("scaling", "scaling", "{:.2f}"),
                 fig("wall s", "wall_s", "{:.0f}"), ROW_IDS),
                caption="Capture over the GPUs of one host (`bench_capture_scaling_gpu.py`, `distill cache-teacher` "
                        "under torchrun; scaling: tokens/s over N x the 1-GPU rate):"),
        ),
        goals=(
            Goal("stage one at least 1.5x the plain pass, end to end", tuple(
                Check(name(s), figure(f"teacher_gpu/{s}/default@*", "x_plain"), ">=", 1.5, "{:.2f}x")
                for s in ("smollm2-135m", "qwen2-0.5b"))),
            Goal("capture scaling at least 0.9 over the GPUs of one host", (Check(
                "least", lambda rows: min(f["scaling"] for f in rows.all("capture_scaling/*")), ">=", 0.9,
                "{:.2f}"),)),
        ),
    ),
    Section(
        "Value codecs", "capture.md",
        "`bench_codecs.py` on real targets (SmolLM2-135M-Instruct, stdlib text, exact top-100): bytes per token "
        "(top-k arrays in the Zarr store; whole shard), KL(exact || decoded) in nats.",
        tables=(Table(
            ("codecs/V49152/fp32@*", "codecs/V49152/bf16@*", "codecs/V49152/sqrt8@*"),  # fp16: notes/capture.md
            (label("vocabulary", lambda key: f"{int(key[1:].split('/')[0].split('-')[0]):,}"
                   + {"stretch": ", ids stretched", "shuffle": ", ids shuffled"}.get(
                       key.split("/")[0].partition("-")[2], "")),
             label("codec", variant), fig("top-k B/token", "topk_bytes_per_token_zarr_store"),
             fig("whole shard B/token", "shard_bytes_per_token_zarr"), fig("KL mean", "kl_mean", "{:.2e}"),
             fig("KL max", "kl_max", "{:.2e}"), ROW_IDS)),),
    ),
    Section(
        "Quality", "quality.md",
        "KD from the cache against cross-entropy alone (`bench_kd_vs_ce.py`, CPU): the quickstart's cache and "
        "student, same seed and data, 120 steps, 16 held-out sequences; the quickstart (`distill quickstart -q`), "
        "held-out before -> after.",
        tables=(Table(
            ("kd_vs_ce/*", "quickstart/*"),
            (label("run", name),
             Col("held-out KL", lambda line: num(line.fig("heldout_kl_start"), "{:.2f} -> ")
                 + num(line.fig("heldout_kl"), "{:.3f}")),
             Col("held-out CE", lambda line: num(line.fig("heldout_ce_start"), "{:.2f} -> ")
                 + num(line.fig("heldout_ce"), "{:.3f}")),
             fig("top-1", "heldout_top1", "{:.3f}"),
             Col("stage one / stage two / whole s", lambda line: " / ".join(
                 num(line.fig(k), "{:.0f}") for k in ("stage_one_s", "stage_two_s", "wall_s"))
                 if line.fig("wall_s") else ""),
             ROW_IDS)),),
    ),
    Section(
        "Sampled teacher targets", "quality.md",
        "`bench_sampled_targets.py` (H200): top-k and sampled caches (S draws a position) of SmolLM2-135M-Instruct "
        "over the stdlib and torch's sources; the quickstart's student, 3,000 steps from each, 64 held-out sequences. "
        "KL: exact, whole vocabulary; ECE: top-1, 15 bins; ±: over seeds, between which ECE moves by about the gap.",
        tables=(Table(
            ("sampled_targets/*@4ad1199", "sampled_targets/*@26a51ff", "sampled_targets/*@6a52d40"),
            (label("targets", name), fig("ids / position", "unique_ids_per_position", "{:.1f}"),
             fig("bytes/token", "bytes_per_token"), mean_sd("full-vocab KL", "full_vocab_kl"),
             mean_sd("CE", "ce"), mean_sd("ECE", "calibration_error", "{:.4f}"),
             fig("cache kl", "cache_kl", "{:.3f}"), ROW_IDS),
            line=by_seed),),
        goals=(
            Goal("S = 12 at a third of top-100's bytes/token or less, at its KL or lower", (
                Check("bytes", over("sampled_targets/sampled12@26a51ff", "sampled_targets/topk100@26a51ff",
                                    "bytes_per_token"), "<=", 1 / 3, "{:.2f}x"),
                Check("KL gap", seeds_gap("full_vocab_kl", "sampled12", "topk100"), "<=", 0.0, "{:+.3f}"))),
            Goal("... and at its ECE or lower", (
                Check("ECE gap", seeds_gap("calibration_error", "sampled12", "topk100"), "<=", 0.0, "{:+.4f}"),)),
        ),
    ),
    Section(
        "Cross-tokenizer distillation", "quality.md",
        "`bench_cross_tokenizer.py`, quickstart student (CPU: 80 steps of 4 x 256; `h100`: 1,200 of 8 x 512); other "
        "tokenizer: an 8K BPE; `+ CE`: --ce-weight 0.5; KL at aligned rows. GPU goals: `..._gpu.py`.",
        tables=(Table(
            ("cross_tokenizer/byte-prefix+ce-seed*", "cross_tokenizer/ce-seed*",
             "cross_tokenizer/same-seed*", "cross_tokenizer/h100-1200steps/*"),
            (label("student", lambda key: xtok_name(key)), mean_sd("bits/byte", "heldout_bits_per_byte"),
             fig("teacher bits/byte", "teacher_bits_per_byte", "{:.3f}"), mean_sd("KL", "heldout_kl"),
             mean_sd("CE / token", "heldout_ce"), ROW_IDS),
            line=by_seed),),
        goals=(
            Goal("another tokenizer's KD student (+ CE) below its CE-only twin in bits per byte, every seed", (Check(
                "worst seed, KD - CE", lambda rows: max(
                    rows.one(f"cross_tokenizer/byte-prefix+ce-seed{seed}@*")["heldout_bits_per_byte"]
                    - rows.one(f"cross_tokenizer/ce-seed{seed}@*")["heldout_bits_per_byte"] for seed in range(3)),
                "<=", 0.0, "{:+.3f}"),)),
            Goal("fused loss on mapped targets within 5% of same-tokenizer targets", (Check(
                "mapped / same", over("cross_tokenizer_gpu/loss/mapped@*", "cross_tokenizer_gpu/loss/same@*",
                                      "median_ms"), "<=", 1.05, "{:.3f}x"),)),
            Goal("alignment keeps the GPU fed: training tokens/s at least 0.95x without it", (Check(
                "cross / same", over("cross_tokenizer_gpu/train/cross@*", "cross_tokenizer_gpu/train/same@*"),
                ">=", 0.95, "{:.3f}x"),)),
        ),
    ),
    Section(
        "Several caches", "mixtures.md",
        "CPU (`bench_mixture.py`, rows mixture/code*, plot in the README): the quickstart's student, 80 steps, on a "
        "code and a prose cache at five shares. `bench_mixture_gpu.py`: training with two caches or two teachers.",
        tables=(
            Table(
                ("mixture_gpu/train/*", "mixture_gpu/data/*"),
                (label("case", lambda key: key), fig("training tokens/s", "tok_s", "{:,.0f}", of="train"),
                 fig("x one cache", "ratio", "{:.3f}", of="train"),
                 fig("host batches alone, tokens/s", "host_tok_s", "{:,.0f}", of="data"), ROW_IDS),
                line=by_last_part),),
        goals=(
            Goal("each domain's held-out KL falls as its share rises, at every step of the sweep", (Check(
                "steps where it does not", lambda rows: mixture_reversals(rows), "<=", 0, "{:.0f}"),)),
            Goal("two caches, or a two-teacher ensemble, within 3% of one cache's training tokens/s", (
                Check("mixture", figure("mixture_gpu/train/mixture@*", "ratio"), ">=", 0.97, "{:.3f}x"),
                Check("ensemble", figure("mixture_gpu/train/ensemble@*", "ratio"), ">=", 0.97, "{:.3f}x"))),
        ),
    ),
    Section(
        "On-policy rounds", "on-policy.md",
        "`bench_on_policy.py` (CPU): the quickstart's student, then 80 steps off-policy or two rounds of 40 on its "
        "own text; (a): the teacher's log-prob / token of its continuations of held-out prompts. GPU: "
        "`bench_generate_gpu.py`.",
        tables=(
            Table(tuple(f"on_policy/seed*/{arm}@*" for arm in ON_POLICY_ARMS),
                  (label("student", lambda key: ON_POLICY_ARMS.get(key, key)),
                   mean_sd("(a) teacher log-prob", "teacher_logprob_per_token"),
                   mean_sd("reverse KL / token", "reverse_kl_per_token"), mean_sd("held-out KL", "heldout_kl"),
                   mean_sd("bits/byte", "heldout_bits_per_byte"),
                   fig("teacher-scored tokens", "teacher_scored_tokens", "{:,.0f}"), ROW_IDS),
                  line=by_arm),
            Table(("generate_gpu/*/ours@*",),
                  (label("shape, batch, prompt, new", lambda key: key.split("/")[0]),
                   fig("tokens/s", "tokens_per_s", "{:,.0f}"), fig("x transformers", "speedup", "{:.2f}"),
                   fig("ms / step", "ms_per_step", "{:.2f}"), fig("of bandwidth floor", "of_bandwidth_floor", "{:.3f}"),
                   fig("kernels / step", "kernels_per_step", "{:,.0f}"), ROW_IDS)),
        ),
        goals=(
            Goal("the recipe's rounds above off-policy training on the student's own text, every seed", (
                Check("(a) worst seed, on - off", lambda rows: on_policy_gap(rows, "teacher_logprob_per_token"), ">=",
                      0.0, "{:+.3f}"),
                Check("reverse KL / token, worst seed, off - on", lambda rows: on_policy_gap(rows, "reverse_kl_per_token"),
                      ">=", 0.0, "{:+.3f}"))),
            Goal("... and on held-out KL (b), every seed", (
                Check("worst seed, off - on", lambda rows: on_policy_gap(rows, "heldout_kl"), ">=", 0.0, "{:+.3f}"),)),
            Goal("`distill generate` at least 3x transformers' `generate` tokens/s", (Check(
                "least speedup", lambda rows: min(r["speedup"] for r in rows.all("generate_gpu/*/ours@*")), ">=", 3.0,
                "{:.2f}x"),)),
        ),
    ),
)


def on_policy_gap(rows: Rows, key: str) -> float:
    """The worst seed's on-policy (the recipe's rounds, after the last) less off-policy figure `key`,
    signed so that >= 0 says on-policy won (the teacher's log-prob as is, a KL negated)."""
    sign = 1.0 if key == "teacher_logprob_per_token" else -1.0  # higher is better for it, lower for the KLs
    seeds = [f"seed{s}" for s in range(10) if rows.all(f"on_policy/seed{s}/{ON_POLICY_GOAL_ARM}@*")]
    return min(sign * (rows.one(f"on_policy/{s}/{ON_POLICY_GOAL_ARM}@*")[key] - rows.one(f"on_policy/{s}/off@*")[key])
               for s in seeds)


def mixture_reversals(rows: Rows) -> int:
    """Of the sweep's neighbouring code shares (0, .25, .5, .75, 1), the steps up at which the code
    domain's held-out KL does not fall, plus those at which the prose domain's does not rise."""
    code, prose = zip(*((rows.one(f"mixture/code{share}@*")["code_kl"], rows.one(f"mixture/code{share}@*")["prose_kl"])
                        for share in ("0", "0.25", "0.5", "0.75", "1")))
    return sum(b >= a for a, b in zip(code, code[1:])) + sum(b <= a for a, b in zip(prose, prose[1:]))


XTOK_NAMES = {"byte-prefix+ce": "other tokenizer, byte-prefix KD + CE", "byte-prefix": "other tokenizer, byte-prefix KD",
              "ce": "other tokenizer, CE only", "same": "teacher's tokenizer, KD"}


def xtok_name(key: str) -> str:
    scale, _, variant = key.rpartition("/")
    return XTOK_NAMES.get(variant, variant) + (", h100" if scale else "")


def twell_pair(line: Line, kernel: str) -> str:
    """`fwd / fwd+bwd` ms of a sparse FFN line, from its twell_ffn rows or a trained layer's figures;
    TwELL's with its speed over dense in parentheses."""
    if line.row(f"{kernel}/fwd") is not None:
        times = [line.fig("median_ms", f"{kernel}/{p}") for p in ("fwd", "fwd_bwd")]
        ratios = [line.fig("speedup", f"twell/{p}") for p in ("fwd", "fwd_bwd")]
    else:
        prefix = "dense" if kernel == "dense" else "blocks"
        times = [line.fig(f"{prefix}_fwd_ms"), line.fig(f"{prefix}_fwd_bwd_ms")]
        ratios = [line.fig("speedup_fwd"), line.fig("speedup_fwd_bwd")]
    text = f"{times[0]:.2f} / {times[1]:.2f}"
    return text + (f" ({ratios[0]:.3f} / {ratios[1]:.3f})" if kernel == "twell" else "")
