"""An offload plan: what of a student's training step lives where (LazyTrain, arXiv 2608.11919).

The contract between the planner (student/planner.py: profiles a step, solves a mixed-integer
program for the fastest schedule under GPU and host memory budgets) and the runtime
(student/offload.py: carries the schedule out). A plan is a JSON file a person can read and edit;
`distill plan` writes one, `distill train-student --offload PLAN.json` uses it. A leaf: it imports
nothing of torch.

Per decoder layer i (its input is activation boundary i; the embeddings and the head are always
resident):
  activation  "keep":      the layer's forward keeps its activations for the backward (no recompute);
              "recompute": only the layer's input is kept, on the GPU; the backward runs the layer
                           again from it (activation checkpointing);
              "offload":   the layer's input goes to pinned host memory after the forward and comes
                           back before the backward, which runs the layer again from it.
  params      "resident":  the layer's bf16 working weights stay on the GPU for the whole step;
              "stream":    they come to the GPU before the layer's forward and again before its
                           backward, `prefetch_depth` layers ahead, and are freed after use.
A "keep" layer's weights stay on the GPU from its forward to its backward, whatever `params` says.
The fp32 master weights, gradients and optimizer states live in pinned host memory; `optimizer`
says whether the update runs on the GPU (states streamed through in slices) or on the CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from distill.configs import ConfigError, check_types
from distill.files import atomic_write_json

__all__ = ["PLAN_VERSION", "LayerPlan", "OffloadPlan", "Predicted"]

PLAN_VERSION = 1


@dataclass(frozen=True)
class LayerPlan:
    activation: Literal["keep", "recompute", "offload"] = "recompute"
    params: Literal["resident", "stream"] = "resident"

    def __post_init__(self):
        check_types(self)


@dataclass(frozen=True)
class Predicted:
    """What the planner's cost model predicts for one optimizer step under the plan."""

    step_s: float = 0.0
    gpu_peak_bytes: int = 0
    host_peak_bytes: int = 0
    layer_s: tuple[float, ...] = ()  # per layer: forward + backward + recompute + exposed transfers


@dataclass(frozen=True)
class OffloadPlan:
    layers: tuple[LayerPlan, ...]
    prefetch_depth: int = 1
    optimizer: Literal["gpu", "cpu"] = "cpu"
    # Long-context engine (student/long_context.py), when it is on: the chunk size and how many
    # key/value pages stay resident on the GPU (the rest are offloaded). None: not planned.
    chunk_tokens: int | None = None
    resident_pages: int | None = None
    gpu_memory: int | None = None  # the budgets the plan was solved for, bytes
    host_memory: int | None = None
    predicted: Predicted = field(default_factory=Predicted)
    version: int = PLAN_VERSION

    def __post_init__(self):
        check_types(self)
        if self.prefetch_depth < 0:
            raise ConfigError("prefetch_depth", f"is {self.prefetch_depth}; use an integer >= 0")
        if self.version != PLAN_VERSION:
            raise ConfigError("version", f"is {self.version}; this distill reads offload plans of version "
                                         f"{PLAN_VERSION}: make the plan again with `distill plan`")

    @classmethod
    def uniform(cls, num_layers: int, activation: str = "recompute", params: str = "resident", **rest) -> OffloadPlan:
        """The same decisions for every layer (a fixed policy, e.g. everything offloaded)."""
        return cls(layers=tuple(LayerPlan(activation, params) for _ in range(num_layers)), **rest)

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
        if "predicted" in d:
            p = dict(d["predicted"])
            p["layer_s"] = tuple(p.get("layer_s", ()))
            d["predicted"] = Predicted(**p)
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
