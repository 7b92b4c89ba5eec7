"""The V4.1 chat format: prompt rendering (`encode_messages`; `prompt_parts` + `encode_prompt` to tokenize
client text safely) and completion parsing (`parse_assistant_output`), spec §10-§11."""

from dsv41.chat.dsml import ParsedOutput, parse_assistant_output, render_tool_calls
from dsv41.chat.encoding import encode_messages, encode_prompt, parse_reasoning_effort, prompt_parts, render_tools

__all__ = [
    "ParsedOutput",
    "encode_messages",
    "encode_prompt",
    "parse_assistant_output",
    "parse_reasoning_effort",
    "prompt_parts",
    "render_tool_calls",
    "render_tools",
]
