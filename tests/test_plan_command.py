"""`distill plan` and the planner's profile on a tiny student: the command's table, JSON and
budget errors on the CPU, plan_for_training's budgets, and on a GPU the profile's optimizer and
allocator cache."""

from __future__ import annotations

import json

import pytest

from cli_helpers import one_error_line, run_cli
from student.offload.plan import OffloadPlan
from test_trainer import tiny  # noqa: F401  (the module-scoped fixture: a tiny student and cache)

GiB = 2**30


def plan_args(tiny, *more):  # noqa: F811
    student, cache, _ = tiny
    return ["plan", "--cache", cache, "--student", student, "--batch-size", "3", "--heldout", "4", "--device", "cpu",
            "--host-memory", "4GiB", *more]


def test_distill_plan_prints_a_table_and_saves_the_json_it_prints(tiny, tmp_path, capsys):  # noqa: F811
    code, out, err = run_cli(plan_args(tiny, "--gpu-memory", "1GiB"), capsys)
    assert code == 0, err
    assert "activation" in out and "predicted step time" in out and "of 1.0 GiB" in out
    # profiled on the CPU: the plan's "GPU" side is the CPU's memory, and the table says so
    assert "peak memory on the device (CPU) " in out and "the device peak, at the " in out
    assert "peak GPU memory" not in out and "GPU peak" not in out and "static GPU bytes" not in out
    assert sum(line.strip().startswith(("│     0", "│     1")) for line in out.splitlines()) == 2

    path = tmp_path / "plan.json"
    code, out, err = run_cli(plan_args(tiny, "--gpu-memory", "1GiB", "--json", "--out", path), capsys)
    assert code == 0, err
    printed = json.loads(out)
    saved = OffloadPlan.load(path)
    assert json.loads(path.read_text()) == printed and saved == OffloadPlan.from_dict(printed)
    assert len(saved.layers) == 2
    assert saved.gpu_memory == GiB and saved.host_memory == 4 * GiB
    assert 0 < saved.predicted.step_s and saved.predicted.gpu_peak_bytes <= GiB


def test_distill_plan_refuses_a_budget_in_one_line_with_the_smallest(tiny, capsys):  # noqa: F811
    code, _, err = run_cli(plan_args(tiny, "--gpu-memory", "64KiB"), capsys)
    line = one_error_line(code, err)
    assert line.startswith("error: --gpu-memory 64.0 KiB cannot hold this student's step; the smallest that can is ")
    code, _, err = run_cli(plan_args(tiny, "--gpu-memory", "lots"), capsys)
    assert "--gpu-memory is 'lots'" in one_error_line(code, err)


def test_distill_plan_takes_train_students_options_and_has_examples(capsys):
    """One option set: every option of train-student that changes the step is an option of plan, with
    the same names, default and help (the budgets too: one declaration), so a plan is made for the
    step train-student runs; those that only say how often a run logs, evaluates or saves are not."""
    import typer.main

    from distill.cli import app

    commands = typer.main.get_command(app).commands
    params = lambda name: {p.name: (p.opts, p.default, p.help) for p in commands[name].params}
    train, plan = params("train-student"), params("plan")
    run_only = {"out", "resume_from", "quiet", "offload", "eval_every", "eval_sequences", "save_every", "log_every",
                "keep_checkpoints"}
    for name in set(train) - run_only:
        assert plan[name] == train[name], name
    assert not (run_only - {"out"}) & set(plan)
    assert {"gpu_memory", "host_memory", "as_json", "plan_out"} <= set(plan)
    code, out, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0 and "Example" in out and "--gpu-memory" in out


def test_plan_for_training_takes_the_budgets_as_bytes(tiny, tmp_path):  # noqa: F811
    from student.planner.solve import plan_for_training
    from student.trainer import TrainConfig

    student, cache, _ = tiny
    config = TrainConfig.from_flat(cache=str(cache), out=str(tmp_path / "run"), student=str(student), batch_size=3,
                                   heldout=4, device="cpu", grad_accum=2)
    plan = plan_for_training(config, gpu_memory=GiB, host_memory=2 * GiB)
    assert len(plan.layers) == 2 and (plan.gpu_memory, plan.host_memory) == (GiB, 2 * GiB)
    assert plan.predicted.gpu_peak_bytes <= GiB and not (tmp_path / "run").exists()


def test_distill_plan_with_chunk_tokens_plans_the_chunked_step(tiny, tmp_path, capsys):  # noqa: F811
    """On the CPU: the plan holds the chunk size and the pages resident (every layer's, without
    kv_offload: 2 layers x 2 pages of 16 positions), its layers' weights are resident, and
    the table says how the step is chunked; the chunked step's GPU peak is not the whole one's."""
    path = tmp_path / "plan.json"
    code, out, err = run_cli(plan_args(tiny, "--gpu-memory", "1GiB", "--chunk-tokens", "7", "--page-tokens", "16",
                                       "--out", path), capsys)
    assert code == 0, err
    # The profiled micro-batch is padded to its longest sequence, of 17 to 21 positions: 3 chunks, 2 pages.
    assert "chunk-recurrent: 7 tokens a chunk, 3 chunks a micro-batch" in out and "4 key/value pages" in out
    plan = OffloadPlan.load(path)
    assert (plan.chunk_tokens, plan.resident_pages) == (7, 4)
    assert all(lp.params == "resident" for lp in plan.layers)
    assert 0 < plan.predicted.step_s and plan.predicted.gpu_peak_bytes <= GiB
    code, out, err = run_cli(plan_args(tiny, "--gpu-memory", "1GiB", "--json"), capsys)
    assert code == 0, err
    whole = OffloadPlan.from_dict(json.loads(out))
    assert whole.chunk_tokens is None and whole.resident_pages is None
    assert whole.predicted.gpu_peak_bytes != plan.predicted.gpu_peak_bytes


@pytest.mark.gpu
def test_on_a_gpu_the_profile_times_each_update_with_the_optimizer_the_trainer_builds(tiny, monkeypatch):  # noqa: F811
    """A CUDA run's AdamW is torch's fused one, and the runtime's update of the layers in host
    memory runs it on the CPU: the profile times the CPU update with that optimizer too, not
    with the for-loop AdamW that torch picks for CPU parameters by default (which priced the CPU
    update of row offload/qwen2.5-3b-T262144-gpu24GiB-chunks16384-kvoffload/planned@3c9e09c
    at more than three times its measured phase)."""
    import torch

    from student.planner.profile import ProfileSettings, profile
    from student.trainer import TrainConfig

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    built = []
    real = torch.optim.AdamW.__init__

    def spy(self, params, *args, **kwargs):
        real(self, params, *args, **kwargs)
        built.append((self.defaults["fused"], {p.device.type for g in self.param_groups for p in g["params"]}))

    monkeypatch.setattr(torch.optim.AdamW, "__init__", spy)
    student, cache, _ = tiny
    config = TrainConfig.from_flat(cache=str(cache), student=str(student), out="unused", batch_size=3, heldout=4,
                                   device="cuda", optimizer="adamw")
    cached = lambda: torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    before = cached()  # free parts of segments that hold live blocks, which no one can hand back
    profile(config, settings=ProfileSettings(repeats=1))
    assert cached() <= before, "the profile's cached blocks stay reserved for the training after it"
    assert {"cpu"} in [devices for _, devices in built] and {"cuda"} in [devices for _, devices in built]
    assert all(fused for fused, _ in built), built


def test_load_factor_is_a_runs_time_back_to_back_over_its_time_in_bursts():
    """`load_factor` on the CPU with runs whose time depends on how long ago the previous one ended
    (a stand-in for a GPU's clock, which no CPU has): three times as long back to back is a factor
    of about 3 (sleeps overshoot on a busy machine); runs faster back to back (a burst's launch
    gaps) leave the timings as they are (1)."""
    import time

    from student.planner.profile import ProfileSettings, load_factor

    def run_taking(idle_s: float, loaded_s: float):
        ended = [0.0]

        def run():
            time.sleep(idle_s if time.perf_counter() - ended[0] > 0.05 else loaded_s)
            ended[0] = time.perf_counter()

        return run

    # Sleeps of tens of milliseconds, so that a busy machine's overshoot (milliseconds) moves the
    # ratio little (with sleeps of 10 and 30 ms it failed once in a run of several test files).
    settings = ProfileSettings(repeats=3, load_s=0.3)
    assert 1.8 < load_factor(run_taking(0.03, 0.09), settings, "cpu", gap_s=0.1) < 3.5
    assert load_factor(run_taking(0.09, 0.03), settings, "cpu", gap_s=0.1) == 1.0


def test_the_plan_table_says_how_the_compute_timings_were_scaled():
    import dataclasses

    from student.planner.report import plan_table
    from student.planner.solve import solve
    from test_planner import random_table

    costs = random_table(3, seed=11, clock_factor=1.1)
    plan = solve(costs, 10**12, 10**12)
    assert "compute timings x1.100 for the clock under a step's load" in plan_table(plan, costs)
    assert "\npeak GPU memory " in plan_table(plan, costs) and "\npeak GPU memory " not in plan_table(
        plan, costs, device="cpu")
    assert "for the clock" not in plan_table(plan, dataclasses.replace(costs, clock_factor=1.0))


def test_the_plan_table_says_what_of_the_host_peak_the_loader_holds():
    import dataclasses

    from student.offload.config import format_bytes
    from student.planner.report import plan_table
    from student.planner.solve import solve
    from test_planner import GiB, random_table

    costs = random_table(3, seed=11)
    assert "the loader's" not in plan_table(solve(costs, 10**12, 10**12), costs)  # a table made without a profile
    costs = dataclasses.replace(costs, static_host_bytes=costs.static_host_bytes + 3 * GiB, loader_host_bytes=3 * GiB)
    plan = solve(costs, 10**12, 10**12)
    (line,) = [x for x in plan_table(plan, costs).splitlines() if "peak host memory" in x]
    assert line.endswith(f"(the loader's batches and decoded shards {format_bytes(3 * GiB)} of it)")


def test_a_host_budget_refusal_names_the_loader_when_it_holds_a_large_share():
    """Where the loader holds a tenth or more of the smallest host budget, the refusal says so and
    what holds less."""
    import dataclasses

    import pytest

    from student.planner.solve import BudgetError, predict, solve
    from test_planner import GiB, every_plan, random_table

    costs = random_table(3, seed=11)
    least_host = min(predict(costs, p).host_peak_bytes for p in every_plan(3, (0,)))
    loader = least_host // 5
    heavy = dataclasses.replace(costs, static_host_bytes=costs.static_host_bytes + loader, loader_host_bytes=loader)
    with pytest.raises(BudgetError, match="the loader's batches and decoded shards hold .* --loader-shards 1 .* --shard-size"):
        solve(heavy, 100 * GiB, least_host - 1)


def test_the_plan_table_says_what_the_gpu_peak_holds_largest_first():
    from student.planner.report import plan_table
    from student.offload.config import format_bytes
    from student.planner.solve import solve
    from test_planner import GiB, random_table

    costs = random_table(3, seed=11, loss_workspace_bytes=40 * GiB)  # the head's workspace outweighs the rest
    plan = solve(costs, 10**12, 10**12)
    (line,) = [x for x in plan_table(plan, costs).splitlines() if x.startswith("the GPU peak, at the turnaround: ")]
    head = 40 * GiB + costs.layers[-1].boundary_bytes  # beside its input, the last layer's output
    assert line.split(": ", 1)[1].startswith(f"head workspace {format_bytes(head)}, ")


def test_last_runs_keeps_the_runs_ending_in_the_last_span_and_at_least_some():
    from student.planner.profile import last_runs

    runs = [0.4, 0.1, 0.2, 0.3, 0.5]  # end at 0.4, 0.5, 0.7, 1.0, 1.5 s
    assert last_runs(runs, 0.6, 1) == [0.3, 0.5]  # ended after 0.9 s
    assert last_runs(runs, 0.5, 1) == [0.5]
    assert last_runs(runs, 0.5, 3) == [0.2, 0.3, 0.5]
    assert last_runs(runs, 10.0, 1) == runs
