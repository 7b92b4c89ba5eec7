"""On-policy distillation: the student samples, one or several teachers grade every token of it by the
full-vocabulary reverse KL (training.md §8; Thinking Machines' "On-Policy Distillation", DeepSeek-V4's
multi-teacher OPD).

For each generated prefix the loss is KL(pi_s || pi_T) = sum_v pi_s(v) (log pi_s(v) - log pi_T(v)) over
the whole vocabulary, at every completion position, averaged over the batch's completion tokens. The
teacher is evaluated without gradient (its logits are detached even when its parameters require
gradients). With several teachers each sample goes to its own (its domain's) teacher.

The RL view (the same gradient in expectation over the student's samples): a per-token advantage
-(log pi_s - log pi_T) on the sampled token, with discount 0 (`token_advantages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dsv41.model.transformer import Transformer
from dsv41.rl.policy import ReplayPolicy, Sample, sequence_logits


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position KL(pi_s || pi_T) over the last (vocabulary) dim: [..., V] x [..., V] -> [...] fp32.
    The teacher gets no gradient."""
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1)


def opd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Mean reverse KL over the completion tokens: logits [N, L, V], mask [N, L] bool."""
    kl = reverse_kl(student_logits, teacher_logits, temperature)
    return (kl * mask).sum() / mask.sum().clamp_min(1)


def token_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """The RL form: advantage -(log pi_s - log pi_T) of each sampled token (discount 0), detached."""
    return -(student_logp - teacher_logp).detach()


def teacher_logits(
    teachers: Mapping[str, Transformer], samples: Sequence[Sample], domains: Sequence[str], row_chunk: int = 16
) -> torch.Tensor:
    """[N, L, V] logits of each sample's own teacher (domains[i] names it) over its completion positions,
    without gradient. A teacher computes with its own routing (it is another model; the student's
    recorded expert ids are not its own)."""
    missing = sorted({d for d in domains} - set(teachers))
    if missing:
        raise KeyError(f"no teacher for domain(s) {missing}; teachers: {sorted(teachers)}")
    width = max([len(s.completion_ids) for s in samples] + [1])
    vocab = next(iter(teachers.values())).cfg.vocab_size
    out = torch.zeros(len(samples), width, vocab)
    with torch.no_grad():
        for name, teacher in teachers.items():
            idx = [i for i, d in enumerate(domains) if d == name]
            if idx:
                logits, _ = sequence_logits(teacher, [samples[i] for i in idx], row_chunk, replay=False)
                out[idx] = logits[:, :width]
    return out


def distill_step(
    student: ReplayPolicy,
    teachers: Mapping[str, Transformer],
    samples: Sequence[Sample],
    domains: Sequence[str] | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The OPD loss of one batch of the student's own samples (call backward on it)."""
    domains = list(domains) if domains is not None else [next(iter(teachers))] * len(samples)
    target = teacher_logits(teachers, samples, domains, student.row_chunk)
    logits, mask = sequence_logits(student.policy, samples, student.row_chunk, student.cast_weights())
    return opd_loss(logits, target[:, : logits.size(1)], mask, temperature)
