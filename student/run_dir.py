"""A stage-two run directory's files other than checkpoints (student/checkpoint.py) and the lock
(student/run_owner.py): whether a rerun continues the run in `out`, and its metrics log.

  run.json        the resolved config (flat names), the cache's id and temperature, the student's
                  identity and tokenizer hash, and what the executor records (offload: its plan)
  metrics.jsonl   one JSON row per line; student/trainer.py's docstring lists the kinds
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from distill.configs import ConfigError
from distill.files import atomic_write_json
from student import run_owner
from student.checkpoint import RunDirError, checkpoint_step, rewind_metrics
from student.train_config import CHANGEABLE, FREE, TrainConfig

__all__ = ["MetricsLog", "check_run_dir", "diverged_message", "eval_row", "make_run_dir"]


def make_run_dir(out: Path) -> None:
    """Create the run directory `out` (refusing a file there, or a place that cannot be written)."""
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"is an existing file ({out}); give a new or empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(out, e) from None


def _unwritable(out: Path, error: OSError) -> ConfigError:
    return ConfigError("out", f"cannot be written ({out}: {error.strerror or error}); give a directory you can "
                              "write to")


def check_run_dir(out: Path, run: dict) -> dict:
    """In a new run dir (`make_run_dir`'s, holding at most the lock) write run.json and return {}; in an
    existing one refuse another run, and return the CHANGEABLE settings that differ, {name: [old, new]}."""
    path = out / "run.json"
    if not path.exists():
        if any(entry.name != run_owner.PID_FILE for entry in out.iterdir()):
            raise RunDirError(f"{out} is not empty and holds no run.json; give --out a new or empty directory")
        try:
            atomic_write_json(path, run)
        except OSError as e:
            raise _unwritable(out, e) from None
        return {}
    old = json.loads(path.read_text())
    defaults = TrainConfig.flat_defaults()  # a field added after the run was written reads as its default
    # as JSON holds them (tuples are lists); a run written when --cache took one path held it as a string
    saved = {**old["config"], **({"cache": [old["config"]["cache"]]} if isinstance(old["config"].get("cache"), str)
                                else {})}
    was = lambda k: saved.get(k, json.loads(json.dumps(defaults.get(k))))
    new = json.loads(json.dumps(run["config"]))
    refused = [f"{k}: {was(k)!r} -> {v!r}" for k, v in new.items()
               if k not in FREE + CHANGEABLE and was(k) != v]
    refused += [k for k in ("cache_id", "cache_ids", "student", "tokenizer_hash") if old.get(k) != run.get(k)]
    if refused:
        raise RunDirError(f"{out} holds another run (run.json differs in {'; '.join(refused)}, which changes the "
                          "model or the data); use a new `out`, or rerun with the run's settings (these may change: "
                          f"{', '.join(CHANGEABLE)})")
    return {k: [was(k), v] for k, v in new.items() if k in CHANGEABLE and was(k) != v}


class MetricsLog:
    """metrics.jsonl, rewound to `step` (rows a killed run wrote after its checkpoint dropped) and
    appended to, a row flushed as written; on a process that does not write the run (`main` False)
    every row goes nowhere."""

    def __init__(self, path: Path, step: int, main: bool):
        self.path = path
        if main:
            rewind_metrics(path, step)
        self.file = path.open("a") if main else open(os.devnull, "w")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def eval_row(path: Path, step: int) -> dict:
    """The last evaluation row of `step` in metrics.jsonl at `path`."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in rows if r["kind"] == "eval" and r["step"] == step][-1]


def diverged_message(step: int, loss: float, grad_norm: float, last_saved, kept: list[Path]) -> str:
    """The one line a run stops with when its loss or gradient norm is not finite. last_saved: (the
    last checkpoint, the loss of its step) or None; kept: the checkpoints kept."""
    stopped = f"loss {loss} / grad norm {grad_norm} is not finite at step {step}; stopped without saving"
    if last_saved is None:
        return (f"{stopped}; there is no checkpoint yet, so a rerun starts over: rerun with a lower --lr or more "
                "--warmup-steps (or --clip-grad)")
    ckpt, ckpt_loss = last_saved
    loss_text = f", loss {ckpt_loss:.4g}" if ckpt_loss is not None else ""
    where = (f"the last checkpoint is {ckpt} (step {checkpoint_step(ckpt)}{loss_text}: the last saved with a finite "
             "loss, which does not mean the weights are sound; the grad_norm rows of metrics.jsonl show where it "
             "began to diverge)")
    kept_steps = [checkpoint_step(c) for c in kept]
    older = (f", or --resume-from STEP for an older kept checkpoint (kept: {', '.join(map(str, kept_steps))})"
             if kept_steps else "")
    return (f"{stopped}; {where}. "
            f"Rerun with a lower --lr or more --warmup-steps (or --clip-grad) to continue from it{older}; "
            "metrics.jsonl records each change")
