"""The fused loss's generalised Jensen-Shannon divergence (``jsd_beta``): the torch and Triton paths
against the dense autograd reference, the reference against scipy's JSD and against the forward KL
it tends to as beta -> 0, and the arguments it refuses."""

from __future__ import annotations

import pytest
import torch
from scipy.spatial.distance import jensenshannon
from test_fused_topk_kl import POISON, SMALL_BLOCKS, _assert_close, _inputs, _loss_and_grads, _tinputs

import kernels.fused_topk_kl_triton as fkt
from kernels.fused_topk_kl import fused_topk_kl, topk_kl_dense


def bucket_distributions(hidden, weight, ids, lp, tl, temperature=1.0):
    """Per row, teacher and student over the top-k and the tail bucket, float64 [N, k + 1] each."""
    logq = torch.log_softmax((hidden.double() @ weight.double().T) / temperature, dim=-1)
    q_S = logq.exp().gather(1, ids.long())
    student = torch.cat([q_S, (1 - q_S.sum(-1, keepdim=True)).clamp_min(0)], dim=1)
    teacher = torch.cat([lp.double().exp(), tl.double().exp()[:, None]], dim=1)
    return teacher / teacher.sum(-1, keepdim=True), student


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 5, 100])
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("temperature, ce_weight", [(1.0, 0.0), (2.0, 0.3)])
def test_torch_path_matches_dense(dtype, k, beta, temperature, ce_weight):
    hidden, weight, ids, lp, tl, target, mask = _inputs(k, dtype)
    kw = dict(target_ids=target, mask=mask, tail="bucket", ce_weight=ce_weight, temperature=temperature,
              cache_temperature=temperature, jsd_beta=beta)
    got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=8, settings=POISON, **kw)
    want = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    _assert_close(got, want, dtype)


def test_gradcheck_float64():
    hidden, weight, ids, lp, tl, target, mask = _inputs(3, torch.float64, n=5, v=13, d=4)
    kw = dict(target_ids=target, mask=mask, tail="bucket", ce_weight=0.3, chunk_size=2, jsd_beta=0.3)
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, w: fused_topk_kl(h, w, ids, lp, tl, **kw), (hidden, weight))


@pytest.mark.parametrize("impl", ["dense", "torch"])
def test_beta_half_is_scipys_jensen_shannon_divergence(impl):
    """scipy's jensenshannon is the square root of the JSD at beta 1/2 in nats."""
    hidden, weight, ids, lp, tl, _, _ = _inputs(7, torch.float64)
    fn = topk_kl_dense if impl == "dense" else fused_topk_kl
    _, jsd = fn(hidden, weight, ids, lp, tl, tail="bucket", jsd_beta=0.5, reduction="none", return_kl=True)
    teacher, student = bucket_distributions(hidden, weight, ids, lp, tl)
    want = torch.tensor([jensenshannon(p, q) ** 2 for p, q in zip(teacher.numpy(), student.numpy())])
    torch.testing.assert_close(jsd, want, rtol=1e-9, atol=1e-12)


def test_jsd_over_beta_tends_to_the_forward_bucket_kl():
    """JSD_beta / beta = KL(P || Q) - beta chi^2(P || Q) / 2 + O(beta^2) once beta P / Q is small
    everywhere: the gap falls linearly in beta (these students put ~1e-6 where the teacher has mass)."""
    hidden, weight, ids, lp, tl, _, mask = _inputs(5, torch.float64)
    kl = fused_topk_kl(hidden, weight, ids, lp, tl, mask=mask, tail="bucket")
    gap = {beta: float(abs(fused_topk_kl(hidden, weight, ids, lp, tl, mask=mask, tail="bucket", jsd_beta=beta) / beta
                           - kl)) for beta in (1e-6, 1e-8)}
    assert gap[1e-8] <= 1e-5 * kl and 80 <= gap[1e-6] / gap[1e-8] <= 120, gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k, temperature, ce_weight, reduction",
                         [(5, 1.0, 0.0, "mean"), (5, 2.0, 0.3, "sum"), (100, 1.0, 0.3, "mean")])
def test_triton_matches_dense(dtype, k, temperature, ce_weight, reduction):
    """Both gradient routes: the scaled row kernel (fp32 / bf16, CE at T 1 or none) and the direct one
    (fp16; CE at T 2); several vocabulary blocks a row."""
    hidden, weight, ids, lp, tl, target, mask = _tinputs(k, dtype)
    kw = dict(target_ids=target, mask=mask, tail="bucket", ce_weight=ce_weight, temperature=temperature,
              cache_temperature=temperature, reduction=reduction, jsd_beta=0.3)
    got = _loss_and_grads(fused_topk_kl, hidden, weight, ids, lp, tl, chunk_size=8, impl="triton",
                          settings=SMALL_BLOCKS, **kw)
    want = _loss_and_grads(topk_kl_dense, hidden, weight, ids, lp, tl, **kw)
    _assert_close(got, want, torch.bfloat16 if dtype == torch.float16 else dtype)


def test_triton_forward_only_returns_the_jsd():
    hidden, weight, ids, lp, tl, target, mask = _tinputs(5, torch.float32)
    kw = dict(target_ids=target, mask=mask, tail="bucket", jsd_beta=0.7, reduction="none", return_kl=True)
    with torch.no_grad():
        _, got = fused_topk_kl(hidden, weight, ids, lp, tl, impl="triton", settings=POISON, **kw)
        assert fkt.row_kernel_for(False, "bucket", False, 1.0, torch.float32) == "forward"
    _, want = topk_kl_dense(hidden, weight, ids, lp, tl, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(jsd_beta=0.0), r"jsd_beta must be in \(0, 1\)"),
    (dict(jsd_beta=1.0), r"jsd_beta must be in \(0, 1\)"),
    (dict(jsd_beta=True), r"jsd_beta must be in \(0, 1\)"),
    (dict(jsd_beta=0.5, tail="renorm"), "jsd_beta needs tail='bucket' and top-k targets"),
    (dict(jsd_beta=0.5, tail="unnormalized", target_weights="w"), "jsd_beta needs tail='bucket' and top-k targets"),
])
def test_bad_jsd_arguments_raise(change, message):
    hidden, weight, ids, lp, tl, _, _ = _inputs(5, n=6, v=20, d=4)
    args = dict(tail="bucket") | change
    if args.get("target_weights") == "w":
        args["target_weights"] = torch.ones_like(lp)
    for fn in (fused_topk_kl, topk_kl_dense):
        with pytest.raises(ValueError, match=message):
            fn(hidden, weight, ids, lp, tl, **args)
