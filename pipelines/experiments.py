"""Many runs over one cache, read from their run directories (no tracking server): `distill runs`
lists them, `distill compare` sets their held-out metrics side by side and plots their curves.

A run's status, from its files (student/trainer.py documents them):
  running    run.pid names a live process on this host (the trainer writes it and removes it when
             it returns or raises; a killed trainer leaves a dead pid behind), or one on another
             host that wrote recently (below)
  finished   its final student/ exists
  stopped    otherwise: "non-finite loss at step N" when a {"kind": "stop"} row ends metrics.jsonl,
             else "interrupted after step N" (the last logged step; a rerun resumes it)

A run.pid written on another host (a cluster node seen from a login node) names a pid that cannot
be checked from here, so whether it is alive here says nothing. Such a run counts as running while
its last sign of life (run.pid, written when the trainer starts or resumes, or the newest
metrics.jsonl row) is recent: within RUNNING_ON_OTHER_HOST_S seconds, or within three of the run's
own intervals between training rows when its steps are slower than that (estimated from the last
row's tokens, tokens/s and log_every). Past that it reads stopped, and the reason says it is a
guess: which host, and for how long nothing was written.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distill.errors import DistillUserError
from student.run_owner import PID_FILE, owner

RUNNING_ON_OTHER_HOST_S = 600
# Settings that never tell runs apart: where things live and how often they are logged or saved.
_NOT_SETTINGS = ("cache", "out", "student", "teacher", "tokenizer", "eval_every", "eval_sequences", "save_every",
                 "log_every", "device")


@dataclass
class RunSummary:
    path: str
    name: str  # the run directory's name
    cache_id: str
    config: dict[str, Any]  # run.json's flat config
    status: str  # "finished" | "running" | "stopped"
    # Why it stopped ("non-finite loss at step N", "interrupted after step N", or for a run on another
    # host "nothing written for M min after step N; ..."), or where a run on another host runs ("on HOST").
    reason: str | None
    steps_done: int
    steps_total: int
    eval: dict | None  # the last held-out evaluation {"step", "kl", "ce", "ppl", "top1", "tokens"}
    tok_per_s: float | None  # of the last logged training row
    optimizer_state_bytes: int | None
    differs: dict[str, Any] = field(default_factory=dict)  # the settings that differ among the runs listed

    def to_dict(self) -> dict:
        return asdict(self)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return rows


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _seconds_since_written(run_dir: Path) -> float:
    """Seconds since the trainer last wrote run.pid or metrics.jsonl (inf when neither is left)."""
    times = []
    for name in (PID_FILE, "metrics.jsonl"):
        try:
            times.append((run_dir / name).stat().st_mtime)
        except FileNotFoundError:  # removed by a trainer that just returned
            continue
    return time.time() - max(times) if times else float("inf")


def _quiet_limit_s(config: dict, last_train: dict) -> float:
    """How long a run on another host may write nothing and still count as running: the fixed window,
    or three of its own intervals between training rows if those are longer."""
    tokens, tok_per_s = last_train.get("tokens"), last_train.get("tok_per_s")
    if not tokens or not tok_per_s:
        return RUNNING_ON_OTHER_HOST_S
    return max(RUNNING_ON_OTHER_HOST_S, 3 * config.get("log_every", 1) * tokens / tok_per_s)


def _status(run_dir: Path, config: dict, rows: list[dict], steps_done: int) -> tuple[str, str | None]:
    """(status, reason) of a run; the reason says why it stopped, or where it runs if not here."""
    claimed, last_train = owner(run_dir), next((r for r in reversed(rows) if r.get("kind") == "train"), {})
    elsewhere = claimed is not None and claimed.get("host") != socket.gethostname()
    if claimed is not None and not elsewhere and _pid_alive(claimed["pid"]):
        return "running", None
    if elsewhere:
        quiet = _seconds_since_written(run_dir)
        if quiet < _quiet_limit_s(config, last_train):
            return "running", f"on {claimed.get('host')}"
    if (run_dir / "student").is_dir():
        return "finished", None
    if rows and rows[-1].get("kind") == "stop":
        return "stopped", f"non-finite loss at step {rows[-1]['step']}"
    if elsewhere:
        return "stopped", (f"nothing written for {quiet / 60:.0f} min after step {steps_done}; its pid "
                           f"{claimed['pid']} on {claimed.get('host')} cannot be checked from here")
    return "stopped", f"interrupted after step {steps_done}"


def read_run(run_dir: str | Path) -> RunSummary:
    """One run directory's status, progress and last metrics."""
    run_dir = Path(run_dir)
    try:
        run = json.loads((run_dir / "run.json").read_text())
    except FileNotFoundError:
        raise DistillUserError(f"{run_dir} is not a run directory (no run.json); give a folder that "
                               "train-student or distill run wrote") from None
    rows = _metrics(run_dir)
    train_rows = [r for r in rows if r.get("kind") == "train"]
    eval_rows = [r for r in rows if r.get("kind") == "eval"]
    steps_done = max((r["step"] for r in train_rows + eval_rows), default=0)
    status, reason = _status(run_dir, run["config"], rows, steps_done)
    last_eval = eval_rows[-1] if eval_rows else None
    last_train = train_rows[-1] if train_rows else {}
    return RunSummary(
        path=str(run_dir), name=run_dir.name, cache_id=run["cache_id"], config=run["config"], status=status,
        reason=reason, steps_done=steps_done, steps_total=run["config"]["steps"],
        eval={k: last_eval[k] for k in ("step", "kl", "ce", "ppl", "top1", "tokens")} if last_eval else None,
        tok_per_s=last_train.get("tok_per_s"), optimizer_state_bytes=last_train.get("optimizer_state_bytes"))


def find_runs(folders: list[str | Path], cache_id: str | None = None) -> list[RunSummary]:
    """The runs in or under `folders` (a folder may be a run itself), sorted by path, with the
    settings that differ among them; `cache_id` keeps the runs of that cache (a prefix will do)."""
    dirs = set()
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise DistillUserError(f"{folder} is not a folder; give folders that hold run directories")
        dirs.update(p.parent for p in folder.rglob("run.json") if "checkpoints" not in p.parts)
        if (folder / "run.json").is_file():
            dirs.add(folder)
    runs = [read_run(d) for d in sorted(dirs)]
    if cache_id is not None:
        runs = [r for r in runs if r.cache_id.startswith(cache_id)]
    return with_differences(runs)


def with_differences(runs: list[RunSummary]) -> list[RunSummary]:
    """Set each run's `differs`: the settings whose values are not the same in every run."""
    keys = sorted({k for r in runs for k in r.config} - set(_NOT_SETTINGS))
    varying = [k for k in keys if len({json.dumps(r.config.get(k)) for r in runs}) > 1]
    for r in runs:
        r.differs = {k: r.config.get(k) for k in varying}
    return runs


def label(run: RunSummary) -> str:
    """The run's name in a table or legend: its differing settings, else its directory name."""
    return ",".join(f"{k}={v}" for k, v in run.differs.items()) or run.name


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def runs_table(runs: list[RunSummary]) -> str:
    """The human table of `distill runs`."""
    if not runs:
        return "no runs found"
    header = (f"{'run':<28} {'cache':<12} {'settings':<32} {'steps':>9} {'KL':>8} {'CE':>7} {'top-1':>6} "
              f"{'tok/s':>8} {'opt MiB':>8}  status")
    lines = [header]
    for r in runs:
        e = r.eval or {}
        status = r.status + (f" ({r.reason})" if r.reason else "")
        mib = None if r.optimizer_state_bytes is None else r.optimizer_state_bytes / 2**20
        settings = ",".join(f"{k}={v}" for k, v in r.differs.items()) or "-"
        lines.append(f"{r.name:<28} {r.cache_id[:12]:<12} {settings:<32} {f'{r.steps_done}/{r.steps_total}':>9} "
                     f"{_fmt(e.get('kl'), '.4f'):>8} {_fmt(e.get('ce'), '.3f'):>7} {_fmt(e.get('top1'), '.3f'):>6} "
                     f"{_fmt(r.tok_per_s, ',.0f'):>8} {_fmt(mib, ',.2f'):>8}  {status}")
    lines.append("KL, CE, top-1: the last held-out evaluation (KL over the teacher's top-k plus a tail category)")
    return "\n".join(lines)


def compare_runs(paths: list[str | Path], allow_different_caches: bool = False) -> list[RunSummary]:
    """The runs at `paths`, refusing runs over different caches unless allowed (their KL is to
    different teacher targets, so the numbers are not comparable)."""
    if not paths:
        raise DistillUserError("give at least one run directory to compare")
    runs = [read_run(p) for p in paths]
    caches = {r.cache_id for r in runs}
    if len(caches) > 1 and not allow_different_caches:
        which = "; ".join(f"{r.name}: {r.cache_id[:12]}" for r in runs)
        raise DistillUserError(f"the runs are over different caches ({which}): their held-out KL numbers are not "
                               "comparable; compare runs of one cache, or pass --allow-different-caches")
    return with_differences(runs)


def compare_table(runs: list[RunSummary]) -> str:
    """Held-out metrics side by side, one column per run."""
    labels = [label(r) for r in runs]
    width = max(12, *(len(x) for x in labels))
    lines = [f"{'':<14}" + "".join(f" {x:>{width}}" for x in labels)]
    for key, spec in (("kl", ".4f"), ("ce", ".3f"), ("ppl", ".2f"), ("top1", ".3f"), ("step", "d")):
        values = [_fmt((r.eval or {}).get(key), spec) for r in runs]
        lines.append(f"{'held-out ' + key if key != 'step' else 'at step':<14}" + "".join(f" {v:>{width}}" for v in values))
    lines.append(f"{'status':<14}" + "".join(f" {r.status:>{width}}" for r in runs))
    return "\n".join(lines)


def curves(run: RunSummary) -> dict[str, list]:
    """{"train_step", "train_loss", "train_tokens", "eval_step", "eval_kl", "eval_tokens"} of a run.
    Tokens are training tokens seen, estimated as step x the mean of the logged rows' per-step
    tokens (a metrics row holds the tokens of its own step only)."""
    rows = _metrics(Path(run.path))
    train_rows = [r for r in rows if r.get("kind") == "train"]
    eval_rows = [r for r in rows if r.get("kind") == "eval"]
    per_step = sum(r["tokens"] for r in train_rows) / len(train_rows) if train_rows else 0.0
    return {"train_step": [r["step"] for r in train_rows], "train_loss": [r["loss"] for r in train_rows],
            "train_tokens": [r["step"] * per_step for r in train_rows],
            "eval_step": [r["step"] for r in eval_rows], "eval_kl": [r["kl"] for r in eval_rows],
            "eval_tokens": [r["step"] * per_step for r in eval_rows]}


def plot_compare(runs: list[RunSummary], path: str | Path) -> Path:
    """Training loss and held-out KL against steps and against tokens, one line per run labelled by
    the settings that differ; the suffix picks the format (none: .png)."""
    try:
        from matplotlib.figure import Figure  # a bare Figure draws with Agg; no pyplot, no global backend
    except ImportError as e:
        raise DistillUserError("compare --plot needs matplotlib: pip install distill[plot]") from e
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if not path.parent.is_dir():
        raise DistillUserError(f"cannot plot to {path}: the folder {path.parent} does not exist; create it first")
    fig = Figure(figsize=(11, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    for run in runs:
        c, name = curves(run), label(run)
        axes[0, 0].plot(c["train_step"], c["train_loss"], label=name)
        axes[0, 1].plot(c["eval_step"], c["eval_kl"], marker="o", label=name)
        axes[1, 0].plot(c["train_tokens"], c["train_loss"], label=name)
        axes[1, 1].plot(c["eval_tokens"], c["eval_kl"], marker="o", label=name)
    for ax, (title, x) in zip(axes.flat, [("training loss", "step"), ("held-out KL", "step"),
                                          ("training loss", "tokens (estimated)"),
                                          ("held-out KL", "tokens (estimated)")]):
        ax.set(title=title, xlabel=x)
        ax.grid(alpha=0.3)
    axes[0, 1].legend(fontsize="small")
    caches = sorted({r.cache_id[:12] for r in runs})
    fig.suptitle(f"{len(runs)} run(s) over cache {', '.join(caches)}")
    try:
        fig.savefig(path, dpi=100)
    except ValueError as e:  # an image format matplotlib does not write
        raise DistillUserError(f"cannot plot to {path}: {e}") from None
    return path
