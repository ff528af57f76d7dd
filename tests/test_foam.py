"""kernels.foam_step and student.optim.foam: the Triton step against the torch reference (fp32,
bf16 and fp16, odd sizes over several tiles, misaligned and strided tensors, several steps, weight
decay on and off), FOAM at level 0 against torch's Adam/AdamW, the folded update against
hand-computed numbers, state size, resume, and the param groups of a real Student."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from kernels.foam_step import (FoamStepSettings, foam_launch_key, foam_moment_shape, foam_step, foam_step_cpu,
                               foam_step_torch)
from student.config import StudentConfig
from student.model import Student
from student.optim.build import state_bytes
from student.optim.foam import FOAM, foam_param_groups, foam_state_bytes_formula

# Tolerances in one place. fp32: kernel and reference differ only in summation order of the
# block means and in fused vs separate multiply-adds, a few ulps of values of size ~1.
# bf16 params: both compute the new value in fp32 and round once to nearest even, so they agree
# unless the fp32 values straddle a rounding boundary: at most one bf16 ulp, 2**-7 relative.
TOL_FP32 = dict(atol=1e-6, rtol=1e-6)
TOL_BF16 = dict(atol=0.0, rtol=2**-7)
# Moments: a block mean sums b gradients of size ~1 in another order, so a mean near 0 can be off
# by a few fp32 ulps of the partial sums (~1e-7), far more than its own relative precision.
TOL_MOMENTS = dict(atol=1e-7, rtol=1e-5)

# Odd last dims (1, 3, 7, 33, 130: none a power of two above 1, most no multiple of any block),
# 1, 5 and 64 rows, and 3-D params whose leading dims are flattened as rows.
SHAPES = [(1, 1), (5, 3), (64, 7), (1, 33), (5, 130), (64, 130), (3, 5, 33), (2, 4, 7)]
LEVELS = [0, 1, 2, 4]
NUM_STEPS = 3
# fused=True runs the Triton kernel: on a GPU where there is one, else in Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tiles of a few blocks, so that the small tensors here span several programs: whole tiles without
# masks and a last partial one (the default tile covers each of them in one program). Triton's
# interpreter runs programs one after another, so the tensors that use them are small.
SMALL_TILES = FoamStepSettings(tile_elems=64)


def _grads(shape, num_steps, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(num_steps)]


def _run(params, grads_per_param, num_steps, **foam_kwargs):
    """Step FOAM num_steps times over params with fixed gradients; returns the optimizer."""
    opt = FOAM(params, **foam_kwargs)
    for step in range(num_steps):
        for p, grads in zip(params, grads_per_param):
            p.grad_dtype = None  # let bf16 params take fp32 grads
            p.grad = grads[step].clone()
        opt.step()
    return opt


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("param_dtype,grad_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_step_matches_torch(shape, param_dtype, grad_dtype, weight_decay):
    tol = TOL_FP32 if param_dtype == torch.float32 else TOL_BF16
    gen = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    p0 = torch.randn(shape, generator=gen).to(DEVICE, param_dtype)
    grads = _grads(shape, NUM_STEPS, grad_dtype, seed=shape[-1])
    for level in LEVELS:
        kwargs = dict(lr=3e-2, level=level, weight_decay=weight_decay, scale=0.5, rho=0.7, betas=(0.8, 0.95))
        p_ref, p_tri = p0.clone(), p0.clone()
        opt_ref = _run([p_ref], [grads], NUM_STEPS, fused=False, **kwargs)
        opt_tri = _run([p_tri], [grads], NUM_STEPS, fused=True, **kwargs)
        assert not torch.equal(p_ref, p0), "the reference must move the param, or the comparison is empty"
        torch.testing.assert_close(p_tri, p_ref, **tol, msg=lambda m: f"level {level}: {m}")
        for key in ("exp_avg", "exp_avg_sq"):
            ref, tri = opt_ref.state[p_ref][key], opt_tri.state[p_tri][key]
            assert ref.dtype == tri.dtype == torch.float32
            torch.testing.assert_close(tri, ref, **TOL_MOMENTS, msg=lambda m: f"level {level} {key}: {m}")


@pytest.mark.parametrize("shape,block,chunk", [((40, 33), 4, 100), ((40, 33), 1, 66), ((5, 7, 33), 16, 70),
                                               ((33,), 4, 8), ((9, 64), 4, 1 << 20), ((64, 9), 4, 9)],
                         ids=["slices", "adam", "3d", "vector", "one-slice", "transposed"])
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                    (torch.float16, torch.bfloat16)])
def test_cpu_step_equals_the_reference_bit_for_bit(shape, block, chunk, param_dtype, grad_dtype):
    """The CPU step (the reference on slices of rows) against the reference on the whole tensor:
    params and moments equal after three steps, over slices that end mid-tensor, Adam (block 1), a
    3-d param, a vector, one slice for all, and a strided (transposed) param."""
    gen = torch.Generator().manual_seed(sum(shape) + block)
    param = torch.randn(shape, generator=gen).to(param_dtype)
    if len(shape) == 2 and shape[0] > shape[1]:
        param = param.T.contiguous().T  # a strided view of the same values
    grad = (torch.randn(shape, generator=gen) * 1e-3).to(grad_dtype)
    moment = foam_moment_shape(shape, block)
    state = [torch.rand(moment, generator=gen) * 1e-3, torch.rand(moment, generator=gen) * 1e-6]
    ref_param, ref_state = param.clone(), [t.clone() for t in state]
    for step in (1, 2, 3):
        kw = dict(block=block, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, scale=1.0, rho=0.5,
                  step=step)
        foam_step_torch(ref_param, grad, *ref_state, **kw)
        foam_step_cpu(param, grad, *state, chunk_elements=chunk, **kw)
    for got, want in zip([param, *state], [ref_param, *ref_state]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fused", [False, True])
def test_folded_update_matches_hand_computation(fused):
    """One row, n = 5, level 2: blocks [1, -1, 3, -3] and [2, 0 (pad), 0 (pad), 0 (pad)]."""
    lr, scale, rho, eps, wd = 0.1, 0.25, 0.5, 1e-8, 0.2
    p = torch.zeros(1, 5, device=DEVICE)
    p.grad = torch.tensor([[1.0, -1.0, 3.0, -3.0, 2.0]], device=DEVICE)
    opt = FOAM([p], lr=lr, level=2, scale=scale, rho=rho, eps=eps, weight_decay=wd, fused=fused)
    opt.step()
    g_mean, g2_mean = [0.0, 0.5], [5.0, 1.0]  # block mean of g^2 (the code), not (mean g)^2 = [0, 0.25]
    m = [0.1 * x for x in g_mean]
    v = [0.001 * x for x in g2_mean]
    resid = [1.0, -1.0, 3.0, -3.0, 1.5]
    block_of = [0, 0, 0, 0, 1]
    step_size = lr * math.sqrt(1 - 0.999) / (1 - 0.9)
    expected = []
    for j, r in enumerate(resid):
        big_m, big_v = m[block_of[j]] + rho * r, v[block_of[j]] + rho**2 * r**2
        p_new = -step_size * scale * big_m / (math.sqrt(big_v) + eps)
        expected.append(p_new - lr * wd * p_new)  # decay after the update, on the updated value
    torch.testing.assert_close(opt.state[p]["exp_avg"].cpu(), torch.tensor([m]), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"].cpu(), torch.tensor([v]), atol=1e-9, rtol=1e-6)
    torch.testing.assert_close(p.cpu(), torch.tensor([expected]), atol=1e-7, rtol=1e-6)


# fp16 params: as bf16, rounded once, at most one fp16 ulp (2**-10 relative; 2**-24 below the
# smallest normal).
TOL_FP16 = dict(atol=2**-24, rtol=2**-10)
TOL_BY_DTYPE = {torch.float32: TOL_FP32, torch.bfloat16: TOL_BF16, torch.float16: TOL_FP16}
# The kernel-level comparison: odd shapes spanning several SMALL_TILES programs (n % 8 != 0 and
# == 0), an empty one, and a strided one appended by _kernel_case.
KERNEL_SHAPES = [(3, 37), (2, 3, 11), (5, 16), (1, 1), (0, 8)]


def _view(shape, dtype, aligned, gen):
    """A contiguous tensor of `shape`, random values; when not `aligned`, a view one element into
    its buffer, so its address is 2 or 4 bytes past a 16-byte boundary."""
    offset = 0 if aligned else 1
    buffer = torch.randn(math.prod(shape) + offset, generator=gen).to(DEVICE, dtype)
    return buffer[offset:].view(shape)


def _kernel_case(param_dtype, grad_dtype, aligned, block, num_steps, seed):
    """(params, moments, grads per step) for a foam_step call; the last param a transposed view."""
    gen = torch.Generator().manual_seed(seed)
    params = [_view(shape, param_dtype, aligned, gen) for shape in KERNEL_SHAPES] + [
        _view((6, 4), param_dtype, aligned, gen).t()]
    moments = [[_view(foam_moment_shape(p.shape, block), torch.float32, aligned, gen).abs_() for p in params]
               for _ in range(2)]
    grads = [[_view(p.shape, grad_dtype, aligned, gen) for p in params] for _ in range(num_steps)]
    grads = [[g if p.is_contiguous() else g.reshape(p.shape[::-1]).t() for g, p in zip(step, params)]
             for step in grads]
    return params, moments, grads


# Every dtype pair aligned and misaligned, weight decay on and off (alignment only picks the launch's
# load hints, which the interpreter ignores, so it is not crossed with everything else).
KERNEL_CASES = [
    (torch.float32, torch.float32, True, 0.0), (torch.float32, torch.float32, False, 0.1),
    (torch.bfloat16, torch.bfloat16, True, 0.1), (torch.bfloat16, torch.bfloat16, False, 0.0),
    (torch.bfloat16, torch.float32, False, 0.1), (torch.float16, torch.float16, True, 0.0),
    (torch.float16, torch.float32, False, 0.1),
]


@pytest.mark.parametrize("param_dtype,grad_dtype,aligned,weight_decay", KERNEL_CASES)
def test_foam_step_triton_matches_torch(param_dtype, grad_dtype, aligned, weight_decay):
    """kernels.foam_step itself: impl="triton" against impl="torch" over several steps, with tiles
    small enough that every tensor spans whole and partial programs, aligned and misaligned."""
    for level in (0, 3):
        block = 2**level
        kwargs = dict(block=block, lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=weight_decay,
                      scale=0.5 if block > 1 else 1.0, rho=0.7)
        runs = []
        for impl in ("torch", "triton"):
            params, (exp_avgs, exp_avg_sqs), grads = _kernel_case(param_dtype, grad_dtype, aligned, block, NUM_STEPS,
                                                                  seed=level)
            start = [p.clone() for p in params]
            launch_key = foam_launch_key(params[0], grads[0][0], exp_avgs[0], exp_avg_sqs[0], block, SMALL_TILES)
            assert launch_key[4] == aligned  # the misaligned case takes the unhinted launch
            for step in range(NUM_STEPS):
                foam_step(params, grads[step], exp_avgs, exp_avg_sqs, step=step + 1, impl=impl,
                          settings=SMALL_TILES, **kwargs)
            runs.append((start, params, exp_avgs, exp_avg_sqs))
        (start, ref, ref_m, ref_v), (_, tri, tri_m, tri_v) = runs
        for i, (p0, r, t) in enumerate(zip(start, ref, tri)):
            if r.numel():
                assert not torch.equal(r, p0), "the reference must move the param, or the comparison is empty"
            assert t.stride() == r.stride()  # a strided param is written back in place
            torch.testing.assert_close(t, r, **TOL_BY_DTYPE[param_dtype], msg=lambda m: f"level {level} [{i}]: {m}")
        for name, refs, tris in (("exp_avg", ref_m, tri_m), ("exp_avg_sq", ref_v, tri_v)):
            for i, (r, t) in enumerate(zip(refs, tris)):
                torch.testing.assert_close(t, r, **TOL_MOMENTS, msg=lambda m: f"level {level} {name}[{i}]: {m}")


def test_foam_step_rejects_bad_inputs(monkeypatch):
    p, g, m, v = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 2), torch.zeros(4, 2)
    ok = dict(block=4, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, scale=0.25, rho=1.0, step=1)
    foam_step([p], [g], [m], [v], **ok)  # valid: the torch path on a CPU
    bad = [
        (dict(impl="cuda"), "`impl` must be"),
        (dict(block=3), "`block` must be a power of two"),
        (dict(step=0), "`step` must be an int >= 1"),
        (dict(beta1=1.0), "`beta1` must be"),
        (dict(scale=0.0), "`scale` must be"),
        (dict(settings="small"), "`settings` must be a FoamStepSettings"),
    ]
    for override, match in bad:
        with pytest.raises(ValueError, match=match):
            foam_step([p], [g], [m], [v], **{**ok, **override})
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] must be a contiguous fp32 tensor of shape \(4, 2\)"):
        foam_step([p], [g], [torch.zeros(4, 8)], [v], **ok)
    with pytest.raises(ValueError, match="lists of one length"):
        foam_step([p, p], [g], [m], [v], **ok)
    with pytest.raises(ValueError, match=r"grads\[0\] must be float tensors of one shape"):
        foam_step([p], [torch.zeros(4, 9)], [m], [v], **ok)
    with pytest.raises(ValueError, match="impl='triton' takes fp32, bf16 or fp16"):
        foam_step([p.double()], [g.double()], [m], [v], impl="triton", **ok)
    with pytest.raises(ValueError, match="power of two"):
        FoamStepSettings(tile_elems=48)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
            foam_step([p], [g], [m], [v], impl="triton", **ok)


ADAM_SHAPES = [(5, 7), (33,), (3, 4, 130), (1,)]


def _adam_grads(num_steps=5):
    return [_grads(shape, num_steps, torch.float32, seed=i) for i, shape in enumerate(ADAM_SHAPES)]


def _torch_adam_run(params, grads, num_steps, decay_after=0.0, **kwargs):
    opt = (torch.optim.AdamW if "weight_decay" in kwargs else torch.optim.Adam)(params, foreach=False, **kwargs)
    for step in range(num_steps):
        for p, g in zip(params, grads):
            p.grad = g[step].clone()
        opt.step()
        for p in params:
            p.sub_(p, alpha=decay_after)


# With eps = 0 the interpreter's numpy warns on 0 / 0 in masked-out lanes, which are never stored.
EPS0_WARNING = "ignore:invalid value encountered in divide:RuntimeWarning"


@pytest.mark.filterwarnings(EPS0_WARNING)
@pytest.mark.parametrize("fused", [False, True])
def test_level0_equals_torch_adam(fused):
    """Level 0 (and 1-D params in a folded group) is Adam. torch adds eps to sqrt(v / bc2) where
    FOAM adds it to sqrt(v) and folds sqrt(bc2) into the step, i.e. FOAM's eps is torch's times
    1 / sqrt(bc2) (10x at step 1 with beta2 0.99): visible for gradients near 1e-4, so eps = 0
    here. Weight decay is applied after the step, as the reference does."""
    num_steps, lr, wd = 5, 1e-2, 0.1
    torch.manual_seed(0)
    init = [torch.randn(shape).to(DEVICE) for shape in ADAM_SHAPES]
    grads = _adam_grads(num_steps)
    for foam_wd, decay_after in ((0.0, 0.0), (wd, lr * wd)):
        ours = [x.clone() for x in init]
        # 1-D params in a folded group take plain Adam, and the folded-only scale does not reach them.
        groups = [{"params": ours[:3], "level": 0}, {"params": ours[3:], "level": 4, "scale": 0.25}]
        _run_groups(groups, ours, grads, num_steps, lr=lr, betas=(0.9, 0.99), eps=0.0, scale=1.0,
                    weight_decay=foam_wd, fused=fused)
        theirs = [x.clone() for x in init]
        _torch_adam_run(theirs, grads, num_steps, decay_after=decay_after, lr=lr, betas=(0.9, 0.99), eps=0.0)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, **TOL_FP32)


def _run_groups(groups, params, grads, num_steps, **kwargs):
    opt = FOAM(groups, **kwargs)
    for step in range(num_steps):
        for p, g in zip(params, grads):
            p.grad = g[step].clone()
        opt.step()
    return opt


@pytest.mark.filterwarnings(EPS0_WARNING)
@pytest.mark.parametrize("fused", [False, True])
def test_level0_matches_torch_adamw(fused):
    """AdamW decays before the step, FOAM (like the paper's code) after it: the params differ by
    lr * weight_decay * (the step) per step, at most lr * wd * lr * |u| with |u| < 3 here.
    eps = 0 for the reason given in test_level0_equals_torch_adam."""
    num_steps, lr, wd = 5, 1e-3, 0.1
    torch.manual_seed(1)
    init = [torch.randn(shape).to(DEVICE) for shape in ADAM_SHAPES]
    grads = _adam_grads(num_steps)
    ours = [x.clone() for x in init]
    _run_groups([{"params": ours, "level": 0}], ours, grads, num_steps, lr=lr, eps=0.0, scale=1.0,
                weight_decay=wd, fused=fused)
    theirs = [x.clone() for x in init]
    _torch_adam_run(theirs, grads, num_steps, lr=lr, eps=0.0, weight_decay=wd)
    order_bound = num_steps * lr * wd * lr * 3
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=order_bound + 1e-6, rtol=0)


def _mixed_params():
    """Params that take every route of a fused step: fp32 and bf16, folded and plain, shapes with
    n % block != 0, an empty one, and a strided (transposed) one that takes the per-tensor path."""
    gen = torch.Generator().manual_seed(7)
    specs = [((64, 130), torch.float32), ((5, 33), torch.bfloat16), ((3, 4, 16), torch.float32),
             ((9, 3), torch.float32), ((130,), torch.float32), ((33,), torch.bfloat16), ((0, 8), torch.float32),
             ((16, 64), torch.float32)]
    params = [torch.randn(shape, generator=gen).to(DEVICE, dtype) for shape, dtype in specs]
    params[-1] = params[-1].t()  # [64, 16], not contiguous
    return params


def _mixed_groups(params):
    return [{"params": params[:4], "level": 2, "weight_decay": 0.1},
            {"params": params[4:6], "level": None, "weight_decay": 0.0},
            {"params": params[6:], "level": 3, "scale": 0.5}]


@pytest.mark.parametrize("settings", [None, FoamStepSettings(tile_elems=512)])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_batched_step_matches_torch_over_many_params(set_to_none, settings):
    """Several params per launch, grads that move between steps (zero_grad(set_to_none=True)) or stay,
    a param without a grad at one step (its step count falls behind: a launch of its own after)."""
    num_steps = 4
    gen = torch.Generator().manual_seed(8)
    grads = [[torch.randn(p.shape, generator=gen).to(DEVICE, p.dtype) for _ in range(num_steps)]
             for p in _mixed_params()]
    results = []
    for fused in (False, True):
        params = _mixed_params()
        opt = FOAM(_mixed_groups(params), lr=1e-2, betas=(0.8, 0.95), rho=0.7, fused=fused, settings=settings)
        for step in range(num_steps):
            for i, (p, g) in enumerate(zip(params, grads)):
                if step == 1 and i == 1:
                    p.grad = None
                elif set_to_none or p.grad is None:
                    p.grad = g[step].clone()
                else:
                    p.grad.copy_(g[step])
            opt.step()
        results.append((params, opt))
    (ref_params, ref_opt), (params, opt) = results
    for p_ref, p in zip(ref_params, params):
        tol = TOL_FP32 if p.dtype == torch.float32 else TOL_BF16
        torch.testing.assert_close(p, p_ref, **tol)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[p_ref][key], **TOL_MOMENTS)
        assert opt.state[p]["step"] == ref_opt.state[p_ref]["step"]
    assert opt.state[params[1]]["step"] == num_steps - 1
    # Launches: group 0 fp32 level 2 (n % 4 == 2 and == 0 apart), bf16 level 2 (behind by a step),
    # group 1 fp32 and bf16, group 2 nothing batched (empty and strided params go alone).
    assert len(opt.plans.last.launches) == 5
    tiling = settings or FoamStepSettings()
    assert all(launch.tile_f == tiling.folds_per_tile(launch.block) for _, launch, _ in opt.plans.last.launches)
    assert {id(p) for p, _, _ in opt.plans.last.loose} == {id(params[6]), id(params[7])}


def test_a_plan_is_kept_per_set_of_params_stepped_alone():
    """The offload ring (student/offload/update.py) steps one layer's params at a time, each set of
    them in place again the next step: each set's plan is built once and kept (rebuilding uploads
    tables, whose small copies wait behind the ring's large ones on the copy engine). A state
    replaced by a tensor at another address gets a new plan; every step equals the torch path."""
    gen = torch.Generator().manual_seed(11)
    make = lambda: [torch.randn(shape, generator=gen).to(DEVICE) for shape in ((8, 12), (5, 16), (8, 12), (3, 4))]
    start = make()
    grads = [[torch.randn(p.shape, generator=gen).to(DEVICE) for p in start] for _ in range(3)]
    runs = []
    for fused in (False, True):
        params = [p.clone() for p in start]
        opt = FOAM([{"params": params, "level": 2}], lr=1e-2, fused=fused)
        plans = {0: [], 1: []}
        for step in range(3):
            if step == 2:  # a state moves to another address: its layer's plan is built again
                opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].clone()
            for half in (0, 1):
                for i, p in enumerate(params):
                    p.grad = grads[step][i].clone() if i // 2 == half else None
                opt.step()
                plans[half].append(opt.plans.last)
        runs.append((params, opt, plans))
    (ref, _, _), (params, opt, plans) = runs
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, **TOL_FP32)
    assert plans[0][0] is plans[0][1] and plans[0][2] is not plans[0][1]
    assert plans[1][0] is plans[1][1] is plans[1][2] and plans[1][0] is not plans[0][0]
    assert len(opt.plans) == 3


STATE_SHAPES = [(7,), (1, 1), (5, 3), (64, 130), (3, 5, 33), (2, 4, 7), (16, 64), (9, 17)]


@pytest.mark.parametrize("level", [None, 0, 1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_equal_formula(level, dtype):
    params = [torch.zeros(shape, dtype=dtype) for shape in STATE_SHAPES]
    opt = FOAM(params, level=level, fused=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert state_bytes(opt) == sum(foam_state_bytes_formula(shape, level) for shape in STATE_SHAPES)
    for p, shape in zip(params, STATE_SHAPES):
        exp_avg = opt.state[p]["exp_avg"]
        folded = level and len(shape) >= 2
        n_folded = math.ceil(shape[-1] / 2**level) if folded else shape[-1]
        assert exp_avg.dtype == torch.float32 and exp_avg.shape == shape[:-1] + (n_folded,)
    assert foam_state_bytes_formula((64, 130), 2) == 2 * 4 * 64 * 33  # 130 / 4 -> 33 blocks, last padded


def _resume_params(dtype):
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 33), (3, 4, 7), (64, 130), (7,), (9, 3)]
    return [torch.randn(shape, generator=gen).to(DEVICE, dtype) for shape in shapes]


def _resume_groups(params):
    return [{"params": params[:3], "level": 2}, {"params": params[3:], "level": None, "weight_decay": 0.0}]


def _resume_step(opt, params, grads, step):
    for p, g in zip(params, grads):
        p.grad_dtype = None
        p.grad = g[step].clone()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_state_dict_resume_is_bit_identical(fused, dtype):
    total, saved_at = 6, 3
    kwargs = dict(lr=1e-2, weight_decay=0.05, scale=0.25, fused=fused)
    grads = [_grads(p.shape, total, torch.float32, seed=10 + i) for i, p in enumerate(_resume_params(dtype))]

    straight = _resume_params(dtype)
    opt = FOAM(_resume_groups(straight), **kwargs)
    for step in range(total):
        _resume_step(opt, straight, grads, step)

    first = _resume_params(dtype)
    opt = FOAM(_resume_groups(first), **kwargs)
    for step in range(saved_at):
        _resume_step(opt, first, grads, step)
    buffer = io.BytesIO()
    torch.save({"params": first, "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location=DEVICE)

    resumed = [p.clone() for p in saved["params"]]
    # Other constructor hyperparameters: the loaded param groups must override them.
    opt = FOAM(_resume_groups(resumed), lr=5.0, weight_decay=0.0, scale=1.0, fused=fused)
    opt.load_state_dict(saved["optimizer"])
    for p in resumed:
        assert opt.state[p]["exp_avg"].dtype == torch.float32 and opt.state[p]["exp_avg_sq"].dtype == torch.float32
    for step in range(saved_at, total):
        _resume_step(opt, resumed, grads, step)
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


def _tiny_student(tie: bool) -> Student:
    config = StudentConfig(model_type="qwen2", vocab_size=61, hidden_size=24, intermediate_size=40, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=6, attention_bias=True, tie_word_embeddings=tie)
    return Student(config)


@pytest.mark.parametrize("tie", [True, False])
def test_param_groups_of_student(tie):
    model = _tiny_student(tie)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = foam_param_groups(model, weight_decay=0.1, level=2)
    by_name = {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}
    matrices = {n for n, p in model.named_parameters() if p.ndim >= 2}
    embeddings = {"embed_tokens.weight"} | (set() if tie else {"lm_head.weight"})
    assert by_name["embeddings"] == embeddings
    assert by_name["folded"] == matrices - embeddings
    assert by_name["folded"] and all(".layers." in f".{n}" for n in by_name["folded"])
    assert by_name["no_decay"] == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert any(n.endswith("q_proj.bias") for n in by_name["no_decay"])
    counted = [p for g in groups for p in g["params"]]
    assert len(counted) == len({id(p) for p in counted}) == len(list(model.parameters()))  # tied: once
    hparams = {g["name"]: (g["level"], g["weight_decay"]) for g in groups}
    assert hparams == {"folded": (2, 0.1), "embeddings": (None, 0.1), "no_decay": (None, 0.0)}

    # A real step: folded matrices keep [rows, ceil(n / 4)] moments, the rest full ones.
    opt = FOAM(groups, lr=1e-3, fused=False)
    hidden = model(torch.randint(0, 61, (2, 5)))  # the lm-head is applied by the loss, as in training
    (hidden @ model.lm_head_weight.T).square().mean().backward()
    opt.step()
    for name, p in model.named_parameters():
        expected = p.shape[:-1] + (math.ceil(p.shape[-1] / 4),) if name in by_name["folded"] else p.shape
        assert opt.state[p]["exp_avg"].shape == expected, name

    folded_all = foam_param_groups(model, weight_decay=0.1, level=3, fold_embeddings=True)
    assert {g["name"] for g in folded_all} == {"folded", "no_decay"}
    assert {names[id(p)] for p in folded_all[0]["params"]} == matrices


@pytest.mark.parametrize("kwargs,match", [
    (dict(level=-1), "`level`"), (dict(level=1.5), "`level`"), (dict(level=True), "`level`"),
    (dict(level=17), "`level`"), (dict(level="2"), "`level`"),
    (dict(scale=0.0), "`scale`"), (dict(scale=-0.25), "`scale`"), (dict(scale=float("nan")), "`scale`"),
    (dict(rho=-1.0), "`rho`"), (dict(betas=(0.9, 1.0)), "betas"), (dict(lr=-1e-3), "`lr`"),
    (dict(fused="yes"), "`fused`"),
])
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FOAM([torch.zeros(4, 4)], **kwargs)


def test_bad_group_and_param_group_helper_raise():
    with pytest.raises(ValueError, match=r"`level` must be None or an int in \[0, 16\].*got -2"):
        FOAM([{"params": [torch.zeros(4, 4)], "level": -2}])
    with pytest.raises(ValueError, match="`scale`"):
        foam_param_groups(_tiny_student(True), weight_decay=0.0, level=2, scale=0)
    with pytest.raises(ValueError, match="`level`"):
        foam_param_groups(_tiny_student(True), weight_decay=0.0, level=99)
    with pytest.raises(ValueError, match="`level`"):
        foam_state_bytes_formula((4, 4), -1)


def test_level_change_after_step_raises():
    p = torch.zeros(4, 8)
    opt = FOAM([p], level=2, fused=False)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["level"] = 1
    with pytest.raises(ValueError, match="level cannot change"):
        opt.step()


def test_fused_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="`fused=True` needs CUDA params"):
        FOAM([torch.zeros(4, 4)], fused=True)
    FOAM([torch.zeros(4, 4)], fused=None)  # the torch path needs nothing


def test_state_dict_roundtrip_keeps_fp32_moments_for_bf16_params():
    """torch's loader casts float state to the param dtype; FOAM must undo that for its moments."""
    p = torch.randn(3, 9).bfloat16()
    opt = FOAM([p], level=1, fused=False)
    p.grad = torch.randn(3, 9).bfloat16()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = FOAM([p], level=1, fused=False)
    fresh.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        assert fresh.state[p][key].dtype == torch.float32
        assert torch.equal(fresh.state[p][key], opt.state[p][key])
    assert fresh.state[p]["step"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", [0, 2, 3, 8])
def test_triton_on_gpu_matches_torch_without_param_sized_temporaries(level, dtype):
    """Model-sized odd matrices on a GPU: fused=None picks the kernel, which matches the torch
    reference and allocates nothing of the param's size while it runs."""
    tol = TOL_FP32 if dtype == torch.float32 else TOL_BF16
    for shape in [(1537, 4099), (3, 577, 1031)]:
        p0 = torch.randn(shape, device="cuda").to(dtype)
        grads = [torch.randn(shape, device="cuda").to(dtype) for _ in range(NUM_STEPS)]
        p_ref, p_tri = p0.clone(), p0.clone()
        opt_ref = _run([p_ref], [grads], NUM_STEPS, fused=False, lr=1e-2, level=level, weight_decay=0.1)
        opt_tri = _run([p_tri], [grads], NUM_STEPS, fused=None, lr=1e-2, level=level, weight_decay=0.1)
        torch.testing.assert_close(p_tri, p_ref, **tol)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_tri.state[p_tri][key], opt_ref.state[p_ref][key], **TOL_MOMENTS)
        p_tri.grad = grads[0].clone()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        opt_tri.step()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < p_tri.numel()  # < one byte per element


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_step_has_no_host_sync_and_matches_torch():
    """Once the launches are planned, a step syncs nothing with the host, also when backward puts
    the grads at new addresses (the grad table is uploaded without a sync)."""
    model = _tiny_student(tie=True).cuda()
    groups = foam_param_groups(model, weight_decay=0.1, level=2)
    ref_model = copy.deepcopy(model)
    opt = FOAM(groups, lr=1e-2, fused=None)
    ref_opt = FOAM(foam_param_groups(ref_model, weight_decay=0.1, level=2), lr=1e-2, fused=False)
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    for step in range(4):
        for p, r in zip(params, ref_params):
            p.grad = torch.randn_like(p)  # new tensors, maybe new addresses
            r.grad = p.grad.clone()
        torch.cuda.synchronize()
        if step >= 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref_opt.step()
    assert len(opt.plans.last.launches) == 3 and not opt.plans.last.loose
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, **TOL_FP32)


def test_loading_another_optimizers_state_raises():
    p = torch.zeros(3, 8)
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    sgd.step()
    state = sgd.state_dict()  # {"momentum_buffer": ...}
    state["param_groups"][0].update(level=2, scale=0.25, rho=1.0, betas=(0.9, 0.999), eps=1e-8)
    with pytest.raises(ValueError, match="not a FOAM state dict"):
        FOAM([p], fused=False).load_state_dict(state)
