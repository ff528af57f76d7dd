"""On-policy rounds against off-policy training on the static cache, on the CPU (issue 44's goal).

From one starting student (the quickstart's: SmolLM2-135M-Instruct pruned to 4 layers, --base-steps
on the quickstart's stdlib cache), the same number of further training steps either
  off: on the static cache alone (forward KL), or
  on:  in --rounds rounds of pipelines/recipes/rounds.toml's kind (the student writes continuations
       of --round-prompts stdlib files, the teacher scores them, the student trains --steps-per-round
       steps with reverse KL on them mixed 0.5 / 0.5 with the static cache).
Each student, and the starting one, is then measured on
  (a) the teacher's mean log-probability per token of the student's own continuations of held-out
      prompts (the first --heldout-prompts files of the stdlib's email package, which no round
      prompts from): two samples each, --new-tokens tokens, temperature 1, a fixed seed; scored
      by the teacher through the generated-corpus cache (its target_logprob on completion rows);
  (b) held-out forward KL and bits per byte on the static cache's own held-out sequences.

    python tests/benchmarks/bench_on_policy.py --work /tmp/onpolicy --seed 0 --results rows.jsonl

A variant of the rounds (--objective, --static-weight, --ratio-clip) starts from the plain run's
start student (run that first) and adds only its `on-<variant>` row.

Rows `on_policy/seed<N>/<start|off|round<r>[-variant]|on[-variant]>` (round<r>: the student after
round r < --rounds; on: after the last): teacher_logprob_per_token (a) and its standard error over
the samples (teacher_logprob_se), reverse_kl_per_token
(log q - log p on (a)'s tokens), heldout_kl and heldout_bits_per_byte (b), steps,
teacher_scored_tokens (the tokens the teacher scored for the training beyond the start: the
static cache's for off, the rounds' caches' for on).
"""

from __future__ import annotations

import argparse
import shutil
import sysconfig
from pathlib import Path

import numpy as np
from harness import Results, add_results_arg

RECIPE = """
name = "on-policy-bench"
[corpus]
seq_len = 256
max_sequences = 96
[cache]
out = "{work}/static"
k = 64
shard_size = 32
[student]
from = "teacher"
num_layers = 4
[train]
out = "{run}"
steps = {base_steps}
batch_size = 4
lr = 1e-3
warmup_steps = 8
heldout = 16
eval_every = {base_steps}
save_every = {base_steps}
seed = {seed}
[rounds]
count = {rounds}
max_prompts = {round_prompts}
prompt_tokens = 32
samples_per_prompt = 2
max_new_tokens = {new_tokens}
steps = {steps_per_round}
objective = "{objective}"
static_weight = {static_weight}
seed = {seed}
{ratio_clip}"""


def on_policy_measures(student: Path, work: Path, name: str, args) -> dict:
    """(a) teacher_logprob_per_token: the teacher's mean log-prob per token of `student`'s continuations
    of the held-out prompts; and reverse_kl_per_token: the mean of log q - log p over those tokens
    (sampled at temperature 1 from the whole vocabulary: the plain estimate of the per-token
    KL(student || teacher) on its own text, which the reverse-KL objective lowers)."""
    from pipelines.generate import GenerateConfig, generate
    from pipelines.stage_one import StageOneConfig, cache_teacher
    from teacher_cache.reader import CacheReader

    prompts = Path(sysconfig.get_paths()["stdlib"]) / "email"
    generate(GenerateConfig(policy=student, prompts=prompts, out=work / f"{name}-gen", prompt_tokens=32,
                            max_prompts=args.heldout_prompts, samples_per_prompt=2, max_new_tokens=args.new_tokens,
                            seed=1234, device="cpu"), progress=False)
    config = StageOneConfig.from_flat(paths=(work / f"{name}-gen",), seq_len=32 + args.new_tokens + 8, k=8,
                                      out=work / f"{name}-scored")
    cache_teacher(config, progress=False)
    reader = CacheReader(work / f"{name}-scored")
    teacher, sampler, per_sample = [], [], []
    for shard in map(reader.load_shard, range(reader.num_shards)):
        rows = shard.loss_mask.astype(bool)
        teacher.append(shard.targets.target_logprob[rows])
        sampler.append(shard.sampler_logprob[rows])
        for start, end in zip(shard.seq_offsets[:-1], shard.seq_offsets[1:]):  # one sample a sequence
            mine = rows[start:end]
            if mine.any():
                per_sample.append(shard.targets.target_logprob[start:end][mine].mean())
    teacher, sampler = np.concatenate(teacher), np.concatenate(sampler)
    return {"teacher_logprob_per_token": float(np.mean(teacher)),
            # the standard error of (a) over samples (tokens of one sample are not independent)
            "teacher_logprob_se": float(np.std(per_sample, ddof=1) / np.sqrt(len(per_sample))),
            "reverse_kl_per_token": float(np.mean(sampler - teacher))}


# (label, the students of its line in step order)
ARMS = (("off-policy (static cache)", ("start", "off")),
        ("on-policy rounds, reverse KL, static 0.5", ("start", "round1", "on")),
        ("on-policy rounds, forward KL (seed 0 only)", ("start", "round1-forward_kl", "on-forward_kl")),
        ("on-policy, reverse KL, static 0.75, clip 2 (the recipe's)", ("start", "round1-w0.75-clip2",
                                                                       "on-w0.75-clip2")))


def plot(rows_file: Path, path: Path) -> None:
    """Each arm's (a) and (b) against the training steps beyond the start: the seeds' mean, their
    range as a band; a point where a student has rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from harness import load_rows

    rows = {}
    for row in load_rows(rows_file):  # the newest row of each case wins
        if row["bench"] == "on_policy":
            rows[row["case"]] = row["figures"]
    seeds = sorted({case.split("/")[0] for case in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, title, ax in (("teacher_logprob_per_token", "(a) the teacher's log-prob / token of the student's "
                                                         "continuations", axes[0]),
                           ("heldout_kl", "(b) held-out KL on the static cache", axes[1])):
        for label, students in ARMS:
            points = []
            for student in students:
                values = [rows[f"{s}/{student}"][key] for s in seeds if f"{s}/{student}" in rows]
                if values:
                    steps = rows[next(f"{s}/{student}" for s in seeds if f"{s}/{student}" in rows)]["steps"]
                    points.append((steps, np.mean(values), min(values), max(values)))
            if len(points) > 1:
                x, mean, low, high = zip(*points)
                ax.plot(x, mean, marker="o", label=label)
                ax.fill_between(x, low, high, alpha=0.15)
        ax.set(xlabel="training steps beyond the start", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"On-policy rounds against off-policy training ({len(seeds)} seed(s); band: their range)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="where the caches, corpora and runs go (reused by a rerun)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-steps", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps-per-round", type=int, default=40)
    ap.add_argument("--round-prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--heldout-prompts", type=int, default=16)
    ap.add_argument("--objective", default="reverse_kl", help="[rounds] objective")
    ap.add_argument("--static-weight", type=float, default=0.5, help="[rounds] static_weight")
    ap.add_argument("--ratio-clip", type=float, default=None, help="[rounds] ratio_clip")
    ap.add_argument("--plot", type=Path, default=None, help="draw the rows of --results into this PNG and stop")
    add_results_arg(ap)
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.results, args.plot)
        return
    if args.work is None:
        ap.error("--work is required (unless --plot)")
    from pipelines.recipe import load_recipe, run_recipe, train_config
    from pipelines.rounds import round_paths
    from student.evaluate import evaluate_run_or_folder
    from student.trainer import train

    results = Results(bench="on_policy", path=args.results)
    variant = variant_name(args)
    work = args.work / f"seed{args.seed}{variant}"
    work.mkdir(parents=True, exist_ok=True)
    plain_start = args.work / f"seed{args.seed}" / "on"
    if variant and (plain_start / "student").is_dir() and not (work / "on").exists():
        shutil.copytree(plain_start, work / "on", ignore=lambda d, names: ["rounds"] if d == str(plain_start) else [])
    recipe_file = work / "recipe.toml"
    clip = "" if args.ratio_clip is None else f"ratio_clip = {args.ratio_clip}\n"
    recipe_file.write_text(RECIPE.format(work=args.work, run=work / "on", seed=args.seed, ratio_clip=clip, **{
        k: getattr(args, k) for k in ("base_steps", "rounds", "steps_per_round", "round_prompts", "new_tokens",
                                      "objective", "static_weight")}))
    recipe = load_recipe(recipe_file)
    run_recipe(recipe, progress=False)  # the start (the recipe's run), then the rounds
    start = train_config(recipe, Path("unused"))
    steps = args.rounds * args.steps_per_round
    off = start.with_flat(out=str(work / "off"), student=str(work / "on" / "student"), teacher=None, num_layers=None,
                          steps=steps)
    if not variant and not (work / "off" / "student").is_dir():
        train(off, progress=False)
    last = round_paths(work / "on", args.rounds).run
    static_tokens = json_tokens(args.work / "static")
    round_tokens = sum(json_tokens(round_paths(work / "on", r).cache) for r in range(1, args.rounds + 1))
    config = {"seed": args.seed, "base_steps": args.base_steps, "rounds": args.rounds,
              "steps_per_round": args.steps_per_round, "round_prompts": args.round_prompts,
              "new_tokens": args.new_tokens, "heldout_prompts": args.heldout_prompts, "batch_size": 4,
              "objective": args.objective, "static_weight": args.static_weight, "ratio_clip": args.ratio_clip}
    # (name, run, steps beyond the start, teacher-scored tokens those steps trained on)
    arms = [(f"round{r}", round_paths(work / "on", r).run, r * args.steps_per_round, sum(
        json_tokens(round_paths(work / "on", i).cache) for i in range(1, r + 1))) for r in range(1, args.rounds)]
    arms += [("on", last, steps, round_tokens)]
    if not variant:  # a variant shares the plain run's start and off-policy arm
        arms = [("start", work / "on", 0, 0), ("off", work / "off", steps, static_tokens)] + arms
    for name, run_dir, arm_steps, scored in arms:
        evaluation = evaluate_run_or_folder(run_dir)["after"]
        figures = {**on_policy_measures(run_dir / "student", work, name, args), "heldout_kl": evaluation.kl, "heldout_bits_per_byte": evaluation.bits_per_byte,
                   "steps": arm_steps, "teacher_scored_tokens": scored}
        results.add(f"seed{args.seed}/{name}{variant}", figures, config)


def variant_name(args) -> str:
    """'' for the recipe's rounds (reverse KL, static weight 0.5, no clip), else e.g. '-forward_kl-w0.75'."""
    parts = [args.objective] if args.objective != "reverse_kl" else []
    parts += [f"w{args.static_weight:g}"] if args.static_weight != 0.5 else []
    parts += [f"clip{args.ratio_clip:g}"] if args.ratio_clip is not None else []
    return "".join("-" + p for p in parts)


def json_tokens(cache: Path) -> int:
    import json

    return json.loads((cache / "manifest.json").read_text())["data"]["tokens"]


if __name__ == "__main__":
    main()
