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
    logits = logits.float().cpu()
    if params.temperature < GREEDY_TEMPERATURE:
        return int(logits.argmax())
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("the logits hold NaN or no finite value; cannot sample")
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int, tokenizer) -> TokenLogprob:
    """Log-probabilities under the model's own distribution (before temperature/top-k/top-p)."""
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    top = []
    if top_n:
        values, ids = torch.topk(logp, top_n)
        top = [(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids)]
    return TokenLogprob(token, tokenizer.decode([token]), float(logp[token]), top)
