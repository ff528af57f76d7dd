"""run.pid (student/run_owner.py): who trains a run directory."""

import json
import os
import socket

from student.run_owner import PID_FILE, claim, owner, release


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
