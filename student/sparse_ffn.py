"""The sparse FFN (TwELL) in training: the policy built on what the model measures (its config,
torch-free for the CLI, is student/sparse_ffn_config.py's SparseFFNConfig).

A ReLU-gated student's MLPs measure each forward (Student.forward(..., return_ffn_terms=True)
returns per layer an FFNTerms: the differentiable l1 and kernels.twell_ffn.FFNStats); the model
keeps nothing of it. Everything decided from those measurements lives here: the L1 penalty, the
statistics window behind the metrics rows, routing each layer to the sparse kernels by its
measured non-zeros, and the dead-neuron re-initialisation of the paper's App. C.3.

Under FSDP2 (student/distributed.py) each rank measures its part of every micro-batch: the window
sums the ranks' measurements at the end of each step (`reduce`), so every rank holds the whole
step's statistics, writes the same metrics, routes the layers alike and moves the same dead
neurons; each rank moves the gate rows of its own shard, with the noise one process would draw.
"""

from __future__ import annotations

import torch

from student.optim.shards import local, local_rows
from student.sparse_ffn_config import SparseFFNConfig

# The authors route a layer to their sparse kernels once its mean non-zeros per token fall under 50
# (`sparsity_l0_cutoff` in SakanaAI/sparser-faster-llms' configs). Our kernels break even with dense
# near there at the width they were measured at (RESULTS.md, "Sparse FFN"); each non-zero costs a
# fixed gather, so for other widths the break-even is about 1% of d_ff.
TWELL_MAX_NNZ = 50
# App. C.3 of the paper: the noise the gate rows of dead neurons are pulled toward.
DEAD_REINIT_STD = 0.02


def l1_penalty(terms: list):
    """Mean over layers of each layer's l1 (sum over d_ff of |h|, mean over tokens); differentiable.
    terms: per layer FFNTerms (l1, stats) of one forward."""
    return torch.stack([l1 for l1, _ in terms]).mean()


class FFNWindow:
    """Per-layer statistics of a ReLU-gated student summed on its device over the micro-batches
    since the last metrics row; only `row` copies them to the host (at logging steps).
    reduce: sums a float64 tensor over the ranks in place (student.distributed.sum_over_ranks_)
    when each rank sees its part of the micro-batches; the window then keeps this rank's
    measurements of the step apart until `end_step` adds the ranks' sum. None: one process."""

    def __init__(self, num_layers: int, d_ff: int, device, reduce=None):
        self.reduce = reduce
        self._pending = FFNWindow(num_layers, d_ff, device) if reduce is not None else None  # this rank's step
        self.d_ff = d_ff
        self.l1_step = torch.zeros((), device=device)  # sum over this step's micro-batches of the mean-layer l1
        self.nnz_L = torch.zeros(num_layers, device=device)  # sum over calls of mean non-zeros per token
        self.active_LF = torch.zeros(num_layers, d_ff, dtype=torch.bool, device=device)
        self.overflow_L = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.fallback_L = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.reinit_L = torch.zeros(num_layers, dtype=torch.int64, device=device)  # gate rows moved (dead_reinit)
        self.calls = 0
        self.l1_last = torch.zeros((), device=device)  # mean over the last step's micro-batches
        # Neurons active since the current dead window (SparseFFNConfig.dead_window) began, and its tokens.
        self.dead_active_LF = torch.zeros(num_layers, d_ff, dtype=torch.bool, device=device)
        self.dead_tokens = 0

    def add(self, terms: list, share: float = 1.0) -> None:
        """terms: per layer FFNTerms (l1, FFNStats) of one micro-batch, or of a chunk of it holding
        `share` of its real tokens (the means then add up over the chunks)."""
        if self._pending is not None:
            self._pending.add(terms, share)
            return
        self.l1_step += torch.stack([l1.detach() for l1, _ in terms]).mean() * share
        self.nnz_L += torch.stack([s.nnz for _, s in terms]).to(self.nnz_L) * share
        active_LF = torch.stack([s.active for _, s in terms])
        self.active_LF |= active_LF
        self.dead_active_LF |= active_LF
        self.overflow_L += torch.stack([s.overflow_rows for _, s in terms])
        self.fallback_L += torch.stack([s.fallback_rows for _, s in terms])
        self.calls += share

    def end_step(self, grad_accum: int, tokens: int, dead_window: int):
        """Close the step of `tokens` real tokens. When that closes a dead window (at least
        `dead_window` tokens since it began), returns the neurons active over the window (bool
        [L, d_ff]) and starts the next; else None."""
        if self._pending is not None:
            self._add_pending_over_ranks()
        self.l1_last = self.l1_step / grad_accum
        self.l1_step = torch.zeros_like(self.l1_step)
        self.dead_tokens += tokens
        if self.dead_tokens < dead_window:
            return None
        active, self.dead_active_LF = self.dead_active_LF, torch.zeros_like(self.dead_active_LF)
        self.dead_tokens = 0
        return active

    def _add_pending_over_ranks(self) -> None:
        """Add the step's measurements summed over the ranks (one all-reduce) and clear this rank's."""
        mine, (num_layers, d_ff) = self._pending, self.active_LF.shape
        calls = torch.tensor([float(mine.calls)], device=mine.nnz_L.device)
        parts = (mine.l1_step.view(1), mine.nnz_L, mine.overflow_L, mine.fallback_L, mine.active_LF.flatten(), calls)
        packed = torch.cat([t.to(torch.float64) for t in parts])  # active: how many ranks saw the neuron fire
        self.reduce(packed)
        l1, nnz, overflow, fallback, active, calls = packed.split([1, num_layers, num_layers, num_layers,
                                                                  num_layers * d_ff, 1])
        self.l1_step += l1[0].to(self.l1_step.dtype)
        self.nnz_L += nnz.to(self.nnz_L.dtype)
        self.overflow_L += overflow.round().to(torch.int64)
        self.fallback_L += fallback.round().to(torch.int64)
        active_LF = active.view(num_layers, d_ff) > 0
        self.active_LF |= active_LF
        self.dead_active_LF |= active_LF
        self.calls += float(calls.item())
        self._pending = FFNWindow(num_layers, d_ff, self.nnz_L.device)

    def row(self) -> dict:
        """The metrics of the window (one host sync), then start a new one."""
        nnz = (self.nnz_L / max(self.calls, 1)).tolist()
        out = {"l1": self.l1_last.item(), "ffn_nnz": nnz, "ffn_sparsity": [1 - n / self.d_ff for n in nnz],
               "ffn_dead": (1 - self.active_LF.float().mean(1)).tolist(),
               "ffn_overflow_rows": self.overflow_L.tolist(), "ffn_fallback_rows": self.fallback_L.tolist(),
               "ffn_reinit": self.reinit_L.tolist()}
        self.nnz_L.zero_(), self.active_LF.zero_(), self.overflow_L.zero_(), self.fallback_L.zero_()
        self.reinit_L.zero_()
        self.calls = 0
        return out

    def state_dict(self) -> dict:
        return {"nnz_L": self.nnz_L.cpu(), "active_LF": self.active_LF.cpu(), "overflow_L": self.overflow_L.cpu(),
                "fallback_L": self.fallback_L.cpu(), "reinit_L": self.reinit_L.cpu(), "calls": self.calls,
                "dead_active_LF": self.dead_active_LF.cpu(), "dead_tokens": self.dead_tokens}

    def load_state_dict(self, state: dict) -> None:
        for name in ("nnz_L", "active_LF", "overflow_L", "fallback_L", "reinit_L", "dead_active_LF"):
            if name in state:  # checkpoints written before dead_reinit / dead_window lack the last two
                getattr(self, name).copy_(state[name])
        self.calls = state["calls"]
        self.dead_tokens = state.get("dead_tokens", 0)


def route_layers(model, nnz: list[float]) -> list[str]:
    """Send each layer to the sparse kernels ("auto") when its mean non-zeros per token are under
    TWELL_MAX_NNZ, else to the dense matmuls ("torch"); returns each layer's choice, "twell" or "dense"."""
    for layer, layer_nnz in zip(model.layers, nnz):
        layer.mlp.impl = "auto" if layer_nnz < TWELL_MAX_NNZ else "torch"
    return ["twell" if layer.mlp.impl == "auto" else "dense" for layer in model.layers]


def reinit_dead_gates(model, active_LF, rate: float, seed: int, step: int):
    """Gate rows of the neurons inactive over the dead window (~active_LF) <- (1 - rate) w + rate N(0, 0.02^2),
    the noise from a generator seeded by (seed, step), so a resumed run draws the same. Returns the
    number moved per layer (int64 [L], on the device; no host sync). A gate sharded by FSDP2 moves
    this rank's rows, with their rows of the whole gate's noise (active_LF is then every rank's)."""
    gen = torch.Generator(device=active_LF.device).manual_seed(seed * 1_000_003 + step)
    with torch.no_grad():
        for layer, active_F in zip(model.layers, active_LF):
            w = layer.mlp.gate_proj.weight
            rows, w = local_rows(w), local(w)
            noise = torch.randn(layer.mlp.gate_proj.weight.shape, generator=gen, device=w.device,
                                dtype=torch.float32)[rows] * DEAD_REINIT_STD
            moved = (1 - rate) * w.float() + rate * noise
            w.copy_(torch.where(active_F[rows, None], w.float(), moved).to(w.dtype))
    return (~active_LF).sum(dim=1)


class SparseFFNPolicy:
    """The sparse FFN's part of training a ReLU-gated student: the penalty added to each
    micro-batch's loss, the window of statistics, the per-layer routing at logging steps, and the
    dead-neuron re-init after the steps that close a window. Its state travels in checkpoints.
    Every layer starts dense, until the first logging step has measured it."""

    def __init__(self, config: SparseFFNConfig, model, device, seed: int, reduce=None):
        """reduce: as FFNWindow's (None: one process)."""
        self.config, self.seed = config, seed
        self.window = FFNWindow(model.config.num_layers, model.config.intermediate_size, device, reduce)
        for layer in model.layers:
            layer.mlp.impl = "torch"

    def penalty(self, terms: list):
        """l1 * the mean layer l1 of one forward, or None when the penalty is off (sparse_ffn False:
        a ReLU-gated student trained without it)."""
        return self.config.l1 * l1_penalty(terms) if self.config.sparse_ffn else None

    def observe(self, terms: list, share: float = 1.0) -> None:
        self.window.add(terms, share)

    def end_step(self, model, step: int, grad_accum: int, tokens: int) -> None:
        """After optimizer step `step` (1-based) of `tokens` real tokens: close the step's window and,
        when a dead window closes, move the gate rows of the neurons silent over all of it."""
        active_LF = self.window.end_step(grad_accum, tokens, self.config.dead_window)
        if self.config.dead_reinit and active_LF is not None:
            self.window.reinit_L += reinit_dead_gates(model, active_LF, self.config.dead_reinit, self.seed, step)

    def metrics(self, model) -> dict:
        """The window's metrics row; with sparse_kernel "twell" also routes each layer by its non-zeros."""
        row = self.window.row()
        if self.config.sparse_kernel == "twell":
            row["ffn_kernel"] = route_layers(model, row["ffn_nnz"])
        return row

    def state_dict(self, model) -> dict:
        return {"ffn_window": self.window.state_dict(), "ffn_impl": [layer.mlp.impl for layer in model.layers]}

    def load_state_dict(self, state: dict, model) -> None:
        if state.get("ffn_window") is not None:
            self.window.load_state_dict(state["ffn_window"])
        for layer, impl in zip(model.layers, state.get("ffn_impl") or []):
            layer.mlp.impl = impl
