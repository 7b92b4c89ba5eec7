"""Per-request token sampling: greedy, temperature, top-k, top-p, with an optional per-request seed."""

from __future__ import annotations

from typing import Optional

import torch

from dsv41.engine.types import SamplingParams, TokenLogprob


# Temperatures below this are greedy (vLLM's rule): dividing fp32 logits by 1e-39 overflows to inf/NaN,
# and anything this cold is argmax in all but name.
GREEDY_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """logits [vocab] fp32 -> one token id. Temperature below `GREEDY_TEMPERATURE` (0 included) is greedy
    (ties go to the lowest id). Logits without a finite maximum raise ValueError (that request fails)."""
    probs = sampling_probs(logits, params)
    if probs is None:
        return int(logits.float().cpu().argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> Optional[torch.Tensor]:
    """The distribution `sample` draws from (fp32 [vocab] on the CPU, after temperature, top-k, top-p), or
    None when the request is greedy."""
    return _truncated(logits, params)[0]


def _truncated(logits: torch.Tensor, params: SamplingParams) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(probs, kept): the sampling distribution (None when greedy) and the bool [vocab] mask of the tokens
    top-k/top-p kept (None when neither cuts anything away)."""
    logits = logits.float().cpu()
    if params.temperature < GREEDY_TEMPERATURE:
        return None, None
    logits = logits / params.temperature
    kept = None
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        kept = logits >= kth
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


def sampling_support(logits: torch.Tensor, params: SamplingParams) -> Optional[torch.Tensor]:
    """The ids `sample` could draw for these logits [vocab], ascending int64 (greedy: the argmax alone;
    top-k/top-p: the kept set), or None when every token could be drawn. An RL learner applies the same
    mask at train time ("keep sampling mask", training.md §8)."""
    if params.temperature < GREEDY_TEMPERATURE:
        return logits.float().cpu().argmax().view(1)
    kept = _truncated(logits, params)[1]
    return None if kept is None else kept.nonzero().flatten()


def processed_logprobs(logits: torch.Tensor, temperature: float, support: Optional[torch.Tensor] = None) -> torch.Tensor:
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


def verify_draft(target: torch.Tensor, draft: list[int], draft_logits: Optional[torch.Tensor],
                 params: SamplingParams, generator: Optional[torch.Generator]) -> tuple[int, int]:
    """DSpark verification of one sequence: target [n + 1, vocab] fp32 logits at the last known token and
    at each of the n drafted tokens; draft_logits [n, vocab], what each draft was sampled from (`sample`
    with the same params). Returns (drafts accepted a, the token after them).

    Greedy: drafts are kept while they equal the target's argmax, then the argmax follows, exactly what
    one-token decoding picks. Sampled (standard speculative sampling): draft d is kept with probability
    min(1, p(d) / q(d)); at the first rejection the token comes from norm(max(p - q, 0)); with every
    draft kept, from p at the last position. The tokens then follow the target's distribution p."""
    n = len(draft)
    if params.temperature < GREEDY_TEMPERATURE:
        choice = target.float().cpu().argmax(-1).tolist()
        a = 0
        while a < n and draft[a] == choice[a]:
            a += 1
        return a, choice[a]
    for i, d in enumerate(draft):
        p = sampling_probs(target[i], params)
        q = sampling_probs(draft_logits[i], params)
        if float(torch.rand((), generator=generator)) * float(q[d]) < float(p[d]):
            continue
        residual = (p - q).clamp_min(0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return n, int(torch.multinomial(sampling_probs(target[n], params), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int, tokenizer,
                   params: Optional[SamplingParams] = None) -> TokenLogprob:
    """Log-probabilities under the model's own distribution (before temperature/top-k/top-p), or with
    `params` under the distribution sampled from (`processed_logprobs`; `support` then lists the ids
    top-k/top-p/greedy left, None when nothing was cut)."""
    logits = logits.float().cpu()
    support = None
    if params is None:
        logp = torch.log_softmax(logits, dim=-1)
    else:
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
        tops = [[(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in zip(vs, ix)]
                for vs, ix in zip(values.tolist(), ids.tolist())]
    return [TokenLogprob(t, tokenizer.decode([t]), lp, top) for t, lp, top in zip(tokens, picked, tops)]
