"""Batched decoding for the student backend: many rows (prompts and samples mixed) in one batch,
keys and values in buffers allocated once, and on a GPU the whole decode step (forward, sampling,
the writes) captured in one CUDA graph and replayed a token at a time with no host sync.

A batch's prompts are right-aligned: row b's prompt fills buffer positions start[b] .. P - 1 (P the
longest prompt), and every row writes its n-th new token's keys at P + n, so one write position
serves all rows. A row's position ids count from its own first token, and its queries see only
keys from start[b] on: the padding is invisible to it (up to the rounding of another batch shape).

Rows that drew a stop id keep decoding (their later tokens are dropped when the batch ends), so
every step has the batch's shape; the host checks every `_CHECK_EVERY` steps whether all rows
have stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from student.model import Student, masked_attention

_CHECK_EVERY = 32  # decode steps between the host's looks at whether every row has stopped


class StaticKVStore:
    """The KVStore of one decode batch: per layer keys and values [B, Hkv, length, D], allocated once.
    Before each forward the decoder sets `write_at` (positions [T], int64, on the device) and `mask`
    (bool [B, 1, T, length]); attend writes the chunk's keys and values there and attends over the
    whole buffer under the mask (unwritten positions are masked)."""

    def __init__(self, model: Student, batch: int, length: int):
        c, p = model.config, model.embed_tokens.weight
        shape = (batch, c.num_kv_heads, length, c.head_dim)
        self.keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(c.num_layers)]
        self.values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(c.num_layers)]
        self.write_at: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def past_length(self) -> int:
        raise NotImplementedError("StaticKVStore needs explicit position_ids")

    def attend(self, layer_idx, q, k, v):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.write_at, k)
        values.index_copy_(2, self.write_at, v)
        return masked_attention(q, keys, values, self.mask)


@dataclass
class Decoded:
    """tokens and log-probabilities [B, n] (n <= max_new_tokens: the steps run), on the CPU."""

    tokens: torch.Tensor
    logprobs: torch.Tensor


class BatchDecoder:
    """Decodes rows of (prompt ids, uniforms) with `model`; `logprobs_of(logits [B, V]) -> float64
    log-probs [B, V]` is the sampler's distribution and `pick(logp, uniforms [B]) -> tokens [B]` its
    draw. cuda_graph (default: on a GPU) replays each decode step as one CUDA graph."""

    def __init__(self, model: Student, logprobs_of, pick, stop_ids: tuple[int, ...], cuda_graph: bool | None = None):
        self.model, self.logprobs_of, self.pick = model, logprobs_of, pick
        self.device = model.embed_tokens.weight.device
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def decode(self, prompts: list[tuple[int, ...]], uniforms: torch.Tensor) -> Decoded:
        """prompts: B lists of ids; uniforms float64 [B, max_new_tokens] (row b's draw n uses [b, n])."""
        rows, max_new = uniforms.shape
        longest = max(len(p) for p in prompts)
        length = longest + max_new
        device = self.device
        ids = torch.zeros(rows, longest, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            ids[b, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
        start = torch.tensor([longest - len(p) for p in prompts], device=device)[:, None]
        key = torch.arange(length, device=device)
        store = StaticKVStore(self.model, rows, length)

        # prefill: row b's query i sees keys start[b] .. i (a padding query sees itself only)
        query = torch.arange(longest, device=device)
        store.write_at = query
        store.mask = (((key >= start[:, None]) & (key <= query[:, None])) | (key == query[:, None]))[:, None]
        positions = (query - start).clamp(min=0)
        hidden = self.model(ids.to(device), position_ids=positions, kv_store=store)[:, -1].contiguous()

        state = _StepState(hidden, uniforms.to(device), torch.zeros(1, dtype=torch.int64, device=device),
                           torch.zeros(rows, max_new, dtype=torch.int64, device=device),
                           torch.zeros(rows, max_new, dtype=torch.float64, device=device))

        def step() -> None:
            """Draw token `state.step` of every row, then run it through the model (its keys and
            values at longest + step) for the next one's hidden state."""
            logp = self.logprobs_of(self.model.logits(state.hidden))
            drawn = self.pick(logp, state.uniforms.index_select(1, state.step)[:, 0])
            state.tokens.index_copy_(1, state.step, drawn[:, None])
            state.logprobs.index_copy_(1, state.step, logp.gather(1, drawn[:, None]))
            at = longest + state.step
            store.write_at = at
            store.mask = ((key >= start) & (key <= at))[:, None, None]
            state.hidden.copy_(self.model(drawn[:, None], position_ids=at - start, kv_store=store)[:, -1])
            state.step.add_(1)

        run = _graphed(step, state) if self.cuda_graph else step
        steps = 0
        while steps < max_new:
            for _ in range(min(_CHECK_EVERY, max_new - steps)):
                run()
            steps = min(steps + _CHECK_EVERY, max_new)
            if len(self.stop_ids) and torch.isin(state.tokens[:, :steps], self.stop_ids).any(dim=1).all():
                break
        return Decoded(state.tokens[:, :steps].cpu(), state.logprobs[:, :steps].cpu())


@dataclass
class _StepState:
    hidden: torch.Tensor  # [B, d]: the hidden state the next token is drawn from
    uniforms: torch.Tensor  # float64 [B, max_new]
    step: torch.Tensor  # int64 [1]: the token being drawn
    tokens: torch.Tensor  # int64 [B, max_new]
    logprobs: torch.Tensor  # float64 [B, max_new]


def _graphed(step, state: _StepState):
    """`step` captured in a CUDA graph: returns its replay. Capture runs step twice first on a side
    stream (as torch.cuda.graphs asks), so the state it moved is put back."""
    hidden = state.hidden.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    state.hidden.copy_(hidden)
    state.step.zero_()  # the tokens, log-probs and keys the warm-up wrote are written again
    return graph.replay
