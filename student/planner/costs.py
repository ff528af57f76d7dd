"""The offload planner's cost model (LazyTrain, arXiv 2608.11919 §3.2): what a plan's step costs.

`LayerCosts` and `CostTable` (student/planner/table.py) hold a student's measured step
(student/planner/profile.py fills them); `predict` runs the runtime's queues in order
(student/offload/runtime.py carries a plan out,
student/offload/plan.py says what each decision means) and gives the step time, its phases and
the peak memory on each side (student/planner/peaks.py sums the peaks). student/planner/solve.py's
mixed-integer program encodes `predict` exactly.
No torch, no solver.
"""

from __future__ import annotations

from dataclasses import replace

from student.offload.plan import UPDATE_SLOTS, OffloadPlan, Predicted
from student.planner.peaks import peaks
from student.planner.table import ChunkSeconds, CostTable, KVPages, LayerCosts

# The cost table's types (student/planner/table.py) are named here too: the model's input.
__all__ = ["PHASES", "LayerCosts", "ChunkSeconds", "KVPages", "CostTable", "predict", "kv_options", "kv_residency",
           "kept_attention", "embedding_on_host", "with_layers", "pass_one_forwards", "pass_one_s"]


# The phases of a step, in order, as `predict` returns them and OffloadRuntime.phase_s measures them:
#   forward   the decoder layers' forwards (every micro-batch), with their waits for copies in
#   head      the embeddings, final norm, head and loss, forward and backward
#   backward  the decoder layers' backwards, recomputation and waits for copies in
#   grads     after the backward until the host has the gradients it reads (the update on the CPU:
#             the copies out the backward did not hide; on the GPU: none)
#   clip      the trainer's clipping by the global norm (the norms were taken on the device in the
#             backward: the total and the coefficient)
#   optimizer the update (on the CPU: the host layers one after another; on the GPU: the ring of
#             slots until the compute stream is through, the device parameters after)
#   refresh   after the update until the resident working weights are on the GPU again (the update
#             on the CPU), or until what the next step waits for is there (on the GPU: gradients
#             still on their way out, a streamed layer's write-back)
PHASES = ("forward", "head", "backward", "grads", "clip", "optimizer", "refresh")


def predict(costs: CostTable, plan: OffloadPlan) -> Predicted:
    """Step time, its phases (PHASES) and peak memory of `plan`, by running the runtime's queues in order.

    Assumptions (student/offload/runtime.py carries the plan out; this is what it is modelled as):
    - Three device queues, each in order: compute, host->device copies (H2D), device->host copies
      (D2H); and the host. A copy takes bytes / measured bandwidth of its direction alone; the two
      directions run at once, sharing the bus (below); compute does not slow copies down nor
      copies compute. A host pass over gradients takes the bytes it reads and writes / host_bytes_per_s.
    - The bus. While both directions copy, each moves at its duplex rate (h2d_duplex_bytes_per_s,
      d2h_duplex_bytes_per_s; below the rates alone on the H200: row
      offload/llama-3.1-8b-T8192-gpu40GiB/planned@6a52d40's update). The rule: x bytes in and y
      out copied together, overlapping while both have bytes left, take max(x/h2d + y delay_in,
      y/d2h + x delay_out), delay_in = (1 - h2d_duplex/h2d)/d2h_duplex and delay_out its mirror
      (`CostTable.duplex_delays`): the overlapped part at the duplex rates, the rest at the rate
      alone; with duplex rates equal to the rates alone, max(x/h2d, y/d2h), which the two queues
      give already. Each term bounds the bus over any time window (bytes in over h2d plus bytes
      out times delay_in fill the window while copies in run, and no more otherwise), so each
      copy's end is also at least its window's start plus its direction's bytes in the window at
      the rate alone plus, at their delay, the other direction's bytes whose copies the model's
      own waits end before it. The windows: the forward, from its start (layer i's weights wait
      for layer i-d-1's forward, which waited for the inputs out of layers up to i-2d-2); the
      backward, from the end of the forward (layer i's copies in wait for layer i+d+1's backward,
      which waited for the gradients out of layers from i+2d+2 up); the update's ring, from the
      end of the backward (the load of position k >= UPDATE_SLOTS waits for the copies out of
      positions up to k - UPDATE_SLOTS); a copy out comes after the copies in of its own and
      earlier layers or positions (its compute waited for them). Copies outside a window (the
      ring's first loads, in the backward; gradients still going out after it) are left out of
      it: there the bound is below the bus's.
    - Forward, layer i: its weights (params "stream") are copied when layer i-d-1's forward ends
      (d = prefetch_depth; at the start for the first d+1 layers), and its forward waits for them.
      An "offload" layer's input is copied out after its forward; the forward of layer i+d+1 waits
      until that copy is done (at most d+1 offloaded inputs are on the GPU at once).
    - Then the head (embeddings, norm, head, loss; `head_s`), then the backward, layers in reverse:
      layer i's weights (stream, unless kept since the forward: "keep") and its input (offload) are
      copied in when the backward of layer i+d+1 ends (at the end of the forward for the top d+1
      layers); its backward waits for them and runs the forward again first unless "keep". A
      layer whose states are on the host sends its weight gradient sum out after its backward (fp32;
      with one micro-batch in the working dtypes: `LayerCosts.grad_bytes`) (the backward of layer i-d-1 waits until that copy is done); with more than one
      micro-batch its accumulator comes in with its other copies first (the sum is formed on the
      device; so in every micro-batch, the first's too: a little pessimistic). The gradients'
      norms are taken on the device meanwhile (not timed); a "gpu" layer accumulates there.
    - Micro-batches run one after another, each starting on empty queues; the step is
      (micro_batches - 1) x one micro-batch + the last one. Clipping takes no time of its own (the
      norms are known; the coefficient is applied inside the update). Then the optimizer:
      "cpu": once every gradient is on the host, the host layers update on the CPU one after
      another (each scaling its gradient by the coefficient first: a pass reading the gradient and
      writing it in fp32, widened in the same pass with one micro-batch; then the cast of its
      staging copy), each resident one's working weights going to the GPU
      after its update; the static parameters and the "gpu" layers update on the GPU meanwhile.
      "gpu": the host layers, last to first, through a ring of UPDATE_SLOTS slots, on three
      queues of their own (copies in, compute, copies out; `_ring`): the layer in position k of
      that order loads its master, gradient and states once the copies out of position
      k - UPDATE_SLOTS are done and its gradient is on the host; the first UPDATE_SLOTS positions
      load master and states right after their backward (their gradient is on the device); each
      updates once loaded, then master, states and staging copy go out. Then the static
      parameters and the "gpu" layers update. The copies out overlap the next step: the step ends
      when the compute queue is through, unless the next step's forward of a streamed host layer
      would wait for its copy out (its weights come in after it, and the layers before it take at
      least their forward time), which delays that step as much.
    - Chunk-recurrent training: pass 1 (`pass_one_s`: no-grad forwards, measured with the weights
      resident; a streamed layer waits for its weights as in the forward above) runs before the
      chunks' forwards and backwards, which are the micro-batches above; the key/value store's
      device bytes are held at the turnaround.
    - GPU peak: the larger of the turnaround (end of the forward) and the optimizer phase.
      Turnaround: static + weights of resident and kept layers + master, gradient and states of
      "gpu" layers (with one micro-batch the gradient in the working dtypes) + (d+1) buffers of the
      largest streamed layer + 2 (d+1) of the largest offloaded input (copies out and back in
      flight) + with the update on the GPU its ring (the first slots fill in the backward; the
      slots stay allocated) + the largest of: every layer's held activations (keep: the input and
      everything saved; recompute: the input) and the head's input and workspace (while it runs);
      the same and the input embedding's gradient as its backward makes it (at the end of the
      backward); for each layer j, the held activations of layers 0..j (those above are freed by
      then) and layer j's backward transients. The last two beside a tied head's gradient waiting
      for the embedding's (at one backward a step the static bytes hold the embedding's .grad only
      from the end: less it throughout). Layer j's backward transients: (d+1) fp32 gradients (2
      (d+1) with more than one micro-batch: accumulators coming in) and one compute-dtype gradient
      of the largest layer (with one micro-batch: (d+1) compute-dtype gradients on their way out
      and one fp32 sum) + its workspace + its recomputed activations unless it keeps them.
      Optimizer phase: static + resident weights + "gpu" layers' state + the ring + with one
      micro-batch the fp32 buffer the "gpu" layers' updates widen their gradients into, one of the
      largest such layer's master (`LayerCosts.gpu_widened_bytes`; the turnaround's fp32 sum
      being formed is as large, so it does not raise the peak).
    - An input embedding in host memory (`embedding_on_host`): its bytes on the GPU in the
      optimizer phase only (`CostTable.embedding_update_bytes`), its copies in `head_s`, `pass1_s`
      and `static_update_s`.
    - Host peak: static + the host layers' master, gradient, states and staging copy + the
      offloaded inputs of one micro-batch (on a GPU each the `pinned_block` torch's allocator
      gives it: `CostTable.offloaded_bytes`) + with one micro-batch and the update on the CPU the fp32
      buffer the largest host layer's gradient is widened into.
    - Not modelled: the copy back of an offloaded input waiting for its copy out (the forward and
      backward between them hide it); the update's copies in sharing the bus with the backward's
      (the first slots' loads); the ring waiting on a "gpu" layer's position as if it had a slot;
      the ring's copies out sharing the bus with the next step's.
    """
    L, d, m = len(costs.layers), plan.prefetch_depth, costs.micro_batches
    assert len(plan.layers) == L, f"the plan has {len(plan.layers)} layers, the cost table {L}"
    h2d = lambda n: n / costs.h2d_bytes_per_s
    d2h = lambda n: n / costs.d2h_bytes_per_s
    host_pass = lambda n: n / costs.host_bytes_per_s
    c, p = costs.layers, plan.layers
    keep = [lp.activation == "keep" for lp in p]
    offload = [lp.activation == "offload" for lp in p]
    stream = [lp.params == "stream" for lp in p]
    on_host = [lp.states == "host" for lp in p]
    backward = [c[i].backward_s + (0.0 if keep[i] else c[i].recompute_s) for i in range(L)]
    delay_in, delay_out = costs.duplex_delays()

    # Forward: copy_in / copy_out are the ends of the H2D and D2H queues, so far; bus_in / bus_out
    # the bus's bounds on them (the docstring's windows).
    copy_in = copy_out = bus_in = bus_out = 0.0
    fwd_end, out_end, stall = [0.0] * L, [0.0] * L, [0.0] * L
    for i in range(L):
        issue = fwd_end[i - d - 1] if i - d - 1 >= 0 else 0.0
        j = i - 2 * d - 2  # the inputs of layers up to j are out before layer i's weights are in
        bus_in += stream[i] * h2d(c[i].weight_bytes) + (offload[j] * c[j].boundary_bytes * delay_in if j >= 0 else 0.0)
        copy_in = max(max(copy_in, issue) + stream[i] * h2d(c[i].weight_bytes), bus_in)
        ready = fwd_end[i - 1] if i else 0.0
        start = max(ready, copy_in, out_end[i - d - 1] if i - d - 1 >= 0 else 0.0)
        stall[i] += start - ready
        fwd_end[i] = start + c[i].forward_s
        bus_out += offload[i] * d2h(c[i].boundary_bytes) + stream[i] * c[i].weight_bytes * delay_out
        copy_out = max(max(copy_out, fwd_end[i]) + offload[i] * d2h(c[i].boundary_bytes), bus_out)
        out_end[i] = copy_out

    # Backward, top layer first.
    compute = fwd_end[-1] + costs.head_s
    accumulated = costs.micro_batches > 1  # a host layer's sum so far comes in before its gradient is added
    bwd_end, grad_end = [0.0] * L, [0.0] * L
    bus_in = bus_out = fwd_end[-1]
    grad_bytes = [on_host[i] * c[i].grad_bytes(costs.accumulates) for i in range(L)]
    for i in reversed(range(L)):
        issue = bwd_end[i + d + 1] if i + d + 1 < L else fwd_end[-1]
        moved_in = (stream[i] * (not keep[i]) * c[i].weight_bytes + offload[i] * c[i].boundary_bytes
                    + accumulated * on_host[i] * c[i].master_bytes)
        j = i + 2 * d + 2  # the gradients of layers from j up are out before layer i's copies in are
        bus_in += h2d(moved_in) + (grad_bytes[j] * delay_in if j < L else 0.0)
        copy_in = max(max(copy_in, issue) + h2d(moved_in), bus_in)
        start = max(compute, copy_in, grad_end[i + d + 1] if i + d + 1 < L else 0.0)
        stall[i] += start - compute
        bwd_end[i] = compute = start + backward[i]
        bus_out += d2h(grad_bytes[i]) + moved_in * delay_out
        copy_out = max(max(copy_out, compute) + d2h(grad_bytes[i]), bus_out)
        grad_end[i] = copy_out
    micro_batch = max(compute, copy_in, copy_out)

    # The optimizer, after the clipping (the norms were taken in the backward: no time of its own).
    device_update = costs.static_update_s + sum(x.update_gpu_s for x, h in zip(c, on_host) if not h)
    if plan.optimizer == "cpu":  # once every gradient is on the host
        cpu = start = max(compute, copy_out)
        for i in range(L):
            cpu += on_host[i] * (c[i].update_cpu_s + host_pass(c[i].grad_bytes(costs.accumulates) + c[i].master_bytes))
            copy_in = max(copy_in, cpu) + (on_host[i] and not stream[i]) * h2d(c[i].weight_bytes)
        updated = max(cpu, start + device_update)
        last = max(micro_batch, updated, copy_in)
    else:
        start = compute
        updated, wb_end = _ring(costs, plan, start, bwd_end, grad_end)
        updated += device_update
        last = max(micro_batch, updated, *[wb_end[i] + h2d(c[i].weight_bytes) - sum(x.forward_s for x in c[:i])
                                           for i in range(L) if on_host[i] and stream[i]])
    pass1_s = pass_one_s(costs, plan)
    step_s = (m - 1) * micro_batch + last + pass1_s
    phase_s = dict(forward=m * fwd_end[-1] + pass1_s, head=m * costs.head_s, backward=m * (compute - fwd_end[-1] - costs.head_s),
                   grads=(m - 1) * (micro_batch - compute) + start - compute, clip=0.0, optimizer=updated - start,
                   refresh=last - updated)

    gpu_peak, host_peak = peaks(costs, plan)
    layer_s = tuple(m * (c[i].forward_s + backward[i] + stall[i]) for i in range(L))
    return Predicted(step_s=step_s, gpu_peak_bytes=gpu_peak, host_peak_bytes=host_peak, layer_s=layer_s,
                     phase_s=phase_s)


def pass_one_forwards(costs: CostTable) -> int:
    """Chunk-recurrent training: the no-grad chunk forwards of pass 1 in a step (every chunk but the
    last of each micro-batch); 0 for whole sequences."""
    return costs.micro_batches - costs.micro_batches // costs.chunks


def pass_one_s(costs: CostTable, plan: OffloadPlan) -> float:
    """Pass 1's seconds under `plan` (predict's docstring): `pass_one_forwards` forwards, each from
    empty queues (the runtime schedules each forward anew), each layer taking pass1_s spread evenly
    over the forwards and layers and waiting for its streamed weights, which come in when the
    forward of the layer `prefetch_depth` + 1 places before it ends. No copies out (nothing is kept
    for a backward). With every layer's weights resident, pass1_s as measured. The even spread
    underestimates the waits of the early chunks (fewer past pages, a shorter forward than the
    mean) and overestimates the late ones'."""
    n, L, d = pass_one_forwards(costs), len(costs.layers), plan.prefetch_depth
    stream = [lp.params == "stream" for lp in plan.layers]
    if n == 0 or not any(stream):
        return costs.pass1_s
    seconds = costs.pass1_s / (n * L)
    copy_in, fwd_end = 0.0, [0.0] * L
    for i in range(L):
        issue = fwd_end[i - d - 1] if i - d - 1 >= 0 else 0.0
        copy_in = max(copy_in, issue) + stream[i] * costs.layers[i].weight_bytes / costs.h2d_bytes_per_s
        fwd_end[i] = max(fwd_end[i - 1] if i else 0.0, copy_in) + seconds
    return n * fwd_end[-1]


def _ring(costs: CostTable, plan: OffloadPlan, start: float, bwd_end: list[float], grad_end: list[float]
          ) -> tuple[float, list[float]]:
    """The update on the GPU through the ring of UPDATE_SLOTS slots (predict's docstring): (end of
    the host layers' updates on the compute queue, per layer the end of the copies-out queue after
    it). Three queues, layers last to first; a layer that stays on the GPU passes through in no
    time (but the queues' ends carry over it). From `start` on, the loads and the copies out share
    the bus (predict's docstring)."""
    c, L, R = costs.layers, len(costs.layers), UPDATE_SLOTS
    h2d = lambda n: n / costs.h2d_bytes_per_s
    d2h = lambda n: n / costs.d2h_bytes_per_s
    delay_in, delay_out = costs.duplex_delays()
    host = [lp.states == "host" for lp in plan.layers]
    out_bytes = [host[i] * (c[i].master_bytes + c[i].state_bytes + c[i].staging_bytes) for i in range(L)]
    load, update, written, wb_end = 0.0, start, [], [0.0] * L
    bus_in = bus_out = start
    for k, i in enumerate(reversed(range(L))):
        in_bytes = 0
        if k < R:  # loads in the backward: master and states; the gradient is on the device
            load = max(load, bwd_end[i]) + host[i] * h2d(c[i].master_bytes + c[i].state_bytes)
        else:  # positions up to k - R (the last: layer i + R) are written back before this load ends
            in_bytes = host[i] * c[i].update_in_bytes(costs.accumulates)
            bus_in += h2d(in_bytes) + out_bytes[i + R] * delay_in
            load = max(max(load, grad_end[i], written[k - R]) + h2d(in_bytes), bus_in)
        update = max(update, load) + host[i] * c[i].update_gpu_s
        bus_out += d2h(out_bytes[i]) + in_bytes * delay_out
        wb = max(max(written[-1] if written else 0.0, update) + d2h(out_bytes[i]), bus_out)
        written.append(wb)
        wb_end[i] = wb
    return update, wb_end


# --- where the key/value pages live ---------------------------------------------------------------


def kv_options(kv: KVPages) -> list[tuple[bool, int]]:
    """The residencies the planner prices, (kv_offload, offload_pages): every page on the GPU, and
    on a GPU the pages offloaded with page sets of all of a layer's pages, a quarter, a sixteenth,
    a sixty-fourth of them and the run's offload_pages (the smaller the set, the less the GPU holds
    and the more copies each attention call makes), none smaller than a chunk's pages. Each set is
    one more attention call and merge over all of the chunk's queries, which `_page_copy_s` does
    not price: with sets of a sixteenth of a chunk they cost more than the attention itself (row
    `offload/qwen2-0.5b-T131072-gpu7.25GiB-chunks16384-kvoffload/planned@811dfaa`, whose plan took
    chunks of 32,768 and sets of 32 pages); with sets no smaller than a chunk, at most one call
    and merge per chunk of keys, which the profile's own sets pay too."""
    options = [(False, kv.offload_pages)]
    if kv.offloadable:
        floor = min(-(-kv.chunk_tokens // kv.page_tokens), kv.num_pages)
        sizes = {max(-(-kv.num_pages // 4**k), floor) for k in range(4)} | {min(kv.offload_pages, kv.num_pages)}
        options += [(True, size) for size in sorted(sizes)]
    return options


def kv_residency(costs: CostTable, kv_offload: bool, offload_pages: int) -> CostTable:
    """`costs` (a chunk-recurrent table, measured with the store `costs.kv`) with the pages resident
    or offloaded in sets of `offload_pages`: the store's device and host bytes are those of
    `KVPages.bytes`, and its page copies that the compute does not hide (`_page_copy_s`) change
    pass 1's seconds and the layers' backward seconds by what they add beyond the measured
    residency's (the measured times hold that one's copies already)."""
    old = costs.kv
    assert old is not None, "a chunk-recurrent cost table (profile with --chunk-tokens)"
    new = replace(old, kv_offload=kv_offload, offload_pages=offload_pages)
    (forward_old, backward_old), (forward_new, backward_new) = _page_copy_s(old, costs), _page_copy_s(new, costs)
    per_step = costs.micro_batches // costs.chunks  # grad_accum
    layers = tuple(replace(x, backward_s=max(x.backward_s + b_new - b_old, 0.0))
                   for x, b_old, b_new in zip(costs.layers, backward_old, backward_new))
    (gpu_old, host_old, _), (gpu_new, host_new, resident) = old.bytes(), new.bytes()
    return replace(costs, layers=layers, pass1_s=max(costs.pass1_s + per_step * (forward_new - forward_old), 0.0),
                   kv_gpu_bytes=costs.kv_gpu_bytes - gpu_old + gpu_new,
                   static_host_bytes=costs.static_host_bytes - host_old + host_new, resident_pages=resident, kv=new)


def embedding_on_host(costs: CostTable) -> CostTable:
    """`costs` (the untied input embedding on the GPU, as measured) with it in host memory
    (OffloadPlan.embedding "host"; student/offload/embedding.py). Memory: its master, gradient and
    states leave the static GPU bytes for the host's, its backward's gradient of the matrix's size
    (`late_grad_bytes`) is gone, and in the optimizer phase master, gradient and states are on the
    GPU (`CostTable.embedding_update_bytes`). Time, on the compute queue: each micro-batch's forward
    copies its rows in and its backward their gradient out (the head's seconds; pass 1's forwards
    copy rows in too); the update copies master, states and the touched rows' gradient in and master
    and states out (the static update's seconds). Not modelled: the host's gathers and sums (the
    host thread, while the device runs what is queued) and the host sync that brings each
    micro-batch's token ids over."""
    E, S = costs.embedding_bytes, costs.embedding_state_bytes
    assert E > 0 and costs.embedding == "gpu", "a table with an untied input embedding on the GPU"
    h2d = lambda n: n / costs.h2d_bytes_per_s
    d2h = lambda n: n / costs.d2h_bytes_per_s
    rows = costs.layers[0].boundary_bytes  # a micro-batch's embedding output: layer 0's input
    update = h2d(E + S + min(E, costs.micro_batches * rows)) + d2h(E + S)
    return replace(costs, static_gpu_bytes=costs.static_gpu_bytes - 2 * E - S, late_grad_bytes=0,
                   static_host_bytes=costs.static_host_bytes + 2 * E + S, head_s=costs.head_s + h2d(rows) + d2h(rows),
                   pass1_s=costs.pass1_s + pass_one_forwards(costs) * h2d(rows),
                   static_update_s=costs.static_update_s + update, embedding="host")


def with_layers(costs: CostTable, n: int) -> CostTable:
    """`costs` of the same student with `n` decoder layers, each costing what its first did (a
    shape's decoder layers are alike): the whole step of a length whose step outlasts what one run
    may take, predicted from a profile of fewer layers (bench_offload_gpu.py --predict-layers).
    Pass 1's seconds are the layers' (`profile`), so they scale with the count, and so do the
    key/value store's bytes; the static part (embeddings, head, loss) stays. For a table as
    `profile` measured it: `kv_residency` prices the top layer's page copies apart (no layer above
    prefetches them), so a residency is priced after, on the table of every layer."""
    more = replace(costs, layers=(costs.layers[0],) * n, pass1_s=costs.pass1_s * n / len(costs.layers))
    if costs.kv is None:
        return more
    new = replace(costs.kv, num_layers=n)
    (gpu_old, host_old, _), (gpu_new, host_new, resident) = costs.kv.bytes(), new.bytes()
    return replace(more, kv_gpu_bytes=costs.kv_gpu_bytes - gpu_old + gpu_new,
                   static_host_bytes=costs.static_host_bytes - host_old + host_new, resident_pages=resident, kv=new)


def kept_attention(costs: CostTable, keep: int | None) -> CostTable:
    """`costs` (a chunk-recurrent table, measured with the store `costs.kv`) with pass 1 keeping the
    attention outputs of `keep` chunks (`kept_chunks`; None: all): each layer's forward_s is its
    pass-2 forward over the chunks (`ChunkSeconds.forward_s`; the backward's recomputation takes
    pass 2's own output whatever `keep` is: `LayerCosts.recompute_s`), and the kept outputs'
    bytes are `KVPages.bytes`'. Pass 1's seconds stay as measured (a chunk not kept saves only
    its output's copy out)."""
    old = costs.kv
    assert old is not None, "a chunk-recurrent cost table (profile with --chunk-tokens)"
    new = replace(old, keep_chunks=keep)
    layers = tuple(x if x.chunk is None else replace(x, forward_s=x.chunk.forward_s(costs.chunks, keep))
                   for x in costs.layers)
    (gpu_old, host_old, _), (gpu_new, host_new, _) = old.bytes(), new.bytes()
    return replace(costs, layers=layers, kv_gpu_bytes=costs.kv_gpu_bytes - gpu_old + gpu_new,
                   static_host_bytes=costs.static_host_bytes - host_old + host_new, kv=new)


def _page_copy_s(kv: KVPages, costs: CostTable) -> tuple[float, list[float]]:
    """(seconds a micro-batch's forwards wait for pages, per layer the seconds a chunk's backward
    waits for them on average) with the pages offloaded; nothing when they are resident.

    The model, per chunk j that reads pages 0 .. p_j (of every row), in sets of S pages, each copy
    taking copy_latency_s plus its bytes over the measured bandwidth of its direction:
    - forward (pass 1, and the last chunk's in pass 2): each layer copies in p_j pages of keys and
      values while it computes (the next set while one is read): it waits max(0, copies - its
      forward); the first layer's first set is not prefetched and is waited for whole;
    - backward: each layer copies in the pages and their gradient pages (zeros made on the device
      for the last chunk, whose backward comes first) and sends the gradient pages back while it
      computes: it waits for max(0, the longer direction - its backward), each direction's time
      with the other's bytes at their delay (predict's bus rule: both directions run together),
      and for its last set's gradients to be home; the top layer's first set is waited for whole.
    Not modelled: the bus shared with the runtime's other copies, the set split at the chunk's
    first page, page-attention's cost per set beyond its copies (`kv_options` keeps it small)."""
    if not kv.offloaded:
        return 0.0, [0.0] * len(costs.layers)
    h2d, d2h, latency = costs.h2d_bytes_per_s, costs.d2h_bytes_per_s, costs.copy_latency_s
    delay_in, delay_out = costs.duplex_delays()
    starts = range(0, kv.seq_tokens, kv.chunk_tokens)
    forward, backward = 0.0, [0.0] * len(costs.layers)
    for j, start in enumerate(starts):
        pages = -(-min(start + kv.chunk_tokens, kv.seq_tokens) // kv.page_tokens)
        sets, first = -(-pages // kv.offload_pages), min(kv.offload_pages, pages)
        fresh = j == len(starts) - 1
        read = sets * 2 * latency + pages * kv.kv_page_bytes / h2d
        grads_in = 0.0 if fresh else sets * 2 * latency + pages * kv.grad_page_bytes / h2d
        grads_out = sets * 2 * latency + pages * kv.grad_page_bytes / d2h
        forward += 2 * latency + first * kv.kv_page_bytes / h2d + sum(max(0.0, read - x.forward_s) for x in costs.layers)
        bytes_in, bytes_out = pages * (kv.kv_page_bytes + (not fresh) * kv.grad_page_bytes), pages * kv.grad_page_bytes
        copies_in, copies_out = read + grads_in + bytes_out * delay_in, grads_out + bytes_in * delay_out
        for i, x in enumerate(costs.layers):
            backward[i] += (max(0.0, copies_in - x.backward_s, copies_out - x.backward_s)
                            + 2 * latency + first * kv.grad_page_bytes / d2h)
        backward[-1] += 2 * latency + first * (kv.kv_page_bytes + (not fresh) * kv.grad_page_bytes) / h2d
    return forward, [b / len(starts) for b in backward]
