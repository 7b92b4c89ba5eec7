"""Per-request token sampling: logit processing (min_tokens, logit_bias, repetition / frequency / presence
penalties), then greedy, or temperature, min-p, top-k, top-p, with an optional per-request seed.

Everything here works on one request's fp32 logits row on the CPU, so a request's tokens never depend
on what the engine batched it with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv41.engine.types import SamplingParams, TokenLogprob

# Temperatures below this are greedy (vLLM's rule): dividing fp32 logits by 1e-39 overflows to inf/NaN,
# and anything this cold is argmax in all but name.
GREEDY_TEMPERATURE = 1e-5
MAX_PENALIZED_LOGIT = torch.finfo(torch.float32).max * GREEDY_TEMPERATURE / 2  # / 2: fp32 rounding


class TokenHistory:
    """What the logit processing of one position reads: the request's prompt and the tokens generated
    before that position, and the ids min_tokens holds back (EOS unless ignore_eos, and stop_token_ids).
    The prompt's presence mask (repetition_penalty) is computed once and shared by `then`. `grammar`: the
    request's `dsv41.engine.grammar.RequestGrammar` (structured outputs), whose mask at this position
    applies last."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        stop_ids: Sequence[int] = (),
        _prompt_mask: dict | None = None,
        grammar=None,
    ):
        self.prompt_ids, self.output_ids, self.stop_ids = prompt_ids, output_ids, stop_ids
        self._prompt_mask = {} if _prompt_mask is None else _prompt_mask  # vocab -> bool [vocab]
        self.grammar = grammar

    def prompt_mask(self, vocab: int) -> torch.Tensor:
        if vocab not in self._prompt_mask:
            mask = torch.zeros(vocab, dtype=torch.bool)
            if len(self.prompt_ids):
                mask[torch.tensor(list(self.prompt_ids), dtype=torch.int64)] = True
            self._prompt_mask[vocab] = mask
        return self._prompt_mask[vocab]

    def then(self, drafted: Sequence[int]) -> TokenHistory:
        """The history of the position after `drafted` more generated tokens (a speculative draft)."""
        return TokenHistory(
            self.prompt_ids, list(self.output_ids) + list(drafted), self.stop_ids, self._prompt_mask, self.grammar
        )


def process_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None) -> torch.Tensor:
    """logits [vocab] -> fp32 CPU logits after the processing that comes before temperature, in vLLM's
    order: min_tokens (EOS and stop ids to -inf while fewer than min_tokens tokens are generated),
    logit_bias (added), repetition_penalty (tokens in the prompt or the output: positive logits divided,
    negative multiplied), frequency_penalty (minus penalty x count in the output), presence_penalty
    (minus penalty once per token present in the output), then the grammar's mask (structured outputs:
    the tokens it does not allow next to -inf). A new tensor only when something applies."""
    logits = logits.float().cpu()
    if not params.processes_logits:
        return logits
    if history is None:
        raise ValueError("logit processing (penalties, logit_bias, min_tokens) needs the token history")
    logits = logits.clone()
    vocab = logits.numel()
    generated = len(history.output_ids)
    if generated < params.min_tokens and len(history.stop_ids):
        logits[torch.tensor(list(history.stop_ids), dtype=torch.int64)] = -torch.inf
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
        logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))
    needs_counts = params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
    if not needs_counts:
        return _grammar_masked(logits, history)
    out = torch.tensor(list(history.output_ids), dtype=torch.int64)
    counts = torch.bincount(out, minlength=vocab)[:vocab].float() if generated else torch.zeros(vocab)
    if params.repetition_penalty != 1.0:
        seen = history.prompt_mask(vocab) | (counts > 0)
        rp = params.repetition_penalty
        # a tiny penalty (5e-324 is 0 in fp32) divides a logit past fp32's range: capped where any sampling
        # temperature still leaves it finite (a no-op for every penalty that does not overflow)
        raised = (logits / rp).clamp(max=MAX_PENALIZED_LOGIT)
        logits = torch.where(seen, torch.where(logits > 0, raised, logits * rp), logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0).float()
    return _grammar_masked(logits, history)


def _grammar_masked(logits: torch.Tensor, history: TokenHistory) -> torch.Tensor:
    if history.grammar is None:
        return logits
    allowed = history.grammar.allowed(history.output_ids)  # bool [vocab] or None (not constrained here)
    if allowed is None:
        return logits
    if allowed.numel() != logits.numel():
        raise ValueError(f"the grammar's vocabulary ({allowed.numel()}) differs from the logits' ({logits.numel()})")
    return logits.masked_fill(~allowed, -torch.inf)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: TokenHistory | None = None,
) -> int:
    """logits [vocab] fp32 -> one token id. Temperature below `GREEDY_TEMPERATURE` (0 included) is greedy
    (ties go to the lowest id) over the processed logits. Logits without a finite maximum raise ValueError
    (that request fails). `history`: needed when `params.processes_logits`."""
    logits = process_logits(logits, params, history)
    probs = sampling_probs(logits, params)
    if probs is None:
        return int(logits.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_probs(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None = None
) -> torch.Tensor | None:
    """The distribution `sample` draws from (fp32 [vocab] on the CPU, after the logit processing when
    `history` is given, temperature, min-p, top-k, top-p), or None when the request is greedy."""
    if history is not None:
        logits = process_logits(logits, params, history)
    return _truncated(logits, params)[0]


def _truncated(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(probs, kept): the sampling distribution (None when greedy) and the bool [vocab] mask of the tokens
    min-p/top-k/top-p kept (None when none cuts anything away)."""
    logits = logits.float().cpu()
    if params.temperature < GREEDY_TEMPERATURE:
        return None, None
    logits = logits / params.temperature
    kept = None
    if params.min_p > 0:
        # p >= min_p x p_max  <=>  logit >= log(min_p) + max logit (same softmax denominator)
        kept = logits >= logits.max() + torch.log(torch.tensor(params.min_p))
        logits = logits.masked_fill(~kept, -torch.inf)
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        kept = logits >= kth if kept is None else kept & (logits >= kth)
        logits = logits.masked_fill(~kept, -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("the logits hold NaN or no finite value; cannot sample")
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        inside = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, ~outside)
        kept = inside if kept is None else kept & inside
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(outside, 0.0))
    return probs, kept


def sampling_support(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The ids `sample` could draw for these (processed) logits [vocab], ascending int64 (greedy: the
    argmax alone; min-p/top-k/top-p: the kept set; ids at -inf left out), or None when every token could
    be drawn. An RL learner applies the same mask at train time ("keep sampling mask", training.md §8)."""
    logits = logits.float().cpu()
    if params.temperature < GREEDY_TEMPERATURE:
        return logits.argmax().view(1)
    kept = _truncated(logits, params)[1]
    finite = torch.isfinite(logits)
    if not bool(finite.all()):  # min_tokens' banned ids can never be drawn
        kept = finite if kept is None else kept & finite
    return None if kept is None else kept.nonzero().flatten()


def processed_logprobs(logits: torch.Tensor, temperature: float, support: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities of the distribution a token was sampled from: logits [..., vocab] fp32 divided by
    the temperature (not below `GREEDY_TEMPERATURE`, where the support is the argmax alone), restricted
    to `support` (bool [..., vocab]; None: every token) and renormalised. The engine's
    logprobs_mode="processed" and the RL learner (dsv41.rl) compute it with this one function, so equal
    logits give equal bits. Differentiable."""
    x = logits.float()
    if temperature >= GREEDY_TEMPERATURE:
        x = x / temperature
    if support is not None:
        x = x.masked_fill(~support, -torch.inf)
    return torch.log_softmax(x, dim=-1)


def verify_draft(
    target: torch.Tensor,
    draft: list[int],
    draft_logits: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: TokenHistory | None = None,
) -> tuple[int, int]:
    """DSpark verification of one sequence: target [n + 1, vocab] fp32 logits at the last known token and
    at each of the n drafted tokens; draft_logits [n, vocab], what each draft was sampled from (`sample`
    with the same params and the history extended by the drafts before it). Returns (drafts accepted a,
    the token after them). Position i's target and draft logits are both processed (penalties,
    logit_bias, min_tokens) with `history.then(draft[:i])`, the history plain decoding would have there,
    so verification stays exact with logit processing on.

    Greedy: drafts are kept while they equal the target's argmax, then the argmax follows, exactly what
    one-token decoding picks. Sampled (standard speculative sampling): draft d is kept with probability
    min(1, p(d) / q(d)); at the first rejection the token comes from norm(max(p - q, 0)); with every
    draft kept, from p at the last position. The tokens then follow the target's distribution p."""
    n = len(draft)
    processing = params.processes_logits

    def at(i: int) -> TokenHistory | None:
        return history.then(draft[:i]) if processing else None

    if params.temperature < GREEDY_TEMPERATURE:
        if not processing:
            choice = target.float().cpu().argmax(-1).tolist()
        else:  # each position's argmax under its own history; only as far as needed
            choice = []
            for i in range(n + 1):
                choice.append(int(process_logits(target[i], params, at(i)).argmax()))
                if i < n and draft[i] != choice[i]:
                    break
        a = 0
        while a < n and draft[a] == choice[a]:
            a += 1
        return a, choice[a]
    for i, d in enumerate(draft):
        p = sampling_probs(target[i], params, at(i))
        q = sampling_probs(draft_logits[i], params, at(i))
        if float(torch.rand((), generator=generator)) * float(q[d]) < float(p[d]):
            continue
        residual = (p - q).clamp_min(0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return n, int(torch.multinomial(sampling_probs(target[n], params, at(n)), 1, generator=generator))


def token_logprobs(
    logits: torch.Tensor,
    token: int,
    top_n: int,
    tokenizer,
    params: SamplingParams | None = None,
    history: TokenHistory | None = None,
) -> TokenLogprob:
    """Log-probabilities under the model's own distribution (before any processing), or with `params`
    under the distribution sampled from (the logit processing with `history`, then `processed_logprobs`;
    `support` then lists the ids min-p/top-k/top-p/greedy/min_tokens left, None when nothing was cut)."""
    logits = logits.float().cpu()
    support = None
    if params is None:
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logits = process_logits(logits, params, history)
        support = sampling_support(logits, params)
        mask = None
        if support is not None:
            mask = torch.zeros(logits.shape, dtype=torch.bool).index_fill_(0, support, True)
        logp = processed_logprobs(logits, params.temperature, mask)
    top = []
    if top_n:
        values, ids = torch.topk(logp, top_n)
        top = [(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids)]
    return TokenLogprob(token, tokenizer.decode([token]), float(logp[token]), top, support)


def prompt_token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int, tokenizer) -> list[TokenLogprob]:
    """Prompt logprobs (SamplingParams.prompt_logprobs) of several positions at once: logits [n, vocab] fp32
    at positions p..p+n-1, tokens the n prompt tokens at p+1..p+n; each entry under the model's own
    distribution (as `token_logprobs` without params), with the top `top_n` alternatives."""
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)  # [n, vocab]
    picked = logp.gather(1, torch.tensor(tokens, dtype=torch.int64).view(-1, 1))[:, 0].tolist()
    tops: list[list] = [[] for _ in tokens]
    if top_n:
        values, ids = torch.topk(logp, top_n, dim=-1)  # [n, top_n]
        tops = [
            [(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in zip(vs, ix)]
            for vs, ix in zip(values.tolist(), ids.tolist())
        ]
    return [TokenLogprob(t, tokenizer.decode([t]), lp, top) for t, lp, top in zip(tokens, picked, tops)]
