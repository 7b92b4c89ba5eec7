"""`dsv41 train --mix retrieval` (dsv41.data.retrieval_tasks): samples are a function of (split, seed, index),
the held-out split shares no value, key or name with train, only answers are trained, lengths follow
the curriculum, the wording is the eval harness's, and the trainer takes the mix."""

import random
import re
import types

import numpy as np
import pytest
import torch

from dsv41.data import TokenDataset
from dsv41.data import retrieval_tasks as rt
from dsv41.data.retrieval_tasks import IGNORE, TASKS, RetrievalMix, RetrievalTasks, split_of
from dsv41.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_corpus):
    return load_tokenizer(tiny_corpus, 512)


@pytest.fixture(scope="module")
def mixes(tiny_corpus, tok):
    return {
        split: RetrievalMix(TokenDataset.from_dir(tiny_corpus, split), tok, split, curriculum=50)
        for split in ("train", "val")
    }


def drawn(sample):
    """The drawn strings a sample is asked for (vartrack: each variable name of its answer)."""
    return set(sample.answers[0].split(", ")) if sample.task == "vartrack" else set(sample.answers)


def test_a_sample_is_a_function_of_split_seed_index_and_row(tok):
    a, b = RetrievalTasks(tok, "train"), RetrievalTasks(tok, "train")
    for index in range(8):
        s1, s2 = a.sample(700, index, seed=3, row=1), b.sample(700, index, seed=3, row=1)
        assert s1.ids == s2.ids and s1.trained == s2.trained and s1.task == s2.task
    assert a.sample(700, 0, seed=3).ids != a.sample(700, 1, seed=3).ids
    assert a.sample(700, 0, seed=3).ids != a.sample(700, 0, seed=4).ids
    assert a.sample(700, 0, seed=3).ids != RetrievalTasks(tok, "val").sample(700, 0, seed=3).ids


def test_held_out_split_is_disjoint_by_construction(tok):
    seen = {}
    for split in ("train", "val"):
        tasks, values = RetrievalTasks(tok, split), set()
        for index in range(150):
            s = tasks.sample(700, index, seed=0)
            for v in drawn(s):
                assert split_of(v) == split, (split, s.task, v)
                values.add(v)
        seen[split] = values
    assert len(seen["train"]) > 200 and len(seen["val"]) > 200
    assert not seen["train"] & seen["val"]
    # the niah key pairs: each split draws only from its own half of the 900 WORD-WORD keys
    for split in ("train", "val"):
        text = " ".join(
            tok.decode(RetrievalTasks(tok, split).render("niah", 700, random.Random(i)).ids) for i in range(40)
        )
        keys = set(re.findall(r"numbers? for ([a-z]+-[a-z]+)", text))
        assert keys and all(split_of(k) == split for k in keys)


def test_only_the_answers_and_the_final_eos_are_trained(tok, mixes):
    mix = mixes["train"]
    for index in range(12):
        b = mix.retrieval_batch(index, 4, 420, seed=1)
        assert b.x.shape == b.y.shape == (4, 420)
        for row in range(4):
            sample = mix.tasks.sample(421, index, 1, index * 4 + row)  # rows are numbered globally
            ids = torch.tensor(sample.ids)
            assert torch.equal(b.x[row], ids[:-1])
            trained = b.y[row] != IGNORE
            assert torch.equal(b.y[row][trained], ids[1:][trained])  # targets are the next tokens
            assert b.y[row][-1] == tok.eos_id  # the last target is EOS
            text = tok.decode(b.y[row][trained][:-1].tolist())
            for answer in sample.answers:  # every answer is trained, and nothing else
                assert answer in text
            assert re.sub(r"[\s.,0-9A-Z]", "", text) == "", text
            prompt = tok.decode(ids[: int(np.argmax(np.array(sample.trained)))].tolist())
            for v in drawn(sample):  # the answer is in the prompt: it can be retrieved
                assert v in prompt


def test_lengths_follow_the_curriculum_and_stay_in_range(mixes):
    mix = mixes["train"]
    lengths = {}
    for index in range(120):
        b = mix.batch(index, 2, 600, seed=0)
        if isinstance(b, tuple):  # a text batch: full seq_len windows
            assert b[0].shape == (2, 600)
            continue
        lengths[index] = b.x.shape[1]
    assert all(mix.min_len <= n <= 600 for n in lengths.values())
    assert all(n <= mix.length_cap(i, 600) for i, n in lengths.items())
    assert max(n for i, n in lengths.items() if i < 10) < 600 * 0.6  # early: short
    assert max(n for i, n in lengths.items() if i >= 50) > 540  # after the curriculum: up to seq_len
    share = 1 - len(lengths) / 120
    assert 0.1 < share < 0.45  # text batches near the default 0.25


def test_every_task_renders_at_its_minimum_length(tok):
    tasks = RetrievalTasks(tok, "train")
    for task in TASKS:
        n = tasks.min_length(task)
        solo = RetrievalTasks(tok, "train", weights={task: 1.0})
        rendered = [solo.sample(n, i) for i in range(40)]
        assert all(len(s.ids) == n for s in rendered)
        assert sum(s.task == task for s in rendered) >= 36  # the passkey fallback is rare
    with pytest.raises(ValueError, match="too short"):
        tasks.render("passkey", 20, random.Random(0))


def test_the_prompts_use_the_eval_harness_wording(tok):
    from dsv41.eval import retrieval as ev

    for name in ("PASSKEY_PREFIX", "NIAH_PREFIX", "VARTRACK_PREFIX", "ADJECTIVES", "NOUNS"):
        assert getattr(rt, name) == getattr(ev, name), name
    assert rt.GRASS_FILLER == __import__("dsv41.eval.common", fromlist=["GRASS_FILLER"]).GRASS_FILLER
    for task in ("passkey", "niah", "vartrack"):
        ours = rt.task_spec(task, random.Random(5), "train")
        theirs = ev.task_text(task, random.Random(5), 0.5)
        # the question's wording up to its first drawn value (the values differ by construction)
        head = re.split(r"[0-9]|[a-z]+-[a-z]+", theirs.question)[0]
        assert ours.tail[0].text.startswith(head), (task, ours.tail[0].text, head)
        assert ours.prefix == theirs.prefix


def test_bad_options_are_refused(tiny_corpus, tok):
    text = TokenDataset.from_dir(tiny_corpus, "train")
    with pytest.raises(ValueError, match="split"):
        RetrievalTasks(tok, "test")
    with pytest.raises(ValueError, match="weights"):
        RetrievalTasks(tok, "train", weights={"copy": 1.0})
    with pytest.raises(ValueError, match="text_fraction"):
        RetrievalMix(text, tok, "train", text_fraction=1.0)
    mix = RetrievalMix(text, tok, "train")
    with pytest.raises(ValueError, match="seq-len"):
        mix.batch(0, 2, mix.min_len - 1)


def test_dense_steps_make_the_first_steps_dense():
    from dsv41.train.config import TrainConfig
    from dsv41.train.trainer import Trainer

    cfg = TrainConfig(preset="tiny", dense_steps=3).resolved()
    fake = types.SimpleNamespace(cfg=cfg, model_cfg=None)
    assert [Trainer._options(fake, s).dense_indexer for s in range(5)] == [True, True, True, False, False]
    with pytest.raises(ValueError, match="mix"):
        TrainConfig(mix="copy").validate()
    with pytest.raises(ValueError, match="dense_steps"):
        TrainConfig(dense_steps=-1).validate()


@pytest.mark.slow  # a whole (two-step) training run; the slow tier, which CI runs
def test_the_trainer_takes_the_mix_and_logs_answer_accuracy(tiny_corpus, tmp_path):
    import json

    from dsv41.train import TrainConfig, train

    cfg = TrainConfig(
        preset="tiny",
        data=tiny_corpus,
        mix="retrieval",
        steps=2,
        batch_size=2,
        seq_len=400,
        eval_every=2,
        eval_batches=4,
        out=str(tmp_path / "run"),
        swa_only=True,
    )
    train(cfg)
    last = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert "val_loss" in last and any(k.startswith("val_accuracy_") for k in last)
    assert "val_loss_text" in last and any(f"val_loss_{t}" in last for t in TASKS)  # text and answers apart
    saved = json.load(open(tmp_path / "run" / "checkpoint" / "config.json"))
    assert not any(saved["compress_ratios"])  # --swa-only: the checkpoint has no compressed layer


def test_mqar_fits_its_pairs_to_the_length(tok):
    """An mqar sample too long for the length is redrawn with fewer pairs (so short curriculum lengths
    still train associative recall), and a draw that fitted at 16 pairs is unchanged."""
    solo = RetrievalTasks(tok, "train", weights={"mqar": 1.0})
    pairs = lambda s: sum(1 for _ in re.finditer(r" [A-Z]{4} is [0-9]+\.", tok.decode(s.ids)))  # noqa: E731
    short = [solo.sample(solo.min_length("mqar"), i) for i in range(20)]
    assert all(s.task == "mqar" for s in short)
    assert all(pairs(s) - len(s.answers) <= 4 for s in short)  # at most 4 pairs in the list (+ queries)
    long_len = 800
    for i in range(10):
        got = solo.sample(long_len, i)
        rng = random.Random(f"dsv41-retrieval:train:0:{i}:0")
        rng.choices(["mqar"], weights=[1.0])  # the task draw sample() makes first
        spec = rt.task_spec("mqar", rng, "train")  # the old draw: 4-16 pairs, no fitting
        assert got.answers == [seg.text.strip(" .") for seg in spec.tail if seg.trained]


def test_the_mix_weights_flag(tiny_corpus, tmp_path):
    from dsv41.train.config import TrainConfig, parse_mix_weights
    from dsv41.train.trainer import Trainer

    assert parse_mix_weights("mqar=0.6, passkey=0.4") == {"mqar": 0.6, "passkey": 0.4}
    for bad in ("copy=1", "mqar", "mqar=x", "mqar=-1", "mqar=0", "mqar=1,mqar=2"):
        with pytest.raises(ValueError, match="mix_weights"):
            TrainConfig(mix="retrieval", mix_weights=bad).validate()
    cfg = TrainConfig(
        preset="recall",
        data=tiny_corpus,
        mix="retrieval",
        mix_weights="passkey=1",
        seq_len=400,
        out=str(tmp_path / "run"),
        threads=1,
    )
    trainer = Trainer(cfg)
    tasks = {t for i in range(30) for t in getattr(trainer.train_set.batch(i, 2, 400), "tasks", [])}
    assert tasks == {"passkey"}  # training draws only the weighted task
    assert trainer.val_set.tasks.weights == rt.DEFAULT_WEIGHTS  # held-out batches keep the default mix


def test_a_resumed_mix_run_counts_the_tokens_of_the_uninterrupted_one(tiny_corpus, tmp_path):
    """The mix draws each batch's length, so the token count cannot be rebuilt from the step on resume
    (it was: a resumed run reported 134K fewer tokens than its twin); it is saved with the state."""
    from dsv41.train.config import TrainConfig
    from dsv41.train.trainer import Trainer

    def cfg(out):
        return TrainConfig(
            preset="recall",
            data=tiny_corpus,
            mix="retrieval",
            seq_len=256,
            batch_size=2,
            steps=4,
            warmup=1,
            save_every=2,
            eval_every=100,
            curriculum_steps=4,
            out=str(out),
            threads=1,
        )

    full = Trainer(cfg(tmp_path / "full")).run()
    interrupted = Trainer(cfg(tmp_path / "resumed"))
    for _ in range(3):  # one step past the save at step 2, then "killed"
        interrupted.history.append(interrupted.train_step())
        if interrupted.step % 2 == 0:
            interrupted.save()
    counts = [0] + [r["tokens"] for r in interrupted.history]
    batch_tokens = {b - a for a, b in zip(counts, counts[1:])}
    del interrupted
    resumed = Trainer(cfg(tmp_path / "resumed"))
    assert resumed.step == 2
    last = resumed.run()
    assert len(batch_tokens) > 1  # the batches really differ in size
    assert last["tokens"] == full["tokens"]
