"""The offload runtime: trains a Student whose decoder layers live in host memory, carrying out an
OffloadPlan (student/offload/plan.py says what each decision means; the planner, student/planner/solve.py,
makes plans). LazyTrain's executor (arXiv 2608.11919, after MegaTrain): layers stream through the
GPU, the host keeps the fp32 state. The runtime owns the streams of the step's copies, their
schedule, the layer autograd Function, the gradients, the clipping and the update on the CPU;
student/offload/update.py owns the layers' fp32 buffers (HostLayer) and the update on the GPU
(UpdateRing), which the runtime builds and calls; student/offload/streams.py the stream helpers
both use.

Where things live:
  host (pinned when the device is CUDA), per decoder layer whose plan says states "host": its fp32
      master weights (the model's own parameters, made views of one flat buffer, so the optimizer,
      clipping and checkpoints see them as without offload), its gradients (fp32 accumulators,
      the parameters' .grad after `finish_grads`, views of a second flat buffer; when a step is one
      backward (`accumulates=False`) one buffer per group in the group's dtype instead, the
      matrices' bf16 values widened only where an update reads them), its optimizer states
      (the optimizer creates them on the parameters' device) and, when the compute dtype is not
      fp32, a staging copy of its matrices in that dtype (what the device reads: half the bytes of
      the masters).
  device: the input embedding (unless the plan puts it on the host: student/offload/embedding.py),
      the final norm and the lm-head with their gradients and optimizer states, exactly as without
      offload; the same flat master, gradient and
      staging buffers of the layers whose plan says states "gpu" (their staging copies are their
      working weights; the optimizer keeps their states beside them; when a step is one
      backward their gradients are one buffer per group in the group's dtype, as a host layer's,
      and during the update one fp32 buffer as large as the largest of those layers, shared, is
      what each one's update widens its gradient into); the working weights of the other
      "resident" layers (kept across steps, refreshed after each update); a ring of
      prefetch_depth + 1 buffers the "stream" layers' working weights pass through; activations
      as the plan says.
Working weights: matrices in the compute dtype (bf16 under autocast on a GPU: the same rounding
autocast applies to an fp32 weight; fp32 on a CPU), vectors (norms, biases) fp32, as the masters.

A step:
  forward   Student.forward's `layer_runner` seam runs each layer (the model's one forward, through
            torch.func.functional_call with the working weights). A layer is one autograd Function:
            "keep" keeps its autograd graph (and so its weights) until its backward; "recompute"
            keeps only its input on the device and runs the layer again in the backward; "offload"
            copies its input to host memory on a side stream and back ahead of the backward, then
            recomputes. Weight copies of "stream" layers and returning activations are issued
            `prefetch_depth` layers ahead, in the order of use (forward in order, backward in
            reverse): a layer's copies start once the compute work queued before the layer
            `prefetch_depth` + 1 places earlier in that order is done, as the planner's cost model
            has them; on a side stream, with events the compute stream waits on; nothing waits on
            the host.
  backward  as soon as a layer's backward has its weight gradients (one flat tensor per dtype):
            states "gpu": they are added into its device accumulators (one backward a step: as a
            host layer's below, but into its device buffers, on the compute stream); states
            "host": the step's sum so far is formed on the device in fp32 (the first micro-batch's
            gradient widened; after it, the host accumulator comes back ahead of use, on the
            schedule, and the gradient is added to it: the host's additions, in its order, so the
            sum is exact), its per-parameter L2 norms are taken there (the last micro-batch's are
            the clipping's) and it goes device -> host on a second side stream into the fp32
            accumulator (one backward a step: each group as the backward made it, in its dtype).
  finish_grads()  makes the accumulators the parameters' .grad (one backward a step: the
            matrices' .grad stay None); with the update on the CPU it waits for their copies (the
            host reads them next: the step's host wait), on the GPU nothing.
  clip_grad_norm()  the trainer's clip_grad_norm_foreach, with no host pass over gradients: the
            norms taken in the backward are the host layers' (and, one backward a step, the "gpu"
            layers'); the other device gradients are scaled now; the coefficient (a device
            scalar) is applied to the rest inside the update.
  step()    plan.optimizer "cpu": the device parameters step (queued on the device), then the host
            reads the coefficient once and the host layers update one after another on the CPU,
            each one's gradient scaled, staging copy cast and, when resident, its working weights
            sent to the device right after its update. "gpu": the host layers, last to first, pass
            through the update ring (student/offload/update.py: UPDATE_SLOTS device slots, the
            first loaded in the backward), then the device parameters step. The ring's copies out
            overlap the next step: what reads those host buffers next waits for them on its stream
            (the next weights' and gradients' copies, the next update), the host in
            `synchronize()` (a checkpoint, the end of training). Every optimizer step is over only
            the parameters that have gradients at that moment: what the optimizer gives without
            offload (per-parameter updates do not depend on which others step with them). One
            backward a step, a layer's gradient in the compute dtype is widened to fp32 (and
            scaled by the coefficient in the same pass) for its layer's step alone: a host layer's
            on the CPU into one host buffer, in its ring slot on the GPU; a "gpu" layer's, after
            the other device parameters' step, into one device buffer the "gpu" layers share.
  phase_s() the last step's phases (forward, head, backward, grads, clip, optimizer, refresh), as the
            planner predicts them (student/planner/solve.py's PHASES).

On a CPU device there are no streams: every copy is a plain copy, the same code path otherwise, so
the CPU tests hold offloaded training to the losses of training without it, bit for bit (the same
fp32 sums, norms and products, in the same order: clip.total_grad_norm stacks the per-parameter
norms in the parameters' order whoever measured them).
Chunk-recurrent training (student/long_context/): the engine runs each chunk through
Student.forward, so through `run_layer`, which hands the layer its key/value store. Pass 1's
forwards run without gradients (the plain no-grad path, as evaluation's); pass 2 runs each chunk
forward and backward, last chunk first, and the runtime takes each chunk as it takes a micro-batch:
its layer gradients are added into the accumulators (the first chunk of a step's first micro-batch
copied, the rest added, in the order plain chunk-recurrent training adds them into .grad). The
plan's activation decision holds per chunk ("recompute" runs the layer again from its chunk input,
attending the stored pages; the store hands back pass 2's kept attention output, as under the
engine's own checkpoint_layers, which the runner replaces). The plan's chunk_tokens, when set,
must be the run's (the trainer checks it).
Not supported yet (the trainer refuses it in one line): the sparse FFN (its L1 terms and dead-neuron
reinitialisation would have to cross the layer Function).
"""

from __future__ import annotations

import math

import torch
from torch.func import functional_call

from distill.configs import ConfigError
from student.offload.clock import PhaseClock
from student.offload.embedding import HostEmbedding
from student.offload.plan import OffloadPlan
from student.offload.streams import Streams
from student.offload.update import HostLayer, UpdateRing
from student.optim.clip import check_max_norm, clip_coefficient, scale_grads_, total_grad_norm

__all__ = ["OffloadRuntime"]


class _Schedule:
    """The copies to the device of one forward (and its backward), in the order of use: weights of
    stream layers in the forward, then per layer in reverse an offloaded input, stream weights and
    (a host layer, after the step's first micro-batch) its gradient accumulator.
    Each layer's forward and backward is a place in that order (forward: its index; backward: L
    more, counted from the top); a layer's copies are issued when the runtime reaches the place
    `depth` before theirs (`reach`: the start of that layer's forward or backward, before its
    work is queued), so they overlap the `depth` layers between. Weight items pass through the
    ring's depth + 1 slots (the item depth + 1 before in a slot is at least one place earlier:
    its reader's work is queued before the copy, which waits for it); the forward weights of a
    kept layer get their own buffer (they live until its backward).
    The runtime hands it `issue(schedule, k)` (starts copy k: (device tensors, event), or None when
    its source is not there yet), `release(before)` (lets go of what copies out read, held at
    places before `before`) and its stream helpers (taking a copy waits for its event)."""

    def __init__(self, plan: OffloadPlan, host: list[HostLayer], grad: bool, issue, release, streams: Streams):
        layers, depth = plan.layers, plan.prefetch_depth
        items = [("w", i, "fwd") for i, lp in enumerate(layers) if lp.params == "stream"]
        if grad:
            for i in reversed(range(len(layers))):
                if layers[i].activation == "offload":
                    items.append(("x", i, "bwd"))
                if layers[i].params == "stream" and layers[i].activation != "keep":
                    items.append(("w", i, "bwd"))
                h = host[i]
                if h.has_grad and not h.on_device:  # not the step's first micro-batch: its sum so far comes in
                    items.append(("g", i, "bwd"))
        self.issue, self.release, self.streams = issue, release, streams
        self.num_layers, self.depth, self.items = len(layers), depth, items
        self.position = {item: k for k, item in enumerate(items)}
        self.place = [self.place_of(i, phase, len(layers)) for _, i, phase in items]
        self.reached = -1
        self.slot, count = {}, 0
        for k, (kind, i, phase) in enumerate(items):
            if kind == "w" and not (grad and phase == "fwd" and layers[i].activation == "keep"):
                self.slot[k], count = count % (depth + 1), count + 1
        self.issued: dict[int, tuple[list[torch.Tensor], object]] = {}
        self.next = 0

    @staticmethod
    def place_of(index: int, phase: str, num_layers: int) -> int:
        return index if phase == "fwd" else 2 * num_layers - 1 - index

    def reach(self, index: int, phase: str) -> None:
        """The runtime is at the start of layer `index`'s forward or backward (`phase`)."""
        self.reached = max(self.reached, self.place_of(index, phase, self.num_layers))
        self.release(before=self.reached - 1)
        self.pump()

    def pump(self) -> None:
        """Issue the items up to `depth` places past the one reached (stopping at one not ready yet)."""
        while self.next < len(self.items) and self.place[self.next] <= self.reached + self.depth:
            issued = self.issue(self, self.next)
            if issued is None:
                return
            self.issued[self.next] = issued
            self.next += 1

    def take(self, item: tuple) -> list[torch.Tensor]:
        k = self.position[item]
        self.reached = max(self.reached, self.place[k])
        self.pump()
        assert k in self.issued, f"copy {item} is issued before it is taken"
        tensors, event = self.issued.pop(k)
        self.streams.wait(event)
        return tensors


class _LayerFunction(torch.autograd.Function):
    """One decoder layer with offloaded weights, as one autograd node: the runtime's
    `_forward_layer` and `_backward_layer` (forward and backward per its LayerPlan), which the
    runtime passes in (`forward_layer`, a bound method; it leaves the backward on `ctx`)."""

    @staticmethod
    def forward(ctx, x, cos, sin, row_mask, forward_layer, index: int, kv_store):
        return forward_layer(ctx, x, cos, sin, row_mask, index, kv_store)

    @staticmethod
    def backward(ctx, dy):
        return ctx.backward_layer(ctx, dy), None, None, None, None, None, None


class OffloadRuntime:
    """Carries out `plan` for `model` (a student.model.Student): moves its decoder layers' weights
    into host memory and installs itself as the model's layer runner; the final norm, the lm-head,
    the RoPE table and (plan.embedding "gpu") the input embedding go to `device` (they stay there,
    not offloaded); with plan.embedding "host" the input embedding stays in host memory and the
    runtime installs its runner (student/offload/embedding.py).

    compute_dtype: the autocast dtype the trainer runs under (None: fp32). The trainer calls
    `finish_grads()` after the micro-batches' backwards, `clip_grad_norm(max_norm)`, then
    `step(optimizer)` instead of optimizer.step(); `refresh()` after loading weights into the
    model, `synchronize()` before reading host weights or states (a checkpoint). Build the
    optimizer after this runtime (it must see the parameters where they live)."""

    def __init__(self, model, plan: OffloadPlan, device, compute_dtype: torch.dtype | None = None, *,
                 accumulates: bool = True):
        num_layers = model.config.num_layers
        if len(plan.layers) != num_layers:
            raise ConfigError("offload", f"holds a plan for {len(plan.layers)} decoder layers but the student has "
                                         f"{num_layers}; make the plan for this student (`distill plan`) or use "
                                         "--offload auto")
        self.model, self.plan, self.device = model, plan, torch.device(device)
        self.cuda = self.device.type == "cuda"
        compute_dtype = compute_dtype or torch.float32
        if plan.embedding == "host" and model.lm_head is None:
            raise ConfigError("offload", "puts the input embedding in host memory, but this student's lm-head is "
                                         "tied to it (the loss reads it on the GPU); make the plan for this student "
                                         "(`distill plan`) or use --offload auto")
        self.embedding = HostEmbedding(model.embed_tokens, self.device) if plan.embedding == "host" else None
        for module in (model.embed_tokens if self.embedding is None else None, model.norm, model.lm_head):
            if module is not None:
                module.to(self.device)
        model.inv_freq = model.inv_freq.to(self.device)
        self.host = [HostLayer(layer, compute_dtype, pin=self.cuda, device=self.device if lp.states == "gpu" else None,
                               narrow_grads=not accumulates)
                     for layer, lp in zip(model.layers, plan.layers)]
        self._widened: torch.Tensor | None = None  # the update on the CPU: a narrow layer's fp32 gradient
        self._host_params = {p for h in self.host if not h.on_device for p in h.params}
        self._narrow_params = {p for h in self.host if h.narrow for p in h.params}
        # The working weights of resident layers; a layer with its states on the device reads its staging copies.
        self.resident = {i: h.staging if h.on_device else
                         [torch.empty(g.numel, dtype=g.dtype, device=self.device) for g in h.groups]
                         for i, h in enumerate(self.host) if plan.layers[i].params == "resident"}
        streamed = [h for h, lp in zip(self.host, plan.layers) if lp.params == "stream"]
        widths = [max(h.groups[k].numel for h in streamed) for k in range(len(streamed[0].groups))] if streamed else []
        dtypes = [g.dtype for g in streamed[0].groups] if streamed else []
        self.ring = [[torch.empty(n, dtype=d, device=self.device) for n, d in zip(widths, dtypes)]
                     for _ in range(plan.prefetch_depth + 1)] if streamed else []
        # Side streams: the step's copies in and out (weights, inputs, gradients); the update ring
        # (plan.optimizer "gpu") makes its own two, which run beside these instead of queueing behind them.
        self.streams = Streams(self.device)  # the stream helpers, shared with the ring
        self.h2d, self.d2h = self.streams.new(), self.streams.new()
        self._update_ring = UpdateRing(self.host, self.resident, self.streams)
        self._resident_ready: dict[int, object] = {}
        self._schedule: _Schedule | None = None
        self._offloaded: dict[int, tuple[torch.Tensor, object]] = {}
        # Device tensors that a copy out on the d2h stream reads, kept until the compute stream has
        # waited for that copy (`_hold`): (the schedule's place when held, the tensors, the copy's event).
        self._held: list[tuple[int, list[torch.Tensor], object]] = []
        # The norms of the host layers' gradients (param -> 0-dim fp32 on the device), measured as
        # the sums leave the device; the clip coefficient the update applies to those gradients.
        self._grad_norms: dict[torch.Tensor, torch.Tensor] = {}
        self._clip_coef: torch.Tensor | None = None
        self._clock = PhaseClock(self.device)
        self.refresh()
        model.layer_runner = self.run_layer
        model.embed_runner = self.embedding.run if self.embedding is not None else None

    # --- copies ----------------------------------------------------------------------------------

    def _hold(self, tensors: list[torch.Tensor], event) -> None:
        """Keep device `tensors`, which a copy on a side stream reads (done at `event`), until the
        compute stream is ordered after that copy (`_release`): freed then, on the compute stream,
        their blocks are safe to reuse at once. record_stream instead leaves events that torch's
        caching allocator waits for on the host each time it frees cached memory, as it does
        again and again under the budget's cap: a stall on the hot path each time."""
        self._held.append((self._schedule.reached, tensors, event))

    def _release(self, before: float = math.inf) -> None:
        """Let go of the tensors held at a schedule place before `before` (all of them by default),
        the compute stream first waiting for their copies. The schedule releases, as it reaches a
        place, those held two places back: a layer's work has run since, so the copy is normally
        done and the wait costs nothing."""
        if not self._held:
            return
        keep = []
        for place, tensors, event in self._held:
            if place < before:
                self.streams.wait(event)
            else:
                keep.append((place, tensors, event))
        self._held = keep

    def _to_device(self, sources: list[torch.Tensor], targets: list[torch.Tensor], after=None):
        """Copy host tensors into device tensors on the h2d stream once the compute stream has
        reached this point (so the targets' previous readers are done) and `after` (an event: the
        sources' last writer) has happened; returns the event."""
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))
            self.streams.wait(after, self.h2d)
        with self.streams.side(self.h2d):
            for target, source in zip(targets, sources):
                target.copy_(source, non_blocking=True)
        return self.streams.record(self.h2d)

    def _issue(self, schedule: _Schedule, k: int):
        """Start copy k of the schedule: (device tensors, event), or None when its source is not there yet."""
        kind, index, phase = schedule.items[k]
        if kind == "x":
            if index not in self._offloaded:
                return None
            host, offloaded = self._offloaded.pop(index)
            target = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            if offloaded is not None:
                self.h2d.wait_event(offloaded)
            return [target], self._to_device([host], [target])
        h = self.host[index]
        if kind == "g":  # the gradient sum of the step's earlier micro-batches, once it is out
            assert not h.narrow, "a narrow layer's step has one backward"
            target = torch.empty(h.numel, dtype=torch.float32, device=self.device)
            return [target], self._to_device([h.grad], [target], after=h.grad_out)
        if k in schedule.slot:
            targets = [buf[:g.numel] for buf, g in zip(self.ring[schedule.slot[k]], h.groups)]
        else:
            targets = [torch.empty(g.numel, dtype=g.dtype, device=self.device) for g in h.groups]
        return targets, self._to_device(h.staging, targets, after=h.written)

    def _offload_input(self, index: int, x: torch.Tensor) -> None:
        """Layer `index`'s input to host memory on the download stream; the device copy is freed
        (for reuse only after the copy) when the forward drops it."""
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.cuda)
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with self.streams.side(self.d2h):
            host.copy_(x, non_blocking=True)
        event = self.streams.record(self.d2h)
        self._hold([x], event)
        self._offloaded[index] = (host, event)
        self._schedule.pump()

    # --- layers ----------------------------------------------------------------------------------

    def run_layer(self, index: int, x, cos, sin, kv_store, row_mask):
        """Student.forward's layer runner: (layer output, None). kv_store: the chunk-recurrent
        engine's (student/long_context/) when a chunk runs, passed to the layer's attention; a
        chunk's forward and backward are those of a micro-batch here."""
        if index == 0:
            if self._schedule is not None:  # the held tensors' places, counted back from the new forward's first
                self._held = [(place - 2 * len(self.host), tensors, event) for place, tensors, event in self._held]
            self._schedule = _Schedule(self.plan, self.host, torch.is_grad_enabled(), self._issue, self._release,
                                       self.streams)
            self._offloaded.clear()
        # Timed: the forwards of training, with gradients or (chunk-recurrent pass 1) without.
        timed = torch.is_grad_enabled() or (kv_store is not None and self.model.training)
        if timed and index == 0:
            self._clock.mark("fwd0")
        if torch.is_grad_enabled():
            y = _LayerFunction.apply(x, cos, sin, row_mask, self._forward_layer, index, kv_store)
        else:
            y = self._call(index, self._weights(index, "fwd"), x, cos, sin, row_mask, kv_store)
        if timed and index == len(self.host) - 1:
            self._clock.mark("fwd1")
        return y, None

    def _forward_layer(self, ctx, x, cos, sin, row_mask, index: int, kv_store) -> torch.Tensor:
        """_LayerFunction's forward (`ctx`: its context): layer `index`'s output, and what its
        backward needs kept as the plan's activation decision says."""
        activation = self.plan.layers[index].activation
        weights = self._weights(index, "fwd")
        ctx.backward_layer, ctx.index, ctx.graph, ctx.kv_store = self._backward_layer, index, None, kv_store
        ctx.amp = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        if activation == "keep":
            with torch.enable_grad():
                x_ = x.detach().requires_grad_()
                flats = [w.detach().requires_grad_() for w in weights]
                y = self._call(index, flats, x_, cos, sin, row_mask, kv_store)
            ctx.graph = (x_, flats, y)
            ctx.save_for_backward()
            return y.detach()
        y = self._call(index, weights, x, cos, sin, row_mask, kv_store)
        ctx.save_for_backward(x if activation == "recompute" else None, cos, sin, row_mask)
        if activation == "offload":
            self._offload_input(index, x)
        return y

    def _backward_layer(self, ctx, dy) -> torch.Tensor:
        """_LayerFunction's backward: the gradient of the layer's input; its weight gradients go to
        `_grads_ready`."""
        index = ctx.index
        if index == len(self.host) - 1:
            self._clock.mark("bwd0")
        self._schedule.reach(index, "bwd")  # before its input or weights are taken
        if ctx.graph is not None:
            x_, flats, y = ctx.graph
            ctx.graph = None
        else:
            x, cos, sin, row_mask = ctx.saved_tensors
            if x is None:
                x = self._schedule.take(("x", index, "bwd"))[0]
            weights = self._weights(index, "bwd")
            enabled, dtype = ctx.amp
            with torch.enable_grad(), torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
                x_ = x.detach().requires_grad_()
                flats = [w.detach().requires_grad_() for w in weights]
                y = self._call(index, flats, x_, cos, sin, row_mask, ctx.kv_store)
            ctx.kv_store = None
        dx, *dflats = torch.autograd.grad(y, [x_, *flats], dy)
        self._grads_ready(index, dflats)
        if index == 0:
            self._clock.mark("bwd1")
        return dx

    def _weights(self, index: int, phase: str) -> list[torch.Tensor]:
        """Layer `index`'s working weights on the device, one flat tensor per group, ready to read."""
        self._schedule.reach(index, phase)
        if index in self.resident:
            self.streams.wait(self._resident_ready.pop(index, None))
            return self.resident[index]
        return self._schedule.take(("w", index, phase))

    def _call(self, index: int, flats: list[torch.Tensor], x, cos, sin, row_mask, kv_store=None):
        params = {}
        for flat, g in zip(flats, self.host[index].groups):
            for name, shape, piece in zip(g.names, g.shapes, flat.split(g.sizes)):
                params[name] = piece.view(shape)
        y, terms = functional_call(self.model.layers[index], params, (x, cos, sin, kv_store, row_mask))
        assert terms is None, "the sparse FFN is refused with offload before training"
        return y

    # --- gradients -------------------------------------------------------------------------------

    def _grads_ready(self, index: int, grads: list[torch.Tensor]) -> None:
        """Layer `index`'s weight gradients (flat, per group) to its gradient buffers: on the device
        for a layer whose states are there, added into its fp32 accumulators (the clipping measures
        them with the device parameters'). Else, and for a narrow layer on the device, the step's
        sum so far is formed on the device in fp32 (the first micro-batch's gradient widened; later
        ones added to the accumulator, which the schedule brought in: the additions the host would
        make, in its order), its per-parameter norms are taken there (the clipping's), and it goes
        to the layer's buffers: the host's on the d2h stream (a layer whose update loads during the
        backward, `UpdateRing.preload`, gets it in its slot too), a narrow device layer's on the
        compute stream (each group as the backward made it: the compute dtype's values)."""
        h = self.host[index]
        first, h.has_grad = not h.has_grad, True
        if h.narrow and not first:
            raise RuntimeError(f"layer {index} has a second backward in one step, but the offload runtime was built "
                               "with accumulates=False (its layers' gradients are kept in the compute dtype); build it "
                               "with accumulates=True for grad_accum > 1 or chunk-recurrent training")
        with torch.no_grad():
            if h.on_device and not h.narrow:
                for g, grad in zip(h.groups, grads):
                    h.grad[g.span].copy_(grad) if first else h.grad[g.span].add_(grad)
                return
            if first:
                total = torch.empty(h.numel, dtype=torch.float32, device=self.device)
                for g, grad in zip(h.groups, grads):
                    total[g.span].copy_(grad)  # exact: the widening autocast's cast backward does
            else:
                total = self._schedule.take(("g", index, "bwd"))[0]
                for g, grad in zip(h.groups, grads):
                    total[g.span].add_(grad)
            views = [total[span].view(shape) for span, shape in h.spans]
            self._grad_norms.update(zip(h.params, torch._foreach_norm(views, 2.0, dtype=torch.float32)))
            if self.plan.optimizer == "gpu" and index in self._update_ring.preloaded:
                self._update_ring.preload(index, total)
            # Out: the fp32 sum; narrow, each group's gradient as the backward made it (the compute
            # dtype's values: the same as the sum's) and the fp32 groups' part of the sum.
            sources = [grad if target.dtype != torch.float32 else total[g.span]
                       for g, grad, target in zip(h.groups, grads, h.grads)] if h.narrow else [total]
            targets = h.grads if h.narrow else [h.grad]
            if self.cuda and not h.on_device:
                self.d2h.wait_stream(torch.cuda.current_stream(self.device))
                with self.streams.side(self.d2h):
                    for target, source in zip(targets, sources):
                        target.copy_(source, non_blocking=True)
                h.grad_out = self.streams.record(self.d2h)
                self._hold(sources, h.grad_out)
            else:
                for target, source in zip(targets, sources):
                    target.copy_(source)

    def finish_grads(self) -> None:
        """Make the accumulators the parameters' .grad once every micro-batch's backward is queued.
        With the update on the CPU the host waits for the copies out (it reads the gradients next:
        the step's host wait); with the update on the GPU nothing waits (the update's copies in wait
        for them on their stream), so the host gradients may still be in flight: clip through
        `clip_grad_norm`, and `synchronize()` before reading them on the host.
        A narrow layer (a step is one backward, `accumulates=False`), its states on the host or on
        the device alike: its vectors' .grad are views of its fp32 buffer (not scaled by the
        clipping, before or after `step`: the coefficient is applied as the update widens them);
        its matrices' .grad stay None before and after `step` (their compute-dtype gradients are
        widened only where the update reads them, into a buffer the next layer's reuses; the
        clipping has their norms)."""
        self._clock.backward_done()
        self._release()
        if self.embedding is not None:  # its parameter and gradient on the device until the end of `step`
            self.embedding.finish_grads()
        if self.plan.optimizer == "cpu":
            for h in self.host:
                if h.grad_out is not None:
                    h.grad_out.synchronize()
        self._clock.host_mark("grads1")
        for h in self.host:
            if h.has_grad:
                for p, view in zip(h.params, h.grad_views):
                    if view.dtype == p.dtype:  # a narrow gradient is widened where an update reads it
                        p.grad = view

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """student.optim.clip.clip_grad_norm_foreach over the model's parameters, with no host pass
        over gradients: the host layers' and the narrow layers' per-parameter norms were measured
        on the device in the backward; the other device gradients are scaled now; those layers'
        inside `step` (the update on the GPU scales each slice there; on the CPU the host reads the
        coefficient once; a narrow device layer's is scaled as it is widened). Returns the total
        norm (a 0-dim fp32 tensor on the device); max_norm inf only measures."""
        max_norm = check_max_norm(max_norm)
        known = {p: norm for p, norm in self._grad_norms.items()
                 if p.grad is not None or p in self._narrow_params}
        total, grads = total_grad_norm(self.model.parameters(), known)
        self._clip_coef = None
        if not math.isinf(max_norm):
            coef = clip_coefficient(total, max_norm)
            scale_grads_(grads, coef)
            self._clip_coef = coef if known else None
        return total

    # --- the update ------------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step over every parameter (where plan.optimizer says), then the working
        copies from the updated masters. Call after `finish_grads` and `clip_grad_norm`."""
        self._clock.host_mark("step0")
        self._clock.device_mark("step0")
        if self.embedding is not None:  # it steps with the device parameters
            self.embedding.states_in(optimizer)
        if self.plan.optimizer == "cpu":
            self._step_on_host(optimizer)
        else:
            self._step_on_device(optimizer)
        if self.embedding is not None:
            self.embedding.home(optimizer)
        self._clock.device_mark("updated")
        self._clock.host_mark("updated")
        for h in self.host:
            h.has_grad = False
        self._grad_norms, self._clip_coef = {}, None
        self._update_ring.end_step()

    def _step_on_host(self, optimizer) -> None:
        """The device parameters (embeddings, head, layers whose states are on the device:
        `_step_device_params`) step first, queued on the device; then the host layers one after
        another on the CPU, each one's gradient scaled by the clip coefficient (read once), staging
        copy cast and (resident) working weights sent to the device as soon as it is updated."""
        held = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
        if self.cuda:
            self.h2d.synchronize()  # no upload still reads a staging copy about to be rewritten
        self._step_device_params(optimizer, held)
        coef = self._clip_coef.to("cpu") if self._clip_coef is not None else None  # after the device's work is queued
        for index, h in enumerate(self.host):
            if h.on_device or not h.needs_update(held):
                continue
            if h.narrow:
                self._step_widened(optimizer, h, held, self._widened_buffer(), coef)
            else:
                if coef is not None:
                    h.grad.mul_(coef)
                members = set(h.params)
                for p in held:
                    p.grad = held[p] if p in members else None
                optimizer.step()
            self._refresh_layer(index)
        for p in held:
            p.grad = held[p]

    def _step_device_params(self, optimizer, held: dict) -> None:
        """The parameters on the device (`held`: each parameter's gradient) step, queued there: the
        static ones and the layers whose states are on the device in one optimizer step, the
        narrow ones of those one layer at a time, each widened (and scaled by the clip coefficient
        in the same pass) into one fp32 buffer of the largest, made for this update and shared
        (the backward's fp32 sums are gone by now: `LayerCosts.gpu_widened_bytes`); then the
        working weights of those layers."""
        for p in held:
            p.grad = held[p] if p not in self._host_params and p not in self._narrow_params else None
        optimizer.step()
        narrow = [h for h in self.host if h.on_device and h.narrow and h.has_grad]
        if narrow:
            widened = torch.empty(max(h.numel for h in narrow), dtype=torch.float32, device=self.device)
            for h in narrow:
                self._step_widened(optimizer, h, held, widened, self._clip_coef)
        self._refresh_device_layers()

    def _step_widened(self, optimizer, h: HostLayer, held: dict, out: torch.Tensor, coef) -> None:
        """Narrow layer `h`'s optimizer step: its gradient widened into `out` (fp32, where it is;
        scaled by `coef` in the same pass, None: not scaled) is its parameters' .grad, and no other
        parameter has one (`held`: the parameters the optimizer holds)."""
        grads = dict(zip(h.params, h.widen_grads(out, coef)))
        for p in held:
            p.grad = grads.get(p)
        optimizer.step()

    def _widened_buffer(self) -> torch.Tensor:
        """The update on the CPU: one fp32 buffer as large as the largest host layer, which each narrow
        layer's gradient is widened into for its optimizer step (the optimizer reads fp32 .grad)."""
        if self._widened is None:
            self._widened = torch.empty(max(h.numel for h in self.host if not h.on_device), dtype=torch.float32)
        return self._widened

    def _step_on_device(self, optimizer) -> None:
        """The host layers, last to first, through the update ring's slots (`UpdateRing.update`),
        then the device parameters; nothing here waits on the host. A layer's copies out overlap the
        next layers' updates and the next step (what reads them waits for them on its stream)."""
        held = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
        for p in held:
            p.grad = None
        self._update_ring.update(optimizer, held, self._clip_coef)
        self._step_device_params(optimizer, held)
        for p in held:
            p.grad = held[p] if p not in self._host_params else None

    def refresh(self) -> None:
        """The staging copies and the resident working weights from the masters (after loading a
        checkpoint into the model)."""
        self.synchronize()  # no copy still reads or writes a host buffer about to be rewritten
        self._refresh_device_layers()
        for index, h in enumerate(self.host):
            if not h.on_device:
                self._refresh_layer(index)

    def _refresh_layer(self, index: int) -> None:
        """A host layer's staging copies from its master; its resident working weights from them."""
        h = self.host[index]
        with torch.no_grad():
            for g, staging in h.separate_staging():
                staging.copy_(h.master[g.span])
        if index in self.resident:
            self._resident_ready[index] = self._to_device(h.staging, self.resident[index], after=h.written)

    def _refresh_device_layers(self) -> None:
        """The working weights of the layers whose states are on the device: a cast there."""
        with torch.no_grad():
            for h in self.host:
                if h.on_device:
                    for g, staging in h.separate_staging():
                        staging.copy_(h.master[g.span])

    def phase_s(self) -> dict[str, float]:
        """The last step's phases, seconds (student/planner/solve.py's PHASES; the plan's predicted.phase_s
        has the same names): call right after `step`, on the steps whose figures are logged: it
        waits for the step's work on the device (a host sync). {} before a step."""
        return self._clock.phases(self.plan.optimizer)

    def synchronize(self) -> None:
        """Every copy done: the host masters, states and gradients may be read (a checkpoint, the
        end of training; the update's copies out are otherwise still in flight after `step`)."""
        self.streams.synchronize()
        if self.embedding is not None:
            self.embedding.synchronize()

    def host_bytes(self, optimizer=None) -> int:
        """Bytes the offloaded layers hold in host memory: masters, gradients, separate staging copies
        and (given the optimizer) their optimizer states."""
        total = sum(h.master.nbytes + sum(g.nbytes for g in h.grads) + sum(s.nbytes for _, s in h.separate_staging())
                    for h in self.host if not h.on_device)
        total += self._widened.nbytes if self._widened is not None else 0
        total += self.embedding.host_bytes() if self.embedding is not None else 0
        if optimizer is not None:
            total += sum(v.nbytes for p in self._host_params for v in optimizer.state.get(p, {}).values()
                         if isinstance(v, torch.Tensor))
        return total

    def close(self) -> None:
        """Wait for every copy and leave the model's layers to run by themselves again (their
        weights stay in host memory)."""
        self.synchronize()
        self.model.layer_runner = self.model.embed_runner = None
        for h in self.host:
            h.unpin_buffers()
        if self.embedding is not None:
            self.embedding.unpin_buffers()
