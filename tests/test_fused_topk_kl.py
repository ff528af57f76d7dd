"""kernels.fused_topk_kl (its chunked torch path, hand-written backward, and its Triton path) against
the dense autograd reference ``topk_kl_dense``."""

from __future__ import annotations

import math

import pytest
import torch

import kernels.fused_topk_kl_triton as fkt
from kernels.fused_topk_kl import TAIL_MODES, FusedKLSettings, fused_topk_kl, topk_kl_dense
from kernels.fused_topk_kl_torch import LossSpec

# Tolerances, in one place: (rtol, atol) on the loss, and on each gradient relative to its largest
# entry. fp32: the fused path sums in another order (per chunk, hand-written gradient); the errors
# seen sit about an order of magnitude under these bounds. bf16: both paths round the logits to
# bf16 in the matmul, but a chunk's matmul may round a logit one bf16 ulp (2**-8 relative) away
# from the whole one (it can on GPUs; on this CPU they agree), and the backward's matmuls take bf16
# inputs and give bf16 outputs (3 significant digits) while the dense one sums grad_W in one bf16
# matmul. fp16 (the Triton path's direct row kernel): its 11-bit significand rounds finer than
# bf16's 8 bits, so the bf16 bounds hold it.
TOL = {
    torch.float32: {"loss": (1e-5, 1e-6), "grad": 1e-5},
    torch.bfloat16: {"loss": (5e-3, 1e-4), "grad": 2e-2},
    torch.float16: {"loss": (5e-3, 1e-4), "grad": 2e-2},
}
# Kernel tests run with NaN-poisoned buffers: an element a kernel should write and does not fails.
POISON = FusedKLSettings(poison=True)
# Odd and prime sizes: a vocabulary that is no multiple of any block size, chunks that do not
# divide N.
N, V, D = 37, 1271, 41


def _inputs(k, dtype=torch.float32, n=N, v=V, d=D, seed=0):
    """Student (hidden, weight) and a teacher's cached top-k of a different model, as the cache holds them."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 1.5
    teacher_lp = torch.log_softmax(torch.randn(n, v, generator=gen, dtype=torch.float64) * 2.5, dim=-1)
    topk_lp, topk_ids = teacher_lp.topk(k, dim=-1)
    tail = torch.log((1 - topk_lp.exp().sum(-1)).clamp_min(1e-12))
    target_ids = torch.randint(0, v, (n,), generator=gen)
    target_ids[::5] = -1  # rows with no next token
    mask = torch.rand(n, generator=gen) > 0.2
    return (hidden.to(dtype), weight.to(dtype), topk_ids.int(), topk_lp.float(), tail.float(),
            target_ids, mask)


def _temps(tail, temperature):
    """The cache temperature a test's random cache is taken to be at: the distillation temperature
    where the tail mode needs them equal, else 1 (renorm then tempers the cached top-k by 1 / T)."""
    return dict(temperature=temperature, cache_temperature=1.0 if tail == "renorm" else temperature)


def _loss_and_grads(fn, hidden, weight, *teacher, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, *teacher, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _assert_close(got, want, dtype, all_zero=False):
    """all_zero: the case's loss is identically zero (renorm KL over one category)."""
    (loss, gh, gw), (ref_loss, ref_gh, ref_gw) = got, want
    if all_zero:
        assert loss == 0 and ref_loss == 0 and not gh.any() and not gw.any() and not ref_gh.any()
        return
    rtol, atol = TOL[dtype]["loss"]
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    for name, g, ref in (("grad_hidden", gh, ref_gh), ("grad_weight", gw, ref_gw)):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        scale = ref.float().abs().max().item()
        assert scale > 0, f"{name} of the reference is all zero: the case tests nothing"
        err = (g.float() - ref.float()).abs().max().item()
        assert err <= TOL[dtype]["grad"] * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 5, 100])
@pytest.mark.parametrize("tail", TAIL_MODES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("ce_weight", [0.0, 0.3, 1.0])
def test_matches_dense(dtype, k, tail, temperature, ce_weight):
    hidden, weight, ids, lp, tl, target, mask = _inputs(k, dtype)
    kw = dict(target_ids=target, mask=mask, tail=tail, ce_weight=ce_weight, **_temps(tail, temperature))
    got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=8, settings=POISON, **kw)
    want = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    _assert_close(got, want, dtype, all_zero=tail == "renorm" and k == 1 and ce_weight == 0)


@pytest.mark.parametrize("tail", TAIL_MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_equals_unchunked(tail, reduction):
    hidden, weight, ids, lp, tl, target, mask = _inputs(5)
    kw = dict(target_ids=target, mask=mask, tail=tail, ce_weight=0.3, reduction=reduction, **_temps(tail, 2.0))
    whole = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=N, **kw)
    for chunk_size in (1, 6, 36, None):
        got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=chunk_size, **kw)
        _assert_close(got, whole, torch.float32)


@pytest.mark.parametrize("tail", TAIL_MODES)
def test_gradcheck_float64(tail):
    hidden, weight, ids, lp, tl, target, mask = _inputs(3, torch.float64, n=5, v=13, d=4)
    kw = dict(target_ids=target, mask=mask, tail=tail, ce_weight=0.3, chunk_size=2, **_temps(tail, 2.0))
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, w: fused_topk_kl(h, w, ids, lp, tl, **kw), (hidden, weight))


def test_unnormalized_is_the_papers_formula():
    """T = 1: sum_S p (log p - log q) with the cached p as is, and its gradient (M q - p) W."""
    hidden, weight, ids, lp, tl, _, _ = _inputs(5, torch.float64)
    h = hidden.clone().requires_grad_()
    loss = fused_topk_kl(h, weight, ids, lp.double(), tl.double(), tail="unnormalized", reduction="sum")
    loss.backward()
    logq_NV = torch.log_softmax(hidden @ weight.T, dim=-1)
    p_NK = lp.double().exp()
    want = (p_NK * (lp.double() - logq_NV.gather(1, ids.long()))).sum()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-7, atol=0)
    g_NV = p_NK.sum(-1, keepdim=True) * logq_NV.exp() - torch.zeros_like(logq_NV).scatter(1, ids.long(), p_NK)
    torch.testing.assert_close(h.grad, g_NV @ weight, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("tail, temperature, cache_temperature", [("bucket", 2.0, 2.0), ("renorm", 2.0, 1.0),
                                                                   ("renorm", 0.5, 2.0)])
def test_temperature_by_hand(tail, temperature, cache_temperature):
    """T^2 KL(P || Q), P the cached teacher tempered from T_c to T (p^(T_c / T), normalised): over
    k + 1 categories for bucket (T = T_c: the cached p and tail as they are), over S for renorm."""
    hidden, weight, ids, lp, tl, _, _ = _inputs(5, torch.float64, n=7, v=50, d=6)
    loss = fused_topk_kl(hidden, weight, ids, lp.double(), tl.double(), tail=tail, temperature=temperature,
                         cache_temperature=cache_temperature)
    q_NV = torch.softmax(hidden @ weight.T / temperature, dim=-1)
    q_NK = q_NV.gather(1, ids.long())
    if tail == "bucket":
        p_NK1 = torch.cat([lp.double().exp(), tl.double().exp()[:, None]], dim=-1)
        q_NK1 = torch.cat([q_NK, 1 - q_NK.sum(-1, keepdim=True)], dim=-1)
    else:
        p_NK1, q_NK1 = lp.double().exp() ** (cache_temperature / temperature), q_NK
    p_NK1, q_NK1 = p_NK1 / p_NK1.sum(-1, keepdim=True), q_NK1 / q_NK1.sum(-1, keepdim=True)
    want = temperature**2 * (p_NK1 * (p_NK1 / q_NK1).log()).sum(-1).mean()
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=0)


# --- temperatures: the cached values are at cache_temperature, the distillation at temperature ----

# Every (tail, T, T_c) the loss accepts: renorm at any pair, the tail modes at T = T_c.
ACCEPTED = [("renorm", t, tc) for t, tc in ((1.0, 1.0), (2.0, 2.0), (2.0, 1.0), (1.0, 2.0), (0.5, 3.0))] + [
    (tail, t, t) for tail in ("bucket", "unnormalized") for t in (1.0, 2.0, 0.5)]


def _teacher_is_student(temperature, cache_temperature, dtype, device="cpu", k=7, n=11, v=97, d=13):
    """Student (hidden, weight) and a cache of the student's own logits z = hidden @ weight.T,
    written at cache_temperature: top-k of log_softmax(z / T_c) and its tail."""
    hidden, weight, *_ = _inputs(k, torch.float64, n=n, v=v, d=d, seed=3)
    hidden, weight = hidden.to(dtype).double(), weight.to(dtype).double()  # z exact in dtype's inputs
    topk_lp, topk_ids = torch.log_softmax(hidden @ weight.T / cache_temperature, dim=-1).topk(k, dim=-1)
    tail_lm = torch.log1p(-topk_lp.exp().sum(-1))
    out = hidden.to(dtype), weight.to(dtype), topk_ids, topk_lp.to(dtype), tail_lm.to(dtype)
    return tuple(t.to(device) for t in out)


@pytest.mark.parametrize("impl", ["torch", "dense", "triton"])
@pytest.mark.parametrize("tail, temperature, cache_temperature", ACCEPTED)
def test_teacher_scores_zero_at_every_accepted_temperature(impl, tail, temperature, cache_temperature):
    """The teacher's own distribution is the loss's optimum: zero KL (to rounding), and for the
    true KLs (renorm, bucket) zero gradient, at every temperature pair the loss accepts."""
    dtype = torch.float64 if impl != "triton" else torch.float32
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    hidden, weight, ids, lp, tl = _teacher_is_student(temperature, cache_temperature, dtype, device)
    fn = topk_kl_dense if impl == "dense" else fused_topk_kl
    kw = dict(tail=tail, temperature=temperature, cache_temperature=cache_temperature, return_kl=True)
    if impl != "dense":
        kw.update(impl=impl, chunk_size=4, settings=POISON)
    h = hidden.clone().requires_grad_()
    loss, kl = fn(h, weight, ids, lp, tl, **kw)
    loss.backward()
    zero = 1e-12 if dtype == torch.float64 else 1e-5
    assert abs(kl.item()) < zero and abs(loss.item()) < zero * max(1.0, temperature**2), (loss.item(), kl.item())
    if tail != "unnormalized":  # the paper's form pushes mass into S even from the teacher
        assert h.grad.abs().max().item() < zero


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_cache_at_t2_equals_a_cache_at_t1_tempered_to_t2(impl):
    """renorm at T = 2: a cache written at T = 2 and one written at T = 1 give the same loss and
    gradients (the cache's temperature is taken into account, never applied twice)."""
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    hidden, weight, _, _, _, target, mask = _inputs(5)
    teacher_z = torch.randn(N, V, generator=torch.Generator().manual_seed(7)) * 2.5
    runs = []
    for cache_temperature in (2.0, 1.0):
        lp, ids = torch.log_softmax(teacher_z / cache_temperature, dim=-1).topk(5, dim=-1)
        tl = torch.log1p(-lp.exp().sum(-1))
        args = (t.to(device) for t in (hidden, weight, ids, lp, tl))
        runs.append(_loss_and_grads(fused_topk_kl, *args, target_ids=target.to(device), mask=mask.to(device),
                                    tail="renorm", temperature=2.0, cache_temperature=cache_temperature,
                                    ce_weight=0.3, impl=impl, chunk_size=8))
    _assert_close(runs[0], runs[1], torch.float32)


@pytest.mark.parametrize("tail", ["bucket", "unnormalized"])
@pytest.mark.parametrize("fn", [fused_topk_kl, topk_kl_dense])
def test_tail_modes_refuse_another_temperature_than_the_cache(tail, fn):
    hidden, weight, ids, lp, tl, _, _ = _inputs(5)
    with pytest.raises(ValueError) as info:
        fn(hidden, weight, ids, lp, tl, tail=tail, temperature=2.0, cache_temperature=1.0)
    message = str(info.value)
    # The one wording of kernels/temperature_rule.py, which the run's config refuses with too.
    for part in ("temperature is 2 but the cache holds the teacher at temperature 1", f"the {tail!r} tail",
                 "cache the teacher at temperature 2", "the 'renorm' tail"):
        assert part in message, message
    fn(hidden, weight, ids, lp, tl, tail=tail, temperature=2.0, cache_temperature=2.0)  # the way out, accepted


# --- masks, reductions, return_kl ----------------------------------------------------------------


def test_mask_drops_rows_and_ignores_their_teacher_values():
    hidden, weight, ids, lp, tl, target, mask = _inputs(5)
    kw = dict(target_ids=target, tail="bucket", temperature=2.0, cache_temperature=2.0, ce_weight=0.3)
    lp_bad, tl_bad = lp.clone(), tl.clone()
    lp_bad[~mask], tl_bad[~mask] = float("nan"), float("inf")
    masked = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp_bad, tl_bad, mask=mask, chunk_size=8, **kw)
    kw["target_ids"] = target[mask]
    kept = _loss_and_grads(fused_topk_kl, hidden[mask], weight, ids[mask], lp[mask], tl[mask], **kw)
    torch.testing.assert_close(masked[0], kept[0])
    torch.testing.assert_close(masked[2], kept[2])
    assert (masked[1][~mask] == 0).all()
    torch.testing.assert_close(masked[1][mask], kept[1])


def test_reduction_and_ce_weight():
    """mean = sum / rows; ce_weight = 1 is plain cross-entropy over rows with a target."""
    hidden, weight, ids, lp, tl, target, _ = _inputs(5)
    kw = dict(target_ids=target, tail="renorm", ce_weight=0.0)
    total = fused_topk_kl(hidden, weight, ids, lp, tl, reduction="sum", **kw)
    torch.testing.assert_close(fused_topk_kl(hidden, weight, ids, lp, tl, **kw), total / N)
    ce = fused_topk_kl(hidden, weight, ids, lp, tl, target_ids=target, ce_weight=1.0)
    keep = target >= 0
    want = torch.nn.functional.cross_entropy(hidden[keep] @ weight.T, target[keep])
    torch.testing.assert_close(ce, want)


@pytest.mark.parametrize("tail", TAIL_MODES)
def test_reduction_none_is_the_loss_per_row(tail):
    """reduction="none": the loss [N] per row (0 on masked rows) sums to the "sum" loss, matches the
    dense reference's rows, and its gradient under per-row weights is the reference's."""
    hidden, weight, ids, lp, tl, target, mask = _inputs(5)
    kw = dict(target_ids=target, mask=mask, tail=tail, ce_weight=0.3, **_temps(tail, 2.0))
    rows, kl = fused_topk_kl(hidden, weight, ids, lp, tl, reduction="none", chunk_size=8, return_kl=True, **kw)
    want_rows, want_kl = topk_kl_dense(hidden, weight, ids, lp, tl, reduction="none", return_kl=True, **kw)
    assert rows.shape == kl.shape == (N,) and (rows[~mask] == 0).all() and (kl[~mask] == 0).all()
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rows.sum(), fused_topk_kl(hidden, weight, ids, lp, tl, reduction="sum", **kw))
    row_w = torch.rand(N, generator=torch.Generator().manual_seed(1))
    got = _loss_and_grads(lambda *a, **k: (fused_topk_kl(*a, **k) * row_w).sum(), hidden, weight, ids, lp, tl,
                          reduction="none", chunk_size=8, **kw)
    want = _loss_and_grads(lambda *a, **k: (topk_kl_dense(*a, **k) * row_w).sum(), hidden, weight, ids, lp, tl,
                           reduction="none", **kw)
    _assert_close(got, want, torch.float32)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("ce_weight, temperature, reduction", [(0.0, 1.0, "mean"), (0.3, 1.0, "sum"),
                                                               (0.3, 2.0, "mean"), (1.0, 1.0, "mean")])
def test_return_kl_is_the_kl_term(impl, ce_weight, temperature, reduction):
    """return_kl: the loss is unchanged and the KL is the dense reference's KL term alone (masked
    rows out, no T^2, no CE weight), from the same call; by hand at ce_weight 0 and T = 1."""
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    hidden, weight, ids, lp, tl, target, mask = (t.to(device) for t in _inputs(5))
    kw = dict(target_ids=target, mask=mask, tail="bucket", temperature=temperature, cache_temperature=temperature,
              ce_weight=ce_weight, reduction=reduction)
    loss, kl = fused_topk_kl(hidden, weight, ids, lp, tl, impl=impl, chunk_size=8, return_kl=True, **kw)
    torch.testing.assert_close(loss, fused_topk_kl(hidden, weight, ids, lp, tl, impl=impl, chunk_size=8, **kw))
    want_loss, want_kl = topk_kl_dense(hidden, weight, ids, lp, tl, return_kl=True, **kw)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-6)
    assert not kl.requires_grad
    if ce_weight == 0.0 and temperature == 1.0:
        torch.testing.assert_close(kl, loss)  # the loss is the KL itself
    if ce_weight == 1.0:  # KL not in the loss, but reported: it equals the KL-only loss at T = 1
        kl_only = fused_topk_kl(hidden, weight, ids, lp, tl, impl=impl, mask=mask, tail="bucket")
        torch.testing.assert_close(kl, kl_only, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("ce_weight", [0.0, 1.0])
def test_evaluation_call_sums_under_no_grad(impl, ce_weight):
    """The whole-sequence evaluation's call: no_grad, reduction="sum", return_kl (the CE sum as the
    loss at ce_weight = 1): the sums of the dense reference, and nothing that tracks gradients."""
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    hidden, weight, ids, lp, tl, target, mask = (t.to(device) for t in _inputs(5))
    kw = dict(target_ids=target, mask=mask, tail="bucket", ce_weight=ce_weight, reduction="sum", return_kl=True)
    with torch.no_grad():
        loss, kl = fused_topk_kl(hidden.requires_grad_(), weight, ids, lp, tl, impl=impl, chunk_size=8,
                                 settings=POISON, **kw)
    want_loss, want_kl = topk_kl_dense(hidden.detach(), weight, ids, lp, tl, **kw)
    assert not loss.requires_grad and not kl.requires_grad
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-5)


def test_no_saved_tensor_is_vocabulary_wide():
    hidden, weight, ids, lp, tl, target, mask = _inputs(5)
    h = hidden.clone().requires_grad_()
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_topk_kl(h, weight, ids, lp, tl, target_ids=target, mask=mask, tail="bucket", ce_weight=0.3)
    assert (V, D) in shapes, "the lm-head weight is saved for the backward's recompute"
    wide = [shape for shape in shapes if V in shape and shape != (V, D)]
    assert not wide, f"saved tensors of vocabulary width: {wide}"


# --- validation ----------------------------------------------------------------------------------


def _kw_valid():
    hidden, weight, ids, lp, tl, target, mask = _inputs(5, n=6, v=20, d=4)
    return dict(hidden=hidden, weight=weight, topk_ids=ids, topk_logprobs=lp, tail_logmass=tl,
                target_ids=target, mask=mask)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a["topk_ids"].__setitem__((0, 0), 20), r"k ids must be in \[0, V=20\)"),
        (lambda a: a["topk_ids"].__setitem__((1, 2), -1), r"k ids must be in \[0, V=20\)"),
        (lambda a: a["topk_ids"].__setitem__((1, 1), int(a["topk_ids"][1, 0])), "distinct"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:-1]), r"topk_ids must have shape \[N=6, k\]"),
        (lambda a: a.update(topk_logprobs=a["topk_logprobs"][:, :4]), r"topk_logprobs must have shape \(6, 5\)"),
        (lambda a: a.update(tail_logmass=a["tail_logmass"][:5]), r"tail_logmass must have shape \(6,\)"),
        (lambda a: a.update(weight=a["weight"][:, :3]), "does not match weight width"),
        (lambda a: a.update(hidden=a["hidden"][None]), r"hidden must be \[N, d\]"),
        (lambda a: a.update(weight=a["weight"].double()), "share a floating-point dtype"),
        (lambda a: a.update(topk_ids=a["topk_ids"].float()), "topk_ids must be int32 or int64"),
        (lambda a: a["target_ids"].__setitem__(0, 20), r"target_ids must be in \[0, V=20\) or -1"),
        (lambda a: a.update(target_ids=a["target_ids"][:3]), r"target_ids must have shape \(6,\)"),
        (lambda a: a.update(mask=a["mask"].int()), "mask must be a bool tensor"),
        (lambda a: a.update(tail="topk"), "tail must be one of"),
        (lambda a: a.update(temperature=0.0), "temperature must be a positive finite number, got 0.0"),
        (lambda a: a.update(cache_temperature=-1.0), "cache_temperature must be a positive finite number, got -1.0"),
        (lambda a: a.update(cache_temperature=float("inf")), "cache_temperature must be a positive finite number"),
        (lambda a: a.update(ce_weight=1.5), r"ce_weight must be in \[0, 1\]"),
        (lambda a: a.update(target_ids=None), "needs target_ids"),
        (lambda a: a.update(reduction="max"), r"reduction must be one of \('mean', 'sum', 'none'\), got 'max'"),
    ],
)
def test_bad_inputs_raise(change, message):
    args = dict(_kw_valid(), ce_weight=0.3)
    change(args)
    for fn in (fused_topk_kl, topk_kl_dense):
        with pytest.raises(ValueError, match=message):
            fn(**args)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(impl="cuda"), "impl must be 'auto', 'torch' or 'triton', got 'cuda'"),
        (dict(settings={"poison": True}), "settings must be a FusedKLSettings or None, got dict"),
        (dict(impl="triton", hidden=torch.zeros(6, 4, dtype=torch.float64),
              weight=torch.zeros(20, 4, dtype=torch.float64)), "impl='triton' takes fp32, bf16 or fp16 inputs"),
    ],
)
def test_bad_run_options_raise(change, message):
    with pytest.raises(ValueError, match=message):
        fused_topk_kl(**(_kw_valid() | change))


@pytest.mark.parametrize("change, field", [(dict(scaled_block=3000), "scaled_block"),
                                           (dict(direct_warps=3), "direct_warps"),
                                           (dict(triton_chunk_bytes=0), "triton_chunk_bytes"),
                                           (dict(poison=1), "poison")])
def test_bad_settings_raise(change, field):
    with pytest.raises(ValueError, match=f"`{field}` must be"):
        FusedKLSettings(**change)


def test_bucket_needs_a_tail():
    hidden, weight, _, _, _, _, _ = _inputs(5, n=4, v=6, d=3)
    ids = torch.arange(6).repeat(4, 1)
    lp = torch.log_softmax(torch.randn(4, 6), -1)
    with pytest.raises(ValueError, match="tail='bucket' needs k < vocab_size=6"):
        fused_topk_kl(hidden, weight, ids, lp, torch.zeros(4), tail="bucket")
    assert torch.isfinite(fused_topk_kl(hidden, weight, ids, lp, torch.zeros(4), tail="renorm"))


def test_auto_runs_the_torch_path_on_the_cpu():
    """impl="auto" on CPU tensors takes the torch path, whose backward (unlike the Triton path's)
    recomputes the logits and so can run twice."""
    hidden, weight, ids, lp, tl, _, _ = _inputs(5)
    h = hidden.clone().requires_grad_()
    loss = fused_topk_kl(h, weight, ids, lp, tl)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    loss.backward()
    torch.testing.assert_close(h.grad, 2 * first)


# --- Triton path (gradients in forward). On a machine with no GPU these run in Triton's
# interpreter (tests/conftest.py), so shapes stay small; the same tolerances apply. Every call
# poisons its buffers (POISON), and small blocks (SMALL_BLOCKS) put several blocks in one row.

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_BLOCKS = FusedKLSettings(poison=True, scaled_block=256, direct_block=256)


def _tinputs(*args, **kw):
    """_inputs on the device the Triton tests run on (a GPU where there is one)."""
    return tuple(t.to(TRITON_DEVICE) for t in _inputs(*args, **kw))


def _triton_vs_dense(dtype, k, n=N, v=V, d=D, chunk_size=8, use_mask=True, settings=POISON, **kw):
    hidden, weight, ids, lp, tl, target, mask = _tinputs(k, dtype, n=n, v=v, d=d)
    kw = dict(target_ids=target, mask=mask if use_mask else None, **kw)
    got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=chunk_size, impl="triton",
                          settings=settings, **kw)
    want = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tail", TAIL_MODES)
@pytest.mark.parametrize("k, temperature, ce_weight, reduction",
                         [(5, 1.0, 0.0, "mean"), (5, 2.0, 0.3, "mean"), (1, 2.0, 0.0, "sum"), (100, 1.0, 0.3, "sum")])
def test_triton_matches_dense(dtype, tail, k, temperature, ce_weight, reduction):
    got, want = _triton_vs_dense(dtype, k, tail=tail, ce_weight=ce_weight, reduction=reduction,
                                 **_temps(tail, temperature))
    _assert_close(got, want, dtype, all_zero=tail == "renorm" and k == 1 and ce_weight == 0)


# (write_grad, dtype, tail, has CE, T) -> the row kernel that runs: each route is tested below on
# such a case against the dense reference.
ROUTES = [
    ((True, torch.bfloat16, "bucket", False, 1.0), "scaled"),
    ((True, torch.float32, "unnormalized", True, 1.0), "scaled"),
    ((True, torch.bfloat16, "renorm", True, 1.0), "scaled"),
    ((True, torch.float32, "bucket", False, 2.0), "scaled"),
    ((True, torch.float16, "bucket", False, 1.0), "direct"),
    ((True, torch.float32, "bucket", True, 2.0), "direct"),
    ((True, torch.bfloat16, "renorm", False, 1.0), "direct"),
    ((False, torch.bfloat16, "bucket", False, 1.0), "forward"),
]


@pytest.mark.parametrize("case, kernel", ROUTES)
def test_triton_row_kernel_routes(case, kernel):
    write_grad, dtype, tail, has_ce, temperature = case
    assert fkt.row_kernel_for(write_grad, tail, has_ce, temperature, dtype) == kernel
    hidden, weight, ids, lp, tl, target, mask = _tinputs(5, dtype)
    spec = LossSpec(tail, temperature, 1.0 if tail == "renorm" else temperature, 0.3 if has_ce else 0.0, "sum")
    out = fkt.triton_forward(hidden, weight, ids, lp, tl, target, mask, spec, 8, POISON, False, write_grad, write_grad)
    assert out.row_kernel == kernel and (out.sigma_N is not None) == (kernel == "scaled")
    kw = dict(target_ids=target, mask=mask, tail=tail, temperature=spec.temperature,
              cache_temperature=spec.cache_temperature, ce_weight=spec.ce_weight, reduction="sum")
    want = topk_kl_dense(hidden.float(), weight.float(), ids, lp, tl, **kw)
    torch.testing.assert_close(out.loss_N.sum(), want.float(), rtol=TOL[dtype]["loss"][0], atol=1e-4)
    if write_grad:
        got, want = _triton_vs_dense(dtype, 5, **{k: v for k, v in kw.items() if k not in ("target_ids", "mask")})
        _assert_close(got, want, dtype)


@pytest.mark.parametrize("tail", TAIL_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_k_close_to_vocab(tail, dtype):
    """k = V (bucket: V - 1): the columns outside S are few or none, and no mask."""
    v = 23
    k = v - 1 if tail == "bucket" else v
    got, want = _triton_vs_dense(dtype, k, v=v, chunk_size=5, use_mask=False, tail=tail, ce_weight=0.3,
                                 **_temps(tail, 2.0))
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("tail", TAIL_MODES)
@pytest.mark.parametrize("temperature, ce_weight", [(0.7, 0.5), (1.0, 0.5), (0.7, 0.0)])
def test_triton_vocab_over_several_blocks(tail, temperature, ce_weight):
    """V = 2 blocks + a remainder: the online logsumexp (direct kernel: CE at T != 1, and renorm
    alone) and the running sum (scaled kernel: the other cases) carry across blocks."""
    v = 2 * SMALL_BLOCKS.scaled_block + 811
    got, want = _triton_vs_dense(torch.float32, 7, n=9, v=v, d=16, chunk_size=4, settings=SMALL_BLOCKS, tail=tail,
                                 ce_weight=ce_weight, **_temps(tail, temperature))
    _assert_close(got, want, torch.float32)


@pytest.mark.parametrize("tail, ce_weight", [("bucket", 0.0), ("unnormalized", 0.5)])
def test_triton_scaled_reference_moves_up(tail, ce_weight):
    """A student logit far above every logit on S (by 25 to 80 nats) in the last of several blocks:
    the scaled row kernel raises its reference there and rescales the blocks written before."""
    v = 2 * SMALL_BLOCKS.scaled_block + 811
    hidden, weight, ids, lp, tl, target, _ = _tinputs(7, n=6, v=v, d=16)
    hidden = hidden / hidden.norm(dim=1, keepdim=True)
    hot = v - 5  # in the last block, outside every row's S
    keep = (ids != hot).all(dim=1)
    weight[hot] = hidden[0] * 80.0  # row 0: z = 80 there; other rows: |z| <= 80 |cos|
    lift = (hidden @ weight.T)[:, hot] - (hidden @ weight.T).gather(1, ids.long()).max(dim=1).values
    assert keep.all() and lift[0] > 25, "the case needs row 0's hot logit 25+ nats above its S"
    kw = dict(target_ids=target, tail=tail, ce_weight=ce_weight)
    got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=4, impl="triton",
                          settings=SMALL_BLOCKS, **kw)
    want = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    _assert_close(got, want, torch.float32)


@pytest.mark.parametrize("hidden_grad, weight_grad", [(True, False), (False, True), (False, False)])
def test_triton_only_needed_grads(hidden_grad, weight_grad):
    """Gradients for exactly the inputs that need one: the forward takes no gradient pass without a
    gradient to take, and backward (with d loss != 1) gives the reference's gradients."""
    hidden, weight, ids, lp, tl, target, mask = _tinputs(5)
    kw = dict(target_ids=target, mask=mask, tail="bucket", temperature=2.0, cache_temperature=2.0, ce_weight=0.3)
    spec = LossSpec("bucket", 2.0, 2.0, 0.3, "mean")
    out = fkt.triton_forward(hidden, weight, ids, lp, tl, target, mask, spec, 8, POISON, False, hidden_grad,
                             weight_grad)
    assert (out.grad_h is not None, out.grad_w is not None) == (hidden_grad, weight_grad)
    assert (out.row_kernel == "forward") == (not (hidden_grad or weight_grad)), "a gradient pass without a gradient"
    h = hidden.clone().requires_grad_(hidden_grad)
    w = weight.clone().requires_grad_(weight_grad)
    loss = fused_topk_kl(h, w, ids, lp, tl, chunk_size=8, impl="triton", settings=POISON, **kw)
    _, ref_gh, ref_gw = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    torch.testing.assert_close(loss.detach(), topk_kl_dense(hidden, weight, ids, lp, tl, **kw), rtol=1e-5, atol=1e-6)
    assert loss.requires_grad == (hidden_grad or weight_grad)
    if loss.requires_grad:
        (2.5 * loss).backward()  # grad_output != 1 scales the saved gradients
    for t, ref in ((h, ref_gh), (w, ref_gw)):
        if t.requires_grad:
            torch.testing.assert_close(t.grad, 2.5 * ref, rtol=1e-5, atol=1e-6)
        else:
            assert t.grad is None


def test_triton_no_grad_mode_runs_forward_only():
    """Under no_grad nothing needs a gradient: the call returns the reference's loss without a graph,
    and a per-row loss (refused on this path only when a gradient is needed) comes back."""
    hidden, weight, ids, lp, tl, _, mask = _tinputs(5)
    kw = dict(mask=mask, tail="unnormalized")
    with torch.no_grad():
        loss = fused_topk_kl(hidden.requires_grad_(), weight, ids, lp, tl, impl="triton", settings=POISON, **kw)
        rows = fused_topk_kl(hidden, weight, ids, lp, tl, impl="triton", reduction="none", settings=POISON, **kw)
    assert loss.grad_fn is None and rows.grad_fn is None
    want = topk_kl_dense(hidden.detach(), weight, ids, lp, tl, **kw)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(rows, topk_kl_dense(hidden.detach(), weight, ids, lp, tl, reduction="none", **kw))
    with pytest.raises(ValueError, match="reduction='none' takes no gradient on the Triton path"):
        fused_topk_kl(hidden, weight, ids, lp, tl, impl="triton", reduction="none", **kw)


def test_triton_backward_runs_once():
    hidden, weight, ids, lp, tl, _, _ = _tinputs(5)
    h = hidden.clone().requires_grad_()
    loss = fused_topk_kl(h, weight, ids, lp, tl, impl="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run once"):
        loss.backward()


def test_triton_bf16_grad_weight_accumulation():
    """grad_W summed in bf16 over many chunks (the default) against an fp32 accumulator: 64 chunks
    of one row; the fp32 accumulator leaves only the per-chunk bf16 product rounding."""
    hidden, weight, ids, lp, tl, target, mask = _tinputs(5, torch.bfloat16, n=64)
    kw = dict(target_ids=target, mask=mask, tail="bucket", temperature=2.0, cache_temperature=2.0, ce_weight=0.3)
    _, _, ref = _loss_and_grads(topk_kl_dense, hidden.float(), weight.float(), ids, lp, tl, **kw)
    errs = {}
    for fp32 in (False, True):
        _, _, gw = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=1, impl="triton",
                                   grad_weight_fp32=fp32, **kw)
        assert gw.dtype == torch.bfloat16
        errs[fp32] = ((gw.float() - ref).norm() / ref.norm()).item()
    assert errs[False] < 1.5e-2, errs
    assert errs[True] < 0.6 * errs[False], errs


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the environment, not the module
    args = _kw_valid()  # CPU tensors
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
        fused_topk_kl(**args, impl="triton")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tail", TAIL_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("temperature, ce_weight", [(2.0, 0.3), (1.0, 0.3), (1.0, 0.0)])
def test_triton_on_gpu_matches_dense(tail, dtype, temperature, ce_weight):
    """A real GPU, auto dispatch, default settings, several chunks and Triton blocks, against the
    dense reference (T = 2 with CE, fp16 and renorm alone run the direct row kernel, the others
    the scaled one)."""
    settings = FusedKLSettings()
    hidden, weight, ids, lp, tl, target, mask = (
        t.cuda() for t in _inputs(100, dtype, n=1031, v=2 * settings.direct_block + 77, d=64))
    kw = dict(target_ids=target, mask=mask, tail=tail, ce_weight=ce_weight, **_temps(tail, temperature))
    got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=256, **kw)
    want = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("num_rows, vocab, element_size", [
    (8192, 151_936, 2), (32_768, 151_936, 2), (131_072, 49_152, 2), (8192, 151_936, 4), (37, 1271, 4),
    (100_003, 151_936, 2), (1, 151_936, 2), (12_288, 151_936, 2), (131_072, 151_936, 2),
    (50_000, 4_000_000, 2)])
def test_triton_auto_chunks_are_equal_and_capped(num_rows, vocab, element_size):
    """The automatic chunk: the fewest chunks under the byte cap (rounded down to 1,024 rows), equal
    in size up to rounding to 128 rows (no small last chunk beyond that), never over the cap."""
    budget = FusedKLSettings().triton_chunk_bytes
    rows = fkt.triton_chunk_size(num_rows, vocab, element_size, budget)
    cap = budget // (element_size * vocab)
    assert 1 <= rows <= max(num_rows, 1) and rows * vocab * element_size <= budget
    num_chunks = math.ceil(num_rows / rows)
    step = 1024 if cap >= 1024 else 128 if cap >= 128 else 1
    assert num_chunks == math.ceil(num_rows / (cap // step * step))
    if num_chunks > 1 and cap >= 128:
        assert rows % 128 == 0 and rows - 128 < math.ceil(num_rows / num_chunks) <= rows
    elif num_chunks > 1:  # a huge vocabulary: under 128 rows fit, chunks are equal to the row
        assert rows == math.ceil(num_rows / num_chunks)
    if (num_rows, vocab, element_size) in ((12_288, 151_936, 2), (131_072, 151_936, 2)):
        assert rows == 2048  # the default budget's chunk at this vocabulary (the measured fastest that fits)
