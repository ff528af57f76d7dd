"""student/pinned.py: page-locked buffers at their exact size, kept between owners of the same sizes
(a step's key/value store and the next step's) and given back when a request of another size comes
(a step of another length). The bookkeeping runs on the CPU (PinnedPools(pin=False)); the
page-locking itself and the store that uses it need a GPU (`-m gpu`)."""

from __future__ import annotations

import gc

import pytest
import torch

from student.long_context.store import PagedKVStore
from student.pinned import POOLS, PinnedPools, release_cached


class Owner:
    """Something that holds buffers, as a store does."""


def test_a_buffer_is_exact_and_comes_back_for_the_next_owner_of_its_size():
    pools = PinnedPools(pin=False)
    first = Owner()
    a = pools.empty(first, (3, 5, 7), torch.bfloat16)
    assert a.shape == (3, 5, 7) and a.dtype == torch.bfloat16 and a.untyped_storage().nbytes() == 3 * 5 * 7 * 2
    pointer = a.data_ptr()
    assert pools.kept_bytes() == 0  # in use, not kept
    del first, a
    assert pools.kept_bytes() == 3 * 5 * 7 * 2  # the owner is gone: kept (no garbage collection needed)
    second = Owner()
    b = pools.empty(second, (15, 7), torch.bfloat16)  # same elements and dtype, another shape
    assert b.data_ptr() == pointer and b.shape == (15, 7) and pools.kept_bytes() == 0


def test_a_request_no_kept_buffer_fits_gives_the_kept_ones_back():
    pools = PinnedPools(pin=False)
    owner = Owner()
    pools.empty(owner, (4, 8), torch.bfloat16), pools.empty(owner, (4, 8), torch.float32)
    del owner
    assert pools.kept_bytes() == 4 * 8 * (2 + 4)
    again = Owner()
    pools.empty(again, (4, 8), torch.float32)  # fits one: the other stays kept
    assert pools.kept_bytes() == 4 * 8 * 2
    pools.empty(again, (9, 8), torch.bfloat16)  # another length: what is kept is not asked for again
    assert pools.kept_bytes() == 0
    del again
    assert pools.kept_bytes() == 4 * 8 * 4 + 9 * 8 * 2
    pools.release()
    assert pools.kept_bytes() == 0


def test_one_owner_takes_as_many_buffers_of_a_size_as_it_asks_for():
    pools = PinnedPools(pin=False)
    owner = Owner()
    pointers = {pools.empty(owner, (6,), torch.float32).data_ptr() for _ in range(3)}
    del owner
    assert pools.kept_bytes() == 3 * 6 * 4
    again = Owner()
    assert {pools.empty(again, (6,), torch.float32).data_ptr() for _ in range(3)} == pointers
    assert pools.kept_bytes() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_an_offloaded_store_reuses_the_last_ones_pools_and_a_new_length_frees_them():
    release_cached()

    def store(seq_len):
        return PagedKVStore(2, 1, seq_len, 2, 64, page_tokens=16, dtype=torch.bfloat16, device="cuda",
                            offload=True, offload_pages=4)

    first = store(256)
    pointers = {t.data_ptr() for t in first.k + first.v}
    assert all(not t.is_cuda and t.is_pinned() for t in first.k + first.v)
    assert first.k[0].untyped_storage().nbytes() == 256 * 2 * 64 * 2  # exact, not a power of two's block
    del first
    gc.collect()
    second = store(256)
    assert {t.data_ptr() for t in second.k + second.v} == pointers
    del second
    third = store(320)
    assert POOLS.kept_bytes() == 0 and all(t.is_pinned() for t in third.k)
    del third
    release_cached()
    assert POOLS.kept_bytes() == 0
