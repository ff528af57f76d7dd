"""The sparse FFN's config (the `sparse` part of TrainConfig): torch-free, for the CLI's option
defaults. student/sparse_ffn.py builds the training policy from it and holds the constants its
comments name (TWELL_MAX_NNZ, DEAD_REINIT_STD)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from distill.configs import ConfigError, check_types, option, require


@dataclass
class SparseFFNConfig:
    """The sparse FFN: a ReLU gate made sparse by an L1 penalty on its activations, and how it runs."""

    # A SwiGLU student gets the ReLU gate (same weights), and the loss adds l1 * the mean over layers
    # of (sum over d_ff of |h|, mean over tokens), the authors' code normalisation.
    sparse_ffn: bool = option(False, (
        "Sparse FFN (TwELL): ReLU gate (a SwiGLU student is converted, same weights) and an L1 penalty on its "
        "activations; logs per-layer sparsity and dead neurons."))
    # the L1 coefficient (used only with sparse_ffn); the paper's conservative value
    l1: float = option(2e-5, (
        "L1 coefficient with --sparse-ffn: loss += l1 * mean over layers of (sum over d_ff of |h|, mean over "
        "tokens)."))
    # How a ReLU-gated FFN computes: "dense" (three matmuls) or "twell": at each logging step, layers
    # whose mean non-zeros per token fell under TWELL_MAX_NNZ switch to kernels/twell_ffn.py's sparse
    # Triton kernels on a GPU (less activation memory), the others stay dense; metrics rows record each
    # layer's choice as ffn_kernel. Dense is the default: the kernels pay only on large calls
    # (batch_size x seq_len tokens), not at the trainer's usual sizes (RESULTS.md, "Sparse FFN", through
    # the trainer).
    sparse_kernel: Literal["dense", "twell"] = option("dense", (
        "With --sparse-ffn on a GPU: dense (matmuls) or twell (a layer switches to the sparse Triton kernels "
        "once under 50 non-zeros per token; they pay only on large calls, so raise --batch-size; see "
        "RESULTS.md)."))
    # Dead-neuron mitigation (App. C.3): the paper calls a neuron dead when it fires on no token of a
    # ~1M-token step, and after each such step moves its gate row to (1 - r) w + r N(0, 0.02^2),
    # r = 0.1. Here the judgement covers windows of whole steps holding at least dead_window real
    # tokens: after the step that closes a window, the neurons silent over all of it move. Judged over
    # single small steps it moves many neurons silent only by chance (notes/sparse-ffn.md, "Sparse FFN
    # dead-neuron mitigation judged over windows"). 0 turns it off.
    dead_reinit: float = option(0.0, (
        "With --sparse-ffn: gate rows of neurons silent on every token of a --dead-window move to (1-r) w + r "
        "N(0, 0.02^2) when it closes (the paper's App. C.3 uses 0.1); 0 = off."))
    # tokens (whole steps) a neuron must stay silent to count as dead
    dead_window: int = option(1_000_000, (
        "With --dead-reinit: tokens (whole steps) a neuron must stay silent to count as dead; the paper's "
        "steps are ~1M tokens."))

    def __post_init__(self):
        check_types(self)
        require("l1", self.l1, math.isfinite(self.l1) and self.l1 >= 0, "a finite number >= 0")
        require("dead_reinit", self.dead_reinit, 0 <= self.dead_reinit <= 1, "a number in [0, 1]")
        require("dead_window", self.dead_window, self.dead_window >= 1, "an integer >= 1 (tokens)")
        if self.dead_reinit and not self.sparse_ffn:
            raise ConfigError("dead_reinit", "acts on the sparse FFN's gate: turn on sparse_ffn (--sparse-ffn) "
                                             "or set it to 0")
