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
fp32 sums run in the same order.

Rounds and steps. Every exchange is a *round* that all ranks of the group enter together; its count exchange
also carries, from each rank, which MoE layer it is at (its index in `ExpertParallel.layers`), or -1 when
that rank has finished its own work for the step. A rank computes the rows it receives with the layer their
sender named, so ranks need not be at the same layer, nor run the same number of forwards in a step: a rank
whose bounded-replay prefill skips the decoder layers, that retries a failed batch request by request, or
that has no tokens at all simply sends -1 while the others go on. Each rank ends each step with `end_step`
(`join_without_tokens` for a rank that ran nothing), which serves the others' rounds until every rank has
sent -1 in the same round. Collectives cost a round trip per layer; on CPU (gloo) that is the price of a
layout that fits the released model's 384 experts on eight devices.
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

    DONE = -1  # the layer index a rank sends once it has finished its own work for the step

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # the MoE layers this dispatcher serves, in model order: a layer's index is its name on the wire,
        # the same on every rank because every rank shards the same model structure
        self.layers: list[nn.Module] = []
        self._index: dict[int, int] = {}

    def add_layer(self, moe: nn.Module) -> None:
        if self.layers and moe.dim != self.layers[0].dim:
            raise ValueError(f"every MoE layer of one dispatcher must have the same width "
                             f"({moe.dim} != {self.layers[0].dim}): rows of several layers share a round")
        self._index[id(moe)] = len(self.layers)
        self.layers.append(moe)

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

    def _round(self, layer: int, rows: torch.Tensor, route: torch.Tensor, ids: torch.Tensor,
               send_counts: torch.Tensor) -> Optional[torch.Tensor]:
        """One round: send `rows` [n, dim] (with their routing weights and expert ids, sorted by destination,
        `send_counts` [W] per rank) for `layer` (DONE: none), compute what the others sent for their layers,
        and return this rank's rows' outputs [n, dim]; None when every rank sent DONE (the step is over)."""
        header = torch.stack([send_counts, torch.full_like(send_counts, layer)], dim=1)  # [W, 2]
        got = torch.empty_like(header)
        dist.all_to_all_single(got, header, group=self.group)
        recv_counts, senders_layer = got[:, 0].tolist(), got[:, 1].tolist()
        if all(at == self.DONE for at in senders_layer):
            return None
        send_counts = send_counts.tolist()
        rows_in = self._exchange(rows, send_counts, recv_counts)  # [R, dim] bf16, rows to compute here
        route_in = self._exchange(route, send_counts, recv_counts)  # [R] fp32
        ids_in = self._exchange(ids, send_counts, recv_counts)  # [R] int64
        row_layer = torch.repeat_interleave(torch.tensor(senders_layer), torch.tensor(recv_counts))
        out_rows = torch.zeros_like(rows_in)
        for at_layer in sorted({at for at, n in zip(senders_layer, recv_counts) if n}):
            moe = self.layers[at_layer]
            here = row_layer == at_layer
            for e in expert_range(len(moe.experts), self.rank, self.world):
                at = ((ids_in == e) & here).nonzero().flatten()
                if at.numel():
                    out_rows[at] = moe.experts[e](rows_in[at], route_in[at, None])
        return self._exchange(out_rows, recv_counts, send_counts)  # back along the reverse splits

    def __call__(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, dim] bf16, weights [T, k] fp32, indices [T, k] -> the routed outputs summed per token in
        expert order, fp32 [T, dim] (what `MoE.forward` computes before adding the shared expert)."""
        layer = self._index.get(id(moe))
        if layer is None:
            raise RuntimeError("this MoE layer is not served by this dispatcher (shard_experts installs it)")
        t, k = indices.shape
        n_experts = len(moe.experts)
        owner = self.owner_of(n_experts).to(indices.device)
        # every (token, pick) pair, grouped by destination rank (then expert, then token: stable)
        expert = indices.reshape(-1)  # [T*k]
        token = torch.arange(t, device=x.device).repeat_interleave(k)
        order = torch.argsort(owner[expert] * n_experts + expert, stable=True)
        expert, token = expert[order], token[order]
        send_counts = torch.bincount(owner[expert], minlength=self.world)
        back = self._round(layer, x[token], weights.reshape(-1)[order], expert, send_counts)  # [T*k] bf16

        # each token's k outputs in ascending expert order, added one by one into fp32 as on one device
        outputs = torch.empty_like(back)
        outputs[order] = back  # back to (token, pick) order
        picks = indices.argsort(dim=-1, stable=True)  # [T, k]
        outputs = outputs.view(t, k, x.size(-1)).gather(1, picks.unsqueeze(-1).expand(-1, -1, x.size(-1)))
        out = torch.zeros(t, x.size(-1), dtype=torch.float32, device=x.device)
        for j in range(k):
            out += outputs[:, j]
        return out

    def end_step(self) -> int:
        """This rank has finished its own work for the step: serve the other ranks' rounds (with the experts
        it owns) until every rank has finished too. Call it under the numerics the forwards use (the rows
        computed here are other ranks' tokens). Returns the number of rounds served for others."""
        if not self.layers:
            raise RuntimeError("end_step: no MoE layer is sharded over this dispatcher")
        gate = self.layers[0].gate
        rows = torch.empty(0, self.layers[0].dim, dtype=gate.weight.dtype, device=gate.weight.device)
        route = torch.empty(0, dtype=torch.float32, device=rows.device)
        ids = torch.empty(0, dtype=torch.int64, device=rows.device)
        nothing = torch.zeros(self.world, dtype=torch.int64, device=rows.device)
        served = 0
        while self._round(self.DONE, rows, route, ids, nothing) is not None:
            served += 1
        return served


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
    drop_experts(model, parallel.rank, parallel.world)
    for module in model.modules():
        if hasattr(module, "dispatcher") and hasattr(module, "experts"):
            module.dispatcher = parallel
            parallel.add_layer(module)
    return parallel


def drop_experts(model: nn.Module, rank: int, world: int) -> list[str]:
    """Replace every routed expert outside `expert_range(E, rank, world)` by a placeholder without weights
    (before a sharded load: on a meta-device model, so the others' experts are never allocated). Returns
    the dropped experts' module names, e.g. "layers.3.ffn.experts.5"."""
    dropped = []
    for name, module in model.named_modules():
        if hasattr(module, "dispatcher") and hasattr(module, "experts"):
            mine = expert_range(len(module.experts), rank, world)
            for e in range(len(module.experts)):
                if e not in mine:
                    if not isinstance(module.experts[e], _AbsentExpert):
                        module.experts[e] = _AbsentExpert(e)
                    dropped.append(f"{name}.experts.{e}")
    return dropped


def dispatcher_of(model: nn.Module) -> Optional[ExpertParallel]:
    """The `ExpertParallel` that `shard_experts` installed in `model`, or None."""
    for module in model.modules():
        if isinstance(getattr(module, "dispatcher", None), ExpertParallel):
            return module.dispatcher
    return None


def end_step(model: nn.Module) -> int:
    """`ExpertParallel.end_step` of the model's dispatcher: every rank calls it once at the end of every step
    (after its own forwards, if any). Returns the rounds served for the other ranks."""
    parallel = dispatcher_of(model)
    if parallel is None:
        raise RuntimeError("end_step: the model's experts are not sharded (shard_experts)")
    return parallel.end_step()


def join_without_tokens(model: nn.Module) -> int:
    """What a rank with no tokens in a step runs instead of a forward: it serves the other ranks' rounds
    until every rank has ended the step (`end_step`), so the ranks that do have tokens get their experts'
    outputs."""
    return end_step(model)
