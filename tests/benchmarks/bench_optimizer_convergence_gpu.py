"""Convergence on real data on the GPU: a randomly initialised student of >= 100M parameters, the same
cache, data order and steps with AdamW, FOAM and 8-bit AdamW; held-out KL to the teacher against
step, in one plot (bench_optimizer_convergence.py is the CPU version).

    # all variants in one process, so Triton compiles each kernel once
    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_convergence_gpu.py \
        --cache ../stdlib512 --student ../student135m --steps 300 --batch-size 8 --eval-every 25 \
        --heldout 32 --warmup 30 --budget-s 190 --results $OUT/results.jsonl \
        --variants adamw,foam:2,adamw:lr=4e-3,foam:2:lr=4e-3,foam:4:lr=4e-3,foam:4,adamw8bit
    # afterwards, anywhere: the plot from the rows of a results file
    python tests/benchmarks/bench_optimizer_convergence_gpu.py --replot --results tests/benchmarks/results.jsonl

Variants: "adamw", "adamw8bit", "foam:LEVEL", each optionally with ":lr=VALUE" (default --lr).
`--student` is an HF folder; one holding only config.json (+ tokenizer files) is a random init of
that shape. `--layers N` rewrites its num_hidden_layers (a tiny CPU check of this script).
Each finished variant adds one row at once (bench "optimizer_convergence_gpu", case NAME: the last
held-out KL, CE and top-1, the KL at every evaluation, the optimizer state, median tokens/s, peak
memory), so a call cut short keeps the runs it finished; `--budget-s` skips the variants that would
not finish inside it (estimated from the slowest run). The plot (default
tests/benchmarks/out/optimizer_convergence_gpu.png) is drawn from the newest row of each case.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from harness import OUTPUT_DIR, Results, add_results_arg, load_rows
from run_helpers import metric_rows, parse_optimizer_variant, run_row

BENCH = "optimizer_convergence_gpu"
COLORS = {"adamw": "tab:blue", "foam_2": "tab:orange", "foam_4": "tab:green", "adamw8bit": "tab:red"}


def family(overrides: dict) -> str:
    opt = overrides["optimizer"]
    return f"foam_{overrides.get('foam_level', 2)}" if opt == "foam" else opt


def plot(rows: list[dict], path: Path) -> None:
    """Held-out KL against step (log) and its second half (linear), one line per case (its newest
    row); the base lr solid, a higher one dashed with squares, a lower one dotted with triangles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest = {row["case"]: row for row in rows}
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.6))
    for case, row in newest.items():
        figures, config = row["figures"], row["config"]
        lr, base_lr = config["lr"], config["base_lr"]
        line, marker = ("-", "o") if lr == base_lr else ("--", "s") if lr > base_lr else (":", "^")
        style = dict(color=COLORS.get(family(config["overrides"])), linestyle=line, marker=marker, markersize=3)
        steps, kl = figures["steps"], figures["heldout_kl_by_step"]
        ax.plot(steps, kl, label=f"{case}: {kl[-1]:.3f}", **style)
        half = [(s, k) for s, k in zip(steps, kl) if s >= steps[-1] // 2]
        zoom.plot([s for s, _ in half], [k for _, k in half], **style)
    some = next(iter(newest.values()))["config"]
    ax.set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", yscale="log",
           title=f"{some['student_params'] / 1e6:.0f}M student (random init), {some['steps']} steps of "
                 f"{some['batch_size']} x {some['seq_len_used']} tokens")
    zoom.set(xlabel="step", ylabel="held-out KL (linear)", title="second half")
    for a in (ax, zoom):
        a.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, title="run: final KL", title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def student_folder(src: Path, layers: int | None, work: Path) -> Path:
    if layers is None:
        return src
    dst = work / f"student_{layers}layers"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--student", type=Path, help="HF folder; config.json alone = random init")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (tiny checks)")
    ap.add_argument("--runs", type=Path, default=OUTPUT_DIR / "optimizer_convergence_gpu_runs",
                    help="run directories (deleted after each run)")
    ap.add_argument("--png", type=Path, default=OUTPUT_DIR / "optimizer_convergence_gpu.png")
    ap.add_argument("--variants", default="adamw,foam:2,foam:4,adamw8bit")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None, help="crop (default: as cached)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--budget-s", type=float, default=None, help="skip variants that would end past this")
    ap.add_argument("--replot", action="store_true", help="only draw --png from the rows in --results")
    add_results_arg(ap)
    args = ap.parse_args()
    if args.replot:
        plot([row for row in load_rows(args.results) if row["bench"] == BENCH], args.png)
        return
    if args.cache is None or args.student is None:
        ap.error("--cache and --student are required (unless --replot)")

    t_start = time.perf_counter()
    import torch

    from student.config import StudentConfig
    from student.model import Student
    from student.trainer import TrainConfig, train
    from teacher_cache.reader import CacheReader

    args.runs.mkdir(parents=True, exist_ok=True)
    student = student_folder(args.student.resolve(), args.layers, args.runs)
    reader = CacheReader(str(args.cache))
    base = TrainConfig.from_flat(cache=str(args.cache), out=str(args.runs / "base"), student=str(student),
                                 steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                                 warmup_steps=args.warmup, heldout=args.heldout, eval_every=args.eval_every,
                                 save_every=0, log_every=args.log_every, device=args.device, seed=0)
    cfg_json = json.loads((student / "config.json").read_text())
    with torch.device("meta"):  # parameters() counts the tied embedding once
        student_params = sum(p.numel() for p in Student(StudentConfig.from_hf_dict(cfg_json)).parameters())
    common = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cache_id": reader.manifest.cache_id, "cache_sequences": reader.num_sequences,
        "seq_len_used": args.seq_len or reader.manifest.spec.data.seq_len, "student_params": student_params,
        "student_config": {k: cfg_json.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                          "intermediate_size", "vocab_size", "tie_word_embeddings")},
        "base_lr": args.lr,
    }
    results = Results(bench=BENCH, path=args.results)
    rows, slowest = [], 0.0
    for spec in args.variants.split(","):
        name, overrides = parse_optimizer_variant(spec)
        elapsed = time.perf_counter() - t_start
        if args.budget_s is not None and elapsed + 1.1 * slowest > args.budget_s:
            print(f"skip {spec}: {elapsed:.0f} s gone, the slowest run took {slowest:.0f} s, budget "
                  f"{args.budget_s:.0f} s", flush=True)
            continue
        out = args.runs / name
        shutil.rmtree(out, ignore_errors=True)
        config = base.with_flat(out=str(out), **overrides)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        report = train(config, progress=False)
        seconds = time.perf_counter() - start
        slowest = max(slowest, seconds)
        train_rows = metric_rows(out, "train")
        timed = train_rows[1:] or train_rows  # the first window holds the compiles
        state = next((r["optimizer_state_bytes"] for r in reversed(train_rows) if "optimizer_state_bytes" in r), None)
        figures = run_row({
            "eval": metric_rows(out, "eval"), "seconds": seconds,
            "optimizer_state_mib": state / 2**20 if state is not None else None,
            "tok_s": sorted(r["tok_per_s"] for r in timed)[len(timed) // 2],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "teacher_heldout_ce": report.teacher_eval.ce,
        })
        rows.append(results.add(name, figures, {**config.to_flat(), **common, "variant": spec,
                                                "overrides": overrides}))
        shutil.rmtree(out, ignore_errors=True)
    if rows:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
