"""The reverse-KL surrogate of on-policy distillation (student/objectives.py): its gradient is an
unbiased estimate of the exact reverse-KL gradient, from the student's own samples and, with the
importance ratio, from another sampler's (and biased without it, which the same check detects);
truncation by hand; through the fused loss's per-row cross-entropy it matches dense logits; rows
outside `rows` count for nothing; bad arguments raise one-line ValueErrors."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.fused_topk_kl import fused_topk_kl
from student.objectives import ReverseKLStats, reverse_kl_surrogate

V_SMALL = 7  # the Monte Carlo vocabulary: exact sums by enumeration
DRAWS = 200_000
# A gradient component may sit this many standard errors from its expectation: a fixed seed makes
# the test deterministic, and at 5 a correct estimator fails with probability ~1e-6 a component.
SIGMAS = 5.0


def _student_and_teacher():
    """Student logits z [V] and a teacher's log p [V], float64: distributions far enough apart that
    the reverse KL and its gradient are far from 0."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(V_SMALL, generator=gen, dtype=torch.float64) * 1.2
    logp = torch.log_softmax(torch.randn(V_SMALL, generator=gen, dtype=torch.float64) * 1.5, dim=-1)
    return z, logp


def _exact_grad(z, logp):
    """d KL(softmax(z) || p) / dz by enumeration: autograd on the closed form."""
    z = z.clone().requires_grad_(True)
    logq = torch.log_softmax(z, dim=-1)
    (grad,) = torch.autograd.grad((logq.exp() * (logq - logp)).sum(), z)
    return grad


def _estimate(z, logp, log_mu, sampler_logprob_of, seed=1):
    """The surrogate's gradient w.r.t. z from DRAWS tokens drawn from exp(log_mu), one position:
    (mean gradient [V] by autograd, its standard error [V], the per-draw coefficients' mean).

    sampler_logprob_of(x) gives the sampler_logprob the surrogate is told. The standard error is
    the per-draw gradient's, k_i (onehot(x_i) - q), with k_i the row's coefficient as the surrogate
    should weigh it (its autograd mean is checked equal to the mean of these)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.multinomial(log_mu.exp(), DRAWS, replacement=True, generator=gen)
    z = z.clone().requires_grad_(True)
    ce_rows = -torch.log_softmax(z, dim=-1)[x]
    sampler_logprob = sampler_logprob_of(x)
    loss, _ = reverse_kl_surrogate(ce_rows, logp[x], sampler_logprob, torch.ones(DRAWS, dtype=torch.bool),
                                   ratio_clip=None)
    loss.backward()

    logq = torch.log_softmax(z.detach(), dim=-1)
    ratio = torch.where(torch.isnan(sampler_logprob), 1.0, (logq[x] - sampler_logprob).exp())
    coef = ratio * (logq[x] - logp[x])
    per_draw = coef[:, None] * (torch.nn.functional.one_hot(x, V_SMALL).double() - logq.exp())
    torch.testing.assert_close(z.grad, per_draw.mean(0), rtol=0, atol=1e-12)
    return z.grad, per_draw.std(0) / math.sqrt(DRAWS)


def _no_sampler(x):
    """sampler_logprob NaN on every draw: the rows are told they are on-policy (ratio 1)."""
    return torch.full(x.shape, float("nan"), dtype=torch.float64)


def _sigmas(estimate, want, stderr):
    """The largest distance of a component from `want`, in standard errors."""
    return float(((estimate - want).abs() / stderr).max())


@pytest.mark.parametrize("labelled", ["nan", "logq"])
def test_on_policy_gradient_is_unbiased(labelled):
    """Draws from the student itself: ratio 1, told as NaN (no sampler log-prob) or as log q."""
    z, logp = _student_and_teacher()
    logq = torch.log_softmax(z, dim=-1)
    told = _no_sampler if labelled == "nan" else (lambda x: logq[x])
    grad, stderr = _estimate(z, logp, logq, told)
    exact = _exact_grad(z, logp)
    off = _sigmas(grad, exact, stderr)
    print(f"\non-policy ({labelled}): max |estimate - exact| = {off:.2f} standard errors "
          f"(stderr {float(stderr.max()):.1e}, |exact| max {float(exact.abs().max()):.2f})")
    assert off < SIGMAS


def test_off_policy_gradient_is_unbiased_with_the_ratio_and_biased_without():
    """Draws from a tempered sampler mu = softmax(z / 0.7): with w = q / mu the estimate is unbiased;
    told the rows are on-policy (NaN), it estimates E_mu[(log q - log p) grad log q] instead, which
    the same check rejects by many standard errors (and which matches that biased expectation)."""
    z, logp = _student_and_teacher()
    logq, log_mu = torch.log_softmax(z, dim=-1), torch.log_softmax(z / 0.7, dim=-1)
    exact = _exact_grad(z, logp)

    grad, stderr = _estimate(z, logp, log_mu, lambda x: log_mu[x])
    weighted = _sigmas(grad, exact, stderr)

    unweighted, stderr_u = _estimate(z, logp, log_mu, _no_sampler)
    biased_want = (log_mu.exp() * (logq - logp))[:, None] * (torch.eye(V_SMALL, dtype=torch.float64) - logq.exp())
    bias_sigmas = _sigmas(unweighted, exact, stderr_u)
    matches_biased = _sigmas(unweighted, biased_want.sum(0), stderr_u)
    print(f"\noff-policy: with the ratio {weighted:.2f} standard errors from exact; without it "
          f"{bias_sigmas:.0f} from exact and {matches_biased:.2f} from E_mu[A grad log q]")
    assert weighted < SIGMAS
    assert bias_sigmas > 4 * SIGMAS, "the sampler must differ enough for the check to detect the bias"
    assert matches_biased < SIGMAS


def test_truncation_by_hand():
    """ratio_clip = c: each row weighs min(w, c); the stats count the clipped rows among `rows` only."""
    logq = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.2], dtype=torch.float64)
    log_mu = torch.tensor([-1.0, -3.0, -2.5, float("nan"), -1.6, -9.0], dtype=torch.float64)
    logp = torch.tensor([-0.7, -2.5, -1.0, -2.0, -1.2, -0.1], dtype=torch.float64)
    rows = torch.tensor([True, True, True, True, True, False])  # the last row's ratio e^8.8 must not count
    ce_rows = (-logq).requires_grad_(True)
    loss, stats = reverse_kl_surrogate(ce_rows, logp, log_mu, rows, ratio_clip=2.0)
    loss.backward()

    ratio = torch.tensor([1.0, math.e, math.e**2, 1.0, math.exp(0.1)], dtype=torch.float64)
    weight = ratio.clamp_max(2.0)
    assert weight[1] == weight[2] == 2.0 and weight[4] < 2.0
    want_k = weight * (logq[:5] - logp[:5])
    # d/d ce of sg(k) log q, log q = -ce, over 5 rows: -k / 5.
    torch.testing.assert_close(ce_rows.grad, torch.cat([-want_k / 5, torch.zeros(1, dtype=torch.float64)]),
                               rtol=1e-12, atol=0)
    torch.testing.assert_close(loss, want_k.mean(), rtol=1e-12, atol=0)
    got = stats.as_floats()
    assert got["clipped_share"] == pytest.approx(2 / 5)
    assert got["mean_ratio"] == pytest.approx(float(ratio.mean()))
    assert got["reverse_kl"] == pytest.approx(float(want_k.mean()))
    assert got["num_rows"] == 5

    unclipped, stats_none = reverse_kl_surrogate(ce_rows, logp, log_mu, rows, ratio_clip=None)
    assert float(stats_none.clipped_share) == 0.0
    torch.testing.assert_close(unclipped, (ratio * (logq[:5] - logp[:5])).mean(), rtol=1e-12, atol=0)


def test_reductions_agree():
    """"none" gives the rows' terms (0 outside rows), "sum" their sum, "mean" the sum over the rows' count."""
    gen = torch.Generator().manual_seed(3)
    ce = torch.rand(9, generator=gen) * 3
    logp, log_mu = -torch.rand(9, generator=gen) * 4, -torch.rand(9, generator=gen) * 4
    rows = torch.rand(9, generator=gen) > 0.3
    per_row, _ = reverse_kl_surrogate(ce, logp, log_mu, rows, ratio_clip=3.0, reduction="none")
    total, _ = reverse_kl_surrogate(ce, logp, log_mu, rows, ratio_clip=3.0, reduction="sum")
    mean, _ = reverse_kl_surrogate(ce, logp, log_mu, rows, ratio_clip=3.0)
    assert per_row.shape == (9,) and bool((per_row[~rows] == 0).all())
    torch.testing.assert_close(total, per_row.sum())
    torch.testing.assert_close(mean, per_row.sum() / rows.sum())


def _fused_case(seed=0, n=13, d=5, v=11, k=4):
    """Student (hidden [n, d], weight [v, d]), a teacher's top-k targets of that cache's form, the
    realized tokens (some -1), a mask, and per-row teacher / sampler log-probs (fp32, NaN where a
    row has none; some rows on-policy)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen)
    teacher_logp = torch.log_softmax(torch.randn(n, v, generator=gen) * 2, dim=-1)
    topk_logprobs, topk_ids = teacher_logp.topk(k, dim=-1)
    tail_logmass = torch.log1p(-topk_logprobs.exp().sum(-1))
    target = torch.randint(0, v, (n,), generator=gen)
    target[[3, 9]] = -1
    mask = torch.ones(n, dtype=torch.bool)
    mask[[5, 12]] = False
    target_logprob = torch.where(target >= 0, teacher_logp.gather(1, target.clamp_min(0)[:, None])[:, 0], float("nan"))
    sampler_logp = torch.log_softmax((hidden @ weight.T) / 0.8 + 0.5 * torch.randn(n, v, generator=gen), dim=-1)
    sampler_logprob = sampler_logp.gather(1, target.clamp_min(0)[:, None])[:, 0]
    sampler_logprob[[0, 7]] = float("nan")
    return hidden, weight, topk_ids, topk_logprobs, tail_logmass, target, mask, target_logprob, sampler_logprob


@pytest.mark.parametrize("tail", ["renorm", "bucket", "unnormalized"])
def test_through_the_fused_loss_equals_dense_logits(tail):
    """ce_rows from fused_topk_kl (ce_weight 1, reduction "none", chunked torch path) is -log q(x) on
    the rows, 0 elsewhere, whatever the tail mode; the surrogate's gradients w.r.t. hidden and weight
    through it equal those through dense logits."""
    hidden, weight, ids, topk_lp, tail_lm, target, mask, target_lp, sampler_lp = _fused_case()
    rows = mask & (target >= 0)

    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ce_fused = fused_topk_kl(h1, w1, ids, topk_lp, tail_lm, target_ids=target, mask=mask, tail=tail, ce_weight=1.0,
                             reduction="none", impl="torch", chunk_size=4)
    loss_fused, stats_fused = reverse_kl_surrogate(ce_fused, target_lp, sampler_lp, rows, ratio_clip=1.5)
    loss_fused.backward()

    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logq_dense = torch.log_softmax(h2 @ w2.T, dim=-1).gather(1, target.clamp_min(0)[:, None])[:, 0]
    ce_dense = torch.where(rows, -logq_dense, 0.0)
    torch.testing.assert_close(ce_fused.detach(), ce_dense.detach(), rtol=0, atol=1e-6)
    loss_dense, stats_dense = reverse_kl_surrogate(ce_dense, target_lp, sampler_lp, rows, ratio_clip=1.5)
    loss_dense.backward()

    assert 0 < float(stats_fused.clipped_share) < 1, "the case should clip some rows, not all"
    torch.testing.assert_close(loss_fused, loss_dense, rtol=0, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-5)
    assert stats_fused.as_floats() == pytest.approx(stats_dense.as_floats(), abs=1e-6)


def test_rows_outside_count_for_nothing():
    """Garbage outside `rows` (NaN cross-entropy, NaN teacher, -inf sampler) changes neither the loss,
    the stats nor the rows' gradients, and gets a zero gradient; no rows at all gives 0."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([True, False, True, True, False, True])
    ce = torch.rand(6, generator=gen) * 3
    logp, log_mu = -torch.rand(6, generator=gen) * 4, -torch.rand(6, generator=gen) * 4
    ce[~rows], logp[~rows], log_mu[~rows] = float("nan"), float("nan"), float("-inf")

    ce_all = ce.clone().requires_grad_(True)
    loss_all, stats_all = reverse_kl_surrogate(ce_all, logp, log_mu, rows, ratio_clip=2.0)
    loss_all.backward()
    ce_kept = ce[rows].clone().requires_grad_(True)
    loss_kept, stats_kept = reverse_kl_surrogate(ce_kept, logp[rows], log_mu[rows], torch.ones(4, dtype=torch.bool),
                                                 ratio_clip=2.0)
    loss_kept.backward()

    torch.testing.assert_close(loss_all, loss_kept)
    assert stats_all.as_floats() == pytest.approx(stats_kept.as_floats())
    torch.testing.assert_close(ce_all.grad[rows], ce_kept.grad)
    assert bool((ce_all.grad[~rows] == 0).all())

    ce_none = ce.clone().requires_grad_(True)
    empty, stats_empty = reverse_kl_surrogate(ce_none, logp, log_mu, torch.zeros(6, dtype=torch.bool), ratio_clip=None)
    empty.backward()
    assert float(empty.detach()) == 0.0 and bool((ce_none.grad == 0).all())
    assert stats_empty.as_floats() == {"reverse_kl": 0.0, "mean_ratio": 0.0, "clipped_share": 0.0, "num_rows": 0.0}


def _valid(n=4):
    return torch.full((n,), 1.0), torch.full((n,), -1.0), torch.full((n,), -1.2), torch.ones(n, dtype=torch.bool)


@pytest.mark.parametrize("change, words", [
    (lambda a: {**a, "ce_rows": a["ce_rows"][:, None]}, "ce_rows must be a 1-D"),
    (lambda a: {**a, "teacher_logprob": a["teacher_logprob"][:3]}, "teacher_logprob must have shape (4,)"),
    (lambda a: {**a, "sampler_logprob": a["sampler_logprob"].long()}, "sampler_logprob must be a floating-point"),
    (lambda a: {**a, "rows": a["rows"].to(torch.uint8)}, "rows must be a bool tensor of shape (4,)"),
    (lambda a: {**a, "rows": a["rows"][:2]}, "rows must be a bool tensor of shape (4,)"),
    (lambda a: {**a, "ratio_clip": 0.5}, "ratio_clip must be None or a finite number >= 1"),
    (lambda a: {**a, "ratio_clip": float("inf")}, "ratio_clip must be None or a finite number >= 1"),
    (lambda a: {**a, "ratio_clip": True}, "ratio_clip must be None or a finite number >= 1"),
    (lambda a: {**a, "reduction": "avg"}, "reduction must be one of"),
    (lambda a: {**a, "teacher_logprob": torch.tensor([-1.0, float("nan"), -1.0, -1.0])},
     "teacher_logprob must be finite on every row of rows, got nan at row 1"),
    (lambda a: {**a, "sampler_logprob": torch.tensor([-1.0, -1.0, float("-inf"), -1.0])},
     "sampler_logprob must be finite or NaN (on-policy) on every row of rows, got -inf at row 2"),
])
def test_bad_arguments_raise_one_line(change, words):
    ce, logp, log_mu, rows = _valid()
    args = change({"ce_rows": ce, "teacher_logprob": logp, "sampler_logprob": log_mu, "rows": rows,
                   "ratio_clip": None, "reduction": "mean"})
    with pytest.raises(ValueError) as caught:
        reverse_kl_surrogate(args.pop("ce_rows"), args.pop("teacher_logprob"), args.pop("sampler_logprob"),
                             args.pop("rows"), **args)
    message = str(caught.value)
    assert words in message and "\n" not in message


def test_stats_are_detached_scalars():
    ce = torch.rand(5).requires_grad_(True)
    _, stats = reverse_kl_surrogate(ce, -torch.rand(5), torch.full((5,), float("nan")), torch.ones(5, dtype=torch.bool),
                                    ratio_clip=None)
    assert isinstance(stats, ReverseKLStats)
    for value in vars(stats).values():
        assert value.dim() == 0 and not value.requires_grad
    assert float(stats.mean_ratio) == 1.0


# ---- the generalised JSD objective (--objective jsd, kernels/fused_topk_kl's jsd_beta) -------------


def test_jsd_trains_from_the_command_and_refuses_what_it_cannot_train_on(tiny_teacher, tmp_path, capsys):
    """--objective jsd --beta 0.3 trains on a top-k cache (a JSD at every step, at most log 2); with
    --tail renorm, or on a sampled cache, it is one error line naming the option."""
    import json

    from cli_helpers import one_error_line, run_cli, run_cli_ok

    small = ["--model", tiny_teacher, "--max-sequences", "4", "--seq-len", "24", "-q"]
    run_cli_ok(["cache-teacher", *small, "-k", "8", "--out", tmp_path / "topk"])
    run_cli_ok(["cache-teacher", *small, "--targets", "sampled", "--samples", "6", "--out", tmp_path / "sampled"])
    flags = ["--teacher", tiny_teacher, "--num-layers", "1", "--steps", "3", "--batch-size", "2", "--heldout", "2",
             "--eval-every", "3", "--log-every", "1", "--device", "cpu", "--objective", "jsd", "--beta", "0.3", "-q"]
    code, _, err = run_cli(["train-student", "--cache", tmp_path / "topk", *flags, "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0 < r["kl"] <= math.log(2) and math.isfinite(r["loss"]) for r in train), train
    code, _, err = run_cli(["train-student", "--cache", tmp_path / "topk", *flags, "--tail", "renorm",
                            "--out", tmp_path / "renorm"], capsys)
    assert "--tail renorm: --objective jsd needs --tail bucket" in one_error_line(code, err)
    code, _, err = run_cli(["train-student", "--cache", tmp_path / "sampled", *flags, "--out", tmp_path / "s"], capsys)
    assert "--objective jsd needs a top-k cache" in one_error_line(code, err)
    code, _, err = run_cli(["train-student", "--cache", tmp_path / "topk", *flags, "--beta", "1", "--out",
                            tmp_path / "b"], capsys)
    assert "--beta must be in (0, 1)" in one_error_line(code, err)
