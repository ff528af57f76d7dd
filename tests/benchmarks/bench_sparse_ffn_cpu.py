"""Sparse FFN on real data: the same student, data and steps as SwiGLU (dense), with the ReLU gate
and no penalty, and with the ReLU gate plus L1 penalties; held-out KL to the teacher and the
per-layer FFN sparsity and dead neurons on the held-out sequences, against step.

    python tests/benchmarks/bench_sparse_ffn_cpu.py --cache caches/quickstart
    python tests/benchmarks/bench_sparse_ffn_cpu.py --cache caches/quickstart --out /tmp/sparse_ffn \
        --variants dense,sparse:0,sparse:2e-5,sparse:1e-3 --steps 80 --eval-every 20

Variants: "dense" (the student as pruned: SwiGLU), "sparse:L1" (converted to the ReLU gate, same
weights, L1 coefficient L1; 0 is the ReLU gate alone). Uses pipelines/recipes/quickstart.toml's
student and [train] settings unless --recipe names another. Writes OUT/NAME/ run dirs,
OUT/sparse_ffn.json and OUT/sparse_ffn.png (OUT defaults to tests/benchmarks/out/sparse_ffn, which
git ignores) and one results row a run, `sparse_ffn_cpu/NAME`: held-out KL, CE and top-1 at the
last evaluation, the KL curve, and per layer the held-out sparsity, non-zeros per token and dead
neurons. Variants can run in separate processes (say, two at once) into separate OUT dirs;
`--merge OTHER_OUT` then adds OTHER_OUT's runs to OUT's json and plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from run_helpers import add_variant_run_args, metric_rows, run_variants


def parse_variant(spec: str) -> tuple[str, dict]:
    if spec == "dense":
        return "dense", {"sparse_ffn": False}
    kind, _, l1 = spec.partition(":")
    if kind != "sparse" or not l1:
        raise SystemExit(f"variant must be 'dense' or 'sparse:L1', got {spec!r}")
    return f"sparse_l1_{l1}", {"sparse_ffn": True, "l1": float(l1)}


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
    add_variant_run_args(ap, variants="dense,sparse:0,sparse:2e-5,sparse:1e-3", eval_every=20,
                         results_json="sparse_ffn.json")
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

    def describe(spec, config, run_dir):
        flat = config.to_flat()
        label = f"ReLU gate, L1 {flat['l1']:g}" if flat["sparse_ffn"] else "dense (SwiGLU)"
        last, last_train = metric_rows(run_dir, "eval")[-1], metric_rows(run_dir, "train")[-1]
        if last.get("ffn_sparsity") is None:
            return {"label": label}, ""
        fields = {"label": label, "ffn_sparsity_by_layer": last["ffn_sparsity"], "ffn_nnz_by_layer": last["ffn_nnz"],
                  "ffn_dead_by_layer": last["ffn_dead"], "train_l1": last_train.get("l1")}
        text = (f" sparsity/layer {[round(100 * s, 1) for s in last['ffn_sparsity']]}% dead/layer "
                f"{[round(100 * d, 1) for d in last['ffn_dead']]}%")
        return fields, text

    results = run_variants(args, parse_variant, describe, "sparse_ffn.json", bench="sparse_ffn_cpu")
    plot(results, args.out / "sparse_ffn.png")


if __name__ == "__main__":
    main()
