"""Prompt rendering against hand-written prompts in the V4.1 format (spec §10, §11)."""

import pytest

from dsv41.chat import encode_messages, parse_reasoning_effort, render_tools
from dsv41.tokenizer import ByteTokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, S = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def user(text):
    return {"role": "user", "content": text}


def call(cid, name, arguments):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_single_user_turn_non_thinking():
    assert encode_messages([user("Hello")]) == BOS + U + "Hello" + A + "</think>"


def test_thinking_with_system_prompt_renders_default_effort_once():
    msgs = [{"role": "system", "content": "Be exact."}, user("Hello")]
    assert (
        encode_messages(msgs, thinking=True) == BOS + S + EFFORT.format(75) + "Be exact." + U + "Hello" + A + "<think>"
    )


def test_thinking_without_system_prompt_opens_a_system_turn_for_the_effort():
    assert (
        encode_messages([user("Hi")], thinking=True, reasoning_effort="max")
        == BOS + S + EFFORT.format(100) + U + "Hi" + A + "<think>"
    )
    assert encode_messages([user("Hi")], thinking=True, reasoning_effort=30).startswith(BOS + S + EFFORT.format(30) + U)


def test_effort_is_not_rendered_outside_thinking_mode():
    msgs = [{"role": "system", "content": "sys"}, user("Hi")]
    assert encode_messages(msgs, reasoning_effort=90) == BOS + S + "sys" + U + "Hi" + A + "</think>"


def test_earlier_reasoning_is_dropped_by_default():
    msgs = [user("q1"), {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, user("q2")]
    assert encode_messages(msgs, thinking=True) == (
        BOS + S + EFFORT.format(75) + U + "q1" + A + "</think>" + "a1" + EOS + U + "q2" + A + "<think>"
    )
    assert encode_messages(msgs, thinking=True, drop_thinking=False) == (
        BOS + S + EFFORT.format(75) + U + "q1" + A + "<think>" + "r1</think>a1" + EOS + U + "q2" + A + "<think>"
    )
    assert encode_messages(msgs) == BOS + U + "q1" + A + "</think>a1" + EOS + U + "q2" + A + "</think>"


def test_reasoning_of_the_final_assistant_turn_is_kept():
    msgs = [user("q"), {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert encode_messages(msgs, thinking=True) == BOS + S + EFFORT.format(75) + U + "q" + A + "<think>r</think>a" + EOS


def test_mid_conversation_system_message_gets_a_header():
    msgs = [user("q"), {"role": "assistant", "content": "a"}, {"role": "system", "content": "now French"}]
    assert encode_messages(msgs) == BOS + U + "q" + A + "</think>a" + EOS + S + "now French" + A + "</think>"


def test_consecutive_users_and_text_parts_merge_with_blank_lines():
    msgs = [user("first"), {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]
    assert encode_messages(msgs) == BOS + U + "first\n\nx\n\ny" + A + "</think>"


def test_tool_call_history_and_results_in_call_order():
    msgs = [
        user("Weather?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("c1", "get_weather", '{"city": "Paris", "days": 3}'), call("c2", "ping", {})],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "pong"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    expected = (
        BOS
        + U
        + "Weather?"
        + A
        + "</think>"
        + "\n\n<｜DSML｜ calls>\n"
        + '<｜DSML｜ invoke name="get_weather">\n'
        + '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        + '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
        + "</｜DSML｜ invoke>\n"
        + '<｜DSML｜ invoke name="ping">\n\n</｜DSML｜ invoke>\n'
        + "</｜DSML｜ calls>"
        + EOS
        + U
        + "<tool_result>sunny</tool_result>\n\n<tool_result>pong</tool_result>"
        + A
        + "</think>"
    )
    assert encode_messages(msgs) == expected


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜ calls>" block like the following:\n\n'
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Météo", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}}}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def test_tools_section_follows_the_system_prompt():
    assert render_tools(TOOLS) == TOOLS_SECTION
    msgs = [{"role": "system", "content": "You help."}, user("Paris?")]
    assert (
        encode_messages(msgs, tools=TOOLS) == BOS + S + "You help.\n\n" + TOOLS_SECTION + U + "Paris?" + A + "</think>"
    )


def test_tools_without_system_prompt_use_an_empty_one():
    assert (
        encode_messages([user("Paris?")], tools=TOOLS)
        == BOS + S + "\n\n" + TOOLS_SECTION + U + "Paris?" + A + "</think>"
    )
    assert encode_messages([user("Paris?")], tools=TOOLS, thinking=True) == (
        BOS + S + EFFORT.format(75) + "\n\n" + TOOLS_SECTION + U + "Paris?" + A + "<think>"
    )


def test_tools_keep_all_reasoning_in_thinking_mode():
    msgs = [user("q1"), {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, user("q2")]
    out = encode_messages(msgs, thinking=True, tools=TOOLS)
    assert out.endswith(U + "q1" + A + "<think>r1</think>a1" + EOS + U + "q2" + A + "<think>")


def test_add_generation_prompt_false_omits_only_the_final_header():
    msgs = [user("q1"), {"role": "assistant", "content": "a1"}, user("q2")]
    assert encode_messages(msgs, add_generation_prompt=False) == BOS + U + "q1" + A + "</think>a1" + EOS + U + "q2"


def test_latest_reminder_follows_the_header():
    msgs = [user("q"), {"role": "latest_reminder", "content": "be brief"}]
    assert encode_messages(msgs) == BOS + U + "q" + A + "</think><｜latest_reminder｜>be brief"


def test_developer_role_is_a_system_message():
    assert (
        encode_messages([{"role": "developer", "content": "d"}, user("q")]) == BOS + S + "d" + U + "q" + A + "</think>"
    )


@pytest.mark.parametrize("value, expected", [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100)])
def test_parse_reasoning_effort(value, expected):
    assert parse_reasoning_effort(value) == expected


@pytest.mark.parametrize("value", [0, 101, -5, "medium", "xhigh", "75", 50.0, True, [75]])
def test_bad_reasoning_effort_raises(value):
    with pytest.raises(ValueError, match="reasoning effort"):
        parse_reasoning_effort(value)
    with pytest.raises(ValueError, match="reasoning effort"):
        encode_messages([user("q")], thinking=True, reasoning_effort=value)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty"),
        ("hello", "non-empty"),
        (["hello"], "must be a dict"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"content": "x"}], "unknown role None"),
        ([{"role": "user"}], r"messages\[0\]: missing content"),
        ([{"role": "system", "content": None}], "missing content"),
        ([{"role": "user", "content": 5}], "string or a list"),
        # images belong to user turns (issue 14); elsewhere an image part is refused, and it needs a url
        ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "needs"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "video"}]}],
            "parts must be",
        ),
        ([user("q"), {"role": "assistant"}], r"messages\[1\]: missing content"),
        ([user("q"), {"role": "assistant", "content": "", "tool_calls": "f()"}], "tool_calls must be a list"),
        ([user("q"), {"role": "assistant", "tool_calls": [{"id": "x"}]}], "missing 'function'"),
        ([user("q"), {"role": "assistant", "tool_calls": [call("x", "", "{}")]}], "non-empty string"),
        ([user("q"), {"role": "assistant", "tool_calls": [call("x", "f", "{oops")]}], "not valid JSON"),
        ([user("q"), {"role": "assistant", "tool_calls": [call("x", "f", "[1, 2]")]}], "JSON object"),
        (
            [user("q"), {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
            "type 'function'",
        ),
        ([user("q"), {"role": "assistant", "content": "a", "reasoning_content": 3}], "reasoning_content"),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], "tool_call_id"),
    ],
)
def test_malformed_messages_raise(messages, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages)


@pytest.mark.parametrize(
    "tools",
    [[{"type": "function"}], [{"type": "function", "function": {"description": "x"}}], ["get_weather"], "get_weather"],
)
def test_malformed_tools_raise(tools):
    with pytest.raises(ValueError, match="tools"):
        encode_messages([user("q")], tools=tools)


def test_prompt_tokenizes_with_single_marker_ids_and_round_trips():
    tok = ByteTokenizer(1024)
    msgs = [
        {"role": "system", "content": "Réponds en français."},
        user("Quelle heure ?"),
        {"role": "assistant", "content": "", "tool_calls": [call("c", "clock", {"tz": "CET"})]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"},
    ]
    prompt = encode_messages(msgs, thinking=True)
    ids = tok.encode(prompt, add_bos=False)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    for marker, count in [
        ("<｜User｜>", 2),
        ("<｜Assistant｜>", 2),
        ("<｜System｜>", 1),
        ("｜DSML｜", 6),
        ("<think>", 1),
        ("</think>", 1),
        ("<｜end▁of▁sentence｜>", 1),
    ]:
        assert ids.count(tok.token_to_id(marker)) == count, marker
    assert tok.decode(ids) == prompt
