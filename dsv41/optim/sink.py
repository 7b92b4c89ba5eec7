"""Sinkhorn-normalised momentum for the embedding, LM head and Engram tables (training.md §1.3; spec §7).

One step for a table W (rows × cols, e.g. vocab × dim) with gradient G:

1. momentum  M ← μM + G;  Nesterov U = G + μM.  μ = 0.95; μ = 0 is the stateless SinkGD of Scetbon
   et al. (arXiv 2502.06742), which keeps no buffer at all.
2. row mask: a row is *active* when
   - ``row_mask`` contains "grad": its gradient row is non-zero (the "token id occurs in this batch"
     mask that training.md §1.3 recommends for embeddings: exact and cheap), and
   - ``row_mask`` contains "tau": ‖U_row‖ ≥ τ·mean‖U_row‖ over the rows that passed the first test,
     τ = 1e-3 (spec §7).
   Masked rows get a zero update and are left bit-identical (weight decay touches active rows only).
3. K = 11 alternating normalisations of U restricted to the active rows: odd steps set each row's RMS
   to 1, even steps set each column's RMS over the active rows to 1 (K odd, so rows finish exactly at 1
   and columns are within ~1e-3 of 1).
4. scale by γ = 0.18 so the update RMS over the active rows is γ, as for Muon. (Spec §7 words it as
   "scaled by √n and γ" for unit-norm rows; with unit-RMS rows that factor is already included.)
5. no weight decay by default (spec §7); Engram tables use lr × 5 (spec §5), set by `build_optimizers`.

The optimizer works on dense gradients (keep `nn.Embedding(sparse=False)`), computes in fp32, and does
not assume CUDA. Under FSDP row sharding the column statistics would need an all-reduce (not done here).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dsv41.optim.momentum import momentum_direction

SINK_RMS = 0.18
SINK_ITERS = 11
SINK_TAU = 1e-3
ROW_MASKS = ("none", "grad", "tau", "both")
_TINY = 1e-30


def active_rows(
    u: torch.Tensor, grad: torch.Tensor | None = None, mode: str = "both", tau: float = SINK_TAU
) -> torch.Tensor:
    """Boolean [rows] mask of the rows that get an update (step 2 of the module docstring)."""
    if mode not in ROW_MASKS:
        raise ValueError(f"row_mask must be one of {ROW_MASKS}, got {mode!r}")
    u2 = u.reshape(u.size(0), -1)
    active = torch.ones(u2.size(0), dtype=torch.bool, device=u.device)
    if mode in ("grad", "both") and grad is not None:
        active &= grad.reshape(grad.size(0), -1).ne(0).any(dim=1)
    if mode in ("tau", "both") and tau > 0:
        norms = torch.linalg.vector_norm(u2.to(torch.float32), dim=1)
        n = active.sum()
        if n > 0:
            mean = norms[active].sum() / n
            active &= norms >= tau * mean
    active &= u2.ne(0).any(dim=1)  # an all-zero row has no direction
    return active


@torch.no_grad()
def sinkhorn_normalize(u: torch.Tensor, active: torch.Tensor | None = None, iters: int = SINK_ITERS) -> torch.Tensor:
    """Alternating row/column RMS normalisation of a 2-D `u` (fp32 result; inactive rows are zero).

    Odd steps (1, 3, ...) normalise rows to RMS 1 over the columns; even steps normalise columns to RMS
    1 over the active rows.
    """
    if u.ndim != 2:
        raise ValueError(f"sinkhorn_normalize needs a 2-D tensor, got shape {tuple(u.shape)}")
    x = u.to(torch.float32).clone()
    if active is None:
        active = torch.ones(u.size(0), dtype=torch.bool, device=u.device)
    x[~active] = 0
    n_active = int(active.sum())
    if n_active == 0:
        return x
    for k in range(1, iters + 1):
        if k % 2:
            rms = x.square().mean(dim=1, keepdim=True).sqrt()
        else:
            rms = (x.square().sum(dim=0, keepdim=True) / n_active).sqrt()
        x.div_(rms.clamp_min(_TINY))
    return x


class SinkMomentum(torch.optim.Optimizer):
    """Nesterov momentum + Sinkhorn row/column normalisation (training.md §1.3), for 2-D tables.

    Group options: lr, weight_decay (decoupled, active rows only; default 0), momentum (0 = stateless
    SinkGD), nesterov, rms (γ), iters (K), tau (τ), row_mask ("both", "grad", "tau" or "none").
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        rms: float = SINK_RMS,
        iters: int = SINK_ITERS,
        tau: float = SINK_TAU,
        row_mask: str = "both",
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or rms <= 0 or iters < 1 or tau < 0:
            raise ValueError("SinkMomentum: need lr, weight_decay, tau >= 0, 0 <= momentum < 1, rms > 0, iters >= 1")
        if row_mask not in ROW_MASKS:
            raise ValueError(f"row_mask must be one of {ROW_MASKS}, got {row_mask!r}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            rms=rms,
            iters=iters,
            tau=tau,
            row_mask=row_mask,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"SinkMomentum handles 2-D tables, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SinkMomentum needs dense gradients (nn.Embedding(sparse=False))")
                g = p.grad.to(torch.float32)
                u = momentum_direction(self.state[p] if mu > 0 else {}, p, g, mu, group["nesterov"])
                active = active_rows(u, g, group["row_mask"], group["tau"])
                if not bool(active.any()):
                    continue
                update = sinkhorn_normalize(u, active, group["iters"])[active].mul_(group["rms"])
                rows = p[active].to(torch.float32)
                if wd:
                    rows.mul_(1.0 - lr * wd)
                rows.add_(update, alpha=-lr)
                p[active] = rows.to(p.dtype)
        return loss
