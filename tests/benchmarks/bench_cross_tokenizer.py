"""Cross-tokenizer distillation on real data: a student with its own tokenizer (a byte-level BPE
trained on the corpus) learns from the default teacher's cache, against the same student on
cross-entropy alone, at equal steps over the same sequences (the same bytes; the student's tokens
differ in number from the teacher's). Held-out bits per byte is the measure that compares students
of different tokenizers; the same-tokenizer KD student and the teacher sit beside them.

    python tests/benchmarks/bench_cross_tokenizer.py --cache caches/stdlib            # every variant, seeds 0-2
    python tests/benchmarks/bench_cross_tokenizer.py --cache C --variants byte-prefix:0,ce:0 --vocab 8192

Variants NAME:SEED, NAME one of METHODS (the other-tokenizer student) or "same" (the teacher's
tokenizer, KD). The cache must hold its tokenizer files (`distill add-tokenizer` adds them). Writes
OUT/<variant>/ run folders, OUT/cross_tokenizer.json and the rows `cross_tokenizer/<variant>`:
held-out bits per byte, the teacher's, KL at aligned positions, CE per student token.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from run_helpers import add_variant_run_args, run_variants

# flat TrainConfig overrides of each variant of the other-tokenizer student
METHODS = {
    "byte-prefix": {"cross_tokenizer": "byte-prefix", "ce_weight": 0.0},
    "byte-prefix+ce": {"cross_tokenizer": "byte-prefix", "ce_weight": 0.5},
    "ce": {"ce_weight": 1.0},
}
LABELS = {"byte-prefix": "other tokenizer, byte-prefix KD",
          "byte-prefix+ce": "other tokenizer, byte-prefix KD + half cross-entropy", "ce": "other tokenizer, cross-entropy only",
          "same": "teacher's tokenizer, KD"}
DEFAULT_VARIANTS = ",".join(f"{name}:{seed}" for seed in range(3) for name in ("byte-prefix", "ce", "same"))


def train_bpe(folder: Path, vocab_size: int, files: int | None = None) -> Path:
    """A byte-level BPE of `vocab_size` ids trained with the `tokenizers` library on the standard
    library's .py files (the default corpus; the first `files` of them in sorted order), saved as an
    HF folder whose EOS is <|endoftext|> (vocab_size 257: the bytes alone, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in sources], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_run_args(ap, variants=DEFAULT_VARIANTS, eval_every=None, results_json="cross_tokenizer.json")
    ap.add_argument("--vocab", type=int, default=8192, help="the student tokenizer's size (default 8192)")
    ap.add_argument("--case-prefix", default="", help="put before each row's case, e.g. h100-1200steps/ for the "
                                                      "recipe cross_tokenizer_gpu.toml on an H100")
    args = ap.parse_args()
    tokenizer = args.out / f"bpe{args.vocab}"
    if not (tokenizer / "tokenizer.json").exists():
        train_bpe(tokenizer, args.vocab)

    def parse(spec: str) -> tuple[str, dict]:
        name, _, seed = spec.partition(":")
        if name != "same" and name not in METHODS or not seed.isdigit():
            raise SystemExit(f"variant must be NAME:SEED with NAME one of {', '.join([*METHODS, 'same'])}, got {spec!r}")
        overrides = {"ce_weight": 0.0} if name == "same" else {**METHODS[name], "tokenizer": str(tokenizer)}
        return f"{args.case_prefix}{name}-seed{seed}", {**overrides, "seed": int(seed)}

    def describe(spec, config, run_dir):
        return {"label": LABELS[spec.partition(":")[0]], "vocab": args.vocab if "tokenizer" in
                parse(spec)[1] else None}, ""

    run_variants(args, parse, describe, "cross_tokenizer.json", bench="cross_tokenizer")


if __name__ == "__main__":
    main()
