"""The OpenAI Responses API (`/v1/responses`) without the HTTP: the request body, input items -> chat
messages, `tools` / `tool_choice` / `reasoning` in the Responses shapes -> what the chat path takes, the
prompt of a continued conversation, the generated turn -> output items and streaming events, and the
bounded store of finished responses behind `previous_response_id`.

The model side is the chat path's: the conversation is rendered by the V4.1 encoder (spec §10-§11:
thinking mode and reasoning effort, tools, tool results) and the generated turn is split by
`ChatStreamSplitter` (reasoning until `</think>`, content, then a DSML tool-call block parsed whole at the
end). One `ResponseBuilder` makes both the streamed events and the final `output`, so a streamed response
ends with exactly the object a non-streamed one returns.

Continuing with `previous_response_id` (spec §8, message-level prefix cache): the conversation is the
stored one (its input messages and its output turn) followed by the new input, and its prompt is rendered
in full. Where the earlier turn's rendering is a prefix of the new prompt (non-thinking mode, or tools
given, which keep reasoning; the same instructions, tools and effort) the earlier prompt and the tokens the
model generated are reused as they are (`continued_prompt`): re-tokenizing generated text need not give
the generated ids back, and with them the new prompt starts with exactly the sequence the engine
snapshotted when the earlier request finished, so only the new turn is prefilled.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from dsv41.chat.encoding import parse_reasoning_effort
from dsv41.server import shapes
from dsv41.server.chat import ChatStreamSplitter, build_chat_prompt, parse_tool_calls
from dsv41.server.protocol import MODEL_DOC, D, Int, _TextRequest, bad_request
from dsv41.tokenizer import THINK_END_TOKEN

# OpenAI's effort names -> V4.1's numeric effort (spec §10). low/high/max are the encoder's 50/75/100;
# the others are our choice: minimal 25 (the lowest effort the report measures), medium and xhigh half-way
# between their neighbours. "none" turns thinking mode off. An int 1..100 is taken as it is (extension).
RESPONSES_EFFORTS = {"minimal": 25, "low": 50, "medium": 62, "high": 75, "xhigh": 88, "max": 100}
DEFAULT_MAX_STORED_RESPONSES = 256
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ResponsesRequest(_TextRequest):
    """`POST /v1/responses`. `top_k`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, the penalties,
    `logit_bias`, `min_p` and `min_tokens` are the chat endpoint's (vLLM) extensions; other unknown fields
    (`include`, `prompt_cache_key`, ...) are ignored."""

    model_config = ConfigDict(json_schema_extra=shapes.RESPONSES_REQUEST_RULES)

    model: Annotated[str | None, D(shapes.ModelName | None)] = Field(None, description=MODEL_DOC)
    input: Annotated[str | list[Any], D(shapes.ResponsesInput)] = Field(
        description="a user message, or a list of items (messages, function calls and their outputs, reasoning: not alone)"
    )
    instructions: str | None = Field(None, description="the system message")
    max_output_tokens: Annotated[Int | None, D(shapes.NewTokens | None)] = Field(
        None, description="the prompt and max_output_tokens must fit max_model_len (else 400)"
    )
    temperature: Annotated[float | None, D(shapes.Temperature | None)] = None
    top_p: Annotated[float | None, D(shapes.TopP | None)] = None
    stream: bool | None = Field(False, description="server-sent events (text/event-stream)")
    tools: Annotated[list[Any] | None, D(list[shapes.FunctionTool] | None)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, D(shapes.ResponsesToolChoice | None)] = Field(
        None, description="needs tools"
    )
    parallel_tool_calls: bool | None = None
    reasoning: Annotated[dict[str, Any] | None, D(shapes.Reasoning | None)] = None
    store: bool | None = True
    previous_response_id: str | None = Field(
        default=None, min_length=1, description="a stored response of this server (else 400)"
    )
    text: Annotated[dict[str, Any] | None, D(shapes.ResponsesText | None)] = None
    background: Annotated[bool | None, D(Literal[False] | None)] = Field(None, description="not supported")
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Annotated[str | None, D(Literal["auto", "disabled"] | None)] = None
    # extensions (vLLM), as on /v1/chat/completions
    top_k: Annotated[Int | None, D(shapes.TopK | None)] = None
    seed: Annotated[Int | None, D(shapes.Seed | None)] = None
    stop: Annotated[str | list[str] | None, D(shapes.Stop | None)] = None
    stop_token_ids: Annotated[list[Int] | None, D(shapes.StopTokenIds | None)] = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float | None, D(shapes.Penalty | None)] = 0.0
    frequency_penalty: Annotated[float | None, D(shapes.Penalty | None)] = 0.0
    repetition_penalty: Annotated[float | None, D(shapes.RepetitionPenalty | None)] = None
    logit_bias: Annotated[dict[str, float] | None, D(shapes.LogitBias | None)] = None
    min_p: Annotated[float | None, D(shapes.MinP | None)] = None
    min_tokens: Annotated[Int | None, D(shapes.MinTokens | None)] = None


# ---------------------------------------------------------------------------------------------- request


def resolve_reasoning(reasoning: dict[str, Any] | None) -> tuple[bool, int | None]:
    """`reasoning` -> (thinking, effort). Thinking mode is on when an effort other than "none" is given
    (as `reasoning_effort` turns it on for chat); ValueError for an unknown effort."""
    effort = (reasoning or {}).get("effort")
    if isinstance(effort, float) and effort.is_integer():  # JSON's 50.0 is the integer 50
        effort = int(effort)
    if effort is None or effort == "none":
        return False, None
    if isinstance(effort, str) and effort in RESPONSES_EFFORTS:
        return True, RESPONSES_EFFORTS[effort]
    if isinstance(effort, int) and not isinstance(effort, bool):
        return True, parse_reasoning_effort(effort)
    raise ValueError(
        f"reasoning.effort must be one of none, {', '.join(RESPONSES_EFFORTS)} or an int in 1..100, got {effort!r}"
    )


def chat_tools(tools: list[Any] | None, tool_choice: Any) -> tuple[list[dict] | None, bool]:
    """Responses function tools `{type, name, description, parameters}` and `tool_choice` -> (chat tools to
    render, whether to parse tool calls), as `/v1/chat/completions` treats its own: "none" renders none,
    a named function renders only that one; "required" and a named function are not enforced while
    decoding (neither are they for chat)."""
    out = None
    if tools:
        out = []
        for k, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise bad_request(f"tools[{k}]: only function tools are supported, got {kind!r}", f"tools[{k}].type")
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"tools[{k}] needs a non-empty string 'name'", f"tools[{k}].name")
            params = tool.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise bad_request(f"tools[{k}].parameters must be a JSON schema object", f"tools[{k}].parameters")
            function = {"name": name}
            if tool.get("description") is not None:
                function["description"] = str(tool["description"])
            if params is not None:
                function["parameters"] = params
            out.append({"type": "function", "function": function})
    if tool_choice is None:
        return out, bool(out)
    if not out:
        raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
    if tool_choice == "none":
        return None, False
    if tool_choice in ("auto", "required"):
        return out, True
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        chosen = [t for t in out if t["function"]["name"] == tool_choice.get("name")]
        if not chosen:
            raise bad_request(
                f"tool_choice names a function that is not in tools: {tool_choice.get('name')!r}", "tool_choice"
            )
        return chosen, True
    raise bad_request(
        f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, got {tool_choice!r}",
        "tool_choice",
    )


def _text_of(value: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of `{type: <one of kinds>, text}` parts joined by a blank line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}[{k}]: expected a {{'type': {kinds[0]!r}, 'text': str}} part")
            texts.append(part["text"])
        return "\n\n".join(texts)
    raise ValueError(f"{where} must be a string or a list of text parts")


def _message_content(content: Any, role: str, where: str) -> Any:
    """A message item's content -> chat content: a string, or text / image_url parts (user only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where} must be a string or a non-empty list of content parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and role == "user" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ValueError(
                f"{where}[{k}]: unsupported content part {kind!r} for role {role!r} (input_text, "
                f"output_text; input_image with an image_url for user messages)"
            )
    return parts


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """`input` -> chat messages. A message item keeps its role (developer is read as system by the
    encoder); `function_call` items join the assistant turn they follow (or start one); a `reasoning`
    item's text becomes the `reasoning_content` of the assistant turn after it; `function_call_output`
    becomes a tool message. ValueError (with the item's path) for anything else."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise ValueError("input must be a string or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    open_turn: dict | None = None  # the assistant message function_call items would join

    def assistant() -> dict:
        nonlocal reasoning, open_turn
        msg: dict[str, Any] = {"role": "assistant", "content": None}
        if reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        messages.append(msg)
        open_turn = msg
        return msg

    for k, item in enumerate(value):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role must be user, system, developer or assistant, got {role!r}")
            content = _message_content(item.get("content"), role, f"{where}.content")
            if role == "assistant":
                msg = (
                    open_turn
                    if open_turn is not None and open_turn["content"] is None and not open_turn.get("tool_calls")
                    else assistant()
                )
                msg["content"] = content
            else:
                reasoning, open_turn = None, None
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            for field_name, v in (("call_id", call_id), ("name", name), ("arguments", arguments)):
                if not isinstance(v, str) or (field_name != "arguments" and not v):
                    raise ValueError(f"{where}.{field_name} must be a non-empty string")
            msg = open_turn if open_turn is not None and reasoning is None else assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}.call_id must be a non-empty string")
            output = _text_of(item.get("output"), f"{where}.output", ("input_text", "output_text", "text"))
            reasoning, open_turn = None, None
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            content = item.get("content")
            if content is None or content in ("", []):  # empty: the summary, if any
                content = [] if item.get("summary") is None else item["summary"]
            reasoning = _text_of(content, f"{where}.content", ("reasoning_text", "summary_text"))
            open_turn = None
        else:
            raise ValueError(
                f"{where}.type: unsupported input item type {kind!r} (supported: {', '.join(INPUT_ITEM_TYPES)})"
            )
    for msg in messages:
        if msg["role"] == "assistant" and msg["content"] is None and not msg.get("tool_calls"):
            msg["content"] = ""  # a reasoning item alone
    return messages


# ---------------------------------------------------------------------------------------------- store


@dataclass
class StoredResponse:
    """A finished response kept for `previous_response_id` and `GET /v1/responses/{id}`.
    `conversation`: the chat messages it answered (instructions excluded: they do not carry over) and its
    own output as the last assistant turn. `prompt_ids` / `output_ids`: what the engine computed;
    `rendered_ids`: the plain rendering of the prompt (equal to `prompt_ids` unless ids were spliced in)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None
    rendered_ids: list[int] | None = None


class ResponseStore:
    """An LRU of at most `max_entries` stored responses (0: nothing is stored). Reading one (continuing
    from it or fetching it) makes it the most recent."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, entry: StoredResponse) -> None:
        with self._lock:
            if self.max_entries == 0:
                return
            self._entries[entry.response["id"]] = entry
            self._entries.move_to_end(entry.response["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------------------------- prompt


def continued_prompt(
    tokenizer,
    messages: list[dict],
    head: list[dict],
    previous: StoredResponse,
    *,
    thinking: bool,
    effort: int | None,
    tools: list[dict] | None,
    token_limit: int | None,
    image_loader=None,
    spans: list | None = None,
) -> tuple[list[int], list[int]]:
    """(prompt ids, plain rendering) of `messages` = `head` + the new input, where `head` is the
    instructions and the stored conversation ending with the earlier output turn. When the rendering of
    `head` starts with the earlier prompt's rendering (same instructions, tools, effort) and the new
    rendering starts with it (the earlier turn is rendered as it stood: non-thinking mode, or tools, which
    keep reasoning), the earlier prompt ids and the generated ids stand in for that part: they differ
    from the rendering only where generated text re-tokenizes differently (or where earlier turns were
    spliced in the same way). Otherwise (thinking mode dropping earlier reasoning, changed instructions,
    a turn that ended on a stop string, images) the plain rendering is the prompt."""
    kw = dict(thinking=thinking, effort=effort, tools=tools)
    full = build_chat_prompt(tokenizer, messages, token_limit=token_limit, image_loader=image_loader, spans=spans, **kw)
    if spans or previous.rendered_ids is None:  # image spans are positions in `full`; a splice could move them
        return full, full
    if previous.finish_reason == "length":
        generated = previous.output_ids + [tokenizer.eos_id]  # the rendered turn is closed by EOS
    elif previous.output_ids and previous.output_ids[-1] == tokenizer.eos_id:
        generated = previous.output_ids
    else:
        return full, full
    rendered = build_chat_prompt(tokenizer, head, add_generation_prompt=False, **kw)
    earlier = previous.rendered_ids
    if rendered[: len(earlier)] != earlier or full[: len(rendered)] != rendered:
        return full, full
    return previous.prompt_ids + generated + full[len(rendered) :], full


# ---------------------------------------------------------------------------------------------- output


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(last, prompt_len: int, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses `usage` object of one finished engine request."""
    prompt = last.num_prompt_tokens if last is not None and last.num_prompt_tokens else prompt_len
    output = len(last.token_ids) if last is not None else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": last.num_cached_tokens if last is not None else 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + output,
    }


def reasoning_token_count(token_ids: list[int], thinking: bool, think_end_id: int | None) -> int:
    """Output tokens before `</think>` in thinking mode (all of them when it never came)."""
    if not thinking:
        return 0
    if think_end_id is not None and think_end_id in token_ids:
        return token_ids.index(think_end_id)
    return len(token_ids)


def think_end_id(tokenizer) -> int | None:
    return tokenizer.token_to_id(THINK_END_TOKEN)


@dataclass
class ResponseBuilder:
    """The generated turn -> output items and the Responses streaming events. `feed(delta)` and
    `finish(status)` return the events to send; `output` holds the items (a reasoning item, a message,
    function calls) in their final form once `finish` has run. `base` is the response object without
    output, status and usage."""

    base: dict[str, Any]
    thinking: bool
    tools: bool
    output: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0
    started: bool = False
    splitter: ChatStreamSplitter | None = None
    current: dict[str, Any] | None = None  # the reasoning or message item whose text is streaming

    def __post_init__(self):
        self.splitter = ChatStreamSplitter(thinking=self.thinking, tools=self.tools)

    def _event(self, type_: str, **fields) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def response(self, status: str, usage_: dict | None = None, incomplete: str | None = None) -> dict:
        return {
            **self.base,
            "status": status,
            "output": [dict(item) for item in self.output],
            "usage": usage_,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
        }

    def start(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        snapshot = self.response("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, delta: str) -> list[dict]:
        events = self.start()
        for kind, text in self.splitter.feed(delta):
            events += self._piece(kind, text)
        return events

    def _open(self, item: dict, part: dict) -> list[dict]:
        self.output.append(item)
        self.current = item
        index = len(self.output) - 1
        return [
            self._event("response.output_item.added", output_index=index, item=dict(item, content=[])),
            self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=dict(part)
            ),
        ]

    def _piece(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        want = "reasoning" if kind == "reasoning" else "message"
        if self.current is None or self.current["type"] != want:
            events += self._close("in_progress")
            if want == "reasoning":
                item = {
                    "id": _item_id("rs"),
                    "type": "reasoning",
                    "summary": [],
                    "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}],
                }
            else:
                item = {
                    "id": _item_id("msg"),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": []}],
                }
            events += self._open(item, item["content"][0])
        item, index = self.current, len(self.output) - 1
        item["content"][0]["text"] += text
        if text:
            name = "response.reasoning_text.delta" if want == "reasoning" else "response.output_text.delta"
            extra = {} if want == "reasoning" else {"logprobs": []}
            events.append(
                self._event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)
            )
        return events

    def _close(self, status: str) -> list[dict]:
        """Finish the streaming item (its text is final)."""
        item, self.current = self.current, None
        if item is None:
            return []
        index = self.output.index(item)
        part = item["content"][0]
        item["status"] = "completed" if status == "in_progress" else status
        if item["type"] == "reasoning":
            done = self._event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
            )
        else:
            done = self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
        return [
            done,
            self._event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part)
            ),
            self._event("response.output_item.done", output_index=index, item=_copy_item(item)),
        ]

    def finish(self, status: str, usage_: dict, incomplete: str | None = None) -> list[dict]:
        """Flush held-back text, close the open item, add the function calls; then the final event
        (`response.completed`, or `response.incomplete` with `incomplete` as the reason)."""
        events = self.start()
        for kind, text in self.splitter.finish():
            events += self._piece(kind, text)
        item_status = "incomplete" if status == "incomplete" else "completed"
        calls = parse_tool_calls(self.splitter.tool_text) if self.splitter.tool_text else []
        if self.splitter.tool_text and not calls:  # a block that does not parse is content, not lost
            events += self._piece("content", self.splitter.tool_text)
        in_reasoning = self.thinking and self.splitter.mode == "reasoning"  # `</think>` never came
        if in_reasoning and not any(item["type"] == "reasoning" for item in self.output):
            events += self._piece("reasoning", "")
        if not calls and not in_reasoning and not any(item["type"] == "message" for item in self.output):
            events += self._piece("content", "")  # an empty answer is still a message
        # the last text item ends as the response does (cut off by max_output_tokens: incomplete)
        events += self._close(item_status if not calls else "completed")
        for call in calls:
            item = {
                "id": _item_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            self.output.append(item)
            index = len(self.output) - 1
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item=dict(item, arguments="", status="in_progress"),
                ),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=index, item=dict(item)),
            ]
        final = self.response(status, usage_, incomplete)
        events.append(
            self._event("response.completed" if status == "completed" else "response.incomplete", response=final)
        )
        return events

    def assistant_message(self) -> dict[str, Any]:
        """This turn as a chat assistant message (what a continuation renders)."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        calls = []
        for item in self.output:
            if item["type"] == "reasoning":
                msg["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                msg["content"] = item["content"][0]["text"]
            else:
                calls.append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
        if calls:
            msg["tool_calls"] = calls
        return msg


def _copy_item(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item["content"]]}
