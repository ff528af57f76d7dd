"""Corpus preparation: every input format, the packing rule, determinism, early stop, and the
errors a user can cause. Uses the real teacher tokenizer and real stdlib files."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest

import pipelines.corpus as corpus_module
from pipelines.corpus import CorpusConfig, PackedCorpus, fingerprint_sequences, prepare_corpus
from pipelines.defaults import default_corpus_dir
from distill.errors import DistillUserError

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé prose, with a tab\tand two\n\nparagraphs.",
    "print('third')",
]
STDLIB = default_corpus_dir()


def ids_of(tokenizer, text: str) -> list[int]:
    """The reference: the tokenizer's own __call__, without special tokens."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def joined(tokenizer, texts: list[str], eos: bool = True) -> list[int]:
    stream: list[int] = []
    for i, text in enumerate(texts):
        if i and eos:
            stream.append(tokenizer.eos_token_id)
        stream.extend(ids_of(tokenizer, text))
    return stream


def stream_of(corpus: PackedCorpus) -> list[int]:
    return np.concatenate(corpus.sequences).tolist()


def prepare(tokenizer, paths, **kwargs) -> PackedCorpus:
    kwargs.setdefault("seq_len", 4096)
    return prepare_corpus(CorpusConfig(paths=paths, **kwargs), tokenizer, progress=False)


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# --- one writer per format: each writes DOCS (plus a null row where the format has rows) ---


def write_txt(folder: Path) -> tuple[Path, list[str]]:
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    return folder / "doc1.txt", [DOCS[1]]


def write_text_folder(folder: Path) -> tuple[Path, list[str]]:
    root = folder / "code"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "z.py").write_text(DOCS[2], encoding="utf-8")
    (root / "pkg" / "a.py").write_text(DOCS[1], encoding="utf-8")
    (root / "a.py").write_text(DOCS[0], encoding="utf-8")
    (root / "pkg" / "__init__.py").write_text("", encoding="utf-8")  # empty: skipped
    (root / "notes.txt").write_text("not matched by *.py", encoding="utf-8")
    (root / "pkg" / "__pycache__" / "x.py").write_text("excluded", encoding="utf-8")
    (root / "site-packages" / "y.py").write_text("excluded", encoding="utf-8")
    return root, DOCS  # sorted by relative path: a.py, pkg/a.py, z.py (not walk order)


def write_json(folder: Path) -> tuple[Path, list[str]]:
    path = folder / "docs.json"
    path.write_text(json.dumps([{"text": d, "id": i} for i, d in enumerate(DOCS)]), encoding="utf-8")
    return path, DOCS


def write_jsonl(folder: Path) -> tuple[Path, list[str]]:
    path = folder / "docs.jsonl"
    rows = [{"text": DOCS[0]}, {"text": None}, {"text": DOCS[1]}, {"text": DOCS[2]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path, DOCS


def _table():
    import pyarrow as pa

    return pa.table({"id": [0, 1, 2, 3], "body": [DOCS[0], DOCS[1], None, DOCS[2]]})


def write_parquet(folder: Path) -> tuple[Path, list[str]]:
    import pyarrow.parquet as pq

    path = folder / "docs.parquet"
    pq.write_table(_table(), path)
    return path, DOCS


def write_arrow(folder: Path) -> tuple[Path, list[str]]:
    import pyarrow as pa

    path = folder / "docs.arrow"
    table = _table()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path, DOCS


def write_hf_dataset(folder: Path) -> tuple[Path, list[str]]:
    import datasets

    path = folder / "saved"
    datasets.Dataset.from_dict({"body": DOCS, "n": [1, 2, 3]}).save_to_disk(str(path))
    return path, DOCS


def write_hf_dataset_dict(folder: Path) -> tuple[Path, list[str]]:
    import datasets

    path = folder / "saved_dict"
    train = datasets.Dataset.from_dict({"text": DOCS[:2]})
    test = datasets.Dataset.from_dict({"text": ["held out, never read"]})
    datasets.DatasetDict({"test": test, "train": train}).save_to_disk(str(path))
    return path, DOCS[:2]


FORMAT_CASES = [
    ("text", write_txt, {}),
    ("text", write_text_folder, {}),
    ("json", write_json, {}),
    ("jsonl", write_jsonl, {}),
    ("parquet", write_parquet, {"text_field": "body"}),
    ("arrow", write_arrow, {"text_field": "body"}),
    ("hf-dataset", write_hf_dataset, {"text_field": "body"}),
    ("hf-dataset", write_hf_dataset_dict, {}),
]


@pytest.mark.parametrize("detect", ["explicit", "auto"])
@pytest.mark.parametrize(
    "fmt,writer,kwargs", FORMAT_CASES, ids=[w.__name__[6:] for _, w, _ in FORMAT_CASES]
)
def test_each_format_gives_the_tokenizers_tokens(
    tmp_path, teacher_tokenizer, fmt, writer, kwargs, detect
):
    path, texts = writer(tmp_path)
    before = tree(tmp_path)
    corpus = prepare(
        teacher_tokenizer, [path], format=fmt if detect == "explicit" else "auto", **kwargs
    )
    assert stream_of(corpus) == joined(teacher_tokenizer, texts)
    assert corpus.num_documents == len(texts)
    assert corpus.num_tokens == len(stream_of(corpus))
    assert all(s.dtype == np.int32 for s in corpus.sequences)
    assert str(path) in corpus.source
    assert tree(tmp_path) == before, "reading must not write cache files beside the input"


def test_paths_read_in_order_and_formats_mixed(tmp_path, teacher_tokenizer):
    jsonl, _ = write_jsonl(tmp_path)
    (tmp_path / "last.txt").write_text("the end", encoding="utf-8")
    corpus = prepare(teacher_tokenizer, [tmp_path / "last.txt", jsonl, STDLIB / "this.py"])
    texts = ["the end", *DOCS, (STDLIB / "this.py").read_text(encoding="utf-8")]
    assert stream_of(corpus) == joined(teacher_tokenizer, texts)
    assert corpus.num_documents == 5


def test_real_stdlib_folder_matches_per_file_tokenisation(teacher_tokenizer):
    folder = STDLIB / "json"
    files = sorted(folder.rglob("*.py"), key=lambda p: p.relative_to(folder).as_posix())
    texts = [f.read_text(encoding="utf-8") for f in files]
    texts = [t for t in texts if t]
    corpus = prepare(teacher_tokenizer, folder, seq_len=1000)
    expected = joined(teacher_tokenizer, texts)
    assert stream_of(corpus) == expected[: len(stream_of(corpus))]
    assert len(expected) - corpus.num_tokens in (0, 1)  # a 1-token remainder is dropped
    assert corpus.num_documents == len(texts)


def test_folder_name_with_glob_characters(tmp_path, teacher_tokenizer):
    folder = tmp_path / "odd [name]"
    folder.mkdir()
    (folder / "a[1].py").write_text(DOCS[0], encoding="utf-8")
    corpus = prepare(teacher_tokenizer, folder)
    assert stream_of(corpus) == ids_of(teacher_tokenizer, DOCS[0])


# --- packing ---


def _three_docs(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    return path


def test_packing_cuts_the_eos_joined_stream(tmp_path, teacher_tokenizer):
    path = _three_docs(tmp_path)
    stream = joined(teacher_tokenizer, DOCS)
    eos = teacher_tokenizer.eos_token_id
    lengths = [len(ids_of(teacher_tokenizer, d)) for d in DOCS]
    assert [i for i, t in enumerate(stream) if t == eos] == [lengths[0], lengths[0] + 1 + lengths[1]]
    n = len(stream)
    for seq_len, kept in [(n, n), (n - 1, n - 1), (n - 2, n), (7, n - n % 7 if n % 7 == 1 else n)]:
        corpus = prepare(teacher_tokenizer, path, seq_len=seq_len)
        assert [len(s) for s in corpus.sequences[:-1]] == [seq_len] * (len(corpus.sequences) - 1)
        assert 2 <= len(corpus.sequences[-1]) <= seq_len
        assert stream_of(corpus) == stream[:kept], f"seq_len={seq_len}"
        assert corpus.seq_offsets().tolist() == [0, *np.cumsum([len(s) for s in corpus.sequences])]


def test_without_eos_documents_are_concatenated(tmp_path, teacher_tokenizer):
    corpus = prepare(teacher_tokenizer, _three_docs(tmp_path), add_eos=False)
    assert stream_of(corpus) == joined(teacher_tokenizer, DOCS, eos=False)
    assert teacher_tokenizer.eos_token_id not in stream_of(corpus)


def test_too_little_text_is_an_error_but_two_tokens_pack(tmp_path, teacher_tokenizer):
    one = tmp_path / "one.txt"
    one.write_text("a", encoding="utf-8")
    assert len(ids_of(teacher_tokenizer, "a")) == 1
    with pytest.raises(DistillUserError, match="tokenises to 1 token"):
        prepare(teacher_tokenizer, one)
    (tmp_path / "two.txt").write_text("b", encoding="utf-8")
    corpus = prepare(teacher_tokenizer, [one, tmp_path / "two.txt"], seq_len=2)
    assert stream_of(corpus) == ids_of(teacher_tokenizer, "a") + [teacher_tokenizer.eos_token_id]
    assert corpus.num_documents == 1  # "b" did not fit in the one full sequence


# --- determinism, fingerprint, early stop ---


def test_same_input_same_sequences_and_fingerprint(teacher_tokenizer):
    config = CorpusConfig(paths=[STDLIB / "json", STDLIB / "email"], seq_len=128, max_sequences=40)
    first = prepare_corpus(config, teacher_tokenizer, progress=False)
    second = prepare_corpus(config, teacher_tokenizer, progress=False)
    assert first.num_sequences == 40
    assert all(np.array_equal(a, b) for a, b in zip(first.sequences, second.sequences))
    assert first.fingerprint == second.fingerprint == fingerprint_sequences(second.sequences)
    changed = [
        CorpusConfig(paths=config.paths, seq_len=129, max_sequences=40),
        CorpusConfig(paths=config.paths, seq_len=128, max_sequences=39),
        CorpusConfig(paths=config.paths, seq_len=128, max_sequences=40, add_eos=False),
        CorpusConfig(paths=config.paths[::-1], seq_len=128, max_sequences=40),
    ]
    fingerprints = {prepare_corpus(c, teacher_tokenizer, progress=False).fingerprint for c in changed}
    assert len(fingerprints) == len(changed) and first.fingerprint not in fingerprints


def test_fingerprint_sees_boundaries_not_only_tokens():
    ids = np.arange(6, dtype=np.int32)
    assert fingerprint_sequences([ids[:3], ids[3:]]) != fingerprint_sequences([ids[:2], ids[2:]])
    assert fingerprint_sequences([ids]) == fingerprint_sequences([ids.astype(np.int64)])


def test_max_sequences_stops_reading_early(monkeypatch, teacher_tokenizer):
    tokenised: list[int] = []  # characters per tokenised batch
    real_encoder = corpus_module._batch_encoder

    def counting_encoder(tokenizer):
        encode = real_encoder(tokenizer)

        def wrapped(texts):
            tokenised.append(sum(map(len, texts)))
            return encode(texts)

        return wrapped

    monkeypatch.setattr(corpus_module, "_batch_encoder", counting_encoder)
    corpus = prepare(teacher_tokenizer, STDLIB, seq_len=256, max_sequences=8)
    assert corpus.num_sequences == 8 and corpus.num_tokens == 8 * 256
    # 2,048 tokens are about 8,000 characters; the stdlib is about 30 million
    assert sum(tokenised) < 100_000, f"tokenised {sum(tokenised):,} characters for 2,048 tokens"
    assert corpus.num_documents >= 1


def test_max_sequences_is_a_prefix_of_the_whole_corpus(teacher_tokenizer):
    whole = prepare(teacher_tokenizer, STDLIB / "json", seq_len=64)
    head = prepare(teacher_tokenizer, STDLIB / "json", seq_len=64, max_sequences=5)
    assert head.num_sequences == 5 < whole.num_sequences
    assert all(np.array_equal(a, b) for a, b in zip(head.sequences, whole.sequences))
    assert head.num_documents <= whole.num_documents


def test_progress_bar_reports_tokens_per_second(tmp_path, teacher_tokenizer, capsys):
    path = _three_docs(tmp_path)
    prepare_corpus(CorpusConfig(paths=path, seq_len=8), teacher_tokenizer, progress=False)
    assert "tok" not in capsys.readouterr().err
    prepare_corpus(CorpusConfig(paths=path, seq_len=8), teacher_tokenizer, progress=True)
    assert "tok/s" in capsys.readouterr().err


def test_no_network_is_touched(tmp_path, teacher_tokenizer, monkeypatch):
    import datasets.config

    def refuse(*args, **kwargs):
        raise AssertionError("corpus preparation tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    offline_before = datasets.config.HF_HUB_OFFLINE
    path, texts = write_jsonl(tmp_path)
    assert stream_of(prepare(teacher_tokenizer, path)) == joined(teacher_tokenizer, texts)
    assert datasets.config.HF_HUB_OFFLINE == offline_before


# --- user errors: one line, the value seen, what to do ---


def _raises(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(DistillUserError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"format": "csv"}, "`format` must be one of .* got 'csv'"),
        ({"seq_len": 1}, "`seq_len` must be an integer >= 2.* got 1"),
        ({"seq_len": "8"}, "`seq_len` must be an integer, got '8'"),
        ({"max_sequences": 0}, r"`max_sequences` must be a positive integer, or leave it out \(the whole corpus\), "
                               "got 0"),
        ({"paths": []}, "`paths` is empty"),
        ({"text_field": ""}, "`text_field` must be a non-empty string"),
        ({"encoding_errors": "surrogate"}, "`encoding_errors` must be one of"),
        ({"add_eos": "yes"}, "`add_eos` must be true or false, got 'yes'"),
    ],
)
def test_invalid_config_values(kwargs, match):
    from distill.configs import ConfigError

    message = _raises(match, CorpusConfig, **kwargs)
    with pytest.raises(ConfigError) as info:  # so the CLI can name its option, a recipe its key
        CorpusConfig(**kwargs)
    assert info.value.field in message


def test_missing_path(tmp_path, teacher_tokenizer):
    message = _raises("does not exist", prepare, teacher_tokenizer, tmp_path / "nope.jsonl")
    assert "nope.jsonl" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_path(tmp_path, teacher_tokenizer):
    path, _ = write_jsonl(tmp_path)
    path.chmod(0)
    _raises("not readable", prepare, teacher_tokenizer, path)


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("broken.json", '{"text": "x",', r"read corpus .*broken.json \(json\): JSON parse"),
        ("junk.parquet", "not parquet", r"read corpus .*junk.parquet \(parquet\): .*magic"),
    ],
)
def test_undecodable_files(tmp_path, teacher_tokenizer, name, content, match):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    _raises(match, prepare, teacher_tokenizer, path)


def test_text_that_is_not_utf8(tmp_path, teacher_tokenizer):
    path = tmp_path / "latin.txt"
    path.write_bytes(b"caf\xe9")
    match = r"read corpus .*latin.txt \(text\): .*decode byte 0xe9"
    _raises(match, prepare, teacher_tokenizer, path, encoding_errors="strict")
    corpus = prepare(teacher_tokenizer, path, encoding_errors="replace")
    assert stream_of(corpus) == ids_of(teacher_tokenizer, "caf\ufffd")
    _raises("1 file.* skipped as not UTF-8 text", prepare, teacher_tokenizer, path)  # "skip" by default


def test_binary_files_are_skipped_and_counted_never_scored(tmp_path, teacher_tokenizer, caplog):
    """--glob '*' over a folder with images and archives: only the text is tokenised."""
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (tmp_path / "c.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(200))
    (tmp_path / "d.py").write_text(DOCS[2], encoding="utf-8")
    for encoding_errors in ("skip", "replace", "ignore"):  # a NUL byte means binary whatever the setting
        with caplog.at_level("WARNING", logger="pipelines.corpus"):
            corpus = prepare(teacher_tokenizer, tmp_path, file_glob="*", encoding_errors=encoding_errors)
        assert stream_of(corpus) == joined(teacher_tokenizer, [DOCS[0], DOCS[2]])
        assert [p.name for p in corpus.skipped_files] == ["b.png", "c.gz"]
        assert "2 file(s) skipped as not UTF-8 text" in caplog.text
        assert "pass --encoding-errors strict (in a recipe: [corpus] encoding_errors = \"strict\")" in caplog.text
    _raises(r"read corpus .*b.png \(text\): it holds NUL bytes", prepare, teacher_tokenizer, tmp_path,
            file_glob="*", encoding_errors="strict")


def test_text_files_keep_universal_newlines(tmp_path, teacher_tokenizer):
    (tmp_path / "crlf.txt").write_bytes("line one\r\nline two\rline three\n\ufeffbom".encode())
    corpus = prepare(teacher_tokenizer, tmp_path / "crlf.txt")
    assert stream_of(corpus) == ids_of(teacher_tokenizer, "line one\nline two\nline three\n\ufeffbom")


def test_empty_corpus(tmp_path, teacher_tokenizer):
    (tmp_path / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "empty.py").write_text("", encoding="utf-8")
    _raises("no non-empty documents", prepare, teacher_tokenizer, tmp_path)
    (tmp_path / "nulls.jsonl").write_text('{"text": null}\n', encoding="utf-8")
    _raises("no non-empty documents", prepare, teacher_tokenizer, tmp_path / "nulls.jsonl")


def test_folder_without_matching_files(tmp_path, teacher_tokenizer):
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    message = _raises("`file_glob` '\\*.py' matches no files", prepare, teacher_tokenizer, tmp_path)
    assert str(tmp_path) in message


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet, write_arrow, write_hf_dataset])
def test_missing_text_field(tmp_path, teacher_tokenizer, writer):
    path, _ = writer(tmp_path)
    message = _raises(
        "`text_field` 'content' is not a column", prepare, teacher_tokenizer, path, text_field="content"
    )
    assert "columns:" in message


def test_text_field_that_is_not_text(tmp_path, teacher_tokenizer):
    path, _ = write_parquet(tmp_path)
    _raises("holds int values, not strings", prepare, teacher_tokenizer, path, text_field="id")


def test_hf_dataset_format_needs_a_saved_dataset(tmp_path, teacher_tokenizer):
    write_txt(tmp_path)
    match = "needs a folder written by datasets' save_to_disk"
    _raises(match, prepare, teacher_tokenizer, tmp_path, format="hf-dataset")


def test_tokenizer_without_eos(tmp_path, teacher_tokenizer):
    class NoEos:
        eos_token_id = None
        name_or_path = "no-eos-tokenizer"

    path = _three_docs(tmp_path)
    _raises("no-eos-tokenizer has no EOS token", prepare, NoEos(), path)
    corpus = prepare_corpus(CorpusConfig(paths=path, add_eos=False), teacher_tokenizer, progress=False)
    assert corpus.num_documents == 3
