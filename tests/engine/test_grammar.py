"""Grammar-constrained decoding in the engine (dsv41/engine/grammar.py, issue 34 item 1): masks over the
byte vocabulary, JSON-schema output from random weights (where unconstrained output is noise) that always
validates, determinism and batch independence with masks in the batch, thinking mode (nothing constrained
before `</think>`), lossless DSpark verification, preemption and prefix caching."""

import json
import os

import pytest
import torch

from tests.conftest import GOLDEN_DIR, optional_import

optional_import("llguidance")
jsonschema = optional_import("jsonschema")

from dsv41.engine import SamplingParams  # noqa: E402
from dsv41.engine.grammar import GrammarCompiler  # noqa: E402
from dsv41.engine.types import GrammarSpec  # noqa: E402
from dsv41.tokenizer import BYTE_OFFSET, THINK_END_TOKEN, ByteTokenizer  # noqa: E402
from dsv41.weights import load_model  # noqa: E402
from tests.engine.helpers import make, prompts  # noqa: E402
from tests.engine.test_speculative import oracle  # noqa: E402

EOS = 1
# every part bounded, so that random weights finish well inside the token budget
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "kind", "tags", "at"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "at": {
            "type": "object",
            "required": ["x"],
            "additionalProperties": False,
            "properties": {"x": {"type": "string", "maxLength": 2}},
        },
    },
}


def byte(c: str) -> int:
    return BYTE_OFFSET + ord(c)


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(ByteTokenizer(1024), 1024)


def json_spec(engine, schema=SCHEMA, start_after=None) -> GrammarSpec:
    return GrammarSpec(engine.grammar_compiler.json_schema(schema), start_after, "json")


def valid(text: str, schema=SCHEMA) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_masks_follow_the_grammar_and_allow_eos_only_where_it_accepts(compiler):
    g = compiler.matcher(GrammarSpec(compiler.regex("ab+")))
    assert g.allowed([]).nonzero().flatten().tolist() == [byte("a")]
    g.advance(byte("a"))
    assert g.allowed([byte("a")]).nonzero().flatten().tolist() == [byte("b")]
    after_b = g.allowed([byte("a"), byte("b")]).nonzero().flatten().tolist()  # a draft position: rolled back
    assert after_b == [EOS, byte("b")]
    assert g.allowed([byte("a")]).nonzero().flatten().tolist() == [byte("b")]  # the state is unchanged
    assert not g.allowed([byte("a"), byte("c")]).any()  # after a draft the grammar rejects: unreachable
    with pytest.raises(ValueError, match="violates"):
        g.advance(byte("c"))


@pytest.mark.parametrize("threaded", [True, False])
def test_prefetched_batch_masks_equal_single_masks(compiler, threaded):
    """Both ways of computing a step's masks (llguidance's thread pool, used from 4 cores, and one request
    after another) give each request the mask it computes alone."""
    import llguidance

    compiler._executor = llguidance.LLExecutor() if threaded else None
    specs = [compiler.regex("[0-9]{2}x"), compiler.json_schema(SCHEMA), compiler.lark('start: "ab" | "ac"')]
    batched = [compiler.matcher(GrammarSpec(s)) for s in specs]
    single = [compiler.matcher(GrammarSpec(s)) for s in specs]
    for g, first in zip(batched, (byte("1"), byte("{"), byte("a"))):
        g.advance(first)
    for g, first in zip(single, (byte("1"), byte("{"), byte("a"))):
        g.advance(first)
    compiler.prefetch(batched)
    for b, s in zip(batched, single):
        assert () in b._masks
        assert torch.equal(b.allowed([0]), s.allowed([0]))


def test_tool_call_grammar_accepts_what_the_template_renders(compiler):
    """The DSML grammar of tool_choice "required" takes the chat template's own rendering of valid calls
    (raw strings, enums, JSON values, a call without parameters, two calls) up to EOS, and refuses an
    unknown tool, a missing required parameter and a value outside its schema."""
    from dsv41.chat.dsml import render_tool_calls
    from dsv41.server.structured import tool_call_lark

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "required": ["city", "days"],
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                        "unit": {"enum": ["c", "f"]},
                        "at": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
                    },
                },
            },
        },
        {"type": "function", "function": {"name": "ping"}},
    ]
    tok = ByteTokenizer(1024)
    grammar = compiler.lark(tool_call_lark(tools, tok.token_to_id("｜DSML｜"), parallel=True))
    single = compiler.lark(tool_call_lark(tools, tok.token_to_id("｜DSML｜"), parallel=False))

    def takes(g, calls) -> bool:
        ids = tok.encode("\n\n" + render_tool_calls(calls), add_bos=False)
        m = compiler.matcher(GrammarSpec(g))._m
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    def call(name, **args):
        return {"type": "function", "function": {"name": name, "arguments": args}}

    good = [call("get_weather", city="Paris 2", days=3), call("ping")]
    assert takes(grammar, good) and takes(grammar, [call("get_weather", city="", days=7, unit="f", at={"lat": 1.5})])
    assert takes(single, good[:1]) and not takes(single, good)
    for bad in (
        [call("other")],
        [call("get_weather", city="Paris")],
        [call("get_weather", city="x", days=9)],
        [call("get_weather", city="x", days=2, unit="k")],
    ):
        assert not takes(grammar, bad), bad


def test_bad_grammars_raise_value_error(compiler):
    for make_bad in (
        lambda: compiler.regex("a(b"),
        lambda: compiler.json_schema({"type": "foo"}),
        lambda: compiler.lark("start: nowhere"),
        lambda: compiler.json_schema([1]),
    ):
        with pytest.raises(ValueError):
            make_bad()


def test_constrained_output_from_random_weights_always_validates(model):
    engine = make(model)
    batch = prompts([7, 12, 5])
    free = engine.generate(batch, [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in range(3)])
    assert not any(valid(o.text) for o in free)  # unconstrained: noise
    spec = json_spec(engine)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured=spec) for s in range(3)]
    outs = engine.generate(batch, params)
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] == EOS, o.text
        assert valid(o.text), o.text
    # determinism and batch independence: one request alone gives the tokens it had in the batch
    (alone,) = make(model).generate([batch[2]], [params[2]])
    assert alone.token_ids == outs[2].token_ids


def test_ignore_eos_still_ends_when_the_grammar_is_complete(model):
    engine = make(model)
    spec = GrammarSpec(engine.grammar_compiler.lark('start: "yes" | "no"'))
    (out,) = engine.generate(
        prompts([6]), SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, structured=spec)
    )
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_thinking_is_not_constrained_before_think_end(model):
    engine = make(model)
    think_end = engine.tokenizer.token_to_id(THINK_END_TOKEN)
    spec = json_spec(engine, start_after=think_end)
    # the bias puts </think> first; a mask from the first token would forbid it (it is no JSON)
    (out,) = engine.generate(
        prompts([8]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=100, structured=spec, logit_bias={think_end: 100.0}),
    )
    assert out.token_ids[0] == think_end and out.finish_reason == "stop"
    assert valid(out.text.split(THINK_END_TOKEN, 1)[1]), out.text
    # a few free tokens before it: unconstrained there (the tiny model's greedy tokens are no JSON)
    g = engine.grammar_compiler.matcher(spec)
    assert g.allowed([]) is None and g.allowed([5, 6]) is None and g.allowed([5, think_end]) is not None


def test_preemption_keeps_the_grammar_state(model):
    batch = prompts([30, 5, 40, 12])
    engine = make(model, kv_pool_tokens=96)
    spec = json_spec(engine)
    outs = engine.generate(
        batch, [SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured=spec) for s in range(len(batch))]
    )
    assert engine.counters["preemptions_total"] > 0
    for o in outs:
        assert o.finish_reason == "stop" and valid(o.text), o.text


def test_prefix_cache_hit_is_masked_too(model):
    """A repeat of a prompt starts from the kept logits of its last position (nothing recomputed): the
    first token is masked there as well, and the replies equal the first ones."""
    engine = make(model, enable_prefix_caching=True)
    spec = json_spec(engine)
    batch = prompts([21, 16])
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured=spec) for s in range(2)]
    first = engine.generate(batch, params)
    second = engine.generate(batch, params)
    assert engine.metrics()["prefix_cache_snapshot_hits"] > 0
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert all(valid(o.text) for o in second)


@pytest.fixture(scope="module")
def dspark():
    return load_model(os.path.join(GOLDEN_DIR, "v41-dspark-fp8"))


@pytest.fixture(scope="module")
def plain_constrained(dspark):
    """(prompts, params, plain constrained greedy outputs): decoded once for both drafters below."""
    batch = prompts([9, 23])
    plain_engine = make(dspark)
    params = SamplingParams(temperature=0, max_tokens=100, structured=json_spec(plain_engine))
    return batch, params, [o.token_ids for o in plain_engine.generate(batch, params)]


# the drafter's own drafts alone are in the slow tier: with the oracle (0.3) the drafter still drafts under the
# mask each step, and the wrong tokens put in its place are rejected by the grammar
@pytest.mark.parametrize("wrong", [pytest.param(None, marks=pytest.mark.slow), 0.3])
def test_speculative_decoding_stays_lossless_with_a_grammar(dspark, plain_constrained, monkeypatch, wrong):
    """Greedy constrained output with DSpark verification equals plain constrained decoding: the drafter's
    own drafts (sampled under the mask) and oracle drafts with wrong tokens the grammar rejects."""
    batch, params, plain = plain_constrained
    assert all(valid(ByteTokenizer(dspark.cfg.vocab_size).decode(t[:-1])) for t in plain)
    if wrong is not None:
        oracle(monkeypatch, {tuple(p): t for p, t in zip(batch, plain)}, wrong)
    engine = make(dspark, speculative=True)
    assert [o.token_ids for o in engine.generate(batch, params)] == plain
    if wrong is not None:
        assert engine.metrics()["spec_decode_accepted_tokens_total"] > 0
