"""The RL learner's policy: fp32 master weights computing through the serving model, with router replay
(training.md §8 "R3", "keep sampling mask"; spec-v41.md §7).

`ReplayPolicy` holds fp32 masters of the trainable parameters (an `nn.Module` mirroring the model, so
the recipe's optimizers group them by name: Muon, Sinkhorn momentum, AdamW) and computes with the
serving model's own modules, their weights replaced for the call by casts of the masters to the serving
dtypes (`torch.func.functional_call`). The forward is `dsv41.model.replay.replay_forward`, the engine's
computation, under the engine's numerics: with the weights the rollout used it returns the rollout's
log-probabilities bit for bit, and its gradient lands in the masters. `sync_policy()` writes the masters
back into the serving model (which a local rollout engine shares).

Frozen during RL: the indexer (its selection is discrete and was trained by its KL during pre-training),
the Engram tables (FP8 rows in the serving model), the DSpark drafter and the vision tower. The rest is
trained: attention, compressors, MoE experts and routers (through the replayed picks' gate weights),
mHC, norms, embeddings and head.

Rows that share a span schedule (same prompt length, hence the same prefill chunks; then one position
per decode step) are computed together, padded at the end.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from dsv41.engine.sampling import processed_logprobs
from dsv41.model.replay import decode_spans, replay_forward
from dsv41.model.transformer import Transformer


def default_trainable(name: str) -> bool:
    """Parameters RL trains (see the module docstring)."""
    frozen = (".indexer.", ".engram.embed.", "mtp.", "vision.", "aligner.", "image_")
    return not any(part in name or name.startswith(part) for part in frozen)


@dataclass
class Sample:
    """What the learner needs of one rollout: prompt + completion ids, the engine's span schedule and
    expert ids (None: the routers pick), the sampling temperature and, per completion token, the ids the
    sampler could draw (None: every id)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    spans: list[tuple[int, int]] | None
    routed_experts: torch.Tensor | None  # [len(prompt) + len(completion) - 1, n_layers, k]
    temperature: float
    supports: list[torch.Tensor | None] | None = None


def split_schedule(spans: Sequence[tuple[int, int]], prompt_len: int) -> list[tuple[int, int]] | None:
    """The prefill spans when the schedule is prefill chunks covering the prompt then one position per
    decode step (a request that was never preempted), else None."""
    prefill = []
    for a, e in spans:
        if e > prompt_len:
            break
        prefill.append((a, e))
    if not prefill or prefill[-1][1] != prompt_len:
        return None
    return prefill if list(spans) == decode_spans(prefill, spans[-1][1]) else None


class ReplayPolicy(nn.Module):
    """fp32 masters (`self.master`, a copy of the model) of the trainable parameters, computing through
    `policy` (the serving model, not a submodule). forward(samples) -> per-token log-probs [N, L]."""

    def __init__(self, policy: Transformer, trainable: Callable[[str], bool] = default_trainable, row_chunk: int = 16):
        super().__init__()
        for name, p in policy.named_parameters():
            if p.requires_grad and p.dtype not in (torch.bfloat16, torch.float32) and trainable(name):
                raise ValueError(
                    f"{name} is stored as {p.dtype}: the RL learner trains bf16/fp32 weights only "
                    "(dequantise an FP8/FP4 checkpoint first)"
                )
        self._policy = [policy]  # a list: not registered, so its bf16 weights are not parameters here
        self.row_chunk = row_chunk
        self.master = copy.deepcopy(policy)
        self.names: list[str] = []
        for name, p in self.master.named_parameters():
            train = p.requires_grad and p.is_floating_point() and trainable(name)
            if train:
                p.data = p.data.float()
                self.names.append(name)
            p.requires_grad_(train)
        self.master.mtp = nn.ModuleList()  # never computed through the masters; drop the copy
        self.cfg = policy.cfg

    @property
    def policy(self) -> Transformer:
        return self._policy[0]

    def cast_weights(self) -> dict[str, torch.Tensor]:
        """The masters in the serving dtypes (differentiable casts)."""
        serving = dict(self.policy.named_parameters())
        masters = dict(self.master.named_parameters())
        return {name: masters[name].to(serving[name].dtype) for name in self.names}

    @torch.no_grad()
    def sync_policy(self) -> None:
        """Write the masters into the serving model (the weights the next rollouts use)."""
        serving = dict(self.policy.named_parameters())
        for name, value in self.cast_weights().items():
            serving[name].copy_(value)

    def serving_state(self) -> dict[str, torch.Tensor]:
        """The trainable parameters as the serving model holds them (for remote rollout workers)."""
        return {name: t.detach().clone() for name, t in self.cast_weights().items()}

    def forward(self, samples: Sequence[Sample], replay: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities of each sample's completion under the masters, as the engine
        computes them (processed distribution, the rollout's support; router replay unless replay=False).
        Returns (logp [N, L] fp32, mask [N, L] bool)."""
        return sequence_logprobs(self.policy, samples, self.row_chunk, self.cast_weights(), replay)


def sequence_logprobs(
    model: Transformer,
    samples: Sequence[Sample],
    row_chunk: int = 16,
    weights: dict | None = None,
    replay: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [N, L], mask [N, L]) of the samples' completion tokens under `model` (with `weights`
    substituted through functional_call when given), under each sample's processed sampling distribution
    (temperature, support), grouped by span schedule. Differentiable when the weights are."""

    def per_group(group: list[Sample], logits: torch.Tensor) -> torch.Tensor:
        out = []
        for row, s in enumerate(group):  # each row at its own sampling temperature and support
            m = len(s.completion_ids)
            lp = processed_logprobs(logits[row, :m], s.temperature, _support_mask(s, m, logits.size(-1)))
            out.append(lp.gather(-1, torch.tensor(s.completion_ids).unsqueeze(-1)).squeeze(-1))
        return out

    return _per_sample(model, samples, row_chunk, weights, replay, per_group, ())


def sequence_logits(
    model: Transformer,
    samples: Sequence[Sample],
    row_chunk: int = 16,
    weights: dict | None = None,
    replay: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, L, vocab] fp32, mask [N, L]) at the positions that predict each completion token (for
    on-policy distillation's full-vocabulary KL)."""

    def per_group(group: list[Sample], logits: torch.Tensor) -> torch.Tensor:
        return [logits[row, : len(s.completion_ids)] for row, s in enumerate(group)]

    return _per_sample(model, samples, row_chunk, weights, replay, per_group, (model.cfg.vocab_size,))


def _support_mask(s: Sample, m: int, vocab: int) -> torch.Tensor | None:
    """bool [m, vocab] of the ids each completion token could have been drawn from, or None (every id)."""
    if not s.supports or all(x is None for x in s.supports):
        return None
    mask = torch.ones(m, vocab, dtype=torch.bool)
    for t, kept in enumerate(s.supports[:m]):
        if kept is not None:
            mask[t] = False
            mask[t, kept.long()] = True
    return mask


def _per_sample(
    model, samples, row_chunk, weights, replay, per_group, tail: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(samples)
    width = max([len(s.completion_ids) for s in samples] + [1])
    values = torch.zeros(n, width, *tail)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for members, prefill, prompt_len in _groups(samples):
        group = [samples[i] for i in members]
        logits = _group_logits(model, group, prefill, prompt_len, row_chunk, weights, replay)
        for i, v in zip(members, per_group(group, logits)):
            m = len(samples[i].completion_ids)
            values[i, :m] = v  # autograd follows the copy into the padded batch
            mask[i, :m] = True
    return values, mask


def _groups(samples: Sequence[Sample]):
    """(member indices, prefill spans, prompt length) per group of samples sharing a span schedule."""
    groups: dict = {}
    for i, s in enumerate(samples):
        if not s.completion_ids:
            continue
        n = len(s.prompt_ids)
        if s.spans is None:  # no engine schedule known: one chunk for the prompt
            prefill = [(0, n)]
        else:
            prefill = split_schedule(s.spans, n)
        key = (n, tuple(prefill)) if prefill is not None else ("own", i)
        groups.setdefault(key, []).append(i)
    for key, members in groups.items():
        if key[0] == "own":
            s = samples[members[0]]
            yield members, None, len(s.prompt_ids)
        else:
            yield members, list(key[1]), key[0]


def _group_logits(
    model: Transformer,
    group: list[Sample],
    prefill,
    prompt_len: int,
    row_chunk: int,
    weights: dict | None,
    replay: bool,
) -> torch.Tensor:
    """fp32 logits [B, m_max, vocab] at the positions predicting one group's completions."""
    cfg = model.cfg
    m_max = max(len(s.completion_ids) for s in group)
    total = prompt_len + m_max - 1  # positions whose logits predict the completion
    ids = torch.zeros(len(group), total, dtype=torch.int64)
    for row, s in enumerate(group):
        seq = (list(s.prompt_ids) + list(s.completion_ids))[:total]
        ids[row, : len(seq)] = torch.tensor(seq)
    spans = list(group[0].spans) if prefill is None else decode_spans(prefill, total)
    routing = None
    if replay and all(s.routed_experts is not None for s in group):
        k = cfg.n_activated_experts
        # padded positions (after a shorter row's end) route to experts 0..k-1; no real position sees them
        routing = torch.arange(k).expand(len(group), total, cfg.n_layers, k).clone()
        for row, s in enumerate(group):
            have = min(s.routed_experts.size(0), total)
            routing[row, :have] = s.routed_experts[:have].long()
    with model.numerics(row_chunk):
        if weights is None:
            return replay_forward(model, ids, spans, routing, logits_from=prompt_len - 1)
        return _functional_replay(model, weights, ids, spans, routing, prompt_len - 1)


class _ReplayCall(nn.Module):
    """Adapter so functional_call can substitute the weights of `model` while replay_forward runs."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, ids, spans, routing, logits_from):
        return replay_forward(self.model, ids, spans, routing, logits_from)


def _functional_replay(model: Transformer, weights: dict, ids, spans, routing, logits_from: int) -> torch.Tensor:
    wrapper = _ReplayCall(model)
    return functional_call(wrapper, {f"model.{k}": v for k, v in weights.items()}, (ids, spans, routing, logits_from))
