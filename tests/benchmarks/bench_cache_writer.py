"""Where a shard's writer time goes, and the tail: from the last row handed over to the shard final.

CPU only. Rows: the default teacher (SmolLM2-135M-Instruct, fp32, hf backend) over standard-library
text, --teacher-seqs sequences of --teacher-len tokens, kept in an .npz (a second run skips the
teacher); a shard of --seqs x --seq-len rows replays them in order, cycled (the real ids and
values, the real token ids beside them). Each case writes that shard through
``CacheWriter.write_shard`` (the path a build takes) with the rows handed over one sequence a
block, as fast as the writer takes them, and reports:

- shard_s: write_shard from first block to return (encode, store, fsync, rename, checksum);
- tail_s: from the writer taking the last block to write_shard returning: what a build waits for
  after its teacher's last batch when that batch ends a shard;
- encode_s, store_s, checksum_s: the stages alone, on the same rows: codec and fixed arrays
  (``encode_blocks``, one thread), the store's ``write_stream`` of encoded rows (Arrow or Zarr
  encoding, compression, fsync, rename), and the shard checksum (read back, sha256).

Before timing, the shard read back must equal the rows written (decoded by the codec). Medians of
--repeats. One row per storage, `cache_writer/<storage>-<codec>/S<seqs>xL<seq_len>`.

    python tests/benchmarks/bench_cache_writer.py                       # parquet and zarr, 64 x 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import OUTPUT_DIR, Results, add_results_arg

DEFAULT_ROWS = OUTPUT_DIR / "cache_writer_rows_smollm2.npz"


def make_rows(path: Path, num_sequences: int, seq_len: int, k: int) -> None:
    """Score standard-library text with the default teacher and save its targets, one row a position."""
    from bench_teacher_cpu import stdlib_sequences
    from transformers import AutoTokenizer

    from pipelines.defaults import default_teacher_dir
    from teacher_cache.backends import make_backend

    teacher = default_teacher_dir()
    sequences = stdlib_sequences(AutoTokenizer.from_pretrained(teacher), num_sequences, seq_len)
    backend = make_backend("hf", teacher, dtype="float32", device="cpu", k=k, max_len=seq_len,
                           batch_size=num_sequences)
    try:
        out = backend.score(sequences, k)
    finally:
        backend.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, ids=np.stack(sequences), topk_ids=np.stack([t.topk_ids for t in out]),
             topk_logprobs=np.stack([t.topk_logprobs for t in out]), tail=np.stack([t.tail_logmass for t in out]),
             target=np.stack([t.target_logprob for t in out]))


def replay_shard(rows: dict, num_sequences: int, seq_len: int):
    """(input ids [seq_len] per sequence, TeacherTargets [seq_len] per sequence): the recorded
    positions in order, cycled."""
    from teacher_cache.targets import TeacherTargets

    flat = {name: value.reshape(-1, *value.shape[2:]) for name, value in rows.items()}
    total = len(flat["ids"])
    ids, blocks = [], []
    for s in range(num_sequences):
        pos = (np.arange(seq_len) + s * seq_len) % total
        ids.append(flat["ids"][pos].astype(np.int32))
        blocks.append(TeacherTargets(flat["topk_ids"][pos], flat["topk_logprobs"][pos], flat["tail"][pos],
                                     flat["target"][pos]))
    return ids, blocks


def spec(num_sequences: int, seq_len: int, k: int, codec: str, storage: str) -> dict:
    return {"teacher": {"path": "bench", "weights_hash": "replay", "backend": "hf", "dtype": "float32"},
            "tokenizer": {"hash": "replay", "vocab_size": 49152},
            "data": {"source": "bench", "fingerprint": "replay", "seq_len": seq_len, "sequences": num_sequences,
                     "tokens": num_sequences * seq_len},
            "targets": {"k": k, "value_codec": codec, "temperature": 1.0},
            "storage": {"format": storage, "shard_size": num_sequences}}


def write_once(folder: Path, ids, blocks, cache_spec: dict) -> tuple[float, float, Path]:
    """(shard_s, tail_s, shard path) of one write_shard of a fresh cache in ``folder``."""
    from teacher_cache.writer import CacheWriter

    last = [0.0]

    def feed():
        for block in blocks:
            yield block
        last[0] = time.perf_counter()  # the writer asked past the last block: it holds every row

    with CacheWriter(folder, cache_spec) as writer:
        start = time.perf_counter()
        info = writer.write_shard(0, ids, feed())
        end = time.perf_counter()
    return end - start, end - last[0], folder / "shards" / info.name


def check_shard(path: Path, storage: str, codec_name: str, ids, blocks) -> None:
    from teacher_cache.codecs import get_codec
    from teacher_cache.store import decode_shard, get_store, read_shard
    from teacher_cache.targets import TeacherTargets

    codec = get_codec(codec_name)
    input_ids, _, targets = decode_shard(read_shard(get_store(storage), path, path.name), codec, path.name)
    whole = TeacherTargets.concat(blocks)
    want_ids, want_logprobs = codec.decode(codec.encode(whole.topk_ids, whole.topk_logprobs))
    assert np.array_equal(input_ids, np.concatenate(ids)), "input ids differ"
    assert np.array_equal(targets.topk_ids, want_ids) and np.array_equal(targets.topk_logprobs, want_logprobs)
    assert np.array_equal(targets.tail_logmass, whole.tail_logmass)


def stages(folder: Path, ids, blocks, storage: str, codec_name: str) -> dict:
    from teacher_cache.codecs import get_codec
    from teacher_cache.store import encode_blocks, get_store, shard_checksum, shard_offsets

    seq_offsets, all_ids = shard_offsets(ids)
    t0 = time.perf_counter()
    encoded = list(encode_blocks(all_ids, blocks, get_codec(codec_name)))
    t1 = time.perf_counter()
    path = folder / f"stage{get_store(storage).suffix}"
    get_store(storage).write_stream(path, seq_offsets, iter(encoded))
    t2 = time.perf_counter()
    shard_checksum(path)
    t3 = time.perf_counter()
    return {"encode_s": t1 - t0, "store_s": t2 - t1, "checksum_s": t3 - t2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=Path, default=DEFAULT_ROWS, help="teacher rows .npz (made if missing)")
    parser.add_argument("--teacher-seqs", type=int, default=8, help="sequences the teacher scores when making --rows")
    parser.add_argument("--teacher-len", type=int, default=512, help="their length in tokens")
    parser.add_argument("--seqs", type=int, default=64, help="sequences in the shard (the default --shard-size)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens a sequence (bench_teacher_gpu.py's)")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--codec", default="sqrt8")
    parser.add_argument("--storage", default="parquet,zarr", help="comma-separated stores to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tmp", type=Path, default=None, help="folder for the shards (default: the system's)")
    add_results_arg(parser)
    args = parser.parse_args()

    if not args.rows.exists():
        make_rows(args.rows, args.teacher_seqs, args.teacher_len, args.k)
    with np.load(args.rows) as f:
        rows = {name: f[name] for name in f.files}
    ids, blocks = replay_shard(rows, args.seqs, args.seq_len)
    results = Results(bench="cache_writer", path=args.results)
    for storage in args.storage.split(","):
        cache_spec = spec(args.seqs, args.seq_len, args.k, args.codec, storage)
        shard, tail, parts = [], [], []
        with tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench_cache_writer_") as tmp:
            for r in range(args.repeats + 1):  # the first is the warm-up and the check
                s, t, path = write_once(Path(tmp) / f"c{r}", ids, blocks, cache_spec)
                if r == 0:
                    check_shard(path, storage, args.codec, ids, blocks)
                    continue
                shard.append(s)
                tail.append(t)
                parts.append(stages(Path(tmp) / f"c{r}", ids, blocks, storage, args.codec))
        tokens = args.seqs * args.seq_len
        figures = {"shard_s": statistics.median(shard), "tail_s": statistics.median(tail),
                   **{key: statistics.median(p[key] for p in parts) for key in parts[0]},
                   "tok_s": tokens / statistics.median(shard), "repeats": args.repeats}
        results.add(f"{storage}-{args.codec}/S{args.seqs}xL{args.seq_len}", figures,
                    {"tokens": tokens, "k": args.k, "rows": args.rows.name, "cpus": os.cpu_count(),
                     "note": "CPU figures; shard written by CacheWriter.write_shard, rows replayed from a real teacher"})


if __name__ == "__main__":
    main()
