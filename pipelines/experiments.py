"""Many runs over one cache, read from their run directories (no tracking server): `distill runs`
lists them, `distill compare` sets their held-out metrics side by side and plots their curves.

A run's progress, from its files: the last step trained is the later of its last metrics.jsonl row
and its latest checkpoint (a run logging every N steps writes no row for the steps in between), and
a rerun resumes from that checkpoint (student/checkpoint.py), or starts over without one.

A run's status, from its files (student/trainer.py documents them):
  running    run.pid names a live process on this host (the trainer writes it and removes it when
             it returns or raises; a killed trainer leaves a dead pid behind), or one on another
             host that wrote recently (below)
  finished   its final student/ exists
  stopped    otherwise: "non-finite loss at step N" when a {"kind": "stop"} row ends metrics.jsonl,
             else "interrupted after step N" ("or later" when rows are logged every few steps);
             either says where a rerun resumes (its latest checkpoint), or that it starts over

A run.pid written on another host (a cluster node seen from a login node) names a pid that cannot
be checked from here, so whether it is alive here says nothing. Such a run counts as running while
its last sign of life (run.pid, written when the trainer starts or resumes, or the newest
metrics.jsonl row) is recent: within RUNNING_ON_OTHER_HOST_S seconds, or within three of the run's
own intervals between training rows when its steps are slower than that (estimated from the last
row's tokens, tokens/s and log_every). Past that it reads stopped, and the reason says it is a
guess: which host, and for how long nothing was written.

Which numbers compare: KL, CE, PPL and top-1 are per token against one cache's teacher targets,
so `compare` shows them for runs over different caches only when told to (allow_different_caches);
bits per byte (student/evaluate.py, BITS_PER_BYTE_NOTE) compares across caches of one corpus and
across tokenizers, so it is shown for every run that recorded it ("-" for runs from before it).

Tables fit a terminal: a run is labelled by its directory's name (with parent folders where two
names clash), the settings that differ among the runs are listed once below the table (with
`wide`, as columns of their own, and the settings every run shares below), and every column is as
wide as its longest value.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distill.errors import DistillUserError
from student.checkpoint_dirs import checkpoint_step, checkpoints
from student.run_owner import PID_FILE, owner

RUNNING_ON_OTHER_HOST_S = 600
# Settings that never tell runs apart: where things live and how often they are logged or saved.
_NOT_SETTINGS = ("cache", "out", "student", "teacher", "tokenizer", "eval_every", "eval_sequences", "save_every",
                 "log_every", "device")


@dataclass
class RunSummary:
    path: str
    name: str  # the run directory's name
    cache_id: str  # a run over several caches (a mixture): their ids joined by "+"
    config: dict[str, Any]  # run.json's flat config
    status: str  # "finished" | "running" | "stopped"
    # Why it stopped ("non-finite loss at step N", "interrupted after step N", or for a run on another
    # host "nothing written for M min after step N; ...") and where a rerun resumes, or where a run on
    # another host runs ("on HOST").
    reason: str | None
    steps_done: int  # the last step trained: of the last metrics row or the latest checkpoint, the later
    steps_total: int
    # The last held-out evaluation {"step", "kl", "ce", "ppl", "top1", "tokens", "bits_per_byte"}
    # (bits_per_byte None when the run did not record it)
    eval: dict | None
    tok_per_s: float | None  # of the last logged training row
    optimizer_state_bytes: int | None
    checkpoint_step: int | None = None  # the latest kept checkpoint, where a rerun resumes (None: it starts over)
    differs: dict[str, Any] = field(default_factory=dict)  # the settings that differ among the runs listed
    # a run over several caches: each cache's part of its last evaluation, {"cache", "kl", "ce", "bits_per_byte"}
    cache_evals: list[dict] = field(default_factory=list)

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


def _status(run_dir: Path, config: dict, rows: list[dict], steps_done: int,
            checkpoint: int | None) -> tuple[str, str | None]:
    """(status, reason) of a run; the reason says why it stopped and where a rerun resumes, or where
    it runs if not here."""
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
    resume = (f"a rerun resumes from step {checkpoint}" if checkpoint is not None
              else "no checkpoint: a rerun starts over")
    if rows and rows[-1].get("kind") == "stop":
        return "stopped", f"non-finite loss at step {rows[-1]['step']}; {resume}"
    if elsewhere:
        return "stopped", (f"nothing written for {quiet / 60:.0f} min after step {steps_done}; its pid "
                           f"{claimed['pid']} on {claimed.get('host')} cannot be checked from here; {resume}")
    # Between two logged rows the trainer may have trained steps it wrote nowhere (a kill loses them).
    exact = config.get("log_every", 1) <= 1 or steps_done >= config.get("steps", steps_done)
    if not exact and steps_done == 0:
        return "stopped", f"interrupted before any step was logged or saved; {resume}"
    return "stopped", f"interrupted after step {steps_done}{'' if exact else ' or later'}; {resume}"


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
    kept = checkpoints(run_dir)
    checkpoint = checkpoint_step(kept[-1]) if kept else None
    steps_done = max([r["step"] for r in train_rows + eval_rows] + [checkpoint or 0])
    status, reason = _status(run_dir, run["config"], rows, steps_done, checkpoint)
    last_eval = eval_rows[-1] if eval_rows else None
    cache_evals = [{k: r.get(k) for k in ("cache", "kl", "ce", "bits_per_byte")} for r in rows
                   if r.get("kind") == "cache_eval" and last_eval is not None and r["step"] == last_eval["step"]]
    last_train = train_rows[-1] if train_rows else {}
    return RunSummary(
        path=str(run_dir), name=Path(os.path.abspath(run_dir)).name, config=run["config"],
        cache_id="+".join(run.get("cache_ids", [run["cache_id"]])),  # a mixture's: its caches' ids joined
        status=status, reason=reason, steps_done=steps_done, steps_total=run["config"]["steps"],
        eval=({k: last_eval[k] for k in ("step", "kl", "ce", "ppl", "top1", "tokens")}
              | {"bits_per_byte": last_eval.get("bits_per_byte")}) if last_eval else None,
        tok_per_s=last_train.get("tok_per_s"), optimizer_state_bytes=last_train.get("optimizer_state_bytes"),
        checkpoint_step=checkpoint, cache_evals=cache_evals)


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


def labels(runs: list[RunSummary]) -> list[str]:
    """Each run's short name in a table or legend: its directory's name, with as many parent folders
    as tell it from the other runs of the same name."""
    parts = [Path(os.path.abspath(r.path)).parts for r in runs]  # "." too has a name
    depth = [1] * len(runs)
    while True:
        names = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        clashes = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(parts[i])]
        if not clashes:
            return names
        for i in clashes:
            depth[i] += 1


def _setting(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_ppl(value) -> str:
    """Perplexity: fixed point while it reads, scientific once it would run long (a random student's)."""
    return _fmt(value, ",.2f" if value is None or value < 1e5 else ".3e")


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Lines of a table whose columns are as wide as their longest cell; the first `left` columns and
    the last (free text) are aligned left, the numbers between right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    last = len(header) - 1

    def line(cells):
        return "  ".join(c.ljust(w) if i < left or i == last else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), *map(line, rows)]


def _wrapped(head: str, text: str, indent: int) -> list[str]:
    width = max(shutil.get_terminal_size().columns, 60)
    return textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * indent,
                         break_long_words=False, break_on_hyphens=False) or [head.rstrip()]


def _notes(runs: list[RunSummary], names: list[str], wide: bool, shown: tuple[str, ...] = ()) -> list[str]:
    """What the table leaves out: each stopped run's reason; the settings that differ, one line a
    run (with `wide` they are columns; the settings every run shares are listed instead); the cache
    when every run shares one. `shown`: settings the table shows in columns of its own."""
    lines = []
    width = max(len(n) for n in names)
    for r, name in zip(runs, names):
        if r.reason:
            text = f"running {r.reason}" if r.status == "running" else r.reason
            lines += _wrapped(f"{name + ':':<{width + 1}} ", text, width + 2)
    if wide:
        shared = {k: v for k, v in runs[0].config.items()
                  if k not in runs[0].differs and k not in _NOT_SETTINGS and k not in shown}
        if shared:
            text = ", ".join(f"{k}={_setting(v)}" for k, v in sorted(shared.items()))
            lines += _wrapped("settings of every run: ", text, 2)
    elif set(runs[0].differs) - set(shown):
        lines.append("settings that differ:")
        for r, name in zip(runs, names):
            lines += _wrapped(f"  {name:<{width}}  ", ", ".join(f"{k}={_setting(v)}" for k, v in r.differs.items()
                                                                 if k not in shown), width + 4)
    for r, name in zip(runs, names):  # a run over several caches: its evaluation on each
        if r.cache_evals:
            caches = r.config.get("ensemble") or r.config["cache"]
            text = "; ".join(f"{Path(caches[e['cache']]).name}: KL {_fmt(e['kl'], '.4f')}, CE {_fmt(e['ce'], '.3f')}"
                             + (f", {_fmt(e['bits_per_byte'], '.4f')} bits/byte" if e["bits_per_byte"] else "")
                             for e in r.cache_evals)
            lines += _wrapped(f"{name + ' by cache:':<{width + 10}} ", text, width + 2)
    caches = {r.cache_id for r in runs}
    if len(caches) == 1:
        lines.append(f"cache {_short(runs[0].cache_id)} (every run)")
    return lines


def _settings_columns(runs: list[RunSummary], wide: bool, caches: bool,
                      shown: tuple[str, ...] = ()) -> tuple[list[str], list[list[str]]]:
    """The extra columns: the cache when the runs span several, and with `wide` each differing
    setting the table does not show already (`shown`)."""
    keys = [k for k in runs[0].differs if k not in shown] if wide else []
    header = (["cache"] if caches else []) + keys
    cells = [([_short(r.cache_id)] if caches else []) + [_setting(r.differs[k]) for k in keys] for r in runs]
    return header, cells


_EVAL_NOTE = "KL, CE, top-1: the last held-out evaluation (KL over the teacher's top-k plus a tail category)"
_BPB_NOTE = ("bits/byte: the held-out cross-entropy in bits per UTF-8 byte of the predicted tokens, comparable across "
             "tokenizers and caches of one corpus (- where a run did not record it)")


def _has_bits_per_byte(runs: list[RunSummary]) -> bool:
    return any((r.eval or {}).get("bits_per_byte") is not None for r in runs)


def runs_table(runs: list[RunSummary], wide: bool = False) -> str:
    """The human table of `distill runs`: one line a run, the stop reasons and the settings that
    differ below it (`wide`: the settings as columns)."""
    if not runs:
        return "no runs found"
    names = labels(runs)
    shown = ("steps",)  # the steps column says each run's total
    extra_header, extra = _settings_columns(runs, wide, caches=len({r.cache_id for r in runs}) > 1, shown=shown)
    bpb = _has_bits_per_byte(runs)
    header = ["run", *extra_header, "steps", "ckpt", "KL", "CE", "top-1", *(["bits/byte"] if bpb else []), "tok/s",
              "opt MiB", "status"]
    rows = []
    for r, name, more in zip(runs, names, extra):
        e = r.eval or {}
        mib = None if r.optimizer_state_bytes is None else r.optimizer_state_bytes / 2**20
        rows.append([name, *more, f"{r.steps_done}/{r.steps_total}", _fmt(r.checkpoint_step, "d"),
                     _fmt(e.get("kl"), ".4f"), _fmt(e.get("ce"), ".3f"), _fmt(e.get("top1"), ".3f"),
                     *([_fmt(e.get("bits_per_byte"), ".4f")] if bpb else []),
                     _fmt(r.tok_per_s, ",.0f"), _fmt(mib, ",.2f"), r.status])
    lines = _table(header, rows, left=1 + len(extra_header))
    return "\n".join(lines + _notes(runs, names, wide, shown)
                     + _wrapped("", _EVAL_NOTE + "; ckpt: the latest checkpoint, where a rerun resumes", 0)
                     + (_wrapped("", _BPB_NOTE, 0) if bpb else []))


def compare_runs(paths: list[str | Path], allow_different_caches: bool = False,
                 plot: bool = False) -> list[RunSummary]:
    """The runs at `paths`. Runs over different caches are refused only for a `plot` (it draws
    held-out KL and training loss, which are to different teacher targets) unless allowed; their
    table shows what compares (compare_table)."""
    if not paths:
        raise DistillUserError("give at least one run directory to compare")
    runs = [read_run(p) for p in paths]
    caches = {r.cache_id for r in runs}
    if plot and len(caches) > 1 and not allow_different_caches:
        which = "; ".join(f"{r.name}: {_short(r.cache_id)}" for r in runs)
        raise DistillUserError(f"--plot: the runs are over different caches ({which}): their held-out KL and "
                               "training loss are not comparable; plot runs of one cache, or pass "
                               "--allow-different-caches")
    return with_differences(runs)


def compare_table(runs: list[RunSummary], wide: bool = False, allow_different_caches: bool = False) -> str:
    """Held-out metrics side by side, one line a run, the settings that differ below (`wide`: as
    columns). Over several caches the per-token columns (KL, CE, PPL, top-1) show "-" unless
    `allow_different_caches`; bits/byte (shown when a run recorded it) compares across caches."""
    names = labels(runs)
    several = len({r.cache_id for r in runs}) > 1
    per_token = allow_different_caches or not several
    extra_header, extra = _settings_columns(runs, wide, caches=several)
    bpb = _has_bits_per_byte(runs)
    header = ["run", *extra_header, "at step", "held-out KL", "CE", "PPL", "top-1", *(["bits/byte"] if bpb else []),
              "status"]
    rows = []
    for r, name, more in zip(runs, names, extra):
        e = r.eval or {}
        shown = e if per_token else {}
        rows.append([name, *more, _fmt(e.get("step"), "d"), _fmt(shown.get("kl"), ".4f"),
                     _fmt(shown.get("ce"), ".3f"), _fmt_ppl(shown.get("ppl")), _fmt(shown.get("top1"), ".3f"),
                     *([_fmt(e.get("bits_per_byte"), ".4f")] if bpb else []), r.status])
    notes = []
    if not per_token:
        notes = _wrapped("", "held-out KL, CE, PPL, top-1: - for runs over different caches (per-token numbers "
                             "against different teacher targets); --allow-different-caches shows them", 0)
    if bpb:
        notes += _wrapped("", _BPB_NOTE, 0)
    return "\n".join(_table(header, rows, left=1 + len(extra_header)) + _notes(runs, names, wide) + notes)


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


def _legend_label(name: str, run: RunSummary) -> str:
    """A legend entry: the run's name, and below it the settings that tell it apart unless the name
    already says them (a sweep point's directory is named after them)."""
    settings = ", ".join(f"{k}={_setting(v)}" for k, v in run.differs.items())
    if not settings or settings.replace(", ", ",") in name:
        return name
    # Two lines at most, so many runs still fit beside the panels; the table lists them all.
    return "\n".join([name, *textwrap.wrap(settings, 36, max_lines=2, placeholder=" ...", break_long_words=False,
                                           break_on_hyphens=False)])


def plot_compare(runs: list[RunSummary], path: str | Path) -> Path:
    """Training loss and held-out KL against steps and against tokens, one style per run, named in
    a legend beside the panels (never over them); the suffix picks the format (none: .png). A run
    with fewer than three training rows (shorter than its log_every: only its last step is logged)
    is drawn with markers, so a lone row still shows; one with none yet is left out of the panels
    against tokens (its tokens per step are estimated from those rows)."""
    from teacher_cache.stats import new_figure, plot_file, save_figure

    path = plot_file(path, "compare")
    fig = new_figure("compare", figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    handles = []
    for i, (run, name) in enumerate(zip(runs, labels(runs))):
        c = curves(run)
        style = {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4]}  # past ten runs, dashes
        train_style = {**style, **({"marker": "o", "markersize": 4} if len(c["train_step"]) < 3 else {})}
        eval_style = {**style, "marker": "o", "markersize": 4}
        (handle,) = axes[0, 0].plot(c["train_step"], c["train_loss"], label=_legend_label(name, run), **train_style)
        axes[0, 1].plot(c["eval_step"], c["eval_kl"], **eval_style)
        if c["train_step"]:  # the tokens are estimated from the training rows: without one, unknown
            axes[1, 0].plot(c["train_tokens"], c["train_loss"], **train_style)
            axes[1, 1].plot(c["eval_tokens"], c["eval_kl"], **eval_style)
        handles.append(handle)
    for ax, (title, x) in zip(axes.flat, [("training loss", "step"), ("held-out KL", "step"),
                                          ("training loss", "tokens (estimated)"),
                                          ("held-out KL", "tokens (estimated)")]):
        ax.set(title=title, xlabel=x)
        ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    caches = sorted({_short(r.cache_id) for r in runs})
    fig.suptitle(f"{len(runs)} run(s) over cache {', '.join(caches)}")
    return save_figure(fig, path, dpi=100)


def _short(cache_id: str) -> str:
    """A cache id as shown: its first 12 characters; a mixture's, each of its caches' so."""
    return "+".join(part[:12] for part in cache_id.split("+"))
