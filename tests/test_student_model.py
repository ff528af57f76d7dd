"""student.model: logits equal transformers' on the same weights; HF folders round-trip; chunked
forward with a KV store equals the full forward; pruning; config errors."""

from __future__ import annotations

import json

import pytest
import torch

from student.config import StudentConfig
from student.model import ListKVStore, Student, evenly_spaced_layers, prune_layers
from distill.errors import DistillUserError

ATOL = 1e-5  # fp32, same weights, same op order up to SDPA vs eager softmax
TEXT = 'def greet(name):\n    """Return a greeting."""\n    return f"Hello, {name}!"\n'

# Odd sizes on purpose: hidden 72, 6 heads of 12, 2 kv heads (GQA groups of 3), vocab 301.
SMALL = dict(vocab_size=301, hidden_size=72, intermediate_size=100, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_tied_bias": ("LlamaConfig", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama3_rope": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    # The sparse FFN student: transformers builds it from hidden_act alone (runs kernels.twell_ffn here).
    "llama_relu": ("LlamaConfig", dict(hidden_act="relu")),
    "qwen3_relu": ("Qwen3Config", dict(head_dim=16, hidden_act="relu")),
}


def hf_model(family: str):
    import transformers

    torch.manual_seed(0)
    config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases so a missing one shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def saved_hf(family, tmp_path):
    model = hf_model(family)
    model.save_pretrained(tmp_path / family)
    return model, tmp_path / family


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    ref, folder = saved_hf(family, tmp_path)
    student = Student.from_pretrained(folder).eval()
    ids = torch.randint(0, 301, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = student(ids)
        expected = ref(ids).logits
    assert hidden.shape == (2, 37, 72)
    torch.testing.assert_close(student.logits(hidden), expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_explicit_position_ids_match_transformers(family, tmp_path):
    ref, folder = saved_hf(family, tmp_path)
    student = Student.from_pretrained(folder).eval()
    ids = torch.randint(0, 301, (1, 11), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(40, 51)[None]
    with torch.no_grad():
        got = student.logits(student(ids, position_ids=positions))
        expected = ref(ids, position_ids=positions).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("family", ["llama", "llama_tied_bias", "llama3_rope", "qwen2", "qwen3", "mistral",
                                    "llama_relu"])
def test_saved_student_loads_in_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    _, folder = saved_hf(family, tmp_path)
    student = Student.from_pretrained(folder).eval()
    with torch.no_grad():  # move weights off the source so the check cannot pass by re-reading it
        student.embed_tokens.weight.mul_(1.5)
        student.layers[1].self_attn.k_proj.weight.add_(0.01)
    student.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, 301, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, student.logits(student(ids)), atol=ATOL, rtol=ATOL)
    assert not list(tmp_path.glob(".out.*")), "temp folder left behind"


def test_tied_and_untied_embeddings(tmp_path):
    _, tied_dir = saved_hf("qwen2", tmp_path)
    _, untied_dir = saved_hf("llama", tmp_path)
    tied, untied = Student.from_pretrained(tied_dir), Student.from_pretrained(untied_dir)
    assert tied.lm_head is None and tied.lm_head_weight is tied.embed_tokens.weight
    assert untied.lm_head_weight is untied.lm_head.weight
    assert not torch.equal(untied.lm_head_weight, untied.embed_tokens.weight)
    assert "lm_head.weight" not in tied.hf_state_dict()
    assert "lm_head.weight" in untied.hf_state_dict()
    tied.save_pretrained(tmp_path / "tied_out")  # saving over an existing folder replaces it
    tied.save_pretrained(tmp_path / "tied_out")
    assert json.loads((tmp_path / "tied_out" / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_relu"])
def test_chunked_forward_with_kv_store_equals_full(family, tmp_path):
    _, folder = saved_hf(family, tmp_path)
    student = Student.from_pretrained(folder).eval()
    ids = torch.randint(0, 301, (2, 29), generator=torch.Generator().manual_seed(4))
    store = ListKVStore()
    with torch.no_grad():
        full = student(ids)
        chunks = [student(chunk, kv_store=store) for chunk in ids.split([10, 7, 12], dim=1)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=ATOL)
    assert store.get(0)[0].shape == (2, 2, 29, student.config.head_dim)


def test_chunked_backward_equals_full(tmp_path):
    _, folder = saved_hf("qwen3", tmp_path)
    student = Student.from_pretrained(folder)
    ids = torch.randint(0, 301, (1, 15), generator=torch.Generator().manual_seed(5))
    student.logits(student(ids)).logsumexp(-1).sum().backward()
    full_grads = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    store = ListKVStore()
    chunks = [student(c, kv_store=store) for c in ids.split([4, 5, 6], dim=1)]
    sum(student.logits(h).logsumexp(-1).sum() for h in chunks).backward()
    for p, expected in zip(student.parameters(), full_grads):
        torch.testing.assert_close(p.grad, expected, atol=1e-4, rtol=1e-4)


def test_default_teacher_matches_transformers(teacher_dir, teacher_tokenizer):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = Student.from_pretrained(teacher_dir).eval()
    assert student.config.num_layers == 30 and student.config.tie_word_embeddings
    ids = teacher_tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        got, expected = student.logits(student(ids)), ref(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_pruned_teacher_keeps_evenly_spaced_layers(teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    full = Student.from_pretrained(teacher_dir)
    pruned = Student.from_teacher_pruned(teacher_dir, num_layers=6)
    assert pruned.config.num_layers == len(pruned.layers) == 6
    for new_idx, old_idx in enumerate([0, 6, 12, 17, 23, 29]):
        assert torch.equal(pruned.layers[new_idx].mlp.up_proj.weight, full.layers[old_idx].mlp.up_proj.weight)
    pruned.save_pretrained(tmp_path / "pruned")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, pruned.logits(pruned(ids)), atol=1e-4, rtol=1e-4)


def test_prune_layers_on_small_model(tmp_path):
    _, folder = saved_hf("qwen3", tmp_path)
    student = prune_layers(Student.from_pretrained(folder), [0, 2])
    store = ListKVStore()
    hidden = student(torch.zeros(1, 5, dtype=torch.long), kv_store=store)
    assert hidden.shape == (1, 5, 72) and sorted(store.kv) == [0, 1]
    assert evenly_spaced_layers(30, 2) == [0, 29] and evenly_spaced_layers(5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(DistillUserError, match="must be sorted distinct layer indices"):
        prune_layers(student, [1, 0])
    with pytest.raises(DistillUserError, match=r"`num_layers` must be in \[1, 30\], got 31"):
        evenly_spaced_layers(30, 31)


def test_from_config_builds_a_trainable_model():
    config = StudentConfig(model_type="qwen3", vocab_size=301, hidden_size=72, intermediate_size=100,
                           num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16)
    student = Student(config)
    loss = student.logits(student(torch.ones(2, 7, dtype=torch.long))).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in student.parameters())
    assert StudentConfig.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"hidden_act": "gelu"}, r"`hidden_act` must be one of \('silu', 'relu'\).*got 'gelu'"),
    ({"hidden_act": "relu", "mlp_bias": True}, "`mlp_bias` must be False with hidden_act 'relu'"),
    ({"num_key_value_heads": 4}, "`num_heads` must be a multiple of `num_kv_heads`, got 6 and 4"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "`rope_scaling` type must be 'llama3'"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64},
     "sliding-window attention is not supported"),
])
def test_bad_config_gives_one_clear_error(change, message):
    hf = {"architectures": ["LlamaForCausalLM"], **SMALL, **change}
    with pytest.raises(DistillUserError, match=message) as info:
        StudentConfig.from_hf_dict(hf)
    assert "\n" not in str(info.value)


def test_missing_weight_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = saved_hf("llama", tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(DistillUserError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        Student.from_pretrained(folder)
