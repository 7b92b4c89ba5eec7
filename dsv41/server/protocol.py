"""Request bodies of the OpenAI-compatible API and the OpenAI error shape.

Field names and defaults follow the OpenAI API reference (`/v1/completions`, `/v1/chat/completions`);
`top_k`, `stop_token_ids`, `ignore_eos`, `repetition_penalty`, `min_p`, `min_tokens`, `return_token_ids`
and `chat_template_kwargs` are the vLLM extensions of the same names, and `/tokenize` / `/detokenize`
take vLLM's bodies. Unknown fields are ignored, as OpenAI-style servers do, so clients that send `user`,
`store` or `metadata` keep working. Range checks that need the model (vocab, context length) live in `app.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from dsv41.server import shapes
from dsv41.server.shapes import documented_as


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
    """Fields take JSON's types strictly, as the schema states them: no `"2"` for 2 or `0` for false (an
    integral number such as 2.0 is the integer 2, as JSON Schema counts it)."""

    model_config = ConfigDict(extra="ignore", strict=True)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


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
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
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


# Each field is validated as its own type says (as before), the handlers' checks following with their own
# messages; `documented_as(shape)` gives the schema the contract those checks enforce (dsv41.server.shapes).
MODEL_DOC = "the served model (`GET /v1/models`); another name gets 404"
D = documented_as


class _Sampling(_TextRequest):
    """Fields shared by both endpoints."""

    model: Annotated[str | None, D(shapes.ModelName | None)] = Field(None, description=MODEL_DOC)
    temperature: Annotated[float | None, D(shapes.Temperature | None)] = Field(None, description="default 1; 0: greedy")
    top_p: Annotated[float | None, D(shapes.TopP | None)] = Field(None, description="default 1")
    top_k: Annotated[Int | None, D(shapes.TopK | None)] = Field(None, description="extension; 0 or -1: off")
    seed: Annotated[Int | None, D(shapes.Seed | None)] = None
    max_tokens: Annotated[Int | None, D(shapes.NewTokens | None)] = Field(
        None, description="the prompt and max_tokens must fit max_model_len (else 400 context_length_exceeded)"
    )
    stop: Annotated[str | list[str] | None, D(shapes.Stop | None)] = None
    stop_token_ids: Annotated[list[Int] | None, D(shapes.StopTokenIds | None)] = Field(None, description="extension")
    ignore_eos: bool = Field(False, description="extension")
    n: Annotated[Int | None, D(shapes.Choices | None)] = Field(1, description="choices returned")
    stream: bool | None = Field(False, description="server-sent events (text/event-stream)")
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float | None, D(shapes.Penalty | None)] = 0.0
    frequency_penalty: Annotated[float | None, D(shapes.Penalty | None)] = 0.0
    logit_bias: Annotated[dict[str, float] | None, D(shapes.LogitBias | None)] = None
    repetition_penalty: Annotated[float | None, D(shapes.RepetitionPenalty | None)] = Field(
        None, description="extension"
    )
    min_p: Annotated[float | None, D(shapes.MinP | None)] = Field(None, description="extension")
    min_tokens: Annotated[Int | None, D(shapes.MinTokens | None)] = Field(
        None, description="extension; at most max_tokens, and not with structured outputs"
    )
    return_token_ids: bool | None = Field(False, description="extension: each choice carries its token ids")
    # text, json_object, json_schema (dsv41.server.structured)
    response_format: Annotated[dict[str, Any] | None, D(shapes.ResponseFormat | None)] = None
    structured_outputs: Annotated[dict[str, Any] | None, D(shapes.StructuredOutputs | None)] = Field(
        None, description="extension (vLLM); not with response_format"
    )


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra=shapes.CHAT_REQUEST_RULES)

    messages: Annotated[list[dict[str, Any]], Field(min_length=1), D(shapes.ChatMessages)]
    max_completion_tokens: Annotated[Int | None, D(shapes.NewTokens | None)] = Field(
        None, description="takes the place of max_tokens when given"
    )
    logprobs: bool | None = False
    top_logprobs: Annotated[Int | None, D(shapes.Logprobs | None)] = Field(None, description="needs logprobs: true")
    reasoning_effort: Annotated[Int | str | None, D(shapes.ChatEffort | None)] = Field(
        None, description="turns thinking mode on, unless chat_template_kwargs turn it off"
    )
    chat_template_kwargs: Annotated[dict[str, Any] | None, D(shapes.ChatTemplateKwargs | None)] = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[str | dict[str, Any] | None, D(shapes.ChatToolChoice | None)] = Field(
        None, description="needs tools"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call")


class CompletionRequest(_Sampling):
    prompt: Annotated[str | list[Int] | list[str] | list[list[Int]], D(shapes.CompletionPrompt)] = Field(
        description="text or token ids, or a list of one of these (no batches)"
    )
    logprobs: Annotated[Int | None, D(shapes.Logprobs | None)] = None
    echo: Annotated[bool | None, D(Literal[False] | None)] = Field(False, description="not supported")
    best_of: Annotated[Int | None, D(shapes.Choices | None)] = Field(
        None, description="at least n; more than n cannot be streamed"
    )
    suffix: Annotated[str | None, D(shapes.NotSupported | None)] = Field(None, description="not supported")


class TokenizeRequest(_TextRequest):
    """vLLM's `/tokenize`: either `prompt` (tokenized as `/v1/completions` would: BOS first unless
    `add_special_tokens` is false) or `messages` (rendered as `/v1/chat/completions` would, with the
    assistant turn's opening when `add_generation_prompt`)."""

    model_config = ConfigDict(json_schema_extra=shapes.TOKENIZE_RULES)

    model: Annotated[str | None, D(shapes.ModelName | None)] = Field(None, description=MODEL_DOC)
    prompt: str | None = None
    messages: Annotated[list[dict[str, Any]] | None, D(shapes.ChatMessages | None)] = None
    add_special_tokens: bool | None = Field(
        None, description="prompt: default true; messages: the template has its own BOS"
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="with messages: not supported")
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="with messages: as for chat completions")
    reasoning_effort: Int | str | None = Field(None, description="with messages: as for chat completions")
    tools: list[Tool] | None = Field(None, description="with messages: as for chat completions")


class DetokenizeRequest(_Request):
    """vLLM's `/detokenize`: token ids -> text."""

    model: Annotated[str | None, D(shapes.ModelName | None)] = Field(None, description=MODEL_DOC)
    tokens: Annotated[list[Int], D(list[shapes.TokenId])]
