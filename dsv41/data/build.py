"""Build a training data folder from offline text (issue 4 part 3; sources in environment.md §4, vocabulary
and sequence sizes in training.md §10):

    python -m dsv41.data.build --out DIR [--vocab-size 8192] [--tokenizer bpe|deepseek|PATH/tokenizer.json]
        [--sources shakespeare,milton,kjv,fortunes] [--val-fraction 0.03] [--cache DIR]

Steps: load the documents (`dsv41.data.sources`), split them by document hash (`dsv41.data.shards`),
get the tokenizer (a byte-level BPE trained on the **training documents only**, so nothing of the val
text shapes the vocabulary; or the DeepSeek tokenizer; or a given `tokenizer.json`), write
`train.bin`, `val.bin`, `meta.json`, the tokenizer files when one was trained or given, and
`engram_map.safetensors`: the Engram raw-to-compressed id map of that tokenizer
(`dsv41.engram_map.build_engram_token_map`), tensor `engram_token_map`, with `compressed_vocab_size` and
`vocab_size` in the safetensors metadata.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Optional

from dsv41.data.sources import DEFAULT_SOURCES, default_cache_dir, load_documents, parse_sources

ENGRAM_MAP_NAME = "engram_map.safetensors"


def write_engram_map(tokenizer, out_dir: str) -> int:
    """Write `engram_map.safetensors` for `tokenizer`; returns the compressed vocabulary size."""
    from safetensors.torch import save_file

    from dsv41.engram_map import build_engram_token_map

    token_map, size = build_engram_token_map(tokenizer)
    path = os.path.join(out_dir, ENGRAM_MAP_NAME)
    save_file({"engram_token_map": token_map.contiguous()}, path + ".part",
              metadata={"compressed_vocab_size": str(size), "vocab_size": str(int(tokenizer.vocab_size))})
    os.chmod(path + ".part", 0o644)
    os.replace(path + ".part", path)
    return size


def load_engram_map(data_dir: str):
    """(int64 map tensor, compressed vocab size) from a data folder."""
    from safetensors import safe_open

    with safe_open(os.path.join(data_dir, ENGRAM_MAP_NAME), framework="pt") as f:
        return f.get_tensor("engram_token_map"), int(f.metadata()["compressed_vocab_size"])


def build_dataset(out: str, *, vocab_size: int = 8192, tokenizer: str = "bpe", sources=DEFAULT_SOURCES,
                  val_fraction: float = 0.03, cache: Optional[str] = None, salt: str = "",
                  min_frequency: int = 2, documents=None) -> dict:
    """Run every step (see the module docstring) and return the meta dict. `documents` (a list of
    `Document`) replaces the fetched sources, for tests."""
    from dsv41.data.bpe import train_bpe
    from dsv41.data.shards import split_documents, write_shards
    from dsv41.tokenizer import HFTokenizer, deepseek_tokenizer

    t0 = time.time()
    skipped: list = []
    if documents is None:
        names = parse_sources(sources)
        documents = load_documents(names, cache, skipped=skipped)
    else:
        names = list(dict.fromkeys(d.source for d in documents))
    if not documents:
        raise SystemExit("no documents: every requested source was unavailable")
    split = split_documents(documents, val_fraction, salt=salt)
    os.makedirs(out, exist_ok=True)
    t1 = time.time()
    if tokenizer == "bpe":
        tok = train_bpe((d.text for d in split.train), vocab_size, out, min_frequency=min_frequency)
        tok_name, tok_path = f"bpe-{tok.vocab_size}", "tokenizer.json"
    elif tokenizer == "deepseek":
        tok, tok_name, tok_path = deepseek_tokenizer(), "deepseek", None
    else:
        src = tokenizer if tokenizer.endswith(".json") else os.path.join(tokenizer, "tokenizer.json")
        tok = HFTokenizer.from_file(src)
        dst = os.path.join(out, "tokenizer.json")
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
            cfg = os.path.join(os.path.dirname(os.path.abspath(src)), "tokenizer_config.json")
            if os.path.isfile(cfg):
                shutil.copyfile(cfg, os.path.join(out, "tokenizer_config.json"))
        tok_name, tok_path = os.path.abspath(src), "tokenizer.json"
    t2 = time.time()
    compressed = write_engram_map(tok, out)
    meta = write_shards(out, split, tok, tokenizer_path=tok_path, tokenizer_name=tok_name, sources=names,
                        extra_meta={"engram_map": ENGRAM_MAP_NAME,
                                    "engram_compressed_vocab_size": compressed,
                                    "skipped_sources": [{"source": s, "reason": r} for s, r in skipped],
                                    "build_seconds": {"fetch_and_split": round(t1 - t0, 2),
                                                      "tokenizer": round(t2 - t1, 2)}})
    meta["build_seconds"]["total"] = round(time.time() - t0, 2)
    _rewrite_meta(out, meta)
    return meta


def _rewrite_meta(out: str, meta: dict) -> None:
    import json

    from dsv41.data.shards import META_NAME

    tmp = os.path.join(out, META_NAME + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
    os.replace(tmp, os.path.join(out, META_NAME))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41.data.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE size, specials included (default 8192)")
    p.add_argument("--tokenizer", default="bpe",
                   help="'bpe' (train one, default), 'deepseek', or a tokenizer.json / folder holding one")
    p.add_argument("--sources", default=",".join(DEFAULT_SOURCES),
                   help="comma-separated: shakespeare, milton, kjv, fortunes (default shakespeare,milton)")
    p.add_argument("--val-fraction", type=float, default=0.03, help="held-out share of documents (default 0.03)")
    p.add_argument("--cache", default=None, help=f"download/extract cache (default {default_cache_dir()})")
    p.add_argument("--salt", default="", help="salt of the split hash (default empty)")
    p.add_argument("--min-frequency", type=int, default=2, help="BPE merge minimum count (default 2)")
    a = p.parse_args(argv)
    try:
        meta = build_dataset(a.out, vocab_size=a.vocab_size, tokenizer=a.tokenizer, sources=a.sources,
                             val_fraction=a.val_fraction, cache=a.cache, salt=a.salt,
                             min_frequency=a.min_frequency)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    nd, nt = meta["num_documents"], meta["tokens"]
    print(f"wrote {a.out}: vocab {meta['vocab_size']} ({meta['tokenizer']}), dtype {meta['dtype']}, "
          f"train {nd['train']} docs / {nt['train']:,} tokens, val {nd['val']} docs / {nt['val']:,} tokens, "
          f"split {meta['split_rule']['kind']}, engram compressed vocab {meta['engram_compressed_vocab_size']}, "
          f"{meta['build_seconds']['total']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
