"""The files `transformers.AutoTokenizer.from_pretrained` expects next to a dsv41 `tokenizer.json`:
`tokenizer_config.json` (tokenizer class, BOS/EOS/PAD, and a Jinja `chat_template`) and
`special_tokens_map.json`.

V4.1 has no official Jinja template (its prompts come from `encoding.py`); `CHAT_TEMPLATE` is written
anew from `dsv41.chat.encoding.prompt_parts` and renders the same text for plain conversations: system
(or developer), user, assistant and latest_reminder messages with string or text-part content,
consecutive user messages merged by a blank line, thinking mode (`thinking=True`, `reasoning_effort`
1-100 or low/high/max) with earlier turns' reasoning dropped, `add_generation_prompt`. Tools, tool
messages, tool calls and images are refused by the template (`raise_exception`): use `dsv41.chat` (or the
server) for those. Tokenizing the rendered text gives the ids of `encode_prompt` when no message holds
marker text (tests/chat/test_hf_template.py checks it through transformers).
"""

from __future__ import annotations

import json
import os
from typing import Any

from dsv41.chat.encoding import DEFAULT_REASONING_EFFORT, REASONING_EFFORT_LEVELS, REASONING_EFFORT_SENTENCE
from dsv41.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    LATEST_REMINDER_TOKEN,
    SYSTEM_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)

_EFFORT_PREFIX, _EFFORT_SUFFIX = REASONING_EFFORT_SENTENCE.split("{}")


def _chat_template() -> str:
    """The Jinja source. `last_user` is the index of the last user message (or system message after the
    first): headers after it open `<think>` in thinking mode, and only assistants after it keep their
    reasoning, as `prompt_parts` does with drop_thinking."""
    levels = ", ".join(f"'{k}': {v}" for k, v in REASONING_EFFORT_LEVELS.items())

    def j(text: str) -> str:  # a Jinja string literal (JSON's quoting; the characters themselves, unescaped)
        return json.dumps(text, ensure_ascii=False)

    return (
        "{%- set thinking = thinking is defined and thinking -%}"
        "{%- if tools is defined and tools -%}{{ raise_exception('this template renders plain conversations; "
        "tools need dsv41.chat') }}{%- endif -%}"
        f"{{%- set effort = reasoning_effort if (reasoning_effort is defined and reasoning_effort is not none) "
        f"else {DEFAULT_REASONING_EFFORT} -%}}"
        f"{{%- if effort is string -%}}{{%- set effort = {{{levels}}}[effort] -%}}{{%- endif -%}}"
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'tool' or m.get('tool_calls') -%}{{ raise_exception('tool messages and tool calls "
        "need dsv41.chat') }}{%- endif -%}"
        "{%- if m['role'] == 'user' or (m['role'] in ('system', 'developer') and not loop.first) -%}"
        "{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        f"{{{{ {j(BOS_TOKEN)} }}}}"
        "{%- for m in messages -%}"
        "{%- set role = 'system' if m['role'] == 'developer' else m['role'] -%}"
        "{%- if m['content'] is string -%}{%- set text = m['content'] -%}"
        "{%- elif m['content'] is none -%}{%- set text = '' -%}"
        "{%- else -%}{%- for p in m['content'] if p['type'] != 'text' -%}"
        "{{ raise_exception('only text content parts: images need dsv41.chat') }}{%- endfor -%}"
        "{%- set text = m['content'] | map(attribute='text') | join('\\n\\n') -%}{%- endif -%}"
        "{%- if loop.first -%}"
        f"{{%- if thinking or role == 'system' -%}}{{{{ {j(SYSTEM_TOKEN)} }}}}{{%- endif -%}}"
        f"{{%- if thinking -%}}{{{{ {j(_EFFORT_PREFIX)} ~ effort ~ {j(_EFFORT_SUFFIX)} }}}}{{%- endif -%}}"
        "{%- endif -%}"
        "{%- if role == 'system' -%}"
        f"{{%- if not loop.first -%}}{{{{ {j(SYSTEM_TOKEN)} }}}}{{%- endif -%}}{{{{ text }}}}"
        "{%- elif role == 'user' -%}"
        f"{{%- if not loop.first and loop.previtem['role'] == 'user' -%}}{{{{ '\\n\\n' }}}}"
        f"{{%- else -%}}{{{{ {j(USER_TOKEN)} }}}}{{%- endif -%}}{{{{ text }}}}"
        "{%- elif role == 'latest_reminder' -%}"
        f"{{{{ {j(LATEST_REMINDER_TOKEN)} }}}}{{{{ text }}}}"
        "{%- elif role == 'assistant' -%}"
        "{%- if thinking and loop.index0 > ns.last_user -%}"
        f"{{{{ m.get('reasoning_content') or '' }}}}{{{{ {j(THINK_END_TOKEN)} }}}}{{%- endif -%}}"
        f"{{{{ text }}}}{{{{ {j(EOS_TOKEN)} }}}}"
        "{%- else -%}{{ raise_exception('unknown role ' ~ m['role']) }}"
        "{%- endif -%}"
        "{%- set following = none if loop.last else loop.nextitem['role'] -%}"
        "{%- if (role == 'user' and following != 'user') or (role == 'system' and not loop.first) -%}"
        "{%- if (following is none and add_generation_prompt is defined and add_generation_prompt)"
        " or following in ('assistant', 'latest_reminder') -%}"
        f"{{{{ {j(ASSISTANT_TOKEN)} }}}}"
        f"{{%- if thinking and loop.index0 >= ns.last_user -%}}{{{{ {j(THINK_START_TOKEN)} }}}}"
        f"{{%- else -%}}{{{{ {j(THINK_END_TOKEN)} }}}}{{%- endif -%}}"
        "{%- endif -%}{%- endif -%}"
        "{%- endfor -%}"
    )


CHAT_TEMPLATE = _chat_template()


def hf_tokenizer_config(
    bos: str | None, eos: str, pad: str | None, *, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """tokenizer_config.json for a dsv41 tokenizer.json: `PreTrainedTokenizerFast` (the tokenizer is all in
    tokenizer.json), its BOS/EOS/PAD names and the chat template. `extra`: fields of an existing config,
    kept unless they are ours to set."""
    config = dict(extra or {})
    config.update(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos,
            "chat_template": CHAT_TEMPLATE,
            # the prompt starts with BOS by itself (the template writes it, encode(add_bos=True) adds it)
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
    )
    config.setdefault("model_max_length", 1 << 20)
    if bos is not None:
        config["bos_token"] = bos
    if pad is not None:
        config["pad_token"] = pad
    return config


def write_hf_tokenizer_files(out_dir: str, tokenizer, base_config: str | None = None) -> None:
    """Write tokenizer_config.json and special_tokens_map.json for `tokenizer` (a dsv41.tokenizer.HFTokenizer
    whose tokenizer.json is, or will be, in `out_dir`), keeping the other fields of `base_config` (a
    tokenizer_config.json the tokenizer came with; default: the one already in `out_dir`, if any)."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    base_config = base_config or path
    existing: dict[str, Any] = {}
    if os.path.isfile(base_config):
        with open(base_config, encoding="utf-8") as f:
            existing = json.load(f)
        if not isinstance(existing, dict):
            existing = {}
    names = {
        k: tokenizer.id_to_token(i)
        for k, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id))
    }
    config = hf_tokenizer_config(names["bos"], names["eos"], names["pad"], extra=existing)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({f"{k}_token": v for k, v in names.items()}, f, ensure_ascii=False, indent=2)


__all__ = ["CHAT_TEMPLATE", "hf_tokenizer_config", "write_hf_tokenizer_files"]
