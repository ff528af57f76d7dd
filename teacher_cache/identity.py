"""Fingerprints that tie a cache to the tokenizer and text it was built from."""

from __future__ import annotations

import hashlib
import json


def tokenizer_info(tokenizer) -> dict:
    """{"hash", "vocab_size", "special_ids"} for an HF tokenizer.

    The hash covers the token-to-id map and the special tokens, so two tokenizers that split text
    the same way over the same ids hash the same wherever their files live.
    """
    vocab = tokenizer.get_vocab()
    special_ids = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")
    }
    payload = json.dumps(
        {"vocab": sorted(vocab.items(), key=lambda kv: kv[1]), "special": special_ids},
        ensure_ascii=False,
    )
    return {
        "hash": hashlib.sha256(payload.encode()).hexdigest()[:16],
        "vocab_size": len(tokenizer),
        "special_ids": special_ids,
    }
