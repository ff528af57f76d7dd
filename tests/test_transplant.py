"""A pruned student for another tokenizer (student/transplant.py): the spelling of each new token
in teacher tokens, the transplanted rows against brute-force means, special tokens by content and
role, tied and untied teachers, the random option, and a student built, trained, resumed and
evaluated through the real entry points. The teacher is the real default tokenizer (tiny random
weights over its vocabulary); the student's tokenizer is a byte-level BPE trained here."""

from __future__ import annotations

import inspect
import json
import shutil
import string
import textwrap
from pathlib import Path

import pytest
import torch

from cli_helpers import one_error_line, run_cli
from distill.configs import ConfigError
from student.model import Student
from student.step import initial_student
from student.train_config import TrainConfig
from student.transplant import fit_vocabulary, spellings, transplanted_rows
from teacher_cache.identity import tokenizer_info
from test_cache_synth import make_corpus, write_cache

# Python source and some accented, CJK and punctuation text, so the vocabulary holds whole
# multi-byte characters and partial ones.
TEXT = "".join(inspect.getsource(m) for m in (textwrap, string)) + (
    "café naïve résumé — déjà vu, über straße, 日本語 テキスト. " * 20)
STUDENT_SPECIALS = ["<|endoftext|>", "<s>", "<pad>", "<extra>"]


@pytest.fixture(scope="module")
def student_tokenizer_dir(tmp_path_factory):
    """A 1500-token byte-level BPE: "<|endoftext|>" (EOS, also the teacher's), "<s>" (BOS), "<pad>"
    (PAD) and "<extra>" (no role, not the teacher's) are its special ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=1500, special_tokens=STUDENT_SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("bpe") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>", pad_token="<pad>",
                            extra_special_tokens=["<extra>"]).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def student_tokenizer(student_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(student_tokenizer_dir)


@pytest.fixture(scope="module")
def spelled(student_tokenizer, teacher_tokenizer):
    return spellings(student_tokenizer, teacher_tokenizer)


@pytest.fixture(scope="module")
def untied_teacher(tmp_path_factory, teacher_tokenizer):
    """tiny_teacher's shape with a separate lm-head."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("untied") / "teacher"
    config = LlamaConfig(vocab_size=len(teacher_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    teacher_tokenizer.save_pretrained(folder)
    return folder


def _id_of_piece(tokenizer, piece: bytes) -> int:
    from teacher_cache.token_bytes import token_pieces

    return token_pieces(tokenizer).pieces.index(piece)


def _teacher_ids(teacher_tokenizer, *tokens: str) -> tuple[int, ...]:
    """Ids of the teacher's tokens as written in its vocabulary ("Ġ" a space, "Ã" the byte 0xC3)."""
    ids = tuple(teacher_tokenizer.convert_tokens_to_ids(list(tokens)))
    assert teacher_tokenizer.unk_token_id not in ids
    return ids


def _brute_force_rows(teacher_rows, student_tokenizer, teacher_tokenizer):
    """Each student id's row, one at a time, spelled through the tokenizers' own decode/encode:
    a token that decodes to text is that text re-encoded by the teacher; a partial character its
    bytes through the teacher's single-byte tokens; special tokens as the module doc says; nothing
    left: the mean of every teacher row."""
    teacher_vocab = teacher_tokenizer.get_vocab()
    special = {0: [teacher_tokenizer.convert_tokens_to_ids("<|endoftext|>")],  # same content
               1: [teacher_tokenizer.bos_token_id], 2: [teacher_tokenizer.pad_token_id],  # by role
               3: []}  # neither
    rows = []
    for i in range(len(student_tokenizer)):
        if i in special:
            ids = special[i]
        else:
            text = student_tokenizer.decode([i])
            if "\ufffd" not in text:
                ids = teacher_tokenizer.encode(text, add_special_tokens=False)
            else:
                # byte-level BPE writes each byte as one character, so the teacher's token of that one
                # character is that byte's; the teacher has none for bytes it never saw (0xC0, 0xFF, ...)
                chars = student_tokenizer.convert_ids_to_tokens(i)
                ids = [teacher_vocab[char] for char in chars if char in teacher_vocab]
        rows.append(teacher_rows[ids].mean(0) if ids else teacher_rows.mean(0))
    return torch.stack(rows)


def _pruned(teacher_dir, tokenizer_dir, embedding_init="transplant"):
    torch.manual_seed(0)
    model = Student.from_teacher_pruned(teacher_dir, 1)
    init = fit_vocabulary(model, teacher_dir, tokenizer_dir, embedding_init)
    return model, init


@pytest.fixture(scope="module")
def pruned(tiny_teacher, untied_teacher, student_tokenizer_dir):
    """{(tied, embedding_init): (student pruned from that teacher for the BPE tokenizer, its init)}:
    each is built once (loading two tokenizers takes a second)."""
    return {(tied, init): _pruned(tiny_teacher if tied else untied_teacher, student_tokenizer_dir, init)
            for tied in (True, False) for init in ("transplant", "random")}


# --- the spelling ----------------------------------------------------------------------------------


def test_hand_checked_tokens_are_spelled_by_the_teacher(student_tokenizer, teacher_tokenizer, spelled):
    cases = {
        b" return": ("Ġreturn",),  # ASCII: one teacher token
        b"\xc3\xa9": ("Ã©",),  # "é", a whole two-byte character
        b"\xc3": ("Ã",),  # its first byte alone: the teacher's single-byte token
        b" na\xc3": ("Ġ", "n", "a", "Ã"),  # ends inside "ï": not text, spelled byte by byte
    }
    for piece, teacher_tokens in cases.items():
        assert spelled[_id_of_piece(student_tokenizer, piece)] == _teacher_ids(teacher_tokenizer, *teacher_tokens), piece
    multi = _id_of_piece(student_tokenizer, b" r\xc3\xa9sum\xc3\xa9")  # " résumé": the teacher's own split
    assert spelled[multi] == tuple(teacher_tokenizer.encode(" résumé", add_special_tokens=False))
    assert len(spelled) == len(student_tokenizer) == 1500


def test_special_tokens_map_by_content_then_role(student_tokenizer, teacher_tokenizer, spelled):
    assert student_tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == STUDENT_SPECIALS
    # the student's EOS is "<|endoftext|>": the teacher's token of that content (its id 0), not its EOS "<|im_end|>"
    assert spelled[0] == (teacher_tokenizer.convert_tokens_to_ids("<|endoftext|>"),) != (teacher_tokenizer.eos_token_id,)
    assert spelled[1] == (teacher_tokenizer.bos_token_id,)  # "<s>": by role, the teacher's BOS "<|im_start|>"
    assert spelled[2] == (teacher_tokenizer.pad_token_id,)  # "<pad>": by role
    assert spelled[3] == ()  # "<extra>": no content or role in common


def test_transplanted_rows_weigh_each_teacher_row_of_a_spelling_equally():
    teacher_rows = torch.arange(12.0).reshape(6, 2)
    rows = transplanted_rows(teacher_rows, [(1,), (2, 4), (), (5, 5, 0)], num_teacher_tokens=4)
    expected = torch.stack([teacher_rows[1], (teacher_rows[2] + teacher_rows[4]) / 2, teacher_rows[:4].mean(0),
                            (2 * teacher_rows[5] + teacher_rows[0]) / 3])
    torch.testing.assert_close(rows, expected)


# --- the embedding and lm-head ---------------------------------------------------------------------


def test_tied_teacher_rows_are_the_brute_force_means_and_stay_tied(tiny_teacher, pruned, student_tokenizer,
                                                                   teacher_tokenizer):
    teacher = Student.from_pretrained(tiny_teacher)
    model, init = pruned[True, "transplant"]
    expected = _brute_force_rows(teacher.embed_tokens.weight.detach(), student_tokenizer, teacher_tokenizer)
    torch.testing.assert_close(model.embed_tokens.weight.detach(), expected)
    assert model.lm_head is None and model.lm_head_weight is model.embed_tokens.weight
    assert model.embed_tokens.weight.requires_grad
    assert model.config.vocab_size == 1500 and model.embed_tokens.num_embeddings == 1500
    assert init == f":tokenizer={tokenizer_info(student_tokenizer)['hash']}:embedding_init=transplant"
    torch.testing.assert_close(model.layers[0].mlp.up_proj.weight, teacher.layers[0].mlp.up_proj.weight)


def test_untied_teacher_gives_lm_head_rows_from_its_lm_head(untied_teacher, pruned, student_tokenizer,
                                                            teacher_tokenizer):
    teacher = Student.from_pretrained(untied_teacher)
    model, _ = pruned[False, "transplant"]
    assert model.lm_head is not None and model.lm_head.weight.shape == (1500, 16)
    for ours, theirs in ((model.embed_tokens.weight, teacher.embed_tokens.weight),
                         (model.lm_head.weight, teacher.lm_head.weight)):
        torch.testing.assert_close(ours.detach(), _brute_force_rows(theirs.detach(), student_tokenizer,
                                                                    teacher_tokenizer))
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


@pytest.mark.parametrize("tied", [True, False])
def test_random_init_draws_new_rows_of_the_new_shape(pruned, tied):
    transplanted, _ = pruned[tied, "transplant"]
    model, init = pruned[tied, "random"]
    assert init.endswith(":embedding_init=random")
    assert model.embed_tokens.weight.shape == transplanted.embed_tokens.weight.shape == (1500, 16)
    assert not torch.allclose(model.embed_tokens.weight, transplanted.embed_tokens.weight)
    assert abs(model.embed_tokens.weight.std().item() - 0.02) < 0.002  # the model's own init
    assert model.config == transplanted.config
    assert (model.lm_head is None) == tied
    if not tied:
        assert model.lm_head.weight.shape == (1500, 16)
        assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_the_teachers_own_tokenizer_keeps_the_pruned_teacher(tiny_teacher, tmp_path, teacher_tokenizer):
    copy = tmp_path / "teacher-tokenizer"
    teacher_tokenizer.save_pretrained(copy)  # another folder, the same tokenizer (same hash)
    pruned = Student.from_teacher_pruned(tiny_teacher, 1)
    for tokenizer_dir in (None, tiny_teacher, copy):
        model, init = _pruned(tiny_teacher, tokenizer_dir)
        assert init == "" and model.config == pruned.config
        assert torch.equal(model.embed_tokens.weight, pruned.embed_tokens.weight)
    model, init = _pruned(tiny_teacher, copy, "random")
    assert init == ":embedding_init=random" and model.config == pruned.config
    assert not torch.equal(model.embed_tokens.weight, pruned.embed_tokens.weight)


# --- through initial_student, the trainer and eval -------------------------------------------------


def test_initial_student_has_the_new_vocabulary_and_saves_and_loads(tiny_teacher, student_tokenizer_dir,
                                                                    student_tokenizer, tmp_path):
    config = TrainConfig(cache="unused", out=str(tmp_path / "run"), teacher=str(tiny_teacher), num_layers=1,
                         tokenizer=str(student_tokenizer_dir))
    model, identity = initial_student(config, "cpu")
    assert identity["init"] == (f"teacher:{tiny_teacher}:num_layers=1:tokenizer="
                                f"{tokenizer_info(student_tokenizer)['hash']}:embedding_init=transplant")
    hf = identity["config"]
    assert hf["vocab_size"] == len(student_tokenizer) == 1500
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (1, 0, 2)
    assert "unk_token_id" not in hf  # the teacher's UNK id means nothing to this tokenizer, which has none
    _, again = initial_student(config, "cpu")
    assert again == identity  # a resume rebuilds the same student identity
    model.save_pretrained(tmp_path / "student")
    saved = json.loads((tmp_path / "student" / "config.json").read_text())
    assert saved["vocab_size"] == 1500 and saved["eos_token_id"] == 0 and saved["bos_token_id"] == 1
    loaded = Student.from_pretrained(tmp_path / "student")
    assert loaded.config == model.config
    torch.testing.assert_close(loaded.embed_tokens.weight, model.embed_tokens.weight)
    ids = torch.tensor([student_tokenizer.encode("def café(x):\n    return x")])
    torch.testing.assert_close(loaded.logits(loaded(ids)), model.logits(model(ids)))


def test_a_transplanted_student_trains_resumes_and_evaluates(tiny_teacher, student_tokenizer_dir,
                                                              student_tokenizer, tmp_path, capsys):
    from student.trainer import train

    vocab = len(student_tokenizer)
    corpus = make_corpus(num_seqs=12, seq_len=16, k=8, vocab=vocab, seed=2)
    write_cache(tmp_path / "cache", corpus, vocab=vocab, tokenizer__hash=tokenizer_info(student_tokenizer)["hash"],
                shard_size=4, fmt="parquet", seq_len=16)
    flat = dict(cache=str(tmp_path / "cache"), out=str(tmp_path / "run"), teacher=str(tiny_teacher), num_layers=1,
                tokenizer=str(student_tokenizer_dir), steps=2, batch_size=2, heldout=2, eval_every=0, save_every=1,
                device="cpu", deterministic=True)
    report = train(TrainConfig.from_flat(**flat), progress=False)
    student = Student.from_pretrained(report.student_dir)
    assert student.config.vocab_size == vocab and student.config.extra["eos_token_id"] == 0
    assert (Path(report.student_dir) / "tokenizer.json").exists()
    resumed = train(TrainConfig.from_flat(**{**flat, "steps": 3}), progress=False)
    assert resumed.resumed_from == 2 and resumed.steps == 3
    code, out, err = run_cli(["eval", tmp_path / "run", "--json", "-q"], capsys)
    assert code == 0, err
    assert json.dumps(json.loads(out))  # a result came back for the transplanted student


# --- errors a user can cause -----------------------------------------------------------------------


def test_a_tokenizer_folder_without_a_tokenizer_is_one_error_naming_the_option(tiny_teacher, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a tokenizer")
    for folder, problem in ((tmp_path / "junk", "holds no tokenizer"), (tmp_path / "missing", "not a folder")):
        with pytest.raises(ConfigError, match=problem) as caught:
            _pruned(tiny_teacher, folder)
        assert str(caught.value.as_option()).startswith(f"--tokenizer is '{folder}'")


def test_embedding_init_is_refused_with_a_student_folder(tmp_path, capsys):
    with pytest.raises(ConfigError, match="applies only to a student pruned from the teacher") as caught:
        TrainConfig(cache="c", out="o", student="s", embedding_init="random")
    assert caught.value.field == "embedding_init"
    TrainConfig(cache="c", out="o", student="s")  # the default says nothing
    code, _, err = run_cli(["train-student", "--cache", tmp_path / "c", "--out", tmp_path / "o", "--student",
                            tmp_path / "s", "--embedding-init", "random"], capsys)
    assert one_error_line(code, err).startswith("error: --embedding-init is 'random', but it applies only")


def test_a_student_with_fewer_rows_than_its_tokenizer_is_refused_before_training(student_tokenizer_dir,
                                                                                 student_tokenizer, tmp_path, capsys):
    from student.config import StudentConfig

    folder = tmp_path / "small"
    config = StudentConfig(model_type="llama", vocab_size=1000, hidden_size=16, intermediate_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, head_dim=8)
    Student(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(student_tokenizer_dir / name, folder / name)
    corpus = make_corpus(num_seqs=6, seq_len=8, vocab=1000, seed=3)
    write_cache(tmp_path / "cache", corpus, vocab=len(student_tokenizer),
                tokenizer__hash=tokenizer_info(student_tokenizer)["hash"], shard_size=2, fmt="parquet", seq_len=8)
    code, _, err = run_cli(["train-student", "--cache", tmp_path / "cache", "--out", tmp_path / "run", "--student",
                            folder, "--heldout", "2", "--device", "cpu", "-q"], capsys)
    assert "vocab size 1000 is smaller than its tokenizer's 1500" in one_error_line(code, err)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
