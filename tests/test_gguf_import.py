"""teacher_cache.gguf_import: the imported default teacher against transformers' own GGUF loading."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipelines.defaults import default_teacher_gguf
from distill.errors import DistillUserError
from teacher_cache.gguf_import import import_gguf

TEXT = 'def greet(name):\n    """Return a greeting."""\n    return f"Hello, {name}!"\n'


@pytest.fixture(scope="module")
def gguf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_teacher_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def imported_model(teacher_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(teacher_dir).eval()


def test_imported_folder_is_a_plain_hf_checkpoint(teacher_dir):
    config = json.loads((teacher_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert (teacher_dir / "model.safetensors").is_file() and (teacher_dir / "tokenizer.json").is_file()


def test_same_logits_as_transformers_gguf_loading(imported_model, gguf_model, teacher_tokenizer):
    reference, gguf_tokenizer = gguf_model
    ids = teacher_tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.tolist() == gguf_tokenizer(TEXT, return_tensors="pt").input_ids.tolist()
    assert imported_model.dtype == torch.float32
    with torch.inference_mode():
        got, expected = imported_model(ids).logits, reference(ids).logits
    # float32 copies of the same dequantised weights through the same code: equal up to kernel order.
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_greedy_generation_writes_text(imported_model, teacher_tokenizer):
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    prompt = teacher_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = imported_model.generate(**prompt, max_new_tokens=24, do_sample=False)
    text = teacher_tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip(), "greedy generation produced no text"


def test_import_rejects_bad_arguments(tmp_path):
    with pytest.raises(DistillUserError, match="GGUF file not found"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(DistillUserError, match="dtype must be one of float32, bfloat16, float16, got 'int4'"):
        import_gguf(default_teacher_gguf(), tmp_path / "out", dtype="int4")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("someone's files")
    with pytest.raises(FileExistsError, match="is not empty"):
        import_gguf(default_teacher_gguf(), tmp_path / "full")


def test_written_folder_honours_the_umask(tmp_path, teacher_tokenizer):
    """An imported teacher is shared like a cache: its weights must not come out 0600."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from teacher_cache.gguf_import import write_hf_folder

    config = LlamaConfig(vocab_size=len(teacher_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    old = os.umask(0o027)
    try:
        write_hf_folder(model, teacher_tokenizer, tmp_path / "teacher", source="a test")
    finally:
        os.umask(old)
    assert (tmp_path / "teacher" / "model.safetensors").is_file()
    assert (tmp_path / "teacher").stat().st_mode & 0o777 == 0o750
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "teacher").iterdir()}
    assert set(modes.values()) == {"0o640"}, modes


def test_import_refuses_an_out_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DistillUserError, match="is an existing file"):
        import_gguf(default_teacher_gguf(), tmp_path / "file")


def test_the_real_gguf_passes_the_file_check():
    from teacher_cache.gguf_import import check_gguf_file

    check_gguf_file(default_teacher_gguf())  # a whole file: no error


def test_a_file_that_is_not_gguf_is_one_error_line(tmp_path, capsys):
    from cli_helpers import one_error_line, run_cli

    for name, data in (("notes.gguf", b"hello, this is text\n" * 50), ("empty.gguf", b""),
                       ("model.safetensors", (8).to_bytes(8, "little") + b'{"a": 1}')):
        (tmp_path / name).write_bytes(data)
        code, _, err = run_cli(["import-gguf", tmp_path / name, tmp_path / "out"], capsys)
        line = one_error_line(code, err)
        assert code == 2 and f"{tmp_path / name} is not a GGUF file" in line, line
        assert not (tmp_path / "out").exists()
    (tmp_path / "v99.gguf").write_bytes(b"GGUF" + (99).to_bytes(4, "little") + bytes(64))
    code, _, err = run_cli(["import-gguf", tmp_path / "v99.gguf", tmp_path / "out"], capsys)
    assert "GGUF version the installed gguf package cannot read" in one_error_line(code, err)


def test_a_truncated_gguf_is_one_error_line_wherever_it_ends(tmp_path, capsys):
    """Real cut copies of the default teacher's GGUF: inside the fixed header, the metadata, the
    tensor table, the tensor data and one byte short. Each is one `error:` line naming the file
    (transformers alone raised struct.error or ValueError), and nothing is written."""
    import shutil

    from cli_helpers import one_error_line, run_cli
    from gguf import GGUFReader

    source = default_teacher_gguf()
    size = source.stat().st_size
    first_tensor = min(t.data_offset for t in GGUFReader(source).tensors)
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(source, cut)
    # first_tensor - 64: before the alignment padding (< 32 bytes) that ends the tensor table
    for length in (size - 1, size // 2, first_tensor - 64, 5000, 10):  # shortest last: truncate in place
        os.truncate(cut, length)
        code, _, err = run_cli(["import-gguf", cut, tmp_path / "out"], capsys)
        line = one_error_line(code, err)
        assert code == 2 and f"{cut} is a truncated or damaged GGUF file ({length:,} bytes" in line, (length, line)
        assert not (tmp_path / "out").exists()
