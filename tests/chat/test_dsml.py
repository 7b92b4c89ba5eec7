"""DSML tool-call rendering and completion parsing (spec §11)."""

import json

import pytest

from dsv41.chat import encode_messages, parse_assistant_output, render_tool_calls
from dsv41.chat.dsml import ParsedOutput

EOS = "<｜end▁of▁sentence｜>"
ARGS = {
    "city": "Zürich",
    "days": 3,
    "ratio": 0.5,
    "metric": True,
    "note": None,
    "tags": ["a", "b"],
    "opts": {"unit": "c", "n": [1, 2]},
    "looks_numeric": "42",
    "empty": "",
    "multi": "line1\nline2",
}


def call(cid, name, arguments):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def completion_after_last_header(prompt: str, header: str) -> str:
    return prompt[prompt.rindex(header) + len(header) :]


@pytest.mark.parametrize("thinking", [False, True])
def test_round_trip_through_the_encoder(thinking):
    calls = [call("c1", "get_weather", json.dumps(ARGS)), call("c2", "ping", "{}"), call("c3", "echo", {"x": "y"})]
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "think first", "tool_calls": calls},
    ]
    prompt = encode_messages(msgs, thinking=thinking, add_generation_prompt=False)
    text = completion_after_last_header(prompt, "<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    parsed = parse_assistant_output(text, thinking=thinking)
    assert parsed.content == "Checking."
    assert parsed.reasoning_content == ("think first" if thinking else None)
    got = [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in parsed.tool_calls]
    assert got == [("get_weather", ARGS), ("ping", {}), ("echo", {"x": "y"})]
    assert all(tc["type"] == "function" and tc["id"].startswith("call_") for tc in parsed.tool_calls)
    assert len({tc["id"] for tc in parsed.tool_calls}) == 3


def test_string_flag_decides_the_type():
    text = (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="true">42</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="b" string="false">42</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="c" string="false">{"k": [true, null]}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="d" string="true">{"k": 1}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS
    )
    parsed = parse_assistant_output(text, thinking=False)
    assert parsed.content == ""
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {
        "a": "42",
        "b": 42,
        "c": {"k": [True, None]},
        "d": '{"k": 1}',
    }


def test_render_literal_format():
    assert (
        render_tool_calls([call("x", "ping", {})])
        == '<｜DSML｜ calls>\n<｜DSML｜ invoke name="ping">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    )
    assert render_tool_calls([call("x", "f", {"s": "é", "n": [1, "é"]})]) == (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="s" string="true">é</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">[1, "é"]</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )


def test_reasoning_and_content_split():
    p = parse_assistant_output("Let me see.\nOK</think>The answer is 4." + EOS, thinking=True)
    assert (p.reasoning_content, p.content, p.tool_calls) == ("Let me see.\nOK", "The answer is 4.", [])
    p = parse_assistant_output("still thinking", thinking=True)  # cut off before </think>
    assert (p.reasoning_content, p.content) == ("still thinking", "")
    p = parse_assistant_output("Plain answer", thinking=False)
    assert (p.reasoning_content, p.content) == (None, "Plain answer")


def test_content_before_tool_calls_keeps_its_own_blank_lines():
    text = 'Para 1.\n\nPara 2.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    p = parse_assistant_output(text, thinking=False)
    assert p.content == "Para 1.\n\nPara 2." and p.tool_calls[0]["function"]["name"] == "f"


def test_lenient_whitespace_between_tags():
    text = (
        '<｜DSML｜ calls><｜DSML｜ invoke name="f">  <｜DSML｜ parameter name="x" string="false">1'
        "</｜DSML｜ parameter></｜DSML｜ invoke>\n</｜DSML｜ calls>\n"
    )
    assert json.loads(parse_assistant_output(text, False).tool_calls[0]["function"]["arguments"]) == {"x": 1}


def test_to_message():
    p = ParsedOutput(reasoning_content="r", content="", tool_calls=[call("call_1", "f", "{}")])
    assert p.to_message() == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "r",
        "tool_calls": [call("call_1", "f", "{}")],
    }
    assert ParsedOutput(None, "hi").to_message() == {"role": "assistant", "content": "hi"}


CALL_HEAD = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'


@pytest.mark.parametrize(
    "text, match",
    [
        (CALL_HEAD + '<｜DSML｜ parameter name="x" string="false">1</｜DSML｜ parameter>\n', "missing"),
        (CALL_HEAD + '<｜DSML｜ parameter name="x" string="false">1', "unterminated parameter 'x'"),
        (
            CALL_HEAD + '<｜DSML｜ parameter name="x" string="false">{oops</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
            "</｜DSML｜ calls>",
            "not JSON",
        ),
        (
            CALL_HEAD + '<｜DSML｜ parameter name="x" string="true">1</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="x" string="true">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
            "duplicate parameter 'x'",
        ),
        (CALL_HEAD + "garbage\n</｜DSML｜ invoke>\n</｜DSML｜ calls>", "expected a parameter tag"),
        (CALL_HEAD + '<｜DSML｜ parameter name="x" string="maybe">1</｜DSML｜ parameter>', "expected a parameter tag"),
        ("\n\n<｜DSML｜ calls>\nhello</｜DSML｜ calls>", "expected an invoke tag"),
        (CALL_HEAD + "</｜DSML｜ invoke>\n</｜DSML｜ calls>trailing words", "after the tool calls"),
        ("answer" + EOS + "more", "after <｜end▁of▁sentence｜>"),
    ],
)
def test_malformed_completions_raise(text, match):
    with pytest.raises(ValueError, match=match):
        parse_assistant_output(text, thinking=False)


@pytest.mark.parametrize(
    "calls, match",
    [
        ([], "non-empty list"),
        ([call("x", 'a"b', {})], "double quote"),
        ([call("x", "f", {"bad\nname": 1})], "newline"),
        ([call("x", "f", "[1]")], "JSON object"),
        ([call("x", "f", {"v": "has ｜DSML｜ inside"})], "cannot be rendered"),
    ],
)
def test_render_rejects_unrepresentable_calls(calls, match):
    with pytest.raises(ValueError, match=match):
        render_tool_calls(calls)
