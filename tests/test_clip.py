"""student.optim.clip: clip_grad_norm_foreach equals torch.nn.utils.clip_grad_norm_ (norm and scaled
grads) for fp32 and mixed fp32/bf16 grads, params without grads and max_norm=inf; a non-finite
norm is returned with the grads left untouched; no host sync on CUDA."""

from __future__ import annotations

import pytest
import torch

from student.optim.clip import clip_grad_norm_foreach

# fp32 grads: same per-tensor norms as torch, so only summation order differs.
FP32_RTOL = 1e-6
# torch rounds each bf16 grad's norm to bf16 (8 mantissa bits) before summing; we keep it in fp32.
BF16_NORM_RTOL = 2 ** -8
# So the coefficients differ by up to that much, which can round a bf16 grad to its neighbour.
BF16_ULP_RTOL = 2 ** -7


def make_params(dtypes, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(41, 13), (7,), (3, 5, 11), (1,), (257,)]
    params = []
    for i, dtype in enumerate(dtypes):
        p = torch.nn.Parameter(torch.randn(shapes[i % len(shapes)], generator=gen).to(device, dtype))
        if dtype is not None:
            p.grad = (torch.randn(p.shape, generator=gen) * (i + 1)).to(device, p.dtype)
        params.append(p)
    return params


def clone_grads(params):
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(clones, params):
        c.grad = None if p.grad is None else p.grad.clone()
    return clones


def upcast(params):
    """fp32 copies of params and grads: torch's clip on these is exact to fp32 rounding."""
    copies = [torch.nn.Parameter(p.detach().float()) for p in params]
    for c, p in zip(copies, params):
        c.grad = None if p.grad is None else p.grad.to(torch.float32, copy=True)
    return copies


def fp64_norm(params):
    return torch.stack([p.grad.double().norm() for p in params if p.grad is not None]).norm()


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 1e6])
def test_fp32_equals_torch(max_norm):
    ours = make_params([torch.float32] * 5)
    ref = clone_grads(ours)
    norm = clip_grad_norm_foreach(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert norm.dtype == torch.float32 and norm.shape == ()
    torch.testing.assert_close(norm, ref_norm, rtol=FP32_RTOL, atol=0)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=FP32_RTOL, atol=0)
    if max_norm == 1e6:  # no clipping: grads keep their exact values
        assert all(torch.equal(p.grad, r.grad) for p, r in zip(ours, ref))
    else:
        clipped = torch.stack([p.grad.double().norm() for p in ours]).norm()
        assert clipped.item() == pytest.approx(max_norm, rel=1e-5)


def mixed_params():
    # bf16 and fp32 grads, and two params without a grad (dtype None leaves .grad unset).
    params = make_params([torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16])
    params += make_params([torch.float32], seed=1)
    params[2].grad = None
    params[-1].grad = None
    return params


@pytest.mark.parametrize("max_norm", [1.0, 1e6])
def test_mixed_fp32_bf16_and_missing_grads_equal_torch(max_norm):
    ours = mixed_params()
    ref = clone_grads(ours)
    exact = upcast(ours)
    expected_norm = fp64_norm(ours)
    norm = clip_grad_norm_foreach(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    exact_norm = torch.nn.utils.clip_grad_norm_(exact, max_norm)

    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, ref_norm.float(), rtol=BF16_NORM_RTOL, atol=0)
    torch.testing.assert_close(norm, exact_norm, rtol=FP32_RTOL, atol=0)
    assert norm.double().item() == pytest.approx(expected_norm.item(), rel=1e-6)
    for p, r, e in zip(ours, ref, exact):
        if r.grad is None:
            assert p.grad is None
            continue
        assert p.grad.dtype == r.grad.dtype
        # Scaling by the fp32-exact coefficient, then rounding to the grad's dtype.
        torch.testing.assert_close(p.grad, e.grad.to(p.grad.dtype), rtol=FP32_RTOL, atol=0)
        torch.testing.assert_close(p.grad.float(), r.grad.float(), rtol=BF16_ULP_RTOL, atol=0)


def test_max_norm_inf_only_measures():
    ours = mixed_params()
    before = clone_grads(ours)
    norm = clip_grad_norm_foreach(ours, float("inf"))
    ref_norm = torch.nn.utils.clip_grad_norm_(clone_grads(ours), float("inf"))
    torch.testing.assert_close(norm, ref_norm.float(), rtol=BF16_NORM_RTOL, atol=0)
    assert norm.double().item() == pytest.approx(fp64_norm(ours).item(), rel=1e-6)
    for p, b in zip(ours, before):
        assert (p.grad is None and b.grad is None) or torch.equal(p.grad, b.grad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_grad_returns_norm_and_leaves_grads_untouched(bad):
    ours = mixed_params()
    ours[1].grad[3] = bad
    before = clone_grads(ours)
    norm = clip_grad_norm_foreach(ours, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(clone_grads(ours), 1.0)
    assert norm.isnan() if bad != bad else norm.isinf()
    assert ref_norm.isnan() if bad != bad else ref_norm.isinf()  # torch agrees on the norm...
    for p, b in zip(ours, before):  # ...but, unlike torch, the grads keep their values
        assert (p.grad is None and b.grad is None) or torch.equal(p.grad.nan_to_num(), b.grad.nan_to_num())


def test_error_if_nonfinite_raises_like_torch():
    ours = make_params([torch.float32] * 3)
    ours[0].grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite|nan"):
        torch.nn.utils.clip_grad_norm_(clone_grads(ours), 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="total norm of the gradients is nan"):
        clip_grad_norm_foreach(ours, 1.0, error_if_nonfinite=True)
    finite = make_params([torch.float32] * 3)
    assert clip_grad_norm_foreach(finite, 1.0, error_if_nonfinite=True).isfinite()


def test_no_grads_single_tensor_and_bad_max_norm():
    params = make_params([None, None])
    assert torch.equal(clip_grad_norm_foreach(params, 1.0), torch.tensor(0.0))
    single = make_params([torch.float32])[0]
    expected = single.grad.norm()
    torch.testing.assert_close(clip_grad_norm_foreach(single, 1e6), expected, rtol=FP32_RTOL, atol=0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="`max_norm` must be > 0"):
            clip_grad_norm_foreach(make_params([torch.float32]), bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_no_host_sync_and_equals_torch():
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in mixed_params()]
    for o, p in zip(ours, mixed_params()):
        o.grad = None if p.grad is None else p.grad.cuda()
    exact = upcast(ours)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = clip_grad_norm_foreach(ours, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exact_norm = torch.nn.utils.clip_grad_norm_(exact, 1.0)
    assert norm.device.type == "cuda"
    torch.testing.assert_close(norm, exact_norm, rtol=1e-5, atol=0)
    for p, e in zip(ours, exact):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, e.grad.to(p.grad.dtype), rtol=1e-5, atol=0)
