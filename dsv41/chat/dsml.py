"""DSML tool calls: rendering them into an assistant turn and parsing them (and the reasoning) back out
of a completion (spec §11).

V4.1 writes tool calls as a block after the assistant's content, separated from it by a blank line:

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

`｜DSML｜` is one token and the tag names carry a leading space (V4 used `tool_calls`). String arguments
are written as they are with `string="true"`; every other value is JSON (`ensure_ascii=False`, default
separators) with `string="false"`. Invocations and parameters are joined by single newlines; an
invocation without parameters has an empty line between its tags. These details, and the parsing rules
(reasoning ends at `</think>`, the calls block starts at "\\n\\n<｜DSML｜ calls"), were read from a public
copy of the official `encoding/encoding.py` (spec source S5) and agree with independent ports.

The parser is more lenient than the official one: a missing EOS (the engine usually strips it), any
whitespace between tags, and a completion cut off before `</think>` (all of it is reasoning) are
accepted. A malformed calls block raises `ValueError`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsv41.tokenizer import DSML_TOKEN, EOS_TOKEN, THINK_END_TOKEN

CALLS_OPEN = f"<{DSML_TOKEN} calls>"
CALLS_CLOSE = f"</{DSML_TOKEN} calls>"
INVOKE_CLOSE = f"</{DSML_TOKEN} invoke>"
PARAM_CLOSE = f"</{DSML_TOKEN} parameter>"

_INVOKE_OPEN = re.compile(rf'<{DSML_TOKEN} invoke name="([^"\n]*)">')
_PARAM_OPEN = re.compile(rf'<{DSML_TOKEN} parameter name="([^"\n]*)" string="(true|false)">')
_WS = re.compile(r"\s*")


def invoke_open(name: str) -> str:
    return f'<{DSML_TOKEN} invoke name="{name}">'


def param_open(name: str, is_string: bool) -> str:
    return f'<{DSML_TOKEN} parameter name="{name}" string="{"true" if is_string else "false"}">'


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _check_name(kind: str, name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: {kind} name must be a non-empty string, got {name!r}")
    if '"' in name or "\n" in name or DSML_TOKEN in name:
        raise ValueError(f"{where}: {kind} name {name!r} cannot hold a double quote, a newline or {DSML_TOKEN}")
    return name


def normalize_tool_call(tool_call: Any, where: str = "tool_calls[0]") -> tuple[str, dict]:
    """An OpenAI tool call -> (function name, arguments dict). `arguments` may be a dict or a JSON
    string holding an object; anything else raises ValueError naming `where`."""
    if not isinstance(tool_call, dict):
        raise ValueError(f"{where}: a tool call must be a dict, got {type(tool_call).__name__}")
    if tool_call.get("type", "function") != "function":
        raise ValueError(f"{where}: only tool calls of type 'function' are supported, got {tool_call.get('type')!r}")
    function = tool_call.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}: missing 'function' object")
    name = _check_name("function", function.get("name"), where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: arguments of {name!r} are not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}: arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    for key, value in arguments.items():
        _check_name("parameter", key, where)
        if isinstance(value, str) and DSML_TOKEN in value:
            raise ValueError(f"{where}: parameter {key!r} of {name!r} contains {DSML_TOKEN}, which cannot be rendered")
    return name, arguments


def render_tool_calls(tool_calls: list) -> str:
    """OpenAI tool calls -> the `<｜DSML｜ calls>` block (without the blank line that precedes it in an
    assistant turn)."""
    return "".join(text for text, _ in tool_calls_parts(tool_calls))


def tool_calls_parts(tool_calls: list) -> list[tuple[str, bool]]:
    """`render_tool_calls` as (text, from_template) pieces: the DSML tags are the template's, while
    function names, parameter names and values came from the client and must be tokenized as text."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise ValueError("tool_calls must be a non-empty list")
    parts: list[tuple[str, bool]] = [(CALLS_OPEN + "\n", True)]
    for k, tc in enumerate(tool_calls):
        name, arguments = normalize_tool_call(tc, f"tool_calls[{k}]")
        if k:
            parts.append(("\n", True))
        parts += [(f'<{DSML_TOKEN} invoke name="', True), (name, False), ('">\n', True)]
        for j, (key, value) in enumerate(arguments.items()):
            is_string = isinstance(value, str)
            parts += [
                ("\n" if j else "", True),
                (f'<{DSML_TOKEN} parameter name="', True),
                (key, False),
                (f'" string="{"true" if is_string else "false"}">', True),
                (value if is_string else _to_json(value), False),
                (PARAM_CLOSE, True),
            ]
        parts.append(("\n" + INVOKE_CLOSE, True))
    parts.append(("\n" + CALLS_CLOSE, True))
    return [(text, trusted) for text, trusted in parts if text]


@dataclass
class ParsedOutput:
    """An assistant completion split into its parts. `reasoning_content` is None outside thinking mode;
    `tool_calls` are OpenAI dicts with a fresh `call_…` id and JSON-string arguments."""

    reasoning_content: str | None
    content: str
    tool_calls: list = field(default_factory=list)

    def to_message(self) -> dict:
        """As an OpenAI assistant message (content None when there are only tool calls)."""
        msg: dict = {"role": "assistant", "content": self.content if self.content or not self.tool_calls else None}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def parse_tool_calls_block(text: str) -> list[dict]:
    """Parse text that starts with `<｜DSML｜ calls>` and ends with its closing tag (trailing whitespace
    allowed) into OpenAI tool calls."""
    if not text.startswith(CALLS_OPEN):
        raise ValueError(f"tool calls must start with {CALLS_OPEN!r}")
    calls = []
    pos = len(CALLS_OPEN)
    while True:
        pos = _skip_ws(text, pos)
        if text.startswith(CALLS_CLOSE, pos):
            pos += len(CALLS_CLOSE)
            break
        m = _INVOKE_OPEN.match(text, pos)
        if m is None:
            if pos >= len(text):
                raise ValueError(f"unterminated tool calls: missing {CALLS_CLOSE!r}")
            raise ValueError(f"expected an invoke tag or {CALLS_CLOSE!r} at: {text[pos : pos + 60]!r}")
        name, pos = m.group(1), m.end()
        arguments: dict = {}
        while True:
            pos = _skip_ws(text, pos)
            if text.startswith(INVOKE_CLOSE, pos):
                pos += len(INVOKE_CLOSE)
                break
            p = _PARAM_OPEN.match(text, pos)
            if p is None:
                if pos >= len(text):
                    raise ValueError(f"unterminated invoke of {name!r}: missing {INVOKE_CLOSE!r}")
                raise ValueError(
                    f"expected a parameter tag or {INVOKE_CLOSE!r} in {name!r} at: {text[pos : pos + 60]!r}"
                )
            key, is_string = p.group(1), p.group(2) == "true"
            end = text.find(PARAM_CLOSE, p.end())
            if end < 0:
                raise ValueError(f"unterminated parameter {key!r} of {name!r}: missing {PARAM_CLOSE!r}")
            raw = text[p.end() : end]
            if key in arguments:
                raise ValueError(f"duplicate parameter {key!r} in call to {name!r}")
            if is_string:
                arguments[key] = raw
            else:
                try:
                    arguments[key] = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f'parameter {key!r} of {name!r} has string="false" but is not JSON: {raw[:60]!r} ({e})'
                    ) from None
            pos = end + len(PARAM_CLOSE)
        calls.append(
            {"id": _new_call_id(), "type": "function", "function": {"name": name, "arguments": _to_json(arguments)}}
        )
    if text[pos:].strip():
        raise ValueError(f"unexpected text after the tool calls: {text[pos : pos + 60]!r}")
    return calls


def parse_assistant_output(text: str, thinking: bool) -> ParsedOutput:
    """Split a completion (the text generated after the `<｜Assistant｜><think>` or
    `<｜Assistant｜></think>` header) into reasoning, content and tool calls."""
    if not isinstance(text, str):
        raise ValueError(f"completion must be a str, got {type(text).__name__}")
    eos = text.find(EOS_TOKEN)
    if eos >= 0:
        if text[eos + len(EOS_TOKEN) :].strip():
            raise ValueError(f"unexpected text after {EOS_TOKEN}: {text[eos + len(EOS_TOKEN) :][:60]!r}")
        text = text[:eos]
    reasoning = None
    if thinking:
        end = text.find(THINK_END_TOKEN)
        if end < 0:  # cut off while reasoning
            return ParsedOutput(reasoning_content=text, content="", tool_calls=[])
        reasoning, text = text[:end], text[end + len(THINK_END_TOKEN) :]
    start = text.find(CALLS_OPEN)
    if start < 0:
        return ParsedOutput(reasoning_content=reasoning, content=text, tool_calls=[])
    content = text[:start]
    if content.endswith("\n\n"):
        content = content[:-2]
    return ParsedOutput(reasoning_content=reasoning, content=content, tool_calls=parse_tool_calls_block(text[start:]))
