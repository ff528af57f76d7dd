"""Whether and how a training run offloads: the `offload` part of TrainConfig, and the one place a
memory size given as text ("40GiB") becomes bytes. Torch-free: the CLI builds it for its options."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distill.configs import ConfigError, check_types, option

__all__ = ["OffloadConfig", "format_bytes", "parse_bytes", "parse_chunk_candidates"]


@dataclass
class OffloadConfig:
    """Whether and how a training run offloads (the `offload` part of TrainConfig; flat names are
    the CLI options of `distill train-student` and `distill plan`)."""

    offload: str = option("none", (
        "Train a student bigger than the GPU: none (everything on the GPU), auto (profile a step, plan under "
        "--gpu-memory / --host-memory, train with that plan) or PLAN.json (a plan `distill plan` saved). Decoder "
        "layers' fp32 weights, gradients and optimizer states then live in host memory; the results are those of "
        "--offload none."))
    # The headrooms are student/planner/profile.py's ProfileSettings.
    gpu_memory: str | None = option(None, (
        "GPU memory budget of the plan, e.g. 40GiB, for the tensors a step holds at once and a reserve for the "
        "allocator (default: the device's total, less 5%; on a CPU-only machine the host's available memory). "
        "train-student --offload also caps torch's caching allocator at it; see the README."))
    host_memory: str | None = option(
        None, "Host memory budget of the plan, e.g. 120GiB (default: the host's available memory, less 10%).")
    chunk_candidates: str | None = option(None, (
        "With --offload auto (and in distill plan): chunk sizes the planner chooses among, e.g. 4096,8192,16384; it "
        "chooses where the key/value pages live too (--kv-offload, --offload-pages) and the run trains with its "
        "choice. Default: --chunk-tokens and the pages as given."))

    def __post_init__(self):
        check_types(self)
        self._budgets = {name: None if getattr(self, name) is None else parse_bytes(getattr(self, name), name)
                         for name in ("gpu_memory", "host_memory")}
        if self.chunk_candidates is not None:
            parse_chunk_candidates(self.chunk_candidates)

    @property
    def gpu_memory_bytes(self) -> int | None:
        """gpu_memory in bytes (None when not given)."""
        return self._budgets["gpu_memory"]

    @property
    def host_memory_bytes(self) -> int | None:
        """host_memory in bytes (None when not given)."""
        return self._budgets["host_memory"]

    @property
    def candidates(self) -> tuple[int, ...] | None:
        """chunk_candidates as chunk sizes, ascending (None when not given)."""
        return None if self.chunk_candidates is None else parse_chunk_candidates(self.chunk_candidates)


def parse_bytes(text: str, field_name: str = "memory") -> int:
    """'40GiB', '1.5 TB', '512MiB', '1000000' -> bytes (binary units with an i, decimal without)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not 0 < value < math.inf:
        raise ConfigError(field_name, f"is {text!r}; give a size such as 40GiB, 512MiB or 1.5TB")
    return int(value * units[unit])


def format_bytes(n: int) -> str:
    """Bytes as GiB (or MiB, KiB below one) with one decimal, rounded up: the text given back as a
    budget (`parse_bytes` reads it) is never below `n`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size or unit == "KiB":
            return f"{math.ceil(n / size * 10 - 1e-9) / 10:.1f} {unit}"
    raise AssertionError("unreachable")


def parse_chunk_candidates(text: str) -> tuple[int, ...]:
    """'4096,8192, 16384' -> (4096, 8192, 16384): distinct chunk sizes >= 1, ascending."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ConfigError("chunk_candidates", f"is {text!r}; give distinct chunk sizes in tokens separated by commas, "
                                              "e.g. 4096,8192,16384")
    return tuple(sorted(sizes))
