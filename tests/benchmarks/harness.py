"""The one timing harness every benchmark goes through.

A benchmark builds its inputs, checks its result against the reference (`check_close`) before
timing anything, times each variant with `time_gpu` (CUDA events, peak memory above what was
allocated before) or `time_cpu`, turns times into TFLOP/s or GB/s against the device's measured
ceilings (`ceilings`), and records each measurement with `Results.add`: one JSON row a
measurement, appended to a results file (default `tests/benchmarks/results.jsonl`):

    {"id": "fused_kl/V49152-N8192/ours@3f2a1c0", "bench": "fused_kl", "case": "V49152-N8192/ours",
     "date": "2026-12-01T16:02:11Z", "commit": "3f2a1c0" (+ "-dirty"), "device": "NVIDIA H200",
     "command": "python tests/benchmarks/bench_fused_kl_gpu.py ...", "figures": {...}, "config": {...}}

`RESULTS.md` cites rows by their `id`. Scripts run as `python tests/benchmarks/NAME.py` (this
folder is then on sys.path) and take `--results PATH` (`add_results_arg`) so a run on another
machine writes its rows where they can be copied back.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results.jsonl"
OUTPUT_DIR = HERE / "out"  # plots and JSON the benchmarks generate; git ignores it


@dataclass(frozen=True)
class Timing:
    """Times in milliseconds of the repeats; peak_gib: the largest allocation above the baseline
    during them (GPU only; 0 on the CPU)."""

    times_ms: tuple[float, ...]
    peak_gib: float = 0.0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    def figures(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": max(self.times_ms),
                "repeats": len(self.times_ms), "peak_gib": self.peak_gib}


def time_gpu(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10, min_ms: float = 0.0) -> Timing:
    """Median-friendly CUDA-event times of `fn()`: `warmup` untimed calls, then `repeats` timed ones
    (more while their total is under `min_ms`). Peak memory counts what `fn` allocates above what
    was allocated before the timed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    while len(times) < repeats or sum(times) < min_ms:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return Timing(tuple(times), peak)


def time_cpu(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 3) -> Timing:
    """Wall-clock times of `fn()` on the host (perf_counter)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(tuple(times))


def check_close(name: str, got, want, *, atol: float, rtol: float = 0.0) -> float:
    """Refuse to time a variant whose result differs from the reference: raises AssertionError
    naming `name` with the largest error; returns that error (for the row's figures)."""
    import torch

    got_t, want_t = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    if got_t.shape != want_t.shape:
        raise AssertionError(f"{name}: shape {tuple(got_t.shape)} != reference {tuple(want_t.shape)}")
    err = (got_t - want_t).abs()
    bound = atol + rtol * want_t.abs()
    if not bool(torch.isfinite(got_t).all()) or bool((err > bound).any()):
        raise AssertionError(f"{name}: max error {err.max().item():.3g} > atol {atol} + rtol {rtol} x |ref|")
    return err.max().item()


@functools.cache
def ceilings() -> dict:
    """The device's measured ceilings, once a process: bf16 matmul TFLOP/s (8192^3) and
    device-to-device copy GB/s (bytes read + written)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm = time_gpu(lambda: a @ b, warmup=3, repeats=10)
    del a, b
    src = torch.empty(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    cp = time_gpu(lambda: dst.copy_(src), warmup=3, repeats=10)
    del src, dst
    return {"matmul_bf16_tflops": 2 * n**3 / mm.median_ms / 1e9, "copy_gbps": 2 * 2**31 / cp.median_ms / 1e6}


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / ms / 1e6


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def commit() -> str:
    """The checkout's short commit, with "-dirty" when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def add_results_arg(parser) -> None:
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help=f"JSON-lines file the rows are appended to (default {DEFAULT_RESULTS.name} beside this script)")


@dataclass
class Results:
    """Collects a benchmark's rows and appends each to `path` as it is added."""

    bench: str
    path: Path = DEFAULT_RESULTS
    rows: list = field(default_factory=list)

    def add(self, case: str, figures: dict, config: dict | None = None) -> dict:
        """Append one measurement: `case` names it within the bench (e.g. "V49152-N8192/ours"),
        `figures` are its numbers (ms, GiB, TFLOP/s, ratios), `config` its settings."""
        sha = commit()
        row = {"id": f"{self.bench}/{case}@{sha.split('-')[0]}", "bench": self.bench, "case": case,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "commit": sha, "device": device_name(),
               "command": shlex.join([Path(sys.executable).name, *sys.argv]),
               "figures": _plain(figures), "config": _plain(config or {})}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.rows.append(row)
        print(f"[{row['id']}] " + ", ".join(f"{k}={_short(v)}" for k, v in row["figures"].items()), flush=True)
        return row


def _plain(obj):
    """JSON-ready: dataclasses as dicts, paths and other objects as strings, floats kept."""
    if hasattr(obj, "__dataclass_fields__"):
        return _plain(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def load_rows(path: Path = DEFAULT_RESULTS) -> list[dict]:
    """Every row of a results file, oldest first."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
