"""The two passes of chunk-recurrent training (OOMB, arXiv 2602.02108) over a paged key/value store.

A micro-batch of sequences of L positions is cut into chunks of `chunk_tokens`. The gradient is
that of full backpropagation, exactly, while the activations held at once are those of one chunk:

  pass 1, no gradients, chunks in order (all but the last): every layer writes the chunk's keys
          and values (after RoPE) into pages of a `PagedKVStore` (student/long_context/store.py)
          and attends over the pages so far, keeping the attention output and lse (pinned host
          memory on a GPU) for pass 2, which would compute the same again;
  pass 2, chunks in reverse: the chunk runs again with gradients against the stored pages; its
          loss (the fused top-k KL on its cached rows, normalised by the micro-batch's real
          tokens, so the chunks' losses sum to the full-sequence loss) is backpropagated. The page
          attention's backward adds the gradients of every key and value it read into that page's
          gradient accumulator, and hands the chunk's own keys and values their accumulated
          gradient: what this chunk's queries and every later chunk's (already run) sent them.
          Parameter gradients accumulate over the chunks.

`chunked_forward` runs every chunk in order without gradients, as pass 1 does, for evaluation:
each chunk's hidden states against the pages of the chunks before it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from student.data import Batch
from student.long_context.config import LongContextConfig, chunk_bounds, kept_chunks
from student.long_context.store import store_for_model

__all__ = ["Part", "chunk_recurrent_backward", "chunked_forward", "kept_attention_from"]


class Part(NamedTuple):
    """What a chunk is of its micro-batch: the micro-batch's real rows (Batch.kd_rows) and rows with a next token
    (student.loss.distill_loss's `whole`), and the chunk's share of the real rows (for means over
    tokens such as the sparse FFN's L1 penalty)."""

    rows: int
    target_rows: int
    share: float

    @property
    def whole(self) -> tuple[int, int]:
        return self.rows, self.target_rows


def kept_attention_from(bounds: list[tuple[int, int]], keep_chunks: int | None) -> int:
    """The first position whose chunk's attention pass 1 keeps (LongContextConfig.keep_attention_chunks):
    the last `keep_chunks` of the chunks before the final one (all when None); past the sequence
    when none."""
    kept = kept_chunks(len(bounds), keep_chunks)
    return bounds[kept.start][0] if kept else bounds[-1][1]


def _attention_dtype(model, autocast_dtype):
    return autocast_dtype if autocast_dtype is not None else model.embed_tokens.weight.dtype


def chunked_forward(model, input_ids, token_mask, config: LongContextConfig, *, autocast_dtype=None):
    """Without gradients: yield (start, end, hidden [B, end - start, d], ffn terms) of each chunk of
    input_ids [B, L] in order (one chunk of the whole sequence when chunk_tokens is None)."""
    B, L = input_ids.shape
    device = input_ids.device
    amp = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    bounds = chunk_bounds(L, config.chunk_tokens)
    dtype = _attention_dtype(model, autocast_dtype)
    store = None if len(bounds) == 1 else store_for_model(model, B, L, config, dtype, device)
    mask_BL = token_mask.view(B, L)
    with torch.no_grad():
        for s, e in bounds:
            if store is not None:
                store.begin(s, e, grad=False)
            with amp:
                hidden, terms = model(input_ids[:, s:e], kv_store=store, token_mask=mask_BL[:, s:e],
                                      return_ffn_terms=True)
            yield s, e, hidden, terms


def chunk_recurrent_backward(model, batch: Batch, chunk_loss: Callable, config: LongContextConfig, *,
                             device, autocast_dtype=None, grad_scale: float = 1.0,
                             whole: tuple[int, int] | None = None):
    """Backpropagate the loss of micro-batch `batch` chunk by chunk (module docstring); returns the
    sum over chunks of what `chunk_loss` returned, detached.

    batch: a student.data.Batch, on the host or the device (each chunk's rows go to `device` as
    they are needed). chunk_loss(hidden [B, T, d], rows: Batch of the chunk, terms, part: Part)
    -> (loss, *logged): the chunk's part of the micro-batch's loss, such that the chunks' losses
    sum to it (student.loss.distill_loss's `whole` argument does this for the fused loss);
    `loss * grad_scale` is backpropagated and the rest summed. Parameter .grad accumulate as for
    a plain backward. whole: the (real rows, rows with a next token) of the micro-batch of which
    `batch` is one process's part (student/distributed.py; default: `batch` is the whole).
    """
    input_ids = batch.input_ids.to(device, non_blocking=True)
    B, L = input_ids.shape
    mask_BL = batch.mask.view(B, L)
    real_L = batch.kd_rows.view(B, L).sum(0).tolist()  # one host sync (none when the batch is on the host)
    if whole is None:
        whole = (sum(real_L), int((mask_BL & (batch.target_ids.view(B, L) >= 0)).sum()))
    bounds = chunk_bounds(L, config.chunk_tokens)
    store = store_for_model(model, B, L, config, _attention_dtype(model, autocast_dtype), device)
    store.keep_attention = True
    store.keep_from = kept_attention_from(bounds, config.keep_attention_chunks)
    mask_BL = mask_BL.to(device, non_blocking=True)
    amp = torch.autocast(torch.device(device).type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with torch.no_grad(), amp:
        for s, e in bounds[:-1]:  # pass 1: the last chunk writes its own pages in pass 2
            store.begin(s, e, grad=False)
            model(input_ids[:, s:e], kv_store=store, token_mask=mask_BL[:, s:e])
    sums = None
    for s, e in reversed(bounds):  # pass 2
        store.begin(s, e, grad=True)
        rows = batch.positions(s, e).to(device, non_blocking=True)
        with amp:
            hidden, terms = model(input_ids[:, s:e], kv_store=store, token_mask=mask_BL[:, s:e],
                                  return_ffn_terms=True, checkpoint_layers=config.checkpoint_layers)
        loss, *logged = chunk_loss(hidden, rows, terms, Part(*whole, share=sum(real_L[s:e]) / max(whole[0], 1)))
        (loss * grad_scale).backward()
        values = [loss.detach(), *[x.detach() for x in logged]]
        sums = values if sums is None else [a + b for a, b in zip(sums, values)]
    return tuple(sums)
