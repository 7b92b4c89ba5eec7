"""Grammar-constrained decoding (structured outputs, enforced tool calls) with llguidance.

A request with `SamplingParams.structured` (a `GrammarSpec`: an llguidance grammar, and optionally the
token after which it starts, `</think>` in thinking mode) gets a `RequestGrammar`: an llguidance matcher
advanced by every token the request keeps. Before each sampling, `sampling.process_logits` asks it for
the bool [vocab] mask of the tokens the grammar allows next and sets the others to -inf, after the other
logit processing; EOS is allowed exactly where the grammar accepts. The engine computes the masks of all
constrained requests of a step in one parallel llguidance call (`GrammarCompiler.prefetch`), so the
per-row sampler only reads them.

Speculative decoding stays lossless: the mask at draft position i is the grammar's state advanced along
the first i drafted tokens (consumed, masked, rolled back), so the target and draft distributions of
`sampling.verify_draft` are both the constrained ones and a draft token the grammar rejects has
probability 0 under the target and is never kept. A preempted request keeps its matcher: the engine keeps
its output tokens and recomputes only the KV cache, so the grammar state (a function of those tokens)
stays right.

Why llguidance (measured, README "Structured outputs"): it is a self-contained wheel (xgrammar requires
torch, transformers and triton, so installing it can replace the pinned torch), compiles a JSON schema
in ~1 ms against 47 ms for xgrammar on the 129,280-id DeepSeek vocabulary (compilation is on the request
path), and its Lark dialect names tokens by id (`<[id]>`) and embeds JSON schemas (`%json`), which the
DSML tool-call grammar needs (the `｜DSML｜` marker is one token). Its mask costs more per step (194 us
against 15 us on that vocabulary), which is small next to a decode step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from dsv41.engine.types import GrammarSpec

INSTALL_HINT = "structured outputs need `pip install dsv41[structured]` (the llguidance package)"


class GrammarUnavailable(ValueError):
    """llguidance is not installed."""

    def __init__(self):
        super().__init__(INSTALL_HINT)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarUnavailable() from None
    return llguidance


def grammar_available() -> bool:
    try:
        _llguidance()
    except GrammarUnavailable:
        return False
    return True


class _ByteVocab:
    """The `TokenizerWrapper` protocol llguidance reads for a `ByteTokenizer`: every id's bytes (a byte
    id is its byte; BOS/EOS/PAD, the chat markers and the unused ids are special tokens, which llguidance
    spells as 0xFF + name and never matches against text), and a text -> ids function."""

    def __init__(self, tokenizer, vocab_size: int):
        from dsv41.tokenizer import BYTE_OFFSET

        self._tok = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.tokens, self.special_token_ids = [], []
        for i in range(vocab_size):
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                self.tokens.append(bytes([i - BYTE_OFFSET]))
            else:
                name = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else f"<unused_{i}>"
                self.tokens.append(b"\xff" + name.encode("utf-8"))
                self.special_token_ids.append(i)

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, parse_special=False)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance bitmask int32 [..., ceil(vocab / 32)] (bit j of word w allows id 32 w + j) -> bool [..., vocab]."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [..., words, 32]
    return bits.flatten(-2)[..., :vocab].bool()


class GrammarCompiler:
    """Grammars for one tokenizer and model vocabulary: compiles and checks request grammars, makes each
    request's matcher, and computes a step's masks in one call. Building the llguidance tokenizer takes
    about a second on the DeepSeek vocabulary, so one compiler serves the engine's whole life."""

    def __init__(self, tokenizer, vocab_size: int):
        llg = _llguidance()
        from dsv41.tokenizer import ByteTokenizer, HFTokenizer

        self.vocab_size = vocab_size
        if isinstance(tokenizer, ByteTokenizer):
            self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)), n_vocab=vocab_size)
        elif isinstance(tokenizer, HFTokenizer):
            self.lltok = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_id)
        else:
            raise ValueError(f"structured outputs do not support the tokenizer {type(tokenizer).__name__}")
        self.eos_id = tokenizer.eos_id
        # llguidance's thread pool takes 80% of the cores: below 4 cores that is one worker, whose hand-offs
        # cost more than computing the masks in turn (measured on 2 cores: 4.4 against 2.7 ms for 8 requests)
        self._executor = llg.LLExecutor() if (os.cpu_count() or 1) >= 4 else None
        self._llg = llg

    # ------------------------------------------------------------------ grammars
    def json_schema(self, schema: dict) -> str:
        """A JSON schema -> grammar, compact JSON (no free whitespace: with it, a weak model can fill its
        budget with blanks). Raises ValueError when the schema is not one llguidance can compile."""
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return self.check(self._llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))

    def regex(self, pattern: str) -> str:
        return self.check(self._llg.LLMatcher.grammar_from_regex(pattern))

    def lark(self, text: str) -> str:
        """A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's)."""
        try:
            return self.check(self._llg.grammar_from("grammar", text))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the GBNF converter raises whatever it meets
            raise ValueError(f"invalid grammar: {exc}") from None

    def check(self, grammar: str) -> str:
        """The grammar, or ValueError with llguidance's message (first 500 characters)."""
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            message = messages[0] if messages else "invalid grammar"
            raise ValueError(message[:500])
        return grammar

    # ------------------------------------------------------------------ matching
    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        m = self._llg.LLMatcher(self.lltok, spec.grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid grammar: {m.get_error()[:500]}")
        return RequestGrammar(m, self.vocab_size, spec.start_after)

    def prefetch(self, grammars: Sequence[RequestGrammar]) -> None:
        """Compute the next-token masks of these requests (with no draft) in one parallel llguidance call,
        [B, ceil(vocab / 32)] int32, and keep each on its request (on fewer than 4 cores: one after another)."""
        todo = [g for g in grammars if g.active and () not in g._masks]
        if not todo:
            return
        if self._executor is None:
            for g in todo:
                g.allowed([0] * g.seen)  # the current state's mask (no drafted tail), kept on the request
            return
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(todo), words, dtype=torch.int32)  # [B, words]
        self._executor.unsafe_compute_mask_ptr(
            [(g._m, i) for i, g in enumerate(todo)], bitmask.data_ptr(), words * 4, len(todo)
        )
        masks = unpack_bitmask(bitmask, self.vocab_size)  # [B, vocab]
        for g, mask in zip(todo, masks):
            g._masks[()] = mask


class RequestGrammar:
    """One request's grammar state. `advance` feeds it every output token the request keeps; before
    `start_after` appears in the output (`</think>` in thinking mode) it constrains nothing."""

    def __init__(self, matcher, vocab_size: int, start_after: int | None = None):
        self._m, self.vocab_size, self.start_after = matcher, vocab_size, start_after
        self.active = start_after is None
        self.seen = 0  # output tokens advanced over
        self._masks: dict[tuple, torch.Tensor | None] = {}  # drafted tail -> bool [vocab]; per state

    def advance(self, token: int) -> None:
        self.seen += 1
        self._masks.clear()
        if not self.active:
            self.active = token == self.start_after
            return
        if not self._m.consume_token(int(token)):
            raise ValueError(f"token {token} violates the request's grammar: {self._m.get_error()[:200]}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS (or has taken EOS)."""
        return self.active and self._m.is_stopped()

    def allowed(self, output_ids: Sequence[int]) -> torch.Tensor | None:
        """bool [vocab]: the tokens allowed at the position after `output_ids` (everything advanced over,
        then drafted tokens), or None where nothing is constrained (before `start_after`). A draft the
        grammar rejects leads to an all-False mask: that position is never reached, since the rejected
        token has probability 0 where it was drafted."""
        if len(output_ids) < self.seen:
            raise ValueError("the grammar state is ahead of the request's tokens")
        tail = tuple(output_ids[self.seen :])
        if tail in self._masks:
            return self._masks[tail]
        active, consume = self.active, []
        for t in tail:
            if active:
                consume.append(int(t))
            elif t == self.start_after:
                active = True
        mask = None
        if active:
            taken = self._m.try_consume_tokens(consume) if consume else 0
            if taken < len(consume):
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            else:
                mask = unpack_bitmask(
                    torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32), self.vocab_size
                )
            if taken and not self._m.rollback(taken):
                raise RuntimeError(f"grammar rollback failed: {self._m.get_error()[:200]}")
        self._masks[tail] = mask
        return mask
