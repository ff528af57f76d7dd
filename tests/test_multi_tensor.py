"""kernels.multi_tensor: the launch tables the optimizer steps share (layout of the meta rows and
tile owners) and the grad table, which uploads again only when the grads move and refuses grads
that no longer fit their launch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels.multi_tensor import META_COLUMNS, GradTable, TensorTable, is_aligned


def test_tensor_table_rows_and_tile_owners():
    table = TensorTable([[11, 12, 13], [21], [31, 32]], [2, 0, 3], torch.device("cpu"))
    assert table.num_tensors == 3 and table.num_tiles == 5
    assert table.meta.dtype == torch.int64 and table.meta.shape == (3, META_COLUMNS)
    assert table.meta[:, -1].tolist() == [0, 2, 2]  # each tensor's first tile; an empty one takes none
    assert table.meta[0, :4].tolist() == [11, 12, 13, 0] and table.meta[2, :2].tolist() == [31, 32]
    assert table.tile_owner.dtype == torch.int32 and table.tile_owner.tolist() == [0, 0, 2, 2, 2]


def _launch(num_tensors, grad_dtype=torch.float32, aligned=True):
    return SimpleNamespace(num_tensors=num_tensors, grad_dtype=grad_dtype, aligned=aligned)


def test_grad_table_uploads_only_when_grads_move():
    grads = [torch.zeros(8), torch.zeros(4), torch.zeros(16, dtype=torch.bfloat16)]
    table = GradTable([_launch(2), _launch(1, torch.bfloat16, aligned=False)], align_bytes=16)
    assert table.point_at(grads)
    first = table.table
    assert first.tolist() == [g.data_ptr() for g in grads]
    assert table.for_launch(0).tolist() == [grads[0].data_ptr(), grads[1].data_ptr()]
    assert table.for_launch(1).tolist() == [grads[2].data_ptr()]
    assert table.point_at(grads) and table.table is first  # same addresses: nothing uploaded
    grads[1] = torch.ones(4)  # a new grad tensor, as after zero_grad(set_to_none=True)
    assert table.point_at(grads) and table.table is not first
    assert table.for_launch(0).tolist() == [grads[0].data_ptr(), grads[1].data_ptr()]


def test_grad_table_refuses_grads_that_no_longer_fit():
    table = GradTable([_launch(1), _launch(1, aligned=False)], align_bytes=16)
    fitting = [torch.zeros(8), torch.zeros(9)[1:]]  # the second is misaligned, as its launch allows
    assert not is_aligned(fitting[1:], 16) and table.point_at(fitting)
    assert not table.point_at([torch.zeros(8, dtype=torch.bfloat16), fitting[1]])  # another dtype
    assert not table.point_at([torch.zeros(4, 2).t(), fitting[1]])  # not contiguous
    assert not table.point_at([torch.zeros(9)[1:], fitting[1]])  # misaligned where the launch assumes alignment
