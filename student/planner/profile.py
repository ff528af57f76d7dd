"""Measuring a student's training step for the offload planner (student/planner/solve.py): per decoder
layer forward and backward seconds and bytes on one real micro-batch, copy bandwidth each way, one
optimizer update on each side, and the default memory budgets of this machine. With chunk-recurrent
training (--chunk-tokens, student/long_context/engine.py) the layers are measured on a chunk attending its
key/value store, and the store's bytes and pass 1's forwards are counted (`profile` says how).
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch

from distill.files import distill_home
from student.cross_tokenizer.batches import batches_for, open_cross_tokenizer
from student.data import load_tokenizer, split_indices
from student.host_heap import keep_freed_pieces
from student.host_threads import one_openmp_team
from student.long_context.config import chunk_bounds, sparse_grad_pages
from student.long_context.store import select_pages, store_for_model
from student.model import rope_cos_sin
from student.optim.build import build_optimizer, state_bytes
from student.pinned import release_cached
from student.planner.table import ChunkSeconds, CostTable, KVPages, LayerCosts, past_read_share, pinned_block
from student.step import initial_student, micro_batch_loss, resolve, steps_accumulate
from teacher_cache.reader import CacheReader, release_unused_memory

__all__ = ["ProfileSettings", "profile", "default_budgets", "available_host_bytes"]


@dataclass(frozen=True)
class ProfileSettings:
    """How `profile` measures and how `plan_for_training` picks default budgets."""

    repeats: int = 3  # timed runs of each measurement after one warm-up run; the median is kept
    copy_bytes: int = 64 * 2**20  # bytes of each bandwidth measurement (one copy each way)
    small_copy_bytes: int = 64 * 2**10  # bytes of the copy whose time beyond its bandwidth's is a copy's latency
    # fp32 bytes of each operand of the host pass measured (an add, as the gradient accumulation
    # runs): larger than a host's last-level cache, so that it measures memory, as on a layer.
    host_pass_bytes: int = 256 * 2**20
    reserve_bytes: int = 512 * 2**20  # GPU allocator slack a budget keeps beyond the predicted peak (none on the CPU)
    # Seconds of one layer's forward and backward run back to back, as a step runs its layers, that
    # measure the GPU's clock under load against the bursts the layers are timed in (`load_factor`;
    # 0: not measured, the timings as the bursts gave them). The CPU's timings are never scaled.
    load_s: float = 3.0
    gpu_headroom: float = 0.05  # share of the device's memory the default budget leaves to the CUDA context and others
    host_headroom: float = 0.10  # share of the host's available memory the default budget leaves to the process


def profile(config, *, micro_batches: int = 1, settings: ProfileSettings = ProfileSettings()) -> CostTable:
    """Measure the costs of `config`'s training step: the student and real micro-batches built as
    student/trainer.py builds them; each decoder layer run forward and backward on the device in
    the compute dtype (its working weights), timed with CUDA events on a GPU and perf_counter on
    the CPU; copy bandwidth each way (pinned host memory on a GPU); one layer's optimizer update on
    the GPU and on the CPU (the same measurement on a CPU-only machine); copy bandwidth each way while
    the other direction copies too (`_bandwidths`). `micro_batches` real micro-batches are timed
    (medians); the table's `micro_batches` is config.grad_accum.

    Bytes are counted from tensors: a layer's working weights, its input, what its forward saves
    for the backward (parameters left out), the optimizer's states after one update, what the
    trainer's loader holds in host memory (`CacheBatches.host_bytes`: batches, decoded shards). Transient
    workspace is the allocator's peak beyond those on a GPU; on the CPU, where no allocator
    reports a peak, it is estimated as the largest saved tensor plus two layer inputs (the
    gradients flowing in and out). All decoder layers of a student have one shape, so the update
    is timed on layer 0 and scaled by parameter count. The host heap keeps freed pieces
    (student.host_heap) and the main thread's OpenMP team is the process's one (student.host_threads),
    as in the trainer's process, so the CPU update is timed as it will run."""
    keep_freed_pieces()
    config = resolve(config)
    device, cuda = config.device, config.device.startswith("cuda")
    one_openmp_team(device)
    reader = CacheReader(config.cache[0])  # a mixture's caches share the tokenizer and targets (student/mixture.py)
    # a student of another tokenizer reads the cache as the trainer does (student/cross_tokenizer)
    cross = open_cross_tokenizer(reader, load_tokenizer(config.tokenizer), config.cross_tokenizer,
                                 maps_folder=distill_home() / "vocab-maps")
    cache_temperature = reader.manifest.spec.targets.temperature
    config.loss.check_cache_temperature(cache_temperature, kind=reader.manifest.spec.targets.kind)
    config = config.with_flat(temperature=config.loss.distillation_temperature(cache_temperature))
    train_idx, _ = split_indices(reader.num_sequences, config.heldout)
    data = batches_for(cross)(reader, train_idx, config.batch_size, seq_len=config.seq_len, seed=config.seed,
                              lru_shards=config.loader_shards)
    batches = [batch for batch, _ in zip(data, range(micro_batches))]
    model, _ = initial_student(config, "cpu")  # the layers come to the device one at a time
    amp = torch.bfloat16 if config.dtype == "bfloat16" else None
    for name in ("embed_tokens", "norm", "lm_head"):
        if getattr(model, name) is not None:
            setattr(model, name, getattr(model, name).to(device))
    model.inv_freq = model.inv_freq.to(device)

    measured = [_measure_chunks(model, batch.to(device), config, amp, settings, cache_temperature)
                for batch in batches]
    median = lambda values: sorted(values)[len(values) // 2]
    per_layer = [
        {key: (median([m["layers"][i][key] for m in measured]) if key.endswith("_s")
               else max(m["layers"][i][key] for m in measured)) for key in measured[0]["layers"][i]}
        for i in range(len(model.layers))]
    head_s = median([m["head_s"] for m in measured])
    pass1_s = median([m["pass1_s"] for m in measured]) * config.grad_accum
    clock = 1.0
    if cuda and settings.load_s > 0:  # every compute timing as it runs inside a step, under load
        tokens = min(batches[0].input_ids.shape[1], config.long.chunk_tokens or batches[0].input_ids.shape[1])
        clock = load_factor(layer_run(model, (batches[0].input_ids.shape[0], tokens), amp, device), settings, device)
        per_layer = [{key: value * clock if key.endswith("_s") else value for key, value in m.items()}
                     for m in per_layer]
        head_s, pass1_s = head_s * clock, pass1_s * clock
    chunks = max(m["chunks"] for m in measured)
    loss_workspace = max(m["loss_workspace"] for m in measured)

    # The optimizer as the trainer builds it for this device, wherever its parameters are: on a GPU
    # run torch's AdamW is the fused one, and so is its update of the layers in host memory.
    build = lambda module: build_optimizer(module, config.optim, device)
    gpu_update_s, states, _ = _update_seconds(model.layers[0], build, device, settings)
    # On the CPU the update also casts the layer's matrices to its staging copy (the runtime's refresh).
    cpu_update_s = _update_seconds(model.layers[0], build, "cpu", settings, cast_to=amp)[0] if cuda else gpu_update_s
    numel0 = sum(p.numel() for p in model.layers[0].parameters())
    layers = []
    for layer, m in zip(model.layers, per_layer):
        share = sum(p.numel() for p in layer.parameters()) / numel0
        chunk = None
        if CHUNK_KEYS[0] in m:  # forward_s from the medians' ChunkSeconds, as `kept_attention` reprices it
            chunk = ChunkSeconds(**{key: m.pop(key) for key in CHUNK_KEYS}, budget_chunks=config.long.budget_chunks)
            m["forward_s"] = chunk.forward_s(chunks, config.long.keep_attention_chunks)
        layers.append(LayerCosts(**m, state_bytes=int(states * share), update_gpu_s=gpu_update_s * share,
                                 update_cpu_s=cpu_update_s * share, chunk=chunk))
    static = torch.nn.ModuleDict({name: getattr(model, name) for name in ("embed_tokens", "norm", "lm_head")
                                  if getattr(model, name) is not None})
    # The untied input embedding, which a plan may keep in host memory, and its own states (FOAM,
    # say, keeps an embedding in plain Adam and folds the head).
    weight = model.embed_tokens.weight if model.lm_head is not None else None
    static_update_s, static_states, embedding_states = _update_seconds(static, build, device, settings,
                                                                       copy_first=False, of=weight)
    static_params = sum(p.numel() * p.element_size() for p in static.parameters())
    embedding = weight.numel() * weight.element_size() if weight is not None else 0
    h2d, d2h, h2d_duplex, d2h_duplex, latency = _bandwidths(device, settings)
    kv = _kv_pages(model, config, batches[0].input_ids.shape, amp) if chunks > 1 else None
    kv_gpu, kv_host, resident_pages = kv.bytes() if kv is not None else (0, 0, None)
    late, held = _grad_bytes_of_embedding(model)
    # What the trainer's loader holds in host memory: its built batches, page-locked on a GPU (a
    # pinned block each tensor), and its decoded shards, each cache's as large as the first's (a
    # mixture's caches share the targets). Then the memory Arrow keeps from this profile's reads goes
    # back: the loader's own reads are what it counts.
    loader_host = data.host_bytes(batches[0], pinned_block if cuda else (lambda n: n), streams=len(config.cache))
    del data, batches, reader
    release_unused_memory()
    left = 0
    if cuda:  # hand the caching allocator's blocks back: the training that follows reserves its own
        del model, static
        gc.collect()
        torch.cuda.empty_cache()
        # And the page-locked host memory of the profile's key/value stores, kept for reuse (by
        # student/pinned.py and torch's pinned allocator): the training's own store and offloaded
        # inputs take what the plan says.
        release_cached()
        # What stays allocated (cuBLAS's workspaces, one a stream that ran a matmul, and whatever
        # the caller holds) stays so through the training after the profile in this process, and
        # max_memory_allocated counts it.
        left = torch.cuda.memory_allocated(device)
    return CostTable(layers=tuple(layers), h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
                     h2d_duplex_bytes_per_s=h2d_duplex, d2h_duplex_bytes_per_s=d2h_duplex,
                     static_gpu_bytes=2 * static_params + static_states + left,
                     gpu_reserve_bytes=settings.reserve_bytes if cuda else 0,
                     loss_workspace_bytes=loss_workspace, late_grad_bytes=late, held_grad_bytes=held,
                     static_host_bytes=kv_host + loader_host, loader_host_bytes=loader_host, head_s=head_s,
                     static_update_s=static_update_s,
                     micro_batches=config.grad_accum * chunks, host_bytes_per_s=_host_pass_rate(settings),
                     chunks=chunks, pass1_s=pass1_s, kv_gpu_bytes=kv_gpu,
                     chunk_tokens=config.long.chunk_tokens if chunks > 1 else None, resident_pages=resident_pages,
                     kv=kv, copy_latency_s=latency, accumulates=steps_accumulate(config), pinned_blocks=cuda,
                     clock_factor=clock, embedding_bytes=embedding, embedding_state_bytes=embedding_states)


def _grad_bytes_of_embedding(model) -> tuple[int, int]:
    """(late_grad_bytes, held_grad_bytes): the input embedding's gradient, made by its backward
    after every layer's; a tied head's gradient of the same parameter, waiting for it meanwhile."""
    weight = model.embed_tokens.weight
    size = weight.numel() * weight.element_size()
    return size, size if model.lm_head is None else 0


def _timed(device: str, fn):
    """(seconds, fn()) with the device's work finished."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def layer_run(model, shape: tuple[int, int], amp, device: str):
    """`run()`: decoder layer 0's forward and backward on the device as the profile's working copy
    runs them (matrices in the compute dtype, under autocast), on random input of (rows, tokens)."""
    dtype = amp or torch.float32
    working = copy.deepcopy(model.layers[0]).to(device)
    for p in working.parameters():
        if p.ndim >= 2:
            p.data = p.data.to(dtype)
    x = torch.randn(*shape, model.config.hidden_size, device=device, dtype=dtype)
    positions = torch.arange(shape[1], device=device)[None].expand(shape[0], -1)
    cos, sin = rope_cos_sin(model.inv_freq.to(device), positions, dtype)

    def run():
        leaf = x.detach().requires_grad_(True)
        with torch.autocast(torch.device(device).type, dtype=amp, enabled=amp is not None):
            out, _ = working(leaf, cos, sin)
        out.backward(torch.ones_like(out))
        working.zero_grad(set_to_none=True)

    return run


def load_factor(run, settings: ProfileSettings, device: str = "cuda", gap_s: float = 0.2) -> float:
    """How much longer `run` (a layer's forward and backward on a GPU) takes back to back, as a
    step's layers run, than in bursts with the device idle before each, as `_measure_layers` times
    them: the median of the runs that ended in the last third of `loaded_seconds` over
    settings.load_s (at least settings.repeats of them), over the median of `burst_seconds`, at
    least 1. A GPU lowers its clock under sustained load within a few seconds and raises it again
    within a fraction of a second idle (bench rows `layer_clock/llama-3.1-8b-T8192@b49752c` and
    `layer_clock/qwen2.5-14b-T8192@b49752c`); single runs under load vary by a few percent, so the
    whole last third is taken, not a few runs (`layer_clock/llama-3.1-8b-T8192@e13b83b`, its
    medians by second). Below 1 would be launch gaps a burst's events include, which a step's small
    layers have too."""
    run()  # kernels chosen outside both measurements
    bursts = burst_seconds(run, settings.repeats, gap_s, device)
    loaded = last_runs(loaded_seconds(run, settings.load_s, settings.repeats, device), settings.load_s / 3,
                       settings.repeats)
    return max(statistics.median(loaded) / statistics.median(bursts), 1.0)


def last_runs(seconds: list[float], span_s: float, at_least: int) -> list[float]:
    """The runs of `seconds` (run back to back, in order) that ended within the last `span_s` of
    their summed time, and at least the last `at_least` runs."""
    kept, total = [], 0.0
    for run_s in reversed(seconds):
        if total >= span_s and len(kept) >= at_least:
            break
        kept.append(run_s)
        total += run_s
    return kept[::-1]


def burst_seconds(run, repeats: int, gap_s: float, device: str) -> list[float]:
    """Seconds of `repeats` runs of `run`, each timed alone after the device finished everything
    and then idled `gap_s`."""
    seconds = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        time.sleep(gap_s)
        seconds.append(_timed(device, run)[0])
    return seconds


def loaded_seconds(run, load_s: float, min_runs: int, device: str) -> list[float]:
    """Seconds of every run of `run` queued back to back for `load_s` seconds (and at least
    `min_runs` runs), in order; on a GPU timed by CUDA events read once the queue has drained, so
    that nothing waits between the runs."""
    cuda = device.startswith("cuda")
    timed, start = [], time.perf_counter()
    while time.perf_counter() - start < load_s or len(timed) < min_runs:
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            timed.append((begin, end))
        else:
            timed.append(_timed(device, run)[0])
    if cuda:
        torch.cuda.synchronize(device)
        timed = [begin.elapsed_time(end) / 1e3 for begin, end in timed]
    return timed


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for the backward inside the block, but those
    of the tensors given (parameters, counted as weights; tensors all layers share)."""

    def __init__(self, params):
        self.skip = {t.untyped_storage().data_ptr() for t in params}
        self.storages: dict[int, int] = {}

    def __enter__(self):
        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.skip:
                self.storages[storage.data_ptr()] = storage.nbytes()
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    @property
    def largest(self) -> int:
        return max(self.storages.values(), default=0)


def _measure_chunks(model, batch, config, amp, settings: ProfileSettings, cache_temperature: float,
                    build_store=store_for_model) -> dict:
    """`_measure_layers` of one micro-batch, whole, or with chunk-recurrent training per chunk as
    pass 2 runs it: a chunk's attention grows with its past pages, linearly, so its first and last
    chunks are measured and chunk j's seconds are interpolated between them (a chunk's bytes are
    their largest: the last one's, which reads every page). A layer's forward_s is then the mean
    over the chunks of its pass-2 forward: taking pass 1's kept attention output for the chunks
    pass 1 keeps (LongContextConfig.keep_attention_chunks), attending for the others and the last.
    Its recomputation in the backward takes pass 2's own output in every chunk (priced by the kept
    forwards: `LayerCosts.recompute_s`). Adds `chunks` (per micro-batch) and `pass1_s`: pass 1's no-grad
    forwards of every chunk but the last, interpolated the same way."""
    bounds = chunk_bounds(batch.input_ids.shape[1], config.long.chunk_tokens)
    if len(bounds) == 1:
        return {**_measure_layers(model, batch, config, amp, settings, cache_temperature), "chunks": 1, "pass1_s": 0.0}
    ends, select_s = [], 0.0
    for s, e in (bounds[0], bounds[-1]):
        store = build_store(model, batch.input_ids.shape[0], batch.input_ids.shape[1], config.long,
                            amp or model.embed_tokens.weight.dtype, config.device)
        for pool in store.k + store.v:
            pool.zero_()  # the past pages' values do not matter to the timing, only that they are finite
        store.begin(s, e, grad=True)
        ends.append(_measure_layers(model, batch.positions(s, e), config, amp, settings, cache_temperature,
                                    store=store))
        if (s, e) == bounds[-1]:
            select_s = _select_seconds(store, model.config.num_heads, e - s, amp, settings, config.device)
        # One store at a time: at long lengths a store is much of the host's memory (notes/
        # long-context.md, "The 7B on an H200"), and the next one would otherwise be built beside it.
        del store
    first, last = ends
    return {**_chunk_layers(first["layers"], last["layers"], bounds, config.long.keep_attention_chunks,
                            config.long.budget_chunks, select_s),
            "head_s": (first["head_s"] + last["head_s"]) / 2, "chunks": len(bounds),
            "loss_workspace": max(first["loss_workspace"], last["loss_workspace"])}


def _select_seconds(store, num_heads: int, tokens: int, amp, settings: ProfileSettings, device: str) -> float:
    """Sparse mode: one selection of past pages for a chunk of `tokens` queries begun in `store`
    (`select_pages` over every page before it, as pass 1 runs it once a chunk and layer; the
    measured forwards reuse the selection their warm-up run made); 0.0 where the chunk has no
    more past pages than the budget, so selects none. Its cost grows with the past, unlike the
    sparse attention's."""
    past = store.start // store.P
    if store.sparse_pages is None or past <= store.sparse_pages:
        return 0.0
    q = torch.randn(store.B, num_heads, tokens, store.mean_k[0].shape[-1], dtype=amp or torch.float32, device=device)
    seconds = [_timed(device, lambda: select_pages(q, store.mean_k[0][:past], store.sparse_pages))[0]
               for _ in range(settings.repeats + 1)]
    return sorted(seconds[1:])[len(seconds[1:]) // 2]  # after the warm-up run


def _chunk_layers(first: list[dict], last: list[dict], bounds: list[tuple[int, int]],
                  keep_chunks: int | None, budget_chunks: float | None = None, select_s: float = 0.0) -> dict:
    """{"layers", "pass1_s"} of a micro-batch in chunks `bounds` from its first and last chunk's
    layers (`_measure_layers` with a store): a layer's forward_s the mean over chunks of pass 2's
    forward, on the kept attention output for a chunk pass 1 keeps (`keep_chunks`:
    LongContextConfig.keep_attention_chunks), attending otherwise (`ChunkSeconds.forward_s`, whose
    four figures the layer carries as CHUNK_KEYS); its other seconds their mean, its bytes their
    largest; pass 1 the no-grad forwards of every chunk but the last, chunk j's seconds
    interpolated between the first and last chunk's by the past pages it attends
    (`past_read_share`, sparse mode's budget `budget_chunks`). Sparse mode's selections are
    pass 1's too (the last chunk's, made in pass 2, with them): the last chunk's `select_s`,
    in proportion to a chunk's past, for each chunk past the budget."""
    n = len(bounds)
    share = lambda j: past_read_share(j, n, budget_chunks)
    selects = sum(j / (n - 1) for j in range(n) if budget_chunks is not None and j > budget_chunks)
    layers, pass1_s = [], 0.0
    for a, b in zip(first, last):
        layer = {key: (a[key] + b[key]) / 2 if key.endswith("_s") else max(a[key], b[key]) for key in a
                 if key not in ("kept_forward_s", "pass1_forward_s")}
        chunk = ChunkSeconds(first_forward_s=a["forward_s"], last_forward_s=b["forward_s"],
                             first_kept_forward_s=a["kept_forward_s"], last_kept_forward_s=b["kept_forward_s"],
                             budget_chunks=budget_chunks)
        layer.update(forward_s=chunk.forward_s(n, keep_chunks), **{key: getattr(chunk, key) for key in CHUNK_KEYS})
        layers.append(layer)
        pass1_s += sum(a["pass1_forward_s"] + (b["pass1_forward_s"] - a["pass1_forward_s"]) * share(j)
                       for j in range(n - 1)) + select_s * selects
    return {"layers": layers, "pass1_s": pass1_s}


# A chunk-recurrent layer's ChunkSeconds, carried in its measured dict (medians over micro-batches
# like its other seconds) until `profile` makes its LayerCosts.
CHUNK_KEYS = ("first_forward_s", "last_forward_s", "first_kept_forward_s", "last_kept_forward_s")


def _kv_pages(model, config, shape, amp) -> KVPages:
    """The chunk-recurrent engine's key/value store for micro-batches of `shape` [B, L]
    (student/long_context/store.py's PagedKVStore), as config.long places it: per layer its key and value
    pages in the attention dtype and their fp32 gradient pages (in sparse mode only as many as
    `sparse_grad_pages` bounds, and each page's fp32 mean key; `KVPages.bytes` says where they
    live), and pass 1's kept attention outputs (and their fp32 lse) of the chunks it keeps
    (config.long.keep_attention_chunks of those before the last: all full chunks)."""
    c, long = model.config, config.long
    B, L = shape
    size = (amp or model.embed_tokens.weight.dtype).itemsize
    page = B * c.num_kv_heads * long.page_tokens * c.head_dim
    sparse = long.sparse_pages is not None
    grad_pages = sparse_grad_pages(L, long.chunk_tokens, long.page_tokens, long.sparse_pages) if sparse else None
    return KVPages(num_layers=c.num_layers, seq_tokens=L, chunk_tokens=long.chunk_tokens, page_tokens=long.page_tokens,
                   kv_page_bytes=2 * size * page, grad_page_bytes=2 * 4 * page,
                   grad_pages=grad_pages,
                   mean_key_bytes=4 * B * c.num_kv_heads * c.head_dim if sparse else 0,
                   sequence_bytes=B * L * (torch.int64.itemsize + torch.bool.itemsize),  # engine.py's ids and mask
                   kept_out_bytes=B * c.num_heads * c.head_dim * size, kept_lse_bytes=B * c.num_heads * 4,
                   offloadable=config.device.startswith("cuda"), kv_offload=long.kv_offload,
                   offload_pages=long.offload_pages, keep_chunks=long.keep_attention_chunks)


def _pass1_then_kept(device: str, forward, store, autocast, kept: list[float]) -> float:
    """A chunk's layer as the engine runs it twice: pass 1's no-grad forward, its attention output
    kept (the seconds returned), then pass 2's forward with gradients taking that output (its
    seconds appended to `kept`; the store forgets the output again, as pass 2's backward would)."""
    store.keep_attention, store.grad = True, False
    with torch.no_grad(), autocast():
        seconds, _ = _timed(device, forward)
    store.grad = True
    with autocast():
        kept.append(_timed(device, forward)[0])
    store.keep_attention = False
    store.kept_attention.clear()
    return seconds


def _measure_layers(model, batch, config, amp, settings: ProfileSettings, cache_temperature: float,
                    store=None) -> dict:
    """Per layer forward/backward seconds and bytes on one micro-batch (on config.device), and the
    head's seconds and workspace (embeddings, final norm, head, loss). store: a chunk's key/value
    store (begun for that chunk, which `batch` is: its positions start there); each layer then
    also gives pass1_forward_s, its no-grad forward as pass 1 runs it (keeping its attention
    output), and kept_forward_s, its forward with gradients taking that output, as pass 2 does;
    forward_s is the forward with gradients attending (pass 2 of a chunk whose output is not kept)."""
    device, cuda = config.device, config.device.startswith("cuda")
    dtype = amp or torch.float32
    autocast = lambda: torch.autocast(torch.device(device).type, dtype=amp, enabled=amp is not None)
    ids, row_mask = batch.input_ids, batch.mask
    start = store.past_length() if store is not None else 0
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    with torch.no_grad(), autocast():
        x = model.embed_tokens(ids)
    cos, sin = rope_cos_sin(model.inv_freq, positions, x.dtype)
    layers = []
    for layer in model.layers:
        # The runtime's working weights: matrices in the compute dtype, vectors (norms, biases) fp32.
        working = copy.deepcopy(layer).to(device)
        for p in working.parameters():
            if p.ndim >= 2:
                p.data = p.data.to(dtype)
        params = list(working.parameters())
        shared = [*params, cos, sin, row_mask]  # one copy for all layers: not a layer's activations
        forward, backward, pass1, kept, saved = [], [], [], [], None
        for run in range(settings.repeats + 1):
            x_in = x.detach().requires_grad_(True)
            if store is not None:
                pass1.append(_pass1_then_kept(device, lambda: working(x_in, cos, sin, store, row_mask), store,
                                              autocast, kept))
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            with _SavedBytes(shared) as counted, autocast():
                seconds, (out, _) = _timed(device, lambda: working(x_in, cos, sin, store, row_mask))
            saved = saved or counted
            forward.append(seconds)
            backward.append(_timed(device, lambda: out.backward(torch.ones_like(out)))[0])
            if cuda and run == 0:
                workspace = max(torch.cuda.max_memory_allocated(device) - base - saved.total, 0)
            working.zero_grad(set_to_none=True)
        boundary = x.numel() * x.element_size()
        x = out.detach()
        median = lambda values: sorted(values[1:])[len(values[1:]) // 2]  # after the warm-up run
        extra = dict(pass1_forward_s=median(pass1), kept_forward_s=median(kept)) if store is not None else {}
        layers.append(dict(
            **extra, forward_s=median(forward), backward_s=median(backward),
            weight_bytes=sum(p.numel() * p.element_size() for p in params), boundary_bytes=boundary,
            keep_bytes=saved.total, workspace_bytes=workspace if cuda else saved.largest + 2 * boundary,
            master_bytes=sum(p.numel() * 4 for p in params)))
        working = out = None  # free the layer before the next one comes to the device

    static_params = [p for name in ("embed_tokens", "norm", "lm_head") if getattr(model, name) is not None
                     for p in getattr(model, name).parameters()]

    def head():
        with autocast():
            x0 = model.embed_tokens(ids)
            hidden = model.norm(leaf)
        loss, _ = micro_batch_loss(hidden, [], batch, model, config, cache_temperature=cache_temperature)
        torch.autograd.backward([loss, x0], [None, torch.ones_like(x0)])

    # Where a step sums several backwards, the static parameters' gradients of an earlier one are
    # there while the head runs (chunk by chunk, at every chunk but the first): the workspace is
    # measured beside them, on the run after the first, which made them.
    measured_run = 1 if steps_accumulate(config) else 0
    seconds = []
    for run in range(settings.repeats + 1):
        leaf = x.detach().requires_grad_(True)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with _SavedBytes(static_params) as counted:
            seconds.append(_timed(device, head)[0])
        if run == measured_run:
            # static_gpu_bytes counts the static parameters' gradients already (2 x their bytes).
            # Made in this run, they are alive at its end, so the allocator's peak is at least
            # them: taken out, static part plus workspace stays an upper bound. Made before it,
            # they are in `base`.
            grads = sum(p.grad.numel() * p.grad.element_size() for p in static_params
                        if p.grad is not None) if run == 0 else 0
            workspace = (torch.cuda.max_memory_allocated(device) - base - grads if cuda
                         else counted.total + 2 * leaf.numel() * leaf.element_size())
        if run >= measured_run:
            for p in static_params:
                p.grad = None
    return {"layers": layers, "head_s": sorted(seconds[1:])[len(seconds[1:]) // 2], "loss_workspace": workspace}


def _update_seconds(module, build, device: str, settings: ProfileSettings, copy_first: bool = True,
                    cast_to=None, of=None) -> tuple[float, int, int]:
    """(seconds of one optimizer update of `module`'s fp32 parameters on `device`, by the optimizer
    `build(module)` makes, then a cast of its matrices into a staging copy of dtype `cast_to` if
    given, as OffloadRuntime's refresh casts them; the optimizer's state bytes after it; those of
    the parameter `of` alone, one of `module`'s when `copy_first` is False, else 0): the first
    update (which creates the states) is not timed."""
    module = copy.deepcopy(module).to(device=device, dtype=torch.float32) if copy_first else module
    optimizer = build(module)
    generator = torch.Generator(device=device).manual_seed(0)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, device=device, generator=generator) * 1e-3
    matrices = [p for p in module.parameters() if p.ndim >= 2]
    staging = [torch.empty_like(p, dtype=cast_to) for p in matrices] if cast_to is not None else []

    def update():
        optimizer.step()
        with torch.no_grad():
            for out, p in zip(staging, matrices):
                out.copy_(p)

    seconds = [_timed(device, update)[0] for _ in range(settings.repeats + 1)][1:]
    states = state_bytes(optimizer)
    own = sum(v.nbytes for v in optimizer.state[of].values() if isinstance(v, torch.Tensor)) if of is not None else 0
    for p in module.parameters():
        p.grad = None
    return sorted(seconds)[len(seconds) // 2], states, own


def _bandwidths(device: str, settings: ProfileSettings) -> tuple[float, float, float, float, float]:
    """(host->device, device->host bytes per second each alone, the same while both copy at once,
    seconds a copy takes beyond its bytes): pinned host memory on a GPU, plain copies between two
    host buffers on the CPU. The latency is a small copy's time (each way, the larger) less its
    bytes over the bandwidth. Both at once: `_duplex` on a GPU; on the CPU the rates alone, since
    the runtime copies there on the calling thread, one copy after another, never both ways at
    once (and the cost model then charges nothing for it: offload_cost.predict's bus)."""
    cuda = device.startswith("cuda")
    median = lambda dst, src: sorted([_timed(device, lambda: dst.copy_(src, non_blocking=cuda))[0]
                                      for _ in range(settings.repeats + 1)][1:])[settings.repeats // 2]
    rate, latency = [], 0.0
    for n in (settings.copy_bytes, settings.small_copy_bytes):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        for k, (dst, src) in enumerate(((dev, host), (host, dev))):
            seconds = median(dst, src)
            if n == settings.copy_bytes:
                rate.append(n / max(seconds, 1e-9))
            else:
                latency = max(latency, seconds - n / rate[k])
    duplex = _duplex(device, settings, rate[0], rate[1]) if cuda else (rate[0], rate[1])
    return rate[0], rate[1], *duplex, max(latency, 0.0)


def _duplex(device: str, settings: ProfileSettings, h2d: float, d2h: float) -> tuple[float, float]:
    """(host->device, device->host bytes per second while both directions copy): one copy of
    settings.copy_bytes each way on two side streams, started together after one event, each
    timed to its own end with CUDA events (medians of settings.repeats after a warm-up), then
    `_duplex_rates` with the rates alone `h2d`, `d2h`."""
    n = settings.copy_bytes
    host_in, host_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_in, dev_out = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)
    times = []
    for _ in range(settings.repeats + 1):
        start = torch.cuda.Event(enable_timing=True)
        ends = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for stream, end, (dst, src) in zip(streams, ends, ((dev_in, host_in), (host_out, dev_out))):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                end.record()
        for end in ends:
            end.synchronize()
        times.append([start.elapsed_time(end) / 1e3 for end in ends])
    median = lambda k: sorted(t[k] for t in times[1:])[settings.repeats // 2]
    return _duplex_rates(n, median(0), median(1), h2d, d2h)


def _duplex_rates(n: int, t_in: float, t_out: float, h2d: float, d2h: float) -> tuple[float, float]:
    """(host->device, device->host duplex bytes per second) from one copy of `n` bytes each way
    started together, ending after `t_in` and `t_out` seconds, with the rates alone `h2d`, `d2h`.
    The copy that ends first ran beside the other all along: n over its time. The other ran its
    last part alone at its rate alone: its duplex rate is what it moved while both ran,
    n - rate_alone x (t_long - t_short), over t_short. Where timing noise makes that not
    positive (its tail alone took longer than a whole copy alone), n over its own time, with a
    warning."""
    t, alone = (max(t_in, 1e-9), max(t_out, 1e-9)), (h2d, d2h)
    short = 0 if t[0] <= t[1] else 1
    long_ = 1 - short
    rates = [0.0, 0.0]
    rates[short] = n / t[short]
    rates[long_] = (n - alone[long_] * (t[long_] - t[short])) / t[short]
    if rates[long_] <= 0:
        logging.getLogger(__name__).warning(
            "the duplex copy measurement was inconsistent (%.3g s and %.3g s each way for %d bytes, %.3g s alone); "
            "taking the later copy's bytes over its own time", t_in, t_out, n, n / alone[long_])
        rates[long_] = n / t[long_]
    return rates[0], rates[1]


def _host_pass_rate(settings: ProfileSettings) -> float:
    """Bytes a second the host reads and writes in a pass over fp32 gradients: `a += b` (read a,
    read b, write a) on buffers of settings.host_pass_bytes, on the threads torch uses here (the
    runtime's accumulation and the trainer's clipping run on them too)."""
    n = settings.host_pass_bytes // 4
    a, b = torch.zeros(n), torch.ones(n)
    seconds = []
    for _ in range(settings.repeats + 1):
        start = time.perf_counter()
        a.add_(b)
        seconds.append(time.perf_counter() - start)
    return 3 * 4 * n / max(sorted(seconds[1:])[len(seconds[1:]) // 2], 1e-9)


def available_host_bytes() -> int:
    """The host's available memory (MemAvailable of /proc/meminfo; free pages where there is none)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budgets(device: str, settings: ProfileSettings = ProfileSettings()) -> tuple[int, int]:
    """(GPU, host) budgets when none is given: the device's total memory and the host's available
    memory, less the headrooms of `settings`. On a CPU-only machine the "GPU" is the host too."""
    host = int(available_host_bytes() * (1 - settings.host_headroom))
    if not device.startswith("cuda"):
        return host, host
    return int(torch.cuda.get_device_properties(device).total_memory * (1 - settings.gpu_headroom)), host
