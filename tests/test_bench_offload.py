"""The offload benchmark (tests/benchmarks/bench_offload_gpu.py) on the CPU: its rows, its check of a
plan against the student without offload, and its chunk-recurrent mode, where the planner may
choose the chunk size. No figures are claimed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_offload_gpu as bench  # noqa: E402
import plan_whole_step  # noqa: E402

SMOKE = ["--device", "cpu", "--shape", "tiny", "--warmup", "0", "--repeats", "1"]


def test_planned_chunk_recurrent_step_takes_the_planners_chunk_size_and_passes_its_check(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    results, work = tmp_path / "results.jsonl", tmp_path / "work"
    rows = bench.main([*SMOKE, "--seq-len", "256", "--chunk-tokens", "64", "--chunk-candidates", "64,128",
                       "--variants", "none,planned", "--work", str(work), "--results", str(results)])
    assert [json.loads(line) for line in results.read_text().splitlines()] == rows
    assert [row["id"] for row in rows] == ["offload/tiny-T256-chunks64/none@abc1234",
                                           "offload/tiny-T256-chunks64/planned@abc1234"]
    none, planned = (row["figures"] for row in rows)
    assert none["oom"] is False and none["model_tflops_with_attention"] > none["model_tflops"] > 0
    assert all(f["peak_host_rss_bytes"] >= f["host_rss_before_bytes"] > 0 for f in (none, planned))
    # What the host held after the steps, for the offloaded variant only; no pinned memory on a CPU.
    parts = planned["host_parts_bytes"]
    assert "host_parts_bytes" not in none and parts["RssAnon"] > 0 and "torch_pinned" not in parts
    assert parts["layers"] == planned["host_bytes_of_layers"] and parts["exact_pools"] == 0
    plan = rows[1]["config"]["plan"]
    assert plan["chunk_tokens"] in (64, 128) and {c["chunk_tokens"] for c in plan["chunk_choices"]} == {64, 128}
    # fp32 on the CPU: chunk-recurrent training is exact at any chunk size, offloaded or not.
    assert planned["check_loss_error"] == 0 and planned["check_grad_norm_error"] == 0
    assert planned["predicted_step_s"] > 0 and set(planned["phase_s"]) == set(planned["predicted_phase_s"])
    peak_sums = [sum(terms.values()) for terms in planned["predicted_gpu_peak_terms"].values()]
    assert max(peak_sums) == planned["predicted_gpu_peak_bytes"]  # the chosen chunk size's table
    assert planned["h2d_gb_s"] > 0 and planned["d2h_gb_s"] > 0 and "h2d_gb_s" not in none  # the profile's
    assert 0 < planned["predicted_loader_host_bytes"] < planned["predicted_host_peak_bytes"]
    # On the CPU nothing copies both ways at once: the duplex figures are the rates alone.
    assert (planned["h2d_duplex_gb_s"], planned["d2h_duplex_gb_s"]) == (planned["h2d_gb_s"], planned["d2h_gb_s"])
    assert (work / "planned-plan.json").exists()  # kept with --work, to train or plan from again
    assert rows[1]["config"]["chunk_tokens"] == 64 and rows[1]["config"]["chunk_candidates"] == "64,128"


def test_a_priming_step_runs_on_fewer_tokens_before_the_timed_one(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    import student.step

    lengths, backward = [], student.step.micro_batch_backward

    def recording(model, batch, *args, **kwargs):
        lengths.append(batch.input_ids.shape[1])
        return backward(model, batch, *args, **kwargs)

    monkeypatch.setattr(student.step, "micro_batch_backward", recording)
    (row,) = bench.main([*SMOKE, "--seq-len", "128", "--prime-tokens", "32", "--variants", "none",
                         "--results", str(tmp_path / "results.jsonl")])
    assert lengths == [32, 128] and row["config"]["prime_tokens"] == 32 and row["figures"]["oom"] is False


def test_the_transformers_baseline_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(SystemExit, match="--variants hf_liger"):
        bench.main([*SMOKE, "--variants", "hf_liger", "--results", str(tmp_path / "results.jsonl")])


def test_trace_writes_a_compressed_trace_and_a_table_per_variant(tmp_path, monkeypatch):
    import gzip

    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    bench.main([*SMOKE, "--seq-len", "64", "--variants", "none", "--trace", str(tmp_path / "trace"),
                "--results", str(tmp_path / "results.jsonl")])
    events = json.loads(gzip.decompress((tmp_path / "trace" / "none.json.gz").read_bytes()))["traceEvents"]
    assert any("backward" in str(event.get("name", "")).lower() for event in events)
    assert "Self CPU" in (tmp_path / "trace" / "none.txt").read_text()


def test_fewer_layers_of_a_shape_are_rows_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    (row,) = bench.main([*SMOKE, "--seq-len", "64", "--num-layers", "2", "--variants", "none",
                         "--results", str(tmp_path / "results.jsonl")])
    assert row["id"] == "offload/tiny-L2-T64/none@abc1234"
    assert row["config"]["num_layers"] == 2 and row["config"]["shape"]["num_hidden_layers"] == 2
    with pytest.raises(SystemExit, match="--num-layers"):
        bench.main([*SMOKE, "--num-layers", "0", "--results", str(tmp_path / "results.jsonl")])


def test_the_peaks_live_blocks_are_summed_by_where_they_were_allocated():
    """memory_peak.live_at_peak on a made-up allocator trace: the peak is the highest allocated
    total, a block freed when its free is requested as torch's allocated bytes count it (frees of
    blocks from before the trace lower it too), and the blocks alive then are summed by their
    innermost frame inside the repository."""
    from memory_peak import BEFORE, live_at_peak

    root = "/repo"
    at = lambda line: [{"filename": "/usr/lib/torch/x.py", "line": 1, "name": "inner"},
                       {"filename": "/repo/student/a.py", "line": line, "name": "f"}]
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": at(10)},
              {"action": "alloc", "addr": 2, "size": 50, "frames": at(10)},
              {"action": "free_requested", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 3, "size": 300, "frames": at(20)},
              # block 1 was used on another stream: the allocator returns it once that stream is
              # past it, but counts it free (max_memory_allocated) from the request on
              {"action": "free_completed", "addr": 1, "size": 100},
              {"action": "free_requested", "addr": 99, "size": 40},  # allocated before the trace
              {"action": "free_completed", "addr": 99, "size": 40},
              {"action": "alloc", "addr": 4, "size": 60, "frames": []},
              {"action": "free_requested", "addr": 3, "size": 300},
              {"action": "free_completed", "addr": 3, "size": 300}]
    result = live_at_peak(events, base_bytes=1000, root=root)
    assert result["peak_bytes"] == 1000 + 50 + 300 - 40 + 60 and result["peak_event"] == 7
    assert result["live_at_peak"] == [{"place": BEFORE, "bytes": 960, "blocks": None},
                                      {"place": "student/a.py:20 f", "bytes": 300, "blocks": 1},
                                      {"place": "unknown", "bytes": 60, "blocks": 1},
                                      {"place": "student/a.py:10 f", "bytes": 50, "blocks": 1}]
    assert sum(row["bytes"] for row in result["live_at_peak"]) == result["peak_bytes"]


def test_reserved_bytes_are_summed_by_the_stream_whose_pool_holds_them():
    from memory_peak import reserved_by_stream

    segments = [{"stream": 0, "total_size": 20, "allocated_size": 5}, {"stream": 7, "total_size": 30, "allocated_size": 0},
                {"stream": 0, "total_size": 4, "allocated_size": 4}]
    assert reserved_by_stream(segments) == [{"stream": 7, "reserved": 30, "allocated": 0, "segments": 1},
                                            {"stream": 0, "reserved": 24, "allocated": 9, "segments": 2}]


def test_the_memory_peak_step_is_refused_on_the_cpu(tmp_path):
    with pytest.raises(SystemExit, match="--memory-peak"):
        bench.main([*SMOKE, "--memory-peak", str(tmp_path), "--results", str(tmp_path / "results.jsonl")])


def test_only_a_variant_with_a_plan_and_a_gpu_budget_runs_capped():
    """As train-student caps its allocator: with a plan and --gpu-memory on a GPU (rows `-capped`)."""
    import argparse

    from student.offload.plan import OffloadPlan

    plan = OffloadPlan.uniform(2, "keep", "resident")
    args = lambda **kw: argparse.Namespace(**{"gpu_memory": "1GiB", "device": "cuda", **kw})
    assert bench.capped(plan, args())
    assert not bench.capped(None, args()) and not bench.capped(plan, args(device="cpu"))
    assert not bench.capped(plan, args(gpu_memory=None))


def test_the_step_keeps_the_attention_outputs_of_as_many_chunks_as_the_plan(tmp_path):
    """A plan with no room for pass 1's outputs (keep_attention_chunks 0) is run keeping none, as the
    trainer runs it (`OffloadPlan.run_settings`); its chunk size stays the run's unless the planner
    chose it."""
    import argparse
    import dataclasses

    from student.offload.plan import ChunkChoice, OffloadPlan

    args = argparse.Namespace(device="cpu", optimizer="adamw", seq_len=256, gpu_memory=None, host_memory=None,
                              chunk_tokens=64, kv_offload=False, page_tokens=16, offload_pages=1024,
                              sparse_pages=None, chunk_candidates=None)
    cfg = bench.train_config(args, tmp_path)
    plan = OffloadPlan.uniform(2, "keep", "resident", chunk_tokens=64, keep_attention_chunks=0)
    assert cfg.long.keep_attention_chunks is None
    assert bench.with_plan(cfg, plan).long.keep_attention_chunks == 0
    assert bench.with_plan(cfg, dataclasses.replace(plan, keep_attention_chunks=None)) == cfg
    chose = dataclasses.replace(plan, chunk_tokens=128, chunk_choices=(ChunkChoice(128, False, None, None),))
    assert bench.with_plan(cfg, chose).long.chunk_tokens == 128


def test_a_work_folder_used_again_keeps_its_complete_cache(tmp_path):
    """The planner's synthetic cache in --work is kept when complete (a warm device machine keeps
    /tmp between calls); a cache of another spec there is still refused."""
    from bench_train_step_gpu import write_cache

    from teacher_cache.errors import CacheMismatchError

    tok = {"vocab_size": 100, "hash": "h"}
    write_cache(tmp_path / "c", tok, num_seqs=4, seq_len=16, k=4, shard_size=4)
    write_cache(tmp_path / "c", tok, num_seqs=4, seq_len=16, k=4, shard_size=4)
    with pytest.raises(CacheMismatchError, match="seq_len"):
        write_cache(tmp_path / "c", tok, num_seqs=4, seq_len=32, k=4, shard_size=4)


def test_a_budget_no_plan_meets_is_a_row_of_the_smallest_budget_and_what_holds_it(tmp_path, monkeypatch):
    """The planner's refusal is a figure too: the smallest GPU budget a plan meets and that plan's
    predicted peak term by term (its largest phase within that budget); the next variant still runs."""
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    planned, none = bench.main([*SMOKE, "--seq-len", "128", "--chunk-tokens", "64", "--variants", "planned,none",
                                "--gpu-memory", "1MB", "--results", str(tmp_path / "results.jsonl")])
    assert planned["id"] == "offload/tiny-T128-gpu1MB-chunks64/planned@abc1234"
    f = planned["figures"]
    assert f["no_plan"] is True and f["error"].startswith("`gpu_memory` 976.6 KiB cannot hold")
    peak = max(sum(terms.values()) for terms in f["least_gpu_peak_terms"].values())
    assert 10**6 < peak <= f["smallest_gpu_bytes"]
    assert none["figures"]["oom"] is False


def test_one_profiled_layer_predicts_the_whole_step(tmp_path, monkeypatch):
    """--num-layers 1 --predict-layers N: beside the one-layer row, the planner's prediction of the
    step with N such layers under the same budgets (`whole_step`), slower than the one layer's; with
    --work its plan is kept (whole-plan.json), and `--variants file` runs the N-layer step from it."""
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    work, results = tmp_path / "work", str(tmp_path / "results.jsonl")
    long = ["--seq-len", "256", "--chunk-tokens", "64", "--check-layers", "0", "--results", results]
    rows = bench.main([*SMOKE, *long, "--num-layers", "1", "--predict-layers", "6", "--variants", "planned",
                       "--work", str(work)])
    figures = rows[0]["figures"]
    whole = figures["whole_step"]
    assert whole["layers"] == 6 and whole["fits"] is True and whole["embedding"] in ("gpu", "host")
    assert whole["step_s"] > figures["predicted_step_s"] > 0
    assert whole["gpu_peak_bytes"] >= figures["predicted_gpu_peak_bytes"]
    plan = bench.OffloadPlan.load(work / "whole-plan.json")
    assert len(plan.layers) == 6 and plan.predicted.step_s == whole["step_s"]
    # the same prediction from the saved cost table, as on another machine (plan_whole_step.py)
    budgets = rows[0]["config"]["plan"]
    again = plan_whole_step.main([str(work / "planned-costs.json"), "--layers", "6", "--gpu-memory",
                                  str(budgets["gpu_memory"]), "--host-memory", str(budgets["host_memory"])])
    assert again == whole
    row, = bench.main([*SMOKE, *long, "--num-layers", "6", "--variants", "file", "--plan", str(work / "whole-plan.json")])
    assert row["id"] == "offload/tiny-L6-T256-chunks64/file@abc1234" and row["figures"]["oom"] is False
    assert row["figures"]["predicted_step_s"] == whole["step_s"]


def test_the_blocks_pass_1_keeps_are_an_output_and_an_lse_a_layer_and_kept_chunk(tmp_path):
    """What `prime_pinned` page-locks for pass 1: for 1,000 tokens in chunks of 256 (four chunks, the
    first three kept unless the plan keeps fewer), per layer and kept chunk a bf16 output [B, H, 256, D]
    and an fp32 lse [B, H, 256]; none where pass 1 keeps none. On the CPU nothing is page-locked."""
    from student.long_context.config import LongContextConfig

    model = bench.build_student(bench.student_config("tiny"), 0, "cpu", layers_on_host=False)
    c = model.config
    blocks = bench.kept_output_blocks(model, LongContextConfig(chunk_tokens=256), 1000, batch_size=2)
    assert blocks == [((2, c.num_heads, 256, c.head_dim), bench.torch.bfloat16),
                      ((2, c.num_heads, 256), bench.torch.float32)] * (3 * c.num_layers)
    assert bench.kept_output_blocks(model, LongContextConfig(chunk_tokens=256, keep_attention_chunks=0), 1000) == []
    assert len(bench.kept_output_blocks(model, LongContextConfig(chunk_tokens=256, keep_attention_chunks=1), 1000)) \
        == 2 * c.num_layers
