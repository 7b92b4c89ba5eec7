"""The Engram token compression map: raw token id -> compressed id (spec §5, environment.md §5.1).

Each id is decoded on its own with special tokens kept. If the text holds U+FFFD (a token that is only
part of a UTF-8 character) its key is the raw vocabulary string; otherwise the key is the text after

    NFKC -> NFD -> drop combining marks -> lowercase -> runs of [ \\t\\r\\n] become one space -> strip

where a text that is exactly one space after the collapse is kept as " " (the reference does this with a
private-use sentinel around the strip), and a text that normalises to nothing keys on itself. Ids whose
keys are equal share a compressed id; compressed ids are numbered in order of first appearance by raw id.

The steps follow the Hugging Face `tokenizers` normalizers the reference is built from, which differ
from Python's string methods: accents are all combining marks (categories Mn, Mc, Me; Bengali and
Devanagari vowel signs are Mc), lowercase maps each character on its own (no final-sigma rule), and strip
removes Unicode White_Space only (Python's `str.strip` also removes U+001C..U+001F). With these the
DeepSeek tokenizer gives exactly 99,092 keys, the value of `engram_compressed_vocab_size`. Measured
alternatives: stripping only Mn gives 99,510; additionally collapsing every `\\s` and keying every other
whitespace-only token by itself gives 99,668.
"""

from __future__ import annotations

import re
import unicodedata

import torch

# Unicode White_Space (what Rust's char::is_whitespace, used by tokenizers' Strip, accepts)
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(chr(c) for c in range(0x2000, 0x200B)) + "\u2028\u2029\u202f\u205f\u3000"
)
_COLLAPSE = re.compile(r"[ \t\r\n]+")


def normalize_engram_text(text: str) -> str:
    """The normalised key of a decoded token text (before the empty-result and U+FFFD fallbacks)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c.lower() for c in s if not unicodedata.category(c).startswith("M"))
    s = _COLLAPSE.sub(" ", s)
    return s if s == " " else s.strip(_WHITE_SPACE)


def engram_key(text: str, raw_token: str) -> str:
    """The compression key of one token: its raw string for partial UTF-8, else the normalised text,
    else (normalised to nothing) the text itself."""
    if "\ufffd" in text:
        return raw_token
    return normalize_engram_text(text) or text


def build_engram_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """-> (int64 [tokenizer.vocab_size] map from raw to compressed id, number of compressed ids).

    `tokenizer` is any `dsv41.tokenizer.TokenizerLike`. Install the map with
    `Transformer.set_engram_token_map`; the model's `engram_compressed_vocab_size` must equal the
    returned count (99,092 for the DeepSeek tokenizer)."""
    vocab = int(tokenizer.vocab_size)
    if vocab <= 0:
        raise ValueError(f"tokenizer has no ids (vocab_size {vocab})")
    keys: dict[str, int] = {}
    table = []
    for i in range(vocab):
        key = engram_key(tokenizer.decode([i], skip_special_tokens=False), tokenizer.id_to_token(i))
        table.append(keys.setdefault(key, len(keys)))
    return torch.tensor(table, dtype=torch.int64), len(keys)
