"""The long-context benchmark (tests/benchmarks/bench_long_context_gpu.py) on the CPU: its rows, its
exactness gate (which must stop a wrong engine) and its shapes. No figures are claimed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_long_context_gpu as bench  # noqa: E402

SMOKE = ["--device", "cpu", "--shape", "tiny", "--lengths", "128,192", "--chunk-tokens", "64", "--check-tokens", "96",
         "--warmup", "0", "--repeats", "1", "--optimizer", "adamw"]


def test_cpu_run_checks_then_appends_one_row_per_length_and_plots(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    results, png = tmp_path / "results.jsonl", tmp_path / "lc.png"
    rows = bench.main([*SMOKE, "--variants", "ours,ours_offload,hf_liger", "--results", str(results),
                       "--plot", str(png)])
    assert [json.loads(line) for line in results.read_text().splitlines()] == rows
    assert [row["id"] for row in rows] == ["long_context/tiny-T128/ours@abc1234", "long_context/tiny-T192/ours@abc1234"]
    for row, length in zip(rows, (128, 192)):
        f = row["figures"]
        assert f["oom"] is False and f["step_s"] > 0 and f["tok_s"] == pytest.approx(length / f["step_s"])
        assert f["peak_host_rss_gib"] >= f["host_rss_before_gib"] > 0
        assert f["check_tokens"] == 96 and f["check_chunk_tokens"] == 32  # three chunks of the check sequence
        assert f["check_grad_error"] <= f["check_grad_allowed"] == bench.TOLERANCES["float32"][1]
        assert row["config"]["length"] == length and row["config"]["chunk_tokens"] == 64
        assert row["config"]["dtype"] == "float32" and row["config"]["kv_offload"] is False
    assert png.stat().st_size > 0


def test_fewer_layers_of_a_shape_are_rows_of_their_own(tmp_path, monkeypatch):
    """--num-layers 1: the tiny shape's first layer only, checked and timed as the whole shape would
    be; its rows are named for it and say so, and the plot draws them apart."""
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    results, png = tmp_path / "results.jsonl", tmp_path / "lc.png"
    (row,) = bench.main([*SMOKE, "--lengths", "128", "--num-layers", "1", "--results", str(results),
                         "--plot", str(png)])
    assert row["id"] == "long_context/tiny-L1-T128/ours@abc1234"
    assert row["config"]["num_layers"] == 1 and row["config"]["student"]["num_layers"] == 1
    assert row["figures"]["check_grad_error"] <= row["figures"]["check_grad_allowed"]
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):
        bench.parse_args([*SMOKE, "--num-layers", "0"])


def test_plot_only_draws_the_rows_already_in_the_results(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    results, png = tmp_path / "results.jsonl", tmp_path / "again.png"
    bench.main([*SMOKE, "--lengths", "128", "--check-tokens", "0", "--results", str(results)])
    assert bench.main(["--plot-only", "--results", str(results), "--plot", str(png)]) == []
    assert png.stat().st_size > 0 and len(results.read_text().splitlines()) == 1


def test_a_priming_step_on_fewer_tokens_runs_before_the_timed_one_and_the_plot_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    lengths, make_step = [], bench.ours_step_fn

    def recording_step_fn(model, batch, config):
        step = make_step(model, batch, config)

        def recorded(batch=batch):
            lengths.append(batch.input_ids.shape[1])
            return step(batch)
        return recorded

    monkeypatch.setattr(bench, "ours_step_fn", recording_step_fn)
    (row,) = bench.main([*SMOKE, "--lengths", "128", "--check-tokens", "0", "--prime-tokens", "64",
                         "--results", str(tmp_path / "results.jsonl")])
    assert lengths == [64, 128]
    assert row["config"]["prime_tokens"] == 64 and row["config"]["warmup"] == 0
    assert bench._warmth([row]) == "the first step (no warm-up), primed on 64 tokens"
    old = {"config": {}, "command": "bench_long_context_gpu.py --warmup 0 --repeats 1"}
    assert bench._warmth([old]) == "the first step (no warm-up)"
    assert bench._warmth([old, row]) == "warm-up differs between rows"


def _drop_past_page_gradients(monkeypatch):
    """OOMB's rectangular backend's defect: a chunk's keys and values get no gradient from later chunks."""
    import torch

    from student.long_context.store import PagedKVStore

    own = PagedKVStore._own
    monkeypatch.setattr(PagedKVStore, "_own", lambda self, pool: torch.zeros_like(own(self, pool)))


def _chunk_loss_over_its_own_rows(monkeypatch):
    """Each chunk's loss normalised over the chunk instead of the whole sequence."""
    import student.step

    loss = student.step.micro_batch_loss
    monkeypatch.setattr(student.step, "micro_batch_loss", lambda *a, part=None, **kw: loss(*a, **kw))


@pytest.mark.parametrize("defect", [_drop_past_page_gradients, _chunk_loss_over_its_own_rows])
def test_the_exactness_check_stops_a_wrong_engine(defect, monkeypatch):
    args = bench.parse_args(SMOKE)
    config = bench.shape_config("tiny", 128)
    defect(monkeypatch)  # the engine as it is passes: the first test
    with pytest.raises(AssertionError, match="ours check"):
        bench.check_exact("ours", config, args, "cpu", "float32")


def test_shapes_have_their_architectures_parameter_counts():
    # Qwen2-0.5B as published (tied); Qwen2.5-3B's published count is with a tied lm-head, ours is untied.
    assert bench.param_count(bench.shape_config("qwen2-0.5b", 65536)) == 494_032_768
    assert bench.param_count(bench.shape_config("qwen2.5-3b", 65536)) == 3_085_938_688 + 151_936 * 2048


def test_bad_options_are_refused_naming_the_option(capsys):
    for argv, option in ((["--variants", "ours,peer"], "--variants"), (["--lengths", "64k"], "--lengths"),
                         (["--shape", "7b"], "--shape")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert option in capsys.readouterr().err
