"""A cache is self-sufficient: stage one stores the teacher's tokenizer files in CACHE/tokenizer/
and lists them in the manifest, so the cache alone says what bytes its token ids stand for.
Caches built before that keep their bytes and cache_id, and `distill add-tokenizer` gives them
the files; verify checks them, cache-stats says whether they are there. A tiny random Llama over
the real teacher's tokenizer keeps the builds fast."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from cli_helpers import one_error_line, run_cli, run_cli_ok
from teacher_cache.errors import CacheError
from teacher_cache.identity import tokenizer_info
from teacher_cache.manifest import Manifest, load_manifest
from teacher_cache.token_bytes import token_pieces
from teacher_cache.tokenizer_files import add_tokenizer, load_cache_tokenizer, save_tokenizer_files
from teacher_cache.verify import verify_cache

SMALL = ["--max-sequences", "4", "--seq-len", "32", "-k", "8", "--shard-size", "2", "-q"]
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, tiny_teacher) -> Path:
    out = tmp_path_factory.mktemp("tok") / "cache"
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL])
    return out


def _manifest(cache: Path) -> dict:
    return json.loads((cache / "manifest.json").read_text())


def _snapshot(cache: Path) -> dict[str, bytes]:
    """Every file of the cache, by relative name."""
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}


def _without_tokenizer(cache: Path, where: Path) -> Path:
    """A copy of ``cache`` as a distill before stored tokenizer files wrote it: no tokenizer/, no
    tokenizer.files in the manifest."""
    shutil.copytree(cache, where)
    shutil.rmtree(where / "tokenizer")
    raw = _manifest(where)
    del raw["tokenizer"]["files"]
    (where / "manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    return where


def test_a_new_cache_stores_the_teachers_tokenizer(tiny_cache, teacher_tokenizer):
    listed = _manifest(tiny_cache)["tokenizer"]["files"]
    stored = sorted(p.relative_to(tiny_cache / "tokenizer").as_posix() for p in (tiny_cache / "tokenizer").rglob("*"))
    assert sorted(listed) == stored and "tokenizer.json" in stored
    tokenizer = load_cache_tokenizer(tiny_cache)
    assert tokenizer_info(tokenizer) == tokenizer_info(teacher_tokenizer)
    ours, theirs = token_pieces(tokenizer), token_pieces(teacher_tokenizer)
    assert ours.pieces == theirs.pieces and (ours.special == theirs.special).all() and ours.scheme == "byte_level"
    assert not list(tiny_cache.glob(".*.tmp"))  # written under a temp name, then renamed


def test_an_older_manifest_loads_unchanged(tmp_path):
    """tests/fixtures/topk_v1_cache predates stored tokenizer files: it reads, writes back byte
    for byte and keeps its cache_id; it has no tokenizer to load."""
    cache = tmp_path / "cache"
    shutil.copytree(FIXTURES / "topk_v1_cache", cache)
    text = (cache / "manifest.json").read_text()
    manifest = load_manifest(cache)
    assert manifest.cache_id == json.loads(text)["cache_id"] == "014cdef5e58065ab"
    assert json.dumps(manifest.to_dict(), indent=2) + "\n" == text
    assert load_cache_tokenizer(cache) is None and verify_cache(cache).ok


def test_the_files_are_no_part_of_the_identity(tiny_cache, tmp_path):
    raw = _manifest(tiny_cache)
    old = _manifest(_without_tokenizer(tiny_cache, tmp_path / "old"))
    assert Manifest.from_dict(old).cache_id == Manifest.from_dict(raw).cache_id == raw["cache_id"]


@pytest.mark.parametrize("files, message", [
    ({"../x": "sha256:" + "0" * 64}, "relative file names"),
    ({"/etc/x": "sha256:" + "0" * 64}, "relative file names"),
    ({"tokenizer.json": "md5:00"}, "'sha256:' and 64 hex digits"),
    (["tokenizer.json"], "must be a mapping"),
])
def test_the_manifest_refuses_a_bad_file_list(tiny_cache, files, message):
    raw = _manifest(tiny_cache)
    with pytest.raises(CacheError, match=message):
        Manifest.from_dict({**raw, "tokenizer": {**raw["tokenizer"], "files": files}})


def test_add_tokenizer_gives_an_older_cache_the_files(tiny_cache, tiny_teacher, tmp_path, capsys):
    cache = _without_tokenizer(tiny_cache, tmp_path / "cache")
    before = _snapshot(cache)
    code, out, err = run_cli(["add-tokenizer", cache, tiny_teacher], capsys)
    assert code == 0, err
    assert out.strip().count("\n") == 0 and "stored the tokenizer files" in out and "cache_id unchanged" in out
    after = _snapshot(cache)
    raw = _manifest(cache)
    assert raw == _manifest(tiny_cache)  # as a new build lists the files; nothing else changed, cache_id neither
    assert {n: b for n, b in after.items() if n != "manifest.json" and not n.startswith("tokenizer/")} == {
        n: b for n, b in before.items() if n != "manifest.json"}
    assert not list(cache.glob(".*.tmp"))
    assert load_cache_tokenizer(cache) is not None and verify_cache(cache).ok


def test_add_tokenizer_killed_mid_write_leaves_the_cache_as_it_was(tiny_cache, tiny_teacher, tmp_path,
                                                                 monkeypatch):
    """The folder is written under a temp name: a failure inside save_pretrained leaves neither
    tokenizer/ nor a changed manifest (and the next claim of the folder removes the temp name)."""
    from transformers import PreTrainedTokenizerBase

    cache = _without_tokenizer(tiny_cache, tmp_path / "cache")
    before = _snapshot(cache)
    real = PreTrainedTokenizerBase.save_pretrained

    def half_then_fail(self, folder, *args, **kwargs):
        real(self, folder, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        add_tokenizer(cache, tiny_teacher)
    assert _snapshot(cache) == before and not list(cache.glob(".*.tmp"))


def test_add_tokenizer_refuses_another_tokenizer_and_leaves_the_cache(tiny_cache, teacher_tokenizer, tmp_path,
                                                                     capsys):
    cache = _without_tokenizer(tiny_cache, tmp_path / "cache")
    other = tmp_path / "other"
    teacher_tokenizer.save_pretrained(other)
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(other)
    grown.add_tokens(["<not-in-the-cache>"])
    grown.save_pretrained(other)
    before = _snapshot(cache)
    line = one_error_line(*run_cli(["add-tokenizer", cache, other], capsys)[::2])
    theirs, ours = tokenizer_info(grown)["hash"], _manifest(cache)["tokenizer"]["hash"]
    assert theirs in line and ours in line and str(other) in line and "give the teacher folder" in line
    assert _snapshot(cache) == before and not (cache / "tokenizer").exists()
    old = tmp_path / "old"  # built by an older distill from a synthetic tokenizer (hash "t0"); no LOCK file
    shutil.copytree(FIXTURES / "topk_v1_cache", old)
    before = _snapshot(old)
    line = one_error_line(*run_cli(["add-tokenizer", old, other], capsys)[::2])
    assert "(hash t0)" in line and "built from (synthetic)" in line
    assert _snapshot(old) == before and sorted(p.name for p in old.iterdir()) == ["manifest.json", "shards"]


def test_add_tokenizer_refusals_are_one_line(tiny_cache, tiny_teacher, tmp_path, capsys):
    line = one_error_line(*run_cli(["add-tokenizer", tmp_path / "nowhere", tiny_teacher], capsys)[::2])
    assert "does not exist" in line
    cache = _without_tokenizer(tiny_cache, tmp_path / "cache")
    line = one_error_line(*run_cli(["add-tokenizer", cache, tmp_path / "no-teacher"], capsys)[::2])
    assert "is not a folder" in line and "the cache was built from" in line
    raw = _manifest(cache)
    (cache / "manifest.json").write_text(json.dumps({**raw, "status": "incomplete", "shards": []}, indent=2))
    line = one_error_line(*run_cli(["add-tokenizer", cache, tiny_teacher], capsys)[::2])
    assert "not complete" in line and "cache-teacher" in line


def test_verify_and_loading_find_a_tampered_tokenizer_file(tiny_cache, tiny_teacher, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    config = cache / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 7}', 1))
    line = one_error_line(*run_cli(["verify", cache], capsys)[::2])
    assert "tokenizer_config.json: checksum differs" in line and f"distill add-tokenizer {cache}" in line
    assert "rerun `distill cache-teacher`" not in line  # the shards are whole
    with pytest.raises(CacheError, match="tokenizer_config.json: checksum differs") as caught:
        load_cache_tokenizer(cache)
    assert "\n" not in str(caught.value)
    code, out, err = run_cli(["add-tokenizer", cache, tiny_teacher], capsys)
    assert code == 0 and "replaced" in out, err
    code, out, _ = run_cli(["verify", cache], capsys)
    assert code == 0 and f"{len(_manifest(cache)['tokenizer']['files'])} tokenizer files checked" in out


def test_loading_checks_the_tokenizer_against_the_manifests_hash(tiny_cache, teacher_tokenizer, tmp_path):
    """Files whose checksums were listed anew but whose tokenizer is another one: refused."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    grown = teacher_tokenizer.__class__.from_pretrained(cache / "tokenizer")
    grown.add_tokens(["<not-in-the-cache>"])
    record = save_tokenizer_files(grown, cache)
    raw = _manifest(cache)
    (cache / "manifest.json").write_text(json.dumps({**raw, "tokenizer": {**raw["tokenizer"], **record}}, indent=2))
    with pytest.raises(CacheError, match=f"hashes {tokenizer_info(grown)['hash']}.*add-tokenizer"):
        load_cache_tokenizer(cache)


def test_cache_stats_says_whether_the_cache_can_teach_other_tokenizers(tiny_cache, tmp_path, capsys):
    code, out, _ = run_cli(["cache-stats", tiny_cache, "--json"], capsys)
    assert code == 0 and json.loads(out)["tokenizer_files"] == {"stored": True, "scheme": "byte_level",
                                                                "summary": "stored (byte_level)"}
    code, out, _ = run_cli(["cache-stats", tiny_cache], capsys)
    assert "tokenizer files" in out and "stored (byte_level)" in out
    old = _without_tokenizer(tiny_cache, tmp_path / "old")
    code, out, _ = run_cli(["cache-stats", old, "--json"], capsys)
    state = json.loads(out)["tokenizer_files"]
    assert state["stored"] is False and f"run `distill add-tokenizer {old} TEACHER`" in state["summary"]
    code, out, _ = run_cli(["cache-stats", old], capsys)
    assert "not stored: run `distill" in out


def test_cache_stats_names_a_stored_tokenizer_it_cannot_read_bytes_from(tiny_cache, tmp_path, capsys):
    """A tokenizer.json that is neither byte-level BPE nor byte fallback (same vocabulary, so the
    same hash): stored, but it cannot teach other tokenizers."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    path = cache / "tokenizer" / "tokenizer.json"
    backend = json.loads(path.read_text())
    backend["pre_tokenizer"] = backend["decoder"] = backend["post_processor"] = None
    path.write_text(json.dumps(backend))
    raw = _manifest(cache)
    files = {**raw["tokenizer"]["files"], "tokenizer.json": "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()}
    (cache / "manifest.json").write_text(json.dumps({**raw, "tokenizer": {**raw["tokenizer"], "files": files}}))
    assert load_cache_tokenizer(cache) is not None  # loads, and hashes as the manifest says
    code, out, _ = run_cli(["cache-stats", cache, "--json"], capsys)
    state = json.loads(out)["tokenizer_files"]
    assert code == 0 and state["stored"] and state["scheme"] is None and "unsupported scheme" in state["summary"]


def test_resuming_an_older_partial_cache_stores_the_files(tiny_cache, tiny_teacher, tmp_path, capsys):
    """An interrupted build of a distill before stored tokenizer files: the rerun finishes it with
    the files listed, and the same cache_id and shards."""
    cache = _without_tokenizer(tiny_cache, tmp_path / "cache")
    raw = _manifest(cache)
    (cache / "manifest.json").write_text(json.dumps({**raw, "status": "incomplete", "shards": []}, indent=2))
    (cache / "shards" / "00001.parquet").unlink()
    code, out, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", cache, *SMALL], capsys)
    assert code == 0 and "1 shards kept" in out, err
    done = _manifest(cache)
    assert done["status"] == "complete" and done["cache_id"] == raw["cache_id"]
    assert done["tokenizer"]["files"] == _manifest(tiny_cache)["tokenizer"]["files"]
    assert done["shards"] == _manifest(tiny_cache)["shards"]
    assert verify_cache(cache).tokenizer_files_checked == len(done["tokenizer"]["files"])


def test_a_job_array_and_its_merge_keep_the_files(tiny_cache, tiny_teacher, tmp_path, capsys):
    """Worker 1 claims the folder; worker 0 stores the files and lists them in the incomplete
    manifest; cache-merge writes the complete one from it."""
    out = tmp_path / "cache"
    for index in (1, 0):
        code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL,
                                "--num-workers", "2", "--worker-index", str(index)], capsys)
        assert code == 0, err
    assert _manifest(out)["status"] == "incomplete" and _manifest(out)["tokenizer"]["files"]
    code, _, err = run_cli(["cache-merge", out], capsys)
    assert code == 0, err
    merged = _manifest(out)
    assert merged["tokenizer"] == _manifest(tiny_cache)["tokenizer"] and merged["cache_id"] == _manifest(
        tiny_cache)["cache_id"]
    assert load_cache_tokenizer(out) is not None


def test_a_cache_at_a_url_gets_and_loads_its_tokenizer(tiny_cache, tiny_teacher, tmp_path):
    """On an object store (here fsspec's memory://) the files are uploaded, then listed in the
    manifest; loading and verify read them back through the URL."""
    import fsspec

    fs, url = fsspec.filesystem("memory"), f"memory://tok-{tmp_path.name}/cache"
    fs.put(str(_without_tokenizer(tiny_cache, tmp_path / "old")), url.removeprefix("memory://"), recursive=True)
    assert load_cache_tokenizer(url) is None
    record, replaced = add_tokenizer(url, tiny_teacher)
    assert not replaced and record["files"] == _manifest(tiny_cache)["tokenizer"]["files"]
    assert tokenizer_info(load_cache_tokenizer(url)) == tokenizer_info(load_cache_tokenizer(tiny_cache))
    assert verify_cache(url).ok
    fs.pipe_file(f"{url.removeprefix('memory://')}/tokenizer/tokenizer.json", b"{}")
    assert "tokenizer.json: checksum differs" in verify_cache(url).message


def test_add_tokenizer_help_has_an_example(capsys):
    code, out, _ = run_cli(["add-tokenizer", "--help"], capsys)
    assert code == 0 and "Example" in out and "distill add-tokenizer caches/" in out
