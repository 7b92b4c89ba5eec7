"""The checkpoint shipped in the package (dsv41/checkpoints/shakespeare-chat): `dsv41 chat`, `generate` and
`serve` run it when given no model and no preset. It loads through the ordinary checkpoint loader, has
the `nano` shape, fits 10 MB, is declared as package data, and writes words: the readability check
below passes on its replies and fails on random weights of the same shape and tokenizer, and on
`--preset tiny`."""

import json
import os
import re
import string

import pytest
import torch

from dsv41.accounting import account
from dsv41.checkpoints import DEFAULT_CHECKPOINT, checkpoint_path, default_checkpoint, pack_checkpoint
from dsv41.cli import generation_defaults, main
from dsv41.config import ModelConfig, nano, tiny
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.train.checkpoint import save_checkpoint
from dsv41.weights import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_BYTES = 10_000_000
PROMPT = "Hello, who are you?"
PRINTABLE = set(string.ascii_letters + string.whitespace + string.punctuation)
CHAT_MARKER = re.compile(r"<｜[^｜]*｜>|</?think>")


@pytest.fixture(scope="module")
def folder():
    path = default_checkpoint()
    assert path == checkpoint_path(DEFAULT_CHECKPOINT), "the package's default checkpoint is missing"
    return path


@pytest.fixture(scope="module")
def words(folder):
    """The training text's words of 3+ letters that the BPE holds whole (a leading-space token `Ġword`):
    the corpus' commonest words, from the shipped tokenizer itself."""
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        vocab = json.load(f)["model"]["vocab"]
    found = {t[1:].lower() for t in vocab if t.startswith("Ġ") and len(t) >= 4 and t[1:].isalpha()}
    assert len(found) > 1000
    return found


def readable(text: str, words: set[str]) -> tuple[bool, dict]:
    """Mostly printable (>= 90% letters, space, punctuation), at least 8 words of 3+ letters, >= 75% of
    them words of the training text, and at least 5 different such words. Chat markers (the model may
    go on to the next turns) are control tokens, not text: they are left out."""
    text = CHAT_MARKER.sub(" ", text)
    long = [w.lower() for w in re.findall(r"[A-Za-z]+", text) if len(w) >= 3]
    known = [w for w in long if w in words]
    facts = {
        "printable": sum(c in PRINTABLE for c in text) / max(len(text), 1),
        "words": len(long),
        "known": len(known) / max(len(long), 1),
        "distinct_known": len(set(known)),
    }
    ok = facts["printable"] >= 0.9 and facts["words"] >= 8 and facts["known"] >= 0.75 and facts["distinct_known"] >= 5
    return ok, facts


def reply(capsys, *model_args: str) -> str:
    """The text `dsv41 generate --chat` writes for PROMPT: 48 tokens, sampled (seeded) as the shipped
    checkpoint's generation_config.json says, given explicitly so that every model samples alike."""
    argv = ["generate", *model_args, "--chat", "--prompt", PROMPT, "--max-tokens", "48", "--ignore-eos"]
    assert main([*argv, "--temperature", "0.7", "--top-p", "0.9", "--seed", "0"]) == 0
    return capsys.readouterr().out.split("\nfinish reason:")[0]


def test_it_loads_with_the_nano_shape(folder):
    model = load_model(folder)
    cfg = model.cfg
    # the data's BPE sets the vocabulary and the Engram compression; everything else is the preset
    assert cfg == nano().replace(engram_compressed_vocab_size=cfg.engram_compressed_vocab_size)
    assert cfg.vocab_size == 4096 and 3000 < cfg.engram_compressed_vocab_size <= 4096
    assert round(account(cfg)["params_total"] / 1e6, 1) == 8.4  # the documented size
    converted = model.load_report.converted
    assert len(converted) > 100 and "head.weight" in converted and "fp8 dequantised" in converted["head.weight"]
    assert ModelConfig.from_file(folder).dtype == "bf16"  # it runs in bf16 as trained; only storage is FP8


def test_it_fits_10_mb_and_is_package_data(folder):
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(sizes)
    assert generation_defaults(folder) == {"temperature": 0.7, "top_p": 0.9}
    assert sum(sizes.values()) <= MAX_BYTES, sizes
    # setuptools installs the folder's files only when pyproject.toml declares them (a wheel has no
    # MANIFEST to fall back on); the section is read as text, Python 3.10 has no tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        section = f.read().split("[tool.setuptools.package-data]", 1)[-1].split("\n[", 1)[0]
    assert re.search(rf'"dsv41\.checkpoints" = \[[^]]*"{DEFAULT_CHECKPOINT}/\*"', section), section


def test_its_replies_are_words_and_random_weights_fail_the_same_check(folder, words, capsys, tmp_path):
    ok, facts = readable(reply(capsys), words)  # no --model, no --preset: the shipped checkpoint
    assert ok, facts
    # random weights of the same shape, with the same tokenizer: word pieces in no order
    cfg = ModelConfig.from_file(folder)
    save_checkpoint(
        str(tmp_path / "random"),
        init_random_weights(Transformer(cfg), seed=0),
        cfg,
        os.path.join(folder, "tokenizer.json"),
    )
    ok, facts = readable(reply(capsys, "--model", str(tmp_path / "random")), words)
    assert not ok, facts
    ok, facts = readable(reply(capsys, "--preset", "tiny"), words)  # random weights, byte tokenizer
    assert not ok, facts


def test_pack_checkpoint_stores_fp8_and_loads_back_close(tmp_path):
    cfg = tiny()
    model = init_random_weights(Transformer(cfg), seed=0)
    save_checkpoint(str(tmp_path / "full"), model, cfg, None, run_info={"name": "dsv41-tiny-test"})
    result = pack_checkpoint(str(tmp_path / "full"), str(tmp_path / "packed"))
    assert result["files"]["model.safetensors"] < 0.6 * os.path.getsize(tmp_path / "full" / "model.safetensors")
    assert "dsv41_train.json" in result["files"] and "tokenizer.json" in result["files"]
    loaded = dict(load_model(str(tmp_path / "packed")).named_parameters())
    for name, p in model.named_parameters():
        q = loaded[name].float()
        assert q.dtype == p.float().dtype and q.shape == p.shape
        assert torch.linalg.norm(q - p.float()) <= 0.05 * torch.linalg.norm(p.float()) + 1e-6, name
