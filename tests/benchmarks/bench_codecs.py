"""Bytes per token and distortion of every value codec, on real teacher top-k targets.

Data: the default teacher (SmolLM2-135M-Instruct in fp32: bf16 matmuls are emulated, and much
slower, on a CPU without AVX-512) through plain transformers over the first standard-library .py files (sorted by path),
cut into 512-token sequences; exact top-k of the fp32 log-softmax over the full vocabulary. The
arrays are cached in an .npz, so a second run skips the teacher. ``--vocab V`` remaps the ids into
a larger vocabulary (see ``remap_vocab``) to check large-vocabulary sizes.

Bytes per position, top-k part only (the codec's arrays): "zstd3 ref" compresses each array as a
Zarr array with numcodecs Shuffle (multi-byte dtypes) + Zstd level 3 would, per --chunk-rows
chunk; "zarr store" and "parquet store" are the bytes on disk when the project's own stores write
those arrays as one shard; "whole zarr shard" adds the fixed arrays (input_ids, seq_offsets,
tail_logmass, target_logprob).

Distortion: per position, KL(exact || decoded) in nats over k + 1 categories, the top-k entries
(matched by id) plus one tail bucket (``teacher_cache.codecs.codec_kl``): exact p_i =
exp(topk_logprobs_i) and tail t = max(1 - sum(p), 0); decoded q_i = exp(decoded logprob_i) with
the same tail t (the cache stores tail_logmass in float32); each side renormalised to sum to one.
Mean, 99.9th percentile and max over positions.

Before timing, each codec's round trip is checked: every row decodes to the same set of ids, in
descending decoded probability, and each value within the codec's rounding (fp32 exact, bf16 and
fp16 to half a unit in the last place, sqrtN to half a step of its sqrt(p) grid). One row a
codec, `codecs/V<vocab>[-<remap>]/<codec>`, goes to --results.

    python tests/benchmarks/bench_codecs.py                 # real data, k=100
    python tests/benchmarks/bench_codecs.py --vocab 151936  # ids remapped into a larger vocabulary
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import numpy as np
from harness import OUTPUT_DIR, Results, add_results_arg, check_close, time_cpu

DEFAULT_DATA = OUTPUT_DIR / "codecs_topk_smollm2.npz"
# Rounding of the float codecs' log-probabilities, (atol, rtol): half a unit in the last place,
# relative to the value (fp16 also half its smallest subnormal, for log-probs next to 0).
FLOAT_TOL = {"fp32": (0.0, 0.0), "bf16": (0.0, 2.0**-8), "fp16": (2.0**-25, 2.0**-11)}


def make_real_topk(path: Path, num_tokens: int, seq_len: int, k: int) -> None:
    """Run the default teacher over stdlib text and save exact top-k ids and log-probs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.defaults import default_teacher_dir

    teacher = default_teacher_dir()
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tokens: list[int] = []
    for f in files:
        tokens += tokenizer(f.read_text(encoding="utf-8", errors="replace"))["input_ids"]
        if len(tokens) >= num_tokens:
            break
    num_seqs = num_tokens // seq_len
    seqs = torch.tensor(tokens[: num_seqs * seq_len]).view(num_seqs, seq_len)
    ids_out, lp_out, target_out = [], [], []
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in seqs.split(4):
            logprobs = torch.log_softmax(model(batch).logits.float(), dim=-1)
            values, ids = logprobs.topk(k, dim=-1)
            target = torch.full(batch.shape, float("nan"))
            target[:, :-1] = logprobs[:, :-1].gather(-1, batch[:, 1:, None])[..., 0]
            ids_out.append(ids.reshape(-1, k).int().numpy())
            lp_out.append(values.reshape(-1, k).numpy())
            target_out.append(target.reshape(-1).numpy())
            print(f"  {len(ids_out)}/{len(seqs) // 4} batches, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"teacher: {num_seqs * seq_len} tokens in {time.perf_counter() - start:.0f} s")
    np.savez(path, topk_ids=np.concatenate(ids_out), topk_logprobs=np.concatenate(lp_out),
             target_logprob=np.concatenate(target_out), input_ids=seqs.reshape(-1).int().numpy(),
             seq_len=seq_len, vocab_size=model.config.vocab_size)


def versions() -> dict:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("numpy", "numcodecs", "zarr", "pyarrow")}


def remap_vocab(topk_ids: np.ndarray, vocab_size: int, new_vocab: int, mode: str) -> np.ndarray:
    """Spread ids over a larger vocabulary with a fixed one-to-one table. "stretch": an increasing
    table with random gaps (BPE ids stay roughly frequency-ordered, as in a real large vocabulary);
    "shuffle": a random permutation (no order left: the worst case for delta-coded ids)."""
    rng = np.random.default_rng(0)
    if mode == "stretch":
        table = np.sort(rng.choice(new_vocab, size=vocab_size, replace=False))
    else:
        table = rng.permutation(new_vocab)[:vocab_size]
    return table.astype(np.int32)[topk_ids]


def zstd_bytes(arrays: dict[str, np.ndarray], chunk_rows: int) -> int:
    """Compressed size as Zarr with Shuffle (multi-byte dtypes) + Zstd level 3 would store it."""
    from numcodecs import Shuffle, Zstd

    total = 0
    for value in arrays.values():
        for start in range(0, len(value), chunk_rows):
            chunk = np.ascontiguousarray(value[start:start + chunk_rows])
            raw = chunk.tobytes() if chunk.itemsize == 1 else Shuffle(elementsize=chunk.itemsize).encode(chunk)
            total += len(Zstd(level=3).encode(raw))
    return total


def store_bytes(arrays: dict[str, np.ndarray], storage: str, tmp: Path) -> int:
    """Bytes on disk when the project's own shard store writes ``arrays`` as one shard (metadata included)."""
    import shutil

    from teacher_cache.store import get_store, shard_size_on_disk

    store = get_store(storage)
    path = tmp / f"bench{store.suffix}"
    arrays = {"seq_offsets": np.array([0, len(next(iter(arrays.values())))], dtype=np.int64), **arrays}
    store.write(path, arrays)
    size = shard_size_on_disk(path)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    return size


def check_round_trip(name: str, codec, topk_ids, topk_logprobs, decoded_ids, decoded_logprobs) -> None:
    """Same ids per row, descending decoded values, each value within the codec's rounding."""
    from teacher_cache.codecs import SqrtCodec

    if not np.all(np.diff(decoded_logprobs, axis=1) <= 0):
        raise AssertionError(f"{name}: decoded rows not in descending order")
    by_id, dec_by_id = np.argsort(topk_ids, axis=1), np.argsort(decoded_ids, axis=1)
    ids, dec_ids = np.take_along_axis(topk_ids, by_id, 1), np.take_along_axis(decoded_ids, dec_by_id, 1)
    check_close(f"{name} ids", dec_ids, ids, atol=0)
    lp, dec_lp = np.take_along_axis(topk_logprobs, by_id, 1), np.take_along_axis(decoded_logprobs, dec_by_id, 1)
    if isinstance(codec, SqrtCodec):
        check_close(f"{name} sqrt(p)", np.exp(0.5 * dec_lp), np.exp(0.5 * lp), atol=0.5 / codec.levels + 1e-6)
    else:
        atol, rtol = FLOAT_TOL[name]
        check_close(f"{name} log-probs", dec_lp, lp, atol=atol, rtol=rtol)


def main() -> None:
    import tempfile

    from teacher_cache.codecs import SqrtCodec, codec_kl, codec_names, get_codec
    from teacher_cache.store import encode_shard
    from teacher_cache.targets import TeacherTargets, tail_logmass_from_topk

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="cached .npz (made if missing)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens to score when making the data")
    parser.add_argument("--k", type=int, default=100, help="top-k kept (the data holds top-100)")
    parser.add_argument("--vocab", type=int, default=0, help="remap ids into this vocabulary size (0: keep)")
    parser.add_argument("--remap", choices=("stretch", "shuffle"), default="stretch")
    parser.add_argument("--chunk-rows", type=int, default=8192, help="rows per chunk for the zstd reference count")
    parser.add_argument("--codecs", default="fp32,bf16,fp16,sqrt8,sqrt7,sqrt6")
    add_results_arg(parser)
    args = parser.parse_args()

    if not args.data.exists():
        args.data.parent.mkdir(parents=True, exist_ok=True)
        make_real_topk(args.data, args.tokens, 512, 100)
    data = np.load(args.data)
    topk_ids, topk_logprobs = data["topk_ids"][:, : args.k], data["topk_logprobs"][:, : args.k]
    vocab = int(data["vocab_size"])
    if args.vocab:
        topk_ids, vocab = remap_vocab(topk_ids, vocab, args.vocab, args.remap), args.vocab
    n, seq_len = len(topk_ids), int(data["seq_len"])
    seqs = list(data["input_ids"].reshape(-1, seq_len))
    targets = TeacherTargets(topk_ids, topk_logprobs, tail_logmass_from_topk(topk_logprobs), data["target_logprob"])
    print(f"{n} positions, k={args.k}, vocab {vocab}, max id {topk_ids.max()}")
    results = Results(bench="codecs", path=args.results)
    vocab_case = f"V{vocab}" + (f"-{args.remap}" if args.vocab else "")
    config = {"data": str(args.data), "positions": n, "k": args.k, "vocab": vocab,
              "remap": args.remap if args.vocab else None, "chunk_rows": args.chunk_rows, "versions": versions()}
    print("| codec | top-k B/token: zstd3 ref | zarr store | parquet store | whole zarr shard B/token "
          "| KL mean | KL p99.9 | KL max | encode / decode Mrow/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    per_array = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.codecs.split(","):
            # sqrtN other than the registered sqrt8: the same codec at N bits, to show the trade-off.
            codec = get_codec(name) if name in codec_names() else SqrtCodec(int(name.removeprefix("sqrt")))
            arrays = codec.encode(topk_ids, topk_logprobs)
            decoded_ids, decoded_logprobs = codec.decode(arrays)
            check_round_trip(name, codec, topk_ids, topk_logprobs, decoded_ids, decoded_logprobs)
            # best of 3: the first call pays for page faults, and the CPU is shared
            encode_s = time_cpu(lambda: codec.encode(topk_ids, topk_logprobs), warmup=0, repeats=3).min_ms / 1e3
            decode_s = time_cpu(lambda: codec.decode(arrays), warmup=0, repeats=3).min_ms / 1e3
            kl = codec_kl(topk_ids, topk_logprobs, decoded_ids, decoded_logprobs)
            ref = zstd_bytes(arrays, args.chunk_rows) / n
            zarr = store_bytes(arrays, "zarr", Path(tmp)) / n
            parquet = store_bytes(arrays, "parquet", Path(tmp)) / n
            shard = store_bytes(encode_shard(seqs, targets, codec), "zarr", Path(tmp)) / n
            print(f"| {name} | {ref:.1f} | {zarr:.1f} | {parquet:.1f} | {shard:.1f} | {kl.mean():.2e} | "
                  f"{np.quantile(kl, 0.999):.2e} | {kl.max():.2e} | "
                  f"{n / encode_s / 1e6:.2f} / {n / decode_s / 1e6:.2f} |", flush=True)
            by_array = {key: zstd_bytes({key: value}, args.chunk_rows) / n for key, value in arrays.items()}
            per_array.append(f"{name}: " + ", ".join(f"{key} {b:.1f}" for key, b in by_array.items()))
            no_op = name == "fp32"  # its encode and decode are copies, not a speed figure
            results.add(f"{vocab_case}/{name}", {
                "topk_bytes_per_token_zstd3_ref": ref, "topk_bytes_per_token_zarr_store": zarr,
                "topk_bytes_per_token_parquet_store": parquet, "shard_bytes_per_token_zarr": shard,
                "kl_mean": kl.mean(), "kl_p999": np.quantile(kl, 0.999), "kl_max": kl.max(),
                "encode_mrow_s": None if no_op else n / encode_s / 1e6, "decode_mrow_s": None if no_op else n / decode_s / 1e6,
                "bytes_per_token_zstd3_by_array": by_array}, config)
    print("\nB/token per array (zstd3 ref):\n" + "\n".join(per_array))


if __name__ == "__main__":
    main()
