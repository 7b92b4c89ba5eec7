"""The warm-start set for RL with reasoning effort, and `dsv41 rl sft` through the trainer."""

import json
import os

import torch

from dsv41.cli import main
from dsv41.rl.sft import IGNORE, EffortTaskText
from dsv41.tokenizer import ByteTokenizer
from dsv41.weights import load_model


def test_samples_carry_the_effort_line_and_train_only_the_reply():
    tok = ByteTokenizer(1024)
    data = EffortTaskText("train", tok)
    s = data.sample(5)
    text = tok.decode(s.ids)
    assert "Reasoning Effort: " in text and "(range 1-100" in text
    assert text.endswith("<｜end▁of▁sentence｜>") and "</think>" + s.answer in text
    assert tok.decode(s.ids[:s.answer_start]).endswith("<｜Assistant｜><think>")
    batch = data.batch(0, 6)
    for row in range(6):
        trained = batch.y[row] != IGNORE
        first = int(trained.nonzero()[0])
        # the first trained target is the first reply token, every target after it is trained until padding
        assert batch.x[row, first + 1] == batch.y[row, first]
        assert trained[first:].sum() == trained.sum()
    styles = {data.sample(i).task for i in range(40)}
    assert styles == {"direct", "scratchpad"}
    # the splits are separate task streams: at most a chance answer in common, no identical sample
    val = EffortTaskText("val", tok)
    train_answers, val_answers = {data.sample(i).answer for i in range(20)}, {val.sample(i).answer for i in range(20)}
    assert len(train_answers & val_answers) <= 1
    assert {tuple(data.sample(i).ids) for i in range(20)}.isdisjoint(tuple(val.sample(i).ids) for i in range(20))
    assert data.sample(7).ids == EffortTaskText("train", tok).sample(7).ids  # reproducible


def test_rl_sft_trains_and_writes_a_byte_level_checkpoint(tmp_path, capsys):
    out = tmp_path / "sft"
    assert main(["rl", "sft", "--preset", "tiny", "--vocab-size", "512", "--out", str(out), "--steps", "2",
                 "--batch-size", "4", "--seq-len", "192", "--eval-every", "2", "--eval-batches", "1",
                 "--threads", "1"]) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[-1]["step"] == 2 and "val_accuracy_direct" in rows[-1] and rows[-1]["loss"] > 0
    model = load_model(str(out / "checkpoint"))
    assert model.cfg.vocab_size == 512 and not os.path.exists(out / "checkpoint" / "tokenizer.json")
