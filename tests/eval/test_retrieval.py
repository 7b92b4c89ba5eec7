"""dsv41.eval.retrieval: the prompts, the scoring (a model that copies passes, one that does not fails) and
the real tiny model through the engine end to end."""

import json
import os
import re

import numpy as np
import pytest

from dsv41.config import tiny
from dsv41.eval.retrieval import (
    Haystack,
    RetrievalConfig,
    build_probe,
    engine_config,
    parse_depths,
    run_grid,
    run_retrieval,
    score,
)
from dsv41.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(1024)


class Copier:
    """A scripted model that reads the prompt and copies the answer out of it, as a model that can
    retrieve would: the pass key, the values of the keys the question names, or the variables of the
    chain. `keep` answers only the first N values (a partial recall)."""

    def __init__(self, keep=None):
        self.tokenizer, self.keep = TOKENIZER, keep

    def answer(self, text: str) -> list[str]:
        question = text[text.rindex("\n") :]
        if "pass key" in question:
            return re.findall(r"The pass key is (\d+)\. Remember it", text)[:1]
        if "magic number" in question:
            asked = re.findall(r"\b([a-z]+-[a-z]+)\b", question.split("?")[0])
            return [re.search(rf"magic numbers for {k} is: (\d+)\.", text).group(1) for k in asked]
        value = re.search(r"assigned the value (\d+)", question).group(1)
        names = [re.search(rf"VAR (\w+) = {value}\.", text).group(1)]
        while (m := re.search(rf"VAR (\w+) = VAR {names[-1]}\.", text)) is not None:
            names.append(m.group(1))
        return names

    def complete(self, prompts, max_new_tokens):
        outs = []
        for p in prompts:
            answers = self.answer(self.tokenizer.decode(p))[: self.keep]
            ids = self.tokenizer.encode(" " + ", ".join(answers) + ".", add_bos=False)
            assert len(ids) <= max_new_tokens, "the harness must leave room for the answer"
            outs.append(ids)
        return outs


class Noise:
    """A model that answers with text that never contains an answer."""

    tokenizer = TOKENIZER

    def complete(self, prompts, max_new_tokens):
        return [TOKENIZER.encode(" I do not know, sorry.", add_bos=False)[:max_new_tokens] for _ in prompts]


CASES = [
    ("passkey", {}),
    ("niah", {"keys": 1, "queries": 1}),
    ("niah", {"keys": 3, "queries": 1}),
    ("niah", {"keys": 3, "queries": 2}),
    ("vartrack", {"hops": 3}),
]


@pytest.mark.parametrize(
    "task,options", CASES, ids=[f"{t}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for t, o in CASES]
)
def test_a_model_that_copies_passes_and_one_that_does_not_fails(task, options):
    haystack = Haystack(TOKENIZER)
    kwargs = dict(lengths=[700, 900], depths=[0.0, 0.3, 1.0], samples=2, haystack=haystack, seed=3, **options)
    copier = run_grid(Copier(), task, **kwargs)
    assert np.array(copier["accuracy"]).shape == (3, 2)
    assert copier["overall"] == 1.0 and np.all(np.array(copier["exact"]) == 1.0)
    noise = run_grid(Noise(), task, **kwargs)
    assert noise["overall"] == 0.0
    partial = run_grid(Copier(keep=1), task, **kwargs)
    n_answers = {"passkey": 1, "niah": options.get("queries", 1), "vartrack": options.get("hops", 0) + 1}[task]
    assert partial["overall"] == pytest.approx(1 / n_answers)  # one answer of n recalled
    assert len(copier["records"]) == 2 * 3 * 2


class RecentCopier(Copier):
    """A copier that sees only the last `window` tokens of the prompt: it finds needles near the question
    and misses the others, so its score depends on both depth and length."""

    def __init__(self, window):
        super().__init__()
        self.window = window

    def complete(self, prompts, max_new_tokens):
        return super().complete([p[-self.window :] for p in prompts], max_new_tokens)


def test_the_grid_puts_each_score_in_its_cell():
    """Depth 0 of a 700-token prompt sits within the last 600 tokens, of a 1,500-token one not; depth 1 always
    does: rows are depths, columns lengths."""
    result = run_grid(RecentCopier(600), "passkey", [700, 1500], [0.0, 1.0], 2, Haystack(TOKENIZER), seed=1)
    assert result["accuracy"] == [[1.0, 0.0], [1.0, 1.0]]
    assert [b["accuracy"] for b in result["by_length"]] == [1.0, 0.5] and result["overall"] == 0.75


def test_prompts_have_the_exact_length_and_the_needle_at_its_depth(text_file):
    held = np.array(TOKENIZER.encode(open(text_file).read(), add_bos=True))
    for haystack in (Haystack(TOKENIZER), Haystack(TOKENIZER, held, "text")):
        answers = set()
        positions = []
        for depth in (0.0, 0.5, 1.0):
            p = build_probe("passkey", TOKENIZER, haystack, 600, depth, sample=1, seed=5)
            assert len(p.prompt) == 600 and p.prompt[0] == TOKENIZER.bos_id
            text = TOKENIZER.decode(p.prompt[p.needle_at[0] :])
            assert text.startswith(f" The pass key is {p.answers[0]}. Remember it.")
            answers.add(p.answers[0])
            positions.append(p.needle_at[0])
            if depth == 0.0:  # right after the instruction
                assert TOKENIZER.decode(p.prompt[: p.needle_at[0]]).endswith("information there.\n")
            if depth == 1.0:  # right before the question
                assert text.endswith("is the pass key.\nWhat is the pass key? The pass key is")
            else:  # at a sentence boundary of the filler
                assert TOKENIZER.decode(p.prompt[: p.needle_at[0]]).rstrip().endswith((".", "\n"))
        assert positions == sorted(positions) and positions[0] < positions[1] < positions[2]
        assert len(answers) == 1  # the same sample at every depth: only the needle's place changes


def test_vartrack_chain_is_in_order_and_niah_keys_are_distinct():
    p = build_probe("vartrack", TOKENIZER, Haystack(TOKENIZER), 800, 0.2, 0, hops=4)
    assert len(p.answers) == 5 and len(set(p.answers)) == 5
    assert p.needle_at == sorted(p.needle_at)
    p = build_probe("niah", TOKENIZER, Haystack(TOKENIZER), 900, 0.5, 0, keys=4, queries=4)
    assert len(set(p.answers)) == 4


def test_score_counts_whole_words_only():
    assert score(["71432"], " 71432.") == 1.0
    assert score(["71432"], "the key is 714321") == 0.0
    assert score(["71432"], "x71432") == 0.0
    assert score(["ABCDE", "FGHIJ"], " abcde, and something else") == 0.5
    with pytest.raises(ValueError):
        score([], "anything")


def test_real_tiny_model_through_the_engine_writes_table_json_and_heatmap(tiny_eval, tmp_path, capsys):
    """Plumbing on the random-weight tiny model: the grid's shape, scores in [0, 1], the files."""
    out = str(tmp_path / "ev")
    cfg = RetrievalConfig(task="passkey", lengths="320,400", depths="0,1", samples=1, out=out)
    result = run_retrieval(cfg, {"prefill_chunk_size": 128, "max_num_batched_tokens": 256}, tiny_eval)
    saved = json.load(open(os.path.join(out, "passkey.json")))
    grid = np.array(saved["accuracy"], dtype=float)
    assert grid.shape == (2, 2) and np.all((grid >= 0) & (grid <= 1))
    assert saved["lengths"] == [320, 400] and saved["depths"] == [0.0, 1.0] and len(saved["records"]) == 4
    assert saved["engine"]["prefill_mode"] == "bounded" and saved["engine"]["prefill_chunk_size"] == 128
    assert all(len(r["output"]) >= 0 and r["answers"] for r in saved["records"])
    assert open(os.path.join(out, "passkey.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert result["overall"] == saved["overall"]
    assert "| depth \\ length | 320 | 400 |" in capsys.readouterr().out


def test_multikey_niah_is_named_by_its_shape(tmp_path):
    """A scripted completer through run_retrieval: files named niah_k3_q2, accuracy 1 for the copier."""
    cfg = RetrievalConfig(task="niah", keys=3, queries=2, lengths="800", depths="0.5", samples=1, out=str(tmp_path))
    result = run_retrieval(cfg, completer=Copier())
    assert result["overall"] == 1.0
    assert os.path.isfile(tmp_path / "niah_k3_q2.json") and os.path.isfile(tmp_path / "niah_k3_q2.png")


def test_bad_input_is_refused_with_a_clear_error(tiny_eval, tmp_path):
    with pytest.raises(ValueError, match="fractions"):
        parse_depths("0,1.5")
    with pytest.raises(ValueError, match="--queries 3"):
        RetrievalConfig(task="niah", keys=2, queries=3).validate()
    with pytest.raises(ValueError, match="task must be one of"):
        RetrievalConfig(task="haystack").validate()
    with pytest.raises(ValueError, match="too short"):
        build_probe("niah", TOKENIZER, Haystack(TOKENIZER), 200, 0.5, 0, keys=3, queries=1)
    with pytest.raises(ValueError, match="--extrapolate"):
        run_retrieval(RetrievalConfig(lengths="8K", out=str(tmp_path)), em=tiny_eval)
    with pytest.raises(ValueError, match="not a positive token count"):
        run_retrieval(RetrievalConfig(lengths="1K,-5", out=str(tmp_path)), em=tiny_eval)
    # --extrapolate raises the engine's context limit to fit the longest prompt and its answer
    config = engine_config({}, 8192, 20, tiny(), extrapolate=True)
    assert config.max_model_len == 8192 + 20 + 1 and config.kv_pool_tokens >= 2 * (8192 + 21)
    with pytest.raises(ValueError, match="does not fit"):
        engine_config({"max_model_len": 1000}, 1024, 20, tiny(), extrapolate=False)
