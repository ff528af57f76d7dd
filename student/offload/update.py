"""The offloaded layers' fp32 state and its update on the GPU, for student/offload/runtime.py's
OffloadRuntime, which builds both and drives them (this module does not import the runtime: the
ring is handed the host layers, the resident working weights and the stream helpers when it is
built, and the clip coefficient with each update).

HostLayer: one decoder layer's flat master and gradient buffers (the layer's parameters and their
    gradients are views of them), its staging copies in the compute dtype and the host buffers of
    its optimizer states; in host memory (page-locked when the device is CUDA), or on the device
    for a layer whose plan puts its states on the GPU. The runtime fills the gradients in the
    backward and, with plan.optimizer "cpu", updates the layers itself.
UpdateRing: plan.optimizer "gpu". The host layers, last to first, pass through a ring of
    UPDATE_SLOTS device slots (student/offload/plan.py): master, gradient and states come in on an
    upload stream (the first slots' in the backward, once their layer's backward is done: they do
    not depend on the clipping; the runtime's backward calls `preload`), the gradient is
    scaled and the same optimizer steps that slice there, the resident working weights and the
    staging casts are written from the updated master, then master, states and staging go out on
    a writeback stream; a slot is loaded again once its copies out are done (`update`, from the
    runtime's step, before the device parameters step). The copies out overlap the next step:
    what reads those host buffers next waits for them on its stream (student/offload/runtime.py: the next
    weights' and gradients' copies, the next update), the host in the runtime's `synchronize()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from student.offload.plan import UPDATE_SLOTS
from student.offload.streams import Streams
from student.pinned import host_empty, unpin

__all__ = ["HostLayer", "UpdateRing"]


@dataclass(frozen=True)
class _Group:
    """The parameters of one layer that share a working dtype: contiguous in the layer's flats."""

    dtype: torch.dtype  # working dtype
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    sizes: tuple[int, ...]
    start: int  # offset in the layer's master and gradient flats
    numel: int

    @property
    def span(self) -> slice:
        return slice(self.start, self.start + self.numel)


class HostLayer:
    """One decoder layer's fp32 state: flat master and gradient buffers whose views are the layer's
    parameters and their gradients, and per group the staging copy the device reads. In host
    memory (pinned when `pin`), or on `device` for a layer whose plan puts its states on the GPU
    (its staging copies are then its resident working weights). `narrow_grads` (a step is one
    backward): the gradient is one buffer per group in the group's dtype instead (`narrow`)."""

    def __init__(self, layer: torch.nn.Module, compute_dtype: torch.dtype, pin: bool, device=None,
                 narrow_grads: bool = False):
        self.on_device = device is not None
        self.pinned = pin and not self.on_device  # its host buffers are page-locked (until `unpin_buffers`)
        # The step's gradient is one backward's (no sum of micro-batches): the layer keeps its
        # compute-dtype groups' gradients in that dtype, on the host or on the device as its states
        # (the values are that dtype's: widening is exact).
        self.narrow = narrow_grads
        empty = (lambda numel, dtype: torch.empty(numel, dtype=dtype, device=device)) if self.on_device else \
            (lambda numel, dtype: host_empty(numel, dtype, pin))
        named = list(layer.named_parameters())
        members = [[(n, p) for n, p in named if p.ndim >= 2], [(n, p) for n, p in named if p.ndim < 2]]
        self.groups, start = [], 0
        for group, dtype in zip(members, (compute_dtype, torch.float32)):
            if group:
                sizes = tuple(p.numel() for _, p in group)
                self.groups.append(_Group(dtype, tuple(n for n, _ in group), tuple(p.shape for _, p in group),
                                          sizes, start, sum(sizes)))
                start += sum(sizes)
        self.numel = start
        self.master = empty(start, torch.float32)
        # The gradient: one flat fp32 buffer (`grad`; `grads` its groups' spans), or with `narrow`
        # one buffer per group in the group's dtype (`grad` None).
        self.grad = None if self.narrow else empty(start, torch.float32)
        self.grads = ([empty(g.numel, g.dtype) for g in self.groups] if self.narrow
                      else [self.grad[g.span] for g in self.groups])
        self.params, self.grad_views, self.spans = [], [], []
        offset = 0
        with torch.no_grad():
            for _, p in members[0] + members[1]:
                span = slice(offset, offset + p.numel())
                view = self.master[span].view(p.shape)
                view.copy_(p.detach())
                p.data = view
                self.params.append(p)
                group = next(k for k, g in enumerate(self.groups) if g.start <= offset < g.start + g.numel)
                local = offset - self.groups[group].start
                self.grad_views.append(self.grads[group][local:local + p.numel()].view(p.shape))
                self.spans.append((span, p.shape))
                offset += p.numel()
        self.staging = [self.master[g.span] if g.dtype == torch.float32 else empty(g.numel, g.dtype)
                        for g in self.groups]
        self.has_grad = False  # gradients of this step arrived (else the next ones are copied, not added)
        # CUDA events (None on a CPU device, or before the first): the copy of the step's gradient
        # sum into `grad` is done; the update's copies into `master`, the states and the staging
        # copies are done (what reads those host buffers waits for it, on its stream).
        self.grad_out = self.written = None
        # The optimizer's tensor states of the layer as views of one host buffer per dtype
        # (`state_flats`; a checkpoint cannot save one storage under two dtypes), so that a few
        # copies move them: (param, key, dtype, offset, shape) each; laid out at the layer's first
        # update on the device (`_states_home`; None before).
        self.state_flats: dict[torch.dtype, torch.Tensor] | None = None
        self.state_entries: list[tuple] = []

    def needs_update(self, held: dict) -> bool:
        """Whether the layer has gradients to update with (`held`: each parameter's .grad, as the
        optimizer holds them): a narrow layer's matrices have no .grad (the runtime's
        `finish_grads`), its `has_grad` flag says."""
        return self.has_grad if self.narrow else any(held.get(p) is not None for p in self.params)

    def unpin_buffers(self) -> None:
        """Give back the page-locking of the layer's host buffers (masters, gradients, staging
        copies, optimizer states; they stay, pageable); nothing when they are not pinned."""
        if not self.pinned:
            return
        flats = list(self.state_flats.values()) if self.state_flats is not None else []
        grads = self.grads if self.narrow else [self.grad]
        for tensor in (self.master, *grads, *(s for _, s in self.separate_staging()), *flats):
            if tensor.numel():
                unpin(tensor)
        self.pinned = False

    def separate_staging(self):
        """(group, staging) of the groups whose staging is not the master itself."""
        return [(g, s) for g, s in zip(self.groups, self.staging) if g.dtype != torch.float32]

    def widen_grads(self, out: torch.Tensor, coef: torch.Tensor | None) -> list[torch.Tensor]:
        """A narrow layer's gradient in fp32 in `out` (on the gradient's device, at least `numel` fp32
        elements), scaled by `coef` (a 0-dim fp32 tensor there; None: not scaled) in the same pass:
        fp32(grad) * coef, the product of the fp32 path's scaling. Returns the parameters' fp32
        gradient views of `out`."""
        assert self.narrow, "a layer with fp32 gradients reads its own buffer"
        with torch.no_grad():
            for g, grad in zip(self.groups, self.grads):
                if coef is None:
                    out[g.span].copy_(grad)
                else:  # expanded, coef takes part in type promotion: fp32 products, whatever grad's dtype
                    torch.mul(grad, coef.expand(g.numel), out=out[g.span])
        return [out[span].view(shape) for span, shape in self.spans]


@dataclass
class _Slot:
    """One of the ring's device buffers that host layers' updates on the GPU pass through (flat,
    sized for the largest host layer): master, gradient, optimizer states (bytes, laid out as the
    layer's `state_flats`) and the staging copies cast from the updated master on their way out."""

    master: torch.Tensor
    grad: torch.Tensor
    staged: list[torch.Tensor]  # per separate-staging group, in the working dtype
    states: dict[torch.dtype, torch.Tensor] | None = None  # allocated once every host layer's states have a layout
    layer: int | None = None  # the layer whose master (and states) came in this step
    states_in: bool = False  # its states came in (else the update copies them in itself)
    narrow_in: bool = False  # its gradient came in narrow: the compute-dtype groups' in `staged`, to widen
    loaded: object = None  # event: the copies in are done
    free: object = None  # event: the last copies out of this slot are done (it may be written)


class UpdateRing:
    """The update on the GPU of the runtime's host layers through UPDATE_SLOTS slots (this module's
    docstring). The runtime builds it right after its own streams, with its host layers (`host`,
    one per decoder layer), the working weights of its resident layers (`resident`: layer index ->
    one device tensor per group) and its stream helpers; it calls `preload` in the backward for the
    `preloaded` layers, `update` in its step on the GPU and `end_step` after every step."""

    def __init__(self, host: list[HostLayer], resident: dict[int, list[torch.Tensor]], streams: Streams):
        self.host, self.resident, self.streams = host, resident, streams
        self.device, self.cuda = streams.device, streams.cuda
        self._side, self._record, self._wait = streams.side, streams.record, streams.wait
        # The update's side streams, which run beside the step's copies instead of queueing behind them.
        self.upload, self.writeback = streams.new(), streams.new()
        # The host layers last to first (the order their backwards end) through the ring: a layer in
        # position k of that order waits for the copies out of position k - UPDATE_SLOTS; the first
        # UPDATE_SLOTS positions load during the backward.
        order = [i for i in reversed(range(len(self.host))) if not self.host[i].on_device]
        self._slot_of = {i: n % UPDATE_SLOTS for n, i in enumerate(order)}
        self._slots: list[_Slot] = []
        self.optimizer = None  # the optimizer of the last step (its states' layouts are checked against it)

    def update(self, optimizer, held: dict, coef: torch.Tensor | None) -> None:
        """The host layers with gradients (`held`: each parameter's gradient, its .grad None
        meanwhile), last to first, through the slots (`_load`, `_update_layer`), each gradient
        scaled by the clip coefficient `coef` (a 0-dim fp32 device tensor; None: not scaled);
        nothing here waits on the host. A layer's copies out overlap the next layers' updates and
        the next step (what reads them waits for them on its stream)."""
        self.optimizer = optimizer
        written = []  # per position in the order: the last copies out so far (an event, or None)
        for k, index in enumerate(reversed(range(len(self.host)))):
            h = self.host[index]
            if not h.on_device and h.needs_update(held):
                slot = self._slot(index)
                if slot.layer != index:
                    self._load(index, slot, gradient=True,
                               after=written[k - UPDATE_SLOTS] if k >= UPDATE_SLOTS else None)
                self._update_layer(index, slot, optimizer, coef)
            written.append(h.written if not h.on_device and h.written is not None else
                           (written[-1] if written else None))

    def end_step(self) -> None:
        """After every step: no slot holds a layer (the next step loads its masters and states again)."""
        for slot in self._slots:
            slot.layer = None

    @property
    def preloaded(self) -> set[int]:
        """The host layers whose update loads during the backward: the first UPDATE_SLOTS positions
        of the update's order (the top layers)."""
        top = range(len(self.host) - 1, len(self.host) - 1 - UPDATE_SLOTS, -1)
        return {i for i in top if i >= 0 and not self.host[i].on_device}

    def _slot(self, index: int) -> _Slot:
        """Layer `index`'s slot of the ring (allocated at first use; the states' buffer once every
        host layer's states have a layout, as large as the largest)."""
        host = [h for h in self.host if not h.on_device]
        allocated = False
        if not self._slots:
            numel = max(h.numel for h in host)
            staged = [[g for g, _ in h.separate_staging()] for h in host]
            groups = [[x[k] for x in staged if len(x) > k] for k in range(max(map(len, staged)))]
            empty = lambda n, dtype: torch.empty(n, dtype=dtype, device=self.device)
            self._slots = [_Slot(empty(numel, torch.float32), empty(numel, torch.float32),
                                 [empty(max(g.numel for g in gs), gs[0].dtype) for gs in groups])
                           for _ in range(UPDATE_SLOTS)]
            allocated = True
        if self._slots[0].states is None and all(h.state_flats is not None for h in host):
            dtypes = {dtype for h in host for dtype in h.state_flats}
            for slot in self._slots:
                slot.states = {dtype: torch.empty(max(h.state_flats[dtype].numel() for h in host if dtype in h.state_flats),
                                                  dtype=dtype, device=self.device) for dtype in dtypes}
            allocated = True
        if allocated and self.cuda:
            # The new buffers come from the compute stream's pool: memory its queued kernels may still
            # read or write (the host frees tensors as soon as it has queued their last use). The
            # upload stream writes them without waiting for the compute stream otherwise.
            self.upload.wait_stream(torch.cuda.current_stream(self.device))
        return self._slots[self._slot_of[index]]

    def preload(self, index: int, total: torch.Tensor) -> None:
        """In the backward: layer `index`'s master and states into its slot (once a step: they do
        not change until its update), and the step's gradient sum so far (each micro-batch: the last
        one's is the step's). The load starts once the device has run the layer's backward, as the
        cost model has it: the host queues the backward well ahead of the device, and a load issued
        then would share the bus with the forward's weight copies still ahead of it (the 8B trace
        at 3c9e09c: 34 ms of the forward's gaps)."""
        slot = self._slot(index)
        if slot.layer != index:
            if self.cuda:
                self.upload.wait_stream(torch.cuda.current_stream(self.device))
            self._load(index, slot, gradient=False)
        self._wait(slot.free)
        slot.grad[:total.numel()].copy_(total)

    def _load(self, index: int, slot: _Slot, gradient: bool, after=None) -> None:
        """Layer `index`'s master, states (when laid out and the slot holds them) and, if
        `gradient`, its host gradient into `slot` on the upload stream, once the slot's last copies
        out, the layer's last update's copies out, its gradient's copy out and `after` are done."""
        h = self.host[index]
        slot.states_in = (slot.states is not None and self._states_laid_out(h)
                          and all(dtype in slot.states and flat.numel() <= slot.states[dtype].numel()
                                  for dtype, flat in h.state_flats.items()))
        if self.cuda:
            for event in (slot.free, h.written, h.grad_out if gradient else None, after):
                self._wait(event, self.upload)
        slot.narrow_in = gradient and h.narrow
        with self._side(self.upload):
            slot.master[:h.numel].copy_(h.master, non_blocking=True)
            if slot.narrow_in:  # the compute-dtype groups land in the staging casts' buffers (free until the update's casts)
                narrow = iter(slot.staged)
                for g, grad in zip(h.groups, h.grads):
                    target = slot.grad[g.span] if g.dtype == torch.float32 else next(narrow)[:g.numel]
                    target.copy_(grad, non_blocking=True)
            elif gradient:
                slot.grad[:h.numel].copy_(h.grad, non_blocking=True)
            if slot.states_in:
                for dtype, flat in h.state_flats.items():
                    slot.states[dtype][:flat.numel()].copy_(flat, non_blocking=True)
        slot.loaded, slot.layer = self._record(self.upload), index

    def _states_laid_out(self, h: HostLayer) -> bool:
        """The layer's tensor states are the views of its state_flats (not replaced since, e.g. by
        loading a checkpoint)."""
        optimizer = self.optimizer
        entries = [(p, key) for p in h.params for key, v in optimizer.state.get(p, {}).items()
                   if isinstance(v, torch.Tensor)]
        return (h.state_flats is not None and entries == [(p, key) for p, key, *_ in h.state_entries]
                and all(optimizer.state[p][key].data_ptr() == _view(h.state_flats, *rest).data_ptr()
                        for p, key, *rest in h.state_entries))

    def _update_layer(self, index: int, slot: _Slot, optimizer, coef: torch.Tensor | None) -> None:
        """One host layer's update in its slot, on the compute stream once its copies in are done:
        the gradient scaled by the clip coefficient `coef`, the optimizer's step over its parameters, the
        resident working weights and the staging casts from the updated master; then master, states
        and staging copies go out on the writeback stream."""
        h = self.host[index]
        self._wait(slot.loaded)
        master, grad = slot.master[:h.numel], slot.grad[:h.numel]
        if slot.narrow_in:
            with torch.no_grad():
                for (g, _), narrow in zip(h.separate_staging(), slot.staged):
                    grad[g.span].copy_(narrow[:g.numel])  # exact: the widening
        if coef is not None:
            grad.mul_(coef)
        for p, (span, shape) in zip(h.params, h.spans):
            p.data, p.grad = master[span].view(shape), grad[span].view(shape)
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor) and not slot.states_in:
                    optimizer.state[p][key] = value.to(self.device, copy=True, non_blocking=True)
        if slot.states_in:
            for p, key, *at in h.state_entries:
                optimizer.state[p][key] = _view(slot.states, *at)
        optimizer.step()
        with torch.no_grad():
            if index in self.resident:
                for target, g in zip(self.resident[index], h.groups):
                    target.copy_(master[g.span])
            staged = [(staging, buf[:g.numel]) for (g, staging), buf in zip(h.separate_staging(), slot.staged)]
            for (g, _), (_, cast) in zip(h.separate_staging(), staged):
                cast.copy_(master[g.span])  # rounded as .to(dtype) rounds
            if not slot.states_in:  # copied out here, on the compute stream (no memory of theirs waits on another)
                self._states_home(h, optimizer)
            if self.cuda:
                self.writeback.wait_stream(torch.cuda.current_stream(self.device))
            with self._side(self.writeback):
                h.master.copy_(master, non_blocking=True)
                for staging, cast in staged:
                    staging.copy_(cast, non_blocking=True)
                if slot.states_in:
                    for p, key, *at in h.state_entries:
                        value = optimizer.state[p][key]
                        _view(h.state_flats, *at).copy_(value, non_blocking=True)
                        if self.cuda and value.data_ptr() != _view(slot.states, *at).data_ptr():
                            value.record_stream(self.writeback)  # a tensor the optimizer made in place of its own
        h.written = slot.free = self._record(self.writeback)
        for p, (span, shape) in zip(h.params, h.spans):
            p.data, p.grad = h.master[span].view(shape), None
        for p, key, *at in h.state_entries:
            optimizer.state[p][key] = _view(h.state_flats, *at)

    def _states_home(self, h: HostLayer, optimizer) -> None:
        """The layer's tensor states (on the device, just updated, not in a slot) into its host
        buffer on the compute stream; a new buffer laid out for them when they do not match the
        layout (the layer's first update on the device, or the optimizer made other states)."""
        current = [(p, key, v) for p in h.params for key, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)]
        if [(p, key, v.dtype, v.shape) for p, key, v in current] != [(p, key, d, s) for p, key, d, _, s in h.state_entries]:
            entries, sizes = [], {}
            for p, key, v in current:
                entries.append((p, key, v.dtype, sizes.get(v.dtype, 0), v.shape))
                sizes[v.dtype] = sizes.get(v.dtype, 0) + v.numel()
            if h.state_flats is not None:
                self.streams.synchronize()  # nothing still reads or writes the old buffers
                for flat in h.state_flats.values():
                    if h.pinned and flat.numel():
                        unpin(flat)
            h.state_flats = {dtype: host_empty(n, dtype, h.pinned) for dtype, n in sizes.items()}
            h.state_entries = entries
        for p, key, *at in h.state_entries:
            _view(h.state_flats, *at).copy_(optimizer.state[p][key], non_blocking=self.cuda)


def _view(flats: dict[torch.dtype, torch.Tensor], dtype: torch.dtype, offset: int, shape: torch.Size) -> torch.Tensor:
    """The tensor of `shape` at element `offset` of the flat buffer of `dtype`."""
    return flats[dtype][offset:offset + math.prod(shape)].view(shape)
