"""Chat requests to prompt tokens, and generated text back to reasoning / content / tool calls.

The prompt is rendered by `dsv41.chat.encoding.prompt_parts` (spec §10-§11: `<think>` header in
thinking mode, reasoning effort at conversation index 0, tools and tool results) and the finished text is
parsed by `dsv41.chat.dsml.parse_assistant_output`. Streaming needs the split as the text arrives, so
`ChatStreamSplitter` tracks the two boundaries a V4.1 assistant turn can cross: `</think>` (reasoning ->
content, thinking mode only, because the generation header already opened `<think>`) and the start of a
DSML tool-call block (content -> tool calls, which are emitted whole once the turn is finished).
Shared by the server and `dsv41 chat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv41.chat.dsml import CALLS_OPEN, parse_assistant_output, parse_tool_calls_block
from dsv41.chat.encoding import encode_prompt, image_slots, parse_reasoning_effort, prompt_parts
from dsv41.tokenizer import EOS_TOKEN, THINK_END_TOKEN


def resolve_thinking(chat_template_kwargs: dict[str, Any] | None, reasoning_effort: Any) -> tuple[bool, int | None]:
    """(thinking, effort). Thinking is off unless `chat_template_kwargs` turns it on (`thinking` or
    `enable_thinking`) or a reasoning effort is given without an explicit `thinking: false`.
    The effort (1-100 or low/high/max) is validated by `parse_reasoning_effort` (ValueError)."""
    kwargs = chat_template_kwargs or {}
    explicit = None
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise ValueError(f"chat_template_kwargs.{key} must be a boolean")
            explicit = kwargs[key]
    effort = None if reasoning_effort is None else parse_reasoning_effort(reasoning_effort)
    thinking = explicit if explicit is not None else effort is not None
    return thinking, (effort if thinking else None)


class PromptTooLong(ValueError):
    """The text is too long for `token_limit` whatever its tokenization; `min_tokens` is a lower bound."""

    def __init__(self, min_tokens: int, token_limit: int):
        super().__init__(f"the prompt has at least {min_tokens} tokens; the limit is {token_limit}")
        self.min_tokens, self.token_limit = min_tokens, token_limit


def check_text_fits(tokenizer, num_chars: int, token_limit: int | None) -> None:
    """Raise PromptTooLong when `num_chars` characters cannot fit `token_limit` tokens: no token decodes
    to more than `tokenizer.max_token_chars` characters. Costs nothing, so a huge body is refused before
    its tokenization is paid for."""
    if token_limit is not None:
        min_tokens = -(-num_chars // max(1, tokenizer.max_token_chars))
        if min_tokens > token_limit:
            raise PromptTooLong(min_tokens, token_limit)


def build_chat_prompt(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    thinking: bool,
    effort: int | None,
    tools: list[dict[str, Any]] | None,
    token_limit: int | None = None,
    image_loader=None,
    spans: list | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render with the V4.1 encoder (ValueError on malformed messages) and tokenize. Control tokens come
    only from the template: message content and tool definitions are tokenized as text, so marker strings
    inside them stay text (`encode_prompt`). The rendered text starts with the BOS marker. With
    `token_limit`, a prompt that cannot fit is refused (PromptTooLong) before it is tokenized. Image parts
    need `image_loader` (dsv41.vision.ImageLoader); each image's (start, ImagePatches) goes to `spans`.
    Without `add_generation_prompt` the assistant turn's opening is left off (`/tokenize`)."""
    parts = prompt_parts(
        messages,
        thinking=thinking,
        reasoning_effort=effort,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        drop_thinking=True,
    )
    slots = image_slots(parts)
    images = None
    if slots:  # image_url parts: decoded and preprocessed here, laid out as spans by encode_prompt
        if image_loader is None:
            raise ValueError("this model does not take images (it has no vision tower)")
        images = image_loader(slots)
    check_text_fits(tokenizer, sum(len(text) for text, _ in parts if isinstance(text, str)), token_limit)
    return encode_prompt(tokenizer, parts, images, image_loader.image_token_id if slots else None, spans)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (it may still grow
    into the marker, so it must not be emitted yet)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ChatStreamSplitter:
    """Feed generated text deltas; get ("reasoning" | "content", text) pieces back in order, each as
    soon as it can no longer turn out to be part of a marker. With `tools`, text from the DSML calls block
    on is kept in `tool_text` and never emitted as content; the blank line before the block is dropped,
    as `parse_assistant_output` drops it, so a streamed turn concatenates to the parsed one."""

    thinking: bool
    tools: bool
    mode: str = ""
    buffer: str = ""
    tool_text: str = ""
    pieces: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self):
        self.mode = self.mode or ("reasoning" if self.thinking else "content")

    def feed(self, delta: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.mode == "tool":
            self.tool_text += delta
            return out
        self.buffer += delta
        if self.mode == "reasoning":
            i = self.buffer.find(THINK_END_TOKEN)
            if i < 0:
                self._flush(out, _held_back(self.buffer, THINK_END_TOKEN))
                return out
            self._emit(out, "reasoning", self.buffer[:i])
            self.buffer, self.mode = self.buffer[i + len(THINK_END_TOKEN) :], "content"
        i = self.buffer.find(CALLS_OPEN) if self.tools else -1
        if i >= 0:
            content = self.buffer[:i]
            self._emit(out, "content", content[:-2] if content.endswith("\n\n") else content)
            self.tool_text, self.buffer, self.mode = self.buffer[i:], "", "tool"
            return out
        keep = 0
        if self.tools:  # a marker prefix and the whitespace before it may be the blank line before calls
            keep = _held_back(self.buffer, CALLS_OPEN)
            rest = self.buffer[: len(self.buffer) - keep]
            keep += len(rest) - len(rest.rstrip())
        self._flush(out, max(keep, _held_back(self.buffer, EOS_TOKEN)))
        return out

    def finish(self) -> list[tuple[str, str]]:
        """Flush what was held back (the turn has ended, so a partial marker is plain text)."""
        out: list[tuple[str, str]] = []
        if self.mode != "tool":
            self._flush(out, 0)
        return out

    def _flush(self, out, keep: int) -> None:
        cut = len(self.buffer) - keep
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        eos = text.find(EOS_TOKEN)  # the engine normally strips EOS; never show it as text
        self._emit(out, self.mode, text if eos < 0 else text[:eos])

    def _emit(self, out, kind, text):
        if text:
            out.append((kind, text))
            self.pieces.append((kind, text))

    def joined(self, kind: str) -> str:
        return "".join(t for k, t in self.pieces if k == kind)


@dataclass
class ChatOutput:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_chat_output(text: str, *, thinking: bool, tools: bool) -> ChatOutput:
    """Split a finished assistant turn with `parse_assistant_output`. Tool calls are only parsed when
    tools were offered; a calls block that does not parse is returned as content rather than lost.
    Content is None when the turn is only tool calls (OpenAI's convention)."""
    if tools:
        try:
            parsed = parse_assistant_output(text, thinking)
        except ValueError:
            parsed = None
        if parsed is not None:
            content = parsed.content if parsed.content or not parsed.tool_calls else None
            return ChatOutput(parsed.reasoning_content, content, list(parsed.tool_calls))
    splitter = ChatStreamSplitter(thinking=thinking, tools=False)
    splitter.feed(text)
    splitter.finish()
    return ChatOutput(splitter.joined("reasoning") if thinking else None, splitter.joined("content"), [])


def parse_tool_calls(dsml_text: str) -> list[dict[str, Any]]:
    """A DSML calls block (as collected by `ChatStreamSplitter.tool_text`) -> OpenAI tool_calls, or []
    when it does not parse."""
    eos = dsml_text.find(EOS_TOKEN)
    try:
        return parse_tool_calls_block(dsml_text if eos < 0 else dsml_text[:eos])
    except ValueError:
        return []
