"""Optimizer state bytes of Qwen2-0.5B- and 1.5B-shaped students: AdamW, FOAM at levels 2, 3, 4
(embedding folded or in plain Adam) and block-wise 8-bit AdamW. Runs on a CPU in seconds.

    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_state.py --results $OUT/results.jsonl

The students are built on the meta device (no memory); bytes come from each optimizer's formula
per parameter shape (foam_state_bytes_formula, adam8bit_state_bytes_formula), which the tests
hold equal to the bytes of the real state tensors (tests/test_foam.py, tests/test_adam8bit.py).
The step counters (a few bytes per parameter tensor) are left out of every column alike. One row
per shape and optimizer, bench "optimizer_state", case "<shape>/<variant>"; the table is printed too.
"""

from __future__ import annotations

import argparse

import torch

from harness import Results, add_results_arg

from student.config import StudentConfig
from student.model import Student
from student.optim.adam8bit import adam8bit_state_bytes_formula
from student.optim.foam import foam_state_bytes_formula

SHAPES = {
    # Qwen2-0.5B and Qwen2-1.5B (their config.json): tied embeddings, qkv bias.
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                       head_dim=64),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                       head_dim=128),
}


def params(shape: str) -> dict[str, torch.Size]:
    config = StudentConfig(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True, attention_bias=True,
                           **SHAPES[shape])
    with torch.device("meta"):
        model = Student(config)
    return {name: p.shape for name, p in model.named_parameters()}


def is_embedding(name: str) -> bool:
    return "embed_tokens" in name or "lm_head" in name


def state_bytes(shapes: dict[str, torch.Size], method: str, level: int = 0, fold_embeddings: bool = False,
                block_size: int = 256) -> dict[str, int]:
    """{"folded": bytes of the matrices a FOAM run folds (all ndim >= 2 but the embedding), "total"}."""
    folded = total = 0
    for name, shape in shapes.items():
        numel = shape.numel()
        matrix = len(shape) >= 2 and not is_embedding(name)
        if method == "adamw":
            b = 8 * numel
        elif method == "adamw8bit":
            b = adam8bit_state_bytes_formula(numel, block_size, 4096)
        else:  # foam
            fold = len(shape) >= 2 and (not is_embedding(name) or fold_embeddings)
            b = foam_state_bytes_formula(tuple(shape), level) if fold else 8 * numel
        total += b
        folded += b if matrix else 0
    return {"folded": folded, "total": total}


def variants() -> list[tuple[str, str, str, dict]]:
    """(case name, label, method, state_bytes arguments) of every optimizer measured."""
    out = [("adamw", "AdamW (fp32 states)", "adamw", {})]
    for level in (2, 3, 4):
        out.append((f"foam-l{level}", f"FOAM level {level}, embedding in Adam", "foam", {"level": level}))
        out.append((f"foam-l{level}-fold-emb", f"FOAM level {level}, embedding folded", "foam",
                    {"level": level, "fold_embeddings": True}))
    out.append(("adamw8bit", "AdamW 8-bit, block 256", "adamw8bit", {"block_size": 256}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_arg(ap)
    args = ap.parse_args()
    results = Results(bench="optimizer_state", path=args.results)
    for shape in SHAPES:
        shapes = params(shape)
        n = sum(s.numel() for s in shapes.values())
        embedding = sum(s.numel() for name, s in shapes.items() if is_embedding(name))
        base = state_bytes(shapes, "adamw")
        print(f"\n{shape}: {n / 1e6:.1f}M parameters ({base['total'] / 2**30:.3f} GiB of AdamW state)")
        print("| optimizer | folded matrices GiB | vs AdamW | whole model GiB | vs AdamW |")
        print("|---|---|---|---|---|")
        for case, label, method, kw in variants():
            b = state_bytes(shapes, method, **kw)
            figures = dict(folded_matrices_gib=b["folded"] / 2**30,
                           folded_matrices_vs_adamw=b["folded"] / base["folded"],
                           whole_model_gib=b["total"] / 2**30, whole_model_vs_adamw=b["total"] / base["total"])
            embedding_state = None if method != "foam" else "folded" if kw.get("fold_embeddings") else "plain Adam"
            config = dict(shape=f"{n / 1e6:.1f}M parameters, tied embedding {embedding / 1e6:.1f}M", variant=case,
                          adamw8bit_block=kw.get("block_size"), embedding=embedding_state)
            results.add(f"{shape}/{case}", figures, config)
            print(f"| {label} | {figures['folded_matrices_gib']:.3f} | {figures['folded_matrices_vs_adamw']:.3f} | "
                  f"{figures['whole_model_gib']:.3f} | {figures['whole_model_vs_adamw']:.3f} |")


if __name__ == "__main__":
    main()
