"""How chunk-recurrent training cuts sequences and keeps their keys and values: the `long` part of
TrainConfig, and the chunk arithmetic the engine (student/long_context/engine.py) runs by and the
planner (student/planner/costs.py) prices. Torch-free: the CLI builds it for its options."""

from __future__ import annotations

from dataclasses import dataclass

from distill.configs import ConfigError, check_types, option, require

__all__ = ["LongContextConfig", "chunk_bounds", "kept_chunks", "sparse_grad_pages"]


@dataclass
class LongContextConfig:
    """How sequences are cut into chunks and where their keys and values live."""

    # Tokens per chunk: a micro-batch's sequences run chunk by chunk (exact gradients; activation
    # memory of one chunk). None: whole sequences at once.
    chunk_tokens: int | None = option(None, (
        "Train each sequence in chunks of N tokens, exactly (OOMB chunk-recurrent: keys and values in pages, "
        "the activations of one chunk); default: whole sequences."))
    page_tokens: int = option(64, "With --chunk-tokens: positions per key/value page (a power of two >= 16).")
    kv_offload: bool = option(False, (
        "With --chunk-tokens on a GPU: keep the pages and their gradients in pinned host memory, streamed to "
        "the GPU a page set at a time."))
    # Pages that come to the GPU at once when offloaded (one page set of an attention call); up to
    # three sets are resident: one read, the next copied, and the next layer's first prefetched.
    offload_pages: int = option(1024, (
        "With --kv-offload: pages per set streamed to the GPU (two sets are resident at once)."))
    # Pass 2 keeps only each layer's input and attention output for the backward and runs the rest
    # of the layer again there: the activations held are one layer's of one chunk, for one more
    # forward of every layer's projections and MLP (not of its attention).
    checkpoint_layers: bool = option(True, (
        "With --chunk-tokens: keep only each layer's input of a chunk and run the layer again in its backward "
        "(less memory, one more forward)."))
    # Sparse attention (not exact): each chunk attends its own pages causally plus this many past
    # pages, those its queries score highest against the pages' mean keys (OOMB's page top-k).
    # None: dense attention over every past page.
    sparse_pages: int | None = option(None, (
        "With --chunk-tokens: sparse attention (not exact): each chunk attends its own pages plus the N past "
        "pages its queries score highest against their mean keys (OOMB's page top-k); default: dense."))
    # Pass 1 keeps each layer's attention output (and lse) of a chunk for pass 2, which then takes
    # it instead of attending again (attention is most of a long chunk's layer): of the last this
    # many chunks before the final one, whose attention costs most (None: every chunk; 0: none).
    # On a GPU they wait in pinned host memory, layers x heads x (head_dim x 2 + 4) bytes a token:
    # at a million tokens more than the pages themselves, so a host that cannot hold them all keeps
    # fewer and pays one more attention forward for each chunk it does not keep.
    keep_attention_chunks: int | None = option(None, (
        "With --chunk-tokens: pass 1 keeps the attention outputs of only the last N chunks for pass 2 (in "
        "pinned host memory on a GPU) and pass 2 attends again for the others: less host memory at a million "
        "tokens, the same results; default: every chunk's, or with --offload auto the most that fit "
        "--host-memory."))

    @property
    def budget_chunks(self) -> float | None:
        """Sparse mode's budget of past pages in chunks' worth of pages (None: dense), by which the
        planner prices a chunk's attention (student/planner/table.py's `past_read_share`)."""
        return None if self.sparse_pages is None else self.sparse_pages * self.page_tokens / self.chunk_tokens

    def __post_init__(self):
        check_types(self)
        require("chunk_tokens", self.chunk_tokens, self.chunk_tokens is None or self.chunk_tokens >= 1,
                "a positive integer, or leave it out")
        p = self.page_tokens
        require("page_tokens", p, p >= 16 and p & (p - 1) == 0, "a power of two >= 16")
        require("offload_pages", self.offload_pages, self.offload_pages >= 1, "an integer >= 1")
        require("keep_attention_chunks", self.keep_attention_chunks,
                self.keep_attention_chunks is None or self.keep_attention_chunks >= 0,
                "an integer >= 0, or leave it out")
        require("sparse_pages", self.sparse_pages, self.sparse_pages is None or self.sparse_pages >= 1,
                "a positive integer, or leave it out")
        if self.sparse_pages is not None and self.chunk_tokens is None:
            raise ConfigError("sparse_pages", "selects past pages for each chunk of chunk-recurrent training: give "
                                              "--chunk-tokens too, or drop --sparse-pages")
        if self.kv_offload and self.chunk_tokens is None:
            raise ConfigError("kv_offload", "keeps the pages of chunk-recurrent training in host memory: give "
                                            "--chunk-tokens too, or drop --kv-offload")


def chunk_bounds(length: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    """[(start, end)] of the chunks of `length` positions, in order; the last may be shorter."""
    step = length if chunk_tokens is None else chunk_tokens
    return [(s, min(s + step, length)) for s in range(0, length, step)]


def kept_chunks(chunks: int, keep: int | None) -> range:
    """The chunks (indexes among a micro-batch's `chunks`) whose attention output pass 1 keeps for
    pass 2 (LongContextConfig.keep_attention_chunks): the last `keep` of those before the final one,
    all of them when None. Pass 2 attends again for the others; pass 1 never runs the final one.
    The one rule: the engine keeps by it and the planner (student/planner/costs.py) prices it."""
    before = chunks - 1
    kept = before if keep is None else min(keep, before)
    return range(before - kept, before)


def sparse_grad_pages(length: int, chunk_tokens: int, page_tokens: int, budget: int) -> int:
    """The most pages (of one row, per layer) that hold a gradient at once in sparse mode, where
    the store keeps a gradient row only for a page that a chunk read as a past page, or that a
    chunk began inside, and gives a chunk's own back once pass 2 has passed it
    (student/long_context/store.py's `_GradPages`; a chunk's own pages' gradients stay on the device).
    Pass 2 runs the chunks last to first; while chunk c's backward runs, the pages with a row lie
    before chunk c + 1 (later ones were given back) and were read by chunks c..n-1, each at most
    `budget` past pages (a chunk with no more past pages than that reads them all) and one more
    where it starts inside a page. So at most min(pages up to chunk c's end, (n - c) x (budget + 1)),
    over c."""
    pages = lambda tokens: -(-tokens // page_tokens)
    bounds = chunk_bounds(length, chunk_tokens)
    return max(min(pages(e), (len(bounds) - c) * (budget + 1)) for c, (_, e) in enumerate(bounds))
