"""What the training benchmarks share: the metrics rows of a run directory, the optimizer variant
specs, and a recipe's [train] settings as the base TrainConfig. Imported by the scripts beside it
(run as `python tests/benchmarks/NAME.py`, this folder is on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path


def metric_rows(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl, only those of `kind` ("train", "eval") when given."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind") == kind]


def parse_optimizer_variant(spec: str) -> tuple[str, dict]:
    """"adamw", "adamw8bit" or "foam:LEVEL", each optionally with ":lr=VALUE" -> (run name, TrainConfig
    overrides), e.g. "foam:2:lr=4e-3" -> ("foam_2_lr4e-3", {"optimizer": "foam", "foam_level": 2, "lr": 0.004})."""
    parts = spec.split(":")
    kw: dict = {"optimizer": parts[0]}
    for part in parts[1:]:
        if part.startswith("lr="):
            kw["lr"] = float(part[3:])
        else:
            kw["foam_level"] = int(part)
    return spec.replace(":", "_").replace("=", ""), kw


def recipe_train_config(recipe, steps: int | None = None, eval_every: int | None = None):
    """The recipe's [train] section as a TrainConfig, with steps / eval_every overridden when given;
    the student starts from the recipe's teacher (or the default one)."""
    from pipelines.defaults import default_teacher_dir
    from pipelines.recipe import train_config

    for key, value in (("steps", steps), ("eval_every", eval_every)):
        if value is not None:
            recipe.train[key] = value
    return train_config(recipe, recipe.stage_one.teacher.model or default_teacher_dir())


def load_bench_recipe(path: Path | None, cache: Path | None):
    """The recipe at `path` (default: the built-in quickstart), its cache moved to `cache` if given."""
    from pipelines.recipe import builtin_recipe, load_recipe

    recipe = load_recipe(path or builtin_recipe("quickstart"))
    if cache is not None:
        recipe.stage_one.cache.out = cache
    return recipe


def add_variant_run_args(ap, *, variants: str, eval_every: int | None, results_json: str) -> None:
    """The arguments of a script that trains the recipe's student once per variant (run_variants)."""
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True, help="a complete cache of the recipe's teacher")
    ap.add_argument("--recipe", type=Path, default=None, help="default: the built-in quickstart")
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--steps", type=int, default=None, help="override [train] steps")
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--replot", action="store_true", help=f"only redraw the plot from OUT/{results_json}")


def run_variants(args, parse, describe, results_json: str) -> dict:
    """Train the recipe's student once per comma-separated spec of args.variants, in OUT/NAME, where
    parse(spec) -> (NAME, TrainConfig overrides) and describe(spec, config, run_dir) -> (fields for
    the run's record, a label among them; text for its printed line). OUT/results_json is rewritten
    after every run, so an interrupted call keeps the runs it finished."""
    import dataclasses
    import sys
    import time

    from student.trainer import train

    base = recipe_train_config(load_bench_recipe(args.recipe, args.cache), args.steps, args.eval_every)
    results = {"command": " ".join(sys.argv), "config": {k: str(v) for k, v in dataclasses.asdict(base).items()},
               "runs": {}}
    for spec in args.variants.split(","):
        name, kw = parse(spec)
        config = dataclasses.replace(base, out=str(args.out / name), **kw)
        start = time.perf_counter()
        train(config)
        seconds = time.perf_counter() - start
        fields, text = describe(spec, config, args.out / name)
        run = results["runs"][name] = {**fields, "overrides": kw, "seconds": seconds,
                                       "eval": metric_rows(args.out / name, "eval")}
        last = run["eval"][-1]
        print(f"{run['label']}: step {last['step']} held-out KL {last['kl']:.4f} CE {last['ce']:.4f}{text}", flush=True)
        (args.out / results_json).write_text(json.dumps(results, indent=2))
    return results
