"""An offload plan: what of a student's training step lives where (LazyTrain, arXiv 2608.11919).

The contract between the planner (student/planner/solve.py: profiles a step, solves a mixed-integer
program for the fastest schedule under GPU and host memory budgets) and the runtime
(student/offload/runtime.py: carries the schedule out). A plan is a JSON file a person can read and edit;
`distill plan` writes one, `distill train-student --offload PLAN.json` uses it. A leaf: it imports
nothing of torch.

Per decoder layer i (its input is activation boundary i; the head is always resident, the input
embedding where `embedding` says):
  activation  "keep":      the layer's forward keeps its activations for the backward (no recompute);
              "recompute": only the layer's input is kept, on the GPU; the backward runs the layer
                           again from it (activation checkpointing);
              "offload":   the layer's input goes to pinned host memory after the forward and comes
                           back before the backward, which runs the layer again from it.
  params      "resident":  the layer's bf16 working weights stay on the GPU for the whole step;
              "stream":    they come to the GPU before the layer's forward and again before its
                           backward, `prefetch_depth` layers ahead, and are freed after use.
  states      "host":      the layer's fp32 master weights, gradient accumulator and optimizer states
                           live in pinned host memory; `optimizer` says whether their update runs on
                           the GPU (streamed through in slices) or on the CPU;
              "gpu":       they live on the GPU and the layer updates there (with the embeddings and
                           the head); its working weights are then resident (params "resident").
A "keep" layer's weights stay on the GPU from its forward to its backward, whatever `params` says.
The untied input embedding (`embedding`):
  "gpu":  on the GPU with the head: master, gradient and optimizer states;
  "host": its master, gradient and states in pinned host memory; the forward gathers its rows on the
          host, the backward sums their gradient there, and the matrix comes to the GPU only for the
          update (student/offload/embedding.py).

Version 2 added `states` and the predicted phases; a version-1 plan reads as every layer "host".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from distill.configs import ConfigError, check_types
from distill.files import atomic_write_json

__all__ = ["PLAN_VERSION", "UPDATE_SLOTS", "READABLE_VERSIONS", "ChunkChoice", "LayerPlan", "OffloadPlan",
           "Predicted"]

PLAN_VERSION = 2
# Host layers updated on the GPU pass through a ring of this many device slots (master, gradient,
# states, staging casts of one layer each): one updating while the next one's copies come in and
# the last one's go out; the first of them load during the backward. The runtime and the planner's
# cost model and peak both use it.
UPDATE_SLOTS = 2
READABLE_VERSIONS = (1, 2)  # a version-1 plan has no `states`: every layer's are on the host


@dataclass(frozen=True)
class LayerPlan:
    activation: Literal["keep", "recompute", "offload"] = "recompute"
    params: Literal["resident", "stream"] = "resident"
    states: Literal["host", "gpu"] = "host"

    def __post_init__(self):
        check_types(self)
        if self.states == "gpu" and self.params != "resident":
            raise ConfigError("params", f"is {self.params!r} for a layer whose states are on the GPU: its working "
                                        "weights are resident there; make the plan again with `distill plan`")


@dataclass(frozen=True)
class Predicted:
    """What the planner's cost model predicts for one optimizer step under the plan."""

    step_s: float = 0.0
    gpu_peak_bytes: int = 0
    host_peak_bytes: int = 0
    layer_s: tuple[float, ...] = ()  # per layer: forward + backward + recompute + exposed transfers
    # The step in phases, seconds, summing to step_s; the runtime measures the same names
    # (OffloadRuntime.phase_s): student/planner/solve.py's PHASES says what each holds.
    phase_s: dict[str, float] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ChunkChoice:
    """One chunk size and key/value residency the planner considered (`OffloadPlan.chunk_choices`)."""

    chunk_tokens: int | None  # None: whole sequences (a table without chunks: the embedding's homes alone)
    kv_offload: bool  # the pages in pinned host memory, a page set of offload_pages at a time on the GPU
    offload_pages: int | None  # None: the micro-batch is one chunk (no pages were measured)
    resident_pages: int | None  # key/value pages (of every row) on the GPU at once, over all layers
    keep_attention_chunks: int | None = None  # as OffloadPlan's
    embedding: str = "gpu"  # as OffloadPlan's
    # The best plan's predictions under the budgets; None where no plan fits them.
    step_s: float | None = None
    gpu_peak_bytes: int | None = None
    host_peak_bytes: int | None = None

    def __post_init__(self):
        check_types(self)


@dataclass(frozen=True)
class OffloadPlan:
    layers: tuple[LayerPlan, ...]
    prefetch_depth: int = 1
    optimizer: Literal["gpu", "cpu"] = "cpu"
    # Long-context engine (student/long_context/), when it is on: the chunk size the plan was
    # made for and how many key/value pages (of every row) the GPU holds at once over all layers:
    # every page without kv_offload, three page sets of offload_pages with it (the rest in host
    # memory). None: whole sequences. A run with another chunk size is refused, unless the planner
    # chose these settings (chunk_choices) and the run's chunk size was among its candidates (or
    # the run gives none): the run then trains with the plan's chunk size, kv_offload and offload_pages.
    chunk_tokens: int | None = None
    resident_pages: int | None = None
    kv_offload: bool | None = None
    offload_pages: int | None = None
    # Chunks whose attention outputs pass 1 keeps for pass 2 (LongContextConfig.keep_attention_chunks),
    # as the plan's host peak counts them; None: every chunk's. A run without --keep-attention-chunks
    # trains with the plan's; a run with another is refused (its host memory was not planned).
    keep_attention_chunks: int | None = None
    embedding: Literal["gpu", "host"] = "gpu"  # where the untied input embedding lives (the module docstring)
    chunk_choices: tuple[ChunkChoice, ...] = ()  # what the planner chose among (--chunk-candidates), in order
    gpu_memory: int | None = None  # the budgets the plan was solved for, bytes
    host_memory: int | None = None
    predicted: Predicted = field(default_factory=Predicted)
    version: int = PLAN_VERSION

    def __post_init__(self):
        check_types(self)
        if self.prefetch_depth < 0:
            raise ConfigError("prefetch_depth", f"is {self.prefetch_depth}; use an integer >= 0")
        if self.version not in READABLE_VERSIONS:
            raise ConfigError("version", f"is {self.version}; this distill reads offload plans of versions "
                                         f"{', '.join(map(str, READABLE_VERSIONS))}: make the plan again with "
                                         "`distill plan`")

    @classmethod
    def uniform(cls, num_layers: int, activation: str = "recompute", params: str = "resident", states: str = "host",
                **rest) -> OffloadPlan:
        """The same decisions for every layer (a fixed policy, e.g. everything offloaded)."""
        return cls(layers=tuple(LayerPlan(activation, params, states) for _ in range(num_layers)), **rest)

    def run_settings(self) -> dict:
        """The flat config settings a run takes from the plan: where the planner chose among chunk
        sizes, the chunk size and where the pages live; and the attention outputs pass 1 keeps,
        as the plan's host memory counts them."""
        chosen = {}
        if self.chunk_choices:
            chosen = {"chunk_tokens": self.chunk_tokens}
            chosen.update({name: getattr(self, name) for name in ("kv_offload", "offload_pages")
                           if getattr(self, name) is not None})
        if self.keep_attention_chunks is not None:
            chosen["keep_attention_chunks"] = self.keep_attention_chunks
        return chosen

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> OffloadPlan:
        d = dict(d)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(min(unknown), "is not a field of an offload plan; make the plan again with "
                                                  "`distill plan`")
        d["layers"] = tuple(LayerPlan(**layer) for layer in d.get("layers", ()))
        d["chunk_choices"] = tuple(ChunkChoice(**choice) for choice in d.get("chunk_choices", ()))
        if "predicted" in d:
            p = dict(d["predicted"])
            p["layer_s"] = tuple(p.get("layer_s", ()))
            d["predicted"] = Predicted(**p)
        if d.get("version", PLAN_VERSION) in READABLE_VERSIONS:  # read as this version (its defaults)
            d["version"] = PLAN_VERSION
        return cls(**d)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> OffloadPlan:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("offload", f"cannot read the plan {path}: {e}; give a file `distill plan --json` "
                                         "wrote") from None
        return cls.from_dict(d)
