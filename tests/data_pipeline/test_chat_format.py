"""`dsv41 data --format chat` (dsv41/data/chat_format.py): plays cut into speeches, speeches rendered as
V4.1 chat turns, and shards that hold exactly the ids the server's prompt encoder gives a conversation."""

import numpy as np
import pytest

from dsv41.chat.encoding import encode_prompt, prompt_parts
from dsv41.data.build import build_dataset
from dsv41.data.chat_format import CHAT_SPECIAL_TOKENS, chat_documents, parse_scenes, render_conversation
from dsv41.data.shards import read_meta
from dsv41.data.sources import Document
from dsv41.tokenizer import ASSISTANT_TOKEN, USER_TOKEN, load_tokenizer

PLAY = """THE TRAGEDY OF NOBODY

ACT I. SCENE I. A room.

[Enter KING and LADY.]

KING.
Good morrow, lady; how fares the queen?

First Lady.
She sleeps, my lord,
and dreams of summer.

[Exit KING.]

Ham.
What news?

[Aside.]

Not a word of it.

DEMETRIUS
Then let us go.

SCENE II. Another room.

KING.
Who's there?

LADY.
A friend.
"""


def test_speeches_are_found_in_every_name_style_and_split_by_scene():
    scenes = parse_scenes(PLAY)
    assert scenes == [
        [
            "Good morrow, lady; how fares the queen?",
            "She sleeps, my lord,\nand dreams of summer.",
            "What news?\nNot a word of it.",  # the speech goes on after a stage direction
            "Then let us go.",
        ],
        ["Who's there?", "A friend."],
    ]


def test_conversations_alternate_user_and_assistant_and_stop_at_the_scene():
    docs = chat_documents(Document("plays", "nobody", PLAY), turns=2)
    assert [d.name for d in docs] == ["nobody#c0", "nobody#c1", "nobody#c2"]
    assert docs[0].text == (
        f"{USER_TOKEN}Good morrow, lady; how fares the queen?{ASSISTANT_TOKEN}</think>"
        "She sleeps, my lord,\nand dreams of summer."
    )
    assert docs[2].text == render_conversation(["Who's there?", "A friend."])
    (whole,) = chat_documents(Document("plays", "nobody", PLAY), turns=4)[:1]
    assert whole.text.count(USER_TOKEN) == 2 and whole.text.count(ASSISTANT_TOKEN) == 2
    assert chat_documents(Document("poems", "sonnet", "Shall I compare thee\nto a summer's day?")) == []
    with pytest.raises(ValueError, match="even"):
        chat_documents(Document("plays", "nobody", PLAY), turns=3)


def test_chat_shards_hold_the_ids_of_the_servers_prompt_encoder(tmp_path):
    plays = [
        Document("plays", f"play{i}", PLAY.replace("queen", f"queen {i}").replace("friend", f"friend {i}"))
        for i in range(12)
    ]
    meta = build_dataset(str(tmp_path), vocab_size=320, documents=plays, val_fraction=0.2, format="chat")
    assert meta["format"] == "chat" and meta["split_rule"]["format"] == "chat"
    tok = load_tokenizer(str(tmp_path), meta["vocab_size"])
    assert [tok.token_to_id(t) for t in CHAT_SPECIAL_TOKENS] == [3, 4, 5, 6, 7]
    docs = read_meta(str(tmp_path))["documents"]
    first = next(d for d in docs if d["split"] == "train")
    ids = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)[first["offset"] : first["offset"] + first["tokens"]]
    play = next(p for p in plays if first["name"].startswith(p.name + "#"))
    speeches = parse_scenes(play.text)[0][:4]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": s} for i, s in enumerate(speeches)]
    parts = prompt_parts(messages, thinking=False, add_generation_prompt=False)
    assert ids.tolist() == encode_prompt(tok, parts)  # BOS ... final EOS, markers one id each
