"""The Jinja chat template written next to a dsv41 tokenizer.json (dsv41.chat.hf_template): rendered by
jinja2 as transformers renders it, it gives `encode_messages`' text for plain conversations; a checkpoint
folder written by the trainer's `save_checkpoint` (over a BPE trained as `dsv41 data` trains it) loads
with `transformers.AutoTokenizer`, whose `apply_chat_template` gives exactly the ids of `dsv41.chat`."""

import json
import os

import pytest

from dsv41.chat.encoding import encode_messages, encode_prompt, prompt_parts
from dsv41.chat.hf_template import CHAT_TEMPLATE
from tests.conftest import optional_import

S, U, A = "system", "user", "assistant"


def m(role, content, **kw):
    return {"role": role, "content": content, **kw}


CONVERSATIONS = [
    [m(U, "Hello")],
    [m(S, "You are terse."), m(U, "Hi there!")],
    [m("developer", "Be kind."), m(U, "Q1"), m(A, "A1"), m(U, "Q2")],
    [
        m(U, "first"),
        m(U, "second, merged"),
        m(A, "ok"),
        m(U, [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
    ],
    [m(S, "sys"), m(U, "q"), m(A, "a", reasoning_content="why"), m(U, "q2"), m(A, "a2", reasoning_content="because")],
    [m(U, "q"), m(A, "a"), m(S, "a later system message"), m(U, "q3")],
    [m(U, "q"), m("latest_reminder", "remember"), m(A, "a")],
    [m(S, ""), m(U, "  spaces  and\nnewlines\n\n"), m(A, "héllo — ✓")],
]
OPTIONS = [
    dict(),
    dict(add_generation_prompt=False),
    dict(thinking=True),
    dict(thinking=True, reasoning_effort=40),
    dict(thinking=True, reasoning_effort="max", add_generation_prompt=False),
]


def _render(messages, **kw):
    jinja2 = optional_import("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    # transformers' own settings: a sandbox with lists immutable, trim_blocks, lstrip_blocks
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    kw.setdefault("add_generation_prompt", True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, **kw)


def _ours(messages, **kw):
    return dict(
        thinking=kw.get("thinking", False),
        reasoning_effort=kw.get("reasoning_effort"),
        add_generation_prompt=kw.get("add_generation_prompt", True),
    )


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_template_renders_the_encoder_text(conv, opt):
    messages, kw = CONVERSATIONS[conv], OPTIONS[opt]
    assert _render(messages, **kw) == encode_messages(messages, **_ours(messages, **kw))


@pytest.mark.parametrize(
    "messages,kw",
    [
        ([m("tool", "42", tool_call_id="c1")], {}),
        (
            [
                m(U, "q"),
                m(A, None, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
            ],
            {},
        ),
        ([m(U, [{"type": "image_url", "image_url": {"url": "data:,"}}])], {}),
        ([m(U, "q")], {"tools": [{"type": "function", "function": {"name": "f"}}]}),
        ([m("robot", "q")], {}),
    ],
)
def test_template_refuses_what_it_cannot_render(messages, kw):
    jinja2 = optional_import("jinja2")
    with pytest.raises(jinja2.exceptions.TemplateError):
        _render(messages, **kw)


def test_trained_checkpoint_loads_with_autotokenizer_and_matches_dsv41_chat(tmp_path, tiny_model):
    transformers = optional_import("transformers")
    optional_import("tokenizers")
    # transformers 5 reads the model's config.json before any tokenizer file; importing dsv41.hf registers
    # model_type deepseek_v41 with AutoConfig (a plain PretrainedConfig chokes on dsv41's `dtype: "bf16"`)
    import dsv41.hf  # noqa: F401
    from dsv41.data.bpe import train_bpe
    from dsv41.tokenizer import HFTokenizer
    from dsv41.train.checkpoint import save_checkpoint
    from tests.data_pipeline.test_data_pipeline import make_docs

    data = tmp_path / "data"
    train_bpe((d.text for d in make_docs(20)), 400, str(data))  # what `dsv41 data` writes
    folder = tmp_path / "checkpoint"
    save_checkpoint(str(folder), tiny_model, tiny_model.cfg, str(data / "tokenizer.json"))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(folder))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id) == (0, 1, 2)
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    text = "WORK 7\nÉ fin — ✓ and some words"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_bos=False)
    assert hf.decode(ours.encode(text, add_bos=False)) == text
    for messages in CONVERSATIONS:
        for kw in OPTIONS:
            kw = {"add_generation_prompt": True, **kw}  # transformers' default is False, ours True
            want = encode_prompt(ours, prompt_parts(messages, **_ours(messages, **kw)))
            got = hf.apply_chat_template(messages, tokenize=True, **kw)
            got = list(got["input_ids"]) if hasattr(got, "keys") else list(got)  # BatchEncoding in transformers 5
            assert got == want, (messages, kw)
