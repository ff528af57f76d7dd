"""`distill generate` as a library call: a policy (a student) samples completions for prompts into a
generated corpus, which stage one later scores with the teacher (issue 44, on-policy rounds).

  OUT/generation.json   format and version, the policy's identity (path, run, step, weights hash),
                        the tokenizer's hash and stop ids, the sampler settings, seed, dtype,
                        backend, the prompts (source, kind, count, fingerprint), the shard size and
                        the resolved options; "status": "complete", with each shard's record count
                        and sha256, once every shard is in place (written atomically, first as
                        "incomplete" so a rerun can compare, and last as "complete")
  OUT/shard-00000.jsonl the samples of prompts 0 .. shard_prompts - 1, one JSON object a line:
                        prompt_index, sample, prompt, completion, prompt_ids, completion_ids,
                        sampler_logprobs, finish ("eos" | "length"); each written whole (temp name,
                        rename) once complete
  OUT/LOCK              held by the one writer

`sampler_logprobs[t]` is the log of the probability with which the sampler drew completion token
t: softmax(logits / temperature) restricted to the top-p nucleus (the smallest set of most
probable tokens whose probability reaches top_p) and renormalised over it. It is the behaviour
policy's log-probability an importance weight divides by; at temperature 1 and top_p 1 it is the
policy's own log-probability. `completion_ids` end with the stop id when `finish` is "eos"; the
texts are `tokenizer.decode` of the ids, special tokens kept.

Prompts: a JSONL file (a line {"prompt": text}, tokenised as the tokenizer does by default, or
{"messages": [{"role", "content"}, ...]}, rendered by the tokenizer's chat template with the
generation prompt and tokenised without special tokens), or corpus files and folders read as
cache-teacher reads them, a prompt being the first `prompt_tokens` tokens of each document.

Determinism: sample s of prompt i draws one uniform a token from its own generator, seeded by
`sample_seed(seed, i, s)`, and picks the token by inverse CDF; a shard's (prompt, sample) rows
are decoded together, `batch_size` at a time (pipelines/generate/decode.py). So the same command
gives byte-identical shards, and a killed run rerun gives the corpus of an uninterrupted one. Another
`batch_size` gives the same draws, but fp32 matmuls round differently for another number of
rows, so the log-probabilities may differ in their last bits (and a token only where a draw falls
within that rounding of a boundary). The vllm backend samples with vLLM's own sampler (the same
distribution, other draws), one request per sample seeded by `sample_seed`, one `generate` call
per shard; it is deterministic for a given shard and engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from distill.configs import ConfigError
from distill.devices import resolve_device, resolve_dtype
from distill.errors import DistillUserError
from distill.files import (
    TEMP_MARK, atomic_write_json, atomic_write_text, remove_stale_temps, try_lock, unlock_and_remove,
)
from pipelines.corpus import CorpusConfig, PackedCorpus, fingerprint_sequences
from pipelines.generate.inputs import GenerateConfig, Policy, Prompt, find_policy, read_prompts, stop_ids
from pipelines.generate.samplers import (
    Sample, SamplerSettings, StudentSampler, VLLMSampler, draw_tokens, nucleus_logprobs, sample_seed,
)

__all__ = ["FORMAT", "MANIFEST_NAME", "GenerateConfig", "GenerateReport", "Policy", "Prompt", "Sample",
           "SamplerSettings", "StudentSampler", "VLLMSampler", "find_policy", "read_prompts", "nucleus_logprobs",
           "draw_tokens", "sample_seed", "generate", "read_generated", "is_generated_corpus", "prepare_generated"]

FORMAT, VERSION = "distill-generated-corpus", 1
MANIFEST_NAME, LOCK_NAME = "generation.json", "LOCK"
LOGPROBS_MEANING = ("log-probability the sampler drew the token with: softmax(logits / temperature) restricted to "
                    "the top-p nucleus and renormalised")
# What a rerun must match (dotted paths into generation.json); the rest is informational.
_IDENTITY = ("format", "version", "policy.weights_hash", "tokenizer.hash", "tokenizer.stop_ids", "sampler", "seed",
             "dtype", "backend", "prompts.kind", "prompts.count", "prompts.prompt_tokens", "prompts.fingerprint",
             "shard_prompts")


# ---- the output folder ------------------------------------------------------------------------


@dataclass
class GenerateReport:
    out: str
    shards_written: int
    shards_skipped: int
    samples: int  # records written by this call
    tokens_generated: int  # completion tokens written by this call
    seconds: float  # the whole call
    tokens_per_second: float  # completion tokens per second of sampling (loading the policy left out)


def generate(config: GenerateConfig, progress: bool = True, on_shard: Callable[[int], None] | None = None
             ) -> GenerateReport:
    """Sample `config.samples_per_prompt` completions for every prompt into `config.out` (the module
    docstring says what it holds). Cheap checks first: the policy, the tokenizer, every prompt and
    the out folder (another corpus there is refused, naming what differs) before the policy loads;
    complete shards are kept, so a rerun resumes. on_shard(i): called after shard i is written."""
    started = time.perf_counter()
    from student.data import load_tokenizer
    from teacher_cache.identity import tokenizer_info

    policy = find_policy(config.policy, config.tokenizer)
    tokenizer = load_tokenizer(policy.tokenizer_dir)
    tokenizer_hash = tokenizer_info(tokenizer)["hash"]
    if policy.run_tokenizer_hash not in (None, tokenizer_hash):
        raise DistillUserError(f"--tokenizer {policy.tokenizer_dir} is not the tokenizer run {policy.run} trained with "
                               f"(hash {tokenizer_hash}, the run's {policy.run_tokenizer_hash}); pass the run's one")
    stop = stop_ids(policy, tokenizer)
    prompts, prompts_record = read_prompts(config, tokenizer)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = max(len(p.ids) for p in prompts) + config.max_new_tokens
    _check_fits(policy, len(tokenizer), max_model_len)
    settings = SamplerSettings(config.temperature, config.top_p, config.max_new_tokens, config.samples_per_prompt,
                               config.seed, tuple(stop))
    manifest = _manifest(config, policy, tokenizer_hash, settings, dtype, prompts_record)
    num_shards = math.ceil(len(prompts) / config.shard_prompts)
    out = config.out
    lock = _claim(out)
    try:
        old = _existing_manifest(out, manifest)
        old_sums = {s["name"]: s["sha256"] for s in old.get("shards", [])}
        todo = [i for i in range(num_shards) if not _shard_whole(out / _shard_name(i), old_sums)]
        counts, sampling_seconds = (0, 0), 0.0
        if todo:
            atomic_write_json(out / MANIFEST_NAME, {**manifest, "status": "incomplete"})
            sampler = _open_sampler(config, policy, settings, device, dtype, max_model_len)
            sampling_started = time.perf_counter()
            try:
                counts = _write_shards(sampler, todo, prompts, config, tokenizer, progress, on_shard)
            finally:
                sampler.close()
            sampling_seconds = time.perf_counter() - sampling_started
        if todo or old.get("status") != "complete":
            shards = [_shard_entry(out / _shard_name(i)) for i in range(num_shards)]
            atomic_write_json(out / MANIFEST_NAME, {**manifest, "status": "complete", "shards": shards})
    finally:
        unlock_and_remove(lock, out / LOCK_NAME)
    samples, tokens = counts
    return GenerateReport(str(out), len(todo), num_shards - len(todo), samples, tokens, time.perf_counter() - started,
                          tokens / sampling_seconds if sampling_seconds else 0.0)


def _write_shards(sampler, todo: list[int], prompts: list[Prompt], config: GenerateConfig, tokenizer, progress: bool,
                  on_shard: Callable[[int], None] | None) -> tuple[int, int]:
    """Sample and write the shards `todo`, in order; (records, completion tokens) written."""
    ranges = {i: _shard_range(i, config.shard_prompts, len(prompts)) for i in todo}
    done = len(prompts) - sum(len(r) for r in ranges.values())
    samples = tokens = 0
    with tqdm(total=len(prompts), initial=done, unit="prompt", desc="generating", disable=not progress) as bar:
        for shard, indices in ranges.items():
            drawn = sampler.sample([(i, prompts[i]) for i in indices], bar.update)
            records = [_record(i, prompts[i], s, sample, tokenizer)
                       for i, per_prompt in zip(indices, drawn) for s, sample in enumerate(per_prompt)]
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            atomic_write_text(config.out / _shard_name(shard), text)
            samples += len(records)
            tokens += sum(len(r["completion_ids"]) for r in records)
            if on_shard is not None:
                on_shard(shard)
    return samples, tokens


def _check_fits(policy: Policy, tokenizer_size: int, max_model_len: int) -> None:
    hf = json.loads((policy.folder / "config.json").read_text())
    vocab, positions = hf.get("vocab_size"), hf.get("max_position_embeddings")
    if isinstance(vocab, int) and vocab < tokenizer_size:
        raise DistillUserError(f"policy {policy.folder} has vocab {vocab}, smaller than its tokenizer's "
                               f"{tokenizer_size}; pass --tokenizer, the tokenizer it was trained with")
    if isinstance(positions, int) and max_model_len > positions:
        raise DistillUserError(f"the longest prompt plus --max-new-tokens is {max_model_len} tokens, more than the "
                               f"policy's max_position_embeddings {positions}; shorten the prompts or --max-new-tokens")


def _open_sampler(config, policy, settings, device, dtype, max_model_len):
    if config.backend == "vllm":
        return VLLMSampler(policy, settings, config.device, dtype, max_model_len)
    return StudentSampler(policy, settings, device, dtype, config.batch_size)


def _manifest(config: GenerateConfig, policy: Policy, tokenizer_hash: str, settings: SamplerSettings, dtype: str,
              prompts_record: dict) -> dict:
    from teacher_cache.backends.folder import weights_hash

    if not any(policy.folder.glob("*.safetensors")):
        raise DistillUserError(f"--policy: {policy.folder} holds no model.safetensors; pass a student HF folder")
    options = {f.name: str(v) if isinstance(v := getattr(config, f.name), Path) else v
               for f in dataclasses.fields(config) if f.name != "out"}
    return {
        "format": FORMAT, "version": VERSION,
        "policy": {"path": str(policy.folder), "run": None if policy.run is None else str(policy.run),
                   "step": policy.step, "weights_hash": weights_hash(policy.folder)},
        "tokenizer": {"path": str(policy.tokenizer_dir.resolve()), "hash": tokenizer_hash,
                      "stop_ids": list(settings.stop_ids)},
        "sampler": {"temperature": settings.temperature, "top_p": settings.top_p,
                    "max_new_tokens": settings.max_new_tokens, "samples_per_prompt": settings.samples_per_prompt,
                    "sampler_logprobs": LOGPROBS_MEANING},
        "seed": settings.seed, "dtype": dtype, "backend": config.backend, "prompts": prompts_record,
        "shard_prompts": config.shard_prompts, "num_shards": math.ceil(prompts_record["count"] / config.shard_prompts),
        "config": options,
    }


def _claim(out: Path):
    """Create `out` if needed, take its lock and clear what a killed writer left; refuse a folder
    that holds something other than a generated corpus."""
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"is an existing file ({out}); give a new or empty folder")
    if out.is_dir() and not (out / MANIFEST_NAME).exists() and any(
            p.name != LOCK_NAME and TEMP_MARK not in p.name for p in out.iterdir()):
        raise ConfigError("out", f"({out}) is not empty and holds no {MANIFEST_NAME}; give a new or empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = try_lock(out / LOCK_NAME)
    except OSError as e:
        raise ConfigError("out", f"cannot be written ({out}: {e.strerror or e}); give a folder you can "
                                 "write to") from None
    if lock is None:
        raise ConfigError("out", f"is being written by another distill generate ({out / LOCK_NAME} is held); wait for "
                                 "it, or give another folder")
    remove_stale_temps(out)
    return lock


def _existing_manifest(out: Path, manifest: dict) -> dict:
    """The folder's generation.json ({} if none), once its identity equals `manifest`'s."""
    path = out / MANIFEST_NAME
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    differ = [f"{key} {_dig(old, key)!r} -> {_dig(manifest, key)!r}" for key in _flat_identity(manifest)
              if _dig(old, key) != _dig(manifest, key)]
    if differ:
        raise DistillUserError(f"{out} holds a generated corpus made otherwise ({'; '.join(differ)}); use a fresh "
                               "--out, or rerun with its settings to resume it")
    return old


def _flat_identity(manifest: dict) -> list[str]:
    """_IDENTITY with each dict-valued key spelled out, so a difference names the setting."""
    keys = []
    for key in _IDENTITY:
        value = _dig(manifest, key)
        keys += [f"{key}.{k}" for k in value] if isinstance(value, dict) else [key]
    return keys


def _dig(manifest: dict, key: str):
    for part in key.split("."):
        manifest = manifest.get(part) if isinstance(manifest, dict) else None
    return manifest


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.jsonl"


def _shard_range(shard: int, shard_prompts: int, num_prompts: int) -> range:
    return range(shard * shard_prompts, min((shard + 1) * shard_prompts, num_prompts))


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _shard_whole(path: Path, recorded: dict[str, str]) -> bool:
    """A shard is written whole or not at all; one a complete generation.json lists must still match its sum."""
    return path.is_file() and (path.name not in recorded or _sha256(path) == recorded[path.name])


def _shard_entry(path: Path) -> dict:
    data = path.read_bytes()
    return {"name": path.name, "records": data.count(b"\n"), "sha256": "sha256:" + hashlib.sha256(data).hexdigest()}


def _record(index: int, prompt: Prompt, sample_index: int, sample: Sample, tokenizer) -> dict:
    return {"prompt_index": index, "sample": sample_index, "prompt": prompt.text,
            "completion": tokenizer.decode(sample.ids), "prompt_ids": list(prompt.ids),
            "completion_ids": sample.ids, "sampler_logprobs": sample.logprobs, "finish": sample.finish}


# ---- reading a generated corpus ---------------------------------------------------------------


def is_generated_corpus(path) -> bool:
    """Whether `path` is a folder `generate` writes (complete or not)."""
    manifest = Path(path) / MANIFEST_NAME
    try:
        return manifest.is_file() and json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def read_generated(folder) -> tuple[dict, Iterator[dict]]:
    """(generation.json, the records of every shard in order) of a complete generated corpus; each
    shard's sha256 is checked against generation.json as it is read (a DistillUserError names a
    damaged one)."""
    folder = Path(folder)
    if not is_generated_corpus(folder):
        raise DistillUserError(f"{folder} is not a generated corpus (no {MANIFEST_NAME} of format {FORMAT})")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    if manifest.get("version") != VERSION:
        raise DistillUserError(f"{folder} is a generated corpus of version {manifest.get('version')}; this distill "
                               f"reads version {VERSION}")
    if manifest.get("status") != "complete":
        raise DistillUserError(f"generated corpus {folder} is incomplete; rerun its distill generate command to "
                               "finish it")

    def records() -> Iterator[dict]:
        for shard in manifest["shards"]:
            path = folder / shard["name"]
            data = path.read_bytes() if path.is_file() else None
            if data is None or "sha256:" + hashlib.sha256(data).hexdigest() != shard["sha256"]:
                raise DistillUserError(f"shard {path} of generated corpus {folder} is missing or damaged (its "
                                       "sha256 is not generation.json's); rerun its distill generate command to "
                                       "rebuild it")
            for line in data.decode("utf-8").splitlines():
                yield json.loads(line)

    return manifest, records()


def prepare_generated(config: CorpusConfig, tokenizer) -> PackedCorpus:
    """A generated corpus (`distill generate`, config.paths[0]) as sequences for the teacher: record
    r is prompt_ids + completion_ids, its row t (the distribution over token t + 1) a loss row when
    token t + 1 is a completion token; the first config.max_sequences records. The policy's
    tokenizer must be the teacher's (`tokenizer`): the ids are scored as they were sampled. The
    fingerprint covers the ids, the prompt lengths and the policy's weights."""
    from teacher_cache.identity import tokenizer_info

    folder = config.paths[0]
    manifest, records = read_generated(folder)
    teacher_hash = tokenizer_info(tokenizer)["hash"]
    if manifest["tokenizer"]["hash"] != teacher_hash:
        raise ConfigError("paths", f"{folder} was generated with tokenizer {manifest['tokenizer']['hash']}, the teacher's "
                                   f"is {teacher_hash}; score generated text with a teacher of the policy's tokenizer")
    sequences, masks, sampler, prompts = [], [], [], []
    for number, record in enumerate(records):
        if config.max_sequences is not None and number >= config.max_sequences:
            break
        prompt, completion = record["prompt_ids"], record["completion_ids"]
        ids = np.asarray(prompt + completion, dtype=np.int32)
        if len(ids) > config.seq_len:
            raise ConfigError("seq_len", f"is {config.seq_len}, but record {number} of {folder} holds {len(ids)} tokens "
                                         "(generated records are never cut); raise it")
        mask, logprob = np.zeros(len(ids), np.uint8), np.full(len(ids), np.nan, np.float32)
        rows = slice(len(prompt) - 1, len(ids) - 1)  # row t predicts token t + 1
        mask[rows] = 1
        logprob[rows] = record["sampler_logprobs"]
        sequences.append(ids)
        masks.append(mask)
        sampler.append(logprob)
        prompts.append(len(prompt))
    if not sequences:
        raise DistillUserError(f"generated corpus {folder} holds no records")
    digest = hashlib.sha256(fingerprint_sequences(sequences).encode())
    digest.update(np.asarray(prompts, "<i8").tobytes())
    digest.update(manifest["policy"]["weights_hash"].encode())
    generated = {"corpus": str(Path(folder).resolve()), "policy": manifest["policy"], "sampler": manifest["sampler"]}
    return PackedCorpus(
        sequences=sequences, num_documents=len(sequences), num_tokens=sum(len(s) for s in sequences),
        seq_len=config.seq_len, source=f"generated corpus {folder}", fingerprint=digest.hexdigest(),
        generated=generated, rows_of={"loss_mask": masks, "sampler_logprob": sampler})
