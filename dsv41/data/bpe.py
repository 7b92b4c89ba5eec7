"""The tokenizer of a training run: a byte-level BPE trained locally with PyPI `tokenizers`, or the
DeepSeek tokenizer (issue 4 part 3; training.md §10 "Train a BPE with PyPI `tokenizers` locally";
environment.md §5.1 for the DeepSeek one).

The trained BPE keeps the V4.1 id layout of the special tokens (spec §11, `dsv41.tokenizer`): id 0
`<｜begin▁of▁sentence｜>` (BOS), 1 `<｜end▁of▁sentence｜>` (EOS), 2 `<｜▁pad▁｜>` (PAD); then the 256
byte symbols, then the merges, up to exactly `vocab_size` ids when the corpus has enough distinct
pairs (training.md §10 uses 8192 for the small tier; a tiny corpus may stop short, `train_bpe` then
says so). It is GPT-2 style byte-level (ByteLevel pre-tokenizer without a prefix space, ByteLevel
decoder), so decoding the ids of any text gives the text back exactly. It is saved as `tokenizer.json`
plus a `tokenizer_config.json` naming BOS/EOS/PAD, which `dsv41.tokenizer.HFTokenizer.from_file` and
`load_tokenizer` read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from dsv41.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, HFTokenizer, _import_tokenizers

SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | None = None,
    *,
    min_frequency: int = 2,
    strict: bool = False,
    extra_special_tokens: tuple[str, ...] = (),
) -> HFTokenizer:
    """Train a byte-level BPE with `vocab_size` ids (specials included) on `texts`; when `out_dir` is
    given write `tokenizer.json` and `tokenizer_config.json` there. The result can have fewer ids than
    asked when the corpus runs out of pairs seen `min_frequency` times: `strict` makes that an error.
    `extra_special_tokens` (e.g. the chat markers, `dsv41.data.chat_format`) take the ids after PAD, one
    id each, and are split out of the text before BPE, as BOS/EOS/PAD are."""
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = list(SPECIAL_TOKENS) + [t for t in extra_special_tokens if t not in SPECIAL_TOKENS]
    if vocab_size < len(specials) + len(alphabet):
        raise ValueError(f"a byte-level BPE needs vocab_size >= {len(specials) + len(alphabet)}, got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(specials):
        if tok.token_to_id(s) != i:  # pragma: no cover - tokenizers places special tokens first
            raise RuntimeError(f"{s} got id {tok.token_to_id(s)}, expected {i}")
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        msg = f"the corpus only supports {got} BPE ids (asked for {vocab_size})"
        if strict:
            raise ValueError(msg)
        print(f"[dsv41.data] warning: {msg}", flush=True)
    if out_dir is not None:
        save_tokenizer(tok, out_dir)
    return HFTokenizer(tok, bos=BOS_TOKEN, eos=EOS_TOKEN, pad=PAD_TOKEN)


def save_tokenizer(backend, out_dir: str) -> str:
    """Write `tokenizer.json`, `tokenizer_config.json` (BOS/EOS/PAD names, the V4.1 chat template) and
    `special_tokens_map.json` into `out_dir`, the files `transformers.AutoTokenizer` loads; returns the
    path of `tokenizer.json`."""
    from dsv41.chat.hf_template import write_hf_tokenizer_files

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    backend.save(path)
    stale = os.path.join(out_dir, "tokenizer_config.json")
    if os.path.exists(stale):  # a fresh tokenizer: nothing of an earlier one's config carries over
        os.remove(stale)
    write_hf_tokenizer_files(out_dir, HFTokenizer(backend, bos=BOS_TOKEN, eos=EOS_TOKEN, pad=PAD_TOKEN))
    return path


def encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without BOS/EOS (batched through `tokenizers` when the tokenizer wraps
    it)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return [list(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_bos=False) for t in texts]


__all__ = ["SPECIAL_TOKENS", "encode_documents", "save_tokenizer", "train_bpe"]
