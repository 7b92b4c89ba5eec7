"""dsv41.eval.lm_eval_model: the lm-evaluation-harness model over the engine, against independent
computations on the plain model forward, and an offline end-to-end simple_evaluate."""

import json

import pytest
import torch

from tests.conftest import optional_import

lm_eval = optional_import("lm_eval")  # required under DSV41_REQUIRE_OPTIONAL (.ci/run)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from dsv41.config import tiny  # noqa: E402
from dsv41.engine import EngineConfig, LLMEngine  # noqa: E402
from dsv41.eval.lm_eval_model import DSV41LM  # noqa: E402
from dsv41.model.init import init_random_weights  # noqa: E402
from dsv41.model.transformer import Transformer  # noqa: E402
from dsv41.tokenizer import BOS, ByteTokenizer  # noqa: E402

CONTEXT_LIMIT = 64  # small, so that long texts need several rolling windows and long contexts are cut


@pytest.fixture(scope="module")
def model():
    return init_random_weights(Transformer(tiny()), seed=1).eval()


@pytest.fixture(scope="module")
def lm(model):
    """Small prefill chunks (several per prompt) and room for many requests at once."""
    config = EngineConfig(
        block_size=8,
        kv_pool_tokens=8192,
        prefill_chunk_size=16,
        max_num_batched_tokens=128,
        max_num_seqs=16,
        max_model_len=CONTEXT_LIMIT,
    )
    return DSV41LM(engine=LLMEngine(model, ByteTokenizer(1024), config), max_gen_toks=24)


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def encode(text):
    """The byte tokenizer's ids of `text`, written out independently: one id per UTF-8 byte, 3 + byte."""
    return [3 + b for b in text.encode("utf-8")]


def plain_logprobs(model, tokens):
    """log_softmax of one plain forward: row p scores tokens[p + 1] ([len - 1, vocab])."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens]))[0, :-1].float(), dim=-1)


def reference_loglikelihood(model, context_ids, continuation_ids):
    """Sum of the plain forward's log-probabilities at the continuation positions, and whether each
    continuation token is the argmax there."""
    tokens = context_ids + continuation_ids
    logp = plain_logprobs(model, tokens)
    rows = range(len(context_ids) - 1, len(tokens) - 1)
    picked = [float(logp[p, tokens[p + 1]]) for p in rows]
    return sum(picked), all(int(logp[p].argmax()) == tokens[p + 1] for p in rows)


PAIRS = [
    ("", "Hello"),
    ("The cat sat on the", " mat"),
    ("Question: 2 + 2 =", " 4"),
    ("Trailing space ", "moves"),
    ("A much longer context that spans several prefill chunks of sixteen", " ok"),
    ("x" * 90, " cut from the left"),
]


def test_loglikelihood_equals_the_plain_forward(lm, model):
    results = lm.loglikelihood([request("loglikelihood", c, x) for c, x in PAIRS])
    for (context, continuation), (logprob, greedy) in zip(PAIRS, results):
        if context.endswith(" "):  # lm-eval's convention: the space belongs to the continuation
            context, continuation = context[:-1], " " + continuation
        ids = [BOS] + encode(context) + encode(continuation)
        ids = ids[-(CONTEXT_LIMIT - 1) :]  # a context too long for the limit keeps its end
        n = len(encode(continuation))
        expected, expected_greedy = reference_loglikelihood(model, ids[:-n], ids[-n:])
        assert abs(logprob - expected) < 1e-4, (context, logprob, expected)
        assert greedy == expected_greedy


def test_is_greedy_for_the_models_own_argmax_tokens(lm, model):
    """A continuation made of the model's own greedy choices is greedy; changing its last token is not."""
    context = [BOS] + encode("Once upon a time")
    tokens = list(context)
    for _ in range(6):
        tokens.append(int(plain_logprobs(model, tokens + [0])[-1].argmax()))
    greedy = tokens[len(context) :]
    other = greedy[:-1] + [(greedy[-1] + 1) % 1024]
    (lp, is_greedy), (lp_other, other_greedy) = lm._score([(context, greedy), (context, other)])
    assert is_greedy and not other_greedy
    assert lp > lp_other
    assert abs(lp - reference_loglikelihood(model, context, greedy)[0]) < 1e-4


def test_requests_are_batched_on_the_engine(lm, monkeypatch):
    """All requests of a call are queued at once: the engine runs several of them in one step."""
    running = []
    step = lm.engine.step

    def spy():
        out = step()
        running.append(len(lm.engine.running) + sum(o.finished for o in out))
        return out

    monkeypatch.setattr(lm.engine, "step", spy)
    lm.loglikelihood([request("loglikelihood", f"Context number {i}:", " yes") for i in range(12)])
    assert max(running) > 4


def rolling_reference(model, tokens, window):
    """lm-eval's rolling log-likelihood written out from its definition: every token predicted once; the
    first `window` from BOS + the tokens before them, then blocks of `window` tokens, each from the
    `window` tokens before its last one."""
    total, done = 0.0, 0
    while done < len(tokens):
        end = min(len(tokens), done + window)
        inputs = [BOS] + tokens[: end - 1] if done == 0 else tokens[end - window - 1 : end - 1]
        logp = plain_logprobs(model, inputs + [tokens[end - 1]])
        offset = end - len(inputs)  # inputs[j] is tokens[offset + j - 1] for the blocks after the first
        total += sum(float(logp[i - offset, tokens[i]]) for i in range(done, end))
        done = end
    return total


def test_loglikelihood_rolling_equals_the_plain_forward(lm, model):
    texts = ["short text", "a longer document " * 9]  # 162 bytes: three windows of the 64-token limit
    results = lm.loglikelihood_rolling([request("loglikelihood_rolling", t) for t in texts])
    for text, logprob in zip(texts, results):
        expected = rolling_reference(model, encode(text), CONTEXT_LIMIT - 2)
        assert abs(logprob - expected) < 1e-4, (text, logprob, expected)


def test_generate_until_stops_at_the_until_strings(lm):
    """The until string is a character the (random) model writes when run free: the output is cut just
    before its first occurrence, also when it is the fifth string (past what the engine checks)."""
    contexts = ["Write something:", "Story:", "Hello there.", "Once upon a time", "Q: why? A:"]
    free = lm.generate_until([request("generate_until", c, {"until": [], "max_gen_toks": 24}) for c in contexts])
    printable = [
        (c, f, next((ch for ch in f[1:] if ch.isprintable() and ch != "\ufffd"), None)) for c, f in zip(contexts, free)
    ]
    context, free, stop = next(p for p in printable if p[2] is not None)
    cut = free[: free.index(stop)]
    many = ["never-1", "never-2", "never-3", "never-4", stop]  # the fifth is past what the engine checks
    got = lm.generate_until(
        [
            request("generate_until", context, {"until": [stop], "max_gen_toks": 24}),
            request("generate_until", context, {"until": many, "max_gen_toks": 24}),
            request("generate_until", context, {"until": stop, "do_sample": False, "max_gen_toks": 3}),
        ]
    )
    assert got[0] == cut and got[1] == cut
    assert len(got[2].encode("utf-8")) <= 3
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until([request("generate_until", context, {"until": [], "num_beams": 4})])


def test_duplicates_empty_and_oversized_continuations(lm):
    same = request("loglikelihood", "abc", "def")
    first, second, empty = lm.loglikelihood([same, same, request("loglikelihood", "abc", "")])
    assert first == second and empty == (0.0, True)
    with pytest.raises(ValueError, match="does not fit"):
        lm.loglikelihood([request("loglikelihood", "abc", "y" * CONTEXT_LIMIT)])


def test_registered_and_validated():
    assert get_model("dsv41") is DSV41LM
    with pytest.raises(TypeError, match="not_an_option"):
        DSV41LM.create_from_arg_string("pretrained=tiny,not_an_option=3")


def test_simple_evaluate_offline_multiple_choice(lm, model, tmp_path):
    """lm-eval end to end on a local multiple-choice task (a JSON file and a YAML task, no download)."""
    rows = [
        {"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b + 7)], "answer": 0}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2)]
    ]
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dsv41_add.yaml").write_text(f"""task: dsv41_add
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["dsv41_add"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False)
    )
    scores = results["results"]["dsv41_add"]
    assert scores["sample_len"] == len(rows)
    # the accuracy an independent scorer implies (plain forward log-softmax, the byte ids written out):
    # a question is right when its answer's continuation " <choice>" has the highest log-likelihood
    hits = []
    for r in rows:
        context = [BOS] + encode(f"Question: {r['question']}\nAnswer:")
        logliks = [reference_loglikelihood(model, context, encode(" " + c))[0] for c in r["choices"]]
        hits.append(max(range(3), key=lambda k: logliks[k]) == r["answer"])
    assert scores["acc,none"] == pytest.approx(sum(hits) / len(rows))


@pytest.mark.slow
def test_lm_eval_cli_with_dsv41_imported_first(tmp_path):
    """The CLI form docs/hf-and-lm-eval.md gives: lm-eval's own CLI, run after importing the adapter (the
    harness has no plugin discovery). Its default --device cuda:0 falls back to the CPU here."""
    import os
    import subprocess
    import sys

    (tmp_path / "one.jsonl").write_text(json.dumps({"q": "1 + 1 =", "choices": [" 2", " 3"], "answer": 0}) + "\n")
    (tmp_path / "dsv41_one.yaml").write_text(f"""task: dsv41_one
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "one.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    code = "import dsv41.eval.lm_eval_model; from lm_eval.__main__ import cli_evaluate; cli_evaluate()"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "run",
            "--model",
            "dsv41",
            "--model_args",
            "pretrained=tiny,max_num_seqs=4",
            "--tasks",
            "dsv41_one",
            "--include_path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dsv41_one" in out.stdout and "acc" in out.stdout
