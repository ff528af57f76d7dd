"""The offload planner's cost table: what one training step of a student costs, as measured
(student/planner/profile.py fills it). `LayerCosts` per decoder layer (with `ChunkSeconds` for
chunk-recurrent training), `KVPages` the chunk-recurrent key/value store, `CostTable` the whole
step. The input of the cost model (student/planner/costs.py's `predict`), of the peaks
(student/planner/peaks.py) and of the solver (student/planner/solve.py); a leaf below them: no
torch, no solver, none of the planner's other modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from student.long_context.config import kept_chunks

__all__ = ["ChunkSeconds", "LayerCosts", "KVPages", "CostTable", "pinned_block", "past_read_share"]


def pinned_block(n: int) -> int:
    """Bytes of pinned host memory a request of `n` bytes holds when it comes from torch's pinned
    allocator (torch.empty(..., pin_memory=True): CachingHostAllocator, whose free lists are by
    power of two): the next power of two. The runtime's buffers of a step (offloaded layer inputs,
    kept attention outputs) come from it; the layers' own host bytes and the key/value store's
    pools are page-locked in place, exactly (student/pinned.py)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def past_read_share(j: int, chunks: int, budget_chunks: float | None) -> float:
    """The past pages chunk j of `chunks` attends, as a share of what the last chunk attends: j
    chunks' worth of pages against chunks - 1 (dense), each at most the sparse budget
    (LongContextConfig.sparse_pages) in chunks' worth of pages (`budget_chunks`; None: dense). So
    with a budget a chunk's attention stops growing once its past is longer than the budget."""
    budget = math.inf if budget_chunks is None else budget_chunks
    return min(j, budget) / max(min(chunks - 1, budget), 1e-12) if chunks > 1 else 0.0


@dataclass(frozen=True)
class ChunkSeconds:
    """A decoder layer's pass-2 forward (with gradients) at the first and the last chunk of a
    micro-batch, attending to its past pages and taking pass 1's kept attention output instead
    (student/planner/profile.py measures them): what a layer's forward_s is made of under any number
    of kept chunks (`forward_s`). budget_chunks: sparse mode's budget of past pages in chunks'
    worth of pages (`past_read_share`); None: dense."""

    first_forward_s: float
    last_forward_s: float
    first_kept_forward_s: float
    last_kept_forward_s: float
    budget_chunks: float | None = None

    def forward_s(self, chunks: int, keep: int | None) -> float:
        """The mean over the `chunks` of pass 2's forward: chunk j's seconds interpolated linearly
        between the first and the last chunk's by the past pages it attends (`past_read_share`),
        kept for the chunks `kept_chunks` names, attending for the others."""
        kept = kept_chunks(chunks, keep)
        at = lambda first, last, j: first + (last - first) * past_read_share(j, chunks, self.budget_chunks)
        return sum(at(self.first_kept_forward_s, self.last_kept_forward_s, j) if j in kept
                   else at(self.first_forward_s, self.last_forward_s, j) for j in range(chunks)) / chunks


@dataclass(frozen=True)
class LayerCosts:
    """What one decoder layer costs, for one micro-batch (seconds, bytes)."""

    forward_s: float  # the layer's forward
    backward_s: float  # its backward from kept activations (a recompute adds forward_s)
    weight_bytes: int  # working weights in the compute dtype; also its weight gradient on the device
    boundary_bytes: int  # the layer's input (what "recompute" keeps and "offload" moves)
    keep_bytes: int  # every tensor the forward saves for the backward when kept, the input included
    workspace_bytes: int  # transient memory of its forward + backward beyond the saved tensors
    master_bytes: int  # fp32 master weights on the host (the fp32 gradient accumulator is as large)
    state_bytes: int  # the optimizer's states of the layer, on the host
    update_gpu_s: float  # one optimizer update of the layer on the GPU (its slice is there)
    update_cpu_s: float  # the same on the CPU, with the cast of its staging copy
    # Chunk-recurrent training: forward_s is the mean of a chunk's pass-2 forwards, made of these
    # (`kept_attention` prices another number of kept chunks with them), and so is recompute_s.
    # None: whole sequences.
    chunk: ChunkSeconds | None = None

    @property
    def recompute_s(self) -> float:
        """The layer's forward once more in the backward (activation "recompute" or "offload"):
        forward_s, or chunk-recurrent the mean of the chunks' forwards taking a kept attention
        output: every chunk's recomputation takes pass 2's own (the engine keeps it for that, also
        for the chunks whose attention pass 1 did not keep), so none attends."""
        if self.chunk is None:
            return self.forward_s
        return (self.chunk.first_kept_forward_s + self.chunk.last_kept_forward_s) / 2

    @property
    def staging_bytes(self) -> int:
        """The host copy of the working weights that copies to the device read, when their dtype is
        not the masters' fp32 (else the masters are read)."""
        return self.weight_bytes if self.weight_bytes < self.master_bytes else 0

    def grad_bytes(self, accumulates: bool) -> int:
        """The layer's gradient where its states are (host or device) and on the bus: when a step
        is one backward (`accumulates` False) in the working dtypes (its matrices' gradients are
        compute-dtype values; the runtime keeps them so), else the fp32 sum."""
        return self.master_bytes if accumulates else self.weight_bytes

    def host_bytes(self, accumulates: bool) -> int:
        """Master weights, gradient, optimizer states and the staging copy."""
        return self.master_bytes + self.grad_bytes(accumulates) + self.state_bytes + self.staging_bytes

    def update_in_bytes(self, accumulates: bool) -> int:
        """What a GPU update of a host layer brings to the device: master, gradient, states."""
        return self.master_bytes + self.grad_bytes(accumulates) + self.state_bytes

    def gpu_state_bytes(self, accumulates: bool) -> int:
        """Master, gradient (`grad_bytes`) and states on the device: what a layer whose states live
        on the GPU holds there beside its working weights."""
        return self.master_bytes + self.grad_bytes(accumulates) + self.state_bytes

    def gpu_widened_bytes(self, accumulates: bool) -> int:
        """When a step is one backward, the device's fp32 buffer a layer whose states live on the GPU
        widens its gradient into for its update (the master's size; one buffer, the largest such
        layer's, shared by all of them, made for the update); none when the step accumulates (the
        fp32 sum is read)."""
        return 0 if accumulates else self.master_bytes

    @property
    def slot_bytes(self) -> int:
        """One slot of the update's ring on the GPU: master, an fp32 gradient (a one-backward
        gradient is widened into it), states and the staging casts."""
        return 2 * self.master_bytes + self.state_bytes + self.staging_bytes


@dataclass(frozen=True)
class KVPages:
    """The chunk-recurrent engine's key/value store of one micro-batch (student/long_context/store.py's
    PagedKVStore) and where its pages live: what `kv_residency` prices the other residencies with."""

    num_layers: int
    seq_tokens: int  # positions of a micro-batch
    chunk_tokens: int
    page_tokens: int
    kv_page_bytes: int  # one page of every row: its keys and values in the attention dtype
    grad_page_bytes: int  # their fp32 gradient pages
    # Pass 1's kept attention of one position (every row), one layer: its output and its fp32 lse.
    kept_out_bytes: int
    kept_lse_bytes: int
    # On a GPU: the pages may live in pinned host memory (elsewhere they stay put): a layer's key,
    # value and gradient pools exactly (student/pinned.py), a kept chunk's output and lse each a
    # `pinned_block` of torch's pinned allocator.
    offloadable: bool
    kv_offload: bool = False
    offload_pages: int = 1024  # pages (of every row) of a page set, with kv_offload
    keep_chunks: int | None = None  # chunks whose attention pass 1 keeps (`kept_chunks`; None: all)
    # Sparse mode (LongContextConfig.sparse_pages): gradient pages only for the pages chunks read,
    # at most this many (of every row) per layer (`sparse_grad_pages`; None: dense, every page), and
    # each page's fp32 mean key (of every row) on the device, for the selection.
    grad_pages: int | None = None
    mean_key_bytes: int = 0
    # The micro-batch's input ids and token mask, which the engine holds on the device whole (each
    # chunk's other rows come to it as the chunk runs).
    sequence_bytes: int = 0

    @property
    def chunks(self) -> int:
        return -(-self.seq_tokens // self.chunk_tokens)

    @property
    def kept_chunk_bytes(self) -> int:
        """Pass 1's kept attention output and lse of one (whole) chunk, all layers."""
        block = pinned_block if self.offloadable else (lambda n: n)
        return self.num_layers * (block(self.chunk_tokens * self.kept_out_bytes)
                                  + block(self.chunk_tokens * self.kept_lse_bytes))

    @property
    def kept_bytes(self) -> int:
        """Pass 1's kept attention outputs (every chunk it keeps is a whole one: all but the last are)."""
        return len(kept_chunks(self.chunks, self.keep_chunks)) * self.kept_chunk_bytes

    @property
    def held_attention_bytes(self) -> int:
        """On a GPU, the device copy of one layer's attention output and lse of a chunk that pass 2
        brings ahead of that layer's recomputation, while the layer above runs its backward (its
        own copy is in its keep_bytes). Elsewhere the kept outputs are used where they are."""
        return self.chunk_tokens * (self.kept_out_bytes + self.kept_lse_bytes) if self.offloadable else 0

    @property
    def num_pages(self) -> int:
        """Pages of every row, per layer."""
        return -(-self.seq_tokens // self.page_tokens)

    @property
    def offloaded(self) -> bool:
        return self.kv_offload and self.offloadable

    def bytes(self) -> tuple[int, int, int]:
        """(device bytes, host bytes, resident pages): per layer its key and value pages and their
        gradient pages, every layer's at once by the end of the last chunk's backward; offloaded,
        all of them in pinned host memory, the device holding three page sets (one read, the next
        copied, and the next layer's first, prefetched across the layer boundary). Pass 1's kept
        attention outputs go to pinned host memory on a GPU (stay on the device elsewhere), and
        beside them pass 2's own of one chunk that pass 1 did not keep (the last one: it comes
        first), kept there for its layers' recomputations.
        The device also holds the micro-batch's ids and mask (`sequence_bytes`).
        Resident pages: the pages (of every row) the device holds at once, over all layers."""
        page = self.kv_page_bytes + self.grad_page_bytes
        grad_pages = self.num_pages if self.grad_pages is None else self.grad_pages
        # wherever the pages live: the mean keys, and the micro-batch's ids and mask
        on_device = self.num_layers * self.num_pages * self.mean_key_bytes + self.sequence_bytes
        if self.offloaded:  # per layer four page-locked pools, exact: keys, values and their gradients
            resident = 3 * min(self.offload_pages, self.num_pages)
            pools = self.num_pages * self.kv_page_bytes + grad_pages * self.grad_page_bytes
            return resident * page + on_device, self.num_layers * pools + self.kept_bytes + self.kept_chunk_bytes, resident
        resident = self.num_layers * self.num_pages
        held = self.num_layers * (self.num_pages * self.kv_page_bytes + grad_pages * self.grad_page_bytes) + on_device
        if self.offloadable:
            return held, self.kept_bytes + self.kept_chunk_bytes, resident
        return held + self.kept_bytes, 0, resident


@dataclass(frozen=True)
class CostTable:
    """Measured costs of a student's training step (`profile`), the input of `predict` and `solve`."""

    layers: tuple[LayerCosts, ...]
    h2d_bytes_per_s: float  # host->device copy bandwidth (pinned host memory)
    d2h_bytes_per_s: float  # device->host
    # Always on the GPU: embeddings, final norm and head with their gradients and optimizer states,
    # and what stayed allocated after the profile (cuBLAS's workspaces, made at a stream's first
    # matmul, and what the caller held).
    static_gpu_bytes: int
    # On the host beside the layers' bytes: the key/value store's pools and kept outputs, and the
    # loader's batches and decoded shards (`profile`).
    static_host_bytes: int = 0
    loader_host_bytes: int = 0  # of static_host_bytes, the loader's (`CacheBatches.host_bytes`), for reports
    head_s: float = 0.0  # embeddings, final norm, head and loss, forward and backward, one micro-batch
    static_update_s: float = 0.0  # the optimizer update of the static parameters (on the GPU)
    # Micro-batches per optimizer step (grad_accum); with chunk-recurrent training each chunk's
    # forward and backward (pass 2) counts as one: grad_accum x chunks.
    micro_batches: int = 1
    # Host memory streaming rate (bytes read plus written a second) of a host pass over fp32
    # gradients: the update on the CPU scales each host layer's gradient by the clip coefficient.
    host_bytes_per_s: float = math.inf
    # Chunk-recurrent training (student/long_context/engine.py; the layers' costs are then a chunk's):
    chunks: int = 1  # chunks per micro-batch (1: whole sequences)
    pass1_s: float = 0.0  # pass 1 of the step's micro-batches: the no-grad forwards of all chunks but the last
    kv_gpu_bytes: int = 0  # the key/value store's pages (and gradient pages) on the GPU; its host bytes are static_host_bytes
    chunk_tokens: int | None = None  # the chunk size measured (None: whole sequences)
    resident_pages: int | None = None  # key/value pages (of every row) on the GPU at once, over all layers
    kv: KVPages | None = None  # the key/value store as measured (chunk-recurrent), for `kv_residency`
    # Seconds a copy takes beyond its bytes over the bandwidth (its launch and completion), measured
    # on a small copy: `kv_residency` charges it per page-set copy.
    copy_latency_s: float = 0.0
    # Whether a step's gradient sums several backwards, as the runtime decides it
    # (student.step.steps_accumulate: grad_accum > 1 or chunk-recurrent, even at one chunk):
    # then host layers' gradients are fp32 sums, else the working dtypes. None: micro_batches > 1.
    accumulates: bool | None = None
    # Copy bandwidth each way while the other direction copies at the same time (`profile` starts
    # one copy each way together): what `predict` charges where both directions are busy. None:
    # the direction's rate alone (the two directions independent; tables made without a duplex
    # measurement, and the CPU's, whose copies never run both ways at once).
    h2d_duplex_bytes_per_s: float | None = None
    d2h_duplex_bytes_per_s: float | None = None
    # On a GPU an offloaded layer input is a pinned buffer from torch's allocator: it holds a
    # `pinned_block` of host memory (`offloaded_bytes`).
    pinned_blocks: bool = False
    # The head's workspace (its logits chunks and the loss's buffers, forward and backward): held
    # only while the head runs, between the forward and the layers' backward, so the GPU peak takes
    # the larger of it and a layer's backward (`in_turn`), not their sum.
    loss_workspace_bytes: int = 0
    # The input embedding's gradient as its backward makes it (a tensor of the parameter's size),
    # after every layer's backward: a step of one backward holds its .grad (in the static bytes)
    # only from then, several add it to the .grad already there (`in_turn`).
    late_grad_bytes: int = 0
    # A tied head's gradient of that same parameter: autograd sums a parameter's gradients from all
    # its uses before accumulating them, so the head's, made first, waits through every layer's
    # backward for the input embedding's (tests/test_planner.py checks that order on the Student).
    held_grad_bytes: int = 0
    # Device memory a GPU budget keeps free beyond the predicted peak, for the caching allocator's
    # slack (`ProfileSettings.reserve_bytes`): the planner fits peak + this into --gpu-memory, and
    # the predicted peak stays what max_memory_allocated measures.
    gpu_reserve_bytes: int = 0
    # What the profile's compute seconds (layers, head, pass 1) were multiplied by: a layer's time
    # back to back over its time in bursts (`student.step_profile.load_factor`; 1.0 unmeasured).
    clock_factor: float = 1.0
    # The untied input embedding (OffloadPlan.embedding): its fp32 master's bytes and its optimizer
    # states' bytes (0: tied, the head's matrix, which stays on the GPU), and where this table prices
    # it: "gpu" as measured (in the static bytes), "host" as student.planner.costs.embedding_on_host moved it.
    embedding_bytes: int = 0
    embedding_state_bytes: int = 0
    embedding: str = "gpu"

    def __post_init__(self):
        assert self.layers and self.micro_batches >= 1 and self.chunks >= 1 and self.h2d_bytes_per_s > 0 and self.d2h_bytes_per_s > 0
        assert self.host_bytes_per_s > 0
        if self.accumulates is None:
            object.__setattr__(self, "accumulates", self.micro_batches > 1)
        assert self.accumulates or self.micro_batches == 1, "several micro-batches a step accumulate"
        for name, simplex in (("h2d_duplex_bytes_per_s", self.h2d_bytes_per_s),
                              ("d2h_duplex_bytes_per_s", self.d2h_bytes_per_s)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, simplex)
            assert getattr(self, name) > 0

    @classmethod
    def from_dict(cls, d: dict) -> CostTable:
        """The table `dataclasses.asdict` gave `d` (as the offload bench keeps it: planned-costs.json)."""
        layers = tuple(LayerCosts(**{**layer, "chunk": ChunkSeconds(**layer["chunk"]) if layer.get("chunk") else None})
                       for layer in d["layers"])
        return cls(**{**d, "layers": layers, "kv": KVPages(**d["kv"]) if d.get("kv") else None})

    @property
    def embedding_update_bytes(self) -> int:
        """GPU bytes of an input embedding in host memory in the optimizer phase: its master,
        gradient and states come to the GPU for the update (student/offload/embedding.py)."""
        return 2 * self.embedding_bytes + self.embedding_state_bytes if self.embedding == "host" else 0

    def offloaded_bytes(self, layer: LayerCosts) -> int:
        """Host bytes of `layer`'s input while it is offloaded."""
        return pinned_block(layer.boundary_bytes) if self.pinned_blocks else layer.boundary_bytes

    def duplex_delays(self) -> tuple[float, float]:
        """(seconds the copies in lose per byte copied out meanwhile, seconds the copies out lose per
        byte copied in meanwhile): (1 - h2d_duplex / h2d) / d2h_duplex and its mirror (`predict`'s
        docstring, "the bus"). Zero when a direction keeps its rate alone beside the other; at most
        the other direction's seconds a byte alone (duplex rates below taking turns count as taking
        turns, so that the bound holds when one direction copies alone)."""
        h2d, d2h = (self.h2d_bytes_per_s, self.h2d_duplex_bytes_per_s), (self.d2h_bytes_per_s, self.d2h_duplex_bytes_per_s)
        delay = lambda own, other: min(max(1.0 - own[1] / own[0], 0.0) / other[1], 1.0 / other[0])
        return delay(h2d, d2h), delay(d2h, h2d)
