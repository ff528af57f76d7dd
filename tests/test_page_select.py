"""page_mass (kernels/page_select.py): the Triton path against the torch reference over odd shapes
(queries and pages not multiples of a block, one to three kv heads, two rows), through Triton's
interpreter on the CPU (tests/conftest.py); a GPU test at the 7B's head shape carries `gpu`. The
score is a selection's, computed without gradients, so there is no backward to test."""

from __future__ import annotations

import pytest
import torch

from kernels.page_select import PageSelectSettings, page_mass


def inputs(B, Hkv, T, D, J, dtype=torch.float32, device="cpu", seed=0):
    """Queries summed over a group of 7 heads and mean keys of RoPE'd keys: scores of tens, where a
    softmax is far from uniform."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(B, Hkv, 7, T, D, generator=gen).sum(2) * 0.5).to(dtype)
    mean_k = torch.randn(J, B, Hkv, D, generator=gen)
    return q.to(device), mean_k.to(device)


@pytest.mark.parametrize("B,Hkv,T,D,J", [(1, 1, 1, 16, 1), (1, 2, 37, 16, 5), (2, 1, 64, 32, 70),
                                         (1, 3, 130, 16, 129), (2, 2, 100, 64, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_the_torch_reference(B, Hkv, T, D, J, dtype):
    q, mean_k = inputs(B, Hkv, T, D, J, dtype)
    want = page_mass(q, mean_k, impl="torch")
    got = page_mass(q, mean_k, impl="triton", settings=PageSelectSettings(block_t=32, block_j=16))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # each query's softmax over the pages sums to one: a row's masses sum to its queries x kv heads
    torch.testing.assert_close(got.sum(1), torch.full((B,), float(Hkv * T)), rtol=1e-5, atol=1e-3)


def test_the_torch_path_takes_queries_a_thousand_at_a_time_and_agrees_with_one_softmax():
    q, mean_k = inputs(1, 2, 2500, 16, 9)
    scores = torch.einsum("bhtd,jbhd->bhtj", q.double(), mean_k.double())
    want = scores.softmax(-1).sum((1, 2))
    torch.testing.assert_close(page_mass(q, mean_k, impl="torch").double(), want, rtol=1e-5, atol=1e-4)


def test_a_wrong_shape_or_impl_is_refused():
    q, mean_k = inputs(1, 2, 8, 16, 4)
    with pytest.raises(ValueError, match=r"mean_k must be \[J, 1, 2, 16\]"):
        page_mass(q, mean_k[:, :, :1])
    with pytest.raises(ValueError, match="impl must be one of"):
        page_mass(q, mean_k, impl="cuda")
    q, mean_k = inputs(1, 2, 8, 24, 4)  # a head size tl.dot cannot take: auto takes torch
    with pytest.raises(ValueError, match="power of two >= 16, got 24"):
        page_mass(q, mean_k, impl="triton")
    torch.testing.assert_close(page_mass(q, mean_k), page_mass(q, mean_k, impl="torch"))


@pytest.mark.gpu
def test_gpu_triton_equals_the_torch_reference_at_the_7b_head_shape():
    q, mean_k = inputs(1, 4, 16384, 128, 3000, torch.bfloat16, device="cuda")
    want = page_mass(q, mean_k, impl="torch")
    got = page_mass(q, mean_k, impl="triton")
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-2)
    # the pages picked by either score are the same up to ties within that rounding
    picked = want.gather(1, got.topk(128).indices)
    assert bool((picked >= want.topk(128).values[:, -1:] - 1e-2).all())
