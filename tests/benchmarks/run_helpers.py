"""What the training and scale-out benchmarks share: the metrics rows of a run directory, the
optimizer variant specs, a recipe's [train] settings as the base TrainConfig, one training run per
variant with a results row each, and the world sizes and torchrun launch of the scaling benchmarks.
Imported by the scripts beside it (run as `python tests/benchmarks/NAME.py`, this folder is on
sys.path). TrainConfig is used only through its flat API (`to_flat`, `with_flat`), so these
helpers do not depend on how its sub-configs are composed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import OUTPUT_DIR, Results, add_results_arg


def metric_rows(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl, only those of `kind` ("train", "eval") when given."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind") == kind]


def world_sizes(spec: str, device: str) -> list[int]:
    """The world sizes of a comma-separated --gpus value, e.g. "1,2,4,8"; on "cuda" those above the
    GPUs this host has are dropped (and said so), elsewhere (gloo on the CPU) every one is kept."""
    sizes = [int(n) for n in spec.split(",")]
    if any(n < 1 for n in sizes):
        raise SystemExit(f"--gpus: world sizes must be >= 1, got {spec!r}")
    if device == "cuda":
        import torch

        present = torch.cuda.device_count()
        skipped = [n for n in sizes if n > present]
        sizes = [n for n in sizes if n <= present]
        if skipped:
            print(f"skipped world sizes {skipped}: {present} GPU(s) seen", flush=True)
    if not sizes:
        raise SystemExit(f"--gpus {spec}: no world size fits this host")
    return sizes


def torchrun(nproc: int) -> list[str]:
    """The command that starts `nproc` processes on this host as `torchrun --standalone` does (a free
    rendezvous port each launch); the distill command follows it as `-m distill ...`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def parse_optimizer_variant(spec: str) -> tuple[str, dict]:
    """"adamw", "adamw8bit" or "foam:LEVEL", each optionally with ":lr=VALUE" -> (run name, flat TrainConfig
    overrides), e.g. "foam:2:lr=4e-3" -> ("foam_2_lr4e-3", {"optimizer": "foam", "foam_level": 2, "lr": 0.004})."""
    parts = spec.split(":")
    kw: dict = {"optimizer": parts[0]}
    for part in parts[1:]:
        if part.startswith("lr="):
            kw["lr"] = float(part[3:])
        else:
            kw["foam_level"] = int(part)
    return spec.replace(":", "_").replace("=", ""), kw


def load_bench_recipe(path: Path | None):
    """The recipe at `path` (default: the built-in quickstart)."""
    from pipelines.recipe import builtin_recipe, load_recipe

    return load_recipe(path or builtin_recipe("quickstart"))


def recipe_train_config(recipe, *, cache: Path | None = None, steps: int | None = None, eval_every: int | None = None):
    """The recipe's [train] section as a TrainConfig, its student starting from the recipe's teacher
    (or the default one); `cache`, `steps` and `eval_every` override the recipe's when given."""
    from pipelines.defaults import default_teacher_dir
    from pipelines.recipe import train_config

    config = train_config(recipe, recipe.stage_one.teacher.model or default_teacher_dir())
    overrides = {"cache": None if cache is None else str(cache), "steps": steps, "eval_every": eval_every}
    overrides = {key: value for key, value in overrides.items() if value is not None}
    return config.with_flat(**overrides) if overrides else config


def add_variant_run_args(ap, *, variants: str, eval_every: int | None, results_json: str,
                         cache_required: bool = True) -> None:
    """The arguments of a script that trains the recipe's student once per variant (run_variants).
    Run folders, OUT/results_json and the plot go to --out, by default under the git-ignored
    tests/benchmarks/out/; one results row a run goes to --results."""
    default_out = OUTPUT_DIR / Path(results_json).stem
    ap.add_argument("--out", type=Path, default=default_out, help=f"run folders, json and plot (default {default_out})")
    ap.add_argument("--cache", type=Path, required=cache_required, default=None,
                    help="a complete cache of the recipe's teacher" + ("" if cache_required else
                                                                       " (default: build the recipe's own)"))
    ap.add_argument("--recipe", type=Path, default=None, help="default: the built-in quickstart")
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--steps", type=int, default=None, help="override [train] steps")
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--replot", action="store_true", help=f"only redraw the plot from OUT/{results_json}")
    ap.add_argument("--resume", action="store_true",
                    help=f"keep the runs OUT/{results_json} holds with the same settings (a call stopped after "
                         "them) and train only the others")
    ap.add_argument("--jobs", type=int, default=1,
                    help="train up to N runs side by side, each in its own process (small students leave a GPU "
                         "mostly idle); their seconds are then not those of a run alone, and their rows say jobs N")
    add_results_arg(ap)


def run_row(run: dict) -> dict:
    """The figures of one training run for its results row: the last held-out evaluation, the
    curve of held-out KL, the wall time and the numbers `describe` added."""
    evals = run["eval"]
    last = evals[-1]
    figures = {"heldout_kl": last.get("kl"), "heldout_ce": last.get("ce"), "heldout_top1": last.get("top1"),
               "heldout_bits_per_byte": last.get("bits_per_byte"),
               "step": last.get("step"), "steps": [r.get("step") for r in evals],
               "heldout_kl_by_step": [r.get("kl") for r in evals], "seconds": run["seconds"]}
    extra = {key: value for key, value in run.items() if key not in ("label", "overrides", "seconds", "eval")}
    return {**figures, **extra}


def run_variants(args, parse, describe, results_json: str, bench: str | None = None) -> dict:
    """Train the recipe's student once per comma-separated spec of args.variants, in OUT/NAME, where
    parse(spec) -> (NAME, flat TrainConfig overrides) and describe(spec, config, run_dir) -> (fields
    for the run's record, a label among them; text for its printed line). OUT/results_json is
    rewritten after every run, so an interrupted call keeps the runs it finished, and with
    args.resume the next call keeps those whose overrides are the same instead of training them
    again; with `bench`, each run it trains also appends a row `bench/NAME` to args.results. With
    args.jobs > 1 up to that many runs train side by side, each in a process of its own (`_train_all`),
    and each run's record says so (`jobs`): their seconds are then not those of a run alone."""
    base = recipe_train_config(load_bench_recipe(args.recipe), cache=args.cache, steps=args.steps,
                               eval_every=args.eval_every)
    flat = base.to_flat()
    results = {"command": " ".join(sys.argv), "config": {k: str(v) for k, v in flat.items()}, "runs": {}}
    rows = Results(bench=bench, path=args.results) if bench else None
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = (json.loads((args.out / results_json).read_text())
               if getattr(args, "resume", False) and (args.out / results_json).exists() else {"runs": {}})
    jobs = getattr(args, "jobs", 1)
    order, runs, todo = [], {}, []
    for spec in args.variants.split(","):
        name, kw = parse(spec)
        order.append(name)
        kept = earlier["runs"].get(name)
        same = kept is not None and kept["overrides"] == json.loads(json.dumps(kw))
        if same and earlier["config"] == results["config"]:
            runs[name] = kept
            print(f"{kept['label']}: kept from {args.out / results_json} (--resume)", flush=True)
        else:
            todo.append((spec, name, kw, base.with_flat(out=str(args.out / name), **kw)))
    for (spec, name, kw, config), (seconds, teacher_ce, teacher_bpb) in _train_all(todo, jobs):
        fields, text = describe(spec, config, args.out / name)
        run = runs[name] = {**fields, "overrides": kw, "seconds": seconds, "teacher_heldout_ce": teacher_ce,
                            "teacher_bits_per_byte": teacher_bpb, **({"jobs": jobs} if jobs > 1 else {}),
                            "eval": metric_rows(args.out / name, "eval")}
        last = run["eval"][-1]
        print(f"{run['label']}: step {last['step']} held-out KL {last['kl']:.4f} CE {last['ce']:.4f}{text}", flush=True)
        results["runs"] = {name: runs[name] for name in order if name in runs}
        (args.out / results_json).write_text(json.dumps(results, indent=2))
        if rows is not None:
            rows.add(name, run_row(run), {"label": run["label"], "overrides": kw, "train_config": config.to_flat()})
    results["runs"] = {name: runs[name] for name in order if name in runs}
    return results


def _train_one(config, threads: int | None = None) -> tuple[float, float, float | None]:
    """Train `config`; (wall seconds, the teacher's held-out CE and bits per byte). threads: torch's
    CPU threads for it (a run in a process of its own shares the host's cores)."""
    import time

    import torch

    from student.trainer import train

    if threads is not None:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    report = train(config)
    return time.perf_counter() - start, report.teacher_eval.ce, report.teacher_eval.bits_per_byte


def _train_all(todo: list[tuple], jobs: int):
    """Yield (item, _train_one's result) for each (spec, name, overrides, config) of `todo`: one after
    another in this process with jobs 1, else up to `jobs` at once, each in a fresh (spawned) process
    with the host's cores shared out, in the order they finish. Small students leave a GPU mostly
    idle, so side by side they finish sooner."""
    if jobs <= 1:
        for item in todo:
            yield item, _train_one(item[3])
        return
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_train_one, item[3], threads): item for item in todo}
        for future in as_completed(futures):
            yield futures[future], future.result()
