"""A teacher's HF folder checked without loading its weights, and the hash of its weights.

Torch-free: stage one checks the folder and fills the manifest's teacher fields before it loads
(or, reusing a complete cache, instead of loading) the teacher.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.errors import DistillUserError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_dir(model_dir: str | Path) -> Path:
    """``model_dir`` resolved, once it holds a config.json (DistillUserError naming what to pass otherwise)."""
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise DistillUserError(
            f"teacher folder {path} has no config.json; pass an HF model folder "
            "(config.json + weights), or turn a GGUF file into one with `distill import-gguf`"
        )
    return path.resolve()


@dataclass(frozen=True)
class TeacherFolder:
    """A teacher HF folder checked without loading its weights."""

    path: Path
    vocab_size: int | None  # rows of the lm-head as config.json gives them (None: not stated)
    tokenizer: Any  # the teacher's transformers tokenizer


def open_teacher_folder(model_dir: str | Path) -> TeacherFolder:
    """Check everything a backend needs from ``model_dir`` short of loading the model: a config
    transformers understands, weight files and a tokenizer. Each problem is one DistillUserError."""
    from transformers import AutoConfig, AutoTokenizer

    path = check_model_dir(model_dir)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DistillUserError(
            f"teacher folder {path}: its config.json is not a model config transformers can read "
            f"({_first_line(e)}); pass an HF model folder, or turn a GGUF file into one with "
            "`distill import-gguf`"
        ) from None
    _weight_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        has_files = any((path / name).is_file() for name in _TOKENIZER_FILES)
        reason = f"transformers: {_first_line(e)}" if has_files else "no tokenizer files"
        raise DistillUserError(
            f"teacher folder {path} has no usable tokenizer ({reason}); copy the teacher's "
            "tokenizer files (tokenizer.json, tokenizer_config.json) into it (`distill import-gguf` "
            "writes them)"
        ) from None
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    return TeacherFolder(path=path, vocab_size=vocab_size if isinstance(vocab_size, int) else None,
                         tokenizer=tokenizer)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(" .:")


_HASHES: dict[tuple, str] = {}


def weights_hash(model_dir: str | Path) -> str:
    """"sha256:<hex>" over the folder's weight files (name, then bytes; files in name order).

    Streamed in 8 MiB blocks; remembered for the life of the process, keyed by the files' names,
    sizes and modification times.
    """
    folder = Path(model_dir)
    files = _weight_files(folder)
    key = (str(folder.resolve()),) + tuple((p.name, *_size_mtime(p)) for p in files)
    if key not in _HASHES:
        digest = hashlib.sha256()
        for p in files:
            digest.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                while block := f.read(8 << 20):
                    digest.update(block)
        _HASHES[key] = "sha256:" + digest.hexdigest()
    return _HASHES[key]


def _weight_files(folder: Path) -> list[Path]:
    """The weight files a loader reads, in name order (folders with both formats load the safetensors ones)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    files = safetensors or files
    if not files:
        raise DistillUserError(f"teacher folder {folder} has no weight files ({', '.join(_WEIGHT_SUFFIXES)}); "
                               "pass an HF model folder with its weights")
    return files


def _size_mtime(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
