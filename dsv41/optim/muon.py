"""Muon and head-wise Muon for hidden 2-D matrices (training.md §1.1, §1.2; spec-v41.md §7).

Per parameter W (A×B, or a batch of matrices) with gradient G, one step is (training.md §1.1):

1. momentum  M ← μM + G;  Nesterov U = G + μM (plain: U = M).  μ = 0.95.
2. orthogonalise  O = NS(U) with the V4 hybrid 8+2 Newton-Schulz schedule (see `newton_schulz`).
3. update-RMS matching  O ← γ·√max(A, B)·O, so that the update RMS is γ = 0.18 (an orthogonal A×B
   matrix has RMS 1/√max(A, B)); γ = 0.18 is the V4/V4.1 value (spec §7), close to AdamW's
   typical update RMS (Moonlight uses 0.2), so Muon can share AdamW's lr and wd.
4. decoupled weight decay  W ← W(1 − η·wd), then W ← W − η·O.

Head-wise Muon (training.md §1.2): a group option `heads` = H (or `head_dim` = d) views W ∈ R^{(H·d)×B}
as H row blocks of d×B, orthogonalises each block independently (batched NS over the H axis) and
scales each block by γ·√max(d, B). H = 1 is plain Muon. Parameters with more than two dimensions
(expert stacks [E, out, in]) are orthogonalised per leading index, never as one flattened matrix.

Computation is in fp32 whatever the parameter dtype (the trainer keeps fp32 master weights); nothing
assumes CUDA. The optimizer does not modify `p.grad`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from dsv41.optim.momentum import momentum_direction
from dsv41.optim.newton_schulz import newton_schulz, resolve_schedule

MUON_RMS = 0.18  # update RMS γ of V4/V4.1 (spec §7, training.md §1.1)


def row_blocks(shape: torch.Size | tuple[int, ...], heads: int = 1, head_dim: int | None = None) -> tuple[int, ...]:
    """The batched matrix shape NS sees for a parameter of `shape`: (..., heads, rows/heads, cols)."""
    if len(shape) < 2:
        raise ValueError(f"Muon needs parameters with >= 2 dims, got shape {tuple(shape)}")
    rows, cols = shape[-2], shape[-1]
    if head_dim is not None:
        if head_dim <= 0 or rows % head_dim:
            raise ValueError(f"head_dim {head_dim} does not divide the {rows} rows of shape {tuple(shape)}")
        heads = rows // head_dim
    if heads <= 0 or rows % heads:
        raise ValueError(f"heads {heads} does not divide the {rows} rows of shape {tuple(shape)}")
    if heads == 1:
        return tuple(shape)
    return tuple(shape[:-2]) + (heads, rows // heads, cols)


@torch.no_grad()
def muon_direction(
    u: torch.Tensor,
    heads: int = 1,
    head_dim: int | None = None,
    rms: float = MUON_RMS,
    schedule: Any = "v4",
    ns_dtype: torch.dtype = torch.float32,
    eps: float = 1e-7,
) -> torch.Tensor:
    """The scaled, orthogonalised update direction (fp32, u's shape) for a momentum-mixed gradient `u`."""
    blocks = row_blocks(u.shape, heads, head_dim)
    o = newton_schulz(u.reshape(blocks), schedule=schedule, eps=eps, dtype=ns_dtype).to(torch.float32)
    o.mul_(rms * math.sqrt(max(blocks[-2], blocks[-1])))
    return o.reshape(u.shape)


class Muon(torch.optim.Optimizer):
    """Muon with the V4 hybrid Newton-Schulz schedule, RMS matching and optional head-wise blocks.

    Group options: lr, weight_decay (decoupled), momentum, nesterov, rms (γ), ns_schedule ("v4",
    "keller" or a list of (a, b, c)), ns_dtype, eps, heads / head_dim (row blocks orthogonalised
    separately; heads=1 and head_dim=None is plain Muon).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        rms: float = MUON_RMS,
        ns_schedule: Any = "v4",
        ns_dtype: torch.dtype = torch.float32,
        eps: float = 1e-7,
        heads: int = 1,
        head_dim: int | None = None,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or rms <= 0:
            raise ValueError("Muon: need lr >= 0, weight_decay >= 0, 0 <= momentum < 1, rms > 0")
        resolve_schedule(ns_schedule)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            rms=rms,
            ns_schedule=ns_schedule,
            ns_dtype=ns_dtype,
            eps=eps,
            heads=heads,
            head_dim=head_dim,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                row_blocks(p.shape, group["heads"], group["head_dim"])  # validate shapes up front

    def split_work(self, rank: int, world: int, process_group=None) -> None:
        """Data-parallel use with identical full replicas on every rank (the FSDP2 trainer): each rank runs
        Newton-Schulz only for the matrices it owns and broadcasts the result, so the dominant cost of
        the step is divided by `world` while every rank still applies the same update. Owners are
        assigned greedily by Newton-Schulz cost, in parameter order, so every rank computes the same map."""
        self._split = (rank, process_group, owner_map(self.param_groups, world))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        split = getattr(self, "_split", None)  # (rank, process group, owners) after split_work
        pending: list[tuple[torch.Tensor, torch.Tensor, dict, int]] = []
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to(torch.float32)
                u = momentum_direction(self.state[p] if mu > 0 else {}, p, g, mu, group["nesterov"])
                owner = split[2][id(p)] if split else 0
                if split is None or owner == split[0]:
                    o = muon_direction(
                        u,
                        group["heads"],
                        group["head_dim"],
                        group["rms"],
                        group["ns_schedule"],
                        group["ns_dtype"],
                        group["eps"],
                    )
                else:
                    o = torch.empty_like(u)  # filled by the owner's broadcast below
                pending.append((p, o, group, owner))
        if split is not None:
            import torch.distributed as dist

            process_group = split[1]
            works = [
                dist.broadcast(
                    o,
                    src=dist.get_global_rank(process_group, owner) if process_group else owner,
                    group=process_group,
                    async_op=True,
                )
                for _, o, _, owner in pending
            ]
            for work in works:
                work.wait()
        for p, o, group, _ in pending:
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(o.to(p.dtype), alpha=-lr)
        return loss


def ns_cost(shape: torch.Size | tuple[int, ...], heads: int = 1, head_dim: int | None = None) -> int:
    """Multiply-adds of one Newton-Schulz step on a parameter (for balancing owners)."""
    blocks = row_blocks(shape, heads, head_dim)
    rows, cols = blocks[-2], blocks[-1]
    return math.prod(blocks[:-2]) * min(rows, cols) ** 2 * max(rows, cols)


def owner_map(param_groups: list[dict], world: int) -> dict[int, int]:
    """id(param) -> owning rank: largest cost first onto the least-loaded rank (ties: parameter order)."""
    items = [
        (ns_cost(p.shape, g["heads"], g["head_dim"]), index, id(p))
        for index, (g, p) in enumerate((g, p) for g in param_groups for p in g["params"])
    ]
    load = [0] * world
    owners: dict[int, int] = {}
    for cost, _, key in sorted(items, key=lambda item: (-item[0], item[1])):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[key] = rank
        load[rank] += cost
    return owners
