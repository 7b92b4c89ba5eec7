"""A minimal generation loop over the model's own cache: prefill once, then one token per step.

The inference engine (batching, paged FP4 cache, CED bounded replay) is a separate package; this loop is
the reference it is checked against.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv41.model.transformer import Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: Optional[torch.Generator]) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B]. temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.inference_mode()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: Optional[int] = None, seed: int = 0) -> torch.Tensor:
    """prompt [B, S] int64 -> generated ids [B, <= max_new_tokens] (stops early when all rows hit eos)."""
    if prompt.ndim != 2 or prompt.size(1) == 0:
        raise ValueError("prompt must be a non-empty [batch, seq] tensor")
    if max_new_tokens <= 0:
        return prompt.new_empty(prompt.size(0), 0)
    b, s = prompt.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = model.new_cache(b, s + max_new_tokens)
    logits = model(prompt.to(model.device), 0, cache, last_only=True)[:, -1]
    out, done = [], torch.zeros(b, dtype=torch.bool)
    for step in range(max_new_tokens):
        token = sample_next(logits.float().cpu(), temperature, top_p, gen)
        if eos_id is not None:
            token = torch.where(done, eos_id, token)
            done |= token == eos_id
        out.append(token)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(token.view(b, 1).to(model.device), s + step, cache, last_only=True)[:, -1]
    return torch.stack(out, dim=1)
