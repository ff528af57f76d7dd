"""run.pid: the one writer of a run directory, and which process it is (the one owner of that file).

The trainer `claim`s the directory when it starts or resumes (rank 0 of a distributed run: one
lock per run, not per rank) and `release`s it when it returns or raises. The claim is an flock on
run.pid held for the run's life, with {"pid", "host"} of the holder written in it: a second
trainer into the same `--out` is refused while the first runs (RunLockedError names the holder).
The kernel drops the lock when its process dies, kill -9 included, so the run.pid a killed trainer
leaves behind (naming a dead pid) is taken over by the next claim. Over NFS the lock holds between
hosts where the server supports locks; a filesystem without locks gets a warning and the pid file
alone, as before the lock.

pipelines/experiments.py reads the file (`owner`) to say whether a run is still running: a pid is
only meaningful on the host that wrote it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
from pathlib import Path

from distill.errors import DistillUserError
from distill.files import try_lock, unlock_and_remove

__all__ = ["PID_FILE", "RunLockedError", "claim", "owner", "release"]

PID_FILE = "run.pid"  # {"pid": int, "host": str}; the trainer holds an flock on it while it runs

log = logging.getLogger(__name__)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # flock's "this filesystem cannot"
_held: dict[Path, object] = {}  # run directory (resolved) -> the open run.pid this process holds


class RunLockedError(DistillUserError):
    """Another trainer holds the run directory."""


def claim(run_dir: Path) -> None:
    """Take the run directory for this process, on this host, until `release` (or the process
    ends); raises RunLockedError while another trainer holds it (also another claim of this one)."""
    run_dir = Path(run_dir)
    path = run_dir / PID_FILE
    try:
        lock_file = try_lock(path)
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        log.warning("warning: %s cannot be locked (%s): nothing stops a second train-student from writing this "
                    "--out; make sure only one runs", path, e.strerror)
        lock_file = open(path, "a+b")
    if lock_file is None:
        holder = owner(run_dir)
        who = f"pid {holder['pid']} on {holder.get('host', '?')}" if holder else "a process that is starting"
        raise RunLockedError(f"--out {run_dir} is being trained by another train-student ({who}); wait for it to "
                             "finish or stop it, or give another --out")
    lock_file.seek(0)
    lock_file.truncate()  # in place: a rename would put a new, unlocked file at the name
    lock_file.write((json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode())
    lock_file.flush()
    _held[run_dir.resolve()] = lock_file


def owner(run_dir: Path) -> dict | None:
    """The run's {"pid", "host"}, or None without a readable one (never written, removed, torn by
    hand, or `run_dir` is not a directory)."""
    try:
        found = json.loads((Path(run_dir) / PID_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("pid"), int) else None


def release(run_dir: Path) -> None:
    """Remove run.pid and let go of the run, if this process claimed it; else do nothing (a claim
    refused, or another trainer's file)."""
    try:
        key = Path(run_dir).resolve()
    except OSError:
        return
    lock_file = _held.pop(key, None)
    if lock_file is not None:
        unlock_and_remove(lock_file, key / PID_FILE)
