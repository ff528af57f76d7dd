"""Stage two under torchrun (student/distributed.py): two CPU processes on gloo train as one
process does at the same global batch, checkpoints resume at another world size (2 -> 1 -> 2 -> 2),
and the settings a sharded run cannot take are refused in one line before any process group.

The runs are spawned as a user runs them: `python -m torch.distributed.run --standalone
--nproc-per-node 2 -m distill train-student ...` (a free port each time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.configs import ConfigError
from student.model import Student
from student.trainer import TrainConfig, train
from test_cache_synth import make_corpus, write_cache
from test_trainer import VOCAB, make_student, rows, tokenizer_hash

REPO = Path(__file__).resolve().parents[1]
# Two processes sum their rows' shares of the loss and of every gradient where one process sums all
# rows at once: the same in exact arithmetic, another order of fp32 sums (student/distributed.py).
# Adam's first steps divide a gradient by its own magnitude, so element errors of that order reach
# the weights; this bound held the losses over 12 steps.
RTOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(student folder, cache dir): 24 ragged sequences of <= 24 tokens in 6 shards of 4."""
    root = tmp_path_factory.mktemp("tiny_dist")
    student = make_student(root / "student")
    corpus = make_corpus(num_seqs=24, seq_len=24, k=8, vocab=VOCAB, seed=1)
    write_cache(root / "cache", corpus, tokenizer__hash=tokenizer_hash(student), shard_size=4, fmt="parquet")
    return student, root / "cache"


def settings(tiny, out, **overrides) -> dict:
    student, cache = tiny
    return {**dict(cache=str(cache), out=str(out), student=str(student), steps=12, batch_size=4, grad_accum=2,
                   lr=1e-2, warmup_steps=2, heldout=4, eval_every=3, save_every=3, log_every=1, seed=0,
                   deterministic=True, device="cpu"), **overrides}


def _options(values: dict) -> list[str]:
    """`distill train-student` options for the TrainConfig flat `values`."""
    args = []
    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(option if value else f"--no-{name.replace('_', '-')}")
        elif value is not None:
            args += [option, str(value)]
    return args


def _run(values: dict, nproc: int, exit_after: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DISTILL_TEST_EXIT_AFTER_STEP", None)
    if exit_after is not None:
        env["DISTILL_TEST_EXIT_AFTER_STEP"] = str(exit_after)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    return subprocess.run([*launch, "-m", "distill", "train-student", *_options(values), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=300)
