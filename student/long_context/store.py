"""The paged key/value store of chunk-recurrent training (student/long_context/engine.py runs it).

`PagedKVStore` holds every layer's keys and values (after RoPE) of one micro-batch in pages, and
attends a chunk's queries over them: it is the attention seam of `student.model.Student` (its
`kv_store` argument), so the model has one forward for whole sequences, inference with a cache,
and both passes of the engine. Attention over pages is kernels/page_attention.py (cuDNN's fused
attention on a GPU, its torch reference elsewhere); with gradients its backward adds the gradients
of every key and value a chunk read into that page's gradient accumulator.

With `kv_offload` the pages live in pinned host memory and only the pages an attention call reads
come to the GPU, a page set at a time (`offload_pages`), copied on a side stream ahead of use:
within a layer the next set while the current one is read, and across layers the first set of the
layer that reads pages next (layer + 1 in a forward, layer - 1 in pass 2's backward), of the pages
already final when the chunk began. The GPU then holds up to three page sets at once: the two of
the current layer and the next layer's first. The paper's reference code moves a whole layer's
pages between host and GPU at once; that is not done here.

With `sparse_pages` a chunk attends its own pages and the past pages its queries select
(`select_pages`, against each page's mean key). Its forward and backward (`_sparse_backward`)
gather the selected pages, and the backward their gradient rows, into a compact set; offloaded, the
GPU reads those rows from pinned host memory itself and writes the gradient rows back the same way
(kernels/page_rows.py), in stream order, so neither waits for the device. Gradient rows exist only
for pages some chunk read as past pages, given back once pass 2 has passed their chunk
(`_GradPages`; `sparse_grad_pages` bounds how many are held at once). A chunk's own pages'
gradients stay on the device until they are complete.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

# The module, not its functions: they are looked up when called, so a test's spy on
# page_attention.page_attention_forward sees every call.
from kernels import page_attention
from kernels.page_rows import gather_rows, scatter_rows
from kernels.page_select import page_mass
from student.long_context.config import LongContextConfig, sparse_grad_pages
from student.pinned import POOLS

logger = logging.getLogger(__name__)
_WARNED = {"offload": False}  # warn once a process

__all__ = ["PagedKVStore", "page_set_bounds", "select_pages", "store_for_model"]


def store_for_model(model, batch_size: int, seq_len: int, config: LongContextConfig, dtype, device) -> PagedKVStore:
    """An empty `PagedKVStore` for `batch_size` sequences of `seq_len` positions of `model` (a
    student.model.Student: its layers, key/value heads and head size), with pages of `dtype` (the
    attention's: the autocast dtype, else the weights') on `device` or, with config.kv_offload on
    a GPU, in pinned host memory; page size, offloaded page sets and sparse selection as `config`."""
    c = model.config
    return PagedKVStore(c.num_layers, batch_size, seq_len, c.num_kv_heads, c.head_dim, page_tokens=config.page_tokens,
                        dtype=dtype, device=device, offload=config.kv_offload, offload_pages=config.offload_pages,
                        sparse_pages=config.sparse_pages, chunk_tokens=config.chunk_tokens)


class PagedKVStore:
    """Keys and values of every layer of one micro-batch, in pages; the `kv_store` of a Student.

    Layer l's pages are `k[l]`, `v[l]`: [num_pages * B, Hkv, P, D] in the attention dtype, slot
    j * B + b holding positions j*P .. (j+1)*P - 1 of row b (page-major, so a run of pages of
    every row is one contiguous block to copy), on the GPU or pinned on the host with offload.
    `begin(start, end, grad)` opens a chunk; each layer's `attend` then writes the chunk's keys and
    values into their pages and attends its queries over every page up to the chunk's end,
    causally. With grad=True it is differentiable: the backward adds the key and value gradients
    into `dk[l]`, `dv[l]` (fp32) and returns the chunk's own keys and values their accumulated
    gradient. Pages are written before they are read (pass 1 in order, then the last chunk in
    pass 2), and gradient pages are zeroed on the GPU when first touched, by the last chunk,
    which reads every page: nothing is cleared on the host. In sparse mode a chunk reads few past
    pages, and gradient pages exist only for pages some chunk read as past pages (`_GradPages`,
    one a layer in `grad_pages`; dk, dv stay None). `store_for_model` builds one for a Student and a
    LongContextConfig.
    """

    def __init__(self, num_layers: int, batch_size: int, seq_len: int, num_kv_heads: int, head_dim: int, *,
                 page_tokens: int, dtype, device, offload: bool = False, offload_pages: int = 1024,
                 sparse_pages: int | None = None, chunk_tokens: int | None = None):
        self.P, self.B, self.seq_len = page_tokens, batch_size, seq_len
        self.num_pages = -(-seq_len // page_tokens)
        self.dtype, self.device = dtype, torch.device(device)
        self.offload = offload and self.device.type == "cuda"
        if offload and not self.offload and not _WARNED["offload"]:
            _WARNED["offload"] = True
            logger.warning("kv_offload keeps pages in pinned host memory for a GPU; on %s they stay where they are",
                           self.device)
        self.offload_pages = offload_pages
        self.page_shape = (num_kv_heads, page_tokens, head_dim)
        self.k = [self._pool(dtype) for _ in range(num_layers)]
        self.v = [self._pool(dtype) for _ in range(num_layers)]
        self.dk: list = [None] * num_layers  # fp32 gradient pages, allocated by the first backward of a layer
        self.dv: list = [None] * num_layers
        self.grads_touched: set[int] = set()  # layers whose offloaded gradient pages exist on the host
        self.sparse_pages = sparse_pages
        # Sparse mode: mean key of every page [num_pages, B, Hkv, D] fp32 on the device, and the past
        # pages each (layer, chunk start) selected in pass 1 (`_Selection`), reused by pass 2 (same
        # sparse function).
        self.mean_k = [torch.zeros(self.num_pages, batch_size, num_kv_heads, head_dim, device=self.device)
                       for _ in range(num_layers)] if sparse_pages is not None else None
        self.selected: dict[tuple[int, int], _Selection] = {}
        # Sparse mode's gradient pages, a layer's made by its first backward. Their rows: enough for
        # pass 2 over chunks of `chunk_tokens` (`sparse_grad_pages`), else one a page.
        self.grad_pages: list = [None] * num_layers
        self.grad_page_rows = batch_size * (self.num_pages if sparse_pages is None or chunk_tokens is None
                                            else sparse_grad_pages(seq_len, chunk_tokens, page_tokens, sparse_pages))
        # Training: each (layer, chunk)'s attention output and lse from pass 1 (in pinned host memory
        # on a GPU, so the GPU holds one chunk's), used by pass 2's run and by the recomputation of
        # its checkpointed layer instead of attending again; the backward drops it (`_AttendPages`).
        # Pass 2 keeps its own there too for the recomputation. On a GPU an output comes back on the
        # side stream (`_bring`), the next layer's ahead of use: layer + 1's while a forward uses
        # this one, layer - 1's when a backward begins; `_brought` holds those copies and their events.
        self.keep_attention = False
        self.keep_from = 0  # pass 1 keeps the attention of chunks starting here or later
        self.kept_attention: dict[tuple[int, int], tuple] = {}
        self._brought: dict[tuple[int, int], tuple] = {}
        self.start = self.end = 0
        self.grad = False
        # Offload: the next layer's first page set, copied ahead (`_prefetch`), and how prefetched
        # sets ended, by (outcome, with_grads): "used", or "dropped" (not the set its layer read).
        self.prefetched: tuple | None = None  # (key, page sets) copied ahead by `_prefetch`, or None
        self.prefetch_count: Counter = Counter()
        slots = torch.arange(self.num_pages * batch_size, dtype=torch.int32, device=self.device)
        self.table = slots.view(self.num_pages, batch_size).T.contiguous()  # [B, num_pages]: row b's page j -> its slot

    def _pool(self, dtype):
        shape = (self.num_pages * self.B, *self.page_shape)
        if self.offload:  # page-locked at its exact size, kept for the next step's store (student/pinned.py)
            return POOLS.empty(self, shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def make_gradient_pools(self) -> None:
        """Every layer's key and value gradient pools now, as each layer's first backward would make
        them (page-locked on the host when offloaded): a store made and dropped before a step of its
        length leaves them, with its key and value pools, in student.pinned.POOLS for that step's."""
        for layer in range(len(self.k)):
            self._make_gradient_pools(layer)

    def _make_gradient_pools(self, layer: int) -> None:
        """Layer's gradient pools where it has none yet: fp32 pages like its key and value pools
        (dense; zeros when resident, since nothing else clears them), or sparse mode's `_GradPages`."""
        if self.sparse_pages is not None:
            if self.grad_pages[layer] is None:
                self.grad_pages[layer] = _GradPages(self.num_pages * self.B, self.grad_page_rows, self.page_shape,
                                                    device="cpu" if self.offload else self.device, pin=self.offload)
        elif self.dk[layer] is None:
            if self.offload:
                self.dk[layer], self.dv[layer] = self._pool(torch.float32), self._pool(torch.float32)
            else:
                self.dk[layer] = torch.zeros_like(self.k[layer], dtype=torch.float32)
                self.dv[layer] = torch.zeros_like(self.v[layer], dtype=torch.float32)

    # --- the KVStore seam ---------------------------------------------------------------------------

    def past_length(self) -> int:
        return self.start

    def begin(self, start: int, end: int, grad: bool) -> None:
        _take_prefetched(self, None)  # a set prefetched for the previous chunk is not this one's
        self._brought.clear()
        self.start, self.end, self.grad = start, end, grad

    def attend(self, layer: int, q, k, v):
        """q [B, H, T, D], k/v [B, Hkv, T, D] of positions start..end -> attention output [B, H, T, D]."""
        q, k, v = q.to(self.dtype), k.to(self.dtype), v.to(self.dtype)
        self._write(self.k[layer], k.detach(), None if self.mean_k is None else self.mean_k[layer])
        self._write(self.v[layer], v.detach())
        self._select(layer, q)
        if self.grad:
            return _AttendPages.apply(q, k, v, self, layer)
        out, lse = self._forward(layer, q)
        out = out.to(q.dtype)
        if self.keep_attention and self.start >= self.keep_from:
            self.kept_attention[(layer, self.start)] = self._stash(out), self._stash(lse)
        return out

    def attention_forward(self, layer: int, q):
        """(out, lse) of the chunk's queries `q` over `layer`'s pages: _AttendPages's forward."""
        # Pass 1 attended with the same queries and pages (the last chunk's first run did, under
        # layer checkpointing, for its recomputation): take that output instead of attending
        # again (attention is the costly part of a long chunk's layer). The backward drops it.
        # The device holds it only while this layer uses it: a forward brings layer + 1's ahead.
        key = (layer, self.start)
        kept = self._bring(key)
        if kept is None:
            out, lse = self._forward(layer, q)
            out = out.to(q.dtype)
            if self.keep_attention:
                self.kept_attention[key] = self._stash(out), self._stash(lse)
        else:
            out, lse = kept
        self._bring((layer + 1, self.start), ahead=True)
        return out, lse

    def attention_backward(self, layer: int, q, out, lse, dout):
        """(dq, dk, dv) of the chunk's attention over `layer`'s pages, the pages' gradient
        accumulators filled on the way: _AttendPages's backward."""
        self.kept_attention.pop((layer, self.start), None)
        self._brought.pop((layer, self.start), None)  # brought for a recomputation that did not come
        self._bring((layer - 1, self.start), ahead=True)  # its recomputation comes next
        dq, dout = None, dout.contiguous()
        if self.sparse_pages is not None:
            dq, dk, dv = self._sparse_backward(layer, q, out, lse, dout)
            return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
        with _no_autocast(q):
            for k, v, dk, dv, table, first in self._page_sets(layer, with_grads=True):
                part = page_attention.page_attention_backward(q, dout, out, lse, k, v, dk, dv, table,
                                                              first_page=first, q_start=self.start)
                dq = part if dq is None else dq + part
        # Complete now: later chunks ran before this one and this chunk's queries just added theirs.
        dk, dv = self._own(self.dk[layer]), self._own(self.dv[layer])
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    def _stash(self, x):
        """x, or on a GPU a pinned host copy of it, copied on the side stream after the work queued
        so far on the current one (which made x); `_bring` copies it back on that stream, after."""
        if self.device.type != "cuda":
            return x
        side = _side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
        x.record_stream(side)
        return host

    def _bring(self, key: tuple[int, int], *, ahead: bool = False):
        """The kept (out, lse) of (layer, chunk start) on the device, for the current stream: the
        copy brought ahead when there is one, else one copied now on the side stream; None when
        nothing is kept for it. ahead=True: start the copy and keep it for a later call."""
        kept = self.kept_attention.get(key)
        if kept is None or self.device.type != "cuda":
            return None if ahead else kept  # elsewhere the kept output is used where it is
        brought = self._brought.pop(key, None)
        if brought is None:
            brought = _copy_in(kept, self.device)
        if ahead:
            self._brought[key] = brought
            return None
        copies, done = brought
        torch.cuda.current_stream(self.device).wait_event(done)
        return tuple(copies)

    # --- pages ------------------------------------------------------------------------------------

    def _page_range(self) -> tuple[int, int]:
        """First and one-past-last page of the current chunk's positions."""
        return self.start // self.P, -(-self.end // self.P)

    def _pages(self, pool, j0: int, j1: int):
        """Pages j0..j1-1 of every row, on the compute device (copied there on the current stream,
        after the writes queued on it, when offloaded): [(j1 - j0) * B, Hkv, P, D]."""
        return pool[j0 * self.B:j1 * self.B].to(self.device, non_blocking=True)

    def _as_positions(self, pages):
        """[n * B, Hkv, P, D] page-major -> [B, Hkv, n * P, D] (a copy)."""
        n = pages.shape[0] // self.B
        return pages.view(n, self.B, *self.page_shape).permute(1, 2, 0, 3, 4).reshape(
            self.B, self.page_shape[0], n * self.P, self.page_shape[2])

    def _write(self, pool, x, mean_k=None) -> None:
        """Store x [B, Hkv, end - start, D] at positions start..end of every row; the rest of the
        chunk's last page is zeros (finite: the attention masks it, but 0 * NaN would leak). With
        `mean_k`, also each written page's mean key (over its P positions)."""
        j0, j1 = self._page_range()
        lo = self.start - j0 * self.P
        region = torch.zeros(self.B, x.shape[1], (j1 - j0) * self.P, x.shape[-1], dtype=pool.dtype, device=x.device)
        if lo:  # the first page holds the previous chunk's last positions
            region[:, :, :lo] = self._as_positions(self._pages(pool, j0, j0 + 1))[:, :, :lo]
        region[:, :, lo:lo + x.shape[2]] = x
        pages = region.view(self.B, x.shape[1], j1 - j0, self.P, x.shape[-1]).permute(2, 0, 1, 3, 4)
        if mean_k is not None:
            mean_k[j0:j1] = pages.float().mean(3)
        pool[j0 * self.B:j1 * self.B].view(j1 - j0, self.B, *self.page_shape).copy_(pages, non_blocking=True)

    def _own(self, pool):
        """The current chunk's positions of `pool` (gradient pages): [B, Hkv, end - start, D]."""
        j0, j1 = self._page_range()
        lo = self.start - j0 * self.P
        return self._as_positions(self._pages(pool, j0, j1))[:, :, lo:lo + self.end - self.start]

    def _sparse_backward(self, layer: int, q, out, lse, dout):
        """(dq, dk, dv) of a sparse chunk's attention, dk and dv those of its own positions. Two
        page sets, as the forward read them:
        - the selected past pages (none while the chunk has no more past pages than the budget),
          gathered with their gradient rows (`_GradPages`) into one set, the rows put back after
          (kernels/page_rows.py: offloaded, by the GPU from and to pinned host memory). The rows
          are chosen on the host from the selection's host copy, which pass 1 made.
        - the chunk's own pages, and without a selection every page before them: a slice of the
          pools, copied as it lies. Their gradients begin as zeros on the device, the past pages'
          from their rows (put back after). The own pages' rows (what later chunks added) are
          added after the attention, in `_complete_own`: the same sums, and the own pages' gradients
          do not go to the host and back."""
        B, (j0, num) = self.B, self._page_range()
        self._make_gradient_pools(layer)
        grads, picked, dq = self.grad_pages[layer], self.selected.get((layer, self.start)), None
        if picked is not None:
            slots = picked.slots()
            k, v = (gather_rows(pool, slots) for pool in (self.k[layer], self.v[layer]))
            rows, index = grads.rows(picked.slots(host=True))
            dk, dv = grads.read(index, self.device)
            table = torch.arange(index.numel(), dtype=torch.int32, device=self.device).view(B, -1)
            dq = self._attention_backward_part(q, out, lse, dout, k, v, dk, dv, table, 0)
            grads.write(rows, dk, dv)
        first = j0 if picked is not None else 0
        k, v = self._pages(self.k[layer], first, num), self._pages(self.v[layer], first, num)
        dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=self.device) for _ in range(2))
        past = torch.arange(first * B, j0 * B)  # page-major slots before the chunk's first page
        n = past.numel()
        if n:
            taken, index = grads.rows(past)
            for acc, rows in zip((dk, dv), grads.read(index, self.device)):
                acc[:n] = rows
        table = torch.arange((num - first) * B, dtype=torch.int32, device=self.device).view(num - first, B).T.contiguous()
        part = self._attention_backward_part(q, out, lse, dout, k, v, dk, dv, table, first)
        dq = part if dq is None else dq + part
        if n:
            grads.write(taken, dk[:n], dv[:n])
        return dq, *self._complete_own(grads, dk[n:], dv[n:])

    def _attention_backward_part(self, q, out, lse, dout, k, v, dk, dv, table, first: int):
        """dq of one page set (`page_attention_backward`), its key and value gradients added into dk, dv."""
        with _no_autocast(q):
            return page_attention.page_attention_backward(q, dout, out, lse, k, v, dk, dv, table, first_page=first,
                                                          q_start=self.start)

    def _complete_own(self, grads: _GradPages, dk, dv):
        """The chunk's own positions of `dk`, `dv` (its own pages' gradients from its own queries,
        page-major) with what later chunks added to those pages (their rows), complete now: pass 2
        ran the later chunks first. The first page, when the chunk began inside it, goes back to
        its row (the chunk before adds to it); the rows of the others are given back."""
        B, (j0, j1) = self.B, self._page_range()
        lo = self.start - j0 * self.P
        slots = torch.arange(j0 * B, j1 * B)
        rows = grads.row_of[slots]
        have = (rows >= 0).nonzero().flatten()
        if have.numel():
            at = have.to(self.device)
            for acc, earlier in zip((dk, dv), grads.read(rows[have], self.device)):
                acc.index_add_(0, at, earlier)
        if lo:
            grads.put(slots[:B], dk[:B], dv[:B])
        grads.release(torch.arange(-(-self.start // self.P) * B, j1 * B))
        return [self._as_positions(g)[:, :, lo:lo + self.end - self.start] for g in (dk, dv)]

    def _select(self, layer: int, q) -> None:
        """Sparse mode: choose the chunk's past pages once (pass 1, or pass 2 for the last chunk)
        with `select_pages`; none while the chunk has no more past pages than the budget."""
        j0 = self.start // self.P
        if self.sparse_pages is None or j0 <= self.sparse_pages or (layer, self.start) in self.selected:
            return
        self.selected[(layer, self.start)] = _Selection(select_pages(q, self.mean_k[layer][:j0], self.sparse_pages))

    def _page_sets(self, layer: int, with_grads: bool):
        """(k, v, dk, dv, table, first_page) for the page sets an attention call reads, in order:
        dense, pages 0 .. the chunk's last; sparse, the selected past pages (given as pages 0..N-1
        of the set: every one lies before the chunk, so all are visible to its queries) and then
        the chunk's own pages. Resident pools give one set per kind; dk/dv are None without grads."""
        j0, num = self._page_range()
        assert not (with_grads and self.sparse_pages is not None), "sparse mode's backward is _sparse_backward"
        if with_grads:
            self._make_gradient_pools(layer)
        picked = self.selected.get((layer, self.start))
        if not self.offload:
            grads = (self.dk[layer], self.dv[layer]) if with_grads else (None, None)
            if picked is None:
                yield self.k[layer], self.v[layer], *grads, self.table[:, :num].contiguous(), 0
                return
            yield self.k[layer], self.v[layer], *grads, self.table.gather(1, picked.pages).contiguous(), 0
            yield self.k[layer], self.v[layer], *grads, self.table[:, j0:num].contiguous(), j0
            return
        if picked is None:
            yield from _offloaded_sets(self, layer, 0, num, with_grads)
            return
        yield from _selected_set(self, layer, picked)
        yield from _offloaded_sets(self, layer, j0, num, with_grads)

    def _forward(self, layer: int, q):
        merged = None
        with _no_autocast(q):  # the kernels take their dtypes from the pages; lse and out stay fp32
            for k, v, _, _, table, first in self._page_sets(layer, with_grads=False):
                part = page_attention.page_attention_forward(q, k, v, table, first_page=first, q_start=self.start)
                # Merged as they come: two partial outputs of the chunk's queries at a time, not one a set.
                merged = part if merged is None else page_attention.merge_partials([merged, part])
        return merged


def select_pages(q, mean_k, budget: int):
    """Page indices [B, budget] (ascending) of the past pages a chunk attends in sparse mode: those
    with the largest attention mass of the chunk's queries q [B, H, T, D] (summed over each GQA
    group, no 1/sqrt(D), as OOMB scores) against the pages' mean keys mean_k [J, B, Hkv, D],
    summed over queries and heads (kernels/page_select.py's `page_mass`). OOMB selects per block
    of 128 queries; here one selection serves the whole chunk, so one page table serves every
    query. On a GPU, `page_mass`'s Triton path (measured faster than torch's: row
    `page_select/qwen2.5-7b-T16384-past4177920/select_triton@64450bc`)."""
    Hkv = mean_k.shape[2]
    with torch.no_grad():
        q_group = q.float().unflatten(1, (Hkv, q.shape[1] // Hkv)).sum(2)  # [B, Hkv, T, D]
        score = page_mass(q_group, mean_k)
        return score.topk(budget, dim=1).indices.sort(dim=1).values


def _offloaded_sets(store: PagedKVStore, layer: int, first_page: int, num_pages: int, with_grads: bool):
    """Page sets of `offload_pages` pages (of every row) copied to the GPU on a side stream, the
    next set's copy in flight while the caller computes on this one. The first set is the one the
    layer before prefetched when it holds these pages; once this layer's last set is on its way
    (without grads) or its gradients are sent home (with grads), the first set of the layer that
    reads pages next is prefetched: up to three sets on the GPU at once. With grads, each set's
    gradient pages come along (zeros the first time a layer's are touched: the sequence's last
    chunk reads every page) and go back to the host after the caller has added to them."""
    B = store.B
    compute, side = torch.cuda.current_stream(store.device), _side_stream(store.device)
    fresh = with_grads and layer not in store.grads_touched
    assert not fresh or first_page == 0, "the first backward of a layer (the last chunk's) reads every page"
    if with_grads:
        store.grads_touched.add(layer)
    bounds = page_set_bounds(first_page, num_pages, store.start // store.P, store.offload_pages)

    def issue(i: int):
        pending = _take_prefetched(store, (layer, with_grads, fresh, *bounds[0])) if i == 0 else None
        if pending is None:
            pending = _fetch(store, layer, *bounds[i], with_grads=with_grads, fresh=fresh)
        if i + 1 == len(bounds) and not with_grads:  # the forward reads layer + 1's pages next
            _prefetch(store, layer + 1, with_grads=False)
        return pending

    pending = issue(0)
    for i, (j0, j1) in enumerate(bounds):
        gpu, done = pending
        if i + 1 < len(bounds):
            pending = issue(i + 1)
        compute.wait_event(done)
        table = torch.arange((j1 - j0) * B, dtype=torch.int32, device=store.device).view(j1 - j0, B).T.contiguous()
        k, v, *grads = gpu
        yield k, v, *(grads or [None, None]), table, j0
        if with_grads:  # the caller added this set's gradients: send them home
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                for pool, new in zip((store.dk[layer], store.dv[layer]), grads):
                    pool[j0 * B:j1 * B].copy_(new, non_blocking=True)
                    new.record_stream(side)
    if with_grads:
        compute.wait_stream(side)  # the chunk's own gradients are read back right after
        # The backward reads layer - 1's pages next. Queued behind the write-backs on the side
        # stream, so the wait above does not wait for it.
        _prefetch(store, layer - 1, with_grads=True)


def page_set_bounds(first_page: int, num_pages: int, final: int, step: int) -> list[tuple[int, int]]:
    """The page sets an offloaded attention call reads, in order: [(j0, j1)] covering pages
    first_page..num_pages-1, `step` pages (LongContextConfig.offload_pages) at a time, split at
    `final` (the chunk's first page): the first set then holds only pages that earlier chunks
    wrote, which the layer before may prefetch (`_prefetch`)."""
    cut = min(max(first_page, final), num_pages)
    return ([(j, min(j + step, cut)) for j in range(first_page, cut, step)]
            + [(j, min(j + step, num_pages)) for j in range(cut, num_pages, step)])


def _fetch(store: PagedKVStore, layer: int, j0: int, j1: int, *, with_grads: bool, fresh: bool):
    """Copy pages j0..j1-1 of `layer` (of every row; with grads their gradient pages too, zeros
    when `fresh`) to the GPU on the side stream, after the work queued so far on the compute stream:
    ([k, v] or [k, v, dk, dv], an event recorded when the copies are done)."""
    B = store.B
    pools = [store.k[layer], store.v[layer]]
    if with_grads and not fresh:
        pools += [store.dk[layer], store.dv[layer]]
    out, done = _copy_in([pool[j0 * B:j1 * B] for pool in pools], store.device)
    if fresh:
        out += [torch.zeros((j1 - j0) * B, *store.page_shape, device=store.device) for _ in range(2)]
    return out, done


def _copy_in(sources, device):
    """Device copies of host tensors, made on the side stream after the work queued so far on the
    current (compute) stream, which last wrote the sources and last read what the copies reuse:
    ([copies], an event recorded when they are done). The copies are allocated in the compute
    stream's pool, where they are used and freed; the caching allocator keeps one pool a stream and
    does not lend one stream's cached blocks to another, so copies made in the side stream's pool
    kept memory reserved that the compute stream could not reuse (`--memory-peak`'s
    reserved_by_stream). Marked used on the side stream, so a copy dropped before the compute
    stream waits for it (a prefetch not taken) is not reused before it is written."""
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    copies = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in sources]
    with torch.cuda.stream(side):
        for copy, x in zip(copies, sources):
            copy.copy_(x, non_blocking=True)
            copy.record_stream(side)
    done = torch.cuda.Event()
    done.record(side)
    return copies, done


def _prefetch(store: PagedKVStore, layer: int, with_grads: bool) -> None:
    """Start copying `layer`'s first page set (`page_set_bounds`) ahead of its attention, keeping it
    on the store for `_offloaded_sets`. Only pages before the chunk's first are final now (the
    chunk's own are written by that layer's `attend`, later), so none without a past page, past
    the first or last layer, or for a layer that reads its selected pages first (sparse)."""
    final = store.start // store.P
    if not 0 <= layer < len(store.k) or final == 0:
        return
    if store.sparse_pages is not None and final > store.sparse_pages:
        return
    _take_prefetched(store, None)
    fresh = with_grads and layer not in store.grads_touched
    key = (layer, with_grads, fresh, 0, min(store.offload_pages, final))
    store.prefetched = key, _fetch(store, layer, *key[3:], with_grads=with_grads, fresh=fresh)


def _take_prefetched(store: PagedKVStore, key):
    """The prefetched copy when it is of `key` (layer, with_grads, fresh, j0, j1), else None; a
    prefetched copy of anything else is dropped (never read as other pages)."""
    held, store.prefetched = store.prefetched, None
    if held is None:
        return None
    if held[0] == key:
        store.prefetch_count["used", key[1]] += 1
        return held[1]
    store.prefetch_count["dropped", held[0][1]] += 1
    return None


def _selected_set(store: PagedKVStore, layer: int, picked: _Selection):
    """The selected past pages of an offloaded sparse chunk's forward as one page set, read by the
    GPU from pinned host memory (kernels/page_rows.py) after the writes queued before it."""
    slots = picked.slots()
    k, v = (gather_rows(pool, slots) for pool in (store.k[layer], store.v[layer]))
    yield k, v, None, None, torch.arange(slots.numel(), dtype=torch.int32, device=store.device).view(store.B, -1), 0


class _Selection:
    """A chunk's selected past pages (`select_pages`: [B, budget], sorted) on the device, and a host
    copy made as they are chosen without waiting for it: pass 2's backward chooses gradient rows from
    it on the host, long after the copy landed."""

    def __init__(self, pages):
        self.pages = pages
        self._host, self._done = pages, None
        if pages.is_cuda:
            self._host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
            self._host.copy_(pages, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def slots(self, host: bool = False):
        """The selected pages' slots (page j of row b: j * B + b), row-major (row b's pages in
        order): on the device, or with host=True on the host (waiting for the copy if need be)."""
        if host and self._done is not None:
            self._done.synchronize()
        pages = self._host if host else self.pages
        B = pages.shape[0]
        return (pages * B + torch.arange(B, device=pages.device)[:, None]).reshape(-1)


class _GradPages:
    """One layer's fp32 key and value gradient pages in sparse mode, only for the slots (page j of
    row b: slot j * B + b, as the key and value pools) that a chunk's backward read as a past page
    or a chunk began inside: a row of `dk` and `dv` a slot, taken when the slot is first read or
    written (read as zeros then), given back (`release`) once pass 2 has passed the slot's chunk.
    `rows` rows in all (PagedKVStore.grad_page_rows: enough for pass 2, by `sparse_grad_pages`), on
    `device` (pinned on the host when offloaded: then only the GPU reads and writes them, in stream
    order, kernels/page_rows.py). Which slot has which row is kept on the host."""

    def __init__(self, slots: int, rows: int, page_shape, *, device, pin: bool):
        shape = (rows, *page_shape)
        make = (lambda: POOLS.empty(self, shape, torch.float32)) if pin else \
            (lambda: torch.empty(shape, dtype=torch.float32, device=device))
        self.dk, self.dv = make(), make()
        self.row_of = torch.full((slots,), -1, dtype=torch.long)  # slot -> its row, -1: none yet
        self.free = list(range(rows - 1, -1, -1))  # rows not in use, the next one taken last

    def rows(self, slots):
        """(rows, index) of `slots` (a CPU index tensor): their rows, taken for those that have none,
        and the same with -1 for those just taken (their gradients are zeros so far: `read`)."""
        rows = self.row_of[slots]
        index = rows.clone()
        new = (rows < 0).nonzero().flatten()
        if new.numel():
            assert new.numel() <= len(self.free), "sparse gradient pages: more in use than sparse_grad_pages bounds"
            taken = torch.tensor([self.free.pop() for _ in range(new.numel())], dtype=torch.long)
            rows[new] = taken
            self.row_of[slots[new]] = taken
        return rows, index

    def read(self, index, device):
        """[dk, dv] of rows `index` on `device`, in their order; zeros where index is -1."""
        at = index.to(device, non_blocking=True)
        return [gather_rows(pool, at) for pool in (self.dk, self.dv)]

    def put(self, slots, dk, dv) -> None:
        """Write gradients of `slots` to their rows (taken for those that have none)."""
        self.write(self.rows(slots)[0], dk, dv)

    def write(self, rows, dk, dv) -> None:
        """Write gradients to rows `rows` (a CPU index tensor), from where dk and dv are."""
        at = rows.to(dk.device, non_blocking=True)
        for pool, new in ((self.dk, dk), (self.dv, dv)):
            scatter_rows(pool, at, new.contiguous())

    def release(self, slots) -> None:
        """Give the rows of `slots` back (those that have one)."""
        rows = self.row_of[slots]
        self.free.extend(rows[rows >= 0].tolist())
        self.row_of[slots] = -1


_SIDE_STREAMS: dict = {}


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _no_autocast(tensor):
    return torch.autocast(tensor.device.type, enabled=False)


class _AttendPages(torch.autograd.Function):
    """The chunk's attention over its layer's pages; backward fills the page accumulators
    (PagedKVStore.attention_forward / attention_backward do the work)."""

    @staticmethod
    def forward(ctx, q, k, v, store: PagedKVStore, layer: int):
        out, lse = store.attention_forward(layer, q)
        ctx.store, ctx.layer = store, layer
        ctx.save_for_backward(q, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.store.attention_backward(ctx.layer, q, out, lse, dout)
        return dq, dk, dv, None, None
