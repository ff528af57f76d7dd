"""gather_rows / scatter_rows (kernels/page_rows.py): the Triton path against the torch reference over
odd shapes (a row not a multiple of a block, one to many rows, an empty index), bf16 and fp32 pools,
through Triton's interpreter on the CPU (tests/conftest.py); the GPU tests (`gpu`) read and write a
pinned host pool from the device, the path offloaded sparse pages take. Copies: equal exactly."""

from __future__ import annotations

import pytest
import torch

from kernels.page_rows import RowCopySettings, gather_rows, scatter_rows

SMALL = RowCopySettings(block=64, num_warps=1)  # several blocks a row at these shapes, and a ragged last one


def pool_of(rows, shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, *shape, generator=gen).to(dtype)


@pytest.mark.parametrize("rows,shape,index", [(1, (3,), [0]), (5, (2, 7, 9), [4, 0, 4, 2]),
                                              (9, (1, 64, 3), [8, -1, 3, -1, 0]), (4, (130,), [])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_equals_the_reference_and_reads_zeros_for_a_negative_index(rows, shape, index, dtype):
    pool = pool_of(rows, shape, dtype)
    at = torch.tensor(index, dtype=torch.long)
    want = gather_rows(pool, at, impl="torch")
    got = gather_rows(pool, at, impl="triton", settings=SMALL)
    assert got.shape == (len(index), *shape) and got.dtype == dtype
    assert torch.equal(got, want)
    for i, j in enumerate(index):  # the reference is what it says
        assert torch.equal(want[i], pool[j] if j >= 0 else torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("rows,shape,index", [(1, (3,), [0]), (6, (2, 7, 9), [5, 0, 2]), (4, (130,), [])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_equals_the_reference_and_leaves_other_rows(rows, shape, index, dtype):
    at = torch.tensor(index, dtype=torch.long)
    src = pool_of(len(index), shape, dtype, seed=1)
    want, got = pool_of(rows, shape, dtype), pool_of(rows, shape, dtype)
    scatter_rows(want, at, src, impl="torch")
    scatter_rows(got, at, src, impl="triton", settings=SMALL)
    assert torch.equal(got, want)
    untouched = [r for r in range(rows) if r not in index]
    assert torch.equal(want[untouched], pool_of(rows, shape, dtype)[untouched])
    assert all(torch.equal(want[j], src[i]) for i, j in enumerate(index))


def test_wrong_arguments_are_refused():
    pool = pool_of(4, (8,), torch.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        gather_rows(pool, torch.tensor([0]), impl="cuda")
    with pytest.raises(ValueError, match="1-d int64"):
        gather_rows(pool, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"src must be torch.float32 \[2, 8\]"):
        scatter_rows(pool, torch.tensor([0, 1]), pool_of(2, (7,), torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(pool.t(), torch.tensor([0]))


def test_auto_takes_torch_for_pools_on_the_index_device():
    """On the CPU (no pinned pool, no CUDA index) auto is the reference: the store's CPU path."""
    pool, at = pool_of(5, (3, 4), torch.float32), torch.tensor([2, -1])
    assert torch.equal(gather_rows(pool, at), gather_rows(pool, at, impl="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", ["torch", "registered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_a_pinned_host_pool_read_and_written_from_the_device(dtype, pinned):
    """The offloaded store's case at the 7B's page shape: a pinned host pool (torch's pinned
    allocator, or ordinary memory page-locked in place as student/pinned.py's pools are), a CUDA
    index; the gather is ordered after a non-blocking copy into the pool on the same stream."""
    from student.pinned import host_empty, unpin

    shape = (4, 64, 128)
    pool = pool_of(300, shape, dtype).pin_memory()
    if pinned == "registered":
        pool = host_empty(pool.shape, dtype, pin=True).copy_(pool)
    fresh = pool_of(2, shape, dtype, seed=3).cuda()
    pool[10:12].copy_(fresh, non_blocking=True)  # the store's page writes
    at = torch.tensor([11, -1, 10, 299, 0], device="cuda")
    got = gather_rows(pool, at)
    torch.cuda.synchronize()
    assert got.is_cuda and torch.equal(got.cpu(), gather_rows(pool, at.cpu(), impl="torch"))
    assert torch.equal(got[0], fresh[1]) and torch.equal(got[2], fresh[0]) and not got[1].any()
    src = pool_of(3, shape, dtype, seed=4).cuda()
    scatter_rows(pool, torch.tensor([5, 7, 250], device="cuda"), src)
    torch.cuda.synchronize()
    assert torch.equal(pool[[5, 7, 250]], src.cpu())
    if pinned == "registered":
        unpin(pool)
