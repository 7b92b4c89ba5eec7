"""Plays as conversations: `dsv41 data --format chat` (the shipped default checkpoint's training text).

A play's text is cut into speeches: a paragraph (lines between blank lines) whose first line is a
speaker's name (`ROMEO.`, `First Lady.`, `Ham.`, `DEMETRIUS`) starts one; a paragraph without a name
continues the previous speech (after a stage direction); stage-direction lines (`[Exit.]`) are left
out; an `ACT` or `SCENE` heading ends the scene. Consecutive speeches of a scene become a conversation
in the V4.1 chat format (`dsv41.chat.encoding`, non-thinking mode): the first speech is a user turn,
the next the assistant's reply, and so on, up to `turns` speeches per conversation. Speaker names are
not part of the turns, so a user types a line and the model answers with the next one.

Each conversation is one document. Its text is the rendered conversation without the leading BOS and
the trailing EOS markers, which the shards put around every document (`dsv41.data.shards`), so a
shard holds exactly the ids of `encode_prompt` for the conversation. The chat markers are special
tokens of the trained BPE (`CHAT_SPECIAL_TOKENS`), one id each, as in the released tokenizer. Works
without speeches (sonnets, poems) give no conversation.
"""

from __future__ import annotations

import re

from dsv41.chat.encoding import encode_messages
from dsv41.data.sources import Document
from dsv41.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    SYSTEM_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)

# the chat template's markers, after BOS/EOS/PAD (ids 3-7 of a BPE trained for --format chat)
CHAT_SPECIAL_TOKENS = (USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN, THINK_START_TOKEN, THINK_END_TOKEN)
FORMATS = ("text", "chat")
DEFAULT_TURNS = 6

# a speaker line: 1-4 capitalised words (connectives allowed), an optional final period
_NAME_WORD = re.compile(r"(?:[A-Z][A-Za-z'\-]*\.?|of|and|the|de|la|le|du)")
_HEADING = re.compile(r"^(?:ACT|SCENE|Act|Scene)\b")
_DIRECTION = re.compile(r"^\s*\[.*\]\s*$")


def _is_name(line: str) -> bool:
    line = line.strip()
    if not line or len(line) > 30 or line.endswith((",", ";", ":", "!", "?")):
        return False
    words = line.rstrip(".").split()
    return 1 <= len(words) <= 4 and all(_NAME_WORD.fullmatch(w) for w in words) and words[0][0].isupper()


def parse_scenes(text: str) -> list[list[str]]:
    """The speeches of a play, scene by scene: each speech its text lines joined by newlines, without
    the speaker's name and stage directions."""
    scenes: list[list[str]] = [[]]
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in paragraph.strip("\n").split("\n") if line.strip()]
        if not lines:
            continue
        if _HEADING.match(lines[0]):
            if scenes[-1]:
                scenes.append([])
            continue
        body = [line for line in lines[1:] if not _DIRECTION.match(line)]
        if len(lines) >= 2 and _is_name(lines[0]):
            if body:
                scenes[-1].append("\n".join(body))
        elif scenes[-1]:  # the speech goes on after a stage direction
            rest = [line for line in lines if not _DIRECTION.match(line)]
            if rest:
                scenes[-1][-1] += "\n" + "\n".join(rest)
    return [s for s in scenes if s]


def render_conversation(speeches: list[str]) -> str:
    """Speeches as alternating user / assistant turns, rendered with the V4.1 template, without the
    leading BOS and the final EOS (the shards add both)."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": s} for i, s in enumerate(speeches)]
    text = encode_messages(messages, thinking=False, add_generation_prompt=False)
    return text.removeprefix(BOS_TOKEN).removesuffix(EOS_TOKEN)


def chat_documents(doc: Document, turns: int = DEFAULT_TURNS) -> list[Document]:
    """`doc` (a play) as conversations of up to `turns` consecutive speeches of one scene (an even
    number, at least 2), each a Document named `NAME#cK`."""
    if turns < 2 or turns % 2:
        raise ValueError(f"turns must be an even number >= 2, got {turns}")
    out: list[Document] = []
    for scene in parse_scenes(doc.text):
        for start in range(0, len(scene) - 1, turns):
            speeches = scene[start : start + turns]
            speeches = speeches[: len(speeches) // 2 * 2]
            out.append(Document(doc.source, f"{doc.name}#c{len(out)}", render_conversation(speeches)))
    return out


__all__ = ["CHAT_SPECIAL_TOKENS", "DEFAULT_TURNS", "FORMATS", "chat_documents", "parse_scenes", "render_conversation"]
