"""Token shards and batch samplers for training (issue 4 part 3; training.md §10 for the scale:
T = 512-1024, 20-100M tokens for the small tier; environment.md §4: no source has a standard held-out
split, so one is defined here deterministically).

**Held-out split.** A document goes to validation when the first 8 bytes of
`sha256(salt + "/" + source/name)`, read as a fraction of 2^64, fall below `val_fraction`. The split
therefore depends only on the document's identity and never on the tokenizer, the text cleaning or the
order of sources, and a document is never cut between train and val. If no document falls below the
fraction, the one with the smallest hash goes to val (there is always at least one val document), and if
every document does, the one with the largest hash stays in train.

When a single document dominates the corpus (more than `dominance` = half of all characters, e.g. one
big file), splitting whole documents would leave either no training text or no validation text. Then
every document is first cut into contiguous chunks of about `chunk_chars` characters at line breaks
(chunk `k` of `source/name` is named `name#k`), and the chunks are split by the same hash rule; each
chunk is then its own document (BOS ... EOS). `meta.json` records which rule was used.

**Shards.** Each split is the concatenation, in corpus order, of `[BOS] + ids(text) + [EOS]` for its
documents, written as a flat little-endian array `train.bin` / `val.bin`: uint16 when every id fits
(vocab_size <= 65536), else uint32. `meta.json` gives the vocab size, dtype, token counts, the
tokenizer, sources, split rule, the sha256 of each shard and every document's (split, offset, length).

**Sampling.** `TokenDataset.batch(step, ...)` draws the windows of training step `step` from a numpy
`Generator` seeded with `(seed, step)`, so the batch of a step depends only on (seed, step), never on
how many batches were drawn before in the process: a resumed run sees the same batches. With
`world_size > 1` the global batch of the step is drawn and rank `r` takes its `r`-th slice, so a
multi-process run sees the same data as a single process with the same global batch. Windows may span
a document boundary (the BOS/EOS tokens mark it). Validation uses `TokenDataset.sequential_batches`,
which tiles the shard with non-overlapping windows in order, so every target token is scored once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsv41.data.sources import Document

META_NAME = "meta.json"
SHARD_NAMES = {"train": "train.bin", "val": "val.bin"}


def shard_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id in [0, vocab_size) fits, else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit uint32")


def doc_hash_fraction(key: str, salt: str = "") -> float:
    """A uniform number in [0, 1) from `sha256(salt/key)`."""
    h = hashlib.sha256(f"{salt}/{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def chunk_document(doc: Document, chunk_chars: int) -> list[Document]:
    """`doc` cut into contiguous pieces of about `chunk_chars` characters, each ending at a line break
    when one exists in the piece (the pieces joined with the break give the text back)."""
    text, out, start, k = doc.text, [], 0, 0
    while start < len(text):
        end = min(start + chunk_chars, len(text))
        if end < len(text):
            cut = text.rfind("\n", start + 1, end)
            if cut > start:
                end = cut
        piece = text[start:end].strip("\n")
        if piece:
            out.append(Document(doc.source, f"{doc.name}#{k}", piece))
            k += 1
        start = end
    return out


@dataclass
class Split:
    train: list[Document]
    val: list[Document]
    rule: dict

    @property
    def documents(self) -> list[tuple[str, Document]]:
        return [("train", d) for d in self.train] + [("val", d) for d in self.val]


def split_documents(
    docs: Sequence[Document],
    val_fraction: float = 0.03,
    *,
    salt: str = "",
    dominance: float = 0.5,
    chunk_chars: int = 100_000,
) -> Split:
    """Deterministic held-out split by document hash (see the module docstring); both lists keep the
    corpus order. Needs at least two documents (after chunking)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    keys = [d.key for d in docs]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"document keys must be unique, repeated: {dup[:5]}")
    total = sum(len(d.text) for d in docs)
    largest = max((len(d.text) for d in docs), default=0)
    chunked = total > 0 and largest > dominance * total
    if chunked:
        docs = [c for d in docs for c in chunk_document(d, chunk_chars)]
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents (after chunking) to hold one out, got {len(docs)}")
    frac = [doc_hash_fraction(d.key, salt) for d in docs]
    is_val = [f < val_fraction for f in frac]
    forced = None
    if not any(is_val):
        i = min(range(len(docs)), key=frac.__getitem__)
        is_val[i], forced = True, "min_hash_to_val"
    elif all(is_val):
        i = max(range(len(docs)), key=frac.__getitem__)
        is_val[i], forced = False, "max_hash_to_train"
    rule = {
        "kind": "chunks_by_hash" if chunked else "documents_by_hash",
        "hash": "sha256(salt + '/' + source/name)[:8] / 2**64 < val_fraction",
        "val_fraction": val_fraction,
        "salt": salt,
        "dominance": dominance,
        "chunk_chars": chunk_chars if chunked else None,
        "forced": forced,
    }
    return Split([d for d, v in zip(docs, is_val) if not v], [d for d, v in zip(docs, is_val) if v], rule)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_shards(
    out_dir: str,
    split: Split,
    tokenizer,
    *,
    tokenizer_path: str | None = None,
    tokenizer_name: str | None = None,
    sources: Sequence[str] = (),
    extra_meta: dict | None = None,
) -> dict:
    """Tokenize `split` with `tokenizer` (any `dsv41.tokenizer.TokenizerLike`), write `train.bin`,
    `val.bin` and `meta.json` into `out_dir`, and return the meta dict."""
    from dsv41.data.bpe import encode_documents

    os.makedirs(out_dir, exist_ok=True)
    vocab = int(tokenizer.vocab_size)
    dtype = shard_dtype(vocab)
    bos, eos = int(tokenizer.bos_id), int(tokenizer.eos_id)
    meta: dict = {
        "format": "dsv41-token-shards-v1",
        "vocab_size": vocab,
        "dtype": dtype.name,
        "byteorder": "little",
        "bos_id": bos,
        "eos_id": eos,
        "pad_id": int(tokenizer.pad_id),
        "tokenizer": tokenizer_name,
        "tokenizer_path": tokenizer_path,
        "sources": list(sources),
        "split_rule": split.rule,
        "files": {},
        "tokens": {},
        "num_documents": {},
        "documents": [],
    }
    for name, docs in (("train", split.train), ("val", split.val)):
        ids = encode_documents(tokenizer, [d.text for d in docs])
        lengths = [len(x) + 2 for x in ids]
        total = sum(lengths)
        arr = np.empty(total, dtype=dtype.newbyteorder("<"))
        pos = 0
        for d, x, n in zip(docs, ids, lengths):
            arr[pos] = bos
            arr[pos + 1 : pos + n - 1] = x
            arr[pos + n - 1] = eos
            meta["documents"].append(
                {"split": name, "source": d.source, "name": d.name, "offset": pos, "tokens": n, "chars": len(d.text)}
            )
            pos += n
        if total and int(arr.max()) >= vocab:
            raise ValueError(f"token id {int(arr.max())} is outside the vocabulary [0, {vocab})")
        path = os.path.join(out_dir, SHARD_NAMES[name])
        arr.tofile(path + ".part")
        os.replace(path + ".part", path)
        meta["files"][name] = {"path": SHARD_NAMES[name], "sha256": _sha256_file(path), "bytes": os.path.getsize(path)}
        meta["tokens"][name] = total
        meta["num_documents"][name] = len(docs)
    if extra_meta:
        meta.update(extra_meta)
    tmp = os.path.join(out_dir, META_NAME + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
    os.replace(tmp, os.path.join(out_dir, META_NAME))
    return meta


def read_meta(data_dir: str) -> dict:
    with open(os.path.join(data_dir, META_NAME), encoding="utf-8") as f:
        return json.load(f)


def verify_shards(data_dir: str) -> None:
    """Raise ValueError when a shard's sha256 or size differs from `meta.json`."""
    meta = read_meta(data_dir)
    for info in meta["files"].values():
        path = os.path.join(data_dir, info["path"])
        if os.path.getsize(path) != info["bytes"] or _sha256_file(path) != info["sha256"]:
            raise ValueError(f"{path} does not match its sha256 in {META_NAME}")


class TokenDataset:
    """One shard (`train` or `val`) of a data folder, memory-mapped; see the module docstring for the
    sampling rules. `tokens` is the flat numpy array."""

    def __init__(self, path: str, dtype, vocab_size: int | None = None):
        self.path = path
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.vocab_size = vocab_size
        n = os.path.getsize(path) // self.dtype.itemsize
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r", shape=(n,)) if n else np.zeros(0, self.dtype)

    @classmethod
    def from_dir(cls, data_dir: str, split: str = "train") -> TokenDataset:
        if split not in SHARD_NAMES:
            raise ValueError(f"split must be one of {sorted(SHARD_NAMES)}, got {split!r}")
        meta = read_meta(data_dir)
        return cls(os.path.join(data_dir, meta["files"][split]["path"]), meta["dtype"], meta["vocab_size"])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _window_count(self, seq_len: int) -> int:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if len(self) < seq_len + 1:
            raise ValueError(f"{self.path} has {len(self)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        return len(self) - seq_len  # window starts 0 .. len - seq_len - 1

    def _gather(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        w = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def batch_starts(
        self, step: int, batch_size: int, seq_len: int, seed: int = 0, *, rank: int = 0, world_size: int = 1
    ) -> np.ndarray:
        """Window start offsets of `step` for `rank` (the global batch is batch_size * world_size)."""
        if step < 0 or batch_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad step/batch/rank: step={step}, batch_size={batch_size}, rank={rank}, world_size={world_size}"
            )
        rng = np.random.default_rng([int(seed), int(step)])
        starts = rng.integers(0, self._window_count(seq_len), size=batch_size * world_size, dtype=np.int64)
        return starts[rank * batch_size : (rank + 1) * batch_size]

    def batch(
        self, step: int, batch_size: int, seq_len: int, seed: int = 0, *, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, target) int64 [batch_size, seq_len] of training step `step`; target is input shifted
        by one token. A function of (seed, step, rank, world_size) only."""
        return self._gather(
            self.batch_starts(step, batch_size, seq_len, seed, rank=rank, world_size=world_size), seq_len
        )

    def iter_batches(
        self, batch_size: int, seq_len: int, seed: int = 0, start_step: int = 0, *, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Endless (step, input, target) from `start_step` on (resume by passing the next step)."""
        step = start_step
        while True:
            x, y = self.batch(step, batch_size, seq_len, seed, rank=rank, world_size=world_size)
            yield step, x, y
            step += 1

    def num_sequential_windows(self, seq_len: int) -> int:
        self._window_count(seq_len)
        return (len(self) - 1) // seq_len

    def sequential_batches(
        self, batch_size: int, seq_len: int, max_batches: int | None = None, *, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Validation batches: window `i` covers tokens [i*seq_len, i*seq_len + seq_len] (inputs and
        targets), windows in order, `batch_size` per batch, the last batch possibly smaller; the tail
        shorter than one window is left out. With `world_size > 1`, rank `r` gets batches r, r+W, ..."""
        n = self.num_sequential_windows(seq_len)
        starts = np.arange(n, dtype=np.int64) * seq_len
        for b, i in enumerate(range(0, n, batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            if b % world_size == rank:
                yield self._gather(starts[i : i + batch_size], seq_len)


__all__ = [
    "META_NAME",
    "SHARD_NAMES",
    "Split",
    "TokenDataset",
    "chunk_document",
    "doc_hash_fraction",
    "read_meta",
    "shard_dtype",
    "split_documents",
    "verify_shards",
    "write_shards",
]
