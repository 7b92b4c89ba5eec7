"""The trainer: loss falls, checkpoints load in the release layout, resume repeats the uninterrupted run."""

import json
import os

import pytest
import torch

from dsv41.train import TrainConfig, Trainer


def data_vocab(data):
    return json.load(open(os.path.join(data, "meta.json")))["vocab_size"]


def config(data, out, **kw):
    base = dict(
        preset="tiny",
        data=data,
        out=str(out),
        steps=12,
        batch_size=4,
        seq_len=32,
        warmup=2,
        eval_every=6,
        eval_batches=2,
        save_every=6,
        threads=1,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.slow  # a whole training/planning run (~15-50 s); the slow tier, which CI runs
def test_loss_falls_and_the_checkpoint_serves(tiny_corpus, tmp_path):
    import dsv41
    from dsv41.engine import SamplingParams, build_engine

    # the release's rule, which the 0.3 drop was set under: the default recipe's N(0, 1) embedding starts
    # slower (5.89 -> 5.80 over these 12 steps; docs/moe-balancing.md), and this test is about the trainer
    Trainer(config(tiny_corpus, tmp_path, balance="release")).run()
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [x["step"] for x in lines] == list(range(1, 13))
    first, last = lines[0], lines[-1]
    assert last["loss"] < first["loss"] - 0.3 and "val_loss" in last
    assert (tmp_path / "loss.png").stat().st_size > 5000
    model = dsv41.load_model(str(tmp_path / "checkpoint"))  # the release layout, dtypes and names
    assert model.cfg.n_layers == 10 and model.cfg.vocab_size == data_vocab(
        tiny_corpus
    )  # the tokenizer's, not tiny's 1024
    engine = build_engine(str(tmp_path / "checkpoint"))
    out = engine.generate([engine.tokenizer.encode("the")], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.token_ids) >= 1


def test_resume_repeats_the_uninterrupted_run(tiny_corpus, tmp_path):
    # the save at step 2 lies past the 1-step warm-up: the resumed steps run on the decaying schedule
    full = Trainer(config(tiny_corpus, tmp_path / "full", steps=4, save_every=2, warmup=1)).run()

    interrupted = Trainer(config(tiny_corpus, tmp_path / "resumed", steps=4, save_every=2, warmup=1))
    for _ in range(3):  # one step past the last save, then "killed"
        interrupted.history.append(interrupted.train_step())
        if interrupted.step % 2 == 0:
            interrupted.save()
    del interrupted
    resumed = Trainer(config(tiny_corpus, tmp_path / "resumed", steps=4, save_every=2, warmup=1))
    assert resumed.step == 2
    last = resumed.run()
    for key in ("loss", "indexer_kl", "balance", "grad_norm", "val_loss"):
        assert last[key] == full[key], key
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "full" / "train_state" / "weights.safetensors"))
    wb = load_file(str(tmp_path / "resumed" / "train_state" / "weights.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoints_are_written_atomically(tiny_corpus, tmp_path):
    trainer = Trainer(config(tiny_corpus, tmp_path, steps=2, save_every=1))
    trainer.run()
    names = sorted(os.listdir(tmp_path))
    assert "checkpoint" in names and "train_state" in names
    assert not [n for n in names if n.endswith((".tmp", ".old"))]


def test_router_bias_moves_per_modality():
    """Text loads move `gate.bias`, image-span loads `gate.bias_vl`; an absent modality moves nothing."""
    from dsv41.config import tiny
    from dsv41.model.transformer import Transformer

    trainer = Trainer.__new__(Trainer)  # only the model, config and process group matter here
    trainer.model = Transformer(tiny().replace(vision_n_layers=1))
    # the release's sign rule on purpose (the recipe's look-ahead sets the text bias before the step instead)
    trainer.cfg, trainer.distributed = TrainConfig(bias_rate=0.01, balance="release").resolved(), False
    text = torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1])  # expert 0 overloaded
    image = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 8])  # expert 7 overloaded
    ratios, natural = trainer._update_router_bias(
        {("bias", 2): text, ("bias_vl", 2): image, ("bias_vl", 3): torch.zeros(8)}
    )
    gate = trainer.model.layers[2].ffn.gate
    assert torch.equal(gate.bias.data, 0.01 * torch.sign(text.mean() - text))
    assert torch.equal(gate.bias_vl.data, 0.01 * torch.sign(image.mean() - image))
    assert torch.count_nonzero(trainer.model.layers[3].ffn.gate.bias_vl) == 0
    assert ratios == {2: 9.0 / 2.0} and natural == {}
    # under a capacity bound the text bias follows the router's own picks, not the bounded ones
    capped = torch.tensor([3.0, 2, 2, 2, 2, 2, 2, 1])
    ratios, natural = trainer._update_router_bias({("bias", 4): capped, ("natural", 4): text})
    assert torch.equal(trainer.model.layers[4].ffn.gate.bias.data, 0.01 * torch.sign(text.mean() - text))
    assert ratios == {4: 3.0 / 2.0} and natural == {4: 9.0 / 2.0}


def test_device_choice():
    import pytest

    from dsv41.train.trainer import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device"):
        TrainConfig(device="tpu").validate()


def test_the_default_corpus_filters_below_the_stdlib_root(tmp_path, monkeypatch):
    """The stdlib corpus leaves out test folders, judged below the stdlib root: a root whose own path
    contains "test" used to exclude every file."""
    import sysconfig

    import dsv41.data.build as build
    from dsv41.train.trainer import default_data

    root = tmp_path / "test-venv" / "lib" / "python3"
    for rel in ("json/__init__.py", "os.py", "unittest/case.py", "test/test_os.py", "site-packages/x.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    seen = []
    monkeypatch.setattr(build, "build_dataset", lambda folder, vocab_size, documents: seen.extend(documents))
    default_data(TrainConfig(), 512)
    assert sorted(d.name for d in seen) == [os.path.join("json", "__init__.py"), "os.py"]
