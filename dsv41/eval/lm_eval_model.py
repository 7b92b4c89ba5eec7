"""An lm-evaluation-harness model (`lm_eval.api.model.LM`, registered as "dsv41") backed by the dsv41 engine.

Why the engine and not a plain forward loop: lm-eval hands over every request of a task at once, and the
engine runs them the way it serves (continuous batching over the paged FP4 cache, chunked prefill with
batch-invariant GEMMs), so a score measures the model as served. All requests of a call are queued on
the engine together and it batches them itself (`max_num_seqs`, `max_num_batched_tokens`).

- `loglikelihood((context, continuation))`: the prompt is context + continuation; the engine's
  `SamplingParams.prompt_logprobs` gives every prompt token's log-probability given the tokens before it,
  and the continuation's are summed. is_greedy: every continuation token is an argmax (a tie counts).
- `loglikelihood_rolling((text,))`: lm-eval's rolling windows (`get_rolling_token_windows`, BOS as the
  prefix token, windows as long as the context limit allows), each scored like a continuation.
- `generate_until((context, gen_kwargs))`: greedy unless do_sample / a temperature says otherwise, cut at
  the first `until` string (the engine stops on up to 4 of them; the rest are cut afterwards).

Text is tokenized with the engine's tokenizer, BOS first, special markers taken as plain text. A prompt
longer than the context limit keeps its end (its continuation must fit). Prompt log-probabilities need
the logits of every prompt position, so these requests run every layer at every position and read
nothing from the prefix cache (see SamplingParams.prompt_logprobs).

Use: `lm_eval.simple_evaluate(model=DSV41LM(pretrained="tiny"), tasks=[...])`, or, once this module is
imported, `model="dsv41", model_args="pretrained=FOLDER,max_num_seqs=16"` (docs/hf-and-lm-eval.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from dsv41.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams, build_engine

log = logging.getLogger("dsv41.eval")

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "seed")


def _device(device: str | None) -> str:
    """The device to build on: the CPU unless one is named; lm-eval's CLI names "cuda:0" by default, which
    falls back to the CPU (with a warning) on a machine without CUDA."""
    if not device:
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available: running on the CPU", device)
        return "cpu"
    return str(device)


@register_model("dsv41")
class DSV41LM(LM):
    """lm-eval's LM over a dsv41 `LLMEngine`.

    pretrained: a preset name (random weights from `seed`) or a checkpoint folder, built with
    `dsv41.engine.build_engine`; or pass `engine=` (an LLMEngine you built). Any `EngineConfig` field
    (max_num_seqs, kv_pool_tokens, prefill_chunk_size, ...) may be given as a keyword. max_gen_toks: the
    generate_until default. batch_size / max_batch_size (lm-eval's own) are accepted and unused: the
    engine batches continuously."""

    def __init__(
        self,
        pretrained: str = "tiny",
        engine: LLMEngine | None = None,
        seed: int = 0,
        device: str | None = None,
        max_gen_toks: int = 256,
        batch_size: Any = None,
        max_batch_size: Any = None,
        **engine_args: Any,
    ):
        super().__init__()
        unknown = sorted(set(engine_args) - ENGINE_FIELDS)
        if unknown:
            raise TypeError(
                f"DSV41LM: unknown arguments {unknown}; model_args take pretrained, seed, device, "
                f"max_gen_toks and EngineConfig fields ({', '.join(sorted(ENGINE_FIELDS))})"
            )
        if engine is None:
            engine = build_engine(str(pretrained), EngineConfig(**engine_args), seed=seed, device=_device(device))
        elif engine_args:
            raise TypeError("DSV41LM: EngineConfig fields apply to an engine it builds, not to engine=")
        if not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise ValueError(f"max_gen_toks must be a positive integer, got {max_gen_toks!r}")
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.max_gen_toks = max_gen_toks
        self._device = str(engine.model.device)
        self._submitted = 0  # engine requests made so far (their ids)

    @property
    def max_length(self) -> int:
        """The longest prompt the engine takes (prompt and output share its context limit)."""
        return self.engine.max_model_len - 1

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def tokenizer_name(self) -> str:
        return repr(self.tokenizer)

    def tok_encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=False)

    def _run(
        self, prompts: list[list[int]], params: list[SamplingParams], take: Callable[[int, RequestOutput], Any]
    ) -> list:
        """Queue every prompt on the engine at once, step it until all have finished, and return
        take(index, final output) of each, in order. Outputs are dropped as they finish (their per-token
        log-probabilities would otherwise pile up over a whole task)."""
        pending: dict[str, int] = {}  # engine request id -> index
        results: list = [None] * len(prompts)
        try:
            for k, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = f"lm-eval-{self._submitted}"
                self.engine.add_request(rid, prompt, sp)
                self._submitted += 1
                pending[rid] = k
            while pending:
                for out in self.engine.step():
                    if not (out.finished and out.request_id in pending):
                        continue
                    if out.finish_reason in ("error", "abort"):
                        raise RuntimeError(
                            f"engine request {out.request_id} ended with {out.finish_reason}: {out.error}"
                        )
                    k = pending.pop(out.request_id)
                    results[k] = take(k, out)
        finally:  # after a failure nothing of this call is left running on the engine
            for rid in pending:
                self.engine.abort_request(rid)
        return results

    # ------------------------------------------------------------------ scoring
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids with BOS, continuation ids): the pair encoded as one text, split where the context
        alone ends; spaces ending the context move to the continuation (lm-eval's convention)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return whole[: len(ctx)], whole[len(ctx) :]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, every continuation token an argmax) per
        (context ids, continuation ids), all queued on the engine at once (identical prompts once)."""
        unique: dict[tuple, int] = {}  # (prompt ids, continuation length) -> index of its engine request
        keys = []
        for ctx, cont in pairs:
            if len(cont) >= self.max_length:
                raise ValueError(
                    f"a continuation of {len(cont)} tokens does not fit the {self.max_length}-token "
                    f"context limit with any context"
                )
            key = (tuple((ctx + cont)[-self.max_length :]), len(cont)) if cont else None
            if key is not None:
                unique.setdefault(key, len(unique))
            keys.append(key)
        order = list(unique)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)

        def take(k: int, out: RequestOutput) -> tuple[float, bool]:
            scored = out.prompt_logprobs[-order[k][1] :]  # the continuation's tokens, the prompt's last
            return sum(t.logprob for t in scored), all(t.logprob >= t.top[0][2] for t in scored)

        scores = self._run([list(prompt) for prompt, _ in order], [params] * len(order), take)
        return [(0.0, True) if key is None else scores[unique[key]] for key in keys]

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = self._score([self._encode_pair(*req.args) for req in requests])
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            windows = get_rolling_token_windows(
                self.tok_encode(text, add_bos=False), self.prefix_token_id, self.max_length - 1, 1
            )
            for ctx, cont in map(make_disjoint_window, windows):
                pairs.append((ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, self._score(pairs)):
            totals[k] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str]]:
        """lm-eval's gen_kwargs -> (SamplingParams, every until string)."""
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(f"DSV41LM.generate_until: unsupported gen_kwargs {unknown} (supported: {GEN_KWARGS})")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(s, str) for s in until):
            raise ValueError(f"until must be a string or a list of strings, got {until!r}")
        until = [s for s in until if s]
        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
        if gen_kwargs.get("do_sample") is False:
            temperature = 0.0
        # the engine checks at most MAX_STOP strings of bounded length per step; the rest are cut after
        stop = [s for s in until if len(s) <= SamplingParams.MAX_STOP_CHARS][: SamplingParams.MAX_STOP]
        params = SamplingParams(
            temperature=temperature,
            top_p=float(gen_kwargs.get("top_p", 1.0)),
            top_k=int(gen_kwargs.get("top_k", 0)),
            seed=gen_kwargs.get("seed"),
            max_tokens=int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)),
            stop=stop,
        )
        return params, until

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        prompts, plist, untils = [], [], []
        for req in requests:
            context, gen_kwargs = req.args
            params, until = self._sampling_params(dict(gen_kwargs or {}))
            room = self.engine.max_model_len - params.max_tokens  # prompt and output share the context limit
            if room < 1:
                raise ValueError(
                    f"max_gen_toks={params.max_tokens} leaves no room for a prompt in the "
                    f"{self.engine.max_model_len}-token context limit"
                )
            prompts.append(self.tok_encode(context)[-room:])
            plist.append(params)
            untils.append(until)
        texts = []
        for req, text, until in zip(requests, self._run(prompts, plist, lambda k, out: out.text), untils):
            for s in until:
                text = text.split(s, 1)[0]
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts
