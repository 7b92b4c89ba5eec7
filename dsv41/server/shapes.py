"""What the request bodies' free-form fields accept, as types: the OpenAPI schema's account of the checks
the handlers make (chat messages, content parts, tool calls, `response_format`, `structured_outputs`,
Responses input items, ...) and of the sampling ranges `SamplingParams.validate` enforces.

These types are documentation: the request models (protocol.py, responses.py) still validate these fields
as before (`dict`, `list`, numbers) and the handlers' own checks refuse what does not fit, with their own
messages (400, OpenAI's error shape). `documented_as(shape)` puts a shape into the schema of such a field.

Marks that `dsv41.server.openapi` resolves for one server (`x-dsv41-*` keys; absent from the served
schema): `maximum` bounds that depend on the server (`max_new_tokens` = max_model_len - 1,
`max_token_id` = vocab_size - 1, `max_choices`), the served model names, token-id object keys, and
branches that only a model with a vision tower (`vision`) or an install with llguidance
(`structured_outputs`) accepts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema, with_config
from typing_extensions import NotRequired, TypedDict

from dsv41.engine.types import SamplingParams

MARK = "x-dsv41-"


def _same(value: Any) -> Any:
    return value


def documented_as(shape: Any) -> BeforeValidator:
    """Annotate a field (validated as its own type says) with the JSON schema of `shape`."""
    return BeforeValidator(_same, json_schema_input_type=shape)


def server_max(limit: str) -> Field:
    """`maximum` set by dsv41.server.openapi: 'max_new_tokens', 'max_token_id', 'max_choices' (each server's
    own), or 'max_seed' (2**63 - 1, exactly)."""
    return Field(json_schema_extra={MARK + "maximum": limit})


def needs(capability: str) -> dict:
    """The mark of a shape only accepted with `capability` ('vision' or 'structured_outputs')."""
    return {MARK + "needs": capability}


def _schema(schema: dict) -> WithJsonSchema:
    return WithJsonSchema(schema)


# ---------------------------------------------------------------------------------------------- scalars

P = SamplingParams
Temperature = Annotated[float, Field(ge=0, le=100)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=-1, description="0 or -1: off")]
Seed = Annotated[int, Field(ge=0), server_max("max_seed")]
Penalty = Annotated[float, Field(ge=-P.PENALTY_RANGE, le=P.PENALTY_RANGE)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=P.MAX_REPETITION_PENALTY)]
MinP = Annotated[float, Field(ge=0, le=1)]
Logprobs = Annotated[int, Field(ge=0, le=P.MAX_LOGPROBS)]
NewTokens = Annotated[int, Field(ge=1), server_max("max_new_tokens")]
MinTokens = Annotated[int, Field(ge=0), server_max("max_new_tokens")]
Choices = Annotated[int, Field(ge=1), server_max("max_choices")]
TokenId = Annotated[int, Field(ge=0), server_max("max_token_id")]
StopString = Annotated[str, Field(min_length=1, max_length=P.MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=P.MAX_STOP)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=P.MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[
    dict[str, float],
    _schema(
        {
            "type": "object",
            "description": "token id (a decimal string) -> bias added to its logit",
            "propertyNames": {MARK + "token_id_key": True},
            "additionalProperties": {
                "type": "number",
                "minimum": -P.LOGIT_BIAS_RANGE,
                "maximum": P.LOGIT_BIAS_RANGE,
            },
            "maxProperties": P.MAX_LOGIT_BIAS,
        }
    ),
]
ModelName = Annotated[str, Field(json_schema_extra={MARK + "enum": "model"})]
ChatEffort = Annotated[int, Field(ge=1, le=100)] | Literal["low", "high", "max"]
NotSupported = Annotated[str, Field(max_length=0)]
# a tool or parameter name the DSML format can carry
Name = Annotated[str, Field(min_length=1, pattern='^[^"\\n]+$')]
# vLLM's structured_outputs: a value counts as given unless it is null or false
_UNSET = {"enum": [None, False]}


# ---------------------------------------------------------------------------------------------- chat


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImageURL(TypedDict):
    url: Annotated[str, Field(min_length=1, description="an http(s) or data: URL")]


@with_config(ConfigDict(json_schema_extra=needs("vision")))
class ImageURLPart(TypedDict):
    """An image (models with a vision tower only)."""

    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, Field(min_length=1)]


Text = str | list[TextPart]


class SystemMessage(TypedDict):
    """`developer` is read as `system`."""

    role: Literal["system", "developer"]
    content: Text


class LatestReminderMessage(TypedDict):
    role: Literal["latest_reminder"]
    content: Text


class UserMessage(TypedDict):
    role: Literal["user"]
    content: str | list[TextPart | ImageURLPart]


class ToolMessage(TypedDict):
    """A tool result; results are put in the order of the calls they answer (`tool_call_id`)."""

    role: Literal["tool"]
    content: Text
    tool_call_id: NotRequired[str]


ToolArguments = Annotated[
    dict[str, Any] | str,
    _schema(
        {
            "description": "an object, or a string holding one as JSON (empty: no arguments); parameter names "
            "as function names, string values without ｜DSML｜",
            "anyOf": [
                {"type": "object", "propertyNames": {"minLength": 1, "pattern": '^[^"\\n]+$'}},
                {"type": "string"},
            ],
        }
    ),
]


class ToolCallFunction(TypedDict):
    name: Name
    arguments: NotRequired[ToolArguments]


class ToolCall(TypedDict):
    id: NotRequired[str | None]
    type: NotRequired[Literal["function"]]
    function: ToolCallFunction


@with_config(
    ConfigDict(
        json_schema_extra={
            "description": "An earlier assistant turn: `content` may be null or absent when it made tool calls.",
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
            ],
        }
    )
)
class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: NotRequired[Text | None]
    reasoning_content: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall] | None]


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage | LatestReminderMessage,
    Field(discriminator="role"),
]
ChatMessages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatTemplateKwargs(TypedDict):
    """Other keys are ignored."""

    thinking: NotRequired[Annotated[bool, Field(description="thinking mode (V4.1 `<think>`)")]]
    enable_thinking: NotRequired[Annotated[bool, Field(description="the same as `thinking`")]]


class FunctionName(TypedDict):
    name: str


@with_config(ConfigDict(json_schema_extra=needs("structured_outputs")))
class ChatToolChoiceFunction(TypedDict):
    """Call this function (one of `tools`), enforced while decoding."""

    type: Literal["function"]
    function: FunctionName


ToolChoiceMode = Annotated[
    Literal["none", "auto"], Field(description="none: render no tools; auto: the model may call them")
]
RequiredToolChoice = Annotated[
    Literal["required"],
    Field(
        description="a call to one of `tools`, enforced while decoding", json_schema_extra=needs("structured_outputs")
    ),
]
ChatToolChoice = ToolChoiceMode | RequiredToolChoice | ChatToolChoiceFunction


# ---------------------------------------------------------------------------------------------- structured


class TextFormat(TypedDict):
    type: NotRequired[Literal["text"]]


@with_config(ConfigDict(json_schema_extra=needs("structured_outputs")))
class JSONObjectFormat(TypedDict):
    """Any JSON object."""

    type: Literal["json_object"]


class JSONSchemaSpec(TypedDict):
    name: NotRequired[str | None]
    schema: Annotated[dict[str, Any] | str, Field(description="a JSON schema (an object, or a string holding one)")]
    strict: NotRequired[bool | None]


@with_config(ConfigDict(json_schema_extra=needs("structured_outputs")))
class JSONSchemaFormat(TypedDict):
    """Output that follows `json_schema.schema` (enforced, strict or not)."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = TextFormat | JSONObjectFormat | JSONSchemaFormat

_STRUCTURED_VALUES = {
    "json": {"anyOf": [{"type": "object"}, {"type": "string"}], "description": "a JSON schema"},
    "regex": {"type": "string", "description": "a regular expression (llguidance's dialect)"},
    "choice": {
        "type": "array",
        "items": {"type": "string", "minLength": 1},
        "minItems": 1,
        "maxItems": 1024,
        "description": "one of these strings",
    },
    "grammar": {"type": "string", "pattern": "\\S", "description": "a Lark (llguidance) or GBNF grammar"},
    "json_object": {"const": True, "description": "any JSON object"},
}


def _structured_value(key: str) -> Any:
    value = dict(_STRUCTURED_VALUES[key])
    return Annotated[Any, _schema({"anyOf": [value, _UNSET], "description": value.pop("description")})]


@with_config(
    ConfigDict(
        json_schema_extra={
            "additionalProperties": _UNSET,
            "oneOf": [{"required": [k], "properties": {k: {"not": _UNSET}}} for k in _STRUCTURED_VALUES],
            **needs("structured_outputs"),
        }
    )
)
class StructuredOutputs(TypedDict):
    """vLLM's structured outputs: exactly one of these (a null or false value counts as absent)."""

    json: NotRequired[_structured_value("json")]
    regex: NotRequired[_structured_value("regex")]
    choice: NotRequired[_structured_value("choice")]
    grammar: NotRequired[_structured_value("grammar")]
    json_object: NotRequired[_structured_value("json_object")]


# ---------------------------------------------------------------------------------------------- responses


class InputTextPart(TypedDict):
    type: Literal["input_text", "output_text", "text"]
    text: str


@with_config(ConfigDict(json_schema_extra=needs("vision")))
class InputImagePart(TypedDict):
    """An image (user messages, models with a vision tower only)."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(description="an http(s) or data: URL")]


class UserMessageItem(TypedDict):
    type: NotRequired[Literal["message"]]
    role: Literal["user"]
    content: str | Annotated[list[InputTextPart | InputImagePart], Field(min_length=1)]


class MessageItem(TypedDict):
    """`developer` is read as `system`."""

    type: NotRequired[Literal["message"]]
    role: Literal["system", "developer", "assistant"]
    content: str | Annotated[list[InputTextPart], Field(min_length=1)]


class FunctionCallItem(TypedDict):
    """A call the model made earlier; it joins the assistant turn it follows."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Name
    arguments: Annotated[str, Field(description="the arguments object as JSON (empty: none)")]


class FunctionCallOutputItem(TypedDict):
    """A function's result (a tool message)."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputTextPart]


class ReasoningTextPart(TypedDict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


ReasoningText = str | list[ReasoningTextPart] | None


class ReasoningItem(TypedDict):
    """Reasoning of the assistant turn that follows (`content`, else `summary`)."""

    type: Literal["reasoning"]
    content: NotRequired[ReasoningText]
    summary: NotRequired[ReasoningText]


InputItem = UserMessageItem | MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
# reasoning items only annotate the assistant turn after them: the input needs some other item
_NOT_ONLY_REASONING = {"contains": {"not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}}
ResponsesInput = str | Annotated[list[InputItem], Field(min_length=1, json_schema_extra=_NOT_ONLY_REASONING)]


class FunctionTool(TypedDict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: NotRequired[Any]
    parameters: NotRequired[dict[str, Any] | None]


@with_config(ConfigDict(json_schema_extra=needs("structured_outputs")))
class ResponsesToolChoiceFunction(TypedDict):
    """Call this function (one of `tools`), enforced while decoding."""

    type: Literal["function"]
    name: str


ResponsesToolChoice = ToolChoiceMode | RequiredToolChoice | ResponsesToolChoiceFunction


class Reasoning(TypedDict):
    effort: NotRequired[
        Annotated[
            Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
            | Annotated[int, Field(ge=1, le=100)]
            | None,
            Field(description="none (or null): thinking mode off; otherwise on, with this reasoning effort"),
        ]
    ]
    summary: NotRequired[Any]


@with_config(ConfigDict(json_schema_extra=needs("structured_outputs")))
class ResponsesJSONSchemaFormat(TypedDict):
    """Output that follows `schema`."""

    type: Literal["json_schema"]
    name: NotRequired[str | None]
    schema: dict[str, Any]
    strict: NotRequired[bool | None]


class ResponsesText(TypedDict):
    format: NotRequired[TextFormat | JSONObjectFormat | ResponsesJSONSchemaFormat | None]


# ---------------------------------------------------------------------------------------------- bodies

CompletionPrompt = (
    str
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[str], Field(min_length=1, max_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]
)


def _absent_or_null(field: str) -> dict:
    return {"properties": {field: {"type": "null"}}}


# rules across fields, as JSON schema (each a body-level anyOf / oneOf)
TOOL_CHOICE_NEEDS_TOOLS = {
    "anyOf": [
        _absent_or_null("tool_choice"),
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    ]
}
TOP_LOGPROBS_NEEDS_LOGPROBS = {
    "anyOf": [
        _absent_or_null("top_logprobs"),
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    ]
}
CHAT_REQUEST_RULES = {"allOf": [TOOL_CHOICE_NEEDS_TOOLS, TOP_LOGPROBS_NEEDS_LOGPROBS]}
RESPONSES_REQUEST_RULES = {"allOf": [TOOL_CHOICE_NEEDS_TOOLS]}
CHAT_EFFORT = {
    "anyOf": [
        {"type": "integer", "minimum": 1, "maximum": 100},
        {"type": "string", "enum": ["low", "high", "max"]},
        {"type": "null"},
    ]
}
# /tokenize: prompt or messages; the chat fields only count (and are only checked) with messages
TOKENIZE_RULES = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {
            "required": ["messages"],
            "properties": {
                "messages": {"type": "array"},
                "prompt": {"type": "null"},
                "continue_final_message": {"const": False},
                "reasoning_effort": CHAT_EFFORT,
                "chat_template_kwargs": {
                    "anyOf": [{"$ref": "#/components/schemas/ChatTemplateKwargs"}, {"type": "null"}]
                },
            },
        },
    ]
}
