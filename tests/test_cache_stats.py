"""cache-stats numbers checked against brute force over the synthetic full distributions."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from teacher_cache.stats import PlotDependencyError, cache_stats, plot, rank_buckets, render_table, to_json
from test_cache_synth import make_corpus, write_cache

K, VOCAB = 8, 300


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    corpus = make_corpus(num_seqs=12, seq_len=40, k=K, vocab=VOCAB, seed=3)
    path = tmp_path_factory.mktemp("stats") / "c"
    write_cache(path, corpus, fmt="parquet", k=K, vocab=VOCAB, shard_size=5, seq_len=40)
    return corpus, path, cache_stats(path)


def test_sizes_and_compression(built):
    corpus, path, stats = built
    on_disk = sum(p.stat().st_size for p in (path / "shards").rglob("*") if p.is_file())
    assert (stats["sequences"], stats["tokens"], stats["shards"]) == (12, corpus.num_tokens, 3)
    assert stats["bytes_on_disk"] == on_disk
    assert stats["bytes_per_token"] == pytest.approx(on_disk / corpus.num_tokens)
    assert stats["fp32_bytes_per_token"] == 8 * K + 8
    assert stats["compression_vs_fp32"] == pytest.approx((8 * K + 8) * corpus.num_tokens / on_disk)


def test_cross_entropy_and_perplexity(built):
    corpus, _, stats = built
    target = np.concatenate([t.target_logprob for t in corpus.targets]).astype(np.float64)
    ce = -target[np.isfinite(target)].mean()
    assert stats["target_rows"] == corpus.num_tokens - 12  # one row per sequence has no next token
    assert stats["teacher_cross_entropy_nats"] == pytest.approx(ce, rel=1e-6)
    assert stats["teacher_perplexity"] == pytest.approx(np.exp(ce), rel=1e-6)


def test_topk_mass_percentiles(built):
    corpus, _, stats = built
    mass = np.concatenate([np.exp(t.topk_logprobs.astype(np.float64)).sum(axis=1) for t in corpus.targets])
    for q in (1, 10, 50, 90, 99):
        assert stats["topk_mass_percentiles"][f"p{q}"] == pytest.approx(np.percentile(mass, q), abs=2e-4), q
    assert sum(stats["topk_mass_histogram"]["counts"]) == corpus.num_tokens


def test_entropy_bounds_hold_the_true_entropy(built):
    corpus, _, stats = built
    lp = corpus.full_logprobs
    true_entropy = float(-(np.exp(lp) * lp).sum(axis=1).mean())
    ent = stats["entropy_nats"]
    assert ent["topk_part"] < ent["lower_bound"] <= true_entropy <= ent["upper_bound"]
    assert ent["upper_bound"] - ent["lower_bound"] < 0.5 * true_entropy  # bounds that say something


def test_actual_token_rank_histogram(built):
    corpus, _, stats = built
    counts = {label: 0 for label in stats["actual_token_rank"]["buckets"]}
    for ids, t in zip(corpus.sequences, corpus.targets):
        for row in range(len(ids) - 1):
            hits = np.flatnonzero(t.topk_ids[row] == ids[row + 1])
            rank = int(hits[0]) + 1 if len(hits) else K + 1
            label = ">8" if rank > K else next(f"{lo}-{hi}" if lo != hi else str(lo)
                                                for lo, hi in rank_buckets(K) if lo <= rank <= hi)
            counts[label] += 1
    assert stats["actual_token_rank"]["buckets"] == ["1", "2", "3-5", "6-8", ">8"]
    assert stats["actual_token_rank"]["counts"] == list(counts.values())
    assert sum(counts.values()) == corpus.num_tokens - 12 and counts["1"] > 0 and counts[">8"] > 0


def test_rank_buckets_follow_k():
    assert rank_buckets(100) == [(1, 1), (2, 2), (3, 5), (6, 10), (11, 100)]
    assert rank_buckets(4) == [(1, 1), (2, 2), (3, 4)]
    assert rank_buckets(1) == [(1, 1)]


def test_renderings(built, tmp_path):
    _, _, stats = built
    assert json.loads(to_json(stats)) == json.loads(json.dumps(stats))
    table = render_table(stats)
    assert stats["cache_id"] in table and f"{stats['tokens']:,}" in table
    assert f"{stats['teacher_cross_entropy_nats']:.3f}" in table and "\x1b[" not in table
    png = tmp_path / "stats.png"
    plot(stats, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(built, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PlotDependencyError, match=r"pip install distill\[plot\]"):
        plot(built[2], tmp_path / "x.png")


def _unwritable_folder(tmp_path):
    """A real folder this process cannot write into: chmod 0500, or, where that does not stop the
    process (root), /proc, where no one can create a file (Linux)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        (folder / "probe").write_text("")
    except PermissionError:
        return folder
    (folder / "probe").unlink()
    if os.path.isdir("/proc/self"):
        return Path("/proc")
    pytest.skip("this process writes into a read-only folder (root) and there is no /proc")


@pytest.mark.parametrize("place", ["read-only folder", "under a file", "a folder's name"])
def test_plot_to_a_place_that_cannot_be_written_is_one_error_line(built, tmp_path, capsys, place):
    """cache-stats --plot to a read-only folder, to a path under a regular file, to a name that is a
    folder: one `error:` line naming --plot and the path, exit 2, no partial image left behind."""
    from cli_helpers import one_error_line, run_cli

    _, cache, _ = built
    if place == "read-only folder":
        target = _unwritable_folder(tmp_path) / "stats.png"
    elif place == "under a file":
        (tmp_path / "somefile").write_text("not a folder")
        target = tmp_path / "somefile" / "stats.png"
    else:
        target = tmp_path / "stats.png"
        target.mkdir()
    try:
        code, out, err = run_cli(["cache-stats", cache, "--plot", target], capsys)
        line = one_error_line(code, err)
        assert code == 2 and line.startswith(f"error: --plot {target}:"), line
        if place == "under a file":
            assert "is a file, not a folder" in line and not out  # refused before the pass over the cache
        else:
            assert "cannot write it" in line and "folder you can write" in line
        if target.parent.is_dir() and target.parent != Path("/proc"):
            assert not [p for p in target.parent.iterdir() if p.name.startswith(".stats.png")]  # no temp left
        assert not target.is_file()
    finally:
        (tmp_path / "read-only").exists() and (tmp_path / "read-only").chmod(0o700)
