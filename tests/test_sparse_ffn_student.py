"""The sparse FFN student (TwELL, issue 5), student side: the ReLU-gated MLP and its L1 term, the
SwiGLU -> ReLU conversion, the trainer's penalty and per-layer sparsity metrics, and `distill eval`
reporting them. Tiny students on the synthetic cache of test_trainer. Elsewhere: the exact resume
of a sparse run (test_trainer) and the transformers parity of a ReLU student (test_student_model,
families "llama_relu", "qwen3_relu")."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch

from student.config import StudentConfig
from student.data import CacheBatches
from student.evaluate import evaluate_run_or_folder, evaluate_student
from student.model import Student, to_relu_gate
from student.sparse_ffn import SparseFFNPolicy
from student.step import micro_batch_loss, resolve
from student.trainer import TrainConfig, train
from distill.errors import DistillUserError
from teacher_cache.reader import CacheReader
from test_trainer import config, rows, tiny  # noqa: F401  (the module-scoped fixture)

SMALL = StudentConfig(model_type="llama", vocab_size=301, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)


def mlp_inputs(model: Student, ids: torch.Tensor) -> list[torch.Tensor]:
    """The input [N, d] of every layer's MLP in a forward over ids, caught with forward hooks."""
    seen = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1])))
             for layer in model.layers]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def gated_h(mlp, x_ND: torch.Tensor) -> torch.Tensor:
    """The reference h = relu(x Wg) * (x Wu), [N, d_ff]."""
    return torch.relu(x_ND @ mlp.gate_proj.weight.T) * (x_ND @ mlp.up_proj.weight.T)


# --- the model ----------------------------------------------------------------------------------


def test_conversion_keeps_the_weights_and_swaps_the_gate():
    torch.manual_seed(0)
    dense = Student(SMALL)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    ids = torch.randint(0, 301, (2, 7), generator=torch.Generator().manual_seed(1))
    x_ND = mlp_inputs(dense, ids)[0]
    mlp = dense.layers[0].mlp
    swiglu, no_terms = mlp(x_ND)
    assert no_terms is None
    sparse = to_relu_gate(dense)
    assert sparse is dense and sparse.config.hidden_act == "relu" and sparse.config.sparse_ffn
    assert all(torch.equal(before[k], v) for k, v in sparse.state_dict().items())
    relu, _ = mlp(x_ND)
    torch.testing.assert_close(relu, gated_h(mlp, x_ND) @ mlp.down_proj.weight.T, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(relu, swiglu)
    assert StudentConfig.from_hf_dict(sparse.config.to_hf_dict()) == sparse.config
    with pytest.raises(DistillUserError, match="`mlp_bias` must be False with hidden_act 'relu'"):
        to_relu_gate(Student(SMALL.replace(mlp_bias=True)))


def test_each_layer_reports_its_l1_and_stats_with_gradients():
    torch.manual_seed(0)
    model = Student(SMALL.replace(hidden_act="relu"))
    ids = torch.randint(0, 301, (3, 5), generator=torch.Generator().manual_seed(2))
    xs = mlp_inputs(model, ids)
    hidden, terms = model(ids, return_ffn_terms=True)
    assert len(terms) == 2 and torch.equal(hidden, model(ids))
    for layer, x_ND, (l1, stats) in zip(model.layers, xs, terms):
        h = gated_h(layer.mlp, x_ND)
        torch.testing.assert_close(l1, h.abs().sum(-1).mean(), atol=1e-6, rtol=1e-5)
        assert l1.dtype == torch.float32 and l1.requires_grad
        assert stats.nnz.item() == pytest.approx((h != 0).sum(-1).float().mean().item())
        assert torch.equal(stats.active, (h != 0).any(0))
    torch.stack([l1 for l1, _ in terms]).mean().backward()
    assert model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad is not None  # the penalty reaches the layers below
    assert Student(SMALL)(ids, return_ffn_terms=True)[1] == []
    assert not hasattr(model.layers[0].mlp, "l1") and not hasattr(model.layers[0].mlp, "stats")  # nothing kept


def test_padding_rows_are_left_out_of_l1_and_stats(tiny):  # noqa: F811
    """A ragged batch with token_mask: each layer's l1, nnz and active neurons are those of the real
    tokens alone (each sequence run by itself, unpadded), and the real tokens' hidden states do not
    change. Without the mask the padding rows count."""
    student, cache, _ = tiny
    torch.manual_seed(0)
    model = to_relu_gate(Student.from_pretrained(student))
    batch = next(iter(CacheBatches(CacheReader(cache), range(24), 6, shuffle=False)))
    ids, mask = batch.input_ids, batch.mask.view(batch.input_ids.shape)
    assert not mask.all(), "the batch must have padding"
    with torch.no_grad():
        hidden, terms = model(ids, token_mask=batch.mask, return_ffn_terms=True)
        plain, unmasked = model(ids, return_ffn_terms=True)
        per_seq = []
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            per_seq.append(([x for x in mlp_inputs(model, ids[b:b + 1, :n])], n))
    torch.testing.assert_close(hidden[mask], plain[mask])
    for i, (layer, (l1, stats)) in enumerate(zip(model.layers, terms)):
        h = torch.cat([gated_h(layer.mlp, xs[i]) for xs, _ in per_seq])
        assert h.shape[0] == int(mask.sum())
        torch.testing.assert_close(l1, h.abs().sum(-1).mean(), atol=1e-6, rtol=1e-5)
        assert stats.nnz.item() == pytest.approx((h != 0).sum(-1).float().mean().item(), rel=1e-6)
        assert torch.equal(stats.active, (h != 0).any(0))
        assert unmasked[i][1].nnz.item() != pytest.approx(stats.nnz.item(), rel=1e-6)


# --- training -----------------------------------------------------------------------------------


def test_step_loss_adds_l1_times_the_mean_layer_l1(tiny, tmp_path):  # noqa: F811
    student, cache, _ = tiny
    model = to_relu_gate(Student.from_pretrained(student))
    batch = next(iter(CacheBatches(CacheReader(cache), range(24), 4)))
    hidden, terms = model(batch.input_ids, token_mask=batch.mask, return_ffn_terms=True)
    dense_loss, kl = micro_batch_loss(hidden, terms, batch, model, resolve(config(tiny, tmp_path / "a")), cache_temperature=1.0)
    penalty = torch.stack([l1 for l1, _ in terms]).mean()
    cfg = resolve(config(tiny, tmp_path / "b", sparse_ffn=True, l1=0.5))
    policy = SparseFFNPolicy(cfg.sparse, model, "cpu", seed=0)
    loss, kl2 = micro_batch_loss(hidden, terms, batch, model, cfg, cache_temperature=1.0, policy=policy)
    torch.testing.assert_close(loss, dense_loss + 0.5 * penalty)
    torch.testing.assert_close(kl2, kl)
    assert policy.window.calls == 1  # the policy saw what the model measured


def test_sparse_run_converts_logs_sparsity_and_saves_a_relu_student(tiny, tmp_path, caplog):  # noqa: F811
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="student"):
        report = train(config(tiny, out, steps=4, sparse_ffn=True, l1=0.1, log_every=2), progress=False)
    assert "now has a ReLU gate, same weights; L1 coefficient 0.1" in caplog.text
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["sparse_ffn"] is True and run["student"]["init"].endswith(":relu-gate")
    assert run["student"]["config"]["hidden_act"] == "relu"
    train_rows = rows(out)
    assert [r["step"] for r in train_rows] == [2, 4]
    for r in train_rows:
        assert len(r["ffn_nnz"]) == len(r["ffn_sparsity"]) == len(r["ffn_dead"]) == 2
        assert all(0 < n <= 48 for n in r["ffn_nnz"]) and all(0 <= d < 1 for d in r["ffn_dead"])
        assert r["ffn_sparsity"] == pytest.approx([1 - n / 48 for n in r["ffn_nnz"]])
        assert r["ffn_overflow_rows"] == r["ffn_fallback_rows"] == [0, 0]  # the torch path never overflows
        assert r["loss"] - r["kl"] == pytest.approx(0.1 * r["l1"], rel=1e-3)  # KD loss at T=1 is the KL
    evals = rows(out, "eval")
    assert all(len(r["ffn_sparsity"]) == 2 for r in evals)
    assert report.final_eval.ffn_dead is not None and report.initial_eval.ffn_nnz is not None
    saved = json.loads((out / "student" / "config.json").read_text())
    assert saved["hidden_act"] == "relu"
    assert AutoModelForCausalLM.from_pretrained(out / "student").config.hidden_act == "relu"


def test_the_penalty_makes_the_ffn_sparser(tiny, tmp_path):  # noqa: F811
    """Same steps and data with and without the penalty: a strong L1 leaves fewer non-zeros."""
    nnz = {}
    for name, l1 in (("off", 0.0), ("strong", 0.5)):
        report = train(config(tiny, tmp_path / name, steps=4, sparse_ffn=True, l1=l1, eval_every=0),
                       progress=False)
        nnz[name] = sum(report.final_eval.ffn_nnz)
    assert nnz["strong"] < 0.8 * nnz["off"]


def test_l1_must_be_a_finite_number_at_least_zero():
    with pytest.raises(DistillUserError, match="`l1` must be a finite number >= 0, got -1"):
        TrainConfig.from_flat(cache="c", out="o", student="s", sparse_ffn=True, l1=-1)
    with pytest.raises(DistillUserError, match="`l1` must be a finite number >= 0, got inf"):
        TrainConfig.from_flat(cache="c", out="o", student="s", sparse_ffn=True, l1=float("inf"))


def test_sparse_kernel_twell_routes_layers_by_their_nonzeros(tiny, tmp_path):  # noqa: F811
    """"twell": every layer starts dense; at each logging step a layer under TWELL_MAX_NNZ non-zeros
    per token goes to the sparse kernels ("auto"), the others stay dense, and the choice is logged
    and kept in checkpoints. "dense" never routes; other values are refused."""
    from student.sparse_ffn import TWELL_MAX_NNZ

    window = SimpleNamespace(row=lambda: {"ffn_nnz": [TWELL_MAX_NNZ - 1, TWELL_MAX_NNZ]})
    cfg = TrainConfig.from_flat(cache="c", out="o", student="s", sparse_ffn=True, sparse_kernel="twell")
    for sparse, routed, impls in ((cfg.sparse, True, ["auto", "torch"]),
                                  (cfg.with_flat(sparse_kernel="dense").sparse, False, ["torch", "torch"])):
        model = Student(SMALL.replace(hidden_act="relu"))
        policy = SparseFFNPolicy(sparse, model, "cpu", seed=0)
        policy.window = window
        row = policy.metrics(model)
        assert (row["ffn_kernel"] == ["twell", "dense"]) if routed else "ffn_kernel" not in row
        assert [layer.mlp.impl for layer in model.layers] == impls
    with pytest.raises(DistillUserError, match="`sparse_kernel` must be one of 'dense', 'twell', got 'cuda'"):
        TrainConfig.from_flat(cache="c", out="o", student="s", sparse_kernel="cuda")
    out = tmp_path / "run"  # a real run (on the CPU the sparse kernels fall back to torch)
    train(config(tiny, out, sparse_ffn=True, sparse_kernel="twell", steps=2, log_every=1, save_every=1),
          progress=False)
    train_rows = [r for r in rows(out) if r["kind"] == "train"]
    assert [len(r["ffn_kernel"]) for r in train_rows] == [len(r["ffn_nnz"]) for r in train_rows] != []
    state = torch.load(out / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False)
    assert state["ffn_impl"] == ["auto" if k == "twell" else "torch" for k in train_rows[-1]["ffn_kernel"]]


def test_dead_gate_rows_move_toward_noise_and_live_ones_stay():
    """App. C.3: rows of neurons inactive in the step <- (1 - r) w + r N(0, 0.02^2), the noise drawn
    from a generator seeded by (seed, step); active rows are untouched; the counts come back."""
    from student.sparse_ffn import DEAD_REINIT_STD, reinit_dead_gates

    torch.manual_seed(0)
    model = Student(SMALL.replace(hidden_act="relu"))
    before = [layer.mlp.gate_proj.weight.detach().clone() for layer in model.layers]
    active = torch.ones(2, 48, dtype=torch.bool)
    active[0, [3, 17]] = False
    active[1, 40:] = False
    moved = reinit_dead_gates(model, active, 0.1, seed=5, step=7)
    assert moved.tolist() == [2, 8]
    gen = torch.Generator().manual_seed(5 * 1_000_003 + 7)
    for layer, w0, act in zip(model.layers, before, active):
        noise = torch.randn(w0.shape, generator=gen) * DEAD_REINIT_STD
        w = layer.mlp.gate_proj.weight
        assert torch.equal(w[act], w0[act])
        torch.testing.assert_close(w[~act], 0.9 * w0[~act] + 0.1 * noise[~act])
        assert not torch.equal(w[~act], w0[~act])


def _five_dead_rows(tiny, tmp_path, out, **overrides) -> TrainConfig:
    """A sparse, L1-free run config (a metrics row every step) whose start student has layer 1's
    first five gate rows zeroed: relu(0) = 0, so those neurons are dead on every token."""
    student, _, _ = tiny
    start = tmp_path / "start"
    if not start.exists():
        model = to_relu_gate(Student.from_pretrained(student))
        with torch.no_grad():
            model.layers[1].mlp.gate_proj.weight[:5] = 0
        model.save_pretrained(start)
    return config(tiny, out, student=str(start), tokenizer=str(student), log_every=1, sparse_ffn=True, l1=0.0,
                  eval_every=0, **overrides)


def test_dead_reinit_revives_dead_neurons_in_a_run_and_is_checked(tiny, tmp_path):  # noqa: F811
    """Five gate rows zeroed (dead on every token): with dead_reinit and a one-token window they are
    moved after every step they stay silent, ffn_reinit counts them, and without it nothing moves."""
    out = tmp_path / "run"
    train(_five_dead_rows(tiny, tmp_path, out, steps=2, dead_reinit=0.1, dead_window=1), progress=False)
    first = rows(out)[0]
    assert first["ffn_reinit"][1] >= 5 and len(first["ffn_reinit"]) == 2
    saved = Student.from_pretrained(out / "student").layers[1].mlp.gate_proj.weight
    assert (saved[:5].abs().sum(dim=1) > 0).all(), "the zeroed rows got noise"
    plain = tmp_path / "plain"
    train(_five_dead_rows(tiny, tmp_path, plain, steps=2), progress=False)
    assert rows(plain)[0]["ffn_reinit"] == [0, 0]
    assert (Student.from_pretrained(plain / "student").layers[1].mlp.gate_proj.weight[:5] == 0).all()
    with pytest.raises(DistillUserError, match="`dead_reinit` acts on the sparse FFN's gate"):
        TrainConfig.from_flat(cache="c", out="o", student="s", dead_reinit=0.1)
    with pytest.raises(DistillUserError, match=r"`dead_reinit` must be a number in \[0, 1\], got 2"):
        TrainConfig.from_flat(cache="c", out="o", student="s", sparse_ffn=True, dead_reinit=2)
    with pytest.raises(DistillUserError, match=r"`dead_window` must be an integer >= 1 \(tokens\), got 0"):
        TrainConfig.from_flat(cache="c", out="o", student="s", sparse_ffn=True, dead_reinit=0.1, dead_window=0)


def test_dead_window_spans_steps_and_moves_rows_only_when_it_closes(tiny, tmp_path):  # noqa: F811
    """With a 150-token dead window (a step here holds 3 ragged sequences, 30-72 tokens), gate rows
    move only after the steps at which the real tokens since the window began reach 150; the
    first such step moves the five zeroed rows."""
    out = tmp_path / "run"
    train(_five_dead_rows(tiny, tmp_path, out, steps=8, dead_reinit=0.1, dead_window=150, save_every=0),
          progress=False)
    closes, seen = [], 0
    for r in rows(out):
        seen += r["tokens"]
        if seen >= 150:
            closes.append(r["step"])
            seen = 0
    assert 2 <= len(closes) < 8, "the test needs windows of more than one step"
    assert all(r["ffn_reinit"] == [0, 0] for r in rows(out) if r["step"] not in closes)
    assert rows(out)[closes[0] - 1]["ffn_reinit"][1] >= 5


def test_dead_window_open_at_a_checkpoint_resumes_where_it_was():
    """The dead window's neurons and tokens travel in FFNWindow's state: a window restored mid-way
    closes at the same step with the same active neurons as the one that was never saved."""
    from kernels.twell_ffn import FFNStats
    from student.sparse_ffn import FFNWindow

    def stats(active):
        zero = torch.zeros((), dtype=torch.int64)
        return torch.zeros(()), FFNStats(nnz=active.sum().float(), active=active, overflow_rows=zero,
                                         fallback_rows=zero)

    first, second = torch.zeros(2, 6, dtype=torch.bool), torch.zeros(2, 6, dtype=torch.bool)
    first[0, 1], second[1, 4] = True, True
    kept = FFNWindow(2, 6, "cpu")
    kept.add([stats(a) for a in first])
    assert kept.end_step(1, tokens=60, dead_window=100) is None
    restored = FFNWindow(2, 6, "cpu")
    restored.load_state_dict(kept.state_dict())
    for window in (kept, restored):
        window.add([stats(a) for a in second])
        assert torch.equal(window.end_step(1, tokens=60, dead_window=100), first | second)
        assert window.end_step(1, tokens=60, dead_window=100) is None  # a new window began


def test_recipe_train_section_takes_the_sparse_keys(tmp_path):
    from pipelines.recipe import builtin_recipe, load_recipe, train_config

    text = Path(builtin_recipe("quickstart")).read_text()
    text = text.replace("[train]\n", "[train]\nsparse_ffn = true\nl1 = 3e-5\n")
    (tmp_path / "sparse.toml").write_text(text)
    cfg = train_config(load_recipe(tmp_path / "sparse.toml"), tmp_path / "teacher")
    assert cfg.sparse.sparse_ffn is True and cfg.sparse.l1 == 3e-5


# --- evaluation ---------------------------------------------------------------------------------


def test_eval_measures_sparsity_and_dead_neurons_on_the_heldout_sequences(tiny):  # noqa: F811
    student, cache, corpus = tiny
    model = to_relu_gate(Student.from_pretrained(student))
    with torch.no_grad():  # five dead neurons: a zero gate row gives relu(0) = 0 on every token
        model.layers[1].mlp.gate_proj.weight[:5] = 0
    indices = [0, 7, 13]
    got = evaluate_student(model, CacheReader(cache), indices, batch_size=3, device="cpu")
    batch = next(CacheBatches(CacheReader(cache), indices, 3, shuffle=False).epoch_batches())
    for layer, x_ND, nnz, sparsity, dead in zip(model.layers, mlp_inputs(model, batch.input_ids), got.ffn_nnz,
                                                got.ffn_sparsity, got.ffn_dead):
        h = gated_h(layer.mlp, x_ND)[batch.mask]  # the real tokens: padding rows are left out
        assert nnz == pytest.approx((h != 0).sum(-1).float().mean().item(), rel=1e-5)
        assert sparsity == pytest.approx(1 - nnz / 48)
        assert dead == pytest.approx(1 - (h != 0).any(0).float().mean().item())
    assert got.ffn_dead[1] >= 5 / 48


def test_distill_eval_reports_sparsity_and_overflow_of_a_sparse_run(tiny, tmp_path, capsys):  # noqa: F811
    from test_cli import run_cli

    out = tmp_path / "run"
    report = train(config(tiny, out, steps=2, sparse_ffn=True, l1=0.01), progress=False)
    # By default at the run's batch size, as the trainer evaluated (other N round differently).
    result = evaluate_run_or_folder(out, device="cpu")
    assert result["after"] == report.final_eval and result["after"].ffn_sparsity is not None
    assert result["run"]["ffn_overflow_rows"] == [0, 0] and result["run"]["l1"] == 0.01
    code, stdout, _ = run_cli(["eval", out], capsys)
    assert code == 0
    assert "student after: FFN sparsity per layer (%)" in stdout and "dead neurons (%)" in stdout
    assert "run: sparse FFN, L1 0.01; kernel overflow rows 0, fallback rows 0" in stdout
    code, stdout, _ = run_cli(["eval", out, "--json"], capsys)
    assert code == 0 and len(json.loads(stdout)["after"]["ffn_dead"]) == 2
    folder = evaluate_run_or_folder(out / "student", cache=tiny[1], heldout=4, device="cpu")
    assert len(folder["student"].ffn_sparsity) == 2


def test_train_student_cli_takes_sparse_ffn_and_l1(tiny, tmp_path, capsys):  # noqa: F811
    from test_cli import run_cli

    student, cache, _ = tiny
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train-student", "--cache", cache, "--student", student, "--out", out, "--steps", "1",
                                 "--batch-size", "2", "--heldout", "2", "--device", "cpu", "--sparse-ffn",
                                 "--l1", "1e-4", "--dead-reinit", "0.1", "--dead-window", "4096", "-q"], capsys)
    assert code == 0, err
    cfg = json.loads((out / "run.json").read_text())["config"]
    assert cfg["sparse_ffn"] is True and cfg["l1"] == 1e-4 and cfg["dead_reinit"] == 0.1
    assert cfg["dead_window"] == 4096
    assert "FFN sparsity per layer" in stdout
    code, stdout, _ = run_cli(["train-student", "--help"], capsys)
    assert "--sparse-ffn" in stdout and "--l1" in stdout
