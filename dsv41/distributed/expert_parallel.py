"""Expert parallelism for the MoE layers (issue 32; spec-v41.md §7; ../shared/docs/serving-at-scale.md).

The routed experts of every MoE layer are split over the ranks of a process group in contiguous ranges
(rank r owns experts [r * E / W, (r + 1) * E / W)); the router, the shared expert, attention and Engram
stay on every rank, which serves its own tokens (data-parallel attention, as vLLM and SGLang deploy
DeepSeek models). A layer's routed part for the T tokens of this rank:

1. the router picks (weights, expert ids) locally, as on one device;
2. each (token, pick) pair goes to its expert's owner: a count exchange (all_to_all_single of [W]
   counts), then the rows (bf16, sent as their bytes: gloo has no bf16), their routing weights
   and expert ids in three all_to_all_single calls, sorted by destination;
3. each owner runs its experts over the rows it received, one expert at a time, and sends the bf16
   outputs back along the reverse splits;
4. the home rank adds each token's k outputs into an fp32 accumulator in ascending expert order, which
   is exactly what `MoE.forward` does on one device (`out[token] += expert(...)` expert by expert).

Bit-identical to one device under batch-invariant numerics (`Transformer.numerics`, the engine's
default): there an expert's output for a row does not depend on which other rows share its GEMMs, and the
fp32 sums run in the same order. A rank with no tokens joins every layer's exchange with zero rows
(`join_without_tokens`), so ranks that run out of work do not stall the others. Collectives cost a round trip per layer; on CPU
(gloo) that is the price of a layout that fits the released model's 384 experts on eight devices.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


def expert_range(n_experts: int, rank: int, world: int) -> range:
    """The experts rank `rank` of `world` owns: a contiguous range, the first ranks one larger when
    `world` does not divide `n_experts`."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    base, extra = divmod(n_experts, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class ExpertParallel:
    """The `MoE.dispatcher` of one rank: owns `expert_range(E, rank, world)` of every MoE layer it is
    installed on (`shard_experts`), and exchanges rows with the other ranks of `group`."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def owner_of(self, n_experts: int) -> torch.Tensor:
        """[E] int64: the rank that owns each expert."""
        return torch.cat([torch.full((len(expert_range(n_experts, r, self.world)),), r, dtype=torch.int64)
                          for r in range(self.world)])

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """all_to_all_single of rows [n, ...] split by destination; bf16 (which gloo does not carry) travels
        as its bytes."""
        as_bits = send.dtype == torch.bfloat16
        payload = send.view(torch.uint8) if as_bits else send
        out = payload.new_empty(sum(recv_counts), *payload.shape[1:])
        dist.all_to_all_single(out, payload.contiguous(), recv_counts, send_counts, group=self.group)
        return out.view(torch.bfloat16) if as_bits else out

    def __call__(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, dim] bf16, weights [T, k] fp32, indices [T, k] -> the routed outputs summed per token in
        expert order, fp32 [T, dim] (what `MoE.forward` computes before adding the shared expert)."""
        t, k = indices.shape
        n_experts = len(moe.experts)
        owner = self.owner_of(n_experts).to(indices.device)
        # every (token, pick) pair, grouped by destination rank (then expert, then token: stable)
        expert = indices.reshape(-1)  # [T*k]
        token = torch.arange(t, device=x.device).repeat_interleave(k)
        order = torch.argsort(owner[expert] * n_experts + expert, stable=True)
        expert, token = expert[order], token[order]
        send_counts = torch.bincount(owner[expert], minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_counts, recv_counts = send_counts.tolist(), recv_counts.tolist()

        rows = self._exchange(x[token], send_counts, recv_counts)  # [R, dim] bf16, rows to compute here
        route = self._exchange(weights.reshape(-1)[order], send_counts, recv_counts)  # [R] fp32
        ids = self._exchange(expert, send_counts, recv_counts)  # [R] int64

        out_rows = torch.zeros_like(rows)
        for e in expert_range(n_experts, self.rank, self.world):
            at = (ids == e).nonzero().flatten()
            if at.numel():
                out_rows[at] = moe.experts[e](rows[at], route[at, None])
        back = self._exchange(out_rows, recv_counts, send_counts)  # [T*k] bf16, in `order`'s order

        # each token's k outputs in ascending expert order, added one by one into fp32 as on one device
        outputs = torch.empty_like(back)
        outputs[order] = back  # back to (token, pick) order
        picks = indices.argsort(dim=-1, stable=True)  # [T, k]
        outputs = outputs.view(t, k, x.size(-1)).gather(1, picks.unsqueeze(-1).expand(-1, -1, x.size(-1)))
        out = torch.zeros(t, x.size(-1), dtype=torch.float32, device=x.device)
        for j in range(k):
            out += outputs[:, j]
        return out


class _AbsentExpert(nn.Module):
    """The place of an expert another rank owns: no weights, and an error if it is ever run here."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise RuntimeError(f"expert {self.index} lives on another rank (expert parallelism)")


def shard_experts(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> ExpertParallel:
    """Keep only this rank's routed experts in every MoE layer of `model` (the others' weights are
    dropped) and route through `ExpertParallel`. Returns the dispatcher. Every rank must call it on the
    same model structure."""
    parallel = ExpertParallel(group)
    for module in model.modules():
        if hasattr(module, "dispatcher") and hasattr(module, "experts"):
            mine = expert_range(len(module.experts), parallel.rank, parallel.world)
            for e in range(len(module.experts)):
                if e not in mine:
                    module.experts[e] = _AbsentExpert(e)
            module.dispatcher = parallel
    return parallel


def join_without_tokens(model: nn.Module) -> None:
    """What a rank with no tokens this step runs instead of a forward: it joins every MoE layer's exchange,
    in layer order, with zero rows, so that the ranks that do have tokens get their experts' outputs."""
    for module in model.modules():
        if isinstance(getattr(module, "dispatcher", None), ExpertParallel):
            gate = module.gate
            x = torch.empty(0, module.dim, dtype=gate.weight.dtype, device=gate.weight.device)
            empty = torch.empty(0, gate.topk, dtype=torch.int64, device=x.device)
            module.dispatcher(module, x, empty.float(), empty)
