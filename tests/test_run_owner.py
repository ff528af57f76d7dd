"""run.pid (student/run_owner.py): who trains a run directory, and the lock that makes it one."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from student.run_owner import PID_FILE, RunLockedError, claim, owner, release
from test_trainer import REPO, tiny  # noqa: F401  (tiny: the module-scoped fixture)


def test_a_claim_names_this_process_and_its_release_removes_it(tmp_path):
    claim(tmp_path)
    assert owner(tmp_path) == {"pid": os.getpid(), "host": socket.gethostname()}
    release(tmp_path)
    assert not (tmp_path / PID_FILE).exists() and owner(tmp_path) is None


def test_release_leaves_another_trainers_claim(tmp_path):
    for other in ({"pid": os.getpid() + 1, "host": socket.gethostname()},
                  {"pid": os.getpid(), "host": "node-7-" + socket.gethostname()}):
        (tmp_path / PID_FILE).write_text(json.dumps(other))
        release(tmp_path)
        assert owner(tmp_path) == other


def test_an_unreadable_claim_is_none(tmp_path):
    (tmp_path / PID_FILE).write_text('{"pid": 12')  # torn
    assert owner(tmp_path) is None
    (tmp_path / PID_FILE).write_text('{"pid": "12"}')
    assert owner(tmp_path) is None
    afile = tmp_path / "a-file"
    afile.write_text("")
    assert owner(afile) is None
    release(afile)  # --out that is a file: nothing to release, no error


# --- the lock: one trainer per run directory ---------------------------------------------------

_HOLDER = """
import sys
from student.run_owner import claim
claim(sys.argv[1])
print("claimed", flush=True)
sys.stdin.read()  # holds the run until the test closes stdin or kills it
"""


def _holder(run_dir):
    """A second process that claims `run_dir` and holds it; returns it once it has."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir)], env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed", proc.stderr.read()
    return proc


def test_a_claim_held_by_another_process_is_refused_naming_it_until_it_exits(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunLockedError) as e:
            claim(tmp_path)
        message = str(e.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in message and "--out" in message
        assert "\n" not in message
        release(tmp_path)  # the refused claim's release (the trainer's finally) leaves the holder's file
        assert owner(tmp_path) == {"pid": proc.pid, "host": socket.gethostname()}
        proc.stdin.close()  # the holder returns without release(): its exit lets go of the lock
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    claim(tmp_path)
    assert owner(tmp_path) == {"pid": os.getpid(), "host": socket.gethostname()}
    release(tmp_path)


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert owner(tmp_path)["pid"] == proc.pid  # left behind, naming a dead pid
    claim(tmp_path)
    assert owner(tmp_path) == {"pid": os.getpid(), "host": socket.gethostname()}
    release(tmp_path)
    assert not (tmp_path / PID_FILE).exists()


def test_a_second_claim_in_one_process_is_refused_and_the_first_holds(tmp_path):
    claim(tmp_path)
    try:
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            claim(tmp_path)
        assert owner(tmp_path)["pid"] == os.getpid()
    finally:
        release(tmp_path)
    claim(tmp_path)  # released: free again
    release(tmp_path)


def test_a_lock_file_removed_between_open_and_lock_is_not_held(tmp_path):
    """try_lock's check: a lock taken on a file its holder removed meanwhile is taken again on the
    file now at the path, so two takers never hold two different files of one name."""
    from distill.files import try_lock, unlock_and_remove

    path = tmp_path / "LOCK"
    first = try_lock(path)
    assert try_lock(path) is None
    stale = open(path, "a+b")  # a taker that opened the file just before its holder removed it
    unlock_and_remove(first, path)
    second = try_lock(path)
    assert second is not None and os.path.samestat(os.fstat(second.fileno()), os.stat(path))
    import fcntl

    fcntl.flock(stale.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file's lock protects nothing...
    assert not path.exists() or not os.path.samestat(os.fstat(stale.fileno()), os.stat(path))  # ...and is told so
    stale.close()
    second.close()


def test_a_second_train_student_into_a_running_out_is_refused(tmp_path, capsys, tiny):  # noqa: F811
    """Two real trainers: while one trains, `train-student` into its --out prints one error line
    naming the holder's pid and host and exits non-zero, leaving the first training; once the
    first is killed (kill -9), the same command takes the run over and finishes it."""
    from cli_helpers import one_error_line, run_cli

    student, cache, _ = tiny
    out = tmp_path / "run"
    args = ["train-student", "--cache", str(cache), "--student", str(student), "--out", str(out), "--batch-size", "2",
            "--heldout", "2", "--device", "cpu", "--eval-every", "0", "--save-every", "0", "--log-every", "1", "-q"]
    proc = subprocess.Popen([sys.executable, "-m", "distill", *args, "--steps", "100000"],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and '"train"' in (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.5)
        code, _, err = run_cli([*args, "--steps", "100000"], capsys)
        line = one_error_line(code, err)
        assert f"pid {proc.pid} on {socket.gethostname()}" in line and f"--out {out}" in line, line
        assert proc.poll() is None and owner(out) == {"pid": proc.pid, "host": socket.gethostname()}
        rows_then = (out / "metrics.jsonl").read_text().count('"train"')
        deadline = time.monotonic() + 120
        while (out / "metrics.jsonl").read_text().count('"train"') <= rows_then:  # the first trains on
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        proc.kill()
    proc.wait(timeout=60)
    assert owner(out)["pid"] == proc.pid  # a dead pid's file, its lock gone with the process
    code, _, err = run_cli([*args, "--steps", "1"], capsys)
    assert code == 0, err
    assert (out / "student").is_dir() and not (out / PID_FILE).exists()
