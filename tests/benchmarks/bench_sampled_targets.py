"""Sampled teacher targets (RS-KD) against top-k, trained alike and measured on one ground truth.

Builds, from the recipe's teacher over the same corpus sequences, top-k caches (k = 8, 32, 100)
and sampled caches (S = 4, 12, 32 draws a position), trains the recipe's pruned student from each
(same steps, seed, data order and held-out split), then evaluates each run as `distill eval RUN
--teacher` does: held-out exact full-vocabulary KL, cross-entropy and calibration error (ECE of
the top-1), beside the cache's bytes per token (as cache-stats counts them) and the cache's own
kl (the top-k bound, or the sampled estimate). One results row a cache and training seed
(`sampled_targets/NAME`, `NAME-seedN` for seeds other than 0) and a plot of full-vocabulary KL and
ECE against bytes/token (log x; with several --seeds their mean and standard deviation) for the
README.

    # H200, full size (the defaults), in two commands, then the plot of both halves:
    python tests/benchmarks/bench_sampled_targets.py --device cuda --targets topk:8,topk:32,topk:100
    python tests/benchmarks/bench_sampled_targets.py --device cuda --targets sampled:4,sampled:12,sampled:32
    python tests/benchmarks/bench_sampled_targets.py --plot-only
    # the hybrid (exact top-K, then S draws outside it; its own series in the plot):
    python tests/benchmarks/bench_sampled_targets.py --device cuda --targets hybrid:8+12,hybrid:32+12
    # more seeds for the caches already built (ECE moves between seeds):
    python tests/benchmarks/bench_sampled_targets.py --device cuda --targets topk:100,sampled:12 --seeds 1,2
    # one pass over a corpus as large as the training (no sequence seen twice), three seeds:
    python tests/benchmarks/bench_sampled_targets.py --device cuda --corpus stdlib,torch --tokens 12400000 \\
        --steps 3000 --targets topk:100,sampled:12 --seeds 0,1,2
    # CPU, tiny, the default teacher (tests/test_bench_sampled_targets.py runs a tinier one on a tiny teacher):
    python tests/benchmarks/bench_sampled_targets.py --device cpu --tokens 4096 --seq-len 64 --steps 4 \\
        --batch-size 2 --heldout 2 --targets topk:8,topk:32 --out /tmp/st --results /tmp/st.jsonl --plot /tmp/st.png

Caches go to OUT/caches/NAME and runs to OUT/runs/NAME (OUT: --out, by default under the
git-ignored tests/benchmarks/out/); a rerun reuses complete caches and resumes or re-evaluates
finished runs, so a command cut short is simply run again. The corpus, teacher and student come
from the recipe (default: the built-in quickstart: SmolLM2-135M-Instruct over the standard
library, a 4-layer pruned student); --tokens and --seq-len size the corpus, the other flags the
training, the same for every cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from harness import HERE, OUTPUT_DIR, add_results_arg, commit, load_rows
from run_helpers import load_bench_recipe, run_variants

BENCH = "sampled_targets"
KINDS = ("topk", "sampled", "topk+sampled")  # the caches' targets kinds, one plot series each
SERIES = {"topk": ("top-k", "o"), "sampled": ("sampled (RS-KD)", "s"), "topk+sampled": ("top-k + sampled", "^")}
TARGETS = "topk:8,topk:32,topk:100,sampled:4,sampled:12,sampled:32"
PLOT = HERE / "sampled_targets.png"


def parse_target(spec: str) -> tuple[str, str, int | str]:
    """"topk:K" | "sampled:S" | "hybrid:K+S" -> (run name, cache targets kind, K or S, or "K+S" for
    the hybrid); ValueError otherwise."""
    kind, _, count = spec.partition(":")
    if kind == "hybrid":
        head, plus, samples = count.partition("+")
        if plus and head.isdigit() and samples.isdigit() and int(head) >= 1 and int(samples) >= 1:
            return f"hybrid{int(head)}+{int(samples)}", "topk+sampled", f"{int(head)}+{int(samples)}"
    elif kind in ("topk", "sampled") and count.isdigit() and int(count) >= 1:
        return f"{kind}{int(count)}", kind, int(count)
    raise ValueError(f"each --targets entry must be topk:K, sampled:S or hybrid:K+S with counts >= 1, got {spec!r}")


def count_tag(kind: str, count: int | str) -> str:
    """How a cache's count reads on the plot and in its label's tail: k=8, S=12, k=8+S=12."""
    if kind == "topk+sampled":
        head, samples = str(count).split("+")
        return f"k={head}+S={samples}"
    return f"k={count}" if kind == "topk" else f"S={count}"


def corpus_path(name: str) -> Path:
    """A --corpus entry: `stdlib`, `torch` or a path."""
    if name == "stdlib":
        from pipelines.defaults import default_corpus_dir

        return default_corpus_dir()
    if name == "torch":
        import torch

        return Path(torch.__file__).parent
    return Path(name)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=TARGETS, help=f"comma-separated caches to build and train from (default {TARGETS})")
    ap.add_argument("--tokens", type=int, default=3_000_000, help="corpus tokens (sequences = tokens // seq-len)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence")
    ap.add_argument("--corpus", default=None,
                    help="comma-separated files or folders read in order in place of the recipe's corpus paths; "
                         "`stdlib` names the interpreter's standard library, `torch` the installed torch "
                         "package's sources (e.g. --corpus stdlib,torch for a corpus of one pass at the "
                         "default --steps)")
    ap.add_argument("--steps", type=int, default=2000, help="training steps of every run")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    ap.add_argument("--heldout", type=int, default=64, help="held-out sequences (the evaluation's, every run's)")
    ap.add_argument("--eval-every", type=int, default=500, help="the trainer's own (cache-based) evaluations")
    ap.add_argument("--seeds", default="0", help="comma-separated training seeds: every cache trains once per seed "
                                                 "(data order and initialisation); the plot draws their mean")
    ap.add_argument("--cache-batch-size", type=int, default=64, help="sequences per teacher call in stage one")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda: teacher, student and evaluation")
    ap.add_argument("--recipe", type=Path, default=None, help="teacher, corpus, student and [train] settings "
                                                                "(default: the built-in quickstart)")
    ap.add_argument("--out", type=Path, default=OUTPUT_DIR / BENCH, help="caches and runs")
    ap.add_argument("--plot", type=Path, default=PLOT, help=f"the figure (default {PLOT.name} beside this script)")
    ap.add_argument("--plot-only", action="store_true", help="only redraw the plot from the rows in --results")
    add_results_arg(ap)
    args = ap.parse_args(argv)
    try:
        args.specs = [parse_target(spec) for spec in args.targets.split(",")]
    except ValueError as e:
        ap.error(str(e))
    try:
        args.seed_list = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if len(set(args.seed_list)) < len(args.seed_list):
        ap.error(f"--seeds names a seed twice: {args.seeds}")
    if len({name for name, _, _ in args.specs}) < len(args.specs):
        ap.error(f"--targets names a cache twice: {args.targets}")
    for name in ("tokens", "seq_len", "steps", "batch_size", "heldout", "cache_batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.corpus_paths = None if args.corpus is None else tuple(corpus_path(name) for name in args.corpus.split(","))
    if args.tokens // args.seq_len <= args.heldout:
        ap.error(f"--tokens {args.tokens} gives {args.tokens // args.seq_len} sequences of --seq-len {args.seq_len}: "
                 f"more than --heldout {args.heldout} are needed")
    return args


def stage_one_config(recipe, args, name: str, kind: str, count: int):
    """The recipe's stage one for one cache: its teacher and corpus sized by --tokens/--seq-len (the
    same sequences for every cache), written to OUT/caches/NAME with these targets."""
    s1 = recipe.stage_one
    corpus = dataclasses.replace(s1.corpus, seq_len=args.seq_len, max_sequences=args.tokens // args.seq_len,
                                 **({"paths": args.corpus_paths} if args.corpus_paths else {}))
    teacher = dataclasses.replace(s1.teacher, device=args.device)
    cache = dataclasses.replace(s1.cache, out=args.out / "caches" / name, batch_size=args.cache_batch_size)
    if kind == "topk":
        cache = dataclasses.replace(cache, k=count)
    elif kind == "sampled":
        cache = dataclasses.replace(cache, targets="sampled", samples=count)
    else:
        head, samples = map(int, count.split("+"))
        cache = dataclasses.replace(cache, targets="topk+sampled", k=head, samples=samples)
    return dataclasses.replace(s1, teacher=teacher, corpus=corpus, cache=cache)


def build_caches(recipe, args) -> dict[str, dict]:
    """Build (or reuse) every cache of --targets: {name: {"dir", "kind", "count", "seconds", "reused"}}.
    Every config is made before the first cache is built, so a target this checkout cannot build
    stops the command before any work."""
    from pipelines.stage_one import cache_teacher

    configs = [stage_one_config(recipe, args, name, kind, count) for name, kind, count in args.specs]
    caches = {}
    for (name, kind, count), config in zip(args.specs, configs):
        start = time.perf_counter()
        built = cache_teacher(config)
        caches[name] = {"dir": Path(built.cache_dir), "kind": kind, "count": count,
                        "seconds": time.perf_counter() - start, "reused": built.already_complete}
    return caches


def evaluate_run(run_dir: Path, cache: dict, teacher_dir, device: str) -> tuple[dict, str]:
    """The run's held-out figures against the teacher (distill eval --teacher) and its cache's bytes/token."""
    from pipelines.teacher_eval import EvalTeacher
    from student.evaluate import evaluate_run_or_folder
    from teacher_cache.stats import cache_stats

    start = time.perf_counter()
    evaluation = evaluate_run_or_folder(run_dir, device=device, teacher=EvalTeacher(teacher_dir))
    after, teacher = evaluation["after"], evaluation["teacher"]
    stats = cache_stats(cache["dir"], max_shards=4)  # its sizes cover every shard
    # sampled caches: the distinct ids the S draws gave (hybrid: outside the top-K)
    unique = stats.get("unique_ids_per_position")
    label = {"topk": f"top-{cache['count']}", "sampled": f"sampled, S = {cache['count']}",
             "topk+sampled": f"top-k + sampled, {count_tag(cache['kind'], cache['count'])}"}[cache["kind"]]
    bytes_per_token = stats["bytes_per_token"]
    fields = {"label": label, "targets": cache["kind"], "count": cache["count"], "bytes_per_token": bytes_per_token,
              "unique_ids_per_position": unique["mean"] if unique else None,
              "full_vocab_kl": after.full_vocab_kl, "ce": after.ce, "calibration_error": after.calibration_error,
              "cache_kl": after.kl, "top1": after.top1, "heldout_tokens": after.tokens,
              "teacher_ce": teacher.ce, "teacher_calibration_error": teacher.calibration_error,
              "cache_seconds": cache["seconds"], "cache_reused": cache["reused"],
              "eval_seconds": time.perf_counter() - start, "kl_note": evaluation["kl_note"]}
    text = (f"; full-vocabulary KL {after.full_vocab_kl:.4f}, ECE {after.calibration_error:.4f}, "
            f"{bytes_per_token:.1f} B/token")
    return fields, text


def newest_rows(path: Path) -> list[dict]:
    """The newest row of each case of this benchmark in the results file, of the newest row's
    training length only (runs of another length are another experiment, not points of its curve)."""
    rows = [row for row in load_rows(path) if row["bench"] == BENCH]
    if not rows:
        return []
    steps = rows[-1]["config"]["train_config"]["steps"]
    return list({row["case"]: row for row in rows if row["config"]["train_config"]["steps"] == steps}.values())


def seed_means(figures: list[dict]) -> list[dict]:
    """One entry per cache (targets, count): its figures averaged over the seeds it trained with,
    with "seeds" (how many) and the standard deviation over seeds of the KL and the ECE."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for f in figures:
        groups.setdefault((f["targets"], f["count"]), []).append(f)
    means = []
    for group in groups.values():
        mean = {**group[0], "seeds": len(group)}
        for key in ("full_vocab_kl", "calibration_error"):
            values = [f[key] for f in group]
            mean[key] = statistics.fmean(values)
            mean[key + "_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        means.append(mean)
    return means


def plot_series(rows: list[dict]) -> list[tuple[str, str, str, list[dict]]]:
    """(kind, legend name, marker, seed-mean points by bytes/token) per target kind with rows: one
    series each for top-k, sampled and the hybrid."""
    series = []
    for kind in KINDS:
        points = sorted(seed_means([r["figures"] for r in rows if r["figures"].get("targets") == kind]),
                        key=lambda f: f["bytes_per_token"])
        if points:
            series.append((kind, *SERIES[kind], points))
    return series


def plot(rows: list[dict], path: Path) -> None:
    """Full-vocabulary KL and ECE against bytes/token (log x), one line per target kind, the teacher's
    own ECE as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, name, marker, points in plot_series(rows):
        x = [f["bytes_per_token"] for f in points]
        for ax, key in zip(axes, ("full_vocab_kl", "calibration_error")):
            spread = [f[key + "_sd"] for f in points] if any(f["seeds"] > 1 for f in points) else None
            ax.errorbar(x, [f[key] for f in points], yerr=spread, marker=marker, capsize=3, label=name)
            for f in points:
                ax.annotate(count_tag(kind, f["count"]), (f["bytes_per_token"], f[key]), textcoords="offset points",
                            xytext=(4, 4), fontsize="small")
    teacher_ece = [r["figures"]["teacher_calibration_error"] for r in rows]
    if teacher_ece:
        axes[1].axhline(teacher_ece[-1], color="gray", linestyle="--", label="the teacher's own")
    axes[0].set(xscale="log", xlabel="cache bytes per token", ylabel="held-out full-vocabulary KL (nats/token)",
                title="KL(teacher || student), whole vocabulary")
    axes[1].set(xscale="log", xlabel="cache bytes per token", ylabel="expected calibration error (top-1)",
                title="Calibration of the student")
    for ax in axes:
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 20, 50, 100, not 2 x 10^1
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([10, 20, 50, 100, 200])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    """Run the benchmark; returns the rows it appended (none with --plot-only)."""
    args = parse_args(argv)
    if args.plot_only:
        plot(newest_rows(args.results), args.plot)
        return []
    from pipelines.defaults import default_teacher_dir

    recipe = load_bench_recipe(args.recipe)
    teacher_dir = recipe.stage_one.teacher.model or default_teacher_dir()
    caches = build_caches(recipe, args)
    before = len(load_rows(args.results))
    by_spec = {f"{kind}:{count}": name for name, kind, count in args.specs}

    def parse(variant):  # "topk:8@SEED"; seed 0's run keeps the cache's own name
        spec, _, seed = variant.partition("@")
        name = by_spec[spec] + ("" if seed == "0" else f"-seed{seed}")
        return name, {"cache": str(caches[by_spec[spec]]["dir"]), "device": args.device, "seed": int(seed),
                      "batch_size": args.batch_size, "heldout": args.heldout, "eval_sequences": None,
                      "warmup_steps": max(1, args.steps // 20), "save_every": 0}

    def describe(variant, config, run_dir):
        fields, text = evaluate_run(run_dir, caches[by_spec[variant.partition("@")[0]]], teacher_dir, args.device)
        return {**fields, "seed": config.seed}, text

    # run_variants trains the recipe's student once per spec (its [train] settings, these overrides).
    variants = argparse.Namespace(recipe=args.recipe, cache=caches[args.specs[0][0]]["dir"], steps=args.steps,
                                  eval_every=args.eval_every, out=args.out / "runs", results=args.results,
                                  variants=",".join(f"{spec}@{seed}" for spec in by_spec for seed in args.seed_list))
    run_variants(variants, parse, describe, f"{BENCH}.json", bench=BENCH)
    rows = load_rows(args.results)[before:]
    plot(newest_rows(args.results), args.plot)
    print(f"{len(rows)} rows at {commit()}; plot: {args.plot}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
