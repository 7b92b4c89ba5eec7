"""The warm-start set for RL with reasoning effort, and `dsv41 rl sft` through the trainer."""

import json

import pytest

from dsv41.cli import main
from dsv41.rl.sft import IGNORE, EffortTaskText
from dsv41.tokenizer import ByteTokenizer, load_tokenizer
from dsv41.weights import load_model


def test_samples_carry_the_effort_line_and_train_only_the_reply():
    tok = ByteTokenizer(1024)
    data = EffortTaskText("train", tok)
    s = data.sample(5)
    text = tok.decode(s.ids)
    assert "Reasoning Effort: " in text and "(range 1-100" in text
    assert text.endswith("<｜end▁of▁sentence｜>") and "</think>" + s.answer in text
    assert tok.decode(s.ids[: s.answer_start]).endswith("<｜Assistant｜><think>")
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
    assert (
        main(
            [
                "rl",
                "sft",
                "--preset",
                "tiny",
                "--vocab-size",
                "512",
                "--out",
                str(out),
                "--steps",
                "2",
                "--batch-size",
                "4",
                "--seq-len",
                "192",
                "--eval-every",
                "2",
                "--eval-batches",
                "1",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[-1]["step"] == 2 and "val_accuracy_direct" in rows[-1] and rows[-1]["loss"] > 0
    model = load_model(str(out / "checkpoint"))
    assert model.cfg.vocab_size == 512
    # its tokenizer files (for AutoTokenizer) are the byte tokenizer's, which dsv41 serves it with
    assert isinstance(load_tokenizer(str(out / "checkpoint"), 512), ByteTokenizer)


def test_the_echo_task_answers_the_effort_and_the_slope_ties_styles_to_it():
    tok = ByteTokenizer(1024)
    plain = EffortTaskText("train", tok)
    echo = EffortTaskText("train", tok, echo=0.3)
    samples = [echo.sample(i) for i in range(200)]
    echoes = [s for s in samples if s.task == "echo"]
    assert 40 <= len(echoes) <= 80  # about 30%
    for s in echoes:
        prompt, reply = tok.decode(s.ids[: s.answer_start]), tok.decode(s.ids[s.answer_start :])
        assert f"Reasoning Effort: {s.answer} (" in prompt and "What is your reasoning effort?" in prompt
        assert reply == f"{s.answer}</think>{s.answer}<｜end▁of▁sentence｜>"
    # the default stream is unchanged by the options existing (earlier runs' data)
    assert [plain.sample(i).ids for i in range(10)] == [
        EffortTaskText("train", tok, echo=0.0).sample(i).ids for i in range(10)
    ]
    # a negative slope: long replies more likely at low effort
    anti = EffortTaskText("train", tok, style_slope=-0.6)
    low = high = low_n = high_n = 0
    for i in range(600):
        s = anti.sample(i)
        b = int(tok.decode(s.ids).split("Reasoning Effort: ")[1].split(" ")[0])
        if b <= 30:
            low, low_n = low + (s.task == "scratchpad"), low_n + 1
        elif b >= 70:
            high, high_n = high + (s.task == "scratchpad"), high_n + 1
    assert low / low_n > 0.65 and high / high_n < 0.35
    assert anti.scratchpad_probability(1) == 0.8 and anti.scratchpad_probability(100) == 0.2
    for bad in (dict(echo=1.0), dict(echo=-0.1), dict(style_slope=1.5)):
        with pytest.raises(ValueError):
            EffortTaskText("train", tok, **bad)


def test_the_effort_line_opens_every_reply_with_the_prompt_effort():
    tok = ByteTokenizer(1024)
    data = EffortTaskText("train", tok, effort_line=True)
    styles = set()
    for i in range(30):
        s = data.sample(i)
        b = int(tok.decode(s.ids).split("Reasoning Effort: ")[1].split(" ")[0])
        reply = tok.decode(s.ids[s.answer_start :])
        assert reply.startswith(f"{b:03d}\n") and reply.endswith("</think>" + s.answer + "<｜end▁of▁sentence｜>")
        styles.add(s.task)
    assert styles == {"direct", "scratchpad"}
    # the same tasks and styles as without the line
    plain = EffortTaskText("train", tok)
    assert [plain.sample(i).answer for i in range(30)] == [data.sample(i).answer for i in range(30)]
    assert [plain.sample(i).task for i in range(30)] == [data.sample(i).task for i in range(30)]


def test_a_share_of_the_efforts_comes_from_the_rl_set():
    tok = ByteTokenizer(1024)
    plain = EffortTaskText("train", tok, effort_line=True)
    mixed = EffortTaskText("train", tok, effort_line=True, effort_set=(25, 50, 75, 100), effort_set_share=0.4)

    def effort(s):
        return int(tok.decode(s.ids).split("Reasoning Effort: ")[1].split(" ")[0])

    counts = {}
    for i in range(1000):
        s = mixed.sample(i)
        b = effort(s)
        counts[b] = counts.get(b, 0) + 1
        assert tok.decode(s.ids[s.answer_start :]).startswith(f"{b:03d}\n")  # the line follows the drawn effort
    # about 0.4 / 4 + 0.6 / 100 = 10.6% each for the set's efforts, 0.6% for any other
    for b in (25, 50, 75, 100):
        assert 70 <= counts[b] <= 145, (b, counts[b])
    assert max(n for b, n in counts.items() if b not in (25, 50, 75, 100)) <= 20
    # a share of 0 leaves the stream earlier runs trained on untouched
    same = EffortTaskText("train", tok, effort_line=True, effort_set=(25, 50, 75, 100), effort_set_share=0.0)
    assert [same.sample(i).ids for i in range(20)] == [plain.sample(i).ids for i in range(20)]
    for bad in (dict(effort_set_share=1.5), dict(effort_set_share=0.2), dict(effort_set=(0, 50), effort_set_share=0.2)):
        with pytest.raises(ValueError):
            EffortTaskText("train", tok, **bad)
