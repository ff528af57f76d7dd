"""Several caches in one run on the GPU: whether mixing two caches, or combining two teachers'
caches position by position (an ensemble), keeps the training step's tokens/s of one cache.

Setup: the standard library's .py text tokenized by a real tokenizer (--tokenizer, e.g. SmolLM2's)
and cut into sequences of --seq-len; caches with random but valid top-k targets written by the real
CacheWriter (bench_cross_tokenizer_gpu.write_cache): A and B over two different stretches of the text
(the mixture's two domains), A and A2 over the same text with other targets and A's fingerprint (two
teachers of one corpus: the ensemble). A random-init student of the SmolLM2-135M shape and the
tokenizer's vocabulary; `student.trainer.train` end to end, tokens/s over its logging windows after
the first, the three cases interleaved over --rounds.

Rows `mixture_gpu/train/<case>`: one (A), mixture (A and B at 0.5,0.5), ensemble (A and A2 at
0.5,0.5, k the caches' k); figures tok_s (the median over rounds of each round's median window),
and for the two others ratio = tok_s / one's. Goal: ratio >= 0.97.

Rows `mixture_gpu/data/<case>` (one, ensemble): the host's batches alone, tokens/s handed out by
the trainer's Prefetcher with nothing else running (bench_cross_tokenizer_gpu.host_rate), against
which the training step's tokens/s says whether the host could keep up.

    python tests/benchmarks/bench_mixture_gpu.py --tokenizer TOKENIZER_FOLDER --results $OUT/rows.jsonl
    python tests/benchmarks/bench_mixture_gpu.py --tokenizer T --device cpu --seq-len 64 --num-seqs 8 --train-steps 4   # smoke
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from bench_cross_tokenizer_gpu import host_rate, packed, save_random_student, write_cache
from bench_train_step_gpu import train_windows
from harness import Results, add_results_arg

from student.trainer import TrainConfig

CASES = {"one": {"cache": "A"}, "mixture": {"cache": "A,B", "cache_weights": "0.5,0.5"},
         "ensemble": {"ensemble": "A,A2", "ensemble_weights": "0.5,0.5"}}


def main():
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-seqs", type=int, default=48, help="sequences in each cache")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--train-steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test at toy sizes, no figure")
    add_results_arg(ap)
    args = ap.parse_args()
    results = Results(bench="mixture_gpu", path=args.results)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_mixture_"))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    text = packed(tokenizer, args.seq_len, 2 * args.num_seqs)
    first, second = text[:args.num_seqs], text[args.num_seqs:]
    caches = {"A": work / "A", "B": work / "B", "A2": work / "A2"}
    write_cache(caches["A"], tokenizer, first, args.k, store_tokenizer=False, seed=0)
    write_cache(caches["B"], tokenizer, second, args.k, store_tokenizer=False, seed=1)
    write_cache(caches["A2"], tokenizer, first, args.k, store_tokenizer=False, seed=2, fingerprint="f0")
    student = work / "student"
    shape = save_random_student(student, tokenizer, args.device)
    config = {"seq_len": args.seq_len, "batch_size": args.batch_size, "k": args.k, "num_seqs": args.num_seqs,
              "shape": shape, "steps": args.train_steps}

    from student.data import CacheBatches
    from student.ensemble import EnsembleBatches
    from teacher_cache.reader import CacheReader

    indices = list(range(args.num_seqs))
    host = {"one": CacheBatches(CacheReader(caches["A"]), indices, args.batch_size),
            "ensemble": EnsembleBatches(CacheReader(caches["A"]), indices, args.batch_size,
                                        others=[CacheReader(caches["A2"])], weights=[0.5, 0.5], k=args.k)}
    for case, batches in host.items():
        results.add(f"data/{case}", {"host_tok_s": host_rate(batches, 24), "workers": batches.prefetch_workers},
                    config)

    windows = {case: [] for case in CASES}
    for _ in range(args.rounds):  # interleaved: a drift of the clock falls on every case
        for case, data in CASES.items():
            paths = {key: ",".join(str(caches[name]) for name in value.split(","))
                     for key, value in data.items() if key in ("cache", "ensemble")}
            flat = {**data, **paths}
            if "cache" in flat:
                flat["cache"] = flat["cache"].split(",")
            run = work / "run"
            shutil.rmtree(run, ignore_errors=True)
            cfg = TrainConfig.from_flat(**flat, out=str(run), student=str(student), tokenizer=str(student),
                                        steps=args.train_steps, batch_size=args.batch_size, lr=3e-4, warmup_steps=2,
                                        heldout=1, eval_every=0, eval_sequences=1, save_every=0, log_every=4,
                                        device=args.device, seed=0)
            _, rates = train_windows(cfg, work)
            windows[case].append(rates)
    rate = {case: statistics.median(statistics.median(r[1:] or r) for r in rounds) for case, rounds in windows.items()}
    for case in CASES:
        ratio = {} if case == "one" else {"ratio": rate[case] / rate["one"]}
        results.add(f"train/{case}", {"tok_s": rate[case], **ratio, "tok_s_windows": windows[case]}, config)


if __name__ == "__main__":
    main()
