"""kernels.topk_logprobs against a dense fp32 log-softmax over the whole vocabulary."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels.topk_logprobs import TopkSettings, topk_logprobs
from teacher_cache.targets import tail_logmass_from_topk

# Absolute tolerances on log-probabilities, in one place. fp32: the kernel scales by 1/T where the
# reference divides, and sums in another order: ~1e-6 apart. bf16: the logits are rounded to bf16
# by the matmul in both; a chunk's matmul may accumulate in another order than the whole one, so
# a logit can differ by one bf16 ulp, 2**-7 relative, i.e. <= 0.03 for |logit / T| < 4.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# Shapes: odd and prime sizes, a vocabulary that is no multiple of any block size.
N, V, D = 37, 1271, 41
# Every output starts as NaN (ids as -1): an element a path should write and does not fails.
POISON = TopkSettings(poison=True)


def _inputs(dtype, n=N, v=V, d=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen) / math.sqrt(d)
    weight = torch.randn(v, d, generator=gen) * 1.5  # logits of std ~1.5: a peaked but not one-hot softmax
    next_ids = torch.randint(0, v, (n,), generator=gen)
    next_ids[::5] = -1  # rows with no next token, as the last row of every sequence
    return hidden.to(dtype), weight.to(dtype), next_ids


def _dense_logprobs(hidden, weight, temperature):
    """[N, V] fp32 log-softmax of the logits as the kernel computes them (matmul in input dtype)."""
    return torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)


def _check_against_dense(hidden, weight, next_ids, k, temperature, out):
    topk_ids, topk_lp, tail, target = out
    atol = ATOL[hidden.dtype]
    ref_NV = _dense_logprobs(hidden, weight, temperature)
    n = hidden.shape[0]
    assert topk_ids.shape == (n, k) and topk_ids.dtype == torch.int32
    assert topk_lp.shape == (n, k) and topk_lp.dtype == torch.float32
    assert tail.shape == (n,) and target.shape == (n,)
    # Values: the k largest of the dense row, in descending order.
    torch.testing.assert_close(topk_lp, ref_NV.topk(k, dim=-1).values, atol=atol, rtol=0)
    assert (topk_lp[:, 1:] <= topk_lp[:, :-1]).all()
    # Ids: each returned id carries its own dense log-prob (robust to ties), and no id repeats.
    torch.testing.assert_close(ref_NV.gather(1, topk_ids.long()), topk_lp, atol=atol, rtol=0)
    sorted_ids = topk_ids.sort(dim=-1).values
    assert (sorted_ids[:, 1:] != sorted_ids[:, :-1]).all()
    # Tail: 1 - (top-k mass of the dense row), compared as a probability.
    tail_mass_ref = 1.0 - ref_NV.gather(1, topk_ids.long()).double().exp().sum(-1)
    torch.testing.assert_close(tail.double().exp(), tail_mass_ref.clamp_min(1e-12), atol=atol, rtol=0)
    # Targets: the dense log-prob of the next token, NaN where there is none.
    has_next = next_ids >= 0
    assert torch.isnan(target[~has_next]).all()
    expected = ref_NV[has_next].gather(1, next_ids[has_next][:, None])[:, 0]
    torch.testing.assert_close(target[has_next], expected, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 5, V])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("chunk_size", [None, 5, 16])  # 5 and 16 do not divide N=37
def test_matches_dense_reference(dtype, k, temperature, chunk_size):
    hidden, weight, next_ids = _inputs(dtype)
    out = topk_logprobs(hidden, weight, k, next_ids, temperature=temperature, chunk_size=chunk_size, settings=POISON)
    _check_against_dense(hidden, weight, next_ids, k, temperature, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 7, 20])  # 20 = ceil(1271 / 64), the most the Triton path takes
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_triton_matches_dense_reference(dtype, k, temperature, chunk_size):
    """The GPU path, run by the Triton interpreter on the CPU (TRITON_INTERPRET=1, see conftest)."""
    hidden, weight, next_ids = _inputs(dtype, seed=k)
    out = topk_logprobs(hidden, weight, k, next_ids, temperature=temperature, chunk_size=chunk_size, impl="triton",
                        settings=POISON)
    _check_against_dense(hidden, weight, next_ids, k, temperature, out)


@pytest.mark.parametrize("settings", [POISON, TopkSettings(poison=True, sub=16, tile=256)], ids=["default", "small"])
def test_triton_vocab_spanning_several_tiles_and_ties(settings):
    # 4,999 columns: three 2,048-wide tiles (20 of 256 with the small settings), the last one
    # partial; duplicated weight rows give exactly tied logits, which may fall on either side of a
    # block boundary.
    hidden, weight, next_ids = _inputs(torch.float32, n=9, v=4999, d=17)
    weight[4000:4100] = weight[0:100]
    out = topk_logprobs(hidden, weight, 60, next_ids, impl="triton", settings=settings)
    _check_against_dense(hidden, weight, next_ids, 60, 1.0, out)


def test_triton_refuses_k_above_candidate_blocks():
    hidden, weight, next_ids = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"needs k <= ceil\(vocab_size / 64\) = 20, got 21"):
        topk_logprobs(hidden, weight, 21, next_ids, impl="triton")
    with pytest.raises(ValueError, match=r"needs k <= ceil\(vocab_size / 128\) = 10, got 11"):
        topk_logprobs(hidden, weight, 11, next_ids, impl="triton", settings=TopkSettings(sub=128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_unchunked(dtype):
    hidden, weight, next_ids = _inputs(dtype)
    whole = topk_logprobs(hidden, weight, 7, next_ids, temperature=0.8, chunk_size=N)
    for chunk_size in (1, 3, 36):
        chunked = topk_logprobs(hidden, weight, 7, next_ids, temperature=0.8, chunk_size=chunk_size, settings=POISON)
        for a, b in zip(whole[1:], chunked[1:]):
            torch.testing.assert_close(a, b, atol=ATOL[dtype], rtol=0, equal_nan=True)


def test_tiny_shapes_and_full_vocabulary_tail():
    hidden, weight, next_ids = _inputs(torch.float32, n=1, v=7, d=3)
    out = topk_logprobs(hidden, weight, 7, next_ids)
    _check_against_dense(hidden, weight, next_ids, 7, 1.0, out)
    # k = V: the top-k holds all the mass, so the tail is (numerically) empty.
    assert out[2].item() < math.log(1e-5)


def test_tail_agrees_with_cache_helper():
    hidden, weight, next_ids = _inputs(torch.float32)
    _, topk_lp, tail, _ = topk_logprobs(hidden, weight, 20, next_ids)
    np.testing.assert_allclose(tail.numpy(), tail_logmass_from_topk(topk_lp.numpy()), atol=1e-5)


def test_no_targets_and_int32_next_ids():
    hidden, weight, next_ids = _inputs(torch.float32)
    assert torch.isnan(topk_logprobs(hidden, weight, 3)[3]).all()
    assert torch.isnan(topk_logprobs(hidden, weight, 3, impl="triton")[3]).all()
    a = topk_logprobs(hidden, weight, 3, next_ids)[3]
    b = topk_logprobs(hidden, weight, 3, next_ids.to(torch.int32))[3]
    torch.testing.assert_close(a, b, equal_nan=True)


def test_does_not_track_gradients():
    hidden, weight, next_ids = _inputs(torch.float32)
    out = topk_logprobs(hidden.requires_grad_(), weight, 3, next_ids)
    assert not any(t.requires_grad for t in out)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), f"k must be in [1, vocab_size={V}], got 0"),
        (dict(k=V + 1), f"k must be in [1, vocab_size={V}], got {V + 1}"),
        (dict(temperature=0.0), "temperature must be a positive finite number, got 0.0"),
        (dict(chunk_size=0), "chunk_size must be a positive int or None, got 0"),
        (dict(impl="cuda"), "impl must be 'auto', 'torch' or 'triton', got 'cuda'"),
        (dict(next_ids=torch.full((N,), V)), f"next_ids must be in [0, vocab_size={V}) or -1"),
        (dict(next_ids=torch.zeros(N + 1, dtype=torch.long)), "next_ids must have shape [N]"),
        (dict(next_ids=torch.zeros(N)), "next_ids must be int32 or int64, got torch.float32"),
        (dict(weight=torch.zeros(V, D + 1)), f"hidden width {D} does not match weight width {D + 1}"),
        (dict(weight=torch.zeros(V, D, dtype=torch.bfloat16)), "hidden and weight must share a dtype"),
        (dict(hidden=torch.zeros(2, 3, D)), "hidden must be [N, d] and weight [V, d]"),
        (dict(settings={"sub": 32}), "settings must be a TopkSettings or None, got dict"),
    ],
)
def test_rejects_bad_inputs(kwargs, message):
    hidden, weight, next_ids = _inputs(torch.float32)
    args = dict(hidden=hidden, weight=weight, k=5, next_ids=next_ids) | kwargs
    with pytest.raises(ValueError) as info:
        topk_logprobs(**args)
    assert message in str(info.value)


@pytest.mark.parametrize("change, field", [(dict(sub=48), "sub"), (dict(sub=64, tile=32), "tile"),
                                           (dict(torch_chunk_bytes=0), "torch_chunk_bytes")])
def test_bad_settings_raise(change, field):
    with pytest.raises(ValueError, match=f"`{field}` must be"):
        TopkSettings(**change)
