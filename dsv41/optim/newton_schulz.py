"""Newton-Schulz orthogonalisation for Muon (training.md §1.1, §1.2; spec-v41.md §7).

`newton_schulz(U)` approximates the polar factor U·(UᵀU)^(-1/2) of every matrix in the last two
dimensions of U (leading dimensions are a batch: heads, groups or expert stacks, training.md §1.1
"Pitfalls": never one NS over a flattened stack).

Iteration (training.md §1.1 step 2): X₀ = U/‖U‖_F, transposed so that the short side comes first, then
X ← aX + (bA + cA²)X with A = XXᵀ, one (a, b, c) per step.

Schedules:
- `V4_HYBRID_SCHEDULE` (default): DeepSeek-V4 hybrid, 10 steps = 8 × (3.4445, −4.7750, 2.0315) then
  2 × (2, −1.5, 0.5). The first phase is fast but leaves σ in about [0.7, 1.2]; the second phase has
  fixed point 1 with zero derivative and snaps σ to 1 (training.md §1.1 measured σ ∈ [0.99, 1.01]).
- `KELLER_SCHEDULE`: 5 × (3.4445, −4.7750, 2.0315), as in torch.optim.Muon / Keller Jordan's Muon
  (σ in (0, 1.25], not close to 1 for ill-conditioned inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Coefficients = tuple[float, float, float]

FAST_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
SNAP_COEFFICIENTS: Coefficients = (2.0, -1.5, 0.5)
V4_HYBRID_SCHEDULE: tuple[Coefficients, ...] = (FAST_COEFFICIENTS,) * 8 + (SNAP_COEFFICIENTS,) * 2
KELLER_SCHEDULE: tuple[Coefficients, ...] = (FAST_COEFFICIENTS,) * 5

SCHEDULES = {"v4": V4_HYBRID_SCHEDULE, "keller": KELLER_SCHEDULE}


def resolve_schedule(schedule: str | Sequence[Coefficients]) -> tuple[Coefficients, ...]:
    """A schedule given by name ("v4", "keller") or as a sequence of (a, b, c) triples."""
    if isinstance(schedule, str):
        try:
            return SCHEDULES[schedule]
        except KeyError:
            raise ValueError(f"unknown Newton-Schulz schedule {schedule!r}; known: {sorted(SCHEDULES)}") from None
    out = tuple(tuple(float(v) for v in abc) for abc in schedule)
    if not out or any(len(abc) != 3 for abc in out):
        raise ValueError("a Newton-Schulz schedule is a non-empty sequence of (a, b, c) triples")
    return out  # type: ignore[return-value]


@torch.no_grad()
def newton_schulz(
    u: torch.Tensor,
    schedule: str | Sequence[Coefficients] = "v4",
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """Orthogonalise each matrix in the last two dims of `u`; returns a tensor of u's shape in `dtype`.

    The Frobenius norm is taken in fp32 whatever `dtype` is (guards against the -inf of Moonlight
    issue #27, training.md §1.1). A zero matrix gives a finite zero result.
    """
    if u.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix (or a batch of them), got shape {tuple(u.shape)}")
    steps = resolve_schedule(schedule)
    dtype = dtype or u.dtype
    x = u.to(torch.float32)
    norm = torch.linalg.matrix_norm(x, ord="fro", keepdim=True)
    x = (x / (norm + eps)).to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT.contiguous()
    flat = x.reshape(-1, x.size(-2), x.size(-1))  # [batch, short, long]: one bmm per product
    for a, b, c in steps:
        gram = torch.bmm(flat, flat.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A, fused: no scalar passes
        flat = torch.baddbmm(flat, poly, flat, beta=a)  # a*X + poly@X
    x = flat.reshape(x.shape)
    if transposed:
        x = x.mT.contiguous()
    return x
