"""The transformers teacher backend: any ``AutoModelForCausalLM`` folder, on the CPU or a GPU.

The model body gives the final hidden states; ``kernels.topk_logprobs`` then applies the lm-head,
log-softmax, top-k and the target gather in row chunks, so the [tokens, vocab] fp32 logits never
exist in full (the model's own forward would build them for the whole batch). For a sampled cache
``kernels.sample_targets`` does the same with S draws per row in place of the top-k, from the
uniforms that ``teacher_cache.targets.Sampling`` gives each sequence (after the exact top-K in a
hybrid cache).

Sequences of at most ``prefill_tokens`` tokens run whole, several to a forward. A longer one runs
alone, chunk by chunk, through the teacher's own KV cache (chunked prefill): memory is its keys
and values plus one chunk's activations, never full-length activations, and each chunk's rows
leave as soon as they are computed (``score_blocks``). A chunk attends to the cached keys and its
own with a lower-right causal mask that SDPA applies itself, so no [chunk, length] mask is built.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

from kernels.sample_targets import sample_targets
from kernels.topk_logprobs import topk_logprobs
from teacher_cache.backends.base import (
    PREFILL_TOKENS,
    canonical_dtype,
    check_k,
    check_sequences,
    check_temperature,
    split_rows,
)
from teacher_cache.backends.folder import check_model_dir, weights_hash
from distill.devices import resolve_device
from distill.errors import DistillUserError
from teacher_cache.targets import Sampling, TeacherTargets

log = logging.getLogger(__name__)

# How far the model's own logits may be from lm_head(final hidden state) (relative to the largest
# logit) before we refuse it. The two paths run the same matmul on differently shaped inputs, so
# in bf16/fp16 they may round differently: 2**-8 relative per logit, well below 2e-2.
_PROBE_RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
_PROBE_TOKENS = 16
# The attention the model uses once a sequence is prefilled in chunks (see _chunk_attention).
_CHUNK_ATTENTION = "distill_chunked_sdpa"


class HFBackend:
    """Teacher targets from a transformers causal LM.

    model_dir: HF folder (config.json + weights). dtype: "bfloat16" | "float16" | "float32".
    device: "auto" (cuda if available) | "cpu" | "cuda[:i]". batch_size: sequences per forward
    (sorted by length first, so a batch pads little). temperature: cache temperature T; logits
    are divided by T before the log-softmax. chunk_size: rows per lm-head chunk (None: auto).
    impl: lm-head top-k path, "auto" (Triton on a GPU) | "torch" | "triton". compile: run the
    model body of whole-sequence batches through torch.compile (fuses its element-wise work); None
    compiles on a GPU, where it pays off once a run is longer than the compilation (rows
    `teacher_gpu/*/default@a2bce95`, RESULTS.md, "Teacher capture"), and not on a CPU. Chunked prefill always runs the eager body:
    its growing KV cache would take a compilation per length.
    prefill_tokens: longest sequence run in one forward; a longer one is prefilled alone in
    chunks of this many tokens through the teacher's KV cache (see the module doc).
    """

    name = "hf"
    can_sample = True  # score_blocks takes sampling= (sees the whole distribution)

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "bfloat16",
        device: str = "auto",
        batch_size: int = 8,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        impl: str = "auto",
        compile: bool | None = None,
        prefill_tokens: int = PREFILL_TOKENS,
    ):
        from transformers import AutoModelForCausalLM

        self.model_dir = check_model_dir(model_dir)
        self.dtype = canonical_dtype(dtype)
        self.temperature = check_temperature(temperature)
        for field, value in (("batch_size", batch_size), ("chunk_size", chunk_size),
                             ("prefill_tokens", prefill_tokens)):
            if value is None and field == "chunk_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DistillUserError(f"{field} must be a positive int, got {value!r}")
        self.batch_size, self.chunk_size, self.impl = batch_size, chunk_size, impl
        self.prefill_tokens = prefill_tokens
        self.device = torch.device(resolve_device(device))
        self._weights_hash: str | None = None
        self._chunk_attention_set = False  # the model runs _chunk_attention (after the first chunked prefill)
        _warn_if_slow_half_precision(self.device, self.dtype)

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.dtype))
        self.model = model.to(self.device).eval()
        _refuse_capped_logits(self.model.config, self.model_dir)
        self._body = self._eager_body = self.model.get_decoder()
        head = self.model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise DistillUserError(
                f"{self.model_dir}: the hf backend needs a bias-free linear lm-head, "
                f"found {type(head).__name__}; use the vllm backend for this model"
            )
        self._lm_weight = head.weight  # [V, d]
        self.vocab_size = int(self._lm_weight.shape[0])
        self._logit_scale = self._probe_logit_scale()
        if compile is None:
            compile = self.device.type == "cuda"
        self.compiled = compile
        if compile:  # after the probe, so its short input does not take a compilation
            self._body = torch.compile(self._body)

    def describe(self) -> dict:
        if self._weights_hash is None:
            self._weights_hash = weights_hash(self.model_dir)
        return {"path": str(self.model_dir), "weights_hash": self._weights_hash, "backend": "hf", "dtype": self.dtype}

    def score(self, sequences: list[np.ndarray], k: int, *, sampling: Sampling | None = None,
              indices: list[int] | None = None) -> list[TeacherTargets]:
        """sequences: int [L_i] token ids each (L_i >= 2); one TeacherTargets of L_i rows each.

        sampling: draw ``sampling.samples`` ids per row instead of the top-k (after the exact top
        ``sampling.topk``, from outside them; k must equal ``sampling.slots``); indices: then the
        sequences' indices in the cache, which choose their uniforms.
        """
        rows: list[list[TeacherTargets]] = [[] for _ in sequences]
        for i, block in self.score_blocks(sequences, k, sampling=sampling, indices=indices):
            rows[i].append(block)
        return [parts[0] if len(parts) == 1 else TeacherTargets.concat(parts) for parts in rows]

    def score_blocks(self, sequences: list[np.ndarray], k: int, *, sampling: Sampling | None = None,
                     indices: list[int] | None = None) -> Iterator[tuple[int, TeacherTargets]]:
        """The rows of ``score`` as they are produced: (i, consecutive rows of sequence i), sequence
        after sequence in the order given; a sequence longer than prefill_tokens comes in chunks."""
        seqs = check_sequences(sequences, self.vocab_size)
        check_k(k, self.vocab_size)
        if sampling is not None:
            if k != sampling.slots or indices is None or len(indices) != len(seqs):
                raise ValueError(f"sampling needs k == sampling.slots ({k} vs {sampling.slots}) and one cache "
                                 f"index per sequence, got {None if indices is None else len(indices)} for {len(seqs)}")
            draw = _Draw(sampling, self.temperature, self._logit_scale, self.chunk_size)
            ids = list(indices)
        else:
            draw, ids = None, [None] * len(seqs)
        short = [i for i, s in enumerate(seqs) if len(s) <= self.prefill_tokens]
        results = self._score_batched(seqs, short, k, draw, ids)
        for i, seq in enumerate(seqs):
            if i in results:
                yield i, results.pop(i)
            else:
                for block in self._prefill_in_chunks(seq, k, draw, ids[i]):
                    yield i, block

    def _score_batched(self, seqs: list[np.ndarray], indices: list[int], k: int, draw: "_Draw | None",
                       cache_ids: list) -> dict[int, TeacherTargets]:
        order = sorted(indices, key=lambda i: -len(seqs[i]))  # longest first, so a batch pads little
        results: dict[int, TeacherTargets] = {}
        # One batch in flight: batch j's results copy to the host while batch j+1 is launched,
        # so the GPU does not idle through the copy and the host-side work between batches.
        pending = None
        for start in range(0, len(order), self.batch_size):
            batch_idx = order[start : start + self.batch_size]
            launched = (batch_idx, self._launch_batch([seqs[i] for i in batch_idx], k, draw,
                                                      [cache_ids[i] for i in batch_idx]))
            if pending is not None:
                self._collect(*pending, results)
            pending = launched
        if pending is not None:
            self._collect(*pending, results)
        return results

    def _prefill_in_chunks(self, seq: np.ndarray, k: int, draw: "_Draw | None" = None,
                           cache_id: int | None = None) -> Iterator[TeacherTargets]:
        """seq: int64 [L], L > prefill_tokens. Its rows, one block per chunk of prefill_tokens."""
        from transformers import DynamicCache

        _refuse_windowed_attention(self.model.config, self.model_dir, len(seq), self.prefill_tokens)
        if not self._chunk_attention_set:
            _register_chunk_attention()
            self.model.set_attn_implementation(_CHUNK_ATTENTION)
            self._chunk_attention_set = True
        ids = torch.from_numpy(seq).to(self.device)
        next_ids = torch.cat([ids[1:], ids.new_full((1,), -1)])  # the last row has no next token
        cache = DynamicCache(config=self.model.config)
        pending = None
        for start in range(0, len(seq), self.prefill_tokens):
            stop = min(start + self.prefill_tokens, len(seq))
            launched = self._launch_chunk(ids[start:stop], next_ids[start:stop], cache, start, k, draw, cache_id)
            if pending is not None:
                yield _host_targets(pending)
            pending = launched
        yield _host_targets(pending)

    @torch.inference_mode()
    def _launch_chunk(self, ids_C, next_ids_C, cache, start: int, k: int, draw: "_Draw | None" = None,
                      cache_id: int | None = None):
        """Positions start..start+C of one sequence against its cache (which the call extends)."""
        positions = torch.arange(start, start + len(ids_C), device=self.device)
        hidden_CD = self._eager_body(input_ids=ids_C[None], past_key_values=cache, use_cache=True,
                               cache_position=positions, position_ids=positions[None]).last_hidden_state[0]
        if draw is not None:
            uniforms = draw.sampling.uniforms(cache_id, start, start + len(ids_C))
            return self._to_host(draw(hidden_CD, self._lm_weight, uniforms, next_ids_C))
        out = topk_logprobs(hidden_CD, self._lm_weight, k, next_ids_C, temperature=self.temperature / self._logit_scale,
                            chunk_size=self.chunk_size, impl=self.impl, check_ids=False)
        return self._to_host(out)

    def close(self) -> None:
        for attr in ("model", "_body", "_eager_body", "_lm_weight"):
            if hasattr(self, attr):
                delattr(self, attr)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _hidden_states(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        # Right padding and no attention mask: causal attention keeps every real position from
        # seeing the pads after it, and position ids 0..L-1 are right for each sequence.
        return self._body(input_ids=input_ids_BL, use_cache=False).last_hidden_state

    @torch.inference_mode()
    def _launch_batch(self, batch: list[np.ndarray], k: int, draw: "_Draw | None" = None, cache_ids=None):
        """Queue a batch's work and its copy to the host; returns (lengths, host arrays, event)."""
        lengths = [len(s) for s in batch]
        ids_BL = np.zeros((len(batch), max(lengths)), dtype=np.int64)
        next_ids = np.full(sum(lengths), -1, dtype=np.int64)
        offset = 0
        for b, seq in enumerate(batch):
            ids_BL[b, : len(seq)] = seq
            next_ids[offset : offset + len(seq) - 1] = seq[1:]
            offset += len(seq)
        hidden_BLD = self._hidden_states(torch.from_numpy(ids_BL).to(self.device, non_blocking=True))
        if min(lengths) == ids_BL.shape[1]:  # packed corpora: no padding, and no host sync
            hidden_ND = hidden_BLD.flatten(0, 1)
        else:
            real_BL = torch.arange(ids_BL.shape[1])[None, :] < torch.tensor(lengths)[:, None]
            hidden_ND = hidden_BLD[real_BL.to(self.device)]  # real rows, sequence after sequence
        if draw is not None:
            uniforms = np.concatenate([draw.sampling.uniforms(i, 0, n) for i, n in zip(cache_ids, lengths)])
            return lengths, self._to_host(draw(hidden_ND, self._lm_weight, uniforms,
                                               torch.from_numpy(next_ids).to(self.device)))
        out = topk_logprobs(
            hidden_ND,
            self._lm_weight,
            k,
            torch.from_numpy(next_ids).to(self.device),
            temperature=self.temperature / self._logit_scale,
            chunk_size=self.chunk_size,
            impl=self.impl,
            check_ids=False,  # check_sequences has checked them on the host
        )
        return lengths, self._to_host(out)

    def _to_host(self, out: tuple[torch.Tensor | None, ...]):
        """Queue the copy of ``out`` to the host; returns (host arrays or tensors, event or None)."""
        if self.device.type != "cuda":
            return tuple(None if t is None else t.numpy() for t in out), None
        host = tuple(None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in out)
        done = torch.cuda.Event()
        done.record()
        return host, done

    @staticmethod
    def _collect(batch_idx, launched, results) -> None:
        lengths, copied = launched
        arrays = _host_arrays(copied)
        present = [a for a in arrays if a is not None]
        for i, parts in zip(batch_idx, split_rows(tuple(present), lengths)):
            results[i] = TeacherTargets(*parts)  # an absent array is the last one (proposal log-probs)

    @torch.inference_mode()
    def _probe_logit_scale(self) -> float:
        """Check on a short input that the model's logits are c * lm_head(h); return c.

        Some families scale their logits (Cohere's logit_scale, Granite's logits_scaling): a
        constant c folds into the temperature. Anything else is refused rather than cached wrong.
        """
        probe = (torch.arange(_PROBE_TOKENS) * 997 % self.vocab_size)[None].to(self.device)
        full = self.model(input_ids=probe, use_cache=False).logits[0].float()
        ours = (self._hidden_states(probe)[0] @ self._lm_weight.T).float()
        scale = float((full * ours).sum() / (ours * ours).sum())
        rtol = _PROBE_RTOL[self.dtype]
        err = float((full - scale * ours).abs().max() / full.abs().max().clamp_min(1.0))
        if not err <= rtol:
            raise DistillUserError(
                f"{self.model_dir}: {type(self.model).__name__} computes logits that are not a "
                f"scaled lm_head(final hidden state) (relative difference {err:.3g} > {rtol}); "
                "the hf backend cannot reproduce them, use the vllm backend"
            )
        if abs(scale - 1.0) <= rtol:
            return 1.0
        log.info("%s scales its logits by %.6g; folded into the temperature", self.model_dir, scale)
        return scale


def _host_arrays(copied) -> tuple[np.ndarray | None, ...]:
    host, done = copied
    if done is not None:
        done.synchronize()
    return tuple(t.numpy() if isinstance(t, torch.Tensor) else t for t in host)


def _host_targets(copied) -> TeacherTargets:
    return TeacherTargets(*_host_arrays(copied))


class _Draw:
    """A sampled cache's lm-head step: ``kernels.sample_targets`` with the backend's temperatures
    (a constant logit scale folds into both, as into the top-k path's)."""

    def __init__(self, sampling: Sampling, temperature: float, logit_scale: float, chunk_size: int | None):
        self.sampling, self.chunk_size = sampling, chunk_size
        self.temperature = temperature / logit_scale
        self.proposal_temperature = sampling.proposal_temperature / logit_scale
        self.proposal_is_teacher = sampling.proposal_temperature == temperature

    def __call__(self, hidden_ND, weight_VD, uniforms: np.ndarray, next_ids_N):
        proposal = None if self.proposal_is_teacher else self.proposal_temperature
        return sample_targets(hidden_ND, weight_VD, torch.from_numpy(uniforms).to(hidden_ND.device), next_ids_N,
                              temperature=self.temperature, proposal_temperature=proposal,
                              chunk_size=self.chunk_size, head=self.sampling.topk)


def _chunk_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Causal attention of C queries, the last C of S positions, over all S keys (SDPA).

    query [B, H, C, D]; key, value [B, Hkv, S, D] (the cache plus this chunk). Lower-right causal:
    query i sees keys 0..S-C+i. SDPA runs it without a mask tensor (flash on a GPU), so a chunk
    late in a long sequence costs no [C, S] mask.
    """
    groups = query.shape[1] // key.shape[1]
    q_len, kv_len = query.shape[2], key.shape[2]
    # Flash takes grouped heads as they are; SDPA's other lower-right kernel on a GPU does not.
    if groups > 1 and query.device.type == "cuda" and query.dtype == torch.float32:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    causal = dict(is_causal=True) if q_len == kv_len else dict(attn_mask=causal_lower_right(q_len, kv_len))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1], **causal)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # _chunk_attention applies the causal mask itself


def _register_chunk_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(_CHUNK_ATTENTION, _chunk_attention)
    AttentionMaskInterface.register(_CHUNK_ATTENTION, _no_mask)


def _refuse_windowed_attention(config, model_dir: Path, length: int, prefill_tokens: int) -> None:
    """Chunked prefill applies plain causal attention: refuse a teacher with sliding-window layers."""
    for cfg in (config, getattr(config, "text_config", None)):
        layer_types = set(getattr(cfg, "layer_types", None) or ())
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if layer_types - {"full_attention"} or window:
            raise DistillUserError(
                f"{model_dir}: a sequence of {length} tokens is longer than --prefill-tokens {prefill_tokens}, and "
                "this teacher uses sliding-window attention, which chunked prefill does not apply; raise "
                f"--prefill-tokens to at least {length} (or lower --seq-len), or use the vllm backend"
            )


def _warn_if_slow_half_precision(device: torch.device, dtype: str) -> None:
    # Without AVX-512 (bf16/fp16 instructions), torch emulates half-precision matmuls on x86, many
    # times slower than float32 (tests/benchmarks/RESULTS.md, "Teacher capture", the CPU table).
    if device.type == "cpu" and dtype != "float32" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        log.warning(
            "dtype=%s on a CPU without AVX-512 (torch reports %s): half-precision matmuls are "
            "emulated and several times slower than float32; consider dtype='float32'",
            dtype, torch.backends.cpu.get_cpu_capability(),
        )  # fmt: skip


def _refuse_capped_logits(config, model_dir: Path) -> None:
    for cfg in (config, getattr(config, "text_config", None)):
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            raise DistillUserError(
                f"{model_dir}: config sets final_logit_softcapping={cap}; its logits are "
                "tanh-capped, which the hf backend's top-k path does not apply; use the vllm backend"
            )
