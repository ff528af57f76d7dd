"""Cross-tokenizer distillation from a cache: a student with its own tokenizer learns from any cache.

align.py      a cached sequence's teacher ids -> their exact bytes -> the student's tokens, and at
              which student positions both tokenizations share a boundary
vocab_map.py  teacher id -> student id (the longest student token that is a byte-prefix of it),
              computed once per tokenizer pair and kept on disk; the cached top-k + tail mapped
              onto the student's vocabulary
batches.py    micro-batches in the student's tokens, the mapped targets at shared boundaries,
              fed to the same fused top-k KL loss; the positions between them train on their own
              next token (student/loss.py)

ALM's chunk-likelihood matching (arXiv 2503.20083) was measured for the unaligned positions, where
their cross-entropy did better on held-out bits per byte, and alone, level with byte-prefix on one
seed and further from the teacher at the aligned positions (rows cross_tokenizer/chunks-seed0,
cross_tokenizer/byte-prefix+chunks-seed0; tests/benchmarks/notes/quality.md): not kept, it lives in
git history.
"""
