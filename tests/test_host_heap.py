"""student.host_heap: with the heap keeping freed pieces, the 8-bit AdamW CPU step faults no fresh pages
in after its first update, where a heap that maps every megabyte block afresh faults them all in again
on every update (glibc's starting behaviour, made certain here by fixing its mmap threshold at its
starting 128 KiB; a fresh process only sometimes keeps it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, ctypes.util, resource, torch
    from student.host_heap import keep_freed_pieces
    from student.optim.adam8bit import AdamW8bit

    torch.set_num_threads(1)
    def faults_per_update(opt, updates=3):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(updates):
            opt.step()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / updates

    p = torch.nn.Parameter(torch.randn(2048, 4096))
    p.grad = torch.randn_like(p) * 1e-3
    opt = AdamW8bit([p], lr=1e-3)
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD fixed at its start
    opt.step()
    before = faults_per_update(opt)
    kept = keep_freed_pieces()
    opt.step()  # the heap grows to the pieces' temporaries once
    after = faults_per_update(opt)
    print(kept, before, after)
""")


def test_kept_pieces_fault_no_pages_in_after_the_first_update():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt and ru_minflt: Linux only")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout.split()
    kept, before, after = out[0] == "True", float(out[1]), float(out[2])
    if not kept:
        pytest.skip("this C library is not glibc: keep_freed_pieces changes nothing")
    pages = 2048 * 4096 * 4 // 4096  # the parameter's own fp32 bytes in 4 KiB pages
    assert before > pages, f"the mapped heap faulted only {before:.0f} pages in an update"
    # a few hundred faults remain at times (Python's own small allocations), against 20x the pages
    assert after < 0.1 * pages, f"the kept heap still faulted {after:.0f} pages in an update"
