"""Convergence on real data on the GPU: a randomly initialised student of >= 100M parameters, the same
cache, data order and steps with AdamW, FOAM and 8-bit AdamW; held-out KL to the teacher against
step, in one plot (issue 4's "longer GPU run"; bench_optimizer_convergence.py is the CPU version).

    # on the GPU machine, from a clean copy (git archive HEAD) in .gpucache/src; all variants in one
    # process, so Triton compiles once (each variant took ~60 s for a 135M student on an H200):
    cd .gpucache/src && PYTHONPATH=$PWD python3 tests/benchmarks/bench_optimizer_convergence_gpu.py \
        --cache ../stdlib512 --student ../student135m --runs /tmp/optconv --json $OUT/optim_convergence_gpu.json \
        --steps 300 --batch-size 8 --eval-every 25 --heldout 32 --warmup 30 --budget-s 190 --commit SHA \
        --variants adamw,foam:2,adamw:lr=4e-3,foam:2:lr=4e-3,foam:4:lr=4e-3,foam:4,adamw8bit
    # afterwards, anywhere: the plot from the JSON
    python tests/benchmarks/bench_optimizer_convergence_gpu.py --replot tests/benchmarks/optim_convergence_gpu.json \
        --png tests/benchmarks/optim_convergence_gpu.png

Variants: "adamw", "adamw8bit", "foam:LEVEL", each optionally with ":lr=VALUE" (default --lr).
`--student` is an HF folder; one holding only config.json (+ tokenizer files) is a random init of
that shape. `--layers N` rewrites its num_hidden_layers (a tiny CPU check of this script).
The JSON is rewritten after every run, so a call cut short still returns the runs it finished;
`--budget-s` skips the variants that would not finish inside it (estimated from the slowest run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import time
from pathlib import Path

from run_helpers import metric_rows, parse_optimizer_variant

COLORS = {"adamw": "tab:blue", "foam_2": "tab:orange", "foam_4": "tab:green", "adamw8bit": "tab:red"}


def family(overrides: dict) -> str:
    opt = overrides["optimizer"]
    return f"foam_{overrides.get('foam_level', 2)}" if opt == "foam" else opt


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base_lr = float(results["config"]["lr"])
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, r in results["runs"].items():
        rows = r["eval"]
        lr = r["overrides"].get("lr", base_lr)
        # the default lr solid, a higher one dashed with squares, a lower one dotted with triangles
        line, marker = ("-", "o") if lr == base_lr else ("--", "s") if lr > base_lr else (":", "^")
        style = dict(color=COLORS.get(family(r["overrides"]), None), linestyle=line, marker=marker, markersize=3)
        steps, kl = [x["step"] for x in rows], [x["kl"] for x in rows]
        ax.plot(steps, kl, label=f"{r['label']}: {kl[-1]:.3f}", **style)
        half = [(s, k) for s, k in zip(steps, kl) if s >= steps[-1] // 2]
        zoom.plot([s for s, _ in half], [k for _, k in half], **style)
    c = results["config"]
    ax.set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", yscale="log",
           title=f"{results['student_params'] / 1e6:.0f}M student (random init), {c['steps']} steps of "
                 f"{c['batch_size']} x {results['seq_len']} tokens")
    zoom.set(xlabel="step", ylabel="held-out KL (linear)", title="second half")
    for a in (ax, zoom):
        a.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, title="run: final KL", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    ap.add_argument("--runs", type=Path, help="run directories (deleted after each run but metrics)")
    ap.add_argument("--json", type=Path, help="results JSON (rewritten after each run)")
    ap.add_argument("--png", type=Path, default=None)
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
    ap.add_argument("--commit", default=None, help="recorded in the JSON (the clean copy has no .git)")
    ap.add_argument("--replot", type=Path, default=None, help="only draw --png from this results JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.png or args.replot.with_suffix(".png"))
        return

    t_start = time.perf_counter()
    import torch

    from student.config import StudentConfig
    from student.model import Student
    from student.trainer import TrainConfig, train
    from teacher_cache.reader import CacheReader

    args.runs.mkdir(parents=True, exist_ok=True)
    student = student_folder(args.student.resolve(), args.layers, args.runs)
    reader = CacheReader(str(args.cache))
    base = TrainConfig(cache=str(args.cache), out="", student=str(student), steps=args.steps,
                       batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup,
                       heldout=args.heldout, eval_every=args.eval_every, save_every=0, log_every=args.log_every,
                       device=args.device, seed=0)
    cfg_json = json.loads((student / "config.json").read_text())
    with torch.device("meta"):  # parameters() counts the tied embedding once
        student_params = sum(p.numel() for p in Student(StudentConfig.from_hf_dict(cfg_json)).parameters())
    results = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": args.commit,
        "host": platform.node(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cache": str(args.cache), "cache_id": reader.manifest.cache_id, "cache_sequences": reader.num_sequences,
        "seq_len": args.seq_len or reader.manifest.spec.data.seq_len, "student_params": student_params,
        "student_config": {k: cfg_json.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                          "intermediate_size", "vocab_size", "tie_word_embeddings")},
        "config": {k: v for k, v in dataclasses.asdict(base).items()},
        "runs": {}, "skipped": [],
    }
    slowest = 0.0
    for spec in args.variants.split(","):
        name, kw = parse_optimizer_variant(spec)
        elapsed = time.perf_counter() - t_start
        if args.budget_s is not None and elapsed + 1.1 * slowest > args.budget_s:
            print(f"skip {spec}: {elapsed:.0f} s gone, the slowest run took {slowest:.0f} s, budget "
                  f"{args.budget_s:.0f} s", flush=True)
            results["skipped"].append(spec)
            continue
        out = args.runs / name
        shutil.rmtree(out, ignore_errors=True)
        config = dataclasses.replace(base, out=str(out), **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        report = train(config, progress=False)
        seconds = time.perf_counter() - start
        slowest = max(slowest, seconds)
        rows = metric_rows(out)
        train_rows = [r for r in rows if r["kind"] == "train"]
        label = f"{spec.split(':lr=')[0]} lr {config.lr:g}"
        results["runs"][name] = {
            "label": label, "overrides": kw, "seconds": seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "optimizer_state_bytes": next((r["optimizer_state_bytes"] for r in reversed(train_rows)), None),
            "median_tok_per_s": sorted(r["tok_per_s"] for r in train_rows[1:] or train_rows)[
                len(train_rows[1:] or train_rows) // 2],
            "eval": [r for r in rows if r["kind"] == "eval"],
            "train": [{k: r[k] for k in ("step", "loss", "kl", "lr", "grad_norm", "epoch") if k in r}
                      for r in train_rows],
            "teacher": report.teacher_eval.to_dict(),
        }
        last = results["runs"][name]["eval"][-1]
        print(f"{label}: step {last['step']} held-out KL {last['kl']:.4f} CE {last['ce']:.4f} "
              f"top1 {last['top1']:.4f} | {seconds:.1f} s, state {results['runs'][name]['optimizer_state_bytes']:,} B",
              flush=True)
        shutil.rmtree(out, ignore_errors=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    results["total_seconds"] = time.perf_counter() - t_start
    args.json.write_text(json.dumps(results, indent=2))
    runs = results["runs"]
    print(f"\n{'run':<22} {'KL':>8} {'CE':>8} {'top1':>7} {'s':>6}")
    for name, r in runs.items():
        last = r["eval"][-1]
        print(f"{r['label']:<22} {last['kl']:8.4f} {last['ce']:8.4f} {last['top1']:7.4f} {r['seconds']:6.1f}")
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
