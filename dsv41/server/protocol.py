"""Request bodies of the OpenAI-compatible API and the OpenAI error shape.

Field names and defaults follow the OpenAI API reference (`/v1/completions`, `/v1/chat/completions`);
`top_k`, `stop_token_ids`, `ignore_eos`, `repetition_penalty`, `min_p`, `min_tokens`, `return_token_ids`
and `chat_template_kwargs` are the vLLM extensions of the same names, and `/tokenize` / `/detokenize`
take vLLM's bodies. Unknown fields are ignored, as OpenAI-style servers do, so clients that send `user`,
`store` or `metadata` keep working. Range checks that need the model (vocab, context length) live in `app.py`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


def find_invalid_text(value: Any, where: str = "body") -> Optional[str]:
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
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


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

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # extension; 0 or -1 disables
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None  # extension
    ignore_eos: bool = False  # extension
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    repetition_penalty: Optional[float] = None  # extension
    min_p: Optional[float] = None  # extension
    min_tokens: Optional[int] = None  # extension
    return_token_ids: Optional[bool] = False  # extension: each choice carries its token ids
    response_format: Optional[dict[str, Any]] = None  # text, json_object, json_schema (dsv41.server.structured)
    structured_outputs: Optional[dict[str, Any]] = None  # extension (vLLM): json, regex, choice, grammar, json_object


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    reasoning_effort: Union[int, str, None] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # {"thinking": bool} (vLLM style)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None  # false: at most one tool call


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TokenizeRequest(_TextRequest):
    """vLLM's `/tokenize`: either `prompt` (tokenized as `/v1/completions` would: BOS first unless
    `add_special_tokens` is false) or `messages` (rendered as `/v1/chat/completions` would, with the
    assistant turn's opening when `add_generation_prompt`)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: Optional[bool] = None  # prompt: default true; chat: the template has its own BOS
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Union[int, str, None] = None
    tools: Optional[list[Tool]] = None


class DetokenizeRequest(_Request):
    """vLLM's `/detokenize`: token ids -> text."""

    model: Optional[str] = None
    tokens: list[int]
