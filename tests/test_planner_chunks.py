"""The planner chooses the chunk size and where the key/value pages live (--chunk-candidates):
the residencies' bytes and page-copy seconds on hand-made cost tables, `choose_chunks` on tables
whose best choice is known, the user's mistakes in one line, and `distill plan` on a tiny CPU
student. Training with the choice: tests/test_offload_chunked.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cli_helpers import one_error_line, run_cli
from distill.configs import ConfigError
from student.offload_cost import KVPages, kv_options, kv_residency
from student.offload_plan import OffloadConfig, OffloadPlan
from student.planner import BudgetError, SolverSettings, choose_chunks, predict, smallest_budget, solve
from test_planner import GiB, MS, layer, plan_args, table
from test_trainer import tiny  # noqa: F401  (the module-scoped fixture: a tiny student and cache)

FAST = SolverSettings(depths=(0,))  # one depth: a few small programs per choice


def kv(**changes) -> KVPages:
    """Four pages a layer (128 positions, pages of 32), two chunks of 64, on a GPU, resident."""
    base = dict(num_layers=1, seq_tokens=128, chunk_tokens=64, page_tokens=32, kv_page_bytes=10**6,
                grad_page_bytes=2 * 10**6, kept_bytes=GiB // 16, offloadable=True)
    return KVPages(**{**base, **changes})


def chunked(pages: KVPages, *layers, **changes) -> tuple:
    """A chunk-recurrent table measured with `pages` resident (two chunks a micro-batch)."""
    gpu, host, resident = pages.bytes()
    base = dict(micro_batches=2, chunks=2, pass1_s=10 * MS, kv_gpu_bytes=gpu, static_host_bytes=GiB + host,
                chunk_tokens=pages.chunk_tokens, resident_pages=resident, kv=pages, h2d_bytes_per_s=1e9,
                d2h_bytes_per_s=1e9)
    return table(layers or [layer()], **{**base, **changes})


# --- the residencies' bytes and seconds (no program) ----------------------------------------------


def test_the_pages_bytes_resident_and_offloaded():
    pages = kv(num_layers=2)
    page = 3 * 10**6  # keys, values and their gradients, of every row
    assert pages.bytes() == (2 * 4 * page, GiB // 16, 8)
    assert dataclasses.replace(pages, kv_offload=True, offload_pages=1).bytes() == (3 * page, 8 * page + GiB // 16, 3)
    assert dataclasses.replace(pages, kv_offload=True, offload_pages=9).bytes() == (12 * page, 8 * page + GiB // 16, 12)
    on_cpu = dataclasses.replace(pages, offloadable=False, kv_offload=True)  # the store keeps them where they are
    assert on_cpu.bytes() == (8 * page + GiB // 16, 0, 8)
    assert kv_options(on_cpu) == [(False, 1024)]
    assert kv_options(pages) == [(False, 1024), (True, 1), (True, 4)]  # 4 pages a layer: 4, 1, 1, 1 and the run's (4)


def test_offloaded_pages_charge_the_copies_the_compute_does_not_hide():
    """The model of `_page_copy_s`, by hand: 1 ms a page each way, 2 ms a gradient page; chunk 0
    reads 2 pages, chunk 1 (its backward first: gradient pages made on the device) reads 4.
    Forwards: first set whole (2 + 4 ms) + copies beyond the 1 ms forward (1 + 3 ms) = 10 ms.
    Backward of chunk 0: max(2 + 4, 4) - 2 = 4, last set home 4, top layer's first set in 6: 14 ms;
    of chunk 1: max(4, 8) - 2 = 6, last set home 8, first set in 4: 18 ms; a chunk's mean 16 ms."""
    costs = chunked(kv(), layer(forward_s=1 * MS, backward_s=2 * MS))
    offloaded = kv_residency(costs, True, 4)
    assert offloaded.pass1_s == pytest.approx(costs.pass1_s + 10 * MS)
    assert offloaded.layers[0].backward_s == pytest.approx(costs.layers[0].backward_s + 16 * MS)
    assert offloaded.kv_gpu_bytes == 3 * 4 * 3 * 10**6 and offloaded.resident_pages == 12
    assert offloaded.static_host_bytes == GiB + 4 * 3 * 10**6 + GiB // 16
    assert (offloaded.kv.kv_offload, offloaded.kv.offload_pages) == (True, 4)
    assert kv_residency(costs, False, 1024) == costs  # as measured: nothing changes
    # Both directions at half their rates alone when copying together (no better than taking
    # turns): each direction of a backward takes its own time plus the other's. Chunk 0: max(6 + 4,
    # 4 + 6) - 2 = 8; chunk 1: max(4 + 8, 8 + 4) - 2 = 10; 4 ms more a chunk. Pass 1 only reads.
    # Duplex rates equal to the rates alone change nothing.
    half = dataclasses.replace(costs, h2d_duplex_bytes_per_s=0.5e9, d2h_duplex_bytes_per_s=0.5e9)
    assert kv_residency(half, True, 4).layers[0].backward_s == pytest.approx(costs.layers[0].backward_s + 20 * MS)
    assert kv_residency(half, True, 4).pass1_s == pytest.approx(offloaded.pass1_s)
    equal = dataclasses.replace(costs, h2d_duplex_bytes_per_s=1e9, d2h_duplex_bytes_per_s=1e9)
    assert kv_residency(equal, True, 4) == offloaded
    # Copies of nothing cost nothing; a copy's latency is paid per page set.
    free = dataclasses.replace(costs, h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30)
    assert kv_residency(free, True, 1).pass1_s == pytest.approx(free.pass1_s)
    slow = dataclasses.replace(free, copy_latency_s=1 * MS)
    assert kv_residency(slow, True, 1).pass1_s > kv_residency(slow, True, 4).pass1_s
    # Measured offloaded, resident takes modelled copies off (those the longer measured times do not hide).
    measured = kv_residency(costs, True, 4)
    resident = kv_residency(measured, False, 4)
    assert resident.layers[0].backward_s < measured.layers[0].backward_s and resident.pass1_s < measured.pass1_s
    assert (resident.kv_gpu_bytes, resident.static_host_bytes) == (costs.kv_gpu_bytes, costs.static_host_bytes)


# --- choose_chunks on hand-made tables ------------------------------------------------------------


def test_a_large_budget_keeps_the_pages_resident_and_a_small_one_offloads_them():
    costs = chunked(kv(num_layers=2, kv_page_bytes=GiB // 4, grad_page_bytes=GiB // 2), layer(), layer())
    roomy, _ = choose_chunks({64: costs}, 200 * GiB, 200 * GiB, settings=FAST)
    assert (roomy.chunk_tokens, roomy.kv_offload, roomy.resident_pages) == (64, False, 8)
    assert roomy.predicted.step_s == min(c.step_s for c in roomy.chunk_choices)
    assert [(c.kv_offload, c.offload_pages) for c in roomy.chunk_choices] == kv_options(costs.kv)
    # Too small for every page on the GPU (6 GiB of them), large enough for sets of one page (2.25 GiB).
    least = lambda *option: smallest_budget(kv_residency(costs, *option), "gpu", None)[1]
    budget = least(False, 1024) - GiB
    assert budget > least(True, 1)
    tight, tight_costs = choose_chunks({64: costs}, budget, 200 * GiB, settings=FAST)
    assert (tight.kv_offload, tight.offload_pages, tight.resident_pages) == (True, 1, 3)
    assert tight.predicted.gpu_peak_bytes <= budget
    assert tight.predicted == predict(tight_costs, tight)
    assert tight.chunk_choices[0].step_s is None  # resident: does not fit
    assert tight.predicted.step_s > roomy.predicted.step_s


def test_the_faster_chunk_size_is_chosen_and_every_one_is_listed():
    fast = chunked(kv(), layer(forward_s=5 * MS, backward_s=10 * MS))
    slow = chunked(kv(chunk_tokens=32), layer(), micro_batches=4, chunks=4)
    made, costs = choose_chunks({32: slow, 64: fast}, 200 * GiB, 200 * GiB, settings=FAST)
    assert made.chunk_tokens == 64 and costs.chunk_tokens == 64 and not made.kv_offload
    assert sorted({c.chunk_tokens for c in made.chunk_choices}) == [32, 64]
    assert all(c.step_s is not None for c in made.chunk_choices)
    best_slow = min(c.step_s for c in made.chunk_choices if c.chunk_tokens == 32)
    assert made.predicted.step_s < best_slow
    # A chunk size whose micro-batch is one chunk is planned as whole sequences, recorded at its size.
    whole = table([layer()])
    made, _ = choose_chunks({32: slow, 128: whole}, 200 * GiB, 200 * GiB, settings=FAST)
    assert made.chunk_tokens == 128 and made.resident_pages is None and made.kv_offload is None


def test_when_no_choice_fits_the_error_names_the_smallest_budget_of_any():
    costs = chunked(kv(kv_page_bytes=GiB // 4, grad_page_bytes=GiB // 2), layer())
    with pytest.raises(BudgetError) as e:
        choose_chunks({64: costs}, 2**20, 200 * GiB, settings=FAST)
    alone = []
    for option in kv_options(costs.kv):
        with pytest.raises(BudgetError) as one:
            solve(kv_residency(costs, *option), 2**20, 200 * GiB, settings=FAST)
        alone.append(one.value.smallest_bytes)
    assert e.value.field == "gpu_memory" and e.value.smallest_bytes == min(alone) < max(alone)


# --- the user's mistakes and distill plan ----------------------------------------------------------


@pytest.mark.parametrize("text", ["", "7,x", "0,8", "8,8", "-4"])
def test_a_bad_candidate_list_is_refused(text):
    with pytest.raises(ConfigError, match="distinct chunk sizes") as e:
        OffloadConfig(chunk_candidates=text)
    assert e.value.field == "chunk_candidates" and repr(text) in str(e.value)
    assert OffloadConfig(chunk_candidates=" 16, 8").candidates == (8, 16)


def test_distill_plan_refuses_bad_candidates_in_one_line(tiny, capsys):  # noqa: F811
    for args, says in ((["--chunk-candidates", "7,x"], "--chunk-candidates is '7,x'; give distinct chunk sizes"),
                       (["--chunk-candidates", "7,25"], "25 is longer than the sequences trained (24 tokens"),
                       (["--chunk-candidates", "7,12", "--seq-len", "10"], "12 is longer than the sequences trained (10"),
                       (["--chunk-candidates", "7,12", "--chunk-tokens", "5"], "without the run's --chunk-tokens 5")):
        code, _, err = run_cli(plan_args(tiny, "--gpu-memory", "1GiB", *args), capsys)
        line = one_error_line(code, err)
        assert line.startswith("error: --chunk-candidates ") and says in line, line


def test_distill_plan_chooses_the_chunk_size_and_lists_the_candidates(tiny, tmp_path, capsys):  # noqa: F811
    """On the CPU (pages stay resident): each candidate profiled and planned, the table lists them
    with their predicted step time and peaks and marks the chosen one, the JSON holds the choice."""
    path = tmp_path / "plan.json"
    code, out, err = run_cli(plan_args(tiny, "--gpu-memory", "1GiB", "--chunk-candidates", "7,12", "--page-tokens",
                                       "16", "--out", path), capsys)
    assert code == 0, err
    plan = OffloadPlan.load(path)
    assert plan.chunk_tokens in (7, 12) and plan.kv_offload is False
    assert [c.chunk_tokens for c in plan.chunk_choices] == [7, 12]
    chosen = [c for c in plan.chunk_choices if c.chunk_tokens == plan.chunk_tokens][0]
    assert chosen.step_s == plan.predicted.step_s == min(c.step_s for c in plan.chunk_choices)
    assert "chunk sizes and key/value pages considered" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("│            7", "│           12"))]
    assert len(rows) == 2 and sum("chosen" in row for row in rows) == 1
    assert f"{plan.chunk_tokens} tokens a chunk" in out
    assert json.loads(path.read_text())["chunk_choices"][0]["chunk_tokens"] == 7
