"""Stage two on a sampled (RS-KD) cache, end to end: the real cache's batches through the real
loss give the estimator of CONTRACT (kernels/fused_topk_kl_torch.py's docstring), and
train-student trains on it and refuses what it cannot compose."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cli_helpers import one_error_line, run_cli
from student.data import CacheBatches
from student.loss import LossConfig, distill_loss
from teacher_cache.reader import CacheReader
from test_sampled_cache import sampled_cache  # noqa: F401  (module-scoped: 7 sequences, S = 12, T = 0.02)


def test_loss_on_a_sampled_batch_is_the_importance_weighted_estimate(sampled_cache):
    reader = CacheReader(sampled_cache)
    temperature = reader.manifest.spec.targets.temperature
    batch = next(iter(CacheBatches(reader, range(7), batch_size=3, seq_len=20, seed=0))).padded_to(24)
    vocab, d = reader.manifest.spec.tokenizer.vocab_size, 8
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(batch.mask), d, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, d, generator=gen, requires_grad=True)
    loss, kl = distill_loss(hidden, weight, batch, LossConfig(), cache_temperature=temperature)
    loss.backward()
    got = hidden.grad.clone(), weight.grad.clone()

    # By hand: sum_j w_j (l_j - log q(u_j)) over every real row, q the student at the cache's temperature.
    hidden.grad = weight.grad = None
    logq = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    real = batch.mask
    w = batch.target_weights[real]
    assert (w.sum(1) - 1).abs().max() < 1e-6  # the proposal is the teacher: counts / S
    per_row = (w * (batch.topk_logprobs[real] - logq[real].gather(1, batch.topk_ids[real]))).sum(1)
    expected = temperature**2 * per_row.mean()  # the KL scaled by T^2, as every tail is
    expected.backward()
    torch.testing.assert_close(kl, per_row.mean().detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)


def _other_student(tiny_teacher, folder: Path) -> Path:
    """The tiny teacher's architecture and tokenizer, other random weights (the teacher itself would
    start at KL 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_teacher)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.std().clamp_min(0.02))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_teacher).save_pretrained(folder)
    return folder


def test_train_student_on_a_sampled_cache(sampled_cache, tiny_teacher, tmp_path, capsys):
    run, student = tmp_path / "run", _other_student(tiny_teacher, tmp_path / "student")
    args = ["train-student", "--cache", sampled_cache, "--out", run, "--student", student, "--steps", "4",
            "--batch-size", "2", "--heldout", "1", "--lr", "1e-2", "--log-every", "1", "--quiet"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4 and all(torch.isfinite(torch.tensor(r["kl"])) for r in train)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and evals[-1]["kl"] < evals[0]["kl"]  # the estimator's KL falls on held-out rows

    code, _, err = run_cli([*args[:4], tmp_path / "other", *args[5:], "--temperature", "1"], capsys)
    line = one_error_line(code, err)
    assert "--temperature" in line and "sampled" in line, line
