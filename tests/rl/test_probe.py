"""The style-choice probe: P(</think>) right after the effort line, per effort."""

import json

import pytest
import torch

from dsv41.cli import main
from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.rl.probe import choice_prompt, direct_probabilities
from dsv41.rl.tasks import arithmetic_task
from dsv41.tokenizer import THINK_END_TOKEN, ByteTokenizer


class ReadsItsEffortLine(torch.nn.Module):
    """A stand-in model whose P(</think>) is b / 100, b read from the last four tokens ('025' + newline),
    and which puts the rest of the mass on one other token."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.end = tokenizer.encode(THINK_END_TOKEN, add_bos=False)[0]
        self.calls = 0

    def forward(self, ids, last_only=False):
        self.calls += 1
        line = self.tokenizer.decode(ids[0, -4:].tolist())
        assert line.endswith("\n") and line[:3].isdigit(), line
        b = int(line[:3])
        logits = torch.full((1, 1, self.tokenizer.vocab_size), -1e9)
        logits[0, 0, self.end] = torch.tensor(b / 100).log()
        logits[0, 0, ord("7")] = torch.tensor(1 - b / 100).log() if b < 100 else -1e9
        return logits


def test_the_probe_reads_the_token_after_the_right_effort_line():
    tok = ByteTokenizer(1024)
    model = ReadsItsEffortLine(tok)
    got = direct_probabilities(model, tok, efforts=(1, 25, 60, 100), prompts=3)
    assert got == pytest.approx({1: 0.01, 25: 0.25, 60: 0.60, 100: 1.0}, abs=1e-6)
    assert model.calls == 4 * 3
    with pytest.raises(ValueError, match="1..100"):
        direct_probabilities(model, tok, efforts=(0, 50))
    with pytest.raises(ValueError, match="prompts"):
        direct_probabilities(model, tok, prompts=0)


def test_the_probe_matches_the_full_sequence_softmax_of_a_real_model():
    cfg = tiny()
    model = Transformer(cfg)
    init_random_weights(model, seed=3)
    tok = ByteTokenizer(cfg.vocab_size)
    end = tok.encode(THINK_END_TOKEN, add_bos=False)[0]
    got = direct_probabilities(model, tok, efforts=(30, 90), prompts=2, with_line=False)
    for b in (30, 90):
        # independently: the whole sequence's logits (no last_only), the distribution at the last position
        expected = []
        for i in range(2):
            task = arithmetic_task("eval", 0, 1000 + i, 2, 2)
            ids = choice_prompt(tok, task, b, with_line=False)
            assert tok.decode(ids).endswith("<｜Assistant｜><think>")
            with torch.no_grad():
                logits = model(torch.tensor([ids]))[0, -1].float()
            expected.append(float(torch.softmax(logits, -1)[end]))
        assert got[b] == pytest.approx(sum(expected) / 2, rel=1e-4)
    assert got[30] != got[90]  # the prompt (and its effort) reaches the logits


def test_rl_choice_prints_a_row_per_effort_and_refuses_bad_efforts(capsys):
    assert main(["rl", "choice", "--model", "tiny", "--efforts", "10,90", "--prompts", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 10 |" in out and "| 90 |" in out
    probs = json.loads(out.strip().splitlines()[-1])["p_direct"]
    assert set(probs) == {"10", "90"} and all(0.0 < p < 1.0 for p in probs.values())
    with pytest.raises(SystemExit, match="1..100"):
        main(["rl", "choice", "--model", "tiny", "--efforts", "0,50", "--prompts", "1"])
    with pytest.raises(SystemExit, match="comma-separated"):
        main(["rl", "choice", "--model", "tiny", "--efforts", "x", "--prompts", "1"])
    with pytest.raises(SystemExit, match="min_digits <= max_digits"):
        main(["rl", "choice", "--model", "tiny", "--min-digits", "3", "--max-digits", "2", "--prompts", "1"])
