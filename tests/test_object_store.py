"""Caches on an object store: cache-teacher --out s3://..., job-array workers and cache-merge,
verify, cache-stats and CacheReader, against a local S3-compatible server (moto) this test starts.
A cache built there equals the local build of the same input (same cache_id, same shard checksums,
equal arrays); a partial upload a kill left is not taken for a shard."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from cli_helpers import one_error_line, run_cli

pytest.importorskip("s3fs", reason="needs s3fs (in the dev extra: pip install -e '.[dev]')")
moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (in the dev extra: pip install -e '.[dev]')")

SMALL = ["--max-sequences", "5", "--seq-len", "32", "-k", "8", "--shard-size", "2", "-q"]
BUCKET = "caches"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free port, found by s3fs through AWS_ENDPOINT_URL; yields its fsspec filesystem."""
    import fsspec

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
        server.stop()


def _build(tiny_teacher, out, capsys, *extra):
    code, stdout, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL, *extra], capsys)
    assert code == 0, err
    return stdout


def _manifest(fs_or_path, where) -> dict:
    text = fs_or_path.cat_file(where).decode() if hasattr(fs_or_path, "cat_file") else where.read_text()
    return json.loads(text)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["zarr", "parquet"])
def test_cache_on_s3_equals_local_and_every_reader_opens_it(s3, tiny_teacher, tmp_path, capsys, storage):
    from teacher_cache.reader import CacheReader

    local = tmp_path / "local"
    _build(tiny_teacher, local, capsys, "--storage", storage)
    url = f"s3://{BUCKET}/{storage}/cache"
    _build(tiny_teacher, url, capsys, "--storage", storage)

    remote, here = _manifest(s3, f"{BUCKET}/{storage}/cache/manifest.json"), _manifest(None, local / "manifest.json")
    assert remote["status"] == "complete" and remote["cache_id"] == here["cache_id"]
    assert [(s["name"], s["checksum"], s["bytes"]) for s in remote["shards"]] == \
           [(s["name"], s["checksum"], s["bytes"]) for s in here["shards"]]
    code, stdout, _ = run_cli(["verify", url], capsys)
    assert code == 0 and " ok" in stdout
    code, stdout, _ = run_cli(["cache-stats", url, "--json"], capsys)
    assert code == 0 and json.loads(stdout)["tokens"] == here["data"]["tokens"]
    a, b = CacheReader(url), CacheReader(f"file://{local}")
    for i in range(len(b)):
        for name in ("input_ids", "topk_ids", "topk_logprobs", "tail_logmass", "target_logprob"):
            np.testing.assert_array_equal(getattr(a[i], name), getattr(b[i], name))
    assert _build(tiny_teacher, url, capsys, "--storage", storage).endswith("nothing to do\n")  # found complete

    s3.rm(f"{BUCKET}/{storage}/cache/shards/00001.{storage}", recursive=True)  # damage: repaired by a rerun
    code, stdout, err = run_cli(["verify", url], capsys)
    assert "00001" in one_error_line(code, err)
    assert "repaired" in _build(tiny_teacher, url, capsys, "--storage", storage)
    assert _manifest(s3, f"{BUCKET}/{storage}/cache/manifest.json")["shards"] == remote["shards"]


@pytest.mark.slow
def test_job_array_on_s3_ignores_a_partial_upload_then_merges(s3, tiny_teacher, tmp_path, capsys):
    """Worker 0 of 2 writes shards 0 and 2; a kill mid-upload left objects of shard 1 but not its
    root zarr.json: cache-merge names shard 1 and worker 1, and worker 1 replaces the partial
    shard, after which cache-merge completes the cache equal to a one-process build."""
    local = tmp_path / "local"
    _build(tiny_teacher, local, capsys, "--storage", "zarr")
    prefix = f"{BUCKET}/array/cache"
    url = f"s3://{prefix}"
    _build(tiny_teacher, url, capsys, "--storage", "zarr", "--num-workers", "2", "--worker-index", "0")
    s3.pipe_file(f"{prefix}/shards/00001.zarr/input_ids/zarr.json", b"{partial")
    code, _, err = run_cli(["cache-merge", url, "--num-workers", "2"], capsys)
    line = one_error_line(code, err)
    assert "00001.zarr" in line and "--worker-index 1 of --num-workers 2" in line and "00000" not in line

    _build(tiny_teacher, url, capsys, "--storage", "zarr", "--num-workers", "2", "--worker-index", "1")
    code, stdout, err = run_cli(["cache-merge", url], capsys)
    assert code == 0, err
    remote, here = _manifest(s3, f"{prefix}/manifest.json"), _manifest(None, local / "manifest.json")
    assert remote["cache_id"] == here["cache_id"]
    assert [s["checksum"] for s in remote["shards"]] == [s["checksum"] for s in here["shards"]]


def test_a_training_run_keeps_a_cache_url_as_given():
    """train-student --cache s3://...: the run's config keeps the URL (a local path is made
    absolute; Path.resolve would turn the URL into a local path)."""
    from student.step import resolve
    from student.train_config import TrainConfig

    config = TrainConfig(cache="s3://bucket/caches/a", out="run", teacher="teacher", num_layers=2, device="cpu")
    assert resolve(config).cache == ("s3://bucket/caches/a",)
