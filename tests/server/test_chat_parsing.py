"""The server's split of generated text into reasoning / content / tool calls, and /metrics rendering."""

import json
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv41.chat.dsml import parse_assistant_output, render_tool_calls
from dsv41.server.chat import ChatStreamSplitter, parse_chat_output, parse_tool_calls, resolve_thinking
from dsv41.server.metrics import ServerMetrics

CALLS = [
    {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
    {"type": "function", "function": {"name": "now", "arguments": "{}"}},
]
TURNS = [
    # (thinking, completion text)
    (True, "Let me look it up.</think>Checking.\n\n" + render_tool_calls(CALLS)),
    (True, "hmm < / think? <thin</think>The answer is 4 </thi"),
    (False, "Plain answer with <｜DSML｜ in the middle but no calls block"),
    (False, "\n\n" + render_tool_calls(CALLS[:1])),
    (True, "cut off while reasoning </thi"),
    (False, "Two blank lines\n\n\n\nthen text"),
]


def _stream(text, thinking, tools, rng):
    """Feed `text` in random pieces; return the streamed (reasoning, content, tool_text)."""
    sp = ChatStreamSplitter(thinking=thinking, tools=tools)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces += sp.feed(text[i : i + n])
        i += n
    pieces += sp.finish()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return reasoning, content, sp.tool_text


@pytest.mark.parametrize("thinking,text", TURNS)
def test_streamed_split_equals_the_parser_for_any_chunking(thinking, text):
    rng = random.Random(0)
    expected = parse_assistant_output(text, thinking)
    for _ in range(25):
        reasoning, content, tool_text = _stream(text, thinking, True, rng)
        assert reasoning == (expected.reasoning_content or "")
        assert content == expected.content
        calls = parse_tool_calls(tool_text) if tool_text else []
        assert [c["function"] for c in calls] == [c["function"] for c in expected.tool_calls]


def test_tool_calls_become_openai_dicts_with_content_none():
    out = parse_chat_output(TURNS[3][1], thinking=False, tools=True)
    assert out.content is None and out.reasoning_content is None
    (call,) = out.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}

    out = parse_chat_output(TURNS[0][1], thinking=True, tools=True)
    assert out.reasoning_content == "Let me look it up." and out.content == "Checking."
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "now"]


def test_without_tools_dsml_stays_text_and_malformed_calls_are_not_lost():
    text = "Hi\n\n" + render_tool_calls(CALLS[:1])
    out = parse_chat_output(text, thinking=False, tools=False)
    assert out.tool_calls == [] and out.content == text
    broken = 'Hi\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="x">\n'  # cut off by max_tokens
    out = parse_chat_output(broken, thinking=False, tools=True)
    assert out.tool_calls == [] and out.content == broken
    assert parse_tool_calls(broken[4:]) == []


def test_end_of_sentence_text_is_never_content():
    sp = ChatStreamSplitter(thinking=False, tools=False)
    pieces = sp.feed("Done.<｜end▁of") + sp.feed("▁sentence｜>") + sp.finish()
    assert "".join(t for _, t in pieces) == "Done."


def test_resolve_thinking():
    assert resolve_thinking(None, None) == (False, None)
    assert resolve_thinking({"thinking": True}, None) == (True, None)
    assert resolve_thinking(None, "low") == (True, 50)  # an effort asks for thinking
    assert resolve_thinking(None, 80) == (True, 80)
    assert resolve_thinking({"thinking": False}, "max") == (False, None)
    assert resolve_thinking({"enable_thinking": True}, "max") == (True, 100)
    for bad_kwargs, bad_effort in [({"thinking": "yes"}, None), (None, 0), (None, 101), (None, "ultra")]:
        with pytest.raises(ValueError):
            resolve_thinking(bad_kwargs, bad_effort)


def test_metrics_exposition():
    """Rendered by prometheus_client and read back with its parser: engine figures under their names and
    types, the server's counters and histograms."""
    engine = {
        "waiting": 3,
        "running": 2,
        "kv_usage": 0.125,
        "generation_tokens_total": 40,
        "new_thing_total": 5,
        "new_gauge": 1.5,
        "label": "ignored",
    }
    m = ServerMetrics(lambda: engine)
    m.response("/v1/completions", 200)
    m.response("/v1/completions", 200)
    m.response("/v1/completions", 429)
    m.rejected_queue_full.inc()
    m.finished(e2e_s=0.3, queue_time_s=0.01, prompt_tokens=7, generation_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("dsv41_num_requests_waiting", ())] == 3 and families["dsv41_num_requests_waiting"].type == "gauge"
    assert samples[("dsv41_kv_cache_usage_ratio", ())] == 0.125
    assert families["dsv41_generation_tokens"].type == "counter"
    assert samples[("dsv41_generation_tokens_total", ())] == 40
    assert families["dsv41_new_thing"].type == "counter" and families["dsv41_new_gauge"].type == "gauge"
    assert samples[("dsv41_http_responses_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2
    assert samples[("dsv41_http_responses_total", (("endpoint", "/v1/completions"), ("status", "429")))] == 1
    assert samples[("dsv41_requests_rejected_queue_full_total", ())] == 1
    assert not any("label" in name for name in families)
    assert families["dsv41_request_prompt_tokens"].type == "histogram"
    assert samples[("dsv41_request_prompt_tokens_sum", ())] == 7
    assert samples[("dsv41_request_generation_tokens_count", ())] == 1
    assert samples[("dsv41_e2e_request_latency_seconds_bucket", (("le", "0.5"),))] == 1
    assert samples[("dsv41_e2e_request_latency_seconds_bucket", (("le", "0.25"),))] == 0
    assert samples[("dsv41_request_queue_time_seconds_count", ())] == 1
    # each ServerMetrics has its own registry: a second one starts from zero
    assert b"dsv41_requests_rejected_queue_full_total 0.0" in ServerMetrics().render()
