"""Corpus preparation: read local documents, tokenise them with the teacher's tokenizer and pack
them into fixed-length sequences for the teacher cache (stage one).

Packing rule. Documents are taken in order (paths in the order given, folders sorted by relative
path, rows in file order). Each document is tokenised without special tokens; documents that
tokenise to nothing (an empty file, a null row) are skipped. The documents are concatenated into
one token stream with the tokenizer's EOS id between consecutive documents (``add_eos``; none
before the first document or after the last), and the stream is cut into sequences of exactly
``seq_len`` tokens. Once ``max_sequences`` sequences are full, reading and tokenising stop. If
the corpus ends first, the remainder becomes a last, shorter sequence when it holds at least 2
tokens (one input and one next token), and is dropped otherwise. A document may therefore span
two sequences, and a sequence may end on the EOS that precedes a document it does not hold.

Generated text (a folder `distill generate` wrote) is not packed: pipelines/generate's
``prepare_generated`` makes each record one sequence, with the ``generated`` and ``rows_of`` fields.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from distill.configs import ConfigError, check_types, option, require
from distill.errors import DistillUserError
from pipelines.corpus_sources import (
    CorpusFormat, EncodingErrors, Source, check_readable, iter_documents, resolve_sources,
)
from pipelines.defaults import default_corpus_dir

log = logging.getLogger(__name__)

# Characters tokenised per batch: at most this many, so the progress bar moves and memory stays
# small; and, under max_sequences, about this many per still-missing token, so an early stop
# tokenises little more than it keeps (code and prose take a few characters a token).
_MAX_BATCH_CHARS = 1 << 20
_MIN_BATCH_CHARS = 1 << 14
_CHARS_PER_MISSING_TOKEN = 6
_FINGERPRINT_VERSION = b"distill-corpus-v1\n"


@dataclass(frozen=True)
class CorpusConfig:
    """What text to read and how to pack it (see the module docstring for the packing rule)."""

    # read in order; one path (not in a tuple) is accepted too
    paths: tuple[Path, ...] = option(
        help="Files or folders of text (repeatable); default: the Python standard library.", flags=("--corpus",),
        default_factory=lambda: (default_corpus_dir(),))
    # hf-dataset: a folder written by datasets' save_to_disk
    format: CorpusFormat = option("auto", "auto, text, json, jsonl, parquet, arrow or hf-dataset.")
    text_field: str = option("text", "Column holding the text (json, parquet, arrow, hf-dataset).")
    # matched like PurePath.match
    file_glob: str = option("*.py", "Which files of a folder to read.", flags=("--glob",))
    # folder names skipped while walking (the stdlib folder often holds site-packages)
    exclude_dirs: tuple[str, ...] = ("site-packages", "dist-packages", "__pycache__")
    encoding_errors: EncodingErrors = option("skip", (
        "Text files that are not UTF-8 text (binary files, other encodings): skip (and count them), strict "
        "(refuse), replace or ignore (decode the bad bytes lossily; binary files are still skipped)."))
    seq_len: int = option(1024, "Tokens per packed sequence (>= 2).")  # only the last sequence may be shorter
    max_sequences: int | None = option(None, "Stop after this many sequences (default: the whole corpus).")
    add_eos: bool = True  # the tokenizer's EOS id between consecutive documents

    def __post_init__(self) -> None:
        paths = self.paths
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        elif isinstance(paths, list):
            paths = tuple(paths)
        object.__setattr__(self, "paths", paths)
        if isinstance(self.exclude_dirs, list):
            object.__setattr__(self, "exclude_dirs", tuple(self.exclude_dirs))
        check_types(self)
        if not self.paths:
            raise ConfigError("paths", "is empty; name at least one file or folder")
        object.__setattr__(self, "paths", tuple(Path(p).expanduser() for p in self.paths))
        for path in self.paths:
            check_readable(path)
        for name in ("text_field", "file_glob"):
            value = getattr(self, name)
            require(name, value, value != "", "a non-empty string")
        require("seq_len", self.seq_len, self.seq_len >= 2, "an integer >= 2 (an input and its next token)")
        require("max_sequences", self.max_sequences, self.max_sequences is None or self.max_sequences >= 1,
                "a positive integer, or leave it out (the whole corpus)")


@dataclass(frozen=True)
class PackedCorpus:
    """Token sequences ready for the teacher.

    ``sequences`` is a list of int32 numpy arrays: every one holds exactly ``seq_len`` tokens
    except possibly the last, which holds between 2 and ``seq_len`` tokens.
    """

    sequences: list[np.ndarray]  # int32 [seq_len] each; the last may be shorter (>= 2)
    num_documents: int  # documents with at least one token in the sequences
    num_tokens: int  # sum of the sequences' lengths
    seq_len: int
    source: str  # human description: paths, formats, globs
    fingerprint: str  # sha256 hex of the token ids and sequence boundaries
    skipped_files: tuple[Path, ...] = ()  # text files skipped as not UTF-8 text (encoding_errors)
    # generated text: its generation (the manifest's data.generated) and per-row arrays, one [L_i]
    # array per sequence each: loss_mask uint8, sampler_logprob float32 (teacher_cache/store.py)
    generated: dict | None = None
    rows_of: dict | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    def seq_offsets(self) -> np.ndarray:
        """int64 [num_sequences + 1]: sequence i is tokens offsets[i]:offsets[i+1] of the stream."""
        lengths = [len(s) for s in self.sequences]
        return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def fingerprint_sequences(sequences: Sequence[np.ndarray]) -> str:
    """sha256 hex over each sequence's length (int64 LE) and token ids (int32 LE), in order: equal
    token ids cut at equal boundaries give equal fingerprints, whatever settings produced them."""
    digest = hashlib.sha256(_FINGERPRINT_VERSION)
    for sequence in sequences:
        digest.update(np.int64(len(sequence)).astype("<i8").tobytes())
        digest.update(np.ascontiguousarray(sequence, dtype="<i4").tobytes())
    return digest.hexdigest()


def prepare_corpus(config: CorpusConfig, tokenizer, progress: bool = True) -> PackedCorpus:
    """Read the corpus that ``config`` names, tokenise it with ``tokenizer`` (a transformers
    tokenizer, ideally fast: its Rust backend is called on batches of documents) and pack it.
    Deterministic: the same files and settings give the same sequences and fingerprint."""
    eos_id = _eos_id(tokenizer) if config.add_eos else None
    sources = resolve_sources(config.paths, config.format, config.file_glob, config.exclude_dirs)
    source = "; ".join(s.describe(config.file_glob) for s in sources)
    encode = _batch_encoder(tokenizer)
    packer = _Packer(config.seq_len, config.max_sequences, eos_id)
    skipped: list[Path] = []
    total = None if config.max_sequences is None else config.max_sequences * config.seq_len
    with tqdm(
        total=total, unit="tok", unit_scale=True, desc="tokenising corpus", disable=not progress
    ) as bar, contextlib.closing(_text_batches(sources, config, packer.tokens_missing, skipped)) as batches:
        for texts in batches:
            packed_before = packer.num_packed_tokens
            packer.add([ids for ids in encode(texts) if len(ids)])
            bar.update(packer.num_packed_tokens - packed_before)
            if packer.is_full:
                break
    sequences, num_documents = packer.finish()
    num_tokens = sum(len(s) for s in sequences)
    skipped_note = ""
    if skipped:
        skipped_note = f"{len(skipped)} file(s) skipped as not UTF-8 text (e.g. {skipped[0]})"
        # a warning has no surface to name the setting after, so it names both
        log.warning("corpus %s: %s; pass --encoding-errors strict (in a recipe: [corpus] encoding_errors = "
                    "\"strict\") to refuse them instead", source, skipped_note)
    if not packer.doc_starts:
        raise DistillUserError(
            f"corpus {source} holds no non-empty documents{f' ({skipped_note})' if skipped else ''}; "
            "check the corpus paths, glob and text field"
        )
    if num_tokens < 2:
        raise DistillUserError(
            f"corpus {source} tokenises to {packer.num_stream_tokens} token(s); a sequence needs "
            "at least 2: add text to the corpus"
        )
    return PackedCorpus(
        sequences=sequences,
        num_documents=num_documents,
        num_tokens=num_tokens,
        seq_len=config.seq_len,
        source=source,
        fingerprint=fingerprint_sequences(sequences),
        skipped_files=tuple(skipped),
    )


class _Packer:
    """Cuts the EOS-joined token stream into sequences of seq_len tokens, batch by batch."""

    def __init__(self, seq_len: int, max_sequences: int | None, eos_id: int | None):
        self.seq_len, self.max_sequences, self.eos_id = seq_len, max_sequences, eos_id
        self.sequences: list[np.ndarray] = []
        self.carry = np.zeros(0, dtype=np.int32)  # stream tokens not yet in a full sequence
        self.doc_starts: list[int] = []  # stream position of each document's first token
        self.num_stream_tokens = 0

    @property
    def num_packed_tokens(self) -> int:
        return len(self.sequences) * self.seq_len

    @property
    def is_full(self) -> bool:
        return self.max_sequences is not None and len(self.sequences) >= self.max_sequences

    def tokens_missing(self) -> int | None:
        if self.max_sequences is None:
            return None
        return (self.max_sequences - len(self.sequences)) * self.seq_len - len(self.carry)

    def add(self, documents: list[np.ndarray]) -> None:
        """Append non-empty documents (int32 token ids each) to the stream and cut full sequences."""
        parts = [self.carry]
        for ids in documents:
            if self.doc_starts and self.eos_id is not None:
                parts.append(np.array([self.eos_id], dtype=np.int32))
                self.num_stream_tokens += 1
            self.doc_starts.append(self.num_stream_tokens)
            parts.append(ids)
            self.num_stream_tokens += len(ids)
        stream = np.concatenate(parts)
        num_full = len(stream) // self.seq_len
        if self.max_sequences is not None:
            num_full = min(num_full, self.max_sequences - len(self.sequences))
        cut = num_full * self.seq_len
        self.sequences.extend(stream[:cut].reshape(num_full, self.seq_len))
        self.carry = stream[cut:]

    def finish(self) -> tuple[list[np.ndarray], int]:
        """The sequences (the remainder kept if it has >= 2 tokens and room is left) and the
        number of documents with at least one token in them."""
        if not self.is_full and len(self.carry) >= 2:
            self.sequences.append(self.carry)
        self.carry = self.carry[:0]
        num_kept = sum(len(s) for s in self.sequences)
        return self.sequences, bisect.bisect_left(self.doc_starts, num_kept)


def _text_batches(
    sources: list[Source],
    config: CorpusConfig,
    tokens_missing: Callable[[], int | None],
    skipped: list[Path],
) -> Iterator[list[str]]:
    """Documents in order, grouped into batches whose size in characters follows how many tokens
    are still missing, so that an early stop reads and tokenises little beyond what it keeps."""
    batch: list[str] = []
    batch_chars = 0
    for source in sources:
        for text in iter_documents(
            source, config.text_field, config.encoding_errors, config.file_glob, skipped
        ):
            if not text:
                continue
            batch.append(text)
            batch_chars += len(text)
            missing = tokens_missing()
            budget = _MAX_BATCH_CHARS
            if missing is not None:
                budget = min(budget, max(_MIN_BATCH_CHARS, missing * _CHARS_PER_MISSING_TOKEN))
            if batch_chars >= budget:
                yield batch
                batch, batch_chars = [], 0
    if batch:
        yield batch


def _batch_encoder(tokenizer) -> Callable[[list[str]], list[np.ndarray]]:
    """texts -> int32 token ids per text, no special tokens added. The fast path calls the Rust
    backend directly, skipping the offsets and masks that the tokenizer's __call__ also builds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):

        def encode_fast(texts: list[str]) -> list[np.ndarray]:
            encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

        return encode_fast

    def encode(texts: list[str]) -> list[np.ndarray]:
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [np.asarray(i, dtype=np.int32) for i in ids]

    return encode


def _eos_id(tokenizer) -> int:
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ConfigError(
            "add_eos",
            f"is true but tokenizer {name} has no EOS token to put between documents; set it to "
            "false or use a tokenizer with an eos_token",
        )
    return int(eos_id)
