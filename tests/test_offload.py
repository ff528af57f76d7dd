"""student/offload/runtime.py through the trainer: offloaded training (plans mixing keep / recompute /
offload activations with resident / streamed weights, prefetch depths 0-2, the update on the host
or in slices on the device) gives the losses, gradient norms, evaluations and final weights of
training without offload, bit for bit on the CPU, for every optimizer and with grad_accum > 1; a
killed offloaded run resumes (with or without offload) like any other; wrong plans and unsupported
combinations are refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from distill.configs import ConfigError
from student.model import Student
from student.offload.plan import LayerPlan, OffloadPlan
from student.planner.solve import PHASES
from student.trainer import TrainConfig, train
from test_cache_synth import make_corpus, write_cache
from test_trainer import KILLED, VOCAB, _train_in_subprocess, make_student, rows, tokenizer_hash

NUM_LAYERS = 4
TIMING = ("tok_per_s", "offload_step_s", "offload_host_bytes")  # measured, not results


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(student folder, cache dir): a 4-layer student whose matrices reach the 8-bit optimizer's
    min_8bit_size (4096), so every optimizer's real state kinds sit in host memory."""
    root = tmp_path_factory.mktemp("offload")
    student = make_student(root / "student", num_layers=NUM_LAYERS, hidden_size=64, intermediate_size=128,
                           head_dim=16)
    corpus = make_corpus(num_seqs=24, seq_len=24, k=8, vocab=VOCAB, seed=1)
    write_cache(root / "cache", corpus, tokenizer__hash=tokenizer_hash(student), shard_size=4, fmt="parquet")
    return student, root / "cache"


def config(small, out, **overrides) -> TrainConfig:
    student, cache = small
    base = dict(cache=str(cache), out=str(out), student=str(student), steps=6, grad_accum=2, batch_size=3, lr=1e-2,
                warmup_steps=2, heldout=4, eval_every=3, save_every=4, log_every=1, seed=0, deterministic=True,
                device="cpu", foam_level=1)
    return TrainConfig.from_flat(**{**base, **overrides})


def plan_file(path: Path, layers: str, prefetch_depth: int, optimizer: str, embedding: str = "gpu") -> str:
    """layers: per layer "activation/params" initials, e.g. "ks rs or og" (k keep, r recompute,
    o offload; s stream, r resident, g resident with the layer's states on the device)."""
    names = {"k": "keep", "r": "recompute", "o": "offload"}
    homes = {"r": ("resident", "host"), "s": ("stream", "host"), "g": ("resident", "gpu")}
    plan = OffloadPlan(layers=tuple(LayerPlan(names[a], *homes[p]) for a, p in layers.split()),
                       prefetch_depth=prefetch_depth, optimizer=optimizer, embedding=embedding)
    plan.save(path)
    return str(path)


_REFERENCE: dict[str, Path] = {}


def reference(small, tmp_path_factory, optimizer: str) -> Path:
    """The run without offload (once per optimizer in this module)."""
    if optimizer not in _REFERENCE:
        out = tmp_path_factory.mktemp(f"reference-{optimizer}") / "run"
        train(config(small, out, optimizer=optimizer), progress=False)
        _REFERENCE[optimizer] = out
    return _REFERENCE[optimizer]


def results(out: Path) -> tuple[list, list]:
    """(train rows without their timings, eval rows)."""
    train_rows = [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("offload_")} for r in rows(out)]
    return train_rows, rows(out, "eval")


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = Student.from_pretrained(a).state_dict(), Student.from_pretrained(b).state_dict()
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


PLANS = {  # every activation x params pair, prefetch 0 / 1 / 2, the update on either side
    "mixed-cpu": ("ks rs or os", 1, "cpu"),
    "mixed-gpu": ("os kr rr ks", 2, "gpu"),
    "streamed-gpu": ("rs os ks rs", 0, "gpu"),
    "resident-cpu": ("kr or rr kr", 2, "cpu"),
    "states-cpu": ("kg os rr og", 1, "cpu"),  # layers 0 and 3: states on the device
    "states-gpu": ("rg ks kg or", 0, "gpu"),
    "embedding-cpu": ("ks rs or og", 1, "cpu", "host"),  # the input embedding in host memory
    "embedding-gpu": ("rg os kr rs", 0, "gpu", "host"),
}


@pytest.mark.parametrize("optimizer, plan", [("adamw", "mixed-cpu"), ("adamw", "streamed-gpu"),
                                             ("foam", "mixed-gpu"), ("foam", "resident-cpu"),
                                             ("adamw8bit", "mixed-cpu"), ("adamw8bit", "mixed-gpu"),
                                             ("adamw", "states-cpu"), ("foam", "states-gpu"),
                                             ("adamw8bit", "embedding-cpu"), ("adamw", "embedding-gpu")])
def test_offloaded_training_equals_training_without_offload(small, tmp_path, tmp_path_factory, optimizer, plan):
    """Six steps of two micro-batches, evaluations at 0, 3 and 6 (the no-grad forward through the
    streamed layers): every loss, KL, gradient norm, evaluation and final weight is the run's
    without offload, exactly. The run records its plan and its figures."""
    want = reference(small, tmp_path_factory, optimizer)
    out = tmp_path / "run"
    train(config(small, out, optimizer=optimizer, offload=plan_file(tmp_path / "plan.json", *PLANS[plan])),
          progress=False)
    assert results(out) == results(want)
    assert len(rows(out)) == 6 and len(rows(out, "eval")) == 3
    assert same_weights(out / "student", want / "student")
    run = json.loads((out / "run.json").read_text())
    assert OffloadPlan.from_dict(run["offload_plan"]) == OffloadPlan.load(tmp_path / "plan.json")
    row = rows(out)[-1]
    assert row["offload_step_s"] > 0 and row["offload_predicted_step_s"] == 0.0
    saved = OffloadPlan.load(tmp_path / "plan.json")
    on_host = [i for i, lp in enumerate(saved.layers) if lp.states == "host"]
    model = Student.from_pretrained(want / "student")
    host_params = [p for i in on_host for p in model.layers[i].parameters()]
    host_params += [model.embed_tokens.weight] if saved.embedding == "host" else []
    master_and_grads = 2 * 4 * sum(p.numel() for p in host_params)
    # Plus their optimizer states, at most two fp32 moments (AdamW) and step counters.
    assert master_and_grads < row["offload_host_bytes"] <= 2 * master_and_grads + 8 * 64 * len(host_params)
    assert set(row["offload_phase_s"]) == set(PHASES) and all(t >= 0 for t in row["offload_phase_s"].values())


@pytest.mark.parametrize("plan, grad_accum", [("mixed-gpu", 2), ("states-cpu", 2), ("streamed-gpu", 1),
                                              ("embedding-cpu", 2)])
def test_offloaded_clipping_equals_clipping_without_offload(small, tmp_path, plan, grad_accum):
    """A max norm small enough that every step clips: the host layers' norms measured on the device
    (of the micro-batches' sum), the coefficient applied inside the update (on the GPU in the slots,
    on the CPU read once) give the losses, gradient norms and weights of clip_grad_norm_foreach
    without offload, bit for bit (CPU: the same fp32 sums and products in the same order)."""
    want, out = tmp_path / "plain", tmp_path / "run"
    clipped = dict(optimizer="adamw", clip_grad=1e-3, grad_accum=grad_accum, save_every=0, eval_every=0)
    train(config(small, want, **clipped), progress=False)
    train(config(small, out, offload=plan_file(tmp_path / "plan.json", *PLANS[plan]), **clipped), progress=False)
    assert all(r["grad_norm"] > 10 * 1e-3 for r in rows(want))  # the clipping bites
    assert results(out) == results(want)
    assert same_weights(out / "student", want / "student")


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_copies_are_issued_prefetch_depth_layers_ahead_in_the_order_of_use(small, depth):
    """The plan's prefetch_depth counts layers, as the cost model does (student/planner/costs.py):
    a streamed layer's weights, and in the backward its offloaded input too, are issued when the
    runtime starts the layer `depth` places before it (forward in order, then backward from the
    top), whatever other copies that layer has; a resident layer counts as a place."""
    from student.offload.runtime import OffloadRuntime, _Schedule

    student, _ = small
    model = Student.from_pretrained(student)
    plan = OffloadPlan.load(plan_file(Path(student) / f"depth{depth}.json", "os os rr os", depth, "cpu"))
    runtime = OffloadRuntime(model, plan, "cpu")
    issued, real = [], runtime._issue

    def recording(schedule, k):
        out = real(schedule, k)
        if out is not None:
            issued.append((schedule.items[k], schedule.reached))
        return out

    runtime._issue = recording
    # A step's first micro-batch: no accumulators come in (the order only: nothing is issued here).
    order = _Schedule(runtime.plan, runtime.host, True, issue=None, release=None, streams=runtime.streams).items
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    model(ids).pow(2).mean().backward()
    assert [item for item, _ in issued] == order
    want = 0
    for item, reached in issued:
        # Due `depth` places ahead; an offloaded input is there from its layer's forward on, and
        # the copies after it in the order wait for it.
        ready = item[1] if item[0] == "x" else 0
        want = max(want, _Schedule.place_of(item[1], item[2], NUM_LAYERS) - depth, ready)
        assert reached == want, (item, reached, want)
    runtime.close()


def test_what_a_copy_out_reads_is_held_two_places_then_released(small):
    """An offloaded input (and on a GPU a gradient leaving for the host) is kept by the runtime
    (not record_stream'd) until the compute stream waits for their copy: two places after the one they
    are held at (a layer's work later), across micro-batches too; nothing is held after
    finish_grads."""
    from student.offload.runtime import OffloadRuntime

    student, _ = small
    model = Student.from_pretrained(student)
    runtime = OffloadRuntime(model, OffloadPlan.load(plan_file(Path(student) / "held-plan.json", "os os rr og", 1,
                                                               "cpu")), "cpu")
    held, releases = [], []
    real_hold, real_release = runtime._hold, runtime._release

    def hold(tensors, event):
        real_hold(tensors, event)
        held.append(runtime._schedule.reached)

    def release(before=math.inf):
        real_release(before)
        releases.append((runtime._schedule.reached, [place for place, *_ in runtime._held]))

    runtime._hold, runtime._release = hold, release
    ids = torch.randint(0, VOCAB, (2, 2, 12), generator=torch.Generator().manual_seed(3))
    for micro in ids:
        model(micro).pow(2).mean().backward()
    # Per micro-batch the inputs of layers 0, 1 and 3 (offloaded); the host layers' gradients are
    # held too where they leave on the d2h stream, on a GPU (on the CPU their copy is a plain one).
    assert held == [0, 1, 3] * 2
    for reached, places in releases[:-1]:
        assert all(reached - 1 <= place <= reached for place in places), (reached, places)
    assert any(places for _, places in releases)
    runtime.finish_grads()
    assert releases[-1][1] == [] and runtime._held == []
    runtime.close()


def test_the_runtime_clips_without_reading_host_gradients(small):
    """The host layers' gradient norms come from the device, measured as the sums left it: with the
    host accumulators poisoned after the backward, the runtime's clip_grad_norm still returns
    clip_grad_norm_foreach's norm of the model without offload, exactly, and scales the device
    gradients as it does; the update then scales the host gradients (here: their poisoned values)."""
    from student.offload.runtime import OffloadRuntime
    from student.optim.clip import clip_grad_norm_foreach

    student, _ = small
    plain, offloaded = Student.from_pretrained(student), Student.from_pretrained(student)
    runtime = OffloadRuntime(offloaded, OffloadPlan.load(plan_file(Path(student) / "clip-plan.json", "ks or rr kg", 1,
                                                                   "gpu")), "cpu")
    ids = torch.randint(0, VOCAB, (2, 2, 12), generator=torch.Generator().manual_seed(3))
    for model in (plain, offloaded):
        for micro in ids:  # two micro-batches: the norm is of their sum
            model(micro).pow(2).mean().backward()
    runtime.finish_grads()
    want = clip_grad_norm_foreach(plain.parameters(), 1e-3)
    for h in runtime.host:
        if not h.on_device:
            h.grad.fill_(float("nan"))
    got = runtime.clip_grad_norm(1e-3)
    assert torch.equal(got, want) and want > 1e-2
    device = [name for name, _ in offloaded.named_parameters() if not name.startswith("layers.")
              or name.startswith("layers.3.")]
    grads = dict(plain.named_parameters())
    pairs = [(p.grad, grads[name].grad) for name, p in offloaded.named_parameters() if name in device]
    assert all(a is None and b is None or torch.equal(a, b) for a, b in pairs)  # (the head is not used here)
    assert runtime._clip_coef is not None and runtime._clip_coef < 1
    runtime.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_checkpoint_right_after_an_offloaded_step_has_the_updated_masters(small, tmp_path):
    """The update on the GPU leaves its copies out in flight after the step (they overlap the next
    step); the trainer's checkpoint after the last step waits for them: it holds the final weights."""
    from student.checkpoint import latest_checkpoint, load_checkpoint

    for name in ("streamed-gpu", "embedding-gpu"):  # the input embedding's copies home are in flight too
        out = tmp_path / name
        train(config(small, out, device="cuda", steps=2, save_every=1, eval_every=0,
                     offload=plan_file(tmp_path / f"{name}.json", *PLANS[name])), progress=False)
        model = Student.from_pretrained(small[0])
        load_checkpoint(latest_checkpoint(out), model)
        final = Student.from_pretrained(out / "student").state_dict()
        assert all(torch.equal(v.float(), final[k].float()) for k, v in model.state_dict().items()), name


@pytest.mark.parametrize("killed, resumed", [("mixed-gpu", "none"), ("none", "mixed-cpu"),
                                             ("embedding-gpu", "embedding-cpu")])
def test_killed_run_resumes_with_or_without_offload(small, tmp_path, tmp_path_factory, killed, resumed):
    """Killed (SIGKILL) after step 5 with a checkpoint at 4; the rerun, with the
    other offload setting (a change a run may make: the checkpoint format is the same), resumes at
    4 and matches the uninterrupted run without offload exactly."""
    want = reference(small, tmp_path_factory, "adamw")
    setting = lambda name: "none" if name == "none" else plan_file(tmp_path / f"{name}.json", *PLANS[name])
    cfg = config(small, tmp_path / "killed", offload=setting(killed))
    assert _train_in_subprocess(cfg, exit_after=5) == KILLED
    assert [r["step"] for r in rows(cfg.out)][-1] == 5 and not (Path(cfg.out) / "student").exists()
    assert _train_in_subprocess(cfg.with_flat(offload=setting(resumed))) == 0
    keys = ("step", "loss", "kl", "lr", "grad_norm", "tokens", "epoch")
    assert [{k: r[k] for k in keys} for r in rows(cfg.out)] == [{k: r[k] for k in keys} for r in rows(want)]
    assert rows(cfg.out, "eval") == rows(want, "eval")
    change = rows(cfg.out, "change")
    assert len(change) == 1 and change[0]["step"] == 4 and "offload" in change[0]["changes"]
    assert same_weights(Path(cfg.out) / "student", want / "student")


def test_a_plan_for_another_layer_count_is_refused(small, tmp_path, capsys):
    """In one line naming --offload, with both layer counts, before anything trains."""
    from cli_helpers import one_error_line, run_cli

    plan = plan_file(tmp_path / "plan.json", "rs rs rs", 1, "cpu")
    with pytest.raises(ConfigError, match="3 decoder layers but the student has 4") as e:
        train(config(small, tmp_path / "run", offload=plan), progress=False)
    assert e.value.field == "offload"
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not rows(tmp_path / "run")
    student, cache = small
    code, _, err = run_cli(["train-student", "--cache", cache, "--student", student, "--out", tmp_path / "cli",
                            "--device", "cpu", "--offload", plan, "--steps", "1", "--quiet"], capsys)
    line = one_error_line(code, err)
    assert "--offload" in line and "3 decoder layers" in line


def test_a_missing_plan_file_and_unsupported_combinations_are_refused(small, tmp_path):
    with pytest.raises(ConfigError, match="cannot read the plan"):
        train(config(small, tmp_path / "run", offload=str(tmp_path / "nowhere.json")), progress=False)
    assert config(small, tmp_path / "r2", offload="auto", chunk_tokens=8).long.chunk_tokens == 8  # chunked: supported
    with pytest.raises(ConfigError, match="sparse FFN"):
        config(small, tmp_path / "r3", offload="auto", sparse_ffn=True)


def test_an_input_embedding_in_host_memory_is_refused_for_a_tied_head(tmp_path):
    """The loss reads a tied head's matrix on the device: in one line naming --offload."""
    from student.offload.runtime import OffloadRuntime

    model = Student(Student.from_pretrained(make_student(tmp_path / "s", tie_word_embeddings=True)).config)
    plan = OffloadPlan.uniform(model.config.num_layers, embedding="host")
    with pytest.raises(ConfigError, match="tied") as e:
        OffloadRuntime(model, plan, "cpu")
    assert e.value.field == "offload"


def test_offload_auto_trains_with_the_planners_plan(small, tmp_path, tmp_path_factory):
    """Needs student/planner/solve.py (the planner branch); skipped until it is there."""
    pytest.importorskip("student.planner.solve")
    want = reference(small, tmp_path_factory, "adamw")
    out = tmp_path / "run"
    train(config(small, out, offload="auto", gpu_memory="1GiB", host_memory="4GiB"), progress=False)
    assert results(out) == results(want)
    assert len(json.loads((out / "run.json").read_text())["offload_plan"]["layers"]) == NUM_LAYERS


def test_a_gpu_peak_past_the_plans_budget_is_told_once(caplog):
    """The trainer's warning when a step held more than the plan's --gpu-memory (the rows' peak on a
    GPU; None on the CPU): said in one line naming the option, and only when the peak passed it."""
    import dataclasses
    import logging

    from student.offload.plan import Predicted
    from student.offload.run import told_over_budget

    plan = dataclasses.replace(OffloadPlan.uniform(2, "keep", "resident"), gpu_memory=7 * 2**30,
                               predicted=Predicted(step_s=1.0, gpu_peak_bytes=7 * 10**9, host_peak_bytes=0))
    with caplog.at_level(logging.WARNING, logger="student.offload.run"):
        assert not told_over_budget(plan, None)
        assert not told_over_budget(plan, 7 * 2**30)
        assert not told_over_budget(dataclasses.replace(plan, gpu_memory=None), 8 * 2**30)
        assert not caplog.records
        assert told_over_budget(plan, 7 * 2**30 + 1)
    (record,) = caplog.records
    assert "--gpu-memory" in record.getMessage() and "\n" not in record.getMessage()


def test_running_out_of_memory_under_the_cap_is_told_in_one_line_naming_the_option():
    from student.offload.run import over_cap_message

    message = over_cap_message("7GiB")
    assert "--gpu-memory 7GiB" in message and "expandable_segments:True" in message and "\n" not in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_offloaded_training_matches_within_bf16_and_its_peak_is_predicted(small, tmp_path):
    """bf16 autocast on the GPU: every plan's losses follow the run without offload to bf16
    tolerance (the same roundings, other kernels' order of sums); with the planner, its predicted
    peak bounds the measured one, and a budget given caps the allocator. Clipping reads host and
    device gradients (a blocking copy home)."""
    from student.optim.clip import clip_grad_norm_foreach

    params = [torch.nn.Parameter(torch.ones(3, device=d)) for d in ("cuda", "cpu")]
    for p, value in zip(params, (3.0, 4.0)):
        p.grad = torch.full((3,), value, device=p.device)
    norm = clip_grad_norm_foreach(params, 1.0)
    assert norm.item() == pytest.approx(5.0 * 3**0.5) and params[1].grad[0].item() == pytest.approx(4 / norm.item())

    gpu = dict(device="cuda", save_every=0, eval_every=0)
    train(config(small, tmp_path / "plain", **gpu), progress=False)
    want = [r["loss"] for r in rows(tmp_path / "plain")]
    for name, spec in PLANS.items():
        out = tmp_path / name
        train(config(small, out, offload=plan_file(tmp_path / f"{name}.json", *spec), **gpu), progress=False)
        assert [r["loss"] for r in rows(out)] == pytest.approx(want, rel=2e-2), name
    try:
        import student.planner.solve  # noqa: F401
    except ImportError:
        return
    for grad_accum in (2, 1):  # one backward a step: the input embedding's gradient comes after the layers'
        out = tmp_path / f"auto{grad_accum}"
        train(config(small, out, offload="auto", grad_accum=grad_accum, **gpu), progress=False)
        for r in rows(out):
            assert r["offload_predicted_gpu_peak_bytes"] >= r["peak_gpu_bytes"], (grad_accum, r)
    # A budget the user gives caps the caching allocator for the run: blocks cached before it (these
    # 1.5 GiB) are handed back, the steps' reserved bytes stay within it, and the cap ends with the run.
    fraction = torch.cuda.get_per_process_memory_fraction(0)
    torch.empty(3 * 2**29, dtype=torch.uint8, device="cuda")  # freed at once, and cached
    assert torch.cuda.memory_reserved() >= 3 * 2**29
    out = tmp_path / "capped"
    train(config(small, out, offload="auto", gpu_memory="1GiB", **gpu), progress=False)
    assert all(r["peak_gpu_reserved_bytes"] <= 2**30 for r in rows(out)), rows(out)
    assert torch.cuda.get_per_process_memory_fraction(0) == fraction


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("optimizer", ["adamw", "foam"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_gpu_host_layers_of_real_size_train_as_without_offload(tmp_path, optimizer, grad_accum):
    """Eight host layers of about 12M parameters (each copy tens of MB, so a wait missing between
    streams shows; the 4-layer student's copies finish before any race can), the update on the GPU
    through the ring, most layers loaded during the step (not preloaded in the backward): six
    steps' losses are finite and follow training without offload to bf16 tolerance. At one
    micro-batch the host gradients are bf16 (landing in the slots' cast buffers); at two, fp32 sums."""
    student = make_student(tmp_path / "student", num_layers=8, hidden_size=1024, intermediate_size=2816,
                           num_heads=16, num_kv_heads=8, head_dim=64)
    corpus = make_corpus(num_seqs=24, seq_len=24, k=8, vocab=VOCAB, seed=1)
    write_cache(tmp_path / "cache", corpus, tokenizer__hash=tokenizer_hash(student), shard_size=4, fmt="parquet")
    big = (student, tmp_path / "cache")
    gpu = dict(device="cuda", save_every=0, eval_every=0, optimizer=optimizer, lr=1e-3, grad_accum=grad_accum)
    train(config(big, tmp_path / "plain", **gpu), progress=False)
    want = [r["loss"] for r in rows(tmp_path / "plain")]
    for name, spec in {"streamed": ("rs rs rs rs rs rs rs rs", 1, "gpu"),
                       "mixed": ("os rr ks rs or rs ks rr", 2, "gpu")}.items():
        out = tmp_path / name
        train(config(big, out, offload=plan_file(tmp_path / f"{name}.json", *spec), **gpu), progress=False)
        got = [r["loss"] for r in rows(out)]
        assert all(map(math.isfinite, got)), (name, got)
        assert got == pytest.approx(want, rel=2e-2), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_update_slots_wait_for_the_compute_streams_last_use_of_their_memory(small):
    """The update ring's slots are allocated from the compute stream's pool while the device still
    runs queued work on that memory (the host frees a tensor once it has queued its last use): the
    upload stream must not write a new slot before that work is done. Here the compute stream is
    half a second into a sleep, then a NaN fill of a freed block the slot may get: the slot's
    copies in are still waiting 50 ms later, and once done the slot holds the layer's master."""
    import time

    from student.offload.runtime import OffloadRuntime
    from student.optim.build import build_optimizer

    student, _ = small
    model = Student.from_pretrained(student)
    plan = OffloadPlan(layers=tuple(LayerPlan("recompute", "resident", "host") for _ in range(NUM_LAYERS)),
                       prefetch_depth=1, optimizer="gpu")
    runtime = OffloadRuntime(model, plan, "cuda", torch.bfloat16)
    build_optimizer(model, config(small, "unused", device="cuda").optim, "cuda")
    ring, index = runtime._update_ring, NUM_LAYERS - 1
    numel = max(h.numel for h in runtime.host)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of device time queued on the compute stream
    block = torch.empty(numel, dtype=torch.float32, device="cuda")
    block.fill_(float("nan"))  # runs after the sleep, long after the host has freed the block
    del block
    slot = ring._slot(index)
    ring._load(index, slot, gradient=False)
    time.sleep(0.05)
    assert not ring.upload.query(), "the slot's copies in ran before the compute stream's queued work"
    torch.cuda.synchronize()
    assert torch.equal(slot.master[:runtime.host[index].numel].cpu(), runtime.host[index].master)
    runtime.close()


def test_resuming_an_offloaded_run_loads_the_layers_in_place_on_the_host(small, tmp_path):
    """load_checkpoint copies the weights into the parameters where the runtime keeps them (the
    views of its host buffers stay), never through the device the embeddings live on: here a
    device that holds no data (meta), so a detour there would lose the layers' weights."""
    from student.checkpoint import load_checkpoint, save_checkpoint
    from student.offload.runtime import OffloadRuntime

    student, _ = small
    saved = Student.from_pretrained(student)
    with torch.no_grad():
        for i, p in enumerate(saved.parameters()):
            p.add_(0.01 * (i + 1))
    ckpt = save_checkpoint(tmp_path / "run", 1, saved, {}, {"position": 0})

    model = Student.from_pretrained(student)
    plan = OffloadPlan(layers=(LayerPlan("keep"), LayerPlan("offload", "stream"), LayerPlan("recompute", "resident", "gpu"),
                               LayerPlan("keep")), optimizer="cpu")
    runtime = OffloadRuntime(model, plan, "cpu")
    homes = [p.data_ptr() for p in model.layers.parameters()]
    for name in ("embed_tokens", "norm", "lm_head"):
        if getattr(model, name) is not None:
            getattr(model, name).to("meta")
    _, data_state = load_checkpoint(ckpt, model)
    assert data_state == {"position": 0}
    assert [p.data_ptr() for p in model.layers.parameters()] == homes
    assert all(torch.equal(a, b) for a, b in zip(model.layers.parameters(), saved.layers.parameters()))
    assert all(torch.equal(p, runtime.host[0].master[span].view(shape))
               for p, (span, shape) in zip(runtime.host[0].params, runtime.host[0].spans))
    runtime.close()


@pytest.mark.parametrize("optimizer, plan, grad_accum", [
    ("adamw", "mixed-cpu", 1), ("foam", "mixed-gpu", 1), ("adamw8bit", "states-gpu", 1),
    ("adamw", "states-cpu", 1), ("foam", "states-gpu", 1), ("foam", "states-cpu", 2)])
def test_bf16_offloaded_training_at_one_micro_batch_keeps_bf16_gradients_and_equals_training_without_offload(
        small, tmp_path, optimizer, plan, grad_accum):
    """bf16 autocast on the CPU, every step clipped: at grad_accum 1 the matrices' gradients stay
    bf16, the host layers' on the host (and, the update on the GPU, into the ring), the "gpu"
    layers' on the device, each widened for its layer's update alone (those into one device buffer
    made for the update), the vectors' fp32; the run's losses, gradient norms, evaluations and weights are
    those of training without offload, bit for bit (the widening is exact). At grad_accum 2 every
    gradient is an fp32 sum, with the same results."""
    from student.offload.runtime import OffloadRuntime
    from student.step import steps_accumulate

    bf16 = dict(optimizer=optimizer, dtype="bfloat16", grad_accum=grad_accum, clip_grad=1e-2, save_every=0,
                eval_every=3)
    want, out = tmp_path / "plain", tmp_path / "run"
    train(config(small, want, **bf16), progress=False)
    cfg = config(small, out, offload=plan_file(tmp_path / "plan.json", *PLANS[plan]), **bf16)
    train(cfg, progress=False)
    assert all(r["grad_norm"] > 1e-2 for r in rows(want))  # the clipping bites
    assert results(out) == results(want)
    assert same_weights(out / "student", want / "student")

    for accumulated, narrow in ((1, torch.bfloat16), (2, torch.float32)):
        model = Student.from_pretrained(small[0])
        runtime = OffloadRuntime(model, OffloadPlan.load(tmp_path / "plan.json"), "cpu", torch.bfloat16,
                                 accumulates=steps_accumulate(cfg.with_flat(grad_accum=accumulated)))
        assert all([g.dtype for g in h.grads] == [narrow, torch.float32] for h in runtime.host)
        runtime.close()


@pytest.mark.parametrize("side", ["cpu", "gpu"])
def test_one_backward_leaves_the_matrices_without_grad_and_clips_and_steps_as_without_offload(small, side):
    """The runtime built for steps of one backward (accumulates=False), bf16 autocast, layers 0 and 3
    with their states on the device: after finish_grads and after the step, every layer's matrices
    have no .grad (their bf16 gradients are in the layer's buffers, host or device), its vectors'
    .grad are fp32 and those of the model without offload before clipping (the clip coefficient is
    applied as the update widens them); clip_grad_norm gives clip_grad_norm_foreach's norm of that
    model and the step its AdamW weights, exactly."""
    from student.offload.runtime import OffloadRuntime
    from student.optim.clip import clip_grad_norm_foreach

    student, _ = small
    plain, offloaded = Student.from_pretrained(student), Student.from_pretrained(student)
    plan = OffloadPlan.load(plan_file(Path(student) / f"narrow-{side}.json", "kg os rr kg", 1, side))
    runtime = OffloadRuntime(offloaded, plan, "cpu", torch.bfloat16, accumulates=False)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    for model in (plain, offloaded):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids).float().pow(2).mean()
        loss.backward()
    runtime.finish_grads()
    want = dict(plain.named_parameters())
    unclipped = {name: p.grad.clone() for name, p in want.items() if p.grad is not None}
    layers = [(name, p) for name, p in offloaded.named_parameters() if name.startswith("layers.")]

    def grads_as_documented():
        for name, p in layers:
            if p.ndim >= 2:
                assert p.grad is None, name
            else:
                assert p.grad.dtype == torch.float32 and torch.equal(p.grad, unclipped[name]), name

    grads_as_documented()
    norm = clip_grad_norm_foreach(plain.parameters(), 1e-3)
    assert torch.equal(runtime.clip_grad_norm(1e-3), norm) and norm > 1e-2
    torch.optim.AdamW(plain.parameters(), lr=1e-2).step()
    runtime.step(torch.optim.AdamW(offloaded.parameters(), lr=1e-2))
    assert all(torch.equal(p, want[name]) for name, p in offloaded.named_parameters())
    if side == "cpu":  # (the update on the GPU leaves the host layers' vectors without .grad)
        grads_as_documented()
    assert all(p.grad is None for _, p in layers if p.ndim >= 2)
    runtime.close()


def test_the_jsd_objective_trains_offloaded_as_without_offload(small, tmp_path):
    """--objective jsd through the offload runtime: every loss, KL (here the JSD), evaluation and final
    weight equals the run's without offload (the objective lives in the loss, which both share)."""
    jsd = dict(objective="jsd", beta=0.3)
    train(config(small, tmp_path / "plain", **jsd), progress=False)
    train(config(small, tmp_path / "offloaded", **jsd,
                 offload=plan_file(tmp_path / "plan.json", *PLANS["mixed-cpu"])), progress=False)
    assert results(tmp_path / "offloaded") == results(tmp_path / "plain")
    assert same_weights(tmp_path / "offloaded" / "student", tmp_path / "plain" / "student")
    train(config(small, tmp_path / "forward"), progress=False)
    assert [r["kl"] for r in rows(tmp_path / "plain")] != [r["kl"] for r in rows(tmp_path / "forward")]  # the JSD ran
