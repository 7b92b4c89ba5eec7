"""OpenAI-style messages -> the DeepSeek-V4.1 prompt string (spec §10 reasoning effort, §11 chat format).

V4.1 has no Jinja template; its prompts come from the official `encoding/encoding.py`. The rules below
were read from a public copy of that file (spec source S5, "likely official") and written anew here;
independent ports agree with them.

Layout::

    <｜begin▁of▁sentence｜>
    [<｜System｜>]                      index 0, if it is a system message or an effort line follows
    [Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\\n\\n]
                                       thinking mode only, once, at index 0 (§10)
    {system content}[\\n\\n{tools section}]
    <｜User｜>{text or <tool_result>…</tool_result> blocks, joined by \\n\\n}
    <｜Assistant｜></think>  or  <｜Assistant｜><think>        the header after each user turn
    [{reasoning}</think>]{content}[\\n\\n<｜DSML｜ calls>…]<｜end▁of▁sentence｜>
    <｜System｜>{content}               a later system message; gets a header like a user turn
    ...

- There is no tool role: consecutive user and tool messages merge into one user turn whose parts are
  joined by a blank line; tool results are wrapped in `<tool_result>…</tool_result>` (plain text, not
  special tokens) and sorted into the order of the calls of the latest assistant message, matched by
  `tool_call_id`.
- Thinking mode (`thinking=True`): the header after the last user (or later system) turn ends `<think>`;
  earlier turns get `</think>` and their assistants' reasoning is dropped, unless `drop_thinking=False`,
  or tools are given (the official encoder then keeps all reasoning), in which case every header ends
  `<think>` and every assistant turn is `{reasoning}</think>{content}`. Non-thinking mode: every header
  ends `</think>` and reasoning is never rendered.
- Tools are rendered after the content of the index-0 system message; without one, an empty system
  message is put first (what the official encoder does with `{"role": "system", "content": ""}`, so the
  section then starts with a blank line). This placement for a conversation that has no system message
  is our choice: the official entry point attaches tools to whatever message comes first.
- `latest_reminder` messages render as `<｜latest_reminder｜>{content}` without a header, as officially.
- Text content may be a string or a list of `{"type": "text"}` parts (joined by a blank line). A user
  message's list may also hold OpenAI `{"type": "image_url", "image_url": {"url": ...}}` parts: each
  becomes an `ImageSlot` piece where it stands, which `encode_prompt` turns into the image's span
  (span_length positions of image_token_id; its own START/END/NEW_LINE embeddings delimit it, so no
  text separator is added around it -- our choice, the official encoder's image handling is not public)
  and `encode_messages` renders as one `<｜deepseek_image｜>` marker. A `developer` role is read as `system`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from dsv41.chat.dsml import (
    CALLS_CLOSE,
    CALLS_OPEN,
    INVOKE_CLOSE,
    PARAM_CLOSE,
    invoke_open,
    normalize_tool_call,
    tool_calls_parts,
)
from dsv41.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    DSML_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    LATEST_REMINDER_TOKEN,
    SYSTEM_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)

REASONING_EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = 75  # "high"
REASONING_EFFORT_SENTENCE = (
    "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE = "<tool_result>", "</tool_result>"

_ROLES = ("system", "user", "assistant", "tool", "latest_reminder")


@dataclass(frozen=True)
class ImageSlot:
    """An image part of a user message, in prompt order: `index` counts the prompt's images from 0;
    `url` is as the client sent it (decoding it is the server's business, dsv41.vision.inputs)."""

    index: int
    url: str


def parse_reasoning_effort(value: Any) -> int:
    """None -> 75 (the default, "high"); an int in 1..100 as is; "low"/"high"/"max" -> 50/75/100 (§10)."""
    if value is None:
        return DEFAULT_REASONING_EFFORT
    if isinstance(value, int) and not isinstance(value, bool):
        if 1 <= value <= 100:
            return value
        raise ValueError(f"reasoning effort must lie in 1..100, got {value}")
    if isinstance(value, str) and value.strip().lower() in REASONING_EFFORT_LEVELS:
        return REASONING_EFFORT_LEVELS[value.strip().lower()]
    raise ValueError(
        f"reasoning effort must be an int in 1..100 or one of {sorted(REASONING_EFFORT_LEVELS)}, got {value!r}"
    )


def render_tools(tools: list) -> str:
    """OpenAI tool definitions -> the tools section of the system prompt (one JSON schema per line)."""
    return "".join(text for text, _ in tools_parts(tools))


def tools_parts(tools: list) -> list[tuple[str, bool]]:
    """`render_tools` as (text, from_template) pieces: the schemas came from the client."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    schemas = []
    for k, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise ValueError(f"tools[{k}] must be {{'type': 'function', 'function': {{...}}}}, got {tool!r}")
        if not isinstance(tool["function"].get("name"), str) or not tool["function"]["name"]:
            raise ValueError(f"tools[{k}].function needs a non-empty 'name'")
        schemas.append(json.dumps(tool["function"], ensure_ascii=False))
    example = "\n".join(
        [
            CALLS_OPEN,
            invoke_open("$TOOL_NAME"),
            f'<{DSML_TOKEN} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}',
            "...",
            INVOKE_CLOSE,
            invoke_open("$TOOL_NAME2"),
            "...",
            INVOKE_CLOSE,
            CALLS_CLOSE,
        ]
    )
    head = (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by "
        f'writing a "{CALLS_OPEN}" block like the following:\n\n'
        f"{example}\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {THINK_START_TOKEN}), you MUST output your complete "
        f"reasoning inside {THINK_START_TOKEN}...{THINK_END_TOKEN} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {THINK_END_TOKEN} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
    )
    tail = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    parts = [(head, True)]
    for k, schema in enumerate(schemas):
        parts += [("\n", True)] * bool(k) + [(schema, False)]
    return parts + [(tail, True)]


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"{where}.content[{k}]: only {{'type': 'text', 'text': str}} parts are supported")
        return "\n\n".join(parts)
    if content is None:
        raise ValueError(f"{where}: missing content")
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _user_content(content: Any, where: str, slots: list) -> Any:
    """A user message's content: its text, or, when it holds image parts, a list of text pieces and
    ImageSlots (consecutive text parts joined by a blank line, as in `_text`)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return _text(content, where)
    pieces: list = []
    for k, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise ValueError(f"{where}.content[{k}]: an image_url part needs {{'image_url': {{'url': str}}}}")
            slot = ImageSlot(len(slots), url)
            slots.append(slot)
            pieces.append(slot)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            if pieces and isinstance(pieces[-1], str):
                pieces[-1] += "\n\n" + part["text"]
            else:
                pieces.append(part["text"])
        else:
            raise ValueError(
                f"{where}.content[{k}]: parts must be {{'type': 'text', 'text': str}} or "
                f"{{'type': 'image_url', 'image_url': {{'url': str}}}}"
            )
    return pieces


def _normalize(messages: Any) -> list[dict]:
    """Validate and merge: -> turns {role, text | blocks, reasoning, calls, call_ids}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    turns: list[dict] = []
    slots: list[ImageSlot] = []
    for k, msg in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: a message must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        role = "system" if role == "developer" else role
        if role not in _ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(_ROLES)})")
        if role in ("user", "tool"):
            if role == "user":
                block = ("text", _user_content(msg.get("content"), where, slots), None)
            else:
                call_id = msg.get("tool_call_id", "")
                if not isinstance(call_id, str):
                    raise ValueError(f"{where}: tool_call_id must be a string")
                block = ("tool_result", _text(msg.get("content"), where), call_id)
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        elif role == "assistant":
            calls = msg.get("tool_calls")
            calls = [] if calls is None else calls
            if not isinstance(calls, list):
                raise ValueError(f"{where}: tool_calls must be a list")
            for j, tc in enumerate(calls):
                normalize_tool_call(tc, f"{where}.tool_calls[{j}]")
                if not isinstance(tc.get("id"), (str, type(None))):  # ids order the tool results
                    raise ValueError(f"{where}.tool_calls[{j}]: id must be a string")
            content = msg.get("content")
            content = "" if content is None and calls else _text(content, where)
            reasoning = msg.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}: reasoning_content must be a string")
            turns.append(
                {
                    "role": "assistant",
                    "text": content,
                    "reasoning": reasoning or "",
                    "calls": calls,
                    "call_ids": [tc.get("id") for tc in calls],
                }
            )
        else:
            turns.append({"role": role, "text": _text(msg.get("content"), where)})
    _sort_tool_results(turns)
    return turns


def _sort_tool_results(turns: list[dict]) -> None:
    """Order each user turn's tool results like the calls of the latest assistant message that made
    calls (results whose id is unknown sort first, stably); other parts keep their places."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn["calls"]:
            order = {cid: k for k, cid in enumerate(turn["call_ids"]) if cid}
        elif turn["role"] == "user" and order:
            slots = [k for k, b in enumerate(turn["blocks"]) if b[0] == "tool_result"]
            ranked = sorted((turn["blocks"][k] for k in slots), key=lambda b: order.get(b[2], 0))
            for k, b in zip(slots, ranked):
                turn["blocks"][k] = b


def encode_messages(
    messages: list,
    *,
    thinking: bool = False,
    reasoning_effort: Any = None,
    tools: list | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
) -> str:
    """Render `messages` as a V4.1 prompt (see the module docstring). The result starts with the BOS
    string. `add_generation_prompt=False` leaves out the assistant header after a final user/system turn.
    Malformed input raises ValueError. To tokenize a prompt that holds client text, use `prompt_parts`
    and `encode_prompt` instead: tokenizing this string would turn marker text inside a message into
    real control tokens."""
    parts = prompt_parts(
        messages,
        thinking=thinking,
        reasoning_effort=reasoning_effort,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        drop_thinking=drop_thinking,
    )
    return "".join(IMAGE_TOKEN if isinstance(text, ImageSlot) else text for text, _ in parts)


def image_slots(parts: list[tuple[Any, bool]]) -> list[ImageSlot]:
    """The image slots of `prompt_parts` output, in order."""
    return [text for text, _ in parts if isinstance(text, ImageSlot)]


def prompt_parts(
    messages: list,
    *,
    thinking: bool = False,
    reasoning_effort: Any = None,
    tools: list | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
) -> list[tuple[str, bool]]:
    """`encode_messages` as (text, from_template) pieces: the template's own text (markers, headers, tags)
    is marked True; everything the messages and tools brought is False. An image part of a user message
    comes as (ImageSlot, False)."""
    effort = parse_reasoning_effort(reasoning_effort)
    turns = _normalize(messages)
    tools_text = tools_parts(tools) if tools else []
    if tools_text:
        if turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "text": ""})
        drop_thinking = False  # the official encoder keeps all reasoning when tools are defined
    last_user = max(
        (k for k, t in enumerate(turns) if t["role"] == "user" or (t["role"] == "system" and k > 0)), default=-1
    )

    out: list[tuple[str, bool]] = []

    def template(text: str) -> None:
        out.append((text, True))

    def data(text: str) -> None:
        out.append((text, False))

    template(BOS_TOKEN)
    for k, turn in enumerate(turns):
        role = turn["role"]
        if k == 0:
            effort_line = REASONING_EFFORT_SENTENCE.format(effort) if thinking else ""
            if effort_line or role == "system":
                template(SYSTEM_TOKEN)
            template(effort_line)
        if role == "system":
            if k > 0:
                template(SYSTEM_TOKEN)
            data(turn["text"])
            if k == 0 and tools_text:
                template("\n\n")
                out.extend(tools_text)
        elif role == "user":
            template(USER_TOKEN)
            for j, (kind, text, _) in enumerate(turn["blocks"]):
                if j:
                    template("\n\n")
                if kind == "tool_result":
                    template(TOOL_RESULT_OPEN)
                    data(text)
                    template(TOOL_RESULT_CLOSE)
                elif isinstance(text, list):  # text pieces and image slots
                    for piece in text:
                        out.append((piece, False))
                else:
                    data(text)
        elif role == "latest_reminder":
            template(LATEST_REMINDER_TOKEN)
            data(turn["text"])
        else:  # assistant
            if thinking and (not drop_thinking or k > last_user):
                data(turn["reasoning"])
                template(THINK_END_TOKEN)
            data(turn["text"])
            if turn["calls"]:
                template("\n\n")
                out.extend(tool_calls_parts(turn["calls"]))
            template(EOS_TOKEN)

        following = turns[k + 1]["role"] if k + 1 < len(turns) else None
        if following not in (None, "assistant", "latest_reminder"):
            continue
        if following is None and not add_generation_prompt:
            continue
        if role == "user" or (role == "system" and k > 0):
            think = thinking and (not drop_thinking or k >= last_user)
            template(ASSISTANT_TOKEN)
            template(THINK_START_TOKEN if think else THINK_END_TOKEN)
    return [(text, trusted) for text, trusted in out if text]


# markers the template writes; only these, and only in the template's own text, become control tokens
_TEMPLATE_MARKERS = re.compile(
    "("
    + "|".join(
        re.escape(m)
        for m in sorted(
            (
                BOS_TOKEN,
                EOS_TOKEN,
                SYSTEM_TOKEN,
                USER_TOKEN,
                ASSISTANT_TOKEN,
                LATEST_REMINDER_TOKEN,
                THINK_START_TOKEN,
                THINK_END_TOKEN,
                DSML_TOKEN,
            ),
            key=len,
            reverse=True,
        )
    )
    + ")"
)


def encode_prompt(
    tokenizer,
    parts: list[tuple[str, bool]],
    images: list | None = None,
    image_token_id: int | None = None,
    spans: list | None = None,
) -> list[int]:
    """Token ids of `prompt_parts` output: markers in the template's text become their ids (when the
    tokenizer has them), and all other text, the client's included, is encoded as text, so no message can
    close its turn or forge another. Adjacent text pieces are encoded together, as one string would be,
    so a prompt without marker text in its messages gets exactly the ids of `encode(encode_messages(...))`.

    Image slots need `images` (one dsv41.vision.ImagePatches per slot, in slot order) and the model's
    `image_token_id`: each becomes span_length copies of that id, and (start, image) is appended to
    `spans` (what LLMEngine.add_request takes as `images`)."""
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        text = "".join(run)
        if text:
            ids.extend(tokenizer.encode(text, add_bos=False, parse_special=False))
        run.clear()

    for text, trusted in parts:
        if isinstance(text, ImageSlot):
            if images is None or image_token_id is None or text.index >= len(images):
                raise ValueError("this prompt holds an image; encoding it needs the processed images")
            flush()
            image = images[text.index]
            if spans is not None:
                spans.append((len(ids), image))
            ids.extend([image_token_id] * image.span_length)
            continue
        if not trusted:
            run.append(text)
            continue
        for k, piece in enumerate(_TEMPLATE_MARKERS.split(text)):
            marker_id = tokenizer.token_to_id(piece) if k % 2 else None
            if marker_id is None:
                run.append(piece)
            else:
                flush()
                ids.append(marker_id)
    flush()
    return ids
