"""student/offload/runtime.py with the chunk-recurrent engine (student/long_context/): offloaded
chunk-recurrent training gives the losses, gradient norms, evaluations and final weights of
chunk-recurrent training without offload, bit for bit on the CPU (a chunk size that does not divide
the sequences, two micro-batches a step, the states on either side, the update on either side,
AdamW and FOAM); a plan made for another chunk size is refused in one line, unless the planner chose
it among candidates (--chunk-candidates) that held the run's: the run then trains with the plan's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from distill.configs import ConfigError
from student.model import Student
from student.offload.plan import OffloadPlan
from student.planner.solve import PHASES
from student.trainer import train
from test_offload import config, plan_file, results, same_weights, small  # noqa: F401 (small: the fixture)
from test_trainer import rows

CHUNK = 7  # the cached sequences have 24 positions: chunks of 7, 7, 7 and 3
CHUNKED = dict(chunk_tokens=CHUNK, page_tokens=16)

PLANS = {  # (layers, prefetch depth, optimizer side): test_offload.plan_file's notation
    "host-cpu": ("rr kr rr or", 1, "cpu"),  # every layer's states on the host, the update on the CPU
    "host-gpu": ("rr rr kr rr", 0, "gpu"),  # on the host, the update in slices on the device
    "states-cpu": ("rg rr kg rr", 1, "cpu"),  # layers 0 and 2: states on the device
    "states-gpu": ("kg rr rg or", 2, "gpu"),
    "streamed-gpu": ("rs os ks rr", 1, "gpu"),  # weights streamed, chunk by chunk
    "embedding-gpu": ("rr rr kr rg", 0, "gpu", "host"),  # the input embedding in host memory
}

_REFERENCE: dict[str, Path] = {}


def reference(small, tmp_path_factory, optimizer: str, chunk_tokens: int = CHUNK) -> Path:  # noqa: F811 (small: the fixture)
    """Chunk-recurrent training without offload (once per optimizer and chunk size in this module)."""
    key = f"{optimizer}-{chunk_tokens}"
    if key not in _REFERENCE:
        out = tmp_path_factory.mktemp(f"chunked-{key}") / "run"
        train(config(small, out, optimizer=optimizer, **{**CHUNKED, "chunk_tokens": chunk_tokens}), progress=False)
        _REFERENCE[key] = out
    return _REFERENCE[key]


@pytest.mark.parametrize("optimizer, plan", [("adamw", "host-cpu"), ("adamw", "host-gpu"), ("foam", "states-cpu"),
                                             ("foam", "states-gpu"), ("adamw", "streamed-gpu"),
                                             ("adamw", "embedding-gpu")])
def test_offloaded_chunk_recurrent_training_equals_it_without_offload(small, tmp_path, tmp_path_factory,  # noqa: F811
                                                                      optimizer, plan):
    """Six steps of two micro-batches of four chunks, evaluations at 0, 3 and 6 (chunked, without
    gradients): every loss, KL, gradient norm, evaluation and final weight is the run's without
    offload, exactly; the measured phases include pass 1's forwards."""
    want = reference(small, tmp_path_factory, optimizer)
    out, path = tmp_path / "run", tmp_path / "plan.json"
    plan_file(path, *PLANS[plan])
    OffloadPlan.from_dict({**OffloadPlan.load(path).to_dict(), "chunk_tokens": CHUNK}).save(path)
    train(config(small, out, optimizer=optimizer, offload=str(path), **CHUNKED), progress=False)
    assert results(out) == results(want)
    assert len(rows(out)) == 6 and len(rows(out, "eval")) == 3
    assert same_weights(out / "student", want / "student")
    assert json.loads((out / "run.json").read_text())["offload_plan"]["chunk_tokens"] == CHUNK
    phases = rows(out)[-1]["offload_phase_s"]
    assert set(phases) == set(PHASES) and all(t >= 0 for t in phases.values()) and phases["forward"] > 0


def test_offload_auto_plans_the_chunked_step_and_trains_as_without_offload(small, tmp_path, tmp_path_factory):  # noqa: F811
    """--offload auto with --chunk-tokens: the planner's plan (made for this chunk size, weights
    resident) trains to the results of chunk-recurrent training without offload, exactly."""
    want = reference(small, tmp_path_factory, "adamw")
    out = tmp_path / "run"
    train(config(small, out, offload="auto", gpu_memory="1GiB", host_memory="4GiB", **CHUNKED), progress=False)
    assert results(out) == results(want)
    plan = OffloadPlan.from_dict(json.loads((out / "run.json").read_text())["offload_plan"])
    assert plan.chunk_tokens == CHUNK and plan.resident_pages is not None
    assert all(lp.params == "resident" for lp in plan.layers)


def test_a_plan_for_another_chunk_size_is_refused(small, tmp_path):  # noqa: F811
    """In one line naming --offload, with both chunk settings, before anything trains."""
    path = tmp_path / "plan.json"
    plan_file(path, *PLANS["host-cpu"])
    OffloadPlan.from_dict({**OffloadPlan.load(path).to_dict(), "chunk_tokens": 5}).save(path)
    for overrides, seen in ((CHUNKED, f"--chunk-tokens {CHUNK}"), ({}, "whole sequences")):
        with pytest.raises(ConfigError, match="--chunk-tokens 5") as e:
            train(config(small, tmp_path / "run", offload=str(path), **overrides), progress=False)
        assert e.value.field == "offload" and seen in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not rows(tmp_path / "run")


def test_offload_auto_with_chunk_candidates_trains_with_the_chosen_chunk_size(small, tmp_path, tmp_path_factory):  # noqa: F811
    """--offload auto --chunk-candidates 7,12 and no --chunk-tokens: the planner profiles both, the
    run trains with the one it chose (run.json's config and plan say which; on the CPU the pages
    stay resident) and gives exactly the results of chunk-recurrent training without offload at
    that chunk size."""
    out = tmp_path / "run"
    train(config(small, out, offload="auto", gpu_memory="1GiB", host_memory="4GiB", chunk_candidates="7,12",
                 page_tokens=16), progress=False)
    run = json.loads((out / "run.json").read_text())
    plan = OffloadPlan.from_dict(run["offload_plan"])
    assert plan.chunk_tokens in (7, 12) and [c.chunk_tokens for c in plan.chunk_choices] == [7, 7, 12, 12]  # x 2 embedding homes
    assert (run["config"]["chunk_tokens"], run["config"]["kv_offload"]) == (plan.chunk_tokens, False)
    want = reference(small, tmp_path_factory, "adamw", plan.chunk_tokens)
    assert results(out) == results(want)
    assert same_weights(out / "student", want / "student")


def test_a_plan_that_chose_its_chunk_size_trains_with_it_unless_the_run_gives_another(small, tmp_path):  # noqa: F811
    """A saved plan whose chunk size the planner chose among 5 and 7: a run with --chunk-tokens 5
    (a candidate) or none trains with 7 and the plan's pages; one with 9 is refused in one line, as
    are --chunk-candidates beside a plan file or without offload."""
    path = tmp_path / "plan.json"
    plan_file(path, *PLANS["host-cpu"])
    choices = [dict(chunk_tokens=n, kv_offload=False, offload_pages=4, resident_pages=8) for n in (5, 7)]
    OffloadPlan.from_dict({**OffloadPlan.load(path).to_dict(), "chunk_tokens": CHUNK, "kv_offload": False,
                           "offload_pages": 4, "chunk_choices": choices}).save(path)
    short = dict(steps=1, warmup_steps=1, eval_every=0, save_every=0, page_tokens=16)
    for given in (5, None):
        out = tmp_path / f"run-{given}"
        train(config(small, out, offload=str(path), chunk_tokens=given, **short), progress=False)
        flat = json.loads((out / "run.json").read_text())["config"]
        assert (flat["chunk_tokens"], flat["offload_pages"]) == (CHUNK, 4) and len(rows(out)) == 1
    refused = [(dict(chunk_tokens=9, offload=str(path)), "offload", "--chunk-tokens 9"),
               (dict(chunk_tokens=CHUNK, offload=str(path), chunk_candidates="5,7"), "chunk_candidates", "a saved plan"),
               (dict(chunk_tokens=CHUNK, chunk_candidates="5,7"), "chunk_candidates", "--offload none")]
    for overrides, field, says in refused:
        with pytest.raises(ConfigError) as e:
            train(config(small, tmp_path / "refused", **{**short, **overrides}), progress=False)
        assert e.value.field == field and says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "refused" / "run.json").exists()


def test_a_plan_that_keeps_fewer_chunks_attention_trains_so_unless_the_run_gives_another(small, tmp_path,  # noqa: F811
                                                                                        tmp_path_factory):
    """A saved plan whose pass 1 keeps one chunk's attention output (the planner's choice for a host
    budget): a run without --keep-attention-chunks, or with 1, trains keeping 1 (run.json's config
    says so) to the losses of keeping all; one with 2 is refused in one line naming the option."""
    path = tmp_path / "plan.json"
    plan_file(path, *PLANS["host-cpu"])
    OffloadPlan.from_dict({**OffloadPlan.load(path).to_dict(), "chunk_tokens": CHUNK,
                           "keep_attention_chunks": 1}).save(path)
    want = [r["loss"] for r in rows(reference(small, tmp_path_factory, "adamw"))]
    for given in (None, 1):
        out = tmp_path / f"run-{given}"
        train(config(small, out, offload=str(path), keep_attention_chunks=given, **CHUNKED), progress=False)
        assert json.loads((out / "run.json").read_text())["config"]["keep_attention_chunks"] == 1
        assert [r["loss"] for r in rows(out)] == pytest.approx(want, rel=1e-5)
    with pytest.raises(ConfigError) as e:
        train(config(small, tmp_path / "refused", offload=str(path), keep_attention_chunks=2, **CHUNKED),
              progress=False)
    assert e.value.field == "keep_attention_chunks" and "keeps the attention outputs of 1" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "refused" / "run.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_offloaded_chunk_recurrent_training_matches_within_bf16(small, tmp_path):  # noqa: F811
    """bf16 autocast on the GPU, the pages in pinned host memory (kv_offload): every plan's losses
    follow chunk-recurrent training without offload to bf16 tolerance."""
    gpu = dict(device="cuda", save_every=0, eval_every=0, kv_offload=True, offload_pages=1, **CHUNKED)
    train(config(small, tmp_path / "plain", **gpu), progress=False)
    want = [r["loss"] for r in rows(tmp_path / "plain")]
    for name, spec in PLANS.items():
        out, path = tmp_path / name, tmp_path / f"{name}.json"
        plan_file(path, *spec)
        train(config(small, out, offload=str(path), **gpu), progress=False)
        assert [r["loss"] for r in rows(out)] == pytest.approx(want, rel=2e-2), name


def test_the_cost_table_accumulates_as_the_runtime_does_even_at_one_chunk(small, tmp_path):  # noqa: F811
    """The runtime keeps a host layer's gradient in fp32 whenever chunks are on (a batch's chunk
    count is known only when it runs), so the profile's table says so even when every sequence
    fits one chunk; without chunks and at one micro-batch the gradients are the working dtypes'."""
    from student.planner.profile import profile
    from student.step import steps_accumulate

    one_chunk = config(small, tmp_path / "a", grad_accum=1, chunk_tokens=32, page_tokens=16)  # sequences of 24
    costs = profile(one_chunk)
    assert costs.micro_batches == 1 and costs.accumulates and steps_accumulate(one_chunk)
    whole = config(small, tmp_path / "b", grad_accum=1)
    assert not profile(whole).accumulates and not steps_accumulate(whole)


@pytest.mark.parametrize("optimizer", ["adamw8bit", "foam"])
def test_the_cost_table_measures_the_untied_input_embedding_a_plan_may_keep_on_the_host(small, tmp_path,  # noqa: F811
                                                                                        optimizer):
    """Its fp32 master's bytes, and its optimizer states' as the optimizer makes them (FOAM keeps an
    embedding in plain Adam, unlike the head)."""
    from student.optim.build import build_optimizer
    from student.planner.profile import profile

    cfg = config(small, tmp_path / "a", grad_accum=1, optimizer=optimizer)
    costs = profile(cfg)
    student = Student.from_pretrained(small[0])
    weight = student.embed_tokens.weight
    assert costs.embedding_bytes == weight.numel() * 4 and costs.embedding == "gpu"
    optimizer = build_optimizer(student, cfg.optim, "cpu")  # as the trainer builds it: FOAM knows an embedding by its module
    for p in student.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    states = sum(v.nbytes for v in optimizer.state[weight].values() if isinstance(v, torch.Tensor))
    assert costs.embedding_state_bytes == states > 0


@pytest.mark.parametrize("keep", [4, 1])
def test_the_cost_table_counts_what_the_loader_holds_in_host_memory(small, tmp_path, keep):  # noqa: F811
    """Without chunks the store holds nothing, so the table's static host bytes are the loader's:
    the batches the trainer's Prefetcher holds at most, each a micro-batch of this config's reads
    (not pinned on the CPU), and its worker's shard cache at its fullest, decoding the largest
    training shard (file bytes and twice its decoded arrays) while it keeps the next `keep`
    (--loader-shards) largest ones."""
    from student.data import CacheBatches, Prefetcher, split_indices
    from student.planner.profile import profile
    from teacher_cache.reader import CacheReader

    cfg = config(small, tmp_path / "a", grad_accum=1, loader_shards=keep)
    reader = CacheReader(small[1])
    train_idx = split_indices(reader.num_sequences, cfg.heldout)[0]
    data = CacheBatches(reader, train_idx, cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    batch = next(iter(data))
    batch_bytes = sum(t.nbytes for t in (batch.input_ids, batch.topk_ids, batch.topk_logprobs, batch.tail_logmass,
                                         batch.target_ids, batch.target_logprob, batch.mask))
    starts = np.cumsum([0] + [s.sequences for s in reader.manifest.shards])
    shards = sorted({int(np.searchsorted(starts, i, side="right")) - 1 for i in train_idx},
                    key=lambda s: -reader.manifest.shards[s].tokens)
    decoded = []
    for index in shards:
        shard = reader.load_shard(index)
        decoded.append(sum(a.nbytes for a in (shard.input_ids, shard.seq_offsets, *shard.targets.arrays)
                           if a is not None))
    assert len(shards) > keep + 1  # the cache keeps only the next `keep` largest
    loader = decoded[0] * 2 + reader.manifest.shards[shards[0]].bytes + sum(decoded[1:keep + 1])
    assert profile(cfg).static_host_bytes == Prefetcher.most_held(data.prefetch_workers) * batch_bytes + loader


def test_the_profile_counts_the_ids_and_mask_the_engine_holds(small, tmp_path):  # noqa: F811
    """9 bytes a position: an int64 id and a bool mask (student/long_context/engine.py)."""
    from student.planner.profile import profile

    cfg = config(small, tmp_path / "a", grad_accum=1, chunk_tokens=16, page_tokens=16)
    costs = profile(cfg)
    assert costs.kv.sequence_bytes == cfg.batch_size * costs.kv.seq_tokens * 9 > 0
