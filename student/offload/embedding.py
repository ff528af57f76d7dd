"""The input embedding in host memory (OffloadPlan.embedding "host"), for student/offload/runtime.py,
which builds it, installs `run` as the model's embedding runner and calls the rest from its own
finish_grads, step and synchronize.

An untied input embedding is a large matrix that a step reads and writes only a few rows of: at
the Qwen2.5-7B shape 545M parameters, whose fp32 master, fp32 gradient and 8-bit states hold
10 bytes each on the GPU, and whose backward makes a second fp32 gradient of the matrix's size
beside the accumulated one (CostTable.late_grad_bytes). Here it stays in host memory (pinned when
the device is CUDA):
  forward   the rows of the batch's tokens are gathered on the host from the fp32 master and
            copied to the device: the values the device's gather gives. The token ids come to the
            host once per micro-batch (the chunks of the long-context engine are views of one
            device storage, copied whole at its first chunk: one host sync, not one a chunk).
  backward  the rows' gradient goes to the host (on the compute stream, into pinned memory) and is
            summed there, once the copy is done, into the fp32 gradient buffer: per distinct token,
            its rows in the order of the tokens, then added to the buffer, the additions torch's
            embedding backward and gradient accumulation make on a CPU.
  finish_grads  the rows touched this step go to a zeroed device gradient (and are zeroed on the
            host), and the master comes to the device: until the end of `home`, the parameter and
            its .grad are device tensors, clipped and stepped with the other device parameters.
  step      `states_in` brings the optimizer's tensor states to the device before the step; `home`
            sends master and states back to host memory after it (on the compute stream; the next
            gather waits for the copy) and leaves the parameter on the host, without .grad.
So the whole matrix crosses the bus only for the update: master and states in and out, in the
optimizer phase, when the step's activations are gone. A tied embedding is the head's matrix,
which the loss reads on the device: the runtime refuses this placement for it.
"""

from __future__ import annotations

import torch

from student.pinned import host_empty, unpin

__all__ = ["HostEmbedding"]


class _Gather(torch.autograd.Function):
    """The embedding's forward on the host (`HostEmbedding.gather`) as one autograd node; its
    backward hands the rows' gradient to the owner and gives the parameter none (the owner keeps
    the sum)."""

    @staticmethod
    def forward(ctx, weight, ids, owner):
        ctx.ids, ctx.owner = ids, owner
        return owner.gather(ids)

    @staticmethod
    def backward(ctx, dy):
        ctx.owner.add_grad(ctx.ids, dy)
        return None, None, None


class HostEmbedding:
    """`embedding`'s weight (an nn.Embedding of the student) in host memory, pinned when `device`
    is CUDA; its parameter stays the model's (the optimizer and checkpoints see it as before)."""

    def __init__(self, embedding: torch.nn.Embedding, device):
        self.param = embedding.weight
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        rows, self.width = self.param.shape
        self.master = host_empty(rows * self.width, torch.float32, self.cuda).view(rows, self.width)
        self.grad = host_empty(rows * self.width, torch.float32, self.cuda).view(rows, self.width)
        with torch.no_grad():
            self.master.copy_(self.param.detach())
            self.grad.zero_()
        self.param.data = self.master
        self._touched: torch.Tensor | None = None  # the rows with gradient this step (sorted), None: none yet
        self._pending: list[tuple] = []  # backward copies not summed yet: (event or None, rows, inverse, host rows' gradient)
        self._ids: tuple = (None, None)  # (the device storage of the last ids, its host copy)
        self._homes: dict[str, torch.Tensor] = {}  # optimizer state key -> its host buffer
        self._written = None  # CUDA event: the last update's copies back to the host are done

    # --- forward and backward ----------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Student.forward's embedding runner: input_ids [B, T] (on the device) -> [B, T, hidden] fp32 there."""
        ids = self._host_ids(input_ids)
        if torch.is_grad_enabled():
            return _Gather.apply(self.param, ids, self)
        return self.gather(ids)

    def _host_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids on the host, read from one host copy of the device storage they are a view of (a
        chunk of the micro-batch's ids), made at the first view of that storage: one host sync a
        micro-batch. The storage is held until another one comes, so no other tensor is allocated
        at its address meanwhile; ids written in place into a storage already copied would not be
        seen (the engine and the trainer copy each micro-batch's ids to the device anew)."""
        storage = input_ids.untyped_storage()  # on a CPU device the copy is the storage itself
        held, host = self._ids
        if held is None or held.data_ptr() != storage.data_ptr() or held.nbytes() != storage.nbytes():
            whole = torch.empty(0, dtype=input_ids.dtype, device=input_ids.device).set_(storage)
            held, host = storage, whole.cpu()
            self._ids = (held, host)
        return host.as_strided(input_ids.shape, input_ids.stride(), input_ids.storage_offset())

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (host) from the master, on the device."""
        self._wait_written()
        rows = torch.empty((*ids.shape, self.width), dtype=torch.float32, pin_memory=self.cuda)
        torch.index_select(self.master, 0, ids.reshape(-1), out=rows.view(-1, self.width))
        return rows.to(self.device, non_blocking=True)

    def add_grad(self, ids: torch.Tensor, dy: torch.Tensor) -> None:
        """The backward of one gather: its rows' gradient to the host, summed once there."""
        rows, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        dy = dy.reshape(-1, self.width)
        event = None
        if self.cuda:
            host = torch.empty(dy.shape, dtype=dy.dtype, pin_memory=True)
            host.copy_(dy, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            dy = host
        self._pending.append((event, rows, inverse, dy))
        self._sum(wait=False)

    def _sum(self, wait: bool) -> None:
        """Sum the copied gradients into the buffer, in the order of the backwards: those whose copy
        is done (all of them, waiting, when `wait`)."""
        while self._pending and (wait or self._pending[0][0] is None or self._pending[0][0].query()):
            event, rows, inverse, dy = self._pending.pop(0)
            if event is not None:
                event.synchronize()
            part = torch.zeros((len(rows), self.width), dtype=torch.float32).index_add_(0, inverse, dy)
            self.grad.index_add_(0, rows, part)  # rows are distinct: one addition per element
            self._touched = rows if self._touched is None else torch.unique(torch.cat([self._touched, rows]))

    # --- the update -----------------------------------------------------------------------------------

    def finish_grads(self) -> None:
        """After the step's backwards: the parameter and its gradient on the device (nothing when
        no backward reached the embedding)."""
        self._sum(wait=True)
        if self._touched is None:
            return
        rows, self._touched = self._touched, None
        values = torch.empty((len(rows), self.width), dtype=torch.float32, pin_memory=self.cuda)
        torch.index_select(self.grad, 0, rows, out=values)
        self.grad.index_fill_(0, rows, 0.0)  # the buffer is zero again for the next step
        grad = torch.zeros(self.master.shape, dtype=torch.float32, device=self.device)
        grad.index_copy_(0, rows.to(self.device), values.to(self.device, non_blocking=True))
        self.param.data = self.master.to(self.device, non_blocking=True)
        self.param.grad = grad

    def states_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the optimizer's step: the parameter's tensor states on the device (when
        `finish_grads` brought the parameter there)."""
        if self.param.device != self.master.device:
            state = optimizer.state.get(self.param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(self.device, non_blocking=True)

    def home(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer's step: master and states back to host memory (the copies run on;
        the next gather, and `synchronize`, wait for them); the parameter on the host, no .grad."""
        if self.param.device == self.master.device:
            return
        state = optimizer.state.get(self.param, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != self.master.device:
                home = self._homes.get(key)
                if home is None or home.shape != value.shape or home.dtype != value.dtype:
                    if home is not None and self.cuda:
                        self.synchronize()
                        unpin(home)
                    home = self._homes[key] = host_empty(value.numel(), value.dtype, self.cuda).view(value.shape)
                home.copy_(value, non_blocking=True)
                state[key] = home
        self.master.copy_(self.param.data, non_blocking=True)
        if self.cuda:
            self._written = torch.cuda.Event()
            self._written.record()
        self.param.grad = None
        self.param.data = self.master

    def _wait_written(self) -> None:
        if self._written is not None:
            self._written.synchronize()
            self._written = None

    def synchronize(self) -> None:
        """The host master and states may be read (a checkpoint); the copied gradients are summed."""
        self._wait_written()
        self._sum(wait=True)

    def host_bytes(self) -> int:
        """Host bytes: master, gradient buffer and the optimizer states' buffers."""
        return self.master.nbytes + self.grad.nbytes + sum(h.nbytes for h in self._homes.values())

    def unpin_buffers(self) -> None:
        """Give back the page-locking of the host buffers (they stay, pageable)."""
        if self.cuda:
            self.synchronize()
            for tensor in (self.master, self.grad, *self._homes.values()):
                if tensor.numel():
                    unpin(tensor)
