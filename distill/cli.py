"""The `distill` command. Thin: each command parses, builds a config, calls one library function."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from distill.cli_options import config_parameters, option_error, with_parameters
from distill.errors import DistillUserError
from pipelines.stage_one import DEFAULT_CACHE_DIR, StageOneConfig  # torch-free: the configs, for the options
from student.train_config import TrainConfig  # torch-free: only the config, for the option defaults

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Offline knowledge distillation: cache a teacher's top-k once, train students against it.",
)


# Stage-one config fields only a recipe sets: cache-teacher has no option for them.
_RECIPE_ONLY = {"add_eos", "exclude_dirs", "writer_threads"}


def _stage_one_option_error(error) -> DistillUserError:
    """A stage-one ConfigError named as the cache-teacher option that sets the field (its first flag: `-k`,
    `--corpus`); a recipe-only field keeps its config name."""
    if error.field in _RECIPE_ONLY:
        return error
    return option_error(error, StageOneConfig.flat_fields())


def _cache_teacher_own_options(
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """cache-teacher's option beside its config's."""


@app.command("cache-teacher")
@with_parameters(
    # no --corpus: None, and the command leaves the corpus to the config (the help names it, not this machine's path)
    config_parameters(StageOneConfig.flat_fields(), skip=_RECIPE_ONLY,
                      defaults={"out": str(DEFAULT_CACHE_DIR), "paths": None}),
    inspect.signature(_cache_teacher_own_options, eval_str=True).parameters.values(),
)
def cache_teacher(**values) -> None:
    """Run a teacher once over a corpus and write its top-k (or sampled) next-token log-probs to a cache.

    Examples:

      distill cache-teacher --max-sequences 64 --seq-len 512 --out caches/stdlib

      distill cache-teacher --model ./Qwen2.5-0.5B --corpus data/ --glob '*.jsonl' --format jsonl -k 64 --out caches/qwen

      distill cache-teacher --backend vllm --max-sequences 16 --out caches/vllm

      distill cache-teacher --targets sampled --samples 12 --max-sequences 64 --out caches/sampled

      distill cache-teacher --targets topk+sampled --k 8 --samples 12 --max-sequences 64 --out caches/hybrid

      torchrun --nproc-per-node 8 -m distill cache-teacher --model ./Qwen2.5-7B --out caches/qwen   # one rank per GPU

      distill cache-teacher ... --num-workers 16 --worker-index $SLURM_ARRAY_TASK_ID; then distill cache-merge caches/qwen --num-workers 16

      distill cache-teacher --model ./Qwen2.5-7B --out /shared/caches/qwen --executor ray --ray-address 10.0.0.1:6379   # one task per shard

    Re-running the same command after an interruption resumes where it stopped (also at another number of workers or ranks); on a complete cache it checks every shard and rebuilds exactly the damaged ones.
    """
    from distill.configs import ConfigError
    from pipelines.stage_one import cache_teacher as run

    quiet, out, num_workers = values.pop("quiet"), values["out"], values["num_workers"]
    if not values["paths"]:
        del values["paths"]  # no --corpus: the config's default corpus
    try:
        config = StageOneConfig.from_flat(**values)
        report = run(config, progress=not quiet)
    except ConfigError as e:
        raise _stage_one_option_error(e) from None
    if report.already_complete:
        typer.echo(f"{out}: cache {report.cache_id} is already complete (every shard checked); nothing to do")
        return
    done = (f"repaired: rebuilt {len(report.repaired_shards)} damaged shard(s) ({', '.join(report.repaired_shards[:5])})"
            if report.repaired_shards else "complete")
    if report.worker is not None and not report.finalized:
        index, count = report.worker
        merge = (f"; when every worker is done: distill cache-merge {out} --num-workers {count}"
                 if num_workers > 1 else "; rank 0 wrote the manifest")
        done = f"worker {index} of {count} wrote its shards{merge}"
    typer.echo(
        f"{out}: cache {report.cache_id} {done}; scored {report.tokens_scored:,} tokens in "
        f"{report.wall_seconds:.1f} s ({report.tokens_per_second:,.0f} tok/s; teacher {report.teacher_seconds:.1f} s, "
        f"writer {report.writer_seconds:.1f} s in the background, {report.resumed_shards} shards kept)"
    )


@app.command("cache-merge")
def cache_merge(
    cache: str = typer.Argument(..., help="Cache directory or URL the workers of a job array wrote."),
    num_workers: Optional[int] = typer.Option(None, help="The array's --num-workers, so a missing shard is named with the worker that owns it."),
) -> None:
    """Write the manifest of a cache built by a job array (cache-teacher --num-workers W --worker-index I), once every shard is there; every shard is read once to record its checksum.

    A missing shard is refused in one line naming it and its worker. Running cache-teacher once more with the same arguments and no --num-workers does the same and also scores any missing shard.

    Example:

      distill cache-merge caches/qwen --num-workers 16
    """
    from distill.configs import ConfigError
    from teacher_cache.build import merge_cache

    try:
        cache_id, already = merge_cache(cache, num_workers=num_workers)
    except ConfigError as e:
        raise e.as_option() from None
    typer.echo(f"{cache}: cache {cache_id} " + ("is already complete; nothing to do" if already else "complete"))


@app.command("cache-stats")
def cache_stats(
    cache: str = typer.Argument(..., help="Cache directory or URL (s3://, gs://, file://)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plot: Optional[Path] = typer.Option(None, help="Also write an image of the distributions (needs matplotlib; .png, .pdf, .svg, ...; no suffix: .png)."),
) -> None:
    """Inspect a cache: size, compression, teacher perplexity, top-k mass, entropy, rank histogram (sampled caches: unique ids per position; topk+sampled: unique ids drawn outside the top-k).

    Examples:

      distill cache-stats caches/default

      distill cache-stats caches/default --json > stats.json

      distill cache-stats caches/default --plot stats.png
    """
    from teacher_cache import stats as cache_stats_lib

    plot_file = None if plot is None else cache_stats_lib.plot_file(plot, "cache-stats")  # refused before the pass
    stats = cache_stats_lib.cache_stats(cache)
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
    else:
        typer.echo(cache_stats_lib.render_table(stats))
    if plot_file is not None:
        written = cache_stats_lib.plot(stats, plot_file)
        typer.echo(f"wrote {written}", err=True)


@app.command("verify")
def verify(cache: str = typer.Argument(..., help="Cache directory or URL (s3://, gs://, file://).")) -> None:
    """Check every shard's size and checksum, the manifest's totals and the stored tokenizer files; name the first bad shard and say how to repair it.

    Example:

      distill verify caches/default
    """
    from teacher_cache.verify import verify_cache

    report = verify_cache(cache)
    if not report.ok:
        raise DistillUserError(report.message)
    typer.echo(report.message)


@app.command("add-tokenizer")
def add_tokenizer(
    cache: str = typer.Argument(..., help="Cache directory or URL (s3://, gs://, file://)."),
    teacher: Path = typer.Argument(..., help="The teacher folder the cache was built from (its tokenizer files suffice)."),
) -> None:
    """Store the teacher's tokenizer files in a cache built without them (or restore damaged ones), so the cache alone says what text its token ids stand for and can teach students of other tokenizers; refused unless the tokenizer is the cache's. The shards and cache_id do not change.

    Example:

      distill add-tokenizer caches/qwen ./Qwen2.5-0.5B
    """
    from teacher_cache.tokenizer_files import add_tokenizer as run

    record, replaced = run(cache, teacher)
    typer.echo(f"{cache}: {'replaced' if replaced else 'stored'} the tokenizer files of {teacher} in tokenizer/ "
               f"({', '.join(sorted(record['files']))}); cache_id unchanged")


@app.command("import-gguf")
def import_gguf(
    gguf: Path = typer.Argument(..., help="GGUF file."),
    out: Path = typer.Argument(..., help="HF folder to create."),
    dtype: str = typer.Option("float32", help="float32 (exact dequantised weights), bfloat16 or float16."),
) -> None:
    """Turn a GGUF file into an HF folder (config.json, safetensors, tokenizer) for any backend.

    Example:

      distill import-gguf SmolLM2-135M-Instruct.Q4_1.gguf teachers/smollm2
    """
    from teacher_cache.gguf_import import import_gguf as run

    typer.echo(run(gguf, out, dtype=dtype))


def _train_own_options(
    resume_from: Optional[int] = typer.Option(None, "--resume-from", help="Continue from the kept checkpoint of this step instead of the latest (newer ones are deleted)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """train-student's options beside its config's (every TrainConfig field is an option: `config_parameters`)."""


def _plan_own_options(
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (what --out saves) instead of a table."),
    plan_out: Optional[Path] = typer.Option(None, "--out", "-o", help="Save the plan to this JSON file (for train-student --offload PLAN.json); unlike train-student's --out, not a run directory."),
    time_limit: float = typer.Option(60.0, "--time-limit", help="Seconds the solver may take in all; past it, the best plan found so far."),
) -> None:
    """plan's options beside the training options that change the step it plans for."""


def _own(options) -> list:
    return list(inspect.signature(options, eval_str=True).parameters.values())


# Options of a run that do not change the step a plan is made for (or are the run's own: --out, --offload).
_NOT_PLANNED = {"out", "offload", "eval_every", "eval_sequences", "save_every", "log_every", "keep_checkpoints"}


@app.command("train-student")
@with_parameters(config_parameters(TrainConfig.flat_fields()), _own(_train_own_options))
def train_student(**values) -> None:
    """Train a student against a teacher cache; the teacher itself is never loaded.

    Examples:

      distill train-student --cache caches/default --num-layers 4 --steps 200 --out runs/s4

      distill train-student --cache caches/qwen --student ./qwen-0.5b-pruned --batch-size 4 --grad-accum 8 --out runs/q

      distill train-student --cache caches/default --num-layers 4 --ce-weight 1.0 --out runs/ce-only

      distill train-student --cache caches/default --num-layers 4 --optimizer foam --foam-level 3 --out runs/foam

      distill train-student --cache caches/default --num-layers 4 --sparse-ffn --l1 2e-5 --out runs/sparse

      distill train-student --cache caches/default --num-layers 4 --tokenizer ./my-bpe --ce-weight 0.5 --out runs/bpe   # another tokenizer

      distill train-student --cache caches/code --cache caches/prose --cache-weights 0.7,0.3 --num-layers 4 --out runs/mix

      distill train-student --ensemble caches/qwen-7b,caches/llama-8b --ensemble-weights 0.5,0.5 --student ./small --out runs/ens

      distill train-student --cache caches/long-1m --student ./qwen-0.5b --batch-size 1 --chunk-tokens 16384 --kv-offload --out runs/long

      distill train-student --cache caches/qwen --student ./qwen-14b --offload auto --gpu-memory 40GiB --out runs/big

      distill train-student --cache caches/long-1m --student ./qwen-3b --batch-size 1 --offload auto --chunk-candidates 8192,16384,32768 --out runs/long-planned

      torchrun --nproc-per-node 8 -m distill train-student --cache caches/qwen --student ./qwen-3b --batch-size 8 --out runs/fsdp

    Rerunning the same command after an interruption continues from the last checkpoint (under torchrun at any number of processes).

    A rerun may change the schedule and optimizer settings (--lr, --warmup-steps, --clip-grad, more --steps, ...): the run continues under them and metrics.jsonl records each change.
    """
    from distill.configs import ConfigError
    from student.trainer import train

    resume_from, quiet = values.pop("resume_from"), values.pop("quiet")
    try:
        config = _train_config(values)
        report = train(config, progress=not quiet, resume_from=resume_from)
    except ConfigError as e:
        raise e.as_option() from None
    resumed = f" (resumed from step {report.resumed_from})" if report.resumed_from else ""
    typer.echo(f"{values['out']}: {_count(report.steps, 'step')}{resumed}; student saved to {report.student_dir}")
    per_cache = [(f"{label} {place}", result) for place, (_, after, teacher) in enumerate(report.cache_evals)
                 for label, result in (("teacher", teacher), ("after, cache", after))]
    typer.echo(_eval_table({"teacher": report.teacher_eval, "before": report.initial_eval, "after": report.final_eval,
                            "per_cache": per_cache}))
    for place, (cache, _, _) in enumerate(report.cache_evals):
        mean = "against the teachers' mixture" if values.get("ensemble") else "their mean at --cache-weights"
        typer.echo(f"cache {place}: {cache}" + (f" (the rows above the caches': {mean})" if place == 0 else ""))


def _train_config(options: dict) -> TrainConfig:
    """TrainConfig from train-student's flat options, after checking where the student starts (a
    ConfigError from the config is the caller's to name as an option)."""
    from pipelines.defaults import default_teacher_dir

    options = dict(options)
    if options["student"] is None and options["num_layers"] is None:
        raise DistillUserError("say where the student starts: --student HF_FOLDER, or --num-layers N to prune the teacher")
    if options["student"] is not None and (options["teacher"] is not None or options["num_layers"] is not None):
        raise DistillUserError("give either --student or --teacher/--num-layers, not both")
    if options["student"] is None:
        options["teacher"] = options["teacher"] or default_teacher_dir()
    options = {name: str(value) if isinstance(value, Path) else value for name, value in options.items()}
    return TrainConfig.from_flat(**options)


@app.command("plan")
@with_parameters(config_parameters(TrainConfig.flat_fields(), skip=_NOT_PLANNED), _own(_plan_own_options))
def plan(**values) -> None:
    """Profile the training step train-student would run and solve for the fastest offload plan under the memory budgets (a mixed-integer program, LazyTrain-style).

    Per decoder layer: keep its activations, recompute them, or offload its input to host memory; keep its weights resident or stream them; and the prefetch depth and where the optimizer update runs. On a CPU-only machine it profiles the CPU.

    Examples:

      distill plan --cache caches/default --num-layers 4 --gpu-memory 2GiB --host-memory 8GiB

      distill plan --cache caches/qwen --student ./qwen-14b --batch-size 1 --seq-len 8192 --gpu-memory 40GiB --out plan.json

      distill plan --cache caches/qwen --student ./qwen-14b --optimizer foam --json

      distill plan --cache caches/long-1m --student ./qwen-3b --batch-size 1 --chunk-candidates 8192,16384,32768 --gpu-memory 80GiB

    Train with a saved plan: distill train-student ... --offload plan.json (or --offload auto to plan and train in one go). A budget no plan meets is refused with the smallest one that works. With --chunk-tokens the step measured is chunk-recurrent (a chunk's layers, pass 1, the key/value pages; weights resident) and the plan holds the chunk size and the pages resident on the GPU. With --chunk-candidates the step is measured at each chunk size, each is priced with its pages resident and (on a GPU) offloaded in page sets of a few sizes, and the table lists every pair with its predicted step time and peaks, the chosen one marked; train-student --offload PLAN.json then trains with the plan's chunk size and pages.
    """
    from distill.configs import ConfigError
    from distill.devices import resolve_device
    from student.planner.report import plan_table
    from student.planner.solve import make_plan

    as_json, plan_out, time_limit = values.pop("as_json"), values.pop("plan_out"), values.pop("time_limit")
    try:
        # `out` is the run directory of a training run; profiling writes nothing there.
        config = _train_config({**values, "out": "unused-by-plan"})
        made, costs = make_plan(config, time_limit_s=time_limit)
    except ConfigError as e:
        raise e.as_option() from None
    if plan_out is not None:
        made.save(plan_out)
    if as_json:
        typer.echo(json.dumps(made.to_dict(), indent=2))
    else:
        typer.echo(plan_table(made, costs, device=resolve_device(config.device)))
    if plan_out is not None:
        typer.echo(f"wrote {plan_out}", err=True)


@app.command("eval")
def evaluate(
    path: Path = typer.Argument(..., metavar="run_or_student",
                                help="A run directory (from train-student), or a student HF folder with --cache."),
    cache: Optional[Path] = typer.Option(None, "--cache", "-c", help="Teacher cache (default: the run's)."),
    heldout: Optional[int] = typer.Option(None, help="Held-out sequences (default: the run's split)."),
    tokenizer: Optional[Path] = typer.Option(None, help="The student's tokenizer folder (default: the student folder, or the run's)."),
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", help="Run long sequences in chunks of N tokens against a paged key/value store (default: as the run trained; whole sequences for a folder)."),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="Teacher HF folder (or 'default': the embedded SmolLM2-135M-Instruct) to run on the held-out sequences: adds the exact full-vocabulary KL and the calibration error. Its tokenizer must be the cache's."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N: where the student (and --teacher) run."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Held-out KL to the teacher, cross-entropy, perplexity, top-1 agreement and bits per byte, beside the teacher's own.

    The KL is over the teacher's top-k plus one tail category: a lower bound of the full-vocabulary KL (on a sampled cache: the cache's unbiased estimate of it).

    With --teacher the teacher runs on the same held-out sequences: the exact full-vocabulary KL (teacher and student at the cache's temperature) and the expected calibration error of the top-1 (15 equal-width bins, against the actual next token), in the table and in --json as full_vocab_kl and calibration_error; caches of any kind are then compared on one ground truth.

    Bits per byte (the cross-entropy in bits over the UTF-8 bytes of the predicted tokens) compares students of different tokenizers; it needs a byte-level BPE or byte-fallback tokenizer, and shows "-" for a row recorded without it.

    The cache must be of the student's tokenizer. For a sparse FFN (ReLU-gated) student also the per-layer sparsity and dead neurons on the held-out sequences, and for a run directory the kernel's overflow / fallback rows in training.

    Examples:

      distill eval runs/quickstart

      distill eval runs/quickstart --teacher default --json

      distill eval runs/quickstart/student --cache caches/quickstart --heldout 16 --json
    """
    from distill.configs import ConfigError
    from pipelines.teacher_eval import EvalTeacher
    from student.evaluate import evaluate_run_or_folder
    from student.long_context.config import LongContextConfig

    try:
        if chunk_tokens is not None:  # train-student's rule, before a run's own value stands in for a 0
            LongContextConfig(chunk_tokens=chunk_tokens)
        results = evaluate_run_or_folder(path, cache=cache, heldout=heldout, tokenizer=tokenizer,
                                         chunk_tokens=chunk_tokens, device=device, progress=not quiet,
                                         teacher=EvalTeacher(teacher) if teacher is not None else None)
    except ConfigError as e:
        raise e.as_option() from None
    typer.echo(json.dumps(_jsonable_eval(results), indent=2) if as_json else _eval_table(results))


def _generate_own_options(
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """generate's option beside its config's."""


def _generate_fields():
    from pipelines.generate import GenerateConfig

    return GenerateConfig.flat_fields()


@app.command("generate")
@with_parameters(config_parameters(_generate_fields(), defaults={"prompts": None}), _own(_generate_own_options))
def generate(**values) -> None:
    """Sample completions from a student into a generated corpus, which cache-teacher then scores (on-policy rounds).

    Each record holds the prompt, the completion and the sampler's log-probability of each sampled token; generation.json names the policy that wrote it (run, step, weights hash).

    Examples:

      distill generate --policy runs/s4 --max-prompts 64 --samples-per-prompt 4 --max-new-tokens 128 --out gen/round1

      distill generate --policy runs/s4 --prompts prompts.jsonl --temperature 0.8 --top-p 0.95 --seed 1 --out gen/chat

      distill generate --policy ./student --backend vllm --prompts data/ --glob '*.md' --prompt-tokens 32 --out gen/md

    Rerunning the same command after an interruption keeps the finished shards and writes the rest; other settings for the same --out are refused.
    """
    from distill.configs import ConfigError
    from pipelines.generate import GenerateConfig
    from pipelines.generate import generate as run

    quiet = values.pop("quiet")
    if values["prompts"] is None:
        del values["prompts"]  # the config's default: the standard library
    try:
        report = run(GenerateConfig(**values), progress=not quiet)
    except ConfigError as e:
        raise option_error(e, GenerateConfig.flat_fields()) from None
    kept = f", {report.shards_skipped} kept" if report.shards_skipped else ""
    typer.echo(f"{report.out}: {report.shards_written} shard(s) written{kept}; {report.samples:,} samples, "
               f"{report.tokens_generated:,} tokens ({report.tokens_per_second:,.0f} tokens/s sampling)")


@app.command("run")
def run_recipe(
    recipe: Path = typer.Argument(..., help="Recipe TOML file (see pipelines/recipes/quickstart.toml)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the recipe and list its runs (a sweep's points) and what a run would do to each; nothing runs."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """Run a recipe: cache the teacher (or reuse a complete matching cache), train, evaluate.

    A [sweep] section ("train.lr" = [3e-4, 1e-3], "train.optimizer" = ["adamw", "foam"], "student.num_layers" = [4, 6]) trains every combination on the one cache, one after another, each into a run directory under [train] out named after its settings.

    Examples:

      distill run pipelines/recipes/quickstart.toml

      distill run my_recipe.toml   # a copy with other teacher, corpus, student or steps

      distill run sweep.toml --dry-run   # list the sweep's points

    Rerunning resumes: a finished cache is reused and training continues from its last checkpoint; in a sweep, finished points are skipped.
    """
    from pipelines.recipe import load_recipe, run_state

    loaded = load_recipe(recipe)
    if dry_run:
        todo = {"finished": "skip (finished)", "started": "resume", "new": "train"}
        for point in loaded.points or [loaded]:
            typer.echo(f"{point.name:<40} {point.train['out']}  {todo[run_state(point.train['out'])]}")
        return
    _run_and_report(loaded, quiet)


@app.command("runs")
def runs(
    folders: Optional[list[Path]] = typer.Argument(None, help="Folders holding run directories (searched below; default: runs)."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Only the runs of this cache id (a prefix will do)."),
    wide: bool = typer.Option(False, "--wide", help="The settings that differ as columns of the table, and those every run shares below it."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """A table of the runs under the folders, each named by its directory: steps trained, the checkpoint a rerun resumes from, held-out KL/CE/top-1 (and bits/byte where recorded), tokens/s, optimizer state, status; below it why a run stopped and the settings that differ.

    Status: finished (final student saved), running (its trainer's pid is alive here, or on another host it wrote recently), or stopped with the reason (a non-finite loss, or interrupted after step N) and the step a rerun resumes from.

    Examples:

      distill runs

      distill runs runs/sweep --cache 3f2a9c --json

      distill runs runs/sweep --wide   # each setting that differs in a column of its own
    """
    from pipelines.experiments import find_runs, runs_table

    found = find_runs(folders or [Path("runs")], cache_id=cache)
    typer.echo(json.dumps([r.to_dict() for r in found], indent=2) if as_json else runs_table(found, wide=wide))


@app.command("compare")
def compare(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write curves of training loss and held-out KL against steps and tokens (needs matplotlib; no suffix: .png)."),
    allow_different_caches: bool = typer.Option(False, "--allow-different-caches", help="Show KL, CE, PPL and top-1 of runs over different caches, and plot them (those numbers are to different teacher targets)."),
    wide: bool = typer.Option(False, "--wide", help="The settings that differ as columns of the table, and those every run shares below it."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """The runs' held-out metrics side by side, one line a run named by its directory, the settings that differ listed below.

    Bits per byte compares runs over different caches of one corpus, and students of different tokenizers; KL, CE, PPL and top-1 of runs over different caches show "-" (they are per token, against different teacher targets), and --plot refuses them, unless --allow-different-caches.

    Examples:

      distill compare runs/sweep/lr=0.001,optimizer=adamw runs/sweep/lr=0.001,optimizer=foam

      distill compare runs/sweep/* --plot compare.png
    """
    from pipelines.experiments import compare_runs, compare_table, plot_compare
    from teacher_cache.stats import plot_file

    plot_to = None if plot is None else plot_file(plot, "compare")  # refused before anything is printed
    found = compare_runs(run_dirs, allow_different_caches=allow_different_caches, plot=plot_to is not None)
    typer.echo(json.dumps([r.to_dict() for r in found], indent=2) if as_json
               else compare_table(found, wide=wide, allow_different_caches=allow_different_caches))
    if plot_to is not None:
        typer.echo(f"wrote {plot_compare(found, plot_to)}", err=True)


@app.command("quickstart")
def quickstart(quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars.")) -> None:
    """The embedded default end to end: SmolLM2-135M-Instruct on the standard library, a pruned student.

    Writes caches/quickstart and runs/quickstart in the current directory; a few minutes on a CPU.
    Same as `distill run pipelines/recipes/quickstart.toml`.

    Example:

      distill quickstart
    """
    from pipelines.recipe import builtin_recipe, load_recipe

    _run_and_report(load_recipe(builtin_recipe("quickstart")), quiet)


def _run_and_report(recipe, quiet: bool) -> None:
    from pipelines.recipe import run_recipe as run

    report = run(recipe, progress=not quiet)
    reused = " (reused: complete and matching)" if report.cache_reused else ""
    caches = ", ".join(map(str, report.cache_dirs))
    typer.echo(f"cache{'s' if len(report.cache_dirs) > 1 else ''} {caches}{reused}: {report.wall_seconds['cache']:.0f} s; "
               f"training {report.run_dir}: {report.wall_seconds['train']:.0f} s")
    if report.points:
        from pipelines.experiments import find_runs, runs_table

        for point in report.points:
            typer.echo(f"{point.name}: {point.state} ({point.seconds:.0f} s)")
        typer.echo(runs_table(find_runs([report.run_dir])))
        return
    typer.echo(_eval_table(report.evaluation))
    if report.rounds:
        from pipelines.experiments import find_runs, runs_table

        typer.echo(f"rounds: {len(report.rounds)} ({report.wall_seconds['rounds']:.0f} s)")
        typer.echo(runs_table(find_runs([report.run_dir])))
    student = report.rounds[-1].run if report.rounds else report.run_dir
    typer.echo(f"student: {student / 'student'} (an HF folder: transformers and vLLM load it)")


def _eval_rows(results: dict) -> list[tuple[str, object]]:
    order = [("teacher (cache)", "teacher"), ("student before", "before"), ("student", "student"), ("student after", "after")]
    return [(label, results[key]) for label, key in order if results.get(key) is not None] + results.get("per_cache", [])


def _eval_table(results: dict) -> str:
    from student.evaluate import BITS_PER_BYTE_NOTE, KL_NOTE

    rows = _eval_rows(results)
    full = any(getattr(r, "full_vocab_kl", None) is not None for _, r in rows)
    bpb = any(getattr(r, "bits_per_byte", None) is not None for _, r in rows)  # "-" in rows without (older ones)
    kl_head = "KL (top-k bound)" if results.get("kl_note", KL_NOTE) == KL_NOTE else "KL (estimate)"
    lines = [f"{'held-out':<16} {kl_head:>16} {'CE':>7} {'PPL':>9} {'top-1 agree':>11} {'tokens':>8}"
             + (f" {'bits/byte':>9}" if bpb else "") + (f" {'full-vocab KL':>13} {'ECE':>7}" if full else "")]
    fmt = lambda value, width, spec: f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"
    for label, r in rows:
        lines.append(f"{label:<16} {r.kl:>16.4f} {r.ce:>7.3f} {_ppl_text(r.ppl):>9} {r.top1:>11.3f} {r.tokens:>8,}"
                     + (f" {fmt(r.bits_per_byte, 9, '.4f')}" if bpb else "")
                     + (f" {fmt(r.full_vocab_kl, 13, '.4f')} {fmt(r.calibration_error, 7, '.4f')}" if full else ""))
    lines.append(_table_note(results.get("kl_note", KL_NOTE)))
    if bpb:
        lines.append(_table_note(results.get("bits_per_byte_note", BITS_PER_BYTE_NOTE)))
    if full:
        lines.append(_table_note(results["full_vocab_note"]) + "; the teacher row's ECE is the --teacher's own")
    for label, r in _eval_rows(results):
        if getattr(r, "ffn_sparsity", None) is not None:
            percent = lambda values: " ".join(f"{100 * v:.1f}" for v in values)
            lines.append(f"{label}: FFN sparsity per layer (%) {percent(r.ffn_sparsity)}; "
                         f"dead neurons (%) {percent(r.ffn_dead)}")
    run = results.get("run")
    if run and run.get("optimizer_state_bytes") is not None:
        lines.append(f"run: {_count(run['steps'], 'step')}, optimizer {run['optimizer']}, "
                     f"state {run['optimizer_state_bytes'] / 2**20:,.1f} MiB")
    if run and run.get("ffn_overflow_rows") is not None:
        penalty = f"L1 {run['l1']:g}" if run.get("sparse_ffn") else "no L1 penalty"
        lines.append(f"run: sparse FFN, {penalty}; kernel overflow rows {sum(run['ffn_overflow_rows']):,}, "
                     f"fallback rows {sum(run['ffn_fallback_rows']):,} (all layers, all logged steps)")
    return "\n".join(lines)


def _ppl_text(ppl: float) -> str:
    """Perplexity in at most 9 characters (the column's width): an untrained student's is in the millions."""
    return f"{ppl:.2f}" if ppl < 1e6 else f"{ppl:.3e}"


# The notes name the JSON's fields (`kl`, `full_vocab_kl`); under the table they begin with its columns' names.
_NOTE_SUBJECTS = {"kl": "KL", "full_vocab_kl": "Full-vocab KL", "bits_per_byte": "Bits/byte"}


def _table_note(note: str) -> str:
    subject, _, rest = note.partition(" ")
    return f"{_NOTE_SUBJECTS.get(subject, subject[:1].upper() + subject[1:])} {rest}"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _jsonable_eval(results: dict) -> dict:
    import dataclasses

    from student.evaluate import KL_NOTE

    jsonable = {key: dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for key, r in results.items()}
    return {"kl_note": KL_NOTE, **jsonable}


_USER_ERRORS = (DistillUserError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report a Ctrl-C


class _Interrupted(Exception):
    """A Ctrl-C inside a command, carried past typer (which turns KeyboardInterrupt into a silent exit)."""


def _carry_interrupts(callback):
    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt:
            raise _Interrupted() from None

    run.carries_interrupts = True
    return run


def main() -> None:
    """Entry point: user mistakes print one line and exit 2; an interrupt says how to resume."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for command in app.registered_commands:
        if not getattr(command.callback, "carries_interrupts", False):
            command.callback = _carry_interrupts(command.callback)
    try:
        app()
    except _USER_ERRORS as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except ImportError as e:
        if "pip install" not in str(e):  # a missing optional extra says what to install; else a bug
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (_Interrupted, KeyboardInterrupt):
        typer.echo("interrupted; run the same command again to resume", err=True)
        sys.exit(INTERRUPTED_EXIT)
