"""Quality of sparse pages on real data (issue 17): the same student, same initialisation, same data
order and same steps, trained chunk by chunk with dense attention over every past page (`dense`,
exact) or with OOMB's page top-k (`sparse:B`: each chunk attends its own pages plus the B past
pages its queries score highest against their mean keys), optionally also on whole sequences
(`whole`, which must give the dense run's losses). Long sequences, so most of the past is dropped.

    python tests/benchmarks/bench_sparse_pages_quality.py                        # CPU, default sizes
    python tests/benchmarks/bench_sparse_pages_quality.py --train-seq-len 2048 --chunk-tokens 256  # the whole cache
    python tests/benchmarks/bench_sparse_pages_quality.py --variants whole,dense,sparse:4 --steps 10
    python tests/benchmarks/bench_sparse_pages_quality.py --seeds 0,1 --variants dense,sparse:2,sparse:8  # noise
    python tests/benchmarks/bench_sparse_pages_quality.py --seeds 0,1 --variants dense,sparse:8 --jobs 4  # side by side

Stage one: the quickstart recipe's teacher and corpus packed into sequences of --seq-len tokens
(--sequences of them), cached once under OUT/cache_L<seq-len>_n<sequences> and reused (a complete
cache of the same identity is not rebuilt; --cache names another one).

Per run, two evaluations on the same held-out sequences: the trainer's own (a sparse run's attend
sparsely, as it trained) and a final DENSE one of the trained student through
student.evaluate.evaluate_run_or_folder, which attends over every page as the deployed student
does. Checks before any figure is kept: the dense run's own final evaluation equals its final
dense evaluation (same attention, reloaded student), and with `whole` its training losses equal
the dense run's step by step. Writes OUT/<variant>/ (run dirs), OUT/sparse_pages_quality.json and
OUT/sparse_pages_quality.png (held-out KL against step per variant; OUT defaults to the git-ignored
tests/benchmarks/out/sparse_pages_quality) and one row `sparse_pages_quality/<variant>` a run. The
rows and the json give each run's dense evaluation (KL, CE, bits per byte) and its cost against the
dense run: dense-eval KL and bits per byte minus the dense run's.

--seeds 0,1,...: every variant trains once per seed, in OUT/seed<N>/<variant> (rows
`seed<N>/<variant>`), each compared with the same seed's dense run; the exactness checks run per
seed. The seed sets the data order (which training sequences come at which step, and the window
start when --train-seq-len crops), not the initialisation: the pruned student starts from the
teacher's weights whatever the seed. The json's "summary" gives, per variant, the mean and
standard deviation over seeds of its cost, and the dense run's own seed-to-seed standard deviation
as the noise yardstick: a variant "matches dense within noise" when its mean cost is no larger in
magnitude than that. Without --seeds: one run per variant at the recipe's seed, in OUT/<variant>.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from harness import Results, check_close
from run_helpers import add_variant_run_args, load_bench_recipe, metric_rows, run_row, run_variants

BENCH = "sparse_pages_quality"
RESULTS_JSON = f"{BENCH}.json"
# Chunked training is exact: its losses and evaluations equal the whole-sequence ones up to the
# order of fp32 sums (tests/test_long_context.py holds the engine to 1e-5 relative).
EXACT_RTOL = 1e-4


def long_stage_one(recipe, *, seq_len: int, sequences: int, out: Path):
    """The recipe's stage one (teacher, corpus, cache settings) with sequences of `seq_len` tokens,
    `sequences` of them, written to `out`."""
    stage_one = recipe.stage_one
    corpus = dataclasses.replace(stage_one.corpus, seq_len=seq_len, max_sequences=sequences)
    return dataclasses.replace(stage_one, corpus=corpus, cache=dataclasses.replace(stage_one.cache, out=out))


def variant_parser(args):
    """parse(spec) for run_variants: "whole", "dense" or "sparse:B", each optionally after
    "seed<N>/" -> (run name, flat TrainConfig overrides), e.g. "seed1/sparse:8" -> ("seed1/sparse_8",
    {..., "sparse_pages": 8, "seed": 1}). Every variant gets the same shared settings, so only the
    attention (and the seed) differs."""
    shared = {"seq_len": args.train_seq_len, "num_layers": args.num_layers, "batch_size": args.batch_size, "heldout": args.heldout,
              "warmup_steps": args.warmup_steps, "save_every": args.steps, "log_every": 1,
              **({} if args.lr is None else {"lr": args.lr})}
    chunked = {"chunk_tokens": args.chunk_tokens, "page_tokens": args.page_tokens}

    def parse(spec: str) -> tuple[str, dict]:
        seed, _, spec = spec.rpartition("/")
        name, kw = parse_variant(spec)
        return (f"{seed}/{name}", {**kw, "seed": int(seed.removeprefix("seed"))}) if seed else (name, kw)

    def parse_variant(spec: str) -> tuple[str, dict]:
        if spec == "whole":
            return spec, {**shared, "chunk_tokens": None}
        if spec == "dense":
            return spec, {**shared, **chunked}
        kind, _, budget = spec.partition(":")
        if kind != "sparse" or not budget.isdigit() or int(budget) < 1:
            raise SystemExit(f"--variants: each must be whole, dense or sparse:B with B >= 1 past pages, got {spec!r}")
        return f"sparse_{budget}", {**shared, **chunked, "sparse_pages": int(budget)}

    return parse


def seeded_specs(variants: str, seeds: str | None) -> str:
    """run_variants' comma-separated specs: `variants` as given without --seeds, else each variant
    once per seed, seed by seed ("seed0/dense,seed0/sparse:8,seed1/dense,..."), so that a call
    stopped early has every variant of the seeds before the one it stopped in."""
    if seeds is None:
        return variants
    if not all(seed.strip().isdigit() for seed in seeds.split(",")):
        raise SystemExit(f"--seeds: a comma-separated list of integers >= 0, e.g. 0,1,2, got {seeds!r}")
    return ",".join(f"seed{int(seed)}/{spec}" for seed in seeds.split(",") for spec in variants.split(","))


def by_seed(runs: dict) -> dict[str, dict]:
    """{"seed<N>" ("" without --seeds): {variant: run}} of results["runs"], whose names are
    "seed<N>/<variant>" (or "<variant>")."""
    groups: dict[str, dict] = {}
    for name, run in runs.items():
        seed, _, variant = name.rpartition("/")
        groups.setdefault(seed, {})[variant] = run
    return groups


def describe(spec, config, run_dir):
    """The run's label and attention settings for its record."""
    long = config.long
    if long.chunk_tokens is None:
        label = "whole sequences (no chunking)"
    elif long.sparse_pages is None:
        label = f"dense pages (chunk {long.chunk_tokens}, page {long.page_tokens})"
    else:
        label = (f"sparse pages: own + {long.sparse_pages} past (chunk {long.chunk_tokens}, "
                 f"page {long.page_tokens})")
    if "/" in spec:
        label = f"seed {config.seed}: {label}"
    return {"label": label, "chunk_tokens": long.chunk_tokens, "page_tokens": long.page_tokens,
            "sparse_pages": long.sparse_pages, "seed": config.seed}, ""


def add_dense_evals(results: dict, out: Path, chunk_tokens: int) -> None:
    """Evaluate every run's trained student with dense attention (chunk by chunk, every past page)
    on the run's held-out sequences; stores run["dense_eval"] (kl, ce, top1, bits_per_byte, ...:
    the run's tokenizer, the teacher's, gives the bytes of its tokens)."""
    from student.evaluate import evaluate_run_or_folder

    for name, run in results["runs"].items():
        after = evaluate_run_or_folder(out / name, chunk_tokens=chunk_tokens)["after"]
        run["dense_eval"] = after.to_dict()
        print(f"{run['label']}: final dense evaluation {after.summary()}", flush=True)


def check_exact(results: dict, out: Path) -> None:
    """Dense chunked training is exact: its own final evaluation must equal the dense evaluation of
    the saved student, and a whole-sequence run's losses must equal its losses step by step."""
    runs = results["runs"]
    for name in ("dense", "whole"):
        if name in runs:
            last, dense = runs[name]["eval"][-1], runs[name]["dense_eval"]
            for key in ("kl", "ce"):
                check_close(f"{name}: trainer's final {key} vs dense evaluation", last[key], dense[key],
                            atol=0.0, rtol=EXACT_RTOL)
    if "dense" in runs and "whole" in runs:
        losses = {name: [r["loss"] for r in metric_rows(out / name, "train")] for name in ("dense", "whole")}
        check_close("whole vs dense training losses", losses["dense"], losses["whole"], atol=0.0, rtol=EXACT_RTOL)
        print(f"whole == dense: {len(losses['dense'])} training losses equal to rtol {EXACT_RTOL}", flush=True)


def costs_vs_dense(run: dict, reference: dict) -> dict:
    """A run's dense-evaluation KL, CE and bits per byte minus those of `reference` (the same seed's
    dense run's dense_eval); bits per byte None where either lacks it."""
    dense = run["dense_eval"]
    bpb = (dense.get("bits_per_byte"), reference.get("bits_per_byte"))
    return {"kl_cost_vs_dense": dense["kl"] - reference["kl"], "ce_cost_vs_dense": dense["ce"] - reference["ce"],
            "bpb_cost_vs_dense": None if None in bpb else bpb[0] - bpb[1]}


def add_rows(results: dict, path: Path | None) -> None:
    """One row a run: run_row's figures (trainer's evaluations, KL curve, seconds) plus the final
    dense evaluation and, beside a dense run of the same seed, the KL, CE and bits-per-byte cost of
    each run against it."""
    rows, groups = Results(bench=BENCH, path=path), by_seed(results["runs"])
    for name, run in results["runs"].items():
        dense = run["dense_eval"]
        reference = groups[name.rpartition("/")[0]].get("dense", {}).get("dense_eval")
        figures = {**run_row(run), "dense_eval_kl": dense["kl"], "dense_eval_ce": dense["ce"],
                   "dense_eval_top1": dense["top1"], "dense_eval_bits_per_byte": dense.get("bits_per_byte")}
        if reference is not None:
            figures.update(costs_vs_dense(run, reference))
        rows.add(name, figures, {"label": run["label"], "overrides": run["overrides"], "cache": results["cache"],
                                 "seq_len": results["seq_len"], "train_command": results["command"]})


def spread(values: list) -> dict:
    """Mean and sample standard deviation (None below two values) of `values`, Nones left out."""
    values = [v for v in values if v is not None]
    return {"values": values, "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None}


def summarize(results: dict) -> dict:
    """Over the seeds that have a dense run: the dense run's dense-eval KL and bits per byte (their
    standard deviation is the noise yardstick), and per other variant its paired cost (its value
    minus the same seed's dense run's), with "within_noise": |mean cost| <= the dense run's
    standard deviation (None with fewer than two seeds)."""
    groups = {seed: runs for seed, runs in by_seed(results["runs"]).items() if "dense" in runs}
    dense = {key: spread([runs["dense"]["dense_eval"].get(key) for runs in groups.values()])
             for key in ("kl", "bits_per_byte")}
    costs = {}
    for variant in dict.fromkeys(v for runs in groups.values() for v in runs if v != "dense"):
        paired = {seed: costs_vs_dense(runs[variant], runs["dense"]["dense_eval"])
                  for seed, runs in groups.items() if variant in runs}
        costs[variant] = {"seeds": list(paired)}
        for key, cost in (("kl", "kl_cost_vs_dense"), ("bits_per_byte", "bpb_cost_vs_dense")):
            entry = costs[variant][key] = spread([c[cost] for c in paired.values()])
            noise = dense[key]["std"]
            entry["within_noise"] = None if noise is None or entry["mean"] is None else abs(entry["mean"]) <= noise
    return {"seeds": list(groups), "dense": dense, "cost_vs_dense": costs,
            "rule": "within_noise: |mean over seeds of (variant - same seed's dense)| <= the dense run's seed-to-seed "
                    "sample standard deviation"}


def print_summary(summary: dict) -> None:
    """summarize's figures, a line for the dense run and one per other variant (none without a dense run)."""
    if not summary["seeds"]:
        return
    f = lambda x, sign="+": "n/a" if x is None else f"{x:{sign}.4f}"
    dense = summary["dense"]
    print(f"dense run over seeds {', '.join(summary['seeds']) or '(one)'}: KL {f(dense['kl']['mean'], '')} "
          f"(sd {f(dense['kl']['std'], '')}), bits/byte {f(dense['bits_per_byte']['mean'], '')} "
          f"(sd {f(dense['bits_per_byte']['std'], '')})", flush=True)
    for variant, cost in summary["cost_vs_dense"].items():
        parts = [f"{key} cost {f(cost[key]['mean'])} (sd {f(cost[key]['std'], '')}; per seed "
                 f"{', '.join(map(f, cost[key]['values']))}; within noise: {cost[key]['within_noise']})"
                 for key in ("kl", "bits_per_byte")]
        print(f"{variant} vs dense: " + "; ".join(parts), flush=True)


def plot(results: dict, path: Path) -> None:
    """Held-out KL against step per run (the trainer's evaluations, a sparse run's attending
    sparsely), and each trained student's dense evaluation as an open marker at its last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = by_seed(results["runs"])
    colors = {variant: f"C{i}" for i, variant in enumerate(dict.fromkeys(v for runs in groups.values() for v in runs))}
    for seed, style in zip(groups, ["-", "--", ":", "-."] * len(groups)):
        for variant, run in groups[seed].items():
            steps = [r["step"] for r in run["eval"]]
            ax.plot(steps, [r["kl"] for r in run["eval"]], marker="o", ms=3, ls=style, color=colors[variant],
                    label=run["label"])
            if "dense_eval" in run:
                ax.plot([steps[-1]], [run["dense_eval"]["kl"]], marker="D", mfc="none", ms=10, color=colors[variant])
    ax.plot([], [], marker="D", mfc="none", ls="none", color="gray", label="final student, dense evaluation")
    ax.set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", yscale="log",
           title=f"Sparse pages vs dense, {results['seq_len']}-token sequences")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7 if len(groups) > 1 else 8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (arguments as on the command line); returns the results written to
    OUT/sparse_pages_quality.json."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_run_args(ap, variants="dense,sparse:4,sparse:16", eval_every=10, results_json=RESULTS_JSON,
                         cache_required=False)
    ap.set_defaults(steps=30)
    ap.add_argument("--finish", action="store_true",
                    help=f"train nothing: evaluate, check, add the rows of and plot the runs kept in OUT/{RESULTS_JSON} "
                         "(a call stopped during a later variant keeps the runs it finished)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per cached sequence (stage one)")
    ap.add_argument("--sequences", type=int, default=24, help="cached sequences, the held-out ones among them")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds (data order): every variant trains once per seed, in OUT/seed<N>/ "
                         "(default: once, at the recipe's seed, in OUT/)")
    ap.add_argument("--train-seq-len", type=int, default=1024,
                    help="train on a window of N tokens of each cached sequence (at a seeded start) and evaluate "
                         "on the first N; 0: all --seq-len")
    ap.add_argument("--heldout", type=int, default=2, help="held-out sequences every evaluation uses")
    ap.add_argument("--num-layers", type=int, default=4, help="layers the student keeps of the teacher")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate of every variant (default: the recipe's); small when the student "
                         "starts converged (--num-layers of all the teacher's layers: the teacher itself)")
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    args.train_seq_len = args.train_seq_len or None
    if args.replot:
        results = json.loads((args.out / RESULTS_JSON).read_text())
        plot(results, args.out / f"{BENCH}.png")
        return results
    if args.finish:
        return finish(json.loads((args.out / RESULTS_JSON).read_text()), args)
    if args.cache is None:
        from pipelines.stage_one import cache_teacher

        args.cache = args.out / f"cache_L{args.seq_len}_n{args.sequences}"
        cache_teacher(long_stage_one(load_bench_recipe(args.recipe), seq_len=args.seq_len,
                                     sequences=args.sequences, out=args.cache))
    specs = argparse.Namespace(**{**vars(args), "variants": seeded_specs(args.variants, args.seeds)})
    return finish(run_variants(specs, variant_parser(args), describe, RESULTS_JSON), args)


def finish(results: dict, args) -> dict:
    """The dense evaluations, the exactness checks, the rows and the plot of the trained runs
    (run_variants' results; its base config names the cache)."""
    results.setdefault("cache", results["config"]["cache"])
    results.setdefault("seq_len", args.train_seq_len or args.seq_len)
    add_dense_evals(results, args.out, args.chunk_tokens)
    results["summary"] = summarize(results)
    (args.out / RESULTS_JSON).write_text(json.dumps(results, indent=2))
    for seed, runs in by_seed(results["runs"]).items():
        check_exact({"runs": runs}, args.out / seed)
    add_rows(results, args.results)
    print_summary(results["summary"])
    plot(results, args.out / f"{BENCH}.png")
    return results


if __name__ == "__main__":
    main()
