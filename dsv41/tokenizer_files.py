"""The tokenizer files of a checkpoint folder for `transformers.AutoTokenizer` (issue 34 item 5), whatever
tokenizer the model uses (spec §11 for the id layout):

- a trained BPE (`dsv41 data`): its own `tokenizer.json`, copied;
- the DeepSeek tokenizer (vocabulary 129,280, `dsv41.tokenizer.deepseek_tokenizer`): its `tokenizer.json`
  with the V4.1 names (`<｜System｜>` at 128799, `<｜deepseek_image｜>` at 129264), so a folder loads the
  same ids with or without the `deepseek-tokenizer` package;
- the byte tokenizer (`tiny` and the other random-weight presets, `ByteTokenizer`): a `tokenizer.json`
  built here whose ids are dsv41's exactly: BOS/EOS/PAD 0/1/2, byte b at 3 + b named `<0xNN>`, the chat
  markers at the top of the vocabulary, every unused id `<unused_N>`. It is a BPE without merges and with
  byte fallback: every character is unknown to it and so falls back to its UTF-8 bytes, one id each, and
  the markers are added tokens (split out before the BPE runs, as `ByteTokenizer.encode` does). Decoding
  drops unused ids (as `ByteTokenizer` does) and joins the bytes; a byte run that is not valid UTF-8 gets
  one U+FFFD per byte from `tokenizers`' ByteFallback decoder, where Python's "replace" (dsv41) puts one
  per maximal invalid subsequence: only partial or garbage byte sequences decode differently.

Next to `tokenizer.json` go `tokenizer_config.json` (with the V4.1 chat template,
`dsv41.chat.hf_template`) and `special_tokens_map.json`. A byte-tokenizer folder's config records
`"dsv41_tokenizer": {"kind": "byte", "vocab_size": N}`, so `dsv41.tokenizer.load_tokenizer` keeps
serving it with `ByteTokenizer` (its file is for other programs).

`save_checkpoint` writes these files for every checkpoint; `dsv41 export-tokenizer FOLDER` adds them to a
folder written before (`export_tokenizer`).
"""

from __future__ import annotations

import json
import os

from dsv41.tokenizer import BYTE_KIND_KEY, ByteTokenizer, HFTokenizer, TokenizerLike, _import_tokenizers, load_tokenizer

_UNUSED_PATTERN = r"<unused_\d+>"


def byte_tokenizer_backend(tokenizer: ByteTokenizer):
    """A `tokenizers.Tokenizer` with `tokenizer`'s ids, names and splitting (see the module docstring)."""
    tokenizers = _import_tokenizers()
    from tokenizers import AddedToken, Regex, decoders, models

    if not isinstance(tokenizer, ByteTokenizer):
        raise ValueError(f"byte_tokenizer_backend needs a ByteTokenizer, got {type(tokenizer).__name__}")
    # every id in the model's vocabulary, markers included, so that the added tokens below keep these ids
    # (an added token missing from the vocabulary would be appended after it)
    vocab = {tokenizer.id_to_token(i): i for i in range(tokenizer.vocab_size)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace(Regex(_UNUSED_PATTERN), ""), decoders.ByteFallback(), decoders.Fuse()]
    )
    markers = sorted(tokenizer._added_by_id.items())
    backend.add_tokens([AddedToken(name, special=i in tokenizer.special_ids, normalized=False) for i, name in markers])
    for i, name in markers:
        if backend.token_to_id(name) != i:  # pragma: no cover - tokenizers keeps a vocabulary token's id
            raise RuntimeError(f"{name} got id {backend.token_to_id(name)}, expected {i}")
    return backend


def write_tokenizer_files(folder: str, tokenizer: TokenizerLike, base_config: str | None = None) -> list[str]:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` for `tokenizer` (a
    `ByteTokenizer` or an `HFTokenizer`) into `folder`; fields of `base_config` (a tokenizer_config.json
    the tokenizer came with) are kept. Returns the paths written."""
    from dsv41.chat.hf_template import write_hf_tokenizer_files

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    config_path = os.path.join(folder, "tokenizer_config.json")
    extra: dict = {}
    if base_config is not None and os.path.isfile(base_config):
        with open(base_config, encoding="utf-8") as f:
            extra = json.load(f)
        if not isinstance(extra, dict):
            raise ValueError(f"{base_config} must hold a JSON object")
    extra.pop(BYTE_KIND_KEY, None)  # set again below when it applies
    if isinstance(tokenizer, ByteTokenizer):
        byte_tokenizer_backend(tokenizer).save(path)
        extra[BYTE_KIND_KEY] = {"kind": "byte", "vocab_size": tokenizer.vocab_size}
    elif isinstance(tokenizer, HFTokenizer):
        tokenizer.backend.save(path)
    else:
        raise ValueError(f"cannot write tokenizer files for a {type(tokenizer).__name__}")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(extra, f, ensure_ascii=False, indent=2)
    write_hf_tokenizer_files(folder, tokenizer, config_path)
    return [path, config_path, os.path.join(folder, "special_tokens_map.json")]


def write_model_tokenizer_files(folder: str, vocab_size: int) -> list[str]:
    """The files for the tokenizer a model of `vocab_size` ids uses when its folder has no tokenizer.json
    (the DeepSeek tokenizer at 129,280 ids, else the byte tokenizer): what `save_checkpoint` writes for a
    run without a tokenizer file."""
    return write_tokenizer_files(folder, load_tokenizer(None, vocab_size))


def export_tokenizer(folder: str, vocab_size: int | None = None) -> list[str]:
    """`dsv41 export-tokenizer FOLDER`: add the AutoTokenizer files to a checkpoint folder written before.
    A folder with a `tokenizer.json` keeps it and gets its `tokenizer_config.json` (chat template,
    BOS/EOS/PAD; its other fields kept) and `special_tokens_map.json`; one without gets the files of the
    tokenizer dsv41 serves it with (see `write_model_tokenizer_files`). `vocab_size` defaults to the
    folder's config.json."""
    from dsv41.config import ModelConfig

    if not os.path.isdir(folder):
        raise ValueError(f"not a folder: {folder}")
    if vocab_size is None:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"{folder} has no config.json: pass --vocab-size")
        vocab_size = ModelConfig.from_file(folder).vocab_size
    tokenizer = load_tokenizer(folder, vocab_size)
    config_path = os.path.join(folder, "tokenizer_config.json")
    if isinstance(tokenizer, HFTokenizer) and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from dsv41.chat.hf_template import write_hf_tokenizer_files

        write_hf_tokenizer_files(folder, tokenizer, config_path)
        return [config_path, os.path.join(folder, "special_tokens_map.json")]
    return write_tokenizer_files(folder, tokenizer, config_path)


def export_command(folder: str, vocab_size: int | None) -> int:
    """The CLI entry: writes the files and names them."""
    for path in export_tokenizer(folder, vocab_size):
        print(f"wrote {path}")
    return 0


__all__ = [
    "byte_tokenizer_backend",
    "export_command",
    "export_tokenizer",
    "write_model_tokenizer_files",
    "write_tokenizer_files",
]
