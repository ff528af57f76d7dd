"""The exact bytes every id of a tokenizer stands for: what makes a cache's token ids text again.

Two schemes define them exactly, and they are the ones read here:
  byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each of the 256 bytes is written as one printable
      character (GPT-2's ``bytes_to_unicode`` table), so a token's string maps back to its bytes;
  SentencePiece-style with byte fallback (Llama 2, Mistral, Gemma): "<0xAB>" tokens are single
      bytes and "▁" is a space; other pieces are their UTF-8.
Any other tokenizer (WordPiece, a SentencePiece without byte fallback, ...) cannot say what bytes
its ids stand for, and ``token_pieces`` refuses it in one line.

Added tokens marked special (EOS, BOS, chat markers) stand for no text: their piece is empty and
``special`` marks them; added tokens not marked special are their content's UTF-8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from distill.errors import DistillUserError

SCHEMES = ("byte_level", "byte_fallback")
_SPACE = "\u2581"  # SentencePiece's "▁"


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's table, inverted: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass(frozen=True)
class TokenPieces:
    """pieces[i]: the bytes of id i (b"" for special ids); special: bool [V]; scheme: one of SCHEMES;
    special_by_content: {added token's content: id} for the special ids; lengths: int64 [V], the
    bytes of each id (0 for special ids)."""

    pieces: tuple[bytes, ...]
    special: np.ndarray
    scheme: str
    special_by_content: dict

    def __post_init__(self) -> None:
        # every piece in one buffer, so that decoding a run of ids is a few array operations
        lengths = np.fromiter((len(p) for p in self.pieces), np.int64, len(self.pieces))
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "_starts", np.cumsum(lengths) - lengths)
        object.__setattr__(self, "_buffer", np.frombuffer(b"".join(self.pieces) or b"\0", np.uint8))

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids) -> bytes:
        """The bytes of a run of ids (special ids add none)."""
        ids = np.asarray(ids, np.int64)
        lengths = self.lengths[ids]
        total = int(lengths.sum())
        if total == 0:
            return b""
        # byte j of the run: piece start of its token + its place within the token
        first = np.cumsum(lengths) - lengths
        where = np.repeat(self._starts[ids] - first, lengths) + np.arange(total)
        return self._buffer[where].tobytes()


def scheme_of(backend_json: dict) -> str | None:
    """"byte_level", "byte_fallback", or None when the tokenizer.json says neither."""
    def types(node) -> list[str]:
        if not isinstance(node, dict):
            return []
        inner = node.get("decoders") or node.get("pretokenizers") or []
        return [node.get("type", ""), *(t for sub in inner for t in types(sub))]

    model = backend_json.get("model") or {}
    decoders = types(backend_json.get("decoder"))
    if "ByteLevel" in decoders or "ByteLevel" in types(backend_json.get("pre_tokenizer")):
        return "byte_level"
    if model.get("byte_fallback") or "ByteFallback" in decoders:
        return "byte_fallback"
    return None


def _piece_bytes(token: str, scheme: str) -> bytes:
    if scheme == "byte_level":
        table = _byte_of_char()
        try:
            return bytes(table[c] for c in token)
        except KeyError:  # not in the byte alphabet: taken as written
            return token.encode("utf-8")
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace(_SPACE, " ").encode("utf-8")


def token_pieces(tokenizer, option: str = "tokenizer") -> TokenPieces:
    """The bytes of every id of an HF fast tokenizer (module doc). `option` names the option a
    refused tokenizer came from, for the error."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DistillUserError(f"--{option}: {type(tokenizer).__name__} is not a fast (tokenizer.json) tokenizer; "
                               "cross-tokenizer alignment needs one: save it with a tokenizer.json")
    scheme = scheme_of(json.loads(backend.to_str()))
    if scheme is None:
        raise DistillUserError(f"--{option}: cannot tell the bytes of this tokenizer's tokens (neither byte-level "
                               "BPE nor byte fallback); use a byte-level or byte-fallback tokenizer")
    return _pieces(tokenizer, scheme)


def _pieces(tokenizer, scheme: str) -> TokenPieces:
    size = len(tokenizer)
    tokens = [None] * size
    for token, i in tokenizer.get_vocab().items():
        if 0 <= i < size:
            tokens[i] = token
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = np.zeros(size, bool)
    by_content, literal = {}, {}
    for i, tok in added.items():
        if i < size and getattr(tok, "special", False):
            special[i] = True
            by_content[str(tok.content)] = int(i)
        elif i < size:  # an added token that is text: its content is the text itself, not the byte alphabet
            literal[i] = str(tok.content).encode("utf-8")
    pieces = tuple(b"" if special[i] or t is None else literal[i] if i in literal else _piece_bytes(t, scheme)
                   for i, t in enumerate(tokens))
    return TokenPieces(pieces, special, scheme, by_content)
