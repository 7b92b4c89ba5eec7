"""The V4.1 chat format: prompt rendering (`encode_messages`) and completion parsing
(`parse_assistant_output`), spec §10-§11."""

from dsv41.chat.dsml import ParsedOutput, parse_assistant_output, render_tool_calls
from dsv41.chat.encoding import encode_messages, parse_reasoning_effort, render_tools

__all__ = ["ParsedOutput", "encode_messages", "parse_assistant_output", "parse_reasoning_effort",
           "render_tool_calls", "render_tools"]
