"""Stage two under torchrun (student/distributed.py): two CPU processes on gloo train as one
process does at the same global batch, checkpoints resume at another world size (2 -> 1 -> 2 -> 2),
FOAM's and the 8-bit AdamW's states shard with their parameters (student/optim/shards.py), and
the settings a sharded run cannot take are refused in one line before any process group.

The runs are spawned as a user runs them: `python -m torch.distributed.run --standalone
--nproc-per-node 2 -m distill train-student ...` (a free port each time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.configs import ConfigError
from student.checkpoint import RunDirError
from student.model import Student
from student.optim.adam8bit import AdamW8bit
from student.trainer import TrainConfig, train
from test_cache_synth import make_corpus, write_cache
from test_trainer import VOCAB, make_student, make_tokenizer, rows, tokenizer_hash

REPO = Path(__file__).resolve().parents[1]
# Two processes sum their rows' shares of the loss and of every gradient where one process sums all
# rows at once: the same in exact arithmetic, another order of fp32 sums (student/distributed.py).
# What does not depend on that order is compared exactly: the steps, the tokens of each step and of
# each evaluation, the epochs and the learning rates. The sums themselves (loss, KL, gradient norm,
# held-out KL) differ by a few fp32 roundings, relative ~1e-7 (seen up to 1e-6 on an AVX-512 Xeon);
# the weights they train feed back into later steps, and this bound held the losses over 12 steps.
RTOL = 1e-4
# The final weights, per tensor: the L2 norm of the difference within WEIGHT_RTOL of the training's
# own update (final - initial). Not element by element: Adam divides each gradient element by its
# own running magnitude, so an element whose gradient cancels to near the rounding of its sums takes
# a rounding-dependent step (seen: one element 2e-4 relative apart on an AVX-512 Xeon while every
# loss agreed to 1e-6). The update as a whole follows the gradients, as the losses do: ~1e-6 of it
# seen here; a few such elements stay far below 1e-2 of it, while a shard lost or misplaced by the
# gather moves it by ~100%.
WEIGHT_RTOL = 1e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(student folder, cache dir): 24 ragged sequences of <= 24 tokens in 6 shards of 4."""
    root = tmp_path_factory.mktemp("tiny_dist")
    student = make_student(root / "student")
    corpus = make_corpus(num_seqs=24, seq_len=24, k=8, vocab=VOCAB, seed=1)
    write_cache(root / "cache", corpus, tokenizer__hash=tokenizer_hash(student), shard_size=4, fmt="parquet")
    return student, root / "cache"


def settings(tiny, out, **overrides) -> dict:
    student, cache = tiny
    return {**dict(cache=str(cache), out=str(out), student=str(student), steps=12, batch_size=4, grad_accum=2,
                   lr=1e-2, warmup_steps=2, heldout=4, eval_every=3, save_every=3, log_every=1, seed=0,
                   deterministic=True, device="cpu"), **overrides}


def _options(values: dict) -> list[str]:
    """`distill train-student` options for the TrainConfig flat `values`."""
    args = []
    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(option if value else f"--no-{name.replace('_', '-')}")
        elif value is not None:
            args += [option, str(value)]
    return args


def _run(values: dict, nproc: int, exit_after: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    # With exit_after, every process SIGKILLs itself right after that step (tests/kill_after_step.py).
    kill = [] if exit_after is None else [str(REPO / "tests" / "kill_after_step.py"), str(exit_after)]
    # Its own session, so that a hang (collectives that do not pair up) ends every process it started.
    proc = subprocess.Popen([*launch, *kill, "-m", "distill", "train-student", *_options(values), "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run did not end in 300 s: {err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _same_weights(got: dict, want: dict, initial: dict) -> None:
    """Final weights trained two ways from `initial`: the same names, shapes and dtypes, and each
    tensor within WEIGHT_RTOL of its update (see WEIGHT_RTOL for why not element by element)."""
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    for name, w in want.items():
        update = (w - initial[name]).norm()
        assert update > 0, name  # trained: the bound below is relative to a real update
        assert (got[name] - w).norm() <= WEIGHT_RTOL * update, (name, float((got[name] - w).norm() / update))


def _close(got: list[dict], want: list[dict]) -> None:
    """Metric rows of the same steps: the data (step, tokens, epoch) and the schedule equal, the
    figures within RTOL."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert (g["tokens"], g["epoch"], g["lr"]) == (w["tokens"], w["epoch"], w["lr"]), g["step"]
        for key in ("loss", "kl", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=RTOL), (g["step"], key)


@pytest.mark.slow
def test_two_processes_train_as_one_and_resume_at_another_world_size(tiny, tmp_path):
    """One run of 8 steps (2 micro-batches of 4 sequences, 2 epochs of the 20 training sequences)
    passed between world sizes through its checkpoints: 2 processes to step 2 (killed after the
    checkpoint), 1 process to step 4 (reads the sharded checkpoint), 2 processes to step 6 (read the
    one-process checkpoint), 2 processes to the end (read their own). Every step's loss, KL and
    gradient norm match the uninterrupted one-process run, and its data and learning rate exactly;
    rank 0 alone wrote the run directory (one row a step)."""
    values = settings(tiny, tmp_path / "passed", steps=8, save_every=2, eval_every=4)
    reference = train(TrainConfig.from_flat(**settings(tiny, tmp_path / "one", steps=8, save_every=2, eval_every=4)),
                      progress=False)
    for nproc, exit_after, sharded in ((2, 2, True), (1, 4, False), (2, 6, True), (2, None, True)):
        done = _run(values, nproc, exit_after)
        assert done.returncode == (0 if exit_after is None else (1 if nproc > 1 else -signal.SIGKILL)), done.stderr[-3000:]
        if exit_after is not None:
            ckpt = tmp_path / "passed" / "checkpoints" / f"step-{exit_after:06d}"
            assert (ckpt / "dcp").is_dir() == sharded and (ckpt / "model").is_dir() != sharded
    _close(rows(tmp_path / "passed"), rows(tmp_path / "one"))
    assert [r["step"] for r in rows(tmp_path / "passed", "eval")] == [0, 4, 8]
    for got, want in zip(rows(tmp_path / "passed", "eval"), rows(tmp_path / "one", "eval")):
        assert got["kl"] == pytest.approx(want["kl"], rel=RTOL) and got["tokens"] == want["tokens"]
    _same_weights(Student.from_pretrained(tmp_path / "passed" / "student").state_dict(),
                  Student.from_pretrained(Path(reference.student_dir)).state_dict(),
                  Student.from_pretrained(Path(tiny[0])).state_dict())
    assert json.loads((tmp_path / "passed" / "run.json").read_text())["config"]["batch_size"] == 4


def _steps_resumed_at_other_world_sizes(values: dict, legs) -> None:
    """Run `values` leg by leg, each leg (processes, step to stop after: None to run to the end)
    resuming the previous one's checkpoint."""
    for nproc, exit_after in legs:
        done = _run(values, nproc, exit_after)
        assert done.returncode == (0 if exit_after is None else (1 if nproc > 1 else -signal.SIGKILL)), done.stderr[-3000:]


@pytest.mark.slow
def test_foam_under_two_processes_matches_one_and_resumes_at_another_world_size(tiny, tmp_path):
    """FOAM folds each matrix's moments along its last dimension, within rows, and FSDP2 shards by
    rows: a rank's moments are the rows of the one-process moments, kept as DTensors of the
    one-process shape, so the run matches one process's (up to the order of the gradient sums:
    RTOL) and its checkpoints pass between world sizes (2 -> 1 -> 2). The embedding is folded
    too, and the optimizer holds as many state bytes as in one process."""
    kw = dict(optimizer="foam", foam_fold_embeddings=True, steps=5, save_every=2, eval_every=0)
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "one", **kw)), progress=False)
    _steps_resumed_at_other_world_sizes(settings(tiny, tmp_path / "passed", **kw), ((2, 2), (1, 4), (2, None)))
    _close(rows(tmp_path / "passed"), rows(tmp_path / "one"))
    assert [r["optimizer_state_bytes"] for r in rows(tmp_path / "passed")] == \
        [r["optimizer_state_bytes"] for r in rows(tmp_path / "one")]


@pytest.mark.slow
def test_adamw8bit_under_two_processes_matches_one_and_resumes_only_at_its_world_size(tiny, tmp_path):
    """The 8-bit AdamW blocks each rank's shard from the shard's first element. With a vocabulary of
    320 the shards of the embedding and lm-head (160 rows of 32; the only matrices with 8-bit states)
    start on block edges (256 elements), so the blocks
    are the one-process blocks and the run matches one process's (RTOL); its 8-bit states resume at
    the world size that wrote them, and another is refused in one line."""
    student = make_student(tmp_path / "student", vocab_size=320)
    kw = dict(student=str(student), optimizer="adamw8bit", steps=3, save_every=2, eval_every=0)
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "one", **kw)), progress=False)
    values = settings(tiny, tmp_path / "passed", **kw)
    _steps_resumed_at_other_world_sizes(values, ((2, 2),))
    with pytest.raises(RunDirError) as error:
        train(TrainConfig.from_flat(**values), progress=False)
    message = error.value.args[0]
    assert "written by 2 process(es), this run has 1" in message and "--optimizer adamw8bit" in message, message
    assert "\n" not in message
    _steps_resumed_at_other_world_sizes(values, ((2, None),))
    _close(rows(tmp_path / "passed"), rows(tmp_path / "one"))
    assert [r["optimizer_state_bytes"] for r in rows(tmp_path / "passed")] == \
        [r["optimizer_state_bytes"] for r in rows(tmp_path / "one")]


# Where a shard does not start on a block edge, its blocks are offset from the one-process blocks
# (student/optim/adam8bit.py): the same code and rounding over other groups of elements. The first
# step is exact anyway (a step updates with its fp32 moments, then stores them); from then on each
# run reads moments rounded through its own blocks' absmax. An element's Adam update is about lr at
# most, so they cannot drift apart by more than about 2 lr a step; the code's rounding keeps them far
# closer: at most 0.19 lr a step over seeds 0-3 of the test below at writing, bound ~2x.
OFFSET_BLOCK_DRIFT_LR = 0.4


def test_adamw8bit_on_shards_off_block_edges_matches_whole_within_a_bound():
    """What a rank computes is the optimizer stepping its shard as a parameter of its own: here one
    process steps a [12, 40] matrix whole and, beside it, as two shards of 6 rows (240 elements,
    not a multiple of the 64-element blocks). The first shard's whole blocks share the one-process
    blocks and end bitwise equal; the rest stays within OFFSET_BLOCK_DRIFT_LR x lr a step."""
    torch.manual_seed(0)
    lr, steps, block = 1e-2, 6, 64
    whole = torch.nn.Parameter(torch.randn(12, 40))
    halves = [torch.nn.Parameter(whole.detach()[:6].clone()), torch.nn.Parameter(whole.detach()[6:].clone())]
    kw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1, block_size=block, min_8bit_size=0, fused=False)
    one, two = AdamW8bit([whole], **kw), AdamW8bit(halves, **kw)
    drift = []
    for _ in range(steps):
        grad = torch.randn(12, 40) * torch.logspace(-3, 0, 40)  # columns of many magnitudes
        whole.grad, halves[0].grad, halves[1].grad = grad.clone(), grad[:6].clone(), grad[6:].clone()
        one.step(), two.step()
        drift.append((whole.detach() - torch.cat([h.detach() for h in halves])).flatten())
    shared = 6 * 40 // block * block  # elements in the first shard's whole blocks
    assert torch.equal(drift[0], torch.zeros_like(drift[0]))  # the first step is exact
    assert (drift[-1][:shared] == 0).all()
    assert (drift[-1][shared:] != 0).any()  # the offset blocks change the arithmetic: else this proves nothing
    for t, d in enumerate(drift, 1):
        assert d.abs().max() <= OFFSET_BLOCK_DRIFT_LR * lr * t, (t, d.abs().max())


@pytest.mark.slow
def test_sparse_ffn_under_two_processes_matches_one(tiny, tmp_path):
    """--sparse-ffn with dead-neuron reinit judged every step: each rank measures its part of the
    micro-batches and the window sums the ranks' (student/sparse_ffn.py), so both write the one
    process's statistics and move the same gate rows, of both ranks' shards (rows 0-3 of 24 on
    rank 0, 30-33 on rank 1, zeroed so that they start dead); losses match one process's."""
    student = tmp_path / "student"
    model = Student.from_pretrained(make_student(student))
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate_proj.weight[[0, 1, 2, 3, 30, 31, 32, 33]] = 0.0
    model.save_pretrained(student)  # the folder anew: its tokenizer again
    make_tokenizer(student)
    kw = dict(student=str(student), sparse_ffn=True, l1=1e-2, dead_reinit=0.5, dead_window=1, steps=3, eval_every=0)
    done = _run(settings(tiny, tmp_path / "two", **kw), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "one", **kw)), progress=False)
    got, want = rows(tmp_path / "two"), rows(tmp_path / "one")
    _close(got, want)
    assert got[0]["ffn_reinit"][0] >= 8  # the zeroed rows of both shards moved after the first step
    for g, w in zip(got, want):
        assert (g["ffn_reinit"], g["ffn_dead"]) == (w["ffn_reinit"], w["ffn_dead"]), g["step"]
        assert g["l1"] == pytest.approx(w["l1"], rel=RTOL) and g["ffn_nnz"] == pytest.approx(w["ffn_nnz"], rel=RTOL)


@pytest.mark.parametrize("change, option", [(dict(batch_size=3), "--batch-size"), (dict(offload="auto"), "--offload"),
                                            (dict(device="cuda:1"), "--device")])
def test_settings_a_sharded_run_cannot_take_are_refused_in_one_line(tiny, tmp_path, monkeypatch, change, option):
    """As torchrun would start rank 0 of 2, but no process group is ever joined: the check comes first."""
    monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("student.trainer.setup", lambda *a: pytest.fail("joined a process group"))
    if change.get("device", "").startswith("cuda"):
        monkeypatch.setattr("student.step.resolve_device", lambda device: device)
    with pytest.raises(ConfigError) as error:
        train(TrainConfig.from_flat(**settings(tiny, tmp_path / "run", **change)), progress=False)
    message = error.value.as_option().args[0]
    assert message.startswith(option) and "\n" not in message, message
    assert not (tmp_path / "run").exists()


def test_the_batch_size_error_reaches_the_command_line_under_torchrun(tiny, tmp_path):
    """The real launch: both ranks stop with the one line, nothing is written."""
    done = _run(settings(tiny, tmp_path / "run", batch_size=3), nproc=2)
    assert done.returncode != 0
    assert "--batch-size is 3, which does not divide among the 2 processes" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_chunk_recurrent_training_under_two_processes_matches_one(tiny, tmp_path):
    """--chunk-tokens under FSDP2: the ranks' parts of a micro-batch of ragged sequences are padded
    to the longest part, so every rank runs the same chunks (else their collectives do not pair up
    and the run hangs); the losses match one process's, chunked and whole. (--kv-offload keeps the
    pages where they are on a CPU, so a CPU launch with it would repeat this one: the offloaded pages
    under two processes are test_kv_offload_under_two_gpus_matches_one_gpu's.)"""
    kw = dict(steps=3, chunk_tokens=8, page_tokens=16, eval_every=0)
    done = _run(settings(tiny, tmp_path / "two", **kw), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "one", **kw)), progress=False)
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "whole", **{**kw, "chunk_tokens": None})), progress=False)
    _close(rows(tmp_path / "two"), rows(tmp_path / "one"))
    _close(rows(tmp_path / "two"), rows(tmp_path / "whole"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kv_offload_under_two_gpus_matches_one_gpu(tiny, tmp_path):
    """--kv-offload under FSDP2 on two GPUs (nccl): each rank's pages live in pinned host memory and
    come to its GPU a page at a time on a side stream beside FSDP2's own streams; the losses match
    one GPU's, offloaded and resident (fp32, deterministic: only the order of the sums differs)."""
    kw = dict(steps=3, chunk_tokens=8, page_tokens=16, eval_every=0, device="cuda", dtype="float32")
    offload = dict(kv_offload=True, offload_pages=1)
    done = _run(settings(tiny, tmp_path / "two", **kw, **offload), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "one", **kw, **offload)), progress=False)
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "resident", **kw)), progress=False)
    _close(rows(tmp_path / "two"), rows(tmp_path / "one"))
    _close(rows(tmp_path / "two"), rows(tmp_path / "resident"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("optimizer", ["foam", "adamw8bit"])
def test_fused_optimizer_steps_under_two_gpus_match_one_gpu(tiny, tmp_path, optimizer):
    """On GPUs FOAM and the 8-bit AdamW run their Triton steps on each rank's local shard (nccl), the
    grads' addresses taken anew as FSDP2 hands over new ones; the losses match one GPU's (fp32,
    deterministic). The vocabulary of 320 puts the 8-bit shards on block edges."""
    student = make_student(tmp_path / "student", vocab_size=320)
    kw = dict(student=str(student), optimizer=optimizer, steps=3, eval_every=0, device="cuda", dtype="float32")
    done = _run(settings(tiny, tmp_path / "two", **kw), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    train(TrainConfig.from_flat(**settings(tiny, tmp_path / "one", **kw)), progress=False)
    _close(rows(tmp_path / "two"), rows(tmp_path / "one"))
