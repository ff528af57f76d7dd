"""The one timing harness every benchmark goes through.

A benchmark builds its inputs, checks its result against the reference (`check_close`) before
timing anything, times each variant with `time_gpu` (CUDA events, peak memory above what was
allocated before) or `time_cpu`, turns times into TFLOP/s or GB/s against the device's measured
ceilings (`ceilings`), and records each measurement with `Results.add`: one JSON row a
measurement, appended to a results file (default `tests/benchmarks/results.jsonl`):

    {"id": "fused_kl/V49152-N8192/ours@3f2a1c0", "bench": "fused_kl", "case": "V49152-N8192/ours",
     "date": "2026-12-01T16:02:11Z", "commit": "3f2a1c0" (+ "-dirty"), "device": "NVIDIA H200",
     "command": "python tests/benchmarks/bench_fused_kl_gpu.py ...", "figures": {...}, "config": {...}}

`RESULTS.md` cites rows by their `id` (unique in the file: a case measured again at the same
commit gets "#2", ...). Scripts run as `python tests/benchmarks/NAME.py` (this folder is then on
sys.path) and take `--results PATH` (`add_results_arg`) so a run on another machine writes its
rows where they can be copied back; on a copy of the tree without `.git`, set
DISTILL_BENCH_COMMIT to the commit it holds. Rows transcribed from the dated notes rather than
measured through this harness carry "backfilled_from" (the notes section) and the date alone.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
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
    naming `name` with the largest error; returns that error (for the row's figures).

    Non-finite entries must match the reference's exactly (NaN where it has NaN, the same
    infinity where it has one); a NaN or infinity anywhere else is a mismatch."""
    import torch

    got_t, want_t = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    if got_t.shape != want_t.shape:
        raise AssertionError(f"{name}: shape {tuple(got_t.shape)} != reference {tuple(want_t.shape)}")
    finite = torch.isfinite(want_t)
    same_nan = torch.isnan(got_t) & torch.isnan(want_t)
    bad_nonfinite = (~finite & ~same_nan & (got_t != want_t)) | (finite & ~torch.isfinite(got_t))
    if bool(bad_nonfinite.any()):
        where = tuple(bad_nonfinite.nonzero()[0].tolist())
        raise AssertionError(f"{name}: {got_t[where].item()} at {where} where the reference has {want_t[where].item()}")
    both = finite & torch.isfinite(got_t)
    err = torch.where(both, (got_t - want_t).abs(), 0.0)
    worst = err.max().item() if err.numel() else 0.0
    if bool((err > atol + rtol * want_t.abs().nan_to_num()).any()):
        raise AssertionError(f"{name}: max error {worst:.3g} > atol {atol} + rtol {rtol} x |ref|")
    return worst


@functools.cache
def ceilings() -> dict:
    """The device's measured ceilings, once a process: bf16 matmul TFLOP/s (8192^3) and
    device-to-device copy GB/s (bytes read + written)."""
    import torch

    result = {"matmul_bf16_tflops": _matmul_tflops(8192), "copy_gbps": _copy_gbps(2**31)}
    torch.cuda.empty_cache()
    return result


def _matmul_tflops(n: int) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return tflops(2 * n**3, time_gpu(lambda: a @ b, warmup=3, repeats=10).median_ms)


def _copy_gbps(num_bytes: int) -> float:
    import torch

    src = torch.empty(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return gbps(2 * num_bytes, time_gpu(lambda: dst.copy_(src), warmup=3, repeats=10).median_ms)


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / ms / 1e6


def free_memory(device: str) -> None:
    """Give a finished variant's memory back, so that the next one's peaks (also after an
    out-of-memory error) are its own: Python's garbage, torch's cached device blocks, the cached
    page-locked host memory (student.pinned.release_cached); the device's peak counter reset."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        from student.pinned import release_cached

        release_cached()


def reset_host_peak() -> int | None:
    """The process's resident bytes now, after the kernel's peak resident size (VmHWM) is reset to
    it (Linux: /proc/self/clear_refs); None where that is not there. `host_peak` then reads the
    peak since. (torch's pinned-memory counters are no such peak: torch.cuda.host_memory_stats
    sums per-size peaks reached at different times, and keeps freed blocks cached until
    they are released: student.pinned.release_cached.)"""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def host_peak() -> int | None:
    """The process's peak resident bytes (VmHWM) since `reset_host_peak`: pinned host memory,
    the runtime's host buffers and everything else the process holds. A lower bound: the kernel
    takes the peak when memory is unmapped (freed pinned blocks, large allocations) and when it is
    read; memory given back without unmapping (madvise, as glibc trims its arenas) between two
    such points is not seen."""
    return _status_bytes("VmHWM")


def host_parts() -> dict[str, int]:
    """Where the process's resident host memory is now: the kernel's split of it (anonymous, file
    mapped, shared: /proc/self/status's RssAnon, RssFile, RssShmem) and, with CUDA, the bytes of
    pinned blocks torch's host allocator holds (handed out and cached: its allocated_bytes, rounded
    to powers of two). What a run's `host_peak` was made of, read after it while caches still hold
    their blocks; empty where neither is there."""
    import torch

    parts = {name: value for name in ("RssAnon", "RssFile", "RssShmem")
             if (value := _status_bytes(name)) is not None}
    if torch.cuda.is_available():
        parts["torch_pinned"] = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    return parts


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            line = next((line for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None
    return None if line is None else int(line.split()[1]) * 1024  # "VmHWM:  123 kB"


def device_name() -> str:
    """The CUDA device's name, else the CPU's model name and core count."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU {cpu}, {os.cpu_count()} cores"


def commit() -> str:
    """The checkout's short commit, with "-dirty" when tracked files differ from it; the
    environment variable DISTILL_BENCH_COMMIT overrides it (a copy of the tree without .git, or
    with a stale one, as on the device machine)."""
    return os.environ.get("DISTILL_BENCH_COMMIT") or _git_commit()


@functools.cache
def _git_commit() -> str:
    """Read once a process: the rows a benchmark appends to the tracked results.jsonl would
    otherwise mark its later rows dirty."""

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return head + ("-dirty" if head != "unknown" and git("status", "--porcelain", "--untracked-files=no") else "")


def add_results_arg(parser) -> None:
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help=f"JSON-lines file the rows are appended to (default {DEFAULT_RESULTS.name} beside this script)")


@dataclass
class Results:
    """Collects a benchmark's rows and appends each to `path` as it is added. Ids are unique in
    the file: a case measured again at the same commit gets "#2", "#3", ... after its id."""

    bench: str
    path: Path = DEFAULT_RESULTS
    rows: list = field(default_factory=list)

    def add(self, case: str, figures: dict, config: dict | None = None) -> dict:
        """Append one measurement: `case` names it within the bench (e.g. "V49152-N8192/ours"),
        `figures` are its numbers (ms, GiB, TFLOP/s, ratios), `config` its settings."""
        sha = commit()
        base_id = f"{self.bench}/{case}@{sha.split('-')[0]}"
        taken = {row["id"] for row in load_rows(self.path)}
        row_id, n = base_id, 1
        while row_id in taken:
            n += 1
            row_id = f"{base_id}#{n}"
        row = {"id": row_id, "bench": self.bench, "case": case,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "commit": sha, "device": device_name(),
               "command": _command_line(),
               "figures": _plain(figures), "config": _plain(config or {})}
        self.path = Path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        self.rows.append(row)
        print(f"[{row['id']}] " + ", ".join(f"{k}={_short(v)}" for k, v in row["figures"].items()), flush=True)
        return row


# Settings outside the command line that change what a benchmark measures; a row's command
# starts with those that were set, as a shell would take them.
_RECORDED_ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF",)


def _command_line() -> str:
    env = [f"{name}={os.environ[name]}" for name in _RECORDED_ENVIRONMENT if os.environ.get(name)]
    return shlex.join([*env, Path(sys.executable).name, *sys.argv])


def _plain(obj):
    """JSON-ready: dataclasses as dicts, scalars as numbers, NaN and infinities as null, paths and
    other objects as strings."""
    if hasattr(obj, "__dataclass_fields__"):
        return _plain(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN or infinity
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # numpy / torch scalars
        return _plain(obj.item())
    return str(obj)


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def load_rows(path: Path = DEFAULT_RESULTS) -> list[dict]:
    """Every row of a results file, oldest first."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
