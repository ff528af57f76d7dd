"""A two-domain data mixture on the CPU: what each cache's share of the batches does to each
domain's held-out KL. The quickstart's student learns from two caches of the default teacher, the
standard library's code (--cache) and the language reference's prose (--prose: pydoc_data/topics.py),
at equal steps, for each share of the code cache in --shares; each cache keeps its own held-out
sequences (student/mixture.py).

    distill cache-teacher --max-sequences 384 --seq-len 256 -k 64 --out caches/stdlib
    distill cache-teacher --corpus "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/pydoc_data" \\
        --glob topics.py --max-sequences 96 --seq-len 256 -k 64 --out caches/prose
    python tests/benchmarks/bench_mixture.py --cache caches/stdlib --prose caches/prose

Rows `mixture/code<share>`: the final held-out KL, CE and bits per byte on each cache (code_*,
prose_*) beside the run's (their mean at the shares); OUT/mixture.json; the plot --plot (default:
mixture_sweep.png beside this file, the README's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from run_helpers import add_variant_run_args, metric_rows, run_variants

HERE = Path(__file__).parent


def plot(results: dict, path: Path) -> None:
    """Each domain's final held-out KL against the code cache's share of the sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(results["runs"].values(), key=lambda run: run["code_share"])
    shares = [run["code_share"] for run in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    for domain, label in (("code", "standard library (code)"), ("prose", "language reference (prose)")):
        ax.plot(shares, [run[f"{domain}_kl"] for run in runs], marker="o", label=label)
    ax.set(xlabel="share of the code cache in the batches (--cache-weights)", ylabel="held-out KL to the teacher",
           title=f"Two-domain mixture, {runs[0]['steps']} steps each")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_run_args(ap, variants="1,0.75,0.5,0.25,0", eval_every=None, results_json="mixture.json")
    ap.add_argument("--prose", type=Path, required=True, help="the second cache (same teacher and tokenizer)")
    ap.add_argument("--plot", type=Path, default=HERE / "mixture_sweep.png")
    args = ap.parse_args()
    if args.replot:
        import json

        plot(json.loads((args.out / "mixture.json").read_text()), args.plot)
        return
    caches = [str(args.cache), str(args.prose)]

    def parse(spec: str) -> tuple[str, dict]:
        share = float(spec)
        if not 0 <= share <= 1:
            raise SystemExit(f"--variants: each a share of the code cache in [0, 1], got {spec!r}")
        return f"code{spec}", {"cache": caches, "cache_weights": f"{share},{1 - share}"}

    def describe(spec, config, run_dir):
        last = max(r["step"] for r in metric_rows(run_dir, "cache_eval"))
        each = {r["cache"]: r for r in metric_rows(run_dir, "cache_eval") if r["step"] == last}
        figures = {f"{domain}_{key}": each[place][key] for place, domain in enumerate(("code", "prose"))
                   for key in ("kl", "ce", "bits_per_byte")}
        text = f"; code KL {figures['code_kl']:.3f}, prose KL {figures['prose_kl']:.3f}"
        return {"label": f"code share {spec}", "code_share": float(spec), "steps": last, **figures}, text

    results = run_variants(args, parse, describe, "mixture.json", bench="mixture")
    plot(results, args.plot)


if __name__ == "__main__":
    main()
