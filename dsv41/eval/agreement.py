"""How close the engine's `fast` numerics come to the reference: teacher-forced perplexity, top-1 agreement
and KL divergence of the served next-token distributions (docs/numerics.md).

`fast` promises no bits (its GEMMs, attention and elementwise kernels round as this machine's fastest
kernels do), so it is judged the way vLLM and SGLang judge their kernels: statistically, against the
reference numerics (`Transformer.numerics(0, reference=True)`: the golden sets' canonical float64 rule,
the same bits on every CPU), position by position on held-out text.

Two paths of the engine are measured, each with the full distribution it sampled from:
- prefill: each sequence is a prompt whose every position is scored (prompt logprobs: the whole prompt is
  computed by the request, chunked as the engine chunks it, batched with the other prompts);
- decode: each sequence's first part is a prompt, and the engine then decodes greedily, one token per step,
  batched with the other sequences, over its paged KV pool; a second pass over the same prompts takes their
  prefixes from the prefix cache. The reference scores the same tokens (prompt + what `fast` generated).

Per scored position: NLL of the next token under both, whether the two argmaxes agree, and
KL(reference || fast) in nats over the whole vocabulary.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dsv41.engine import LLMEngine, SamplingParams


@dataclass
class Agreement:
    """Totals over the scored positions of one measurement."""

    positions: int
    nll_fast: float  # mean NLL (nats/token) of the scored tokens
    nll_reference: float
    top1: float  # share of positions whose argmax agrees
    kl_mean: float  # mean KL(reference || fast), nats/token
    kl_max: float

    @property
    def ppl_ratio(self) -> float:
        """fast's perplexity over the reference's (1.0: equal)."""
        return math.exp(self.nll_fast - self.nll_reference)

    def as_dict(self) -> dict:
        return {**asdict(self), "ppl_ratio": self.ppl_ratio}

    def meets(self, ppl_tolerance: float = 0.005, min_top1: float = 0.99, max_kl: float = 2e-3) -> bool:
        """The targets `fast` is held to: perplexity within 0.5%, >= 99% top-1 agreement, mean KL <= 2e-3."""
        return abs(self.ppl_ratio - 1) <= ppl_tolerance and self.top1 >= min_top1 and self.kl_mean <= max_kl


def compare(fast: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> Agreement:
    """fast, reference: fp32 logits [n, vocab] of the same positions; targets [n]: the tokens they score."""
    if fast.shape != reference.shape or fast.size(0) != targets.numel():
        raise ValueError(f"compare: logits {tuple(fast.shape)} and {tuple(reference.shape)}, {targets.numel()} targets")
    lf, lr = F.log_softmax(fast.double(), -1), F.log_softmax(reference.double(), -1)
    kl = (lr.exp() * (lr - lf)).sum(-1)  # [n]
    idx = targets.view(-1, 1).long()
    return Agreement(
        positions=int(targets.numel()),
        nll_fast=float(-lf.gather(1, idx).mean()),
        nll_reference=float(-lr.gather(1, idx).mean()),
        top1=float((fast.argmax(-1) == reference.argmax(-1)).double().mean()),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
    )


def merge(parts: Sequence[Agreement]) -> Agreement:
    """Position-weighted totals of several measurements (kl_max: the largest)."""
    n = sum(p.positions for p in parts)

    def mean(name: str) -> float:
        return sum(getattr(p, name) * p.positions for p in parts) / n

    return Agreement(
        n, mean("nll_fast"), mean("nll_reference"), mean("top1"), mean("kl_mean"), max(p.kl_max for p in parts)
    )


@torch.inference_mode()
def reference_logits(model, tokens: Sequence[int], memo: dict | None = None) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] of every position under reference numerics (one plain forward).
    memo: a dict kept by the caller across measurements of the same model (the reference is the costly side)."""
    key = tuple(tokens)
    if memo is not None and key in memo:
        return memo[key]
    ids = torch.tensor([list(tokens)], dtype=torch.int64, device=model.device)
    with model.numerics(0, reference=True):
        logits = model(ids)[0].float().cpu()
    if memo is not None:
        memo[key] = logits
    return logits


def _run(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list:
    """Add every prompt, step the engine until all finish; the finished sequences, in order."""
    batch = uuid.uuid4().hex[:8]
    seqs = []
    for i, prompt in enumerate(prompts):
        rid = f"agreement-{batch}-{i}"
        # the full rows the engine sampled from (and the prompt's, when it is scored)
        engine.add_request(rid, list(prompt), params, capture_logits=True)
        seqs.append(engine.requests[rid])
    while any(s.finish_reason is None for s in seqs):
        for out in engine.step():
            if out.finished and out.finish_reason == "error":
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return seqs


def prefill_agreement(
    engine: LLMEngine, model, sequences: Sequence[Sequence[int]], memo: dict | None = None
) -> Agreement:
    """Every position of each sequence scored as a prompt, all sequences in one batch."""
    seqs = _run(engine, sequences, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0))
    parts = []
    for tokens, seq in zip(sequences, seqs):
        fast = torch.cat(seq.prompt_logits).float().cpu()  # [n - 1, vocab]: positions 0..n-2
        ref = reference_logits(model, tokens, memo)[:-1]
        parts.append(compare(fast, ref, torch.tensor(tokens[1:])))
    return merge(parts)


def decode_agreement(
    engine: LLMEngine,
    model,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    passes: int = 2,
    memo: dict | None = None,
) -> Agreement:
    """Greedy decoding of `new_tokens` after each prompt, all in one batch, `passes` times (the passes after
    the first find the prompts in the prefix cache); the reference scores prompt + generated tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    parts = []
    for _ in range(passes):
        for prompt, seq in zip(prompts, _run(engine, prompts, params)):
            fast = torch.stack(seq.logits).float().cpu()  # [new_tokens, vocab]: positions p-1 .. p+new-2
            tokens = list(prompt) + seq.output_ids
            ref = reference_logits(model, tokens, memo)[len(prompt) - 1 : len(tokens) - 1]
            parts.append(compare(fast, ref, torch.tensor(seq.output_ids)))
    return merge(parts)


def held_out_windows(tokens: np.ndarray, lengths: Sequence[int], stride: int | None = None) -> list[list[int]]:
    """Consecutive windows of the given lengths from a token stream (each starts where the last ended, or
    every `stride` tokens)."""
    out, at = [], 0
    for n in lengths:
        if at + n > len(tokens):
            raise ValueError(f"held_out_windows: {sum(lengths)} tokens asked of a stream of {len(tokens)}")
        out.append([int(t) for t in tokens[at : at + n]])
        at += stride or n
    return out
