"""run.pid: which process is training a run directory, the one owner of that file's format.

The trainer `claim`s the directory when it starts or resumes (rank 0 of a distributed run) and
`release`s it when it returns or raises; a killed trainer leaves its file behind, naming a dead pid.
pipelines/experiments.py reads it (`owner`) to say whether a run is still running: a pid is only
meaningful on the host that wrote it.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from distill.files import atomic_write_json

__all__ = ["PID_FILE", "claim", "owner", "release"]

PID_FILE = "run.pid"  # {"pid": int, "host": str}


def claim(run_dir: Path) -> None:
    """Name this process, on this host, as the run's trainer (written atomically)."""
    atomic_write_json(Path(run_dir) / PID_FILE, {"pid": os.getpid(), "host": socket.gethostname()})


def owner(run_dir: Path) -> dict | None:
    """The run's {"pid", "host"}, or None without a readable one (never written, removed, torn by
    hand, or `run_dir` is not a directory)."""
    try:
        found = json.loads((Path(run_dir) / PID_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("pid"), int) else None


def release(run_dir: Path) -> None:
    """Remove run.pid if this process wrote it (another trainer may have taken the directory since)."""
    found = owner(run_dir)
    if found is not None and found["pid"] == os.getpid() and found.get("host") == socket.gethostname():
        (Path(run_dir) / PID_FILE).unlink(missing_ok=True)
