"""Sparse FFN on real data: the same student, data and steps as SwiGLU (dense), with the ReLU gate
and no penalty, and with the ReLU gate plus L1 penalties; held-out KL to the teacher and the
per-layer FFN sparsity and dead neurons on the held-out sequences, against step.

    python tests/benchmarks/bench_sparse_ffn_cpu.py --cache caches/quickstart --out /tmp/sparse_ffn
    python tests/benchmarks/bench_sparse_ffn_cpu.py --cache caches/quickstart --out /tmp/sparse_ffn \
        --variants dense,sparse:0,sparse:2e-5,sparse:1e-3 --steps 80 --eval-every 20

Variants: "dense" (the student as pruned: SwiGLU), "sparse:L1" (converted to the ReLU gate, same
weights, L1 coefficient L1; 0 is the ReLU gate alone). Uses pipelines/recipes/quickstart.toml's
student and [train] settings unless --recipe names another. Writes OUT/NAME/ run dirs,
OUT/sparse_ffn.json and OUT/sparse_ffn.png. Variants can run in separate processes (say, two at
once) into separate OUT dirs; `--merge OTHER_OUT` then adds OTHER_OUT's runs to OUT's json and plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path


def parse_variant(spec: str) -> tuple[str, dict]:
    if spec == "dense":
        return "dense", {"sparse_ffn": False}
    kind, _, l1 = spec.partition(":")
    if kind != "sparse" or not l1:
        raise SystemExit(f"variant must be 'dense' or 'sparse:L1', got {spec!r}")
    return f"sparse_l1_{l1}", {"sparse_ffn": True, "l1": float(l1)}


def metric_rows(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == kind]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_sp) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(results["runs"].values()):
        steps = [x["step"] for x in r["eval"]]
        ax_kl.plot(steps, [x["kl"] for x in r["eval"]], marker="o", color=f"C{i}", label=r["label"])
        if r["eval"][0].get("ffn_sparsity") is not None:
            mean = [sum(x["ffn_sparsity"]) / len(x["ffn_sparsity"]) for x in r["eval"]]
            ax_sp.plot(steps, [100 * m for m in mean], marker="o", color=f"C{i}", label=r["label"])
    ax_kl.set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", yscale="log",
              title="Held-out KL, same student / data / steps")
    ax_sp.set(xlabel="step", ylabel="held-out FFN sparsity, mean of layers (%)", title="Sparsity of h")
    for ax in (ax_kl, ax_sp):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True, help="a complete cache of the recipe's teacher")
    ap.add_argument("--recipe", type=Path, default=None)
    ap.add_argument("--variants", default="dense,sparse:0,sparse:2e-5,sparse:1e-3")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from OUT/sparse_ffn.json")
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="add the runs of another OUT dir's sparse_ffn.json to OUT's, then replot")
    args = ap.parse_args()
    if args.replot or args.merge:
        results = json.loads((args.out / "sparse_ffn.json").read_text())
        for other in args.merge:
            more = json.loads((other / "sparse_ffn.json").read_text())
            results["runs"].update(more["runs"])
            results.setdefault("merged_commands", []).append(more["command"])
        (args.out / "sparse_ffn.json").write_text(json.dumps(results, indent=2))
        plot(results, args.out / "sparse_ffn.png")
        return

    from pipelines.defaults import default_teacher_dir
    from pipelines.recipe import builtin_recipe, load_recipe, train_config
    from student.trainer import train

    recipe = load_recipe(args.recipe or builtin_recipe("quickstart"))
    recipe.stage_one.cache.out = args.cache
    for key, value in (("steps", args.steps), ("eval_every", args.eval_every)):
        if value is not None:
            recipe.train[key] = value
    base = train_config(recipe, recipe.stage_one.teacher.model or default_teacher_dir())
    results = {"command": " ".join(sys.argv), "config": {k: str(v) for k, v in dataclasses.asdict(base).items()},
               "runs": {}}
    for spec in args.variants.split(","):
        name, kw = parse_variant(spec)
        config = dataclasses.replace(base, out=str(args.out / name), **kw)
        start = time.perf_counter()
        train(config)
        label = "dense (SwiGLU)" if not kw["sparse_ffn"] else f"ReLU gate, L1 {kw['l1']:g}"
        train_rows = metric_rows(args.out / name, "train")
        results["runs"][name] = {"label": label, "overrides": kw, "seconds": time.perf_counter() - start,
                                 "eval": metric_rows(args.out / name, "eval"), "last_train": train_rows[-1]}
        last = results["runs"][name]["eval"][-1]
        sparsity = last.get("ffn_sparsity")
        extra = "" if sparsity is None else (
            f" sparsity/layer {[round(100 * s, 1) for s in sparsity]}% dead/layer "
            f"{[round(100 * d, 1) for d in last['ffn_dead']]}%")
        print(f"{label}: step {last['step']} held-out KL {last['kl']:.4f} CE {last['ce']:.4f}{extra}", flush=True)
        (args.out / "sparse_ffn.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "sparse_ffn.png")


if __name__ == "__main__":
    main()
