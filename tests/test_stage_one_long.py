"""Long sequences in the teacher cache: chunked prefill through the teacher's KV cache gives the
rows of one full pass, end to end through `distill cache-teacher` with a --seq-len longer than a
prefill chunk."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import one_error_line, run_cli
from teacher_cache.backends.hf import HFBackend
from teacher_cache.reader import CacheReader
from teacher_cache.targets import TeacherTargets

# fp32, chunked against whole: the same weights and kernels, but attention over other shapes
# (a chunk's queries against the cache) sums in another order; ~3e-5 seen on log-probs of
# magnitude ~10-20, the same as batching's reordering in tests/test_backends.py.
FP32_ATOL = 2e-4


def _stdlib_tokens(tokenizer, relative: str, num_tokens: int) -> np.ndarray:
    text = (Path(sysconfig.get_paths()["stdlib"]) / relative).read_text(encoding="utf-8")
    ids = tokenizer(text[2000:20000]).input_ids[:num_tokens]
    assert len(ids) == num_tokens
    return np.asarray(ids, dtype=np.int32)


def assert_same_rows(got, want) -> None:
    assert got.num_positions == want.num_positions and got.k == want.k
    np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
    np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, atol=FP32_ATOL, rtol=0)
    # The tail as a probability: in log space a tiny tail magnifies the log-prob noise above.
    np.testing.assert_allclose(np.exp(got.tail_logmass), np.exp(want.tail_logmass), atol=10 * FP32_ATOL, rtol=0)
    np.testing.assert_allclose(got.target_logprob, want.target_logprob, atol=FP32_ATOL, rtol=0)  # NaN == NaN


@pytest.fixture(scope="module")
def smollm_fp32(teacher_dir):
    backend = HFBackend(teacher_dir, dtype="float32", device="cpu", batch_size=4)
    yield backend
    backend.close()


def test_chunked_prefill_gives_the_rows_of_one_full_pass(smollm_fp32, teacher_tokenizer):
    # 200 = 3 x 64 + 8: the last chunk is short; a short sequence rides along in the batched path.
    long_seq = _stdlib_tokens(teacher_tokenizer, "textwrap.py", 200)
    short_seq = _stdlib_tokens(teacher_tokenizer, "json/decoder.py", 40)
    k = 12
    smollm_fp32.prefill_tokens = 1 << 20
    whole = smollm_fp32.score([short_seq, long_seq], k)
    smollm_fp32.prefill_tokens = 64
    blocks = list(smollm_fp32.score_blocks([short_seq, long_seq], k))
    # Rows leave chunk by chunk, in sequence order: the short sequence whole, the long one in 4.
    assert [(i, b.num_positions) for i, b in blocks] == [(0, 40), (1, 64), (1, 64), (1, 64), (1, 8)]
    chunked = [TeacherTargets.concat([b for j, b in blocks if j == i]) for i in range(2)]
    for got, want in zip(chunked, whole):
        assert_same_rows(got, want)
    assert np.isnan(chunked[1].target_logprob[-1]) and not np.isnan(chunked[1].target_logprob[:-1]).any()


def test_chunked_prefill_refuses_a_sliding_window_teacher(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    from distill.errors import DistillUserError

    config = MistralConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    backend = HFBackend(tmp_path, dtype="float32", device="cpu", prefill_tokens=16)
    assert backend.score([np.arange(16)], 4)[0].num_positions == 16  # one forward: fine
    with pytest.raises(DistillUserError, match="a sequence of 17 tokens is longer than --prefill-tokens 16"):
        backend.score([np.arange(17)], 4)
