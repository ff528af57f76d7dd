"""On-policy rounds: a recipe's [rounds] section (`RoundsConfig`), run after its [train] run.

Round r (1 .. count) takes the student of round r - 1 (round 0: the recipe's own trained student)
through three stages, each a command of its own and each resumable:

  1. generate   the student samples completions for the round's prompts (pipelines/generate)
  2. score      the teacher scores them into the round's cache (stage one on a generated corpus)
  3. train      the student trains `steps` more steps from its weights on the round's cache mixed
                with the earlier rounds' and the recipe's own caches (`static_weight` is the share
                of the recipe's caches, the rest spread evenly over the rounds' caches so far), with
                `objective` (reverse_kl: on the generated rows; the static rows keep forward_kl)

Layout under the recipe's [train] out: rounds/<r>/generated, rounds/<r>/cache and rounds/<r>/run
(a run directory like any other: `distill runs OUT` lists the rounds beside the first run). Every
round's corpus, cache and student is kept. A rerun of the recipe skips what is complete (a finished
run, a complete corpus or cache: neither model is loaded for them) and resumes what was cut short,
so a kill at any stage loses at most that stage's unfinished shard or steps. The stages run one
after another in one process and each frees its model before the next loads one: the teacher and
the student are never in memory at the same time.

Each round's sampling seed is the [rounds] seed plus the round, so rounds draw different samples.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from distill.configs import check_types, option, require

__all__ = ["RoundsConfig", "RoundPaths", "round_paths", "run_rounds"]


@dataclass
class RoundsConfig:
    """A recipe's [rounds]: how many on-policy rounds follow its run, and what each does."""

    count: int = option(2, "Rounds after the recipe's run (each: generate, score, train).")
    prompts: str | None = option(None, "The prompts: a .jsonl file or corpus files/folders (distill generate "
                                       "--prompts); default: the recipe's [corpus] paths.")
    prompt_tokens: int = option(32, "A corpus document's first tokens taken as its prompt.")
    max_prompts: int = option(32, "Prompts a round samples for.")
    samples_per_prompt: int = option(2, "Completions per prompt.")
    max_new_tokens: int = option(64, "Longest completion, in tokens.")
    temperature: float = option(1.0, "Sampling temperature (1: the student's own distribution).")
    top_p: float = option(1.0, "Nucleus sampling's p (1: the whole vocabulary).")
    seed: int = option(0, "Seed of round 1's draws; round r uses seed + r - 1.")
    steps: int = option(20, "Training steps per round.")
    objective: Literal["forward_kl", "reverse_kl", "jsd"] = option(
        "reverse_kl", "The rounds' training objective (reverse_kl: on the generated rows; jsd: on every row).")
    beta: float = option(0.5, "--beta of the jsd objective, in (0, 1).")
    static_weight: float = option(0.5, "Share of the recipe's own (static) caches in each round's mixture; the "
                                       "rounds' caches share the rest evenly.")
    ratio_clip: float | None = option(None, "--ratio-clip of the reverse-KL objective (default: none).")

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("count", "prompt_tokens", "max_prompts", "samples_per_prompt", "max_new_tokens", "steps"):
            require(name, getattr(self, name), getattr(self, name) >= 1, "an integer >= 1")
        require("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature > 0,
                "a number > 0")
        require("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]")
        require("seed", self.seed, self.seed >= 0, "an integer >= 0")
        require("static_weight", self.static_weight, 0 <= self.static_weight < 1,
                "in [0, 1) (the rounds' caches need a share)")
        require("ratio_clip", self.ratio_clip,
                self.ratio_clip is None or (math.isfinite(self.ratio_clip) and self.ratio_clip >= 1),
                "a finite number >= 1, or leave it out")
        require("beta", self.beta, 0 < self.beta < 1, "in (0, 1)")


@dataclass(frozen=True)
class RoundPaths:
    generated: Path
    cache: Path
    run: Path


def round_paths(train_out: str | Path, r: int) -> RoundPaths:
    root = Path(train_out) / "rounds" / str(r)
    return RoundPaths(root / "generated", root / "cache", root / "run")


def mixture_weights(static_caches: int, static_weight: float, rounds_so_far: int) -> list[float]:
    """The shares of the recipe's caches (static_weight, evenly) and of the rounds' caches so far
    (the rest, evenly), in that order."""
    return ([static_weight / static_caches] * static_caches
            + [(1 - static_weight) / rounds_so_far] * rounds_so_far)


def run_rounds(rounds: RoundsConfig, first, caches: list, progress: bool = True,
               on_stage: Callable[[int, str], None] | None = None) -> list[RoundPaths]:
    """Run (or resume) `rounds` after the run of TrainConfig `first` finished, over the recipe's
    caches (their StageOneConfig: `caches`; the first's teacher and corpus settings score and prompt
    the rounds). on_stage(r, stage) is called after each stage ("generate", "score", "train")
    completes (tests stop the process there). Returns every round's paths."""
    import dataclasses

    from pipelines.generate import GenerateConfig, generate
    from pipelines.stage_one import cache_teacher
    from student.trainer import train

    stage_one = caches[0]
    static = [str(c.cache.out) for c in caches]
    policy, done = Path(first.out), []
    for r in range(1, rounds.count + 1):
        paths = round_paths(first.out, r)
        prompts = rounds.prompts or str(stage_one.corpus.paths[0])
        generate(GenerateConfig(
            policy=policy, out=paths.generated, prompts=prompts, prompt_tokens=rounds.prompt_tokens,
            max_prompts=rounds.max_prompts, samples_per_prompt=rounds.samples_per_prompt,
            max_new_tokens=rounds.max_new_tokens, temperature=rounds.temperature, top_p=rounds.top_p,
            seed=rounds.seed + r - 1, device=first.device, file_glob=stage_one.corpus.file_glob),
            progress=progress)
        _free()
        _stage(on_stage, r, "generate")
        seq_len = rounds.max_new_tokens + _longest_prompt(paths.generated)
        cache_teacher(dataclasses.replace(
            stage_one, corpus=dataclasses.replace(stage_one.corpus, paths=(paths.generated,), seq_len=seq_len,
                                                  max_sequences=None),
            cache=dataclasses.replace(stage_one.cache, out=paths.cache)), progress=progress)
        _free()
        _stage(on_stage, r, "score")
        caches = static + [str(round_paths(first.out, i).cache) for i in range(1, r + 1)]
        config = first.with_flat(
            out=str(paths.run), student=str(_student_folder(policy)), teacher=None, num_layers=None,
            cache=caches, cache_weights=mixture_weights(len(static), rounds.static_weight, r),
            steps=rounds.steps, objective=rounds.objective, ratio_clip=rounds.ratio_clip, beta=rounds.beta)
        if not (paths.run / "student").is_dir():  # a finished run is kept
            train(config, progress=progress)
            _free()
        _stage(on_stage, r, "train")
        policy = paths.run
        done.append(paths)
    return done


def _student_folder(run_or_folder: Path) -> Path:
    """A finished run's final student (an HF folder)."""
    return run_or_folder / "student" if (run_or_folder / "run.json").is_file() else run_or_folder


def _longest_prompt(generated: Path) -> int:
    from pipelines.generate import read_generated

    _, records = read_generated(generated)
    return max(len(r["prompt_ids"]) for r in records)


def _free() -> None:
    """Give the stage's model back before the next stage loads one."""
    gc.collect()


def _stage(on_stage, r: int, stage: str) -> None:
    if on_stage is not None:
        on_stage(r, stage)
