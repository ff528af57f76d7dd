"""The parts the results page (`RESULTS.md`) is declared with: sections, tables, columns and goals,
which rows a glob selects, and how a row's figures read as cells. `results_sections.py` declares the
page with them; `render_results.py` renders it."""

from __future__ import annotations

import fnmatch
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = HERE / "results.jsonl"
# The GPU the page's tables are drawn from; rows of other GPUs (side-by-side checks run where an
# H200 was not lent) stay in results.jsonl and are cited by id, never mixed into a table. A bench
# measured on another card only so far is drawn from that card (its section says which).
PAGE_GPU = "NVIDIA H200"
GPU_OF_BENCH = {"cross_tokenizer_gpu": "NVIDIA H100 80GB HBM3", "cross_tokenizer": "NVIDIA H100 80GB HBM3",
                "mixture_gpu": "NVIDIA H100 80GB HBM3", "generate_gpu": "NVIDIA H100 80GB HBM3",
                "sparse_pages_quality": "NVIDIA H100 80GB HBM3"}
PAGE = HERE / "RESULTS.md"
MAX_LINES = 250
WIDTH = 120


@dataclass
class Line:
    """One line of a table: its key and the rows that share it, by member key (e.g. the variant)."""

    key: str
    members: dict[str, dict]

    def row(self, member: str | None = None) -> dict | None:
        return next(iter(self.members.values())) if member is None else self.members.get(member)

    def fig(self, key: str, member: str | None = None):
        row = self.row(member)
        return None if row is None else row["figures"].get(key)


@dataclass(frozen=True)
class Col:
    header: str
    cell: Callable[[Line], str]


def by_row(row: dict) -> tuple[str, str]:
    """Every row a line of its own, keyed `case@commit`."""
    return row["id"].split("/", 1)[1], ""


@dataclass(frozen=True)
class Table:
    ids: tuple[str, ...]  # id globs; of each glob's matches, the newest row of each case
    cols: tuple[Col, ...]
    line: Callable[[dict], tuple[str, str]] = by_row  # row -> (line key, member key)
    caption: str = ""  # a line above the table


@dataclass(frozen=True)
class Check:
    label: str
    value: Callable[[Rows], float]
    op: str  # ">=" or "<="
    target: float
    fmt: str = "{:.3g}x"


@dataclass(frozen=True)
class Goal:
    text: str
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Section:
    title: str  # cited as: RESULTS.md, "<title>"
    notes: str  # the file(s) under notes/ that tell the story, comma-separated
    prose: str
    tables: tuple[Table, ...] = ()
    goals: tuple[Goal, ...] = ()
    level: int = 2


# ---- selecting rows ----------------------------------------------------------------------------

def load(path: Path = ROWS) -> list[dict]:
    """The rows the page may draw: CPU rows and rows of PAGE_GPU (or of GPU_OF_BENCH's card)."""
    rows = [json.loads(text) for text in path.read_text().splitlines() if text.strip()]
    return [row for row in rows
            if not row["device"].startswith("NVIDIA") or row["device"] == GPU_OF_BENCH.get(row["bench"], PAGE_GPU)]


def newest(rows: list[dict]) -> list[dict]:
    """The last row (the newest) of each case, in the order the cases first appear."""
    latest: dict[tuple[str, str], dict] = {}
    for row in rows:
        latest.setdefault((row["bench"], row["case"]), row)
        latest[(row["bench"], row["case"])] = row
    return list(latest.values())


def select(rows: list[dict], patterns: tuple[str, ...]) -> list[dict]:
    """For each glob in turn, the newest row of each case it matches (each row once)."""
    found: dict[str, dict] = {}
    for pattern in patterns:
        for row in newest([row for row in rows if fnmatch.fnmatchcase(row["id"], pattern)]):
            found.setdefault(row["id"], row)
    return list(found.values())


class Rows:
    """The rows a goal is checked against, looked up by id glob."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def all(self, pattern: str) -> list[dict]:
        return [row["figures"] for row in select(self.rows, (pattern,))]

    def one(self, pattern: str) -> dict:
        found = self.all(pattern)
        if len(found) != 1:
            raise ValueError(f"a goal's glob {pattern!r} must match one case, got {len(found)}")
        return found[0]


# ---- lines: which rows share a table line ------------------------------------------------------

def by_variant(row: dict) -> tuple[str, str]:
    """`<setting>/<variant>`: one line a setting, its variants side by side."""
    key, _, member = row["case"].rpartition("/")
    return key, member


def by_seed(row: dict) -> tuple[str, str]:
    """`<targets>-seedN`: one line a kind of cache, its training seeds gathered."""
    key, _, seed = row["case"].partition("-seed")
    return key, seed or "0"


def by_arm(row: dict) -> tuple[str, str]:
    """`seed<N>/<arm>`: one line an arm (a student), its seeds gathered."""
    seed, _, arm = row["case"].partition("/")
    return arm, seed


def by_length(row: dict) -> tuple[str, str]:
    """`<shape>-T<length>/<variant>`: one line a shape and variant, its lengths side by side."""
    shape_length, variant_name = row["case"].split("/")
    shape_name, length = shape_length.rsplit("-T", 1)
    return f"{shape_name}/{variant_name}", length


def by_bench(row: dict) -> tuple[str, str]:
    """The same case in two benches (CPU and GPU) side by side."""
    return row["case"], row["bench"]


def by_last_part(row: dict) -> tuple[str, str]:
    """`<shape or dtype>/<name>`: one line a name, its shapes or dtypes side by side."""
    member, _, key = row["case"].partition("/")
    return key, member


def by_sparsity(row: dict) -> tuple[str, str]:
    """twell_ffn's `s<sparsity>/<kernel>/<pass>`: one line a sparsity, dense and TwELL side by side."""
    if row["bench"] != "twell_ffn":
        return by_row(row)
    sparsity, _, member = row["case"].partition("/")
    return sparsity, member


# ---- cells -------------------------------------------------------------------------------------

NAMES = {  # how a case's parts read on the page
    "smollm2-135m": "SmolLM2-135M", "qwen2-0.5b": "0.5B", "qwen2-1.5b": "1.5B", "qwen2.5-3b": "3B",
    "qwen2.5-7b": "7B", "qwen2.5-14b": "14B", "llama-3.1-8b": "8B", "ours_offload": "ours offload", "ours_sparse": "ours sparse",
    "hf_liger": "transformers + Liger", "hf": "transformers", "none": "none (no offload)",
    "zero_offload": "ZeRO-Offload policy", "train": "`student.trainer.train` end to end",
    "plain": "plain transformers pass", "default": "ours, default settings", "rs12": "ours, sampled S = 12",
    "vllm-reserved0": "vllm, no reserved core", "torch-adamw-fused": "torch AdamW, fused",
    "torch-adamw-foreach": "torch AdamW, foreach", "foam-l2-triton": "FOAM level 2, Triton step",
    "foam-l4-triton": "FOAM level 4, Triton step", "adamw8bit-triton": "AdamW 8-bit, Triton step",
    "adamw8bit-torch": "AdamW 8-bit, CPU path", "adamw": "AdamW",
    "foam": "FOAM", "foam-l2": "FOAM level 2, emb in Adam", "foam-l2-fold-emb": "FOAM level 2, emb folded",
    "foam-l4": "FOAM level 4, emb in Adam", "foam-l4-fold-emb": "FOAM level 4, emb folded",
    "adamw8bit": "AdamW 8-bit", "adamw_lr4e-3": "AdamW (lr 4e-3)", "foam_2": "FOAM level 2", "foam_4": "FOAM level 4",
    "foam_2_lr4e-3": "FOAM level 2 (lr 4e-3)", "foam_4_lr4e-3": "FOAM level 4 (lr 4e-3)", "dense": "dense",
    "l1-1e-3": "L1 1e-3", "l1-5e-4": "L1 5e-4", "trainer-dense": "L1 5e-4, `--sparse-kernel dense`",
    "trainer-twell": "L1 5e-4, `--sparse-kernel twell`", "sparse_l1_0": "ReLU gate, L1 0",
    "sparse_l1_1e-3": "ReLU gate, L1 1e-3", "kd": "KD from the cache (ce_weight 0)",
    "ce": "cross-entropy only (ce_weight 1)", "cpu": "the quickstart, whole command",
    "sparse_4": "sparse, 4 past pages", "topk8": "top-8", "topk32": "top-32", "topk100": "top-100",
    "sampled4": "sampled, S = 4", "sampled12": "sampled, S = 12", "sampled32": "sampled, S = 32",
    "hybrid8+12": "top-8 + S = 12 outside it",
}
SHAPES = ("smollm2-135m", "qwen2-0.5b", "qwen2-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "llama-3.1-8b")


def name(text: str) -> str:
    return NAMES.get(text, text)


def shape(key: str) -> str:
    return next((name(s) for s in SHAPES if s in key), "")


def kilo(tokens: int) -> str:
    return f"{tokens >> 20}M" if tokens % 2**20 == 0 else f"{tokens >> 10}K"


def length(key: str) -> str:
    """`-T131072` in a case: 128K."""
    return kilo(int(key.split("-T")[1].split("/")[0].split("-")[0])) if "-T" in key else ""


def variant(key: str) -> str:
    return name(key.rsplit("/", 1)[-1])


def budget(key: str) -> str:
    """`-gpu40GiB` in a case; a plan without one had the device's memory."""
    return key.split("-gpu")[1].split("-")[0].split("/")[0] if "-gpu" in key else "the device's"


def num(value, fmt: str = "{:,.1f}", scale: float = 1.0) -> str:
    return "" if value is None else fmt.format(value * scale)


def label(header: str, text: Callable[[str], str]) -> Col:
    """Text made from the line's key (a case, or the part of it a line gathers), less its commit."""
    return Col(header, lambda line: text(line.key.split("@")[0]))


def fig(header: str, key: str, fmt: str = "{:,.1f}", of: str | None = None, scale: float = 1.0) -> Col:
    """A figure of the line's row (or of its member `of`), formatted."""
    return Col(header, lambda line: num(line.fig(key, of), fmt, scale))


def with_ratio(header: str, key: str, ratio_key: str, fmt: str, rfmt: str = "{:.3f}",
               of: str | None = None, scale: float = 1.0) -> Col:
    """`value (ratio)`, two figures of one row: e.g. a time and its multiple of the baseline's."""
    def cell(line: Line) -> str:
        value, ratio = num(line.fig(key, of), fmt, scale), line.fig(ratio_key, of)
        return f"{value} ({rfmt.format(ratio)})" if value and ratio is not None else value
    return Col(header, cell)


def joined(header: str, key: str, members: tuple[str, ...], fmt: str) -> Col:
    """One figure of several members, `a / b / c` (`-` where one has none; empty if all have none)."""
    def cell(line: Line) -> str:
        values = [num(line.fig(key, m), fmt) for m in members]
        return " / ".join(v or "-" for v in values) if any(values) else ""
    return Col(header, cell)


def rate(header: str, key: str = "model_tflops", share: str = "of_matmul_ceiling", of: str | None = None) -> Col:
    """A rate with its share of the ceiling, `315 (43%)`. The offload bench's share is of its
    rate without attention, so a rate with attention is set against the same ceiling."""
    def cell(line: Line) -> str:
        value, fraction = line.fig(key, of), line.fig(share, of)
        if key == "model_tflops_with_attention" and fraction is not None:
            fraction *= value / line.fig("model_tflops", of)
        return f"{value:.0f} ({fraction:.0%})" if fraction is not None else num(value, "{:.0f}")
    return Col(header, cell)


def attention_rate(header: str = "TFLOP/s (of ceiling)") -> Col:
    """The model rate counting attention: long_context rows' model_tflops, offload rows'
    model_tflops_with_attention (their model_tflops leaves attention out: empty where a row has only
    that). Empty for sparse pages, whose count would include the attention they skip."""
    counted, offload = rate(header), rate(header, "model_tflops_with_attention")

    def cell(line: Line) -> str:
        if "sparse" in line.key:
            return ""
        if line.fig("model_tflops_with_attention") is not None:
            return offload.cell(line)
        return counted.cell(line) if line.row()["id"].startswith("long_context/") else ""
    return Col(header, cell)


def gpu_gib(header: str = "peak GPU GiB") -> Col:
    """The GPU peak in GiB from either bench's figure (long_context: GiB; offload: bytes)."""
    def cell(line: Line) -> str:
        gib, nbytes = line.fig("peak_gib"), line.fig("peak_gpu_bytes")
        return num(gib if gib is not None else nbytes and nbytes / 2**30, "{:.1f}")
    return Col(header, cell)


def oom_or(col: Col, member: str | None = None) -> Col:
    """The column's cell, or "out of memory" where the row ran out of it."""
    def cell(line: Line) -> str:
        figures = (line.row(member) or {"figures": {}})["figures"]
        return "out of memory" if figures.get("out_of_memory") or figures.get("status") == "oom" else col.cell(line)
    return Col(col.header, cell)


def mean_sd(header: str, key: str, fmt: str = "{:.3f}") -> Col:
    """Mean ± standard deviation over a line's members (seeds) that have the figure, or the one value."""
    def cell(line: Line) -> str:
        values = [row["figures"][key] for row in line.members.values() if key in row["figures"]]
        if not values:
            return ""
        if len(values) == 1:
            return fmt.format(values[0])
        return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"
    return Col(header, cell)


def first_of(header: str, keys: tuple[str, ...], fmt: str) -> Col:
    """The first of several figures a row has (benches name the same quantity differently)."""
    return Col(header, lambda line: num(next((v for k in keys if (v := line.fig(k)) is not None), None), fmt))


ROW_IDS = Col("rows", lambda line: ", ".join(f"`{row['id']}`" for row in line.members.values()))


# ---- goals -------------------------------------------------------------------------------------

def over(a: str, b: str, key: str = "tok_s") -> Callable[[Rows], float]:
    """Row a's figure over row b's: by default a's speed as a multiple of b's."""
    return lambda rows: rows.one(a)[key] / rows.one(b)[key]


def mean_over(pattern: str, key: str) -> Callable[[Rows], float]:
    """The mean of a figure over every case the glob matches (a variant's training seeds)."""
    return lambda rows: statistics.mean(row[key] for row in rows.all(pattern))


def figure(pattern: str, key: str) -> Callable[[Rows], float]:
    return lambda rows: rows.one(pattern)[key]


def seeds_gap(key: str, a: str, b: str) -> Callable[[Rows], float]:
    """Mean over a's training seeds less the mean over b's (sampled targets)."""
    def mean(rows: Rows, targets: str) -> float:
        return statistics.mean(row[key] for row in rows.all(f"sampled_targets/{targets}*@26a51ff"))
    return lambda rows: mean(rows, a) - mean(rows, b)


PAIR_05B = "offload/qwen2-0.5b-T131072-gpu7.25GiB-chunks32768-kvoffload{}@2b96d6c"
PAIR_3B = "offload/qwen2.5-3b-T262144-gpu24GiB-chunks16384-kvoffload/{}@3c9e09c"
FOAM_14B, ADAMW_14B = "offload/qwen2.5-14b-T8192/planned@e13b83b", "offload/qwen2.5-14b-T8192/planned@a6a3681"
PLANNED = ("offload/llama-3.1-8b-T8192-gpu40GiB-capped/planned@*", "offload/llama-3.1-8b-T8192/planned@*",
           FOAM_14B, ADAMW_14B, "offload/qwen2.5-3b-L1-T1048576-*/planned@*",
           PAIR_05B.format("-capped/planned"), PAIR_3B.format("planned"))


def spread(key: str, pick: Callable[[list[float]], float]) -> Callable[[Rows], float]:
    """The least or greatest of a figure over every planned row on the page."""
    return lambda rows: pick([row[key] for pattern in PLANNED for row in rows.all(pattern)])


def within(label_text: str, key: str, low: float, high: float) -> tuple[Check, Check]:
    return (Check(f"{label_text} least", spread(key, min), ">=", low, "{:.3f}"),
            Check("greatest", spread(key, max), "<=", high, "{:.3f}"))
