"""Capture throughput at 1, 2, 4, 8 GPUs of one host: `distill cache-teacher` itself under
`torchrun --standalone --nproc-per-node N`, the same corpus and teacher at every world size.

Setup, per shape: a random-weight teacher of the SmolLM2-135M or Qwen2-0.5B shape
(bench_teacher_gpu.py's `save_random_model`, bf16) saved as an HF folder with a word-level
tokenizer over its vocabulary (bench_train_step_gpu.py's `make_tokenizer`), and a JSON-lines corpus
of --sequences documents of --seq-len random words each, so the packed sequences are random token
ids (one EOS between documents). Every build is the CLI at its defaults (hf backend, top-k
targets, k, codec, shard and batch sizes) with --seq-len and --max-sequences --sequences; the
shards (the unit of work of a rank) must number at least 4 x the largest world size. One untimed
warm-up build (one process, one shard) fills the machine's file and kernel caches, then each
world size N builds the whole corpus into a fresh folder.

Rows `capture_scaling/<shape>/gpus<N>`: tok_per_s, the cache's tokens over the build seconds (the
longest of the ranks' own build times, as each rank prints it: from its claim of the cache to the
last barrier, after rank 0 wrote the manifest, so the slowest rank's shards and the writers'
tail are in; process start, corpus tokenisation, which every rank does for the whole corpus, and
the teacher load are not); scaling, tok_per_s / (N x the per-GPU rate of the smallest world size
measured, normally 1); wall_s and wall_tok_per_s, the whole command (start, tokenisation and load
included); teacher_s_per_rank, each rank's time inside the teacher calls. Before any figure is
kept, each world size's cache is checked against the smallest world size's: the same cache_id and
the same checksum for every shard (a one-process build equals a torchrun build,
tests/test_scaleout_capture.py). One command a shape keeps each run short:

    PYTHONPATH=. python tests/benchmarks/bench_capture_scaling_gpu.py --shapes smollm2-135m --results $OUT/results.jsonl
    PYTHONPATH=. python tests/benchmarks/bench_capture_scaling_gpu.py --shapes qwen2-0.5b --results $OUT/results.jsonl

On a CPU, `--device cpu --shapes tiny --gpus 1,2 --seq-len 32 --sequences 16 --shard-size 2` runs
the same launches with gloo at a toy size (a smoke test, not a figure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_teacher_gpu import SHAPES, save_random_model
from bench_train_step_gpu import make_tokenizer
from harness import Results, add_results_arg
from run_helpers import torchrun, world_sizes

from teacher_cache.build import CacheConfig
from teacher_cache.manifest import load_manifest

REPO = Path(__file__).resolve().parents[2]
# The summary line `distill cache-teacher` prints on every rank (distill/cli.py).
SUMMARY = re.compile(r"scored ([\d,]+) tokens in [\d.]+ s \(([\d,]+) tok/s; teacher ([\d.]+) s, "
                     r"writer [\d.]+ s in the background, (\d+) shards kept\)")


def write_corpus(path: Path, num_docs: int, words: int, vocab: int, seed: int = 0) -> None:
    """`num_docs` JSON lines {"text": ...} of `words` words each, drawn from make_tokenizer's words
    w3 .. w{vocab-1}: each word is one token id, so the packed corpus is random ids."""
    names = [f"w{i}" for i in range(vocab)]
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(num_docs):
            ids = rng.integers(3, vocab, words).tolist()
            f.write(json.dumps({"text": " ".join([names[i] for i in ids])}) + "\n")


def cli_args(work: Path, out: Path, sequences: int, args) -> list[str]:
    """`distill cache-teacher` options of one build; the same for every world size but --out."""
    return ["-m", "distill", "cache-teacher", "--model", str(work / "teacher"), "--corpus", str(work / "corpus.jsonl"),
            "--format", "jsonl", "--seq-len", str(args.seq_len), "--max-sequences", str(sequences),
            "--shard-size", str(args.shard_size),
            "--device", args.device, *(["--compile"] if args.compile else []), "--out", str(out), "--quiet"]


def launch(nproc: int, options: list[str]) -> tuple[float, list[dict]]:
    """One build on `nproc` processes; returns its wall seconds and each rank's summary
    (tokens, build seconds, teacher seconds, shards kept)."""
    start = time.perf_counter()
    done = subprocess.run([*torchrun(nproc), *options], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{nproc} processes failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    ranks = []
    for tokens, rate, teacher_s, kept in SUMMARY.findall(done.stdout):
        tokens, rate = int(tokens.replace(",", "")), int(rate.replace(",", ""))
        # tokens / rate: the rank's build time to the precision of its rate (the printed seconds have one decimal)
        ranks.append({"tokens": tokens, "build_s": tokens / rate, "teacher_s": float(teacher_s), "kept": int(kept)})
    if len(ranks) != nproc:
        raise SystemExit(f"{nproc} processes printed {len(ranks)} summary line(s):\n{done.stdout[-4000:]}")
    return wall_s, ranks


def check_same_cache(got, want, what: str) -> None:
    """Refuse a world size's cache unless it is the reference's: the same cache_id and, shard by
    shard, the same name and checksum. got, want: teacher_cache.manifest.Manifest."""
    if got.status != "complete":
        raise AssertionError(f"{what}: the manifest says {got.status!r}, not 'complete'")
    if got.cache_id != want.cache_id:
        raise AssertionError(f"{what}: cache_id {got.cache_id} != reference {want.cache_id}")
    got_shards = [(s.name, s.checksum) for s in got.shards]
    want_shards = [(s.name, s.checksum) for s in want.shards]
    if got_shards != want_shards:
        differ = [g[0] for g, w in zip(got_shards, want_shards) if g != w] + \
            [s[0] for s in (got_shards[len(want_shards):] or want_shards[len(got_shards):])]
        raise AssertionError(f"{what}: shards differ from the reference's ({', '.join(differ[:5])}; "
                             f"{len(got_shards)} vs {len(want_shards)} shards)")


def prepare(shape: str, work: Path, args) -> dict:
    """The teacher folder and the corpus in `work`; returns the shape's description for the rows."""
    hidden, vocab, layers, heads, kv_heads, intermediate = SHAPES[shape]
    save_random_model(shape, work / "teacher", args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the children need the GPUs, this process only made the weights
    tok = make_tokenizer(work / "teacher", vocab)
    write_corpus(work / "corpus.jsonl", args.sequences, args.seq_len, tok["vocab_size"])
    return {"hidden": hidden, "vocab": vocab, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "intermediate": intermediate, "tokenizer_vocab": tok["vocab_size"]}


def measure(shape: str, sizes: list[int], work: Path, args, results: Results) -> list[dict]:
    """The warm-up build, then one timed build per world size; one row each."""
    config = {"shape": prepare(shape, work, args), "seq_len": args.seq_len, "sequences": args.sequences,
              "shard_size": args.shard_size, "compile": args.compile, "torch": torch.__version__}
    warmup = work / "warmup"
    launch(1, cli_args(work, warmup, args.shard_size, args))
    shutil.rmtree(warmup)
    rows, reference, base_rate, base_n = [], None, None, None
    for n in sizes:
        out = work / f"gpus{n}"
        options = cli_args(work, out, args.sequences, args)
        wall_s, ranks = launch(n, options)
        manifest = load_manifest(out)
        if reference is None:
            reference, base_n = manifest, n
        check_same_cache(manifest, reference, f"{shape} at {n} processes vs {base_n}")
        tokens = sum(r["tokens"] for r in ranks)
        if tokens != manifest.spec.data.tokens or any(r["kept"] for r in ranks):
            raise AssertionError(f"{shape} at {n} processes: the ranks scored {tokens} tokens "
                                 f"({sum(r['kept'] for r in ranks)} shards kept) of the cache's {manifest.spec.data.tokens}")
        build_s = max(r["build_s"] for r in ranks)
        rate = tokens / build_s
        base_rate = base_rate or rate / n
        figures = {"tok_per_s": rate, "scaling": rate / (n * base_rate), "build_s": build_s, "wall_s": wall_s,
                   "wall_tok_per_s": tokens / wall_s, "tokens": tokens, "shards": len(manifest.shards),
                   "teacher_s_per_rank": [r["teacher_s"] for r in ranks], "cache_id": manifest.cache_id}
        rows.append(results.add(f"{shape}/gpus{n}", figures, {**config, "world_size": n, "reference_world_size": base_n,
                                                               "cache_teacher": options[3:]}))
        shutil.rmtree(out)  # the reference is its manifest, kept in memory
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,qwen2-0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--gpus", default="1,2,4,8", help="world sizes, comma-separated (those above the GPUs seen are skipped)")
    parser.add_argument("--sequences", type=int, default=8192, help="sequences every build writes (--max-sequences)")
    parser.add_argument("--seq-len", type=int, default=2048)
    default_shard = CacheConfig.__dataclass_fields__["shard_size"].default
    parser.add_argument("--shard-size", type=int, default=default_shard,
                        help="sequences per shard (cache-teacher's --shard-size; default: its default)")
    parser.add_argument("--compile", action="store_true", help="cache-teacher --compile (the teacher body compiled)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--work", type=Path, default=None, help="folder for teachers, corpora and caches (default: a temp dir)")
    add_results_arg(parser)
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    sizes = world_sizes(args.gpus, args.device)
    num_shards = math.ceil(args.sequences / args.shard_size)
    if num_shards < 4 * max(sizes):
        raise SystemExit(f"--sequences {args.sequences} in shards of {args.shard_size} make {num_shards} shards; "
                         f"{max(sizes)} processes need at least {4 * max(sizes)}: raise --sequences or lower --shard-size")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_capture_scaling_"))
    results = Results(bench="capture_scaling", path=args.results)
    rows = []
    for shape in shapes:
        rows += measure(shape, sizes, work / shape, args, results)
        shutil.rmtree(work / shape)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
