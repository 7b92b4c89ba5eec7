"""Request bodies of the OpenAI-compatible API and the OpenAI error shape.

Field names and defaults follow the OpenAI API reference (`/v1/completions`, `/v1/chat/completions`);
`top_k`, `stop_token_ids`, `ignore_eos`, `repetition_penalty`, `min_p`, `min_tokens`, `return_token_ids`
and `chat_template_kwargs` are the vLLM extensions of the same names, and `/tokenize` / `/detokenize`
take vLLM's bodies. Unknown fields are ignored, as OpenAI-style servers do, so clients that send `user`,
`store` or `metadata` keep working. Range checks that need the model (vocab, context length) live in `app.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


def find_invalid_text(value: Any, where: str = "body") -> str | None:
    """The path of the first string (or dict key) that is not valid Unicode: JSON's `\\ud800` escapes
    decode to lone surrogates, which no tokenizer or UTF-8 encoder accepts. None when all is well."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str) and find_invalid_text(key) is not None:
                    return f"{path} (a key)"
                stack.append((sub, f"{path}.{key}"))
        elif isinstance(item, list):
            stack.extend((sub, f"{path}[{k}]") for k, sub in enumerate(item))
    return None


class StreamOptions(_Request):
    include_usage: bool = False


class FunctionDef(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class _TextRequest(_Request):
    """A body whose every string must be valid Unicode (checked before any field)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        bad = find_invalid_text(data, "")
        if bad is not None:
            where = bad.lstrip(".") or "body"
            raise ValueError(f"{where} is not valid Unicode text (it holds a lone surrogate)")
        return data


class _Sampling(_TextRequest):
    """Fields shared by both endpoints."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1 disables
    seed: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # extension
    min_p: float | None = None  # extension
    min_tokens: int | None = None  # extension
    return_token_ids: bool | None = False  # extension: each choice carries its token ids
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (dsv41.server.structured)
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM): json, regex, choice, grammar, json_object


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    reasoning_effort: int | str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # {"thinking": bool} (vLLM style)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one tool call


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(_TextRequest):
    """vLLM's `/tokenize`: either `prompt` (tokenized as `/v1/completions` would: BOS first unless
    `add_special_tokens` is false) or `messages` (rendered as `/v1/chat/completions` would, with the
    assistant turn's opening when `add_generation_prompt`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # prompt: default true; chat: the template has its own BOS
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: int | str | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(_Request):
    """vLLM's `/detokenize`: token ids -> text."""

    model: str | None = None
    tokens: list[int]
