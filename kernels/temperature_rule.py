"""Which distillation temperatures cached targets can train at: one rule in one wording, for the
kernel's argument check (kernels/fused_topk_kl.py) and the run's config (student/loss_config.py).
Torch-free (the CLI's config imports it).

The cached log-probabilities are at the cache's temperature. The "renorm" tail tempers the cached
top-k exactly to any temperature; "bucket" and "unnormalized" also use the cached tail mass, one
number for many tokens, which cannot be re-tempered; sampled targets estimate the teacher only at
the temperature their ids were drawn at.
"""

from __future__ import annotations

import math

__all__ = ["temperature_problem"]


def temperature_problem(tail: str, temperature: float, cache_temperature: float, kind: str = "topk") -> str | None:
    """What is wrong with distilling at `temperature` from targets of `kind` ("topk" | "sampled" |
    "topk+sampled") cached at `cache_temperature` with `tail`, worded to follow the name
    "temperature"; None when they compose."""
    if math.isclose(temperature, cache_temperature, rel_tol=1e-6):
        return None
    if kind != "topk":
        return (f"is {temperature:g} but the cache holds ids sampled from the teacher at temperature "
                f"{cache_temperature:g}, and sampled targets estimate the teacher only at the temperature they were "
                f"drawn at; distill at the cache's temperature, or sample a cache at temperature {temperature:g} "
                f"(distill cache-teacher --targets {kind} --temperature {temperature:g})")
    if tail == "renorm":
        return None
    return (f"is {temperature:g} but the cache holds the teacher at temperature {cache_temperature:g}, and the "
            f"{tail!r} tail cannot re-temper the cached tail mass; cache the teacher at temperature {temperature:g} "
            f"(distill cache-teacher --temperature {temperature:g}), or use the 'renorm' tail (--tail renorm), which "
            "composes exactly")
