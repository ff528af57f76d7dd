"""student.host_threads: a thread other than the main one that ran a large CPU op keeps an OpenMP team
of its own (torch's thread count of threads, alive while it lives), which is what throttles every
team of the process once they outnumber its CPUs; after `run_serially_here` it runs the op alone
and adds no thread, while the main thread keeps its count. The autograd engine's thread for a CUDA
device runs serially after `one_openmp_team` (GPU). In fresh processes: a team, once made, stays."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import json, os, threading, time, torch
    from student.host_threads import one_openmp_team, run_serially_here

    torch.set_num_threads(3)
    torch.ones(1 << 22).add_(1)  # the main thread's team
    threads = lambda: len(os.listdir("/proc/self/task"))

    def held_thread(serial):
        # one large CPU op on a thread that lives on after it, as the autograd engine's and the loader's do
        ran, release, seen = threading.Event(), threading.Event(), {}
        def run():
            seen["set"] = run_serially_here() if serial else None
            seen["count"] = torch.get_num_threads()
            torch.ones(1 << 22).add_(1)
            ran.set()
            release.wait()
        before = threads()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        ran.wait()
        seen["added"] = threads() - before - 1  # beyond the thread itself
        release.set()
        thread.join()
        for _ in range(500):  # a team leaves with its thread, its threads a moment later
            if threads() <= before:
                break
            time.sleep(0.01)
        return seen

    serial = held_thread(True)
    plain = held_thread(False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    one_openmp_team(device)
    x = torch.zeros(1, device=device, requires_grad=True)
    seen = {}
    class Probe(torch.autograd.Function):  # a backward that does a large CPU op where backwards run
        @staticmethod
        def forward(ctx, x):
            return x.clone()
        @staticmethod
        def backward(ctx, grad):
            seen["main"] = threading.current_thread() is threading.main_thread()
            seen["count"] = torch.get_num_threads()
            torch.ones(1 << 22).add_(1)
            return grad
    before = threads()
    Probe.apply(x).sum().backward()
    seen["added"] = threads() - before
    print(json.dumps({"serial": serial, "plain": plain, "main_set": run_serially_here(),
                      "main_count": torch.get_num_threads(), "backward": seen, "device": device}))
""")


@pytest.fixture(scope="module")
def seen():
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are counted in /proc: Linux only")
    if not torch.backends.openmp.is_available():
        pytest.skip("torch runs without OpenMP here: no teams to keep")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout
    return json.loads(out.splitlines()[-1])


def test_a_thread_run_serially_adds_no_team_where_a_plain_one_adds_its_own(seen):
    assert seen["plain"]["count"] == 3 and seen["plain"]["added"] == 2, seen["plain"]  # itself and 2 more
    assert seen["serial"] == {"set": True, "count": 1, "added": 0}


def test_the_main_thread_keeps_its_team(seen):
    assert seen["main_set"] is False and seen["main_count"] == 3


def test_the_backward_on_a_cuda_device_runs_serially_after_one_openmp_team(seen):
    if seen["device"] != "cuda":
        pytest.skip("needs CUDA: on the CPU the backward runs on the calling (main) thread")
    assert seen["backward"] == {"main": False, "count": 1, "added": 0}
