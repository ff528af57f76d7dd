"""Stage one on Ray (`cache-teacher --executor ray`): a local Ray of 2 CPUs, started once for the
module, builds caches with the tiny teacher. A worker killed (SIGKILL) in the middle of a shard is
retried by Ray, and the cache still equals the one-process build (same cache_id, byte-identical
shards, so every array is equal); a failed Ray run resumes. The faults come through
``cache_teacher``'s ``wrap_teacher`` seam (tests/ray_faults.py). Skipped where ray is not
installed."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import one_error_line, run_cli, run_cli_ok
from ray_faults import fail_shard

# 7 sequences in shards of 2: 4 shards, the last one short. batch-size 1: a shard's two sequences
# are scored one after the other, so a fault (tests/ray_faults.py) cuts it between them.
SMALL = ["--max-sequences", "7", "--seq-len", "32", "-k", "8", "--shard-size", "2", "--batch-size", "1", "-q"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_teacher) -> Path:
    out = tmp_path_factory.mktemp("one") / "cache"
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL])
    return out


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    # The workers import this checkout's packages, as the driver does, and tests/ray_faults.py.
    here = Path(__file__).resolve().parent
    paths = (str(here.parent), str(here), os.environ.get("PYTHONPATH"))
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _shards(cache: Path) -> tuple[str, list[tuple[str, str]]]:
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    return manifest["cache_id"], [(s["name"], s["checksum"]) for s in manifest["shards"]]


def _build(tiny_teacher, out, capsys, *extra):
    return run_cli(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL, "--executor", "ray", *extra],
                   capsys)


def test_unreachable_cluster_is_one_line(tiny_teacher, tmp_path, capsys):
    ray = pytest.importorskip("ray")
    import socket

    # First in the file: before the module's local Ray starts (a connected process uses its cluster).
    assert not ray.is_initialized()

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = _build(tiny_teacher, tmp_path / "c", capsys, "--ray-address", f"127.0.0.1:{port}")
    line = one_error_line(code, err)
    assert f"127.0.0.1:{port}" in line and "--ray-address" in line


@pytest.mark.slow
def test_worker_killed_mid_shard_is_retried_and_cache_equals_one_process(local_ray, one_process, tiny_teacher,
                                                                        tmp_path):
    from pipelines.stage_one import StageOneConfig, TeacherConfig, cache_teacher
    from pipelines.corpus import CorpusConfig
    from teacher_cache.build import CacheConfig
    from teacher_cache.reader import CacheReader

    marker = tmp_path / "killed"
    out = tmp_path / "cache"
    config = StageOneConfig(
        teacher=TeacherConfig(model=tiny_teacher),
        corpus=CorpusConfig(seq_len=32, max_sequences=7),
        cache=CacheConfig(out=out, k=8, shard_size=2, batch_size=1, executor="ray"))
    report = cache_teacher(config, progress=False, wrap_teacher=fail_shard(1, "kill", marker))
    killed = int(marker.read_text())  # shard 1's first attempt ran, in this worker process
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)  # which was killed in the middle of the shard
    assert report.finalized and report.written_shards == 4
    # One teacher load per worker process that returned shards, whatever number it wrote.
    assert report.extra["ray"]["teacher_loads"] == len(report.extra["ray"]["workers"])
    assert _shards(out) == _shards(one_process)
    assert not [p.name for p in (out / "shards").iterdir() if p.name.startswith(".")]  # no temp file left
    ours, theirs = CacheReader(out), CacheReader(one_process)
    assert len(ours) == len(theirs) == 7
    for a, b in zip(ours, theirs):  # every array equal, decoded
        for name in ("input_ids", "topk_ids", "topk_logprobs", "tail_logmass", "target_logprob"):
            assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True), name


@pytest.mark.slow
def test_failed_ray_run_resumes_and_equals_one_process(local_ray, one_process, tiny_teacher, tmp_path, capsys,
                                                      monkeypatch):
    """A task that raises is not retried: the run fails in one line naming the shard, keeps the
    shards written, and the same command afterwards scores only the missing one."""
    import pipelines.stage_one

    out = tmp_path / "cache"
    # The CLI calls pipelines.stage_one.cache_teacher; this one passes the fault to the Ray tasks.
    monkeypatch.setattr(pipelines.stage_one, "cache_teacher", functools.partial(
        pipelines.stage_one.cache_teacher, wrap_teacher=fail_shard(2, "raise", tmp_path / "raised")))
    code, _, err = _build(tiny_teacher, out, capsys)
    line = one_error_line(code, err)
    assert "shard 2 " in line and "rerun the same command to resume" in line and "RuntimeError" in line
    assert json.loads((out / "manifest.json").read_text())["status"] == "incomplete"
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    assert sorted(kept) == ["00000.parquet", "00001.parquet", "00003.parquet"]

    code, stdout, err = _build(tiny_teacher, out, capsys)  # the marker exists: no fault this time
    assert code == 0, err
    assert "complete" in stdout and "3 shards kept" in stdout
    assert _shards(out) == _shards(one_process)
    assert all((out / "shards" / name).stat().st_mtime_ns == t for name, t in kept.items())  # not scored again


def test_executor_ray_refuses_num_workers_in_one_line(tiny_teacher, tmp_path, capsys):
    code, _, err = _build(tiny_teacher, tmp_path / "c", capsys, "--num-workers", "2", "--worker-index", "1")
    line = one_error_line(code, err)
    assert "--executor" in line and "--num-workers 2" in line


def test_ray_address_without_executor_ray_is_refused(tiny_teacher, tmp_path, capsys):
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "c", *SMALL,
                            "--ray-address", "127.0.0.1:6379"], capsys)
    assert "--ray-address" in one_error_line(code, err) and "--executor ray" in err


def test_missing_ray_names_the_extra(tiny_teacher, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code, _, err = _build(tiny_teacher, tmp_path / "c", capsys)
    line = one_error_line(code, err)
    assert "distill[ray]" in line and "--executor ray" in line
    assert not (tmp_path / "c").exists()


def test_task_device_and_resources_follow_the_cluster():
    """GPU tasks reserve the teacher's GPUs (tensor parallel: several), CPU tasks CPUs; auto picks
    a GPU only where the cluster has one; a device Ray cannot honour is refused in one line."""
    from distill.errors import DistillUserError
    from teacher_cache.ray_executor import RayCluster, RayConfig

    gpu, cpu = RayCluster(RayConfig(), gpus=8, cpus=64), RayCluster(RayConfig(), gpus=0, cpus=2)
    assert gpu.task_device("auto") == gpu.task_device("cuda") == "cuda" and gpu.task_device("cpu") == "cpu"
    assert cpu.task_device("auto") == "cpu"
    with pytest.raises(DistillUserError, match="--device is 'cuda' but the Ray cluster has no GPU"):
        cpu.task_device("cuda")
    with pytest.raises(DistillUserError, match="--device must be auto, cuda or cpu with --executor ray .*got 'cuda:1'"):
        gpu.task_device("cuda:1")
    options = gpu.teacher(print, {"backend": "vllm"}, 10, "cuda", gpus_per_task=2)._task_options()
    assert options["num_gpus"] == 2 and "num_cpus" not in options and options["max_retries"] == 3
    options = cpu.teacher(print, {"backend": "hf"}, 10, "cpu")._task_options()
    assert options["num_cpus"] == 1 and "num_gpus" not in options and not options["retry_exceptions"]


@pytest.mark.slow
def test_sampled_cache_on_ray_equals_one_process(local_ray, tiny_teacher, tmp_path, capsys):
    """A sampled cache's draws depend on the seed and each sequence's index in the cache only, so
    the shards Ray's tasks write equal the one-process ones."""
    sampled = ["--targets", "sampled", "--samples", "12", "--seed", "3"]
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "one", *SMALL, *sampled],
                           capsys)
    assert code == 0, err
    code, _, err = _build(tiny_teacher, tmp_path / "ray", capsys, *sampled)
    assert code == 0, err
    assert _shards(tmp_path / "ray") == _shards(tmp_path / "one")
    assert json.loads((tmp_path / "ray" / "manifest.json").read_text())["targets"]["kind"] == "sampled"


def test_wrap_teacher_needs_the_ray_executor(tmp_path):
    """The fault seam reaches only Ray tasks: asked of a local build, it is refused before any work."""
    from pipelines.stage_one import StageOneConfig, cache_teacher
    from teacher_cache.build import CacheConfig

    config = StageOneConfig(cache=CacheConfig(out=tmp_path / "c"))
    with pytest.raises(ValueError, match="wrap_teacher .* needs the cache executor 'ray', got 'local'"):
        cache_teacher(config, wrap_teacher=fail_shard(0, "raise", tmp_path / "m"))
    assert not (tmp_path / "c").exists()
