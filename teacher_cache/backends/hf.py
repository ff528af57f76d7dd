"""The transformers teacher backend: any ``AutoModelForCausalLM`` folder, on the CPU or a GPU.

The model body gives the final hidden states; ``kernels.topk_logprobs`` then applies the lm-head,
log-softmax, top-k and the target gather in row chunks, so the [tokens, vocab] fp32 logits never
exist in full (the model's own forward would build them for the whole batch).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import numpy as np
import torch

from kernels.topk_logprobs import topk_logprobs
from teacher_cache.backends import (
    canonical_dtype,
    check_k,
    check_model_dir,
    check_sequences,
    check_temperature,
    split_rows,
    weights_hash,
)
from distill.devices import resolve_device
from distill.errors import DistillUserError
from teacher_cache.targets import TeacherTargets

log = logging.getLogger(__name__)

# How far the model's own logits may be from lm_head(final hidden state) (relative to the largest
# logit) before we refuse it. The two paths run the same matmul on differently shaped inputs, so
# in bf16/fp16 they may round differently: 2**-8 relative per logit, well below 2e-2.
_PROBE_RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
_PROBE_TOKENS = 16


class HFBackend:
    """Teacher targets from a transformers causal LM.

    model_dir: HF folder (config.json + weights). dtype: "bfloat16" | "float16" | "float32".
    device: "auto" (cuda if available) | "cpu" | "cuda[:i]". batch_size: sequences per forward
    (sorted by length first, so a batch pads little). temperature: cache temperature T; logits
    are divided by T before the log-softmax. chunk_size: rows per lm-head chunk (None: auto).
    impl: lm-head top-k path, "auto" (Triton on a GPU) | "torch" | "triton". compile: run the
    model body through torch.compile (fuses its element-wise work; pays off on long GPU runs).
    """

    name = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "bfloat16",
        device: str = "auto",
        batch_size: int = 8,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        impl: str = "auto",
        compile: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.model_dir = check_model_dir(model_dir)
        self.dtype = canonical_dtype(dtype)
        self.temperature = check_temperature(temperature)
        for field, value in (("batch_size", batch_size), ("chunk_size", chunk_size)):
            if value is None and field == "chunk_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DistillUserError(f"{field} must be a positive int, got {value!r}")
        self.batch_size, self.chunk_size, self.impl = batch_size, chunk_size, impl
        self.device = torch.device(resolve_device(device))
        self._weights_hash: str | None = None
        _warn_if_slow_half_precision(self.device, self.dtype)

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.dtype))
        self.model = model.to(self.device).eval()
        _refuse_capped_logits(self.model.config, self.model_dir)
        self._body = self.model.get_decoder()
        head = self.model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise DistillUserError(
                f"{self.model_dir}: the hf backend needs a bias-free linear lm-head, "
                f"found {type(head).__name__}; use the vllm backend for this model"
            )
        self._lm_weight = head.weight  # [V, d]
        self.vocab_size = int(self._lm_weight.shape[0])
        self._logit_scale = self._probe_logit_scale()
        if compile:  # after the probe, so its short input does not take a compilation
            self._body = torch.compile(self._body)

    def describe(self) -> dict:
        if self._weights_hash is None:
            self._weights_hash = weights_hash(self.model_dir)
        return {"path": str(self.model_dir), "weights_hash": self._weights_hash, "backend": "hf", "dtype": self.dtype}

    def score(self, sequences: list[np.ndarray], k: int) -> list[TeacherTargets]:
        """sequences: int [L_i] token ids each (L_i >= 2); one TeacherTargets of L_i rows each."""
        seqs = check_sequences(sequences, self.vocab_size)
        check_k(k, self.vocab_size)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # longest first
        results: list[TeacherTargets | None] = [None] * len(seqs)
        # One batch in flight: batch j's results copy to the host while batch j+1 is launched,
        # so the GPU does not idle through the copy and the host-side work between batches.
        pending = None
        for start in range(0, len(order), self.batch_size):
            batch_idx = order[start : start + self.batch_size]
            launched = (batch_idx, self._launch_batch([seqs[i] for i in batch_idx], k))
            if pending is not None:
                self._collect(*pending, results)
            pending = launched
        if pending is not None:
            self._collect(*pending, results)
        return results

    def close(self) -> None:
        for attr in ("model", "_body", "_lm_weight"):
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
    def _launch_batch(self, batch: list[np.ndarray], k: int):
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
        if self.device.type != "cuda":
            return lengths, tuple(t.numpy() for t in out), None
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in out)
        done = torch.cuda.Event()
        done.record()
        return lengths, host, done

    @staticmethod
    def _collect(batch_idx, launched, results) -> None:
        lengths, host, done = launched
        if done is not None:
            done.synchronize()
        arrays = tuple(t.numpy() if isinstance(t, torch.Tensor) else t for t in host)
        for i, parts in zip(batch_idx, split_rows(arrays, lengths)):
            results[i] = TeacherTargets(*parts)

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


def _warn_if_slow_half_precision(device: torch.device, dtype: str) -> None:
    # Without AVX-512 (bf16/fp16 instructions), torch emulates half-precision matmuls on x86, many
    # times slower than float32 (tests/benchmarks/RESULTS.md, teacher capture, the CPU table).
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
