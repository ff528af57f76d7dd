"""`distill cache-stats`: what a cache holds, what it costs on disk, and how sure its teacher is.

Everything is accumulated shard by shard in bounded memory (percentiles come from a 10,000-bin
histogram of top-k mass, accurate to 1e-4), so the stats of a large cache need one pass and
no more memory than one shard.

For a sampled cache (RS-KD) the "top-k" figures are those of the drawn ids (slots with count > 0;
padding slots are left out), ranks are positions among the drawn ids by count, and
``unique_ids_per_position`` says how many distinct ids the S draws gave (mean, percentiles and
a histogram over 1..S). For a hybrid cache (topk+sampled) the "top-k" figures are those of the
exact top-K and the drawn ids together (ranks: the top-K first, then the drawn ids by count), and
``unique_ids_per_position`` counts the distinct drawn ids outside the top-K.

``tokenizer_files`` says whether the cache stores its teacher's tokenizer files, and so can teach
students of other tokenizers (teacher_cache/tokenizer_files.py, teacher_cache/token_bytes.py).
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from distill.errors import DistillUserError
from distill.files import atomic_write_bytes
from teacher_cache.errors import CacheError
from teacher_cache.reader import CacheReader
from teacher_cache.token_bytes import token_pieces
from teacher_cache.tokenizer_files import load_cache_tokenizer

_MASS_BINS = 10_000
_PLOT_BINS = 20
PERCENTILES = (1, 10, 50, 90, 99)
ENTROPY_NOTE = ("nats; top-k part exact from the stored log-probs; tail bounds: lower = tail mass spread "
                "over tokens no likelier than min(p_k, tail mass), upper = tail mass spread uniformly over "
                "the vocab_size - k other tokens")


class PlotDependencyError(DistillUserError, ImportError):
    """matplotlib is missing; it is an optional extra."""


def rank_buckets(k: int) -> list[tuple[int, int]]:
    """Inclusive rank ranges 1, 2, 3-5, 6-10, 11-k, clipped to k (ranks above k form the last bucket)."""
    out = []
    for low, high in ((1, 1), (2, 2), (3, 5), (6, 10), (11, k)):
        if low <= k:
            out.append((low, min(high, k)))
    return out


def _bucket_label(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


@dataclass
class _Accumulator:
    k: int
    vocab_size: int
    tokens: int = 0
    sequences: int = 0
    shards: int = 0
    ce_sum: float = 0.0
    ce_rows: int = 0
    mass_counts: np.ndarray = field(default_factory=lambda: np.zeros(_MASS_BINS, dtype=np.int64))
    entropy_top: float = 0.0
    entropy_tail_low: float = 0.0
    entropy_tail_high: float = 0.0
    rank_counts: np.ndarray = None  # int64 [buckets + 1], the last for ranks > k
    unique_counts: np.ndarray = None  # int64 [k - head + 1]: positions by number of distinct drawn ids (sampled)
    head: int = 0  # a hybrid cache's exact top-K slots per row

    def __post_init__(self) -> None:
        self.rank_counts = np.zeros(len(rank_buckets(self.k)) + 1, dtype=np.int64)
        self.unique_counts = np.zeros(self.k - self.head + 1, dtype=np.int64)

    def add(self, input_ids: np.ndarray, seq_offsets: np.ndarray, targets) -> None:
        self.shards += 1
        self.sequences += len(seq_offsets) - 1
        self.tokens += len(input_ids)
        target = targets.target_logprob.astype(np.float64)
        finite = np.isfinite(target)
        self.ce_sum += float(-target[finite].sum())
        self.ce_rows += int(finite.sum())

        logp = targets.topk_logprobs.astype(np.float64)
        p = np.exp(logp)
        ids, others = targets.topk_ids, np.full(len(p), max(self.vocab_size - self.k, 0))
        if targets.sample_counts is not None:
            drawn = targets.sample_counts > 0
            unique = drawn.sum(axis=1)
            self.unique_counts += np.bincount(unique, minlength=self.k - self.head + 1)
            kept = drawn
            if self.head:
                kept = drawn.copy()
                kept[:, :self.head] = True
            p, logp, ids = np.where(kept, p, 0.0), np.where(kept, logp, 0.0), np.where(kept, ids, -1)
            others = self.vocab_size - self.head - unique
        mass = p.sum(axis=1)
        bins = np.clip((mass * _MASS_BINS).astype(np.int64), 0, _MASS_BINS - 1)
        self.mass_counts += np.bincount(bins, minlength=_MASS_BINS)

        plogp = np.where(p > 0, p * logp, 0.0)
        self.entropy_top += float(-plogp.sum())
        tail = np.exp(targets.tail_logmass.astype(np.float64))
        # Every tail token has p <= p_k and p <= the tail mass; a quantising codec may decode p_k to 0,
        # in which case only the second cap is known (so too for drawn ids, which are no top-k).
        p_min = p.min(axis=1)
        cap = np.where((p_min > 0) & (targets.sample_counts is None), np.minimum(p_min, tail), tail)
        if self.head:  # every id outside the exact top-K is no likelier than its last one
            p_k = p[:, self.head - 1]
            cap = np.where(p_k > 0, np.minimum(p_k, tail), tail)
        low = np.where(cap > 0, tail * -np.log(np.maximum(cap, 1e-300)), 0.0)
        high = np.where(tail > 0, tail * (np.log(np.maximum(others, 1)) - np.log(np.maximum(tail, 1e-300))), 0.0)
        self.entropy_tail_low += float(low.sum())
        self.entropy_tail_high += float(np.maximum(high, low).sum())

        self._add_ranks(input_ids, seq_offsets, ids)

    def _add_ranks(self, input_ids: np.ndarray, seq_offsets: np.ndarray, topk_ids: np.ndarray) -> None:
        # Row t predicts token t + 1 of the same sequence; the last row of a sequence predicts nothing.
        has_next = np.ones(len(input_ids), dtype=bool)
        has_next[seq_offsets[1:] - 1] = False
        rows = np.flatnonzero(has_next)
        match = topk_ids[rows] == input_ids[rows + 1][:, None]
        found = match.any(axis=1)
        rank = np.where(found, match.argmax(axis=1) + 1, self.k + 1)
        highs = np.array([high for _, high in rank_buckets(self.k)] + [self.k + 1])
        self.rank_counts += np.bincount(np.searchsorted(highs, rank), minlength=len(highs))


def _hist_percentile(counts: np.ndarray, q: float) -> float:
    """The q-th percentile (numpy's default, linear) of values in [0, 1) kept as len(counts) equal bins.

    Order statistics are placed evenly inside their bin, so the result is within one bin width of
    ``np.percentile`` on the raw values.
    """
    total = int(counts.sum())
    if total == 0:
        return float("nan")
    cum = np.cumsum(counts)

    def order_stat(j: int) -> float:
        b = int(np.searchsorted(cum, j, side="right"))
        before = cum[b - 1] if b > 0 else 0
        return (b + (j - before + 0.5) / counts[b]) / len(counts)

    rank = q / 100 * (total - 1)
    low = int(math.floor(rank))
    high = min(low + 1, total - 1)
    return float(order_stat(low) + (rank - low) * (order_stat(high) - order_stat(low)))


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def cache_stats(path: str | os.PathLike, max_shards: int | None = None) -> dict:
    """Statistics of the cache at ``path`` as a JSON-ready dict (see ``render_table`` for the meaning).

    max_shards: scan only the first shards (size figures still cover the whole cache).
    """
    reader = CacheReader(path, verify_checksums=False)
    spec = reader.manifest.spec
    sampled = spec.targets.sampled
    acc = _Accumulator(k=spec.targets.k, vocab_size=spec.tokenizer.vocab_size, head=spec.targets.head)
    for index, input_ids, seq_offsets, targets in reader.iter_shards():
        if max_shards is not None and index >= max_shards:
            break
        acc.add(input_ids, seq_offsets, targets)

    k = spec.targets.k
    bytes_on_disk = sum(s.bytes for s in reader.manifest.shards)
    fp32_bytes = 8 * k + 8  # int32 id + fp32 log-prob per entry, fp32 tail and target per position
    if sampled:  # + a uint8 count per drawn slot, and an fp32 proposal log-prob when stored
        fp32_bytes += spec.targets.samples * (1 if spec.targets.proposal_is_teacher else 5)
    per_token = bytes_on_disk / spec.data.tokens
    ce = acc.ce_sum / acc.ce_rows if acc.ce_rows else float("nan")
    rows = max(acc.tokens, 1)
    labels = [_bucket_label(lo, hi) for lo, hi in rank_buckets(k)] + [f">{k}"]
    ranked = int(acc.rank_counts.sum())
    plot_counts = acc.mass_counts.reshape(_PLOT_BINS, -1).sum(axis=1)
    stats = {
        "cache": str(path),
        "cache_id": reader.manifest.cache_id,
        "teacher": spec.teacher.path,
        "storage_format": spec.storage.format,
        "value_codec": spec.targets.value_codec,
        "targets_kind": spec.targets.kind,
        "k": k,
        "temperature": spec.targets.temperature,
        "vocab_size": spec.tokenizer.vocab_size,
        "sequences": spec.data.sequences,
        "tokens": spec.data.tokens,
        "shards": len(reader.manifest.shards),
        "scanned_shards": acc.shards,
        "scanned_tokens": acc.tokens,
        "bytes_on_disk": bytes_on_disk,
        "bytes_per_token": per_token,
        "fp32_bytes_per_token": fp32_bytes,
        "compression_vs_fp32": fp32_bytes / per_token,
        "teacher_cross_entropy_nats": _finite_or_none(ce),
        "teacher_perplexity": _finite_or_none(math.exp(ce)) if math.isfinite(ce) and ce < 700 else None,
        "target_rows": acc.ce_rows,
        "topk_mass_percentiles": {f"p{q}": _finite_or_none(_hist_percentile(acc.mass_counts, q)) for q in PERCENTILES},
        "topk_mass_histogram": {"edges": np.linspace(0, 1, _PLOT_BINS + 1).round(4).tolist(),
                                "counts": plot_counts.tolist()},
        "entropy_nats": {"topk_part": acc.entropy_top / rows,
                         "lower_bound": (acc.entropy_top + acc.entropy_tail_low) / rows,
                         "upper_bound": (acc.entropy_top + acc.entropy_tail_high) / rows,
                         "note": ENTROPY_NOTE},
        "actual_token_rank": {"buckets": labels, "counts": acc.rank_counts.tolist(),
                              "fractions": (acc.rank_counts / max(ranked, 1)).tolist()},
        "tokenizer_files": _tokenizer_files(path, bool(spec.tokenizer.files)),
    }
    if sampled:
        stats["sampling"] = {"samples": spec.targets.samples, "proposal_temperature": spec.targets.proposal_temperature,
                             "seed": spec.targets.seed}
        if spec.targets.hybrid:
            stats["sampling"]["topk"] = spec.targets.topk
        stats["unique_ids_per_position"] = _unique_stats(acc.unique_counts)
    return stats


def _tokenizer_files(path: str | os.PathLike, stored: bool) -> dict:
    """Whether the cache can teach students of other tokenizers: {"stored": its tokenizer files
    are, "scheme": how its token ids map to bytes (token_bytes.SCHEMES) or None, "summary": one
    line saying so, and what to do when it cannot}."""
    if not stored:
        return {"stored": False, "scheme": None,
                "summary": f"not stored: run `distill add-tokenizer {path} TEACHER` to teach other tokenizers"}
    try:
        tokenizer = load_cache_tokenizer(path)
    except CacheError as e:
        return {"stored": True, "scheme": None, "summary": f"stored but damaged: {e}"}
    try:
        scheme = token_pieces(tokenizer).scheme
    except DistillUserError:  # neither byte-level BPE nor byte fallback (token_bytes.py)
        return {"stored": True, "scheme": None, "summary": "stored (unsupported scheme: its token ids do not say "
                                                           "their bytes, so it cannot teach other tokenizers)"}
    return {"stored": True, "scheme": scheme, "summary": f"stored ({scheme})"}


def _unique_stats(counts: np.ndarray) -> dict:
    """Mean, percentiles and histogram of the distinct drawn ids per position; counts: int [S + 1]."""
    total = max(int(counts.sum()), 1)
    values = np.arange(len(counts))
    cum = np.cumsum(counts)
    # The q-th percentile of an integer-valued sample: the smallest value with at least q% of rows at or below it.
    pct = {f"p{q}": int(values[min(np.searchsorted(cum, q / 100 * total), len(counts) - 1)]) for q in PERCENTILES}
    return {"mean": float((values * counts).sum() / total), "percentiles": pct,
            "histogram": {"unique_ids": values[1:].tolist(), "counts": counts[1:].tolist()}}


def to_json(stats: dict) -> str:
    return json.dumps(stats, indent=2)


def _fmt(x, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def render_table(stats: dict) -> str:
    """A human table of ``cache_stats`` output (plain text, no colour codes)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"teacher cache {stats['cache_id']}  ({stats['cache']})", show_header=False)
    table.add_column("statistic", style="bold")
    table.add_column("value")
    table.add_row("teacher", str(stats["teacher"]))
    sampled = stats.get("targets_kind") in ("sampled", "topk+sampled")
    hybrid = stats.get("targets_kind") == "topk+sampled"
    table.add_row("storage / codec / k / T", f"{stats['storage_format']} / {stats['value_codec']} / {stats['k']} / "
                                             f"{stats['temperature']:g}")
    if sampled:
        sampling, unique = stats["sampling"], stats["unique_ids_per_position"]
        outside = f" outside the exact top-{sampling['topk']}" if hybrid else ""
        table.add_row("sampled targets", f"{sampling['samples']} draws per position{outside} from T = "
                                         f"{sampling['proposal_temperature']:g}, seed {sampling['seed']}")
        table.add_row("unique " + ("tail " if hybrid else "") + "ids per position",
                      f"mean {unique['mean']:.2f}; p1/p10/p50/p90/p99 "
                      + " / ".join(str(unique["percentiles"][f"p{q}"]) for q in PERCENTILES))
    table.add_row("sequences / tokens / shards", f"{stats['sequences']:,} / {stats['tokens']:,} / {stats['shards']:,}")
    if stats["scanned_shards"] != stats["shards"]:
        table.add_row("scanned", f"{stats['scanned_shards']} shards, {stats['scanned_tokens']:,} tokens")
    table.add_row("bytes on disk", f"{stats['bytes_on_disk']:,} ({stats['bytes_per_token']:.1f} B/token)")
    table.add_row("vs fp32 ids+values", f"{stats['compression_vs_fp32']:.2f}x smaller than "
                                        f"{stats['fp32_bytes_per_token']} B/token")
    table.add_row("teacher cross-entropy", f"{_fmt(stats['teacher_cross_entropy_nats'])} nats "
                                           f"(perplexity {_fmt(stats['teacher_perplexity'], '.2f')})")
    pct = stats["topk_mass_percentiles"]
    part = "top-k + drawn ids" if hybrid else "drawn ids" if sampled else "top-k"
    table.add_row(f"{part} mass p1/p10/p50/p90/p99", " / ".join(_fmt(pct[f"p{q}"]) for q in PERCENTILES))
    ent = stats["entropy_nats"]
    table.add_row("entropy (nats)", f"{part} part {ent['topk_part']:.3f}; with tail in "
                                    f"[{ent['lower_bound']:.3f}, {ent['upper_bound']:.3f}]")
    ranks = stats["actual_token_rank"]
    table.add_row("actual token's rank" + (" by count" if sampled else ""),
                  "  ".join(f"{b}: {f:.1%}" for b, f in zip(ranks["buckets"], ranks["fractions"])))
    table.add_row("tokenizer files", stats["tokenizer_files"]["summary"])
    console = Console(file=io.StringIO(), width=110, color_system=None, force_terminal=False)
    console.print(table)
    return console.file.getvalue()


def _matplotlib(command: str):
    """matplotlib's (Figure, FigureCanvasBase), or a PlotDependencyError naming `command`'s --plot
    and the extra to install."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
        from matplotlib.figure import Figure  # a bare Figure draws with Agg: no pyplot, no global backend
    except ImportError as e:
        raise PlotDependencyError(f"{command} --plot needs matplotlib: pip install distill[plot]") from e
    return Figure, FigureCanvasBase


def new_figure(command: str, **kwargs):
    """A matplotlib Figure for `command`'s --plot (PlotDependencyError without matplotlib)."""
    return _matplotlib(command)[0](**kwargs)


def plot_file(path: str | os.PathLike, command: str) -> Path:
    """The file `command`'s --plot writes: `path`, with ".png" when it has no suffix. A missing
    matplotlib, a format it does not write, or a folder that is not there is a DistillUserError
    naming --plot: call it before the work the plot shows."""
    formats = _matplotlib(command)[1].get_supported_filetypes()
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if path.suffix[1:].lower() not in formats:
        raise DistillUserError(f"--plot {path}: {path.suffix!r} is not an image format matplotlib writes; end the "
                               f"name in one of {', '.join('.' + f for f in sorted(formats))}")
    if not path.parent.is_dir():
        problem = ("is a file, not a folder; give a path in a folder" if path.parent.exists() else
                   "does not exist; create it first, or give a path in a folder that exists")
        raise DistillUserError(f"--plot {path}: {path.parent} {problem}")
    return path


def save_figure(fig, path: Path, dpi: int) -> Path:
    """Write `fig` to `path` (from `plot_file`) whole: rendered in memory, then written under a temp
    name and renamed, so a failed write leaves no partial image. A place that cannot be written
    (permissions, a read-only filesystem, a full disk, a folder of that name) is a
    DistillUserError naming --plot."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix[1:].lower(), dpi=dpi)
    try:
        atomic_write_bytes(path, buffer.getvalue())
    except OSError as e:
        raise DistillUserError(f"--plot {path}: cannot write it ({e.strerror or e}); give a path in a folder you can "
                               "write to") from None
    return path


def plot(stats: dict, path: str | os.PathLike) -> Path:
    """Write the actual-token rank histogram and the top-k mass distribution as an image; returns
    the file written. The suffix picks the format (.png, .pdf, .svg, ...); a path without one gets
    ".png". A missing matplotlib, an unsupported suffix or a place that cannot be written is a
    DistillUserError."""
    path = plot_file(path, "cache-stats")
    fig = new_figure("cache-stats", figsize=(10, 4), layout="constrained")
    ax_rank, ax_mass = fig.subplots(1, 2)
    ranks = stats["actual_token_rank"]
    ax_rank.bar(ranks["buckets"], ranks["fractions"], color="tab:blue")
    ax_rank.set(title="rank of the actual next token", xlabel="rank in the teacher's top-k", ylabel="fraction")
    hist = stats["topk_mass_histogram"]
    edges = hist["edges"]
    ax_mass.bar(edges[:-1], hist["counts"], width=np.diff(edges), align="edge", color="tab:green")
    ax_mass.set(title=f"probability mass in the top-{stats['k']}", xlabel="mass", ylabel="positions")
    fig.suptitle(f"cache {stats['cache_id']}: {stats['tokens']:,} tokens, "
                 f"CE {_fmt(stats['teacher_cross_entropy_nats'])} nats")
    return save_figure(fig, path, dpi=110)
