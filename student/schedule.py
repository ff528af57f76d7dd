"""The learning-rate schedule of stage two: linear warmup, then cosine decay to a floor.

Torch-free on purpose: the CLI imports the config for its option defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distill.configs import check_types, option, require

# Warmup when none is given, as a share of the run: it scales with a short run instead of
# swallowing it (a fixed 100 warmup steps spent half of a 200-step run there), and at the default
# 1000 steps it gives the 50 steps the trainer used before.
DEFAULT_WARMUP_FRACTION = 0.05


@dataclass
class ScheduleConfig:
    """How many optimizer steps, and the learning rate's multiplier at each."""

    steps: int = option(1000, "Optimizer steps; rerun a finished run with more to extend it.")
    # None: DEFAULT_WARMUP_FRACTION of `steps`
    warmup_steps: int | None = option(None, "Linear warmup steps (default: 5% of --steps, at least 1).")
    min_lr_ratio: float = option(0.1, "The cosine decay ends at lr x this.")

    def __post_init__(self):
        check_types(self)
        require("steps", self.steps, self.steps >= 1, "an integer >= 1")
        require("warmup_steps", self.warmup_steps, self.warmup_steps is None or self.warmup_steps >= 0,
                "an integer >= 0, or leave it out")
        require("min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]")

    @property
    def warmup(self) -> int:
        """The warmup steps this schedule uses (`warmup_steps`, or its default share of `steps`)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, round(DEFAULT_WARMUP_FRACTION * self.steps))


def lr_factor(step: int, config: ScheduleConfig) -> float:
    """Multiplier of `lr` at 0-based optimizer step `step`: linear warmup, then cosine to min_lr_ratio."""
    warmup = config.warmup
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine
