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
from student.planner.costs import kept_attention, kv_options, kv_residency, with_layers
from student.planner.table import ChunkSeconds, CostTable, KVPages
from student.offload.config import OffloadConfig
from student.offload.plan import LayerPlan, OffloadPlan
from student.planner.solve import (BudgetError, SolverSettings, choose_chunks, predict, program_step_s, smallest_budget, solve,
                             solve_kept)
from test_plan_command import plan_args
from test_planner import GiB, MS, layer, table

MiB = 2**20
from test_trainer import tiny  # noqa: F401  (the module-scoped fixture: a tiny student and cache)

FAST = SolverSettings(depths=(0,))  # one depth: a few small programs per choice


def kv(**changes) -> KVPages:
    """Four pages a layer (128 positions, pages of 32), two chunks of 64, on a GPU, resident; pass 1
    keeps the first chunk's attention output, GiB / 16 a layer. Offloaded, a layer's four pinned
    pools hold exactly 2 x 2e6 bytes (keys, values) and 2 x 4e6 (their gradients)."""
    base = dict(num_layers=1, seq_tokens=128, chunk_tokens=64, page_tokens=32, kv_page_bytes=10**6,
                grad_page_bytes=2 * 10**6, kept_out_bytes=GiB // 16 // 64, kept_lse_bytes=0, offloadable=True)
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
    """Offloaded, each pinned pool holds its exact bytes (student/pinned.py) and each kept output
    the power of two torch's pinned allocator rounds it to; on the CPU nothing is pinned and every
    byte is counted as it is."""
    pages = kv(num_layers=2)
    page = 3 * 10**6  # keys, values and their gradients, of every row
    kept = 2 * GiB // 16 + 2 * GiB // 16  # pass 1's of the first chunk, and pass 2's own of the last
    pools = 2 * (2 * 2 * 10**6 + 2 * 4 * 10**6)  # two layers' four pools
    assert pages.bytes() == (2 * 4 * page, kept, 8)
    assert dataclasses.replace(pages, kv_offload=True, offload_pages=1).bytes() == (3 * page, pools + kept, 3)
    assert dataclasses.replace(pages, kv_offload=True, offload_pages=9).bytes() == (12 * page, pools + kept, 12)
    on_cpu = dataclasses.replace(pages, offloadable=False, kv_offload=True)  # the store keeps them where they are
    assert on_cpu.bytes() == (8 * page + 2 * GiB // 16, 0, 8)  # pass 2 uses its own where it is
    odd = dataclasses.replace(pages, kept_out_bytes=GiB // 16 // 64 + 1, kept_lse_bytes=3)  # just over, and 192 B
    assert odd.kept_bytes == 2 * (GiB // 8 + 256)
    assert dataclasses.replace(odd, offloadable=False).kept_bytes == 2 * 64 * (GiB // 16 // 64 + 1 + 3)
    assert kv_options(on_cpu) == [(False, 1024)]
    # 4 pages a layer, 2 a chunk: 4, then 1, 1, 1 raised to a chunk's 2, and the run's (4).
    assert kv_options(pages) == [(False, 1024), (True, 2), (True, 4)]
    assert kv_options(dataclasses.replace(pages, offload_pages=1)) == [(False, 1), (True, 1), (True, 2), (True, 4)]
    assert kv_options(dataclasses.replace(pages, chunk_tokens=512)) == [(False, 1024), (True, 4)]  # one chunk


def test_sparse_pages_count_their_gradient_pages_and_mean_keys():
    """Sparse mode: gradient pages for `grad_pages` pages a layer, not all, and a mean key a page."""
    pages = kv(num_layers=2, grad_pages=1, mean_key_bytes=5)
    kept = 2 * GiB // 16 + 2 * GiB // 16
    assert pages.bytes() == (2 * (4 * 10**6 + 1 * 2 * 10**6) + 2 * 4 * 5, kept, 8)
    pools = 2 * (2 * 2 * 10**6 + 2 * 1 * 10**6)  # the gradient pools of one page: 1e6 bytes each
    assert dataclasses.replace(pages, kv_offload=True, offload_pages=1).bytes() == (3 * 3 * 10**6 + 40, pools + kept, 3)


def test_the_sequences_ids_and_mask_count_once_on_the_device_wherever_the_pages_are():
    """The engine holds a micro-batch's ids and mask on the device whole: once, not per layer, and
    beside the pages whether they are resident, offloaded or on the CPU."""
    for changes in ({}, {"kv_offload": True, "offload_pages": 1}, {"offloadable": False}):
        for layers in (1, 3):
            plain = kv(num_layers=layers, **changes)
            held = dataclasses.replace(plain, sequence_bytes=7)
            assert held.bytes() == (plain.bytes()[0] + 7, *plain.bytes()[1:])


def test_a_table_of_more_layers_like_its_first_is_the_table_measured_with_them():
    """`with_layers`: the table of a student with n layers like the profiled one's, as a profile of
    all n would have measured them: n layers, pass 1 n times as long, the pages of n layers."""
    one = chunked(kv(num_layers=1), layer())
    three = chunked(kv(num_layers=3), layer(), layer(), layer(), pass1_s=30 * MS,
                    static_host_bytes=GiB + kv(num_layers=3).bytes()[1])
    assert with_layers(one, 3) == three
    # Priced after: `kv_residency` charges the top layer's page copies apart (no layer above prefetches them).
    assert kv_residency(with_layers(one, 3), True, 1) == kv_residency(three, True, 1)
    plan = OffloadPlan(layers=(LayerPlan("keep", "resident", "gpu"),) * 3, optimizer="gpu")
    assert predict(with_layers(one, 3), plan) == predict(three, plan)


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
    assert offloaded.static_host_bytes == GiB + 2 * 2 * 10**6 + 2 * 4 * 10**6 + 2 * GiB // 16  # pinned pools: `kv`
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


def test_the_attention_output_brought_ahead_counts_beside_a_layers_backward():
    """On a GPU pass 2 brings layer l - 1's attention output and lse of the chunk to the device
    while layer l runs its backward, for l - 1's recomputation (`KVPages.held_attention_bytes`):
    one layer's, beside a layer's backward; not beside the head's workspace (no layer's is
    brought then) nor the embedding's late gradient; nothing on the CPU, where the kept outputs
    are used where they are. The program prices the same peak: the smallest budget grows by it."""
    pages = kv(num_layers=2)
    copies = 64 * (GiB // 16 // 64)  # one layer's, a chunk of 64 positions
    assert pages.held_attention_bytes == copies
    assert dataclasses.replace(pages, offloadable=False).held_attention_bytes == 0
    none = dataclasses.replace(pages, kept_out_bytes=0)
    assert none.held_attention_bytes == 0 and none.bytes()[0] == pages.bytes()[0]  # same pages on the device
    plan = OffloadPlan.uniform(2, "recompute", "resident", prefetch_depth=0, optimizer="gpu")
    peak = lambda pages, **changes: predict(chunked(pages, layer(), layer(), **changes), plan).gpu_peak_bytes
    assert peak(pages) - peak(none) == copies  # a layer's backward binds
    for binding in ({"loss_workspace_bytes": 40 * GiB}, {"late_grad_bytes": 40 * GiB}):
        assert peak(pages, **binding) == peak(none, **binding)  # the head's workspace, the embedding's gradient
    least = lambda pages: smallest_budget(chunked(pages, layer(), layer()), "gpu", None)[1]
    assert least(pages) - least(none) == copies


# --- choose_chunks on hand-made tables ------------------------------------------------------------


def test_a_large_budget_keeps_the_pages_resident_and_a_small_one_offloads_them():
    costs = chunked(kv(num_layers=2, kv_page_bytes=GiB // 4, grad_page_bytes=GiB // 2), layer(), layer())
    roomy, _ = choose_chunks({64: costs}, 200 * GiB, 200 * GiB, settings=FAST)
    assert (roomy.chunk_tokens, roomy.kv_offload, roomy.resident_pages) == (64, False, 8)
    assert roomy.predicted.step_s == min(c.step_s for c in roomy.chunk_choices)
    assert [(c.kv_offload, c.offload_pages) for c in roomy.chunk_choices] == kv_options(costs.kv)
    # Too small for every page on the GPU (6 GiB of them), large enough for sets of a chunk's two
    # pages (4.5 GiB).
    least = lambda *option: smallest_budget(kv_residency(costs, *option), "gpu", None)[1]
    budget = least(False, 1024) - GiB
    assert budget > least(True, 2)
    tight, tight_costs = choose_chunks({64: costs}, budget, 200 * GiB, settings=FAST)
    assert (tight.kv_offload, tight.offload_pages, tight.resident_pages) == (True, 2, 6)
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


# --- how many chunks' attention pass 1 keeps -------------------------------------------------------


def eight_chunks(**changes) -> CostTable:
    """Eight chunks of 64 a micro-batch, pass 1 keeping the attention outputs of the seven before the
    last (GiB / 4 each); a layer's pass-2 forward 10 ms (first chunk) to 40 ms (last) attending, 1 to
    4 ms on a kept output; its pages resident on a GPU."""
    pages = kv(seq_tokens=512, kept_out_bytes=GiB // 4 // 64, **changes)
    chunk = ChunkSeconds(first_forward_s=10 * MS, last_forward_s=40 * MS, first_kept_forward_s=1 * MS,
                         last_kept_forward_s=4 * MS)
    costs = chunked(pages, layer(chunk=chunk), micro_batches=8, chunks=8)
    return kept_attention(costs, pages.keep_chunks)  # forward_s as the profile makes it


def test_keeping_fewer_chunks_reprices_the_forward_and_the_host_bytes():
    """Chunk j's forward interpolates the first and last chunk's: attending 10 + 30 j / 7 ms, kept
    1 + 3 j / 7; the kept chunks are the last N before the final one, each GiB / 4 of host memory."""
    costs = eight_chunks()
    attending = [10 + 30 * j / 7 for j in range(8)]
    kept_s = [1 + 3 * j / 7 for j in range(8)]
    for n in (None, 7, 3, 0):
        priced = kept_attention(costs, n)
        k = 7 if n is None else n
        want = (sum(attending[:7 - k]) + sum(kept_s[7 - k:7]) + attending[7]) / 8 * MS
        assert priced.layers[0].forward_s == pytest.approx(want), n
        assert priced.kv.kept_bytes == k * GiB // 4
        assert priced.static_host_bytes == costs.static_host_bytes - (7 - k) * GiB // 4
        assert priced.kv_gpu_bytes == costs.kv_gpu_bytes
    assert kept_attention(costs, None) == costs
    more = kept_attention(costs, 9)  # more chunks than pass 1 runs: all of them
    assert (more.layers, more.static_host_bytes) == (costs.layers, costs.static_host_bytes)
    on_cpu = eight_chunks(offloadable=False)  # there the outputs stay on the device
    assert kept_attention(on_cpu, 2).kv_gpu_bytes == on_cpu.kv_gpu_bytes - 5 * GiB // 4


def test_a_recomputation_takes_pass_2s_own_attention_output_in_every_chunk():
    """A recomputed layer's forward in the backward takes the attention output pass 2 kept (pass
    1's or its own), also in the last chunk and the chunks pass 1 did not keep: priced by the kept
    forwards, 1 + 3 j / 7 ms, 2.5 ms on average, whatever the number kept; a kept layer pays none.
    The program prices it the same (`program_step_s`: its step with the plan fixed)."""
    for n in (None, 3, 0):
        priced = kept_attention(eight_chunks(), n)
        assert priced.layers[0].recompute_s == pytest.approx(2.5 * MS)
        for act in ("recompute", "offload", "keep"):
            plan = OffloadPlan.uniform(1, act, "resident", prefetch_depth=0, optimizer="gpu")
            assert program_step_s(priced, plan) == pytest.approx(predict(priced, plan).step_s, rel=1e-9), (n, act)
        recomputed, kept = (predict(priced, OffloadPlan.uniform(1, act, "resident", prefetch_depth=0, optimizer="gpu"))
                            for act in ("recompute", "keep"))
        assert recomputed.phase_s["backward"] - kept.phase_s["backward"] == pytest.approx(8 * 2.5 * MS)


def test_the_planner_keeps_the_most_chunks_whose_outputs_fit_the_host_budget():
    """All seven chunks' outputs do not fit; the plan keeps the last N that do (N + 1 would not),
    predicts a step slower than keeping all and faster than keeping none, and says so in its file.
    A run that fixed --keep-attention-chunks is planned with its own N (and refused when it does
    not fit); a budget that fits everything keeps everything."""
    costs = eight_chunks()
    least = smallest_budget(kept_attention(costs, 0), "host", 200 * GiB, settings=FAST)[1]
    budget = least + 3 * GiB // 4 + GiB // 8  # room for three chunks' outputs and a half
    plan, priced = solve_kept(costs, 200 * GiB, budget, settings=FAST)
    assert plan.keep_attention_chunks == 3 and priced.kv.keep_chunks == 3
    assert plan.predicted == predict(priced, plan) and plan.predicted.host_peak_bytes <= budget
    with pytest.raises(BudgetError) as e:
        solve(kept_attention(costs, 4), 200 * GiB, budget, settings=FAST)
    assert e.value.field == "host_memory"
    all_kept = solve(costs, 200 * GiB, 200 * GiB, settings=FAST)
    none_kept = solve(kept_attention(costs, 0), 200 * GiB, budget, settings=FAST)
    assert all_kept.predicted.step_s < plan.predicted.step_s < none_kept.predicted.step_s
    assert OffloadPlan.from_dict(json.loads(json.dumps(plan.to_dict()))).keep_attention_chunks == 3

    roomy, _ = solve_kept(costs, 200 * GiB, 200 * GiB, settings=FAST)
    assert roomy.keep_attention_chunks is None and roomy.predicted == all_kept.predicted
    fixed = kept_attention(costs, 5)
    with pytest.raises(BudgetError) as e:
        solve_kept(fixed, 200 * GiB, budget, settings=FAST)
    assert e.value.field == "host_memory"
    with pytest.raises(BudgetError) as e:  # not even without kept outputs: the error names that plan's least
        solve_kept(costs, 200 * GiB, least - GiB, settings=FAST)
    assert e.value.field == "host_memory" and e.value.smallest_bytes < least + GiB // 8
    chosen, _ = choose_chunks({64: costs}, 200 * GiB, budget, settings=FAST)
    resident = next(c for c in chosen.chunk_choices if not c.kv_offload)
    assert resident.keep_attention_chunks == 3


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
    """On the CPU (pages stay resident): each candidate profiled and planned, with the untied input
    embedding on the device and in host memory; the table lists them with their predicted step time
    and peaks and marks the chosen one, the JSON holds the choice."""
    path = tmp_path / "plan.json"
    code, out, err = run_cli(plan_args(tiny, "--gpu-memory", "1GiB", "--chunk-candidates", "7,12", "--page-tokens",
                                       "16", "--out", path), capsys)
    assert code == 0, err
    plan = OffloadPlan.load(path)
    assert plan.chunk_tokens in (7, 12) and plan.kv_offload is False
    assert [(c.chunk_tokens, c.embedding) for c in plan.chunk_choices] == [(7, "gpu"), (7, "host"), (12, "gpu"),
                                                                           (12, "host")]
    chosen = [c for c in plan.chunk_choices if (c.chunk_tokens, c.embedding) == (plan.chunk_tokens, plan.embedding)][0]
    assert chosen.step_s == plan.predicted.step_s == min(c.step_s for c in plan.chunk_choices)
    assert "chunk sizes and key/value pages considered" in out
    rows = [line for line in out.splitlines() if line.startswith("│") and line.split("│")[1].strip() in ("7", "12")]
    assert len(rows) == 4 and sum("chosen" in row for row in rows) == 1
    assert f"{plan.chunk_tokens} tokens a chunk" in out
    assert json.loads(path.read_text())["chunk_choices"][0]["chunk_tokens"] == 7
