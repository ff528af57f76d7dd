"""One OpenMP team a training process: the main thread's.

torch runs a large CPU op in parallel on the calling thread's OpenMP team, and GNU OpenMP (the runtime
torch's wheels ship) gives every thread that does so a team of its own, as many threads as torch's
thread count, kept as long as that thread lives. Once the process holds more such threads than it has
CPUs, every team's threads stop spinning between parallel regions and sleep instead (libgomp's
`do_spin`: the spin count drops to the throttled one while `gomp_managed_threads` exceeds
`gomp_available_cpus`), so every region pays a wake-up. The optimizers' CPU steps
(kernels/adamw8bit_step.py, kernels/foam_step.py) are thousands of short regions an update and ran
over twice as slowly so (notes/long-context.md, "One OpenMP team a process"). The autograd engine's
thread for a CUDA device did it: it runs the backward and with it the sparse key/value store's host
gathers. The loader's workers would too: they pin batches, a large copy each.

So the other threads that run CPU ops run them alone (`run_serially_here`): the loader's workers as they
start (student/data.py), the autograd thread once, from `one_openmp_team`.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
from pathlib import Path

import torch

__all__ = ["one_openmp_team", "run_serially_here"]


@functools.cache
def _openmp():
    """`omp_set_num_threads` of the OpenMP runtime torch runs on (the one loaded from torch's own
    folder, else the first loaded, else the process's global one), or None where there is none."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        with open("/proc/self/maps") as maps:
            loaded = dict.fromkeys(line.split()[-1] for line in maps if re.search(r"/lib(g|i|)omp[^/]*\.so", line))
    except OSError:  # no /proc: only the global namespace is searched
        loaded = {}
    ours = str(Path(torch.__file__).parent)
    for path in sorted(loaded, key=lambda path: not path.startswith(ours)) + [None]:
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def run_serially_here() -> bool:
    """Run the calling thread's CPU torch ops on this thread alone, without an OpenMP team; the
    other threads keep their count. Nothing on the main thread (its team is the process's one).
    Returns whether the count was set."""
    set_threads = _openmp()
    if set_threads is None or threading.current_thread() is threading.main_thread():
        return False
    torch.get_num_threads()  # torch sets a thread's count from its own at the thread's first call: before ours
    set_threads(1)
    return torch.get_num_threads() == 1


class _Serially(torch.autograd.Function):
    """An identity whose backward runs `run_serially_here` on the thread running it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        run_serially_here()
        return grad


def one_openmp_team(device) -> None:
    """Keep this process's CPU parallelism in the main thread's team: on a CUDA `device`, a tiny
    backward there, so that the autograd engine's thread for it (it runs every backward on that
    device, for the rest of the process) runs its CPU ops alone. Nothing on the CPU, where the
    backward runs on the calling thread."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    x = torch.zeros(1, device=device, requires_grad=True)
    _Serially.apply(x).sum().backward()
