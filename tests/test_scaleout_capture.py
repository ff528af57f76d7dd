"""Stage one on several processes: shard assignment, job arrays with cache-merge, and torchrun
(gloo, 2 CPU ranks). Every multi-process build must equal the one-process build of the same
input: same cache_id and byte-identical shards (equal checksums), so every array is equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import one_error_line, run_cli, run_cli_ok
from teacher_cache.workers import Workers, shard_owner, worker_shards

# 7 sequences in shards of 2: 4 shards, the last one short.
SMALL = ["--max-sequences", "7", "--seq-len", "32", "-k", "8", "--shard-size", "2", "-q"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_teacher) -> Path:
    out = tmp_path_factory.mktemp("one") / "cache"
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL])
    return out


def _shards(cache: Path) -> tuple[str, list[tuple[str, str]]]:
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    return manifest["cache_id"], [(s["name"], s["checksum"]) for s in manifest["shards"]]


@pytest.mark.parametrize("num_shards", [0, 1, 4, 7, 8])
@pytest.mark.parametrize("num_workers", [1, 2, 3, 5])
def test_shard_assignment_is_disjoint_complete_and_round_robin(num_shards, num_workers):
    parts = [worker_shards(num_shards, num_workers, w) for w in range(num_workers)]
    assert sorted(i for part in parts for i in part) == list(range(num_shards))
    for w, part in enumerate(parts):
        assert all(shard_owner(i, num_workers) == w for i in part)
        assert part == Workers(num_workers, w).shards(num_shards)  # deterministic, one rule
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced


def test_worker_index_out_of_range_is_one_line_naming_the_option(tiny_teacher, tmp_path, capsys):
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "c", *SMALL,
                            "--num-workers", "2", "--worker-index", "2"], capsys)
    assert "--worker-index" in one_error_line(code, err) and "got 2" in err


def test_job_array_then_merge_equals_one_process(one_process, tiny_teacher, tmp_path, capsys):
    out = tmp_path / "cache"
    worker = lambda i: run_cli(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL,
                                "--num-workers", "2", "--worker-index", str(i)], capsys)
    code, stdout, err = worker(1)
    assert code == 0, err
    assert "worker 1 of 2 wrote its shards" in stdout and "cache-merge" in stdout
    assert json.loads((out / "manifest.json").read_text())["status"] == "incomplete"
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["00001.parquet", "00003.parquet"]

    code, _, err = run_cli(["cache-merge", out, "--num-workers", "2"], capsys)
    line = one_error_line(code, err)
    assert "00000.parquet, 00002.parquet" in line and "--worker-index 0 of --num-workers 2" in line

    code, _, err = worker(0)
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["status"] == "incomplete"  # a worker never completes
    code, stdout, err = run_cli(["cache-merge", out], capsys)
    assert code == 0, err
    assert _shards(out) == _shards(one_process)
    code, stdout, _ = run_cli(["verify", out], capsys)
    assert code == 0 and " ok" in stdout


@pytest.mark.slow
def test_torchrun_two_ranks_resume_another_world_size_and_equal_one_process(one_process, tiny_teacher, tmp_path,
                                                                           capsys):
    """An interrupted 3-worker build (only worker 1 ran: shard 1 of 4) is finished by torchrun
    with 2 ranks, which skip shard 1 whoever wrote it; rank 0 writes the manifest."""
    out = tmp_path / "cache"
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL,
                            "--num-workers", "3", "--worker-index", "1"], capsys)
    assert code == 0, err
    kept = (out / "shards" / "00001.parquet").stat().st_mtime_ns
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "distill", "cache-teacher", "--model", str(tiny_teacher), "--out", str(out), *SMALL]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "complete" in done.stdout and "rank 0 wrote the manifest" in done.stdout
    assert _shards(out) == _shards(one_process)
    assert (out / "shards" / "00001.parquet").stat().st_mtime_ns == kept  # not scored again


def test_tensor_parallel_size_reaches_vllm_and_only_vllm(tiny_teacher, tmp_path, capsys, monkeypatch):
    """--tensor-parallel-size goes to vllm.LLM through the backend's engine_kwargs; the hf backend refuses it."""
    import teacher_cache.backends

    seen = {}

    def fake_backend(name, model_dir, **kwargs):
        seen.update(kwargs, name=name)
        raise SystemExit(0)  # the plumbing is all this test checks; no engine is started

    monkeypatch.setattr(teacher_cache.backends, "make_backend", fake_backend)
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "c", *SMALL,
                            "--backend", "vllm", "--tensor-parallel-size", "4"], capsys)
    assert code == 0, err
    assert seen["name"] == "vllm" and seen["engine_kwargs"] == {"tensor_parallel_size": 4}
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "d", *SMALL,
                            "--tensor-parallel-size", "2"], capsys)
    assert "--tensor-parallel-size" in one_error_line(code, err) and "got 2" in err
