"""Page attention: both paths against an independent dense check (the table's pages gathered into
contiguous K/V, plain masked softmax attention in fp64, gradients by autograd), forward and
backward, page-set splits merged and summed, in-place gradient accumulation, and the inputs the
engine may hand over (shuffled slots, NaN in unused slots and past the sequence's end). The torch
path runs everywhere; the cuDNN path needs a CUDA device (its tests are marked gpu), and the way
it cuts a set into pieces is checked on the CPU against the visibility rule itself."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.page_attention import (
    _lone_backward,
    _lone_forward,
    _pieces,
    merge_partials,
    page_attention_backward,
    page_attention_forward,
)

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (impl, dtype, GQA group): the torch path in fp32 at groups 1 and 7 and in bf16 at 2; cuDNN takes
# bf16 (and fp16) only, at every group.
PATHS = [("torch", torch.float32, 1), ("torch", torch.float32, 7), ("torch", torch.bfloat16, 2),
         *[pytest.param("cudnn", torch.bfloat16, g, marks=[pytest.mark.gpu, GPU]) for g in (1, 2, 7)]]
# ||got - want|| / ||want|| against the fp64 dense check on the same rounded inputs. The torch path
# computes in fp32 whatever the input dtype: sums in another order, 1e-5 (the exactness
# bar). cuDNN rounds p and ds to bf16 before its tensor-core products, as FlashAttention does, and
# returns bf16 outputs and gradients: relative error up to 2^-8 per element, 2e-2 normwise.
TOL = {("torch", torch.float32): 1e-5, ("torch", torch.bfloat16): 1e-5, ("cudnn", torch.bfloat16): 2e-2}


def rel_err(got, want) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def make_case(*, B=2, Hkv=2, G=2, Tq=37, D=32, P=16, q_start=45, first_page=0, num_pages=None, dtype=torch.float32,
              seed=0):
    """Inputs with the table's slots shuffled among unused slots that hold NaN, and NaN keys and
    values past the sequence's end (position q_start + Tq) in the last page."""
    gen = torch.Generator().manual_seed(seed)
    H = Hkv * G
    end = q_start + Tq
    if num_pages is None:
        num_pages = math.ceil(end / P) - first_page
    S = B * num_pages + 5
    q = torch.randn(B, H, Tq, D, generator=gen).to(dtype)
    k_pool = torch.full((S, Hkv, P, D), float("nan"), dtype=dtype)
    v_pool = torch.full((S, Hkv, P, D), float("nan"), dtype=dtype)
    table = torch.randperm(S, generator=gen)[:B * num_pages].reshape(B, num_pages).to(torch.int32)
    for b in range(B):
        for j in range(num_pages):
            start = (first_page + j) * P
            filled = max(0, min(P, end - start))
            k_pool[table[b, j], :, :filled] = torch.randn(Hkv, filled, D, generator=gen).to(dtype)
            v_pool[table[b, j], :, :filled] = torch.randn(Hkv, filled, D, generator=gen).to(dtype)
    dout = torch.randn(B, H, Tq, D, generator=gen).to(dtype)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, table=table, first_page=first_page, q_start=q_start), dout


def dense(case, dout=None):
    """fp64 (out, lse) and, given dout, (dq, dk_pool, dv_pool) from autograd on contiguous K/V."""
    q, k_pool, v_pool, table = case["q"], case["k_pool"], case["v_pool"], case["table"].long()
    B, H, Tq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    N = table.shape[1]
    key_pos = case["first_page"] * P + torch.arange(N * P)
    mask = key_pos[None, :] <= case["q_start"] + torch.arange(Tq)[:, None]  # [Tq, N*P]
    seen = mask.any(0)
    k = torch.stack([torch.cat([k_pool[table[b, j]] for j in range(N)], dim=1) for b in range(B)]).double()
    v = torch.stack([torch.cat([v_pool[table[b, j]] for j in range(N)], dim=1) for b in range(B)]).double()
    k = k.masked_fill(~seen[None, None, :, None], 0.0).requires_grad_()  # unseen keys: NaN in the pool
    v = v.masked_fill(~seen[None, None, :, None], 0.0).requires_grad_()
    qd = q.double().requires_grad_()
    k_h = k.repeat_interleave(H // Hkv, dim=1)
    v_h = v.repeat_interleave(H // Hkv, dim=1)
    s = (qd @ k_h.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~mask, -1e30)  # finite, so rows that see nothing keep finite gradients
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(mask, torch.exp(s - lse[..., None]), 0.0)
    out = p @ v_h
    lse = torch.where(mask.any(-1), lse, float("-inf"))
    if dout is None:
        return out.detach(), lse.detach()
    dq, dk, dv = torch.autograd.grad((out * dout.double()).sum(), (qd, k, v))
    dk_pool = torch.zeros(k_pool.shape, dtype=torch.float64)
    dv_pool = torch.zeros(k_pool.shape, dtype=torch.float64)
    for b in range(B):
        for j in range(N):
            dk_pool[table[b, j]] = dk[b, :, j * P:(j + 1) * P]
            dv_pool[table[b, j]] = dv[b, :, j * P:(j + 1) * P]
    return out.detach(), lse.detach(), dq, dk_pool, dv_pool


def check_lse(got, want):
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "rows that see no key must get lse = -inf, only they"
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite].double(), want[finite], atol=1e-4, rtol=1e-4)


def on(impl, *tensors):
    device = "cuda" if impl == "cudnn" else "cpu"
    return [t.to(device) for t in tensors]


def forward(case, impl):
    q, k_pool, v_pool, table = on(impl, case["q"], case["k_pool"], case["v_pool"], case["table"])
    out, lse = page_attention_forward(q, k_pool, v_pool, table, first_page=case["first_page"],
                                      q_start=case["q_start"], impl=impl)
    return out.cpu(), lse.cpu()


def backward(case, dout, out, lse, dk_pool, dv_pool, impl):
    """dq; adds into the CPU pools dk_pool, dv_pool (through a device copy for the GPU)."""
    args = on(impl, case["q"], dout, out, lse, case["k_pool"], case["v_pool"], dk_pool, dv_pool, case["table"])
    dq = page_attention_backward(*args, first_page=case["first_page"], q_start=case["q_start"], impl=impl)
    dk_pool.copy_(args[6])
    dv_pool.copy_(args[7])
    return dq.cpu()


CASES = {
    # Tq odd, q_start not page aligned, the pages up to the last query's
    "unaligned": dict(q_start=45),
    "q_start0": dict(q_start=0, Tq=33),
    # the table starts at page 2 (first keys at 32): queries 0..2 see none of it (lse -inf)
    "subset": dict(q_start=29, first_page=2, num_pages=3),
    "head_dim24": dict(q_start=20, D=24, Tq=21),
    # a chunk of one token: its past keys, then itself alone (a piece of one query and one key)
    "one_query": dict(q_start=7, Tq=1),
}


@pytest.mark.parametrize("impl, dtype, group", PATHS)
@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward_match_dense(impl, dtype, group, name):
    case, dout = make_case(G=group, Hkv=1 if group == 7 else 2, dtype=dtype, **CASES[name])
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref = dense(case, dout)
    out, lse = forward(case, impl)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, out_ref) < TOL[impl, dtype]
    check_lse(lse, lse_ref)
    if name == "subset":
        assert torch.isinf(lse).any() and (out[torch.isinf(lse)] == 0).all()
    # pre-filled pools: the kernel adds; unused slots hold a value the test sees unchanged
    gen = torch.Generator().manual_seed(1)
    dk_pool0 = torch.randn(case["k_pool"].shape, generator=gen)
    dv_pool0 = torch.randn(case["k_pool"].shape, generator=gen)
    dk_pool, dv_pool = dk_pool0.clone(), dv_pool0.clone()
    dq = backward(case, dout, out, lse, dk_pool, dv_pool, impl)
    assert dq.dtype == torch.float32 and dq.shape == case["q"].shape
    assert rel_err(dq, dq_ref) < TOL[impl, dtype]
    assert rel_err(dk_pool - dk_pool0, dk_ref) < TOL[impl, dtype]
    assert rel_err(dv_pool - dv_pool0, dv_ref) < TOL[impl, dtype]
    unused = torch.ones(case["k_pool"].shape[0], dtype=torch.bool)
    unused[case["table"].long().flatten()] = False
    assert torch.equal(dk_pool[unused], dk_pool0[unused]) and torch.equal(dv_pool[unused], dv_pool0[unused])
    assert torch.isfinite(dk_pool).all() and torch.isfinite(dv_pool).all() and torch.isfinite(dq).all()


@pytest.mark.parametrize("impl, dtype", [("torch", torch.float32),
                                         pytest.param("cudnn", torch.bfloat16, marks=[pytest.mark.gpu, GPU])])
@pytest.mark.parametrize("splits", [[2], [1, 3]], ids=["2sets", "3sets"])
def test_page_set_splits_merge_and_sum_to_the_whole(impl, dtype, splits):
    """Forward over page sets merged = the whole; backward per set with the merged out/lse summed
    = the whole's dq, dk, dv. The last set starts past some queries (their lse there is -inf)."""
    case, dout = make_case(G=2, q_start=13, Tq=37, P=16, dtype=dtype)  # pages 0..3, queries at 13..49
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref = dense(case, dout)
    bounds = [0, *splits, case["table"].shape[1]]
    sets = [dict(case, table=case["table"][:, a:b].contiguous(), first_page=a) for a, b in zip(bounds, bounds[1:])]
    parts = [forward(s, impl) for s in sets]
    assert torch.isinf(parts[-1][1]).any()
    out, lse = merge_partials(parts)
    assert rel_err(out, out_ref) < TOL[impl, dtype]
    check_lse(lse, lse_ref)
    dk_pool = torch.zeros(case["k_pool"].shape)
    dv_pool = torch.zeros(case["k_pool"].shape)
    dq = sum(backward(s, dout, out.to(dtype), lse, dk_pool, dv_pool, impl) for s in sets)
    assert rel_err(dq, dq_ref) < TOL[impl, dtype]
    assert rel_err(dk_pool, dk_ref) < TOL[impl, dtype]
    assert rel_err(dv_pool, dv_ref) < TOL[impl, dtype]


@pytest.mark.parametrize("group", [1, 3])
def test_a_piece_of_one_query_and_one_key_matches_dense(group):
    """cuDNN refuses a piece of one query and one key, so the cuDNN path computes that piece in
    plain torch; checked here on the CPU. A chunk of one token at position 7: keys 0..6 (zero, so
    their share of dq is zero and the softmax over all eight stays non-trivial) and its own key 7
    alone, the 1 x 1 piece. Forward: the piece merged with the zero keys' part is the whole;
    backward, with the whole's out and lse: dq is the dense one, key 7's dk and dv are too."""
    case, dout = make_case(G=group, Hkv=2, Tq=1, q_start=7)
    assert _pieces(1, 0, 16, 7) == [(0, 1, 0, 7, False), (0, 1, 7, 8, True)]
    slots = case["table"].long()[:, 0]
    case["k_pool"][slots, :, :7] = 0.0
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref = dense(case, dout)
    k, v = case["k_pool"][slots][:, :, 7:8], case["v_pool"][slots][:, :, 7:8]  # [B, Hkv, 1, D]
    scale = 1 / math.sqrt(k.shape[-1])
    out, lse = _lone_forward(case["q"], k, v, scale)
    zero_keys = (case["v_pool"][slots][:, :, :7].mean(2, keepdim=True).repeat_interleave(group, dim=1),
                 torch.full(lse.shape[:3], math.log(7.0)))
    out_all, lse_all = merge_partials([zero_keys, (out, lse.squeeze(-1))])
    assert rel_err(out_all, out_ref) < 1e-6
    check_lse(lse_all, lse_ref)
    dq, dk, dv = _lone_backward(dout, case["q"], k, v, out_ref.float(), lse_ref.float(), scale)
    assert rel_err(dq, dq_ref) < 1e-5
    assert rel_err(dk, dk_ref[slots][:, :, 7:8]) < 1e-5
    assert rel_err(dv, dv_ref[slots][:, :, 7:8]) < 1e-5


@pytest.mark.parametrize("Tq, first_pos, num_keys, q_start", [
    (7, 0, 16, 0), (7, 0, 48, 40), (37, 16, 32, 13), (37, 32, 32, 13), (5, 0, 64, 64), (9, 48, 16, 40),
    (9, 0, 16, 40), (20, 32, 16, 13)])
def test_pieces_cover_exactly_the_visible_pairs_once(Tq, first_pos, num_keys, q_start):
    """The cuDNN path's cut of a set: every (query, key) pair with key position <= the query's is
    in exactly one piece, no other pair is in any, and causal pieces are squares whose diagonal
    is the visibility edge (cuDNN's causal mask is the top-left one)."""
    count = torch.zeros(Tq, num_keys, dtype=torch.int64)
    for t0, t1, k0, k1, causal in _pieces(Tq, first_pos, num_keys, q_start):
        block = torch.ones(t1 - t0, k1 - k0, dtype=torch.int64)
        if causal:
            assert t1 - t0 == k1 - k0 and first_pos + k0 == q_start + t0
            block = block.tril()
        count[t0:t1, k0:k1] += block
    visible = (first_pos + torch.arange(num_keys))[None, :] <= (q_start + torch.arange(Tq))[:, None]
    assert torch.equal(count, visible.long())


def test_merge_partials_of_nothing_is_minus_inf_and_zero():
    out = torch.zeros(1, 2, 3, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    got_out, got_lse = merge_partials([(out, lse), (out.clone(), lse.clone())])
    assert torch.equal(got_out, out) and torch.isinf(got_lse).all()


@pytest.mark.parametrize("change, message", [
    (dict(q=torch.zeros(1, 3, 5, 16)), "multiple of the kv heads"),
    (dict(table=torch.zeros(1, 2, dtype=torch.float32)), "table must be int32"),
    (dict(table=torch.full((1, 2), 9, dtype=torch.int32)), "table slots must be in"),
    (dict(first_page=-1), "first_page must be an int >= 0"),
    (dict(k_pool=torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)), "share one of"),
    (dict(impl="cuda"), "impl must be one of"),
    (dict(impl="cudnn"), "needs bf16/fp16 CUDA tensors"),
])
def test_bad_arguments_are_one_line_errors(change, message):
    args = dict(q=torch.zeros(1, 4, 5, 16), k_pool=torch.zeros(4, 2, 16, 16), v_pool=torch.zeros(4, 2, 16, 16),
                table=torch.zeros(1, 2, dtype=torch.int32), first_page=0, q_start=0)
    args.update(change)
    with pytest.raises(ValueError, match=message) as info:
        page_attention_forward(**args)
    assert "\n" not in str(info.value)
