"""The fused KL loss on sampled teacher targets (``target_weights``, RS-KD): each path against the
dense reference, the estimator's formula by hand, its unbiasedness over many draws (and the bias of
top-k targets at the same bytes), and student.loss's use of it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_fused_topk_kl import POISON, SMALL_BLOCKS, TOL, TRITON_DEVICE, _assert_close, _loss_and_grads, needs_gpu

import kernels.fused_topk_kl_triton as fkt
from distill.configs import ConfigError
from kernels.fused_topk_kl import FusedKLSettings, fused_topk_kl, topk_kl_dense
from kernels.fused_topk_kl_torch import LossSpec
from student.loss import LossConfig, distill_loss

# Odd sizes: S = 12 slots (not a power of two), N no multiple of the chunk, V no multiple of a block.
N, V, D, SAMPLES = 37, 1271, 41, 12


def sampled_targets(logp_NV, samples, gen, logr_NV=None):
    """A sampled cache's targets for each row of the teacher log p [N, V] (float64), laid out as
    CONTRACT20.md says: `samples` ids drawn with replacement from the proposal log r (None: the
    teacher), the unique ids by count descending then id ascending, then padding slots of unsampled
    ids (count 0, distinct). Returns (ids int64 [N, S], counts int64 [N, S], log p at the ids [N, S],
    weights (count / S) p / r [N, S] (0 on padding), tail_logmass [N] over the sampled slots)."""
    logr_NV = logp_NV if logr_NV is None else logr_NV
    n, v = logp_NV.shape
    draws_NS = torch.multinomial(logr_NV.exp(), samples, replacement=True, generator=gen)
    counts_NV = torch.zeros(n, v, dtype=torch.int64).scatter_add_(1, draws_NS, torch.ones_like(draws_NS))
    ids_NS = (-v * counts_NV + torch.arange(v)).argsort(dim=1)[:, :samples]
    counts_NS = counts_NV.gather(1, ids_NS)
    lp_NS = logp_NV.gather(1, ids_NS)
    w_NS = counts_NS / samples * (lp_NS - logr_NV.gather(1, ids_NS)).exp()
    sampled_mass_N = torch.where(counts_NS > 0, lp_NS.exp(), 0.0).sum(-1)
    return ids_NS, counts_NS, lp_NS, w_NS, torch.log((1 - sampled_mass_N).clamp_min(1e-12))


def _inputs(dtype=torch.float32, n=N, v=V, d=D, samples=SAMPLES, seed=0, proposal_temperature=1.0, device="cpu"):
    """Student (hidden, weight), a peaked teacher of another model sampled as the cache does (so
    rows repeat ids and hold padding slots), CE targets and a mask: (hidden, weight, ids, lp, tail,
    target, mask, weights), teacher values in fp32 as the cache's reader gives them."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 1.5
    teacher_z = torch.randn(n, v, generator=gen, dtype=torch.float64) * 4.0
    logr = torch.log_softmax(teacher_z / proposal_temperature, dim=-1) if proposal_temperature != 1.0 else None
    ids, counts, lp, w, tail = sampled_targets(torch.log_softmax(teacher_z, dim=-1), samples, gen, logr)
    assert (counts == 0).any() and (counts > 1).any(), "the case needs padding slots and repeated ids"
    target = torch.randint(0, v, (n,), generator=gen)
    target[::5] = -1
    mask = torch.rand(n, generator=gen) > 0.2
    out = (hidden.to(dtype), weight.to(dtype), ids.int(), lp.float(), tail.float(), target, mask, w.float())
    return tuple(t.to(device) for t in out)


def _pair(fn_kw, dtype=torch.float32, settings=POISON, chunk_size=8, inputs=None, **kw):
    """(fused, dense) loss and gradients on sampled targets; fn_kw picks the fused path (impl=...)."""
    hidden, weight, ids, lp, tl, target, mask, w = inputs if inputs is not None else _inputs(dtype)
    kw = dict(dict(target_ids=target, mask=mask, tail="unnormalized", target_weights=w), **kw)
    got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=chunk_size, settings=settings,
                          **fn_kw, **kw)
    want = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    return got, want


# --- each path against the dense reference -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature, ce_weight, reduction", [(1.0, 0.0, "mean"), (1.0, 0.3, "sum"),
                                                               (2.0, 0.3, "mean"), (0.5, 1.0, "sum")])
def test_torch_path_matches_dense(dtype, temperature, ce_weight, reduction):
    got, want = _pair(dict(impl="torch"), dtype, temperature=temperature, cache_temperature=temperature,
                      ce_weight=ce_weight, reduction=reduction)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ce_weight, reduction", [(0.0, "mean"), (0.3, "sum")])
def test_triton_path_matches_dense(dtype, ce_weight, reduction):
    inputs = _inputs(dtype, device=TRITON_DEVICE)
    got, want = _pair(dict(impl="triton"), dtype, inputs=inputs, ce_weight=ce_weight, reduction=reduction)
    _assert_close(got, want, dtype)


# (dtype, T, CE weight) -> the Triton row kernel that takes sampled targets: each route against dense.
ROUTES = [((torch.float32, 1.0, 0.0), "scaled"), ((torch.bfloat16, 1.0, 0.3), "scaled"),
          ((torch.float16, 1.0, 0.0), "direct"), ((torch.float32, 2.0, 0.3), "direct")]


@pytest.mark.parametrize("case, kernel", ROUTES)
def test_triton_routes_match_dense(case, kernel):
    dtype, temperature, ce_weight = case
    assert fkt.row_kernel_for(True, "unnormalized", ce_weight > 0, temperature, dtype) == kernel
    inputs = _inputs(dtype, n=11, v=2 * SMALL_BLOCKS.scaled_block + 81, d=16, device=TRITON_DEVICE)
    got, want = _pair(dict(impl="triton"), dtype, settings=SMALL_BLOCKS, chunk_size=4, inputs=inputs,
                      temperature=temperature, cache_temperature=temperature, ce_weight=ce_weight)
    _assert_close(got, want, dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("ce_weight", [0.0, 0.3])
def test_triton_on_gpu_matches_dense(dtype, ce_weight):
    """A real GPU, auto dispatch, default settings, several chunks and Triton blocks (fp16: the
    direct row kernel; the others the scaled one)."""
    settings = FusedKLSettings()
    inputs = _inputs(dtype, n=1031, v=2 * settings.direct_block + 77, d=64, device="cuda")
    got, want = _pair({}, dtype, settings=settings, chunk_size=256, inputs=inputs, ce_weight=ce_weight)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_forward_only_kl_is_the_estimate(impl):
    """No gradient (the forward route on Triton), reduction "none": per-row loss and KL_est equal
    the dense reference's, 0 on masked rows."""
    hidden, weight, ids, lp, tl, target, mask, w = _inputs(device=TRITON_DEVICE if impl == "triton" else "cpu")
    kw = dict(target_ids=target, mask=mask, tail="unnormalized", target_weights=w, ce_weight=0.3,
              reduction="none", return_kl=True)
    with torch.no_grad():
        rows, kl = fused_topk_kl(hidden, weight, ids, lp, tl, impl=impl, chunk_size=8, settings=POISON, **kw)
    want_rows, want_kl = topk_kl_dense(hidden, weight, ids, lp, tl, **kw)
    assert (kl[~mask] == 0).all() and (rows[~mask] == 0).all()
    torch.testing.assert_close(rows, want_rows.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_equals_unchunked(reduction):
    inputs = _inputs()
    whole, _ = _pair(dict(impl="torch"), chunk_size=N, inputs=inputs, ce_weight=0.3, reduction=reduction)
    for chunk_size in (1, 6, None):
        got, _ = _pair(dict(impl="torch"), chunk_size=chunk_size, inputs=inputs, ce_weight=0.3, reduction=reduction)
        _assert_close(got, whole, torch.float32)


def test_gradcheck_float64():
    hidden, weight, ids, lp, tl, target, mask, w = _inputs(torch.float64, n=6, v=13, d=4, samples=5)
    kw = dict(target_ids=target, mask=mask, tail="unnormalized", target_weights=w.double(), ce_weight=0.3,
              chunk_size=4)
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, wt: fused_topk_kl(h, wt, ids, lp.double(), tl.double(), **kw),
                                    (hidden, weight))


@pytest.mark.parametrize("fn", [fused_topk_kl, topk_kl_dense])
def test_the_estimator_by_hand(fn):
    """KL_est = sum_j w_j (l_j - log q(u_j)) with the cached l as they are, and its gradient
    ((sum w) q - w on the ids) W: P replaced by w in the "unnormalized" formulas."""
    hidden, weight, ids, lp, tl, _, _, w = (t.double() if t.is_floating_point() else t
                                            for t in _inputs(torch.float64, proposal_temperature=2.0))
    h = hidden.clone().requires_grad_()
    loss = fn(h, weight, ids, lp, tl, tail="unnormalized", reduction="sum", target_weights=w)
    loss.backward()
    logq_NV = torch.log_softmax(hidden @ weight.T, dim=-1)
    want = (w * (lp - logq_NV.gather(1, ids.long()))).sum()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-9, atol=0)
    g_NV = w.sum(-1, keepdim=True) * logq_NV.exp() - torch.zeros_like(logq_NV).scatter(1, ids.long(), w)
    torch.testing.assert_close(h.grad, g_NV @ weight, rtol=1e-7, atol=1e-10)


# --- padding slots and masked rows ----------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "triton", "dense"])
def test_padding_slots_do_not_count(impl):
    """Slots of weight 0 (padding) add nothing, whatever (distinct) id and finite log p they hold."""
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    v = 211
    hidden, weight, ids, lp, tl, target, mask, w = _inputs(n=9, v=v, d=16, device=device)
    pad = w == 0
    # Other padding ids: the row's largest unsampled ids (the cache's are its smallest).
    sampled_NV = torch.zeros(ids.shape[0], v, device=device).scatter_(1, ids.long(), (~pad).float())
    largest_NS = (2 * v * sampled_NV - torch.arange(v, device=device)).argsort(dim=1)[:, :ids.shape[1]]
    moved_ids = torch.where(pad, largest_NS.int(), ids)
    assert (moved_ids != ids).any() and (moved_ids.sort(dim=1).values.diff(dim=1) != 0).all()
    fn, run = (topk_kl_dense, {}) if impl == "dense" else (fused_topk_kl, dict(impl=impl, chunk_size=4))
    kw = dict(target_ids=target, mask=mask, tail="unnormalized", target_weights=w, ce_weight=0.3, **run)
    base = _loss_and_grads(fn, hidden, weight, ids, lp, tl, **kw)
    moved = _loss_and_grads(fn, hidden, weight, moved_ids, torch.where(pad, lp - 7.0, lp), tl, **kw)
    _assert_close(moved, base, torch.float32)


@pytest.mark.parametrize("impl", ["torch", "triton", "dense"])
def test_masked_rows_ignore_their_targets(impl):
    """Masked rows may hold any weights, log-probs and tail (NaN, inf): the loss and gradients are
    those of the unmasked rows alone, and masked rows get no gradient."""
    hidden, weight, ids, lp, tl, target, mask, w = _inputs(device=TRITON_DEVICE if impl == "triton" else "cpu")
    bad_w, bad_lp, bad_tl = w.clone(), lp.clone(), tl.clone()
    bad_w[~mask], bad_lp[~mask], bad_tl[~mask] = float("nan"), float("-inf"), float("inf")
    fn, kw = (topk_kl_dense, {}) if impl == "dense" else (fused_topk_kl, dict(impl=impl, chunk_size=8))
    kw.update(tail="unnormalized", ce_weight=0.3)
    masked = _loss_and_grads(fn, hidden, weight, ids, bad_lp, bad_tl, target_ids=target, mask=mask,
                             target_weights=bad_w, **kw)
    kept = _loss_and_grads(fn, hidden[mask], weight, ids[mask], lp[mask], tl[mask],
                           target_ids=target[mask], target_weights=w[mask], **kw)
    torch.testing.assert_close(masked[0], kept[0])
    torch.testing.assert_close(masked[2], kept[2])
    assert (masked[1][~mask] == 0).all()
    torch.testing.assert_close(masked[1][mask], kept[1])


# --- validation ----------------------------------------------------------------------------------


def _valid(**change):
    hidden, weight, ids, lp, tl, target, mask, w = _inputs(n=6, v=40, d=4, samples=5)
    mask[1], mask[2] = False, True  # a masked row and an unmasked one at least
    return dict(dict(hidden=hidden, weight=weight, topk_ids=ids, topk_logprobs=lp, tail_logmass=tl, mask=mask,
                     target_weights=w, tail="unnormalized"), **change)


@pytest.mark.parametrize("change, message", [
    (dict(tail="bucket"), r"target_weights \(sampled targets\) need tail='unnormalized'.*got tail='bucket'; "
                          r"pass tail='unnormalized'"),
    (dict(tail="renorm"), "need tail='unnormalized'"),
    (dict(temperature=2.0), r"temperature is 2 but the cache holds ids sampled from the teacher at temperature 1, "
                            r"and sampled targets estimate the teacher only at the temperature they were drawn at"),
    (dict(target_weights=torch.ones(6, 4)), r"target_weights must have shape \(6, 5\)"),
    (dict(target_weights=torch.ones(6, 5, dtype=torch.int64)), "target_weights must be a floating-point tensor"),
])
def test_bad_sampled_options_raise(change, message):
    for fn in (fused_topk_kl, topk_kl_dense):
        with pytest.raises(ValueError, match=message):
            fn(**_valid(**change))


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_weights_must_be_finite_and_nonnegative_on_unmasked_rows(bad):
    args = _valid()
    row = int(args["mask"].int().argmax())  # an unmasked row
    args["target_weights"][row, 0] = bad
    with pytest.raises(ValueError, match=r"target_weights must be finite and >= 0 on unmasked rows, got"):
        fused_topk_kl(**args)
    fused_topk_kl(**args, check_ids=False)  # the value checks sync the device: check_ids=False skips them
    args = _valid()
    args["target_weights"][~args["mask"]] = bad
    assert torch.isfinite(fused_topk_kl(**args))  # masked rows may hold anything


# --- the estimator is unbiased; top-k targets are not -----------------------------------------------

# A small vocabulary, a teacher p and a student q; each row of a call is one independent draw of
# S ids, so one call gives many draws' gradients with respect to z (hidden = z, weight = I).
STAT_V, STAT_S, DRAWS = 24, 8, 40_000
BOUND = 5.0  # standard errors of the mean allowed per component (24 components, fixed seeds)


def _per_draw(fn, z, ids, lp, tail, w, tail_mode="unnormalized"):
    """Per-row gradient with respect to z [R, V] and per-row KL [R] (float64)."""
    rows = ids.shape[0]
    h = z.expand(rows, -1).clone().requires_grad_()
    kw = dict(tail=tail_mode, reduction="none", return_kl=True, target_weights=w)
    if fn is fused_topk_kl:
        kw.update(impl="torch", chunk_size=8192)
    loss, kl = fn(h, torch.eye(z.shape[0], dtype=torch.float64), ids, lp, tail, **kw)
    loss.sum().backward()
    return h.grad, kl


def _teacher_student(seed=0):
    gen = torch.Generator().manual_seed(seed)
    teacher_z = torch.randn(STAT_V, generator=gen, dtype=torch.float64) * 1.5
    z = torch.randn(STAT_V, generator=gen, dtype=torch.float64)
    return teacher_z, z, gen


@pytest.mark.parametrize("fn", [topk_kl_dense, fused_topk_kl], ids=["dense", "torch"])
@pytest.mark.parametrize("proposal_temperature", [1.0, 2.0, 0.7], ids=["r=p", "flatter", "sharper"])
def test_mean_gradient_over_draws_converges_to_the_full_kl_gradient(fn, proposal_temperature):
    """E[d KL_est / dz] = q - p over the whole vocabulary, and E[KL_est] = KL(p || q): the mean over
    DRAWS draws is within BOUND standard errors of both in every component, and its error shrinks
    as draws grow (64 times the draws: about 8 times smaller)."""
    teacher_z, z, gen = _teacher_student()
    logp_V = torch.log_softmax(teacher_z, -1)
    logr_V = torch.log_softmax(teacher_z / proposal_temperature, -1)
    ids, _, lp, w, tail = sampled_targets(logp_V.expand(DRAWS, -1), STAT_S, gen, logr_V.expand(DRAWS, -1))
    grads, kls = _per_draw(fn, z, ids, lp, tail, w)
    logq_V = torch.log_softmax(z, -1)
    want_grad, want_kl = logq_V.exp() - logp_V.exp(), (logp_V.exp() * (logp_V - logq_V)).sum()
    se_V = grads.std(dim=0) / math.sqrt(DRAWS)
    assert (se_V > 0).all()
    z_scores = (grads.mean(dim=0) - want_grad) / se_V
    assert z_scores.abs().max() < BOUND, z_scores
    assert abs(kls.mean() - want_kl) < BOUND * kls.std() / math.sqrt(DRAWS), (kls.mean(), want_kl)
    few = DRAWS // 64
    err_few = (grads[:few].mean(dim=0) - want_grad).norm()
    err_all = (grads.mean(dim=0) - want_grad).norm()
    assert err_all < 0.3 * err_few, (err_all, err_few)


@pytest.mark.parametrize("tail_mode", ["renorm", "unnormalized"])
def test_topk_targets_at_the_same_bytes_stay_biased(tail_mode):
    """Top-k targets of at least the sampled cache's bytes (an int32 id and a bf16 value per slot;
    the sampled slot adds a uint8 count) give a gradient off q - p by far more than the bound the
    sampled estimator meets: the statistical test above can tell a biased estimator."""
    teacher_z, z, gen = _teacher_student()
    logp_V = torch.log_softmax(teacher_z, -1)
    ids, _, lp, w, tail = sampled_targets(logp_V.expand(DRAWS, -1), STAT_S, gen)
    se_V = _per_draw(topk_kl_dense, z, ids, lp, tail, w)[0].std(dim=0) / math.sqrt(DRAWS)
    k = math.ceil(STAT_S * 7 / 6)
    topk_lp, topk_ids = logp_V.topk(k)
    topk_tail = torch.log1p(-topk_lp.exp().sum())[None]
    grad, _ = _per_draw(topk_kl_dense, z, topk_ids[None], topk_lp[None], topk_tail, None, tail_mode)
    want_grad = torch.softmax(z, -1) - logp_V.exp()
    z_scores = (grad[0] - want_grad) / se_V
    assert z_scores.abs().max() > 10 * BOUND, z_scores


# --- student.loss ----------------------------------------------------------------------------------


def _batch(with_weights=True):
    hidden, weight, ids, lp, tl, target, mask, w = _inputs(n=12, v=97, d=8, samples=6)
    batch = SimpleNamespace(topk_ids=ids.long(), topk_logprobs=lp, tail_logmass=tl, target_ids=target, mask=mask,
                            target_weights=w if with_weights else None)
    return hidden, weight, batch


@pytest.mark.parametrize("tail", ["bucket", "renorm", "unnormalized"])
def test_distill_loss_takes_the_batch_weights_whatever_the_tail(tail):
    hidden, weight, batch = _batch()
    config = LossConfig(tail=tail, ce_weight=0.25)
    loss, kl = distill_loss(hidden, weight, batch, config, cache_temperature=1.0)
    want, want_kl = fused_topk_kl(hidden, weight, batch.topk_ids, batch.topk_logprobs, batch.tail_logmass,
                                  target_ids=batch.target_ids, mask=batch.mask, tail="unnormalized", ce_weight=0.25,
                                  target_weights=batch.target_weights, return_kl=True)
    torch.testing.assert_close((loss, kl), (want, want_kl))
    topk_loss, _ = distill_loss(hidden, weight, _batch(with_weights=False)[2], config, cache_temperature=1.0)
    assert not torch.isclose(topk_loss, loss), "a top-k batch of the same ids: another loss"


def test_distill_loss_parts_sum_to_the_whole_on_sampled_targets():
    """`whole` (chunk-recurrent training): the parts' losses and KLs sum to the micro-batch's."""
    hidden, weight, batch = _batch()
    config = LossConfig(ce_weight=0.25)
    loss, kl = distill_loss(hidden, weight, batch, config, cache_temperature=1.0)
    whole = (int(batch.mask.sum()), int((batch.mask & (batch.target_ids >= 0)).sum()))
    parts = [distill_loss(hidden[rows], weight, SimpleNamespace(**{k: v[rows] for k, v in vars(batch).items()}),
                          config, cache_temperature=1.0, whole=whole) for rows in (slice(0, 5), slice(5, 12))]
    torch.testing.assert_close(sum(p[0] for p in parts), loss)
    torch.testing.assert_close(sum(p[1] for p in parts), kl)


def test_a_sampled_cache_refuses_another_temperature_whatever_the_tail():
    for tail in ("renorm", "bucket"):
        config = LossConfig(tail=tail, temperature=2.0)
        with pytest.raises(ConfigError) as info:
            config.check_cache_temperature(1.0, kind="sampled")
        message = str(info.value.as_option())
        assert message.startswith("--temperature is 2 but the cache holds ids sampled from the teacher at "
                                  "temperature 1") and "\n" not in message, message
        assert "distill cache-teacher --targets sampled --temperature 2" in message, message
        LossConfig(tail=tail).check_cache_temperature(1.0, kind="sampled")  # None: the cache's
        LossConfig(tail=tail, temperature=1.0).check_cache_temperature(1.0, kind="sampled")
    LossConfig(tail="renorm", temperature=2.0).check_cache_temperature(1.0)  # a top-k cache: renorm composes


def test_triton_forward_takes_the_weights():
    """triton_forward (which benchmarks call) takes the weights as its last argument: the same loss."""
    hidden, weight, ids, lp, tl, target, mask, w = _inputs(n=9, v=101, d=8, device=TRITON_DEVICE)
    spec = LossSpec("unnormalized", 1.0, 1.0, 0.0, "sum")
    out = fkt.triton_forward(hidden, weight, ids, lp, tl, None, mask, spec, 4, POISON, False, False, False, w)
    want = topk_kl_dense(hidden, weight, ids, lp, tl, mask=mask, tail="unnormalized", reduction="sum",
                         target_weights=w)
    assert out.row_kernel == "forward"
    torch.testing.assert_close(out.loss_N.sum(), want, rtol=TOL[torch.float32]["loss"][0], atol=1e-6)


# --- hybrid targets (--targets topk+sampled): the exact top-K, then draws from outside it ----------


def hybrid_targets(logp_NV, head, samples, gen, logr_NV=None):
    """A hybrid cache's targets, built here from the dense teacher log p [N, V] (float64): the exact
    top-`head` ids, then `samples` draws from the proposal log r (None: the teacher) restricted to
    the ids outside the top-K and renormalised, as a sampled row's slots (unique ids by count
    descending then id, then padding ids outside the top-K). Returns (ids int64 [N, K + S], log p
    at the ids, weights: p on the top-K, (count / S) p / r' on the draws, tail_logmass [N] = log(1 - P_K))."""
    logr_NV = logp_NV if logr_NV is None else logr_NV
    n, v = logp_NV.shape
    top_lp_NK, top_ids_NK = logp_NV.topk(head, dim=-1)
    outside_NV = logr_NV.scatter(1, top_ids_NK, float("-inf")).log_softmax(-1)  # r'
    draws_NS = torch.multinomial(outside_NV.exp(), samples, replacement=True, generator=gen)
    counts_NV = torch.zeros(n, v, dtype=torch.int64).scatter_add_(1, draws_NS, torch.ones_like(draws_NS))
    key_NV = (-v * counts_NV + torch.arange(v)).scatter(1, top_ids_NK, 2 * v)  # the top-K never pads
    ids_NS = key_NV.argsort(dim=1)[:, :samples]
    counts_NS = counts_NV.gather(1, ids_NS)
    lp_NS = logp_NV.gather(1, ids_NS)
    w_NS = counts_NS / samples * (lp_NS - outside_NV.gather(1, ids_NS)).exp()
    tail_N = logp_NV.scatter(1, top_ids_NK, float("-inf")).logsumexp(-1)
    return (torch.cat([top_ids_NK, ids_NS], 1), torch.cat([top_lp_NK, lp_NS], 1),
            torch.cat([top_lp_NK.exp(), w_NS], 1), tail_N)


def _hybrid_inputs(dtype=torch.float32, head=5, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, D, generator=gen, dtype=torch.float64) / math.sqrt(D)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64) * 1.5
    teacher_z = torch.randn(N, V, generator=gen, dtype=torch.float64) * 4.0
    ids, lp, w, tail = hybrid_targets(torch.log_softmax(teacher_z, -1), head, SAMPLES, gen)
    torch.testing.assert_close(w.sum(1), torch.ones(N, dtype=torch.float64))  # P_K + (1 - P_K), the proposal p
    target = torch.randint(0, V, (N,), generator=gen)
    mask = torch.rand(N, generator=gen) > 0.2
    out = (hidden.to(dtype), weight.to(dtype), ids.int(), lp.float(), tail.float(), target, mask, w.float())
    return tuple(t.to(device) for t in out)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hybrid_targets_each_path_matches_dense(impl, dtype):
    """The loss takes a hybrid row's weights as they are (exact p on the top-K, estimates after it)."""
    inputs = _hybrid_inputs(dtype, device=TRITON_DEVICE if impl == "triton" else "cpu")
    got, want = _pair(dict(impl=impl), dtype, inputs=inputs, ce_weight=0.3)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("fn", [topk_kl_dense, fused_topk_kl], ids=["dense", "torch"])
@pytest.mark.parametrize("proposal_temperature", [1.0, 2.0], ids=["r=p", "flatter"])
def test_mean_gradient_over_hybrid_draws_converges_to_the_full_kl_gradient(fn, proposal_temperature):
    """As for sampled targets: E[d KL_est / dz] = q - p and E[KL_est] = KL(p || q) over the whole
    vocabulary, with the top-K exact and the draws from outside it."""
    teacher_z, z, gen = _teacher_student()
    logp_V = torch.log_softmax(teacher_z, -1)
    logr_V = torch.log_softmax(teacher_z / proposal_temperature, -1)
    ids, lp, w, tail = hybrid_targets(logp_V.expand(DRAWS, -1), 3, STAT_S, gen, logr_V.expand(DRAWS, -1))
    grads, kls = _per_draw(fn, z, ids, lp, tail, w)
    logq_V = torch.log_softmax(z, -1)
    want_grad, want_kl = logq_V.exp() - logp_V.exp(), (logp_V.exp() * (logp_V - logq_V)).sum()
    se_V = grads.std(dim=0) / math.sqrt(DRAWS)
    # With r = p a row's weights sum to 1, so at a top-K id the gradient q - p is exact on every draw.
    exact = se_V < 1e-12
    assert int(exact.sum()) == (3 if proposal_temperature == 1.0 else 0)
    torch.testing.assert_close(grads[:, exact], want_grad[exact].expand(DRAWS, -1), rtol=0, atol=1e-12)
    assert ((grads.mean(dim=0) - want_grad)[~exact] / se_V[~exact]).abs().max() < BOUND
    assert abs(kls.mean() - want_kl) < BOUND * kls.std() / math.sqrt(DRAWS), (kls.mean(), want_kl)
