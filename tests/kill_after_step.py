"""Train as a command would, and die by SIGKILL right after training step N (its metrics row and any
checkpoint written), as a kill at that moment would: the library's `train(on_step=...)` seam, for
runs that start as a command (under torchrun) or inside a recipe.

    python tests/kill_after_step.py N -m distill train-student ...   # the CLI in this process
    python tests/kill_after_step.py N -c "python code that ends up in student.trainer.train"
"""

from __future__ import annotations

import functools
import os
import runpy
import signal
import sys


def kill_after(step: int):
    """An on_step callback that SIGKILLs this process once `step` is done."""
    def on_step(done: int) -> None:
        if done == step:
            os.kill(os.getpid(), signal.SIGKILL)
    return on_step


def main(argv: list[str]) -> None:
    import student.trainer

    step, mode, target, *rest = argv
    # Callers reach train() through the module (the CLI and recipes import it when they run).
    student.trainer.train = functools.partial(student.trainer.train, on_step=kill_after(int(step)))
    if mode == "-m":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<kill_after_step>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main(sys.argv[1:])
