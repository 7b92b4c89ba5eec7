"""Mixture of experts: sqrt-softplus router with selection bias, clamped SwiGLU experts, one shared
expert (spec-v41.md §7). Every backbone layer is MoE; DSpark blocks have their own expert counts."""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv41 import ops
from dsv41.config import ModelConfig
from dsv41.model.layers import Linear
from dsv41.ops import canonical, moe_cpu


class RoutingRecord:
    """Collects every router call of a training forward: (scores [T, E] fp32, expert ids [T, k], gate input
    [T, dim]), in layer order. A plain object on purpose: FSDP2's pre-forward rebuilds list and dict
    arguments that hold grad-requiring tensors, so appends to a list passed through a sharded block's
    call would land in a copy and be lost for every layer after the first (issue 11).

    capacity_factor > 0 bounds every expert's picks in this forward to ceil(factor x T x k / E) of the
    call's T tokens (`ops.moe.capacity_topk`; training only, inference routes freely); `natural` then
    holds each call's expert ids without the bound [T, k], for the balancing statistics.

    Router replay (R3, training.md §8): `replay` gives the expert ids [T, k] of every call in order (the
    ids a rollout's engine picked); each router then uses them instead of its own top-k, and its weights
    are recomputed from its current scores over those ids, so the router still gets gradient.
    ids_only: keep only each call's expert ids (the engine's capture; no scores or inputs held)."""

    def __init__(
        self, capacity_factor: float = 0.0, replay: list[torch.Tensor] | None = None, ids_only: bool = False
    ) -> None:
        self.calls: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = []
        self.capacity_factor = capacity_factor
        self.natural: list[torch.Tensor] = []
        self.replay = replay
        self.ids_only = ids_only

    def append(self, call: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.calls.append((None, call[1], None) if self.ids_only else call)

    def replayed(self, tokens: int, k: int, n_experts: int, device) -> torch.Tensor | None:
        """The ids this (next) router call must use, int64 [tokens, k], or None without replay."""
        if self.replay is None:
            return None
        call = len(self.calls)
        if call >= len(self.replay):
            raise ValueError(f"router replay holds {len(self.replay)} calls; MoE call {call} has none")
        ids = self.replay[call]
        if tuple(ids.shape) != (tokens, k):
            raise ValueError(
                f"router replay call {call}: expert ids of shape {tuple(ids.shape)}, the router needs [{tokens}, {k}]"
            )
        ids = ids.to(device=device, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
            raise ValueError(f"router replay call {call}: expert ids must lie in [0, {n_experts})")
        return ids

    def __len__(self) -> int:
        return len(self.calls)


class Gate(nn.Module):
    """Router. The bias (and, for image tokens, `bias_vl`) only steers which experts are picked; the
    routing weights are the unbiased scores, normalised over the picks and scaled by `route_scale`."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        n_experts, self.topk = cfg.moe_shape(layer_id)
        self.score_func, self.temperature = cfg.score_func, cfg.gate_temp
        self.normalize, self.route_scale = cfg.norm_topk_prob, cfg.route_scale
        self.weight = nn.Parameter(torch.zeros(n_experts, cfg.dim, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        if cfg.vision_enabled:
            self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("bias_vl", None)
        self.row_chunk = 0  # > 0: batch-invariant logits (see ops.invariant_matmul)
        self.canonical_ties = True  # exact score ties go to the lowest expert id; False: torch.topk's
        self.reference_numerics = False  # canonical numerics (dsv41.ops.canonical): golden parity

    def scores(self, x: torch.Tensor, calls=None) -> torch.Tensor:
        """x [T, dim] -> fp32 affinities [T, E] (before the selection bias). calls: the tokens' separate
        calls when several sequences' chunks share this one (`ops.lanes.per_call`)."""
        if self.reference_numerics:
            logits = canonical.linear(x.float(), self.weight.float()) / self.temperature
        else:
            logits = ops.invariant_matmul(x.float(), self.weight.float(), self.row_chunk) / self.temperature
        return ops.router_scores(logits, self.score_func, calls, self.reference_numerics)

    def forward(
        self,
        x: torch.Tensor,
        image_mask: torch.Tensor | None = None,
        aux: RoutingRecord | None = None,
        calls=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (weights [T, k] fp32, expert ids [T, k]). aux: if given, receives
        (scores, expert ids, x) for the training-time balancing (dsv41.model.training), or dictates the
        ids (router replay)."""
        scores = self.scores(x, calls)
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, bias)
        replay = None if aux is None else aux.replayed(x.size(0), self.topk, scores.size(-1), x.device)
        if replay is not None:  # R3: the recorded picks, weighted by the current scores
            indices = replay
            weights = ops.moe.route_weights(scores, indices, self.normalize, self.route_scale, self.reference_numerics)
        else:
            weights, indices = ops.route(
                scores, bias, self.topk, self.normalize, self.route_scale, self.canonical_ties, self.reference_numerics
            )
        if aux is not None and aux.capacity_factor > 0 and replay is None:
            aux.natural.append(indices)
            capacity = math.ceil(aux.capacity_factor * x.size(0) * self.topk / scores.size(-1))
            indices = ops.moe.capacity_topk(scores + bias, self.topk, capacity, self.canonical_ties)
            weights = ops.moe.route_weights(scores, indices, self.normalize, self.route_scale, self.reference_numerics)
        if aux is not None:
            aux.append((scores, indices, x))
        return weights, indices


class Expert(nn.Module):
    """w2(silu(min(w1 x, limit)) * clamp(w3 x, +-limit) * routing weight), the weight applied before w2."""

    def __init__(self, dim: int, inter_dim: int, fmt: str, swiglu_limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fmt)
        self.w2 = Linear(inter_dim, dim, fmt)
        self.w3 = Linear(dim, inter_dim, fmt)
        self.swiglu_limit = swiglu_limit
        self.reference_numerics = False  # canonical SiLU (dsv41.ops.canonical); the Linears hold their own flag

    def forward(self, x: torch.Tensor, route_weight: torch.Tensor | None = None) -> torch.Tensor:
        h = ops.clamped_swiglu(self.w1(x), self.w3(x), self.swiglu_limit, self.reference_numerics)  # fp32
        if route_weight is not None:
            h = route_weight * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        n_experts, _ = cfg.moe_shape(layer_id)
        self.dim = cfg.dim
        self.gate = Gate(cfg, layer_id)
        expert_fmt = "fp4" if cfg.expert_dtype == "fp4" else cfg.dtype
        self.experts = nn.ModuleList(
            Expert(cfg.dim, cfg.moe_inter_dim, expert_fmt, cfg.swiglu_limit) for _ in range(n_experts)
        )
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, cfg.dtype, cfg.swiglu_limit)
        # expert parallelism (dsv41.distributed.expert_parallel): computes the routed experts' summed outputs
        # from (moe, x, weights, indices) when the experts live on other ranks; None runs them here
        self.dispatcher = None
        # `decode_forward` runs the picked experts by the C++ kernel (dsv41.ops.moe_cpu) instead of the compiled
        # reference; set by the engine's compiled decode step where that kernel is the faster
        self.cpu_expert_kernel = False

    def forward(
        self,
        x: torch.Tensor,
        image_mask: torch.Tensor | None = None,
        aux: RoutingRecord | None = None,
        calls=None,
    ) -> torch.Tensor:
        """x [B, S, dim] bf16 -> [B, S, dim] bf16. Routed outputs are summed in fp32 in expert order.
        calls: see `Gate.scores`."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self.gate(x, None if image_mask is None else image_mask.reshape(-1), aux, calls)
        if self.dispatcher is not None:
            out = self.dispatcher(self, x, weights, indices)
            out += self.shared_experts(x)
            return out.to(x.dtype).view(shape)
        if not torch.is_grad_enabled():
            out = self._routed_sorted(x, weights, indices)
            out += self.shared_experts(x)
            return out.to(x.dtype).view(shape)
        out = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(indices.flatten(), minlength=len(self.experts)).tolist()
        for e, count in enumerate(counts):
            # under autograd an idle expert still runs (on zero rows), so every rank of a sharded run
            # produces the same set of gradients (FSDP2 reduce-scatters them together)
            if count == 0 and not torch.is_grad_enabled():
                continue
            token, slot = torch.where(indices == e)
            out[token] += self.experts[e](x[token], weights[token, slot, None])
        out += self.shared_experts(x)
        return out.to(x.dtype).view(shape)

    def stack_experts(self) -> bool:
        """Lay the routed experts' and the shared expert's bf16 weights out as three stacked tensors
        (w1, w3 [E + 1, I, D], w2 [E + 1, D, I]; the shared expert last) and make every expert Linear's
        weight a view into them, so `decode_forward` can gather any expert's rows from one tensor without a
        second copy of the weights. In-place updates (copy_, optimizer steps) reach both; a weight whose
        `.data` is replaced is noticed by `stacked()` and the stacking dropped. False (nothing changed) for
        quantized experts or experts of another width."""
        experts = [*self.experts, self.shared_experts]
        linears = {name: [getattr(e, name) for e in experts] for name in ("w1", "w3", "w2")}
        for group in linears.values():
            if any(m.weight.dtype != torch.bfloat16 or m.weight.shape != group[0].weight.shape for m in group):
                return False
        if self.stacked() is not None:
            return True
        stacks = []
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                stack = torch.stack([m.weight.detach() for m in linears[name]])  # [E + 1, out, in]
                for e, m in enumerate(linears[name]):
                    m.weight.data = stack[e]
                stacks.append(stack)
        weights = [m.weight for name in ("w1", "w3", "w2") for m in linears[name]]
        self.__dict__["_stacked"] = (tuple(stacks), weights, [w.data_ptr() for w in weights])
        return True

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(w1, w3, w2) of `stack_experts` while every expert weight is still a view into them, else None."""
        stacked = self.__dict__.get("_stacked")
        if stacked is None:
            return None
        stacks, weights, ptrs = stacked
        if any(w.data_ptr() != p for w, p in zip(weights, ptrs)):
            del self.__dict__["_stacked"]
            return None
        return stacks

    def decode_forward(self, x: torch.Tensor, stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, S, dim] bf16 -> [B, S, dim] bf16 for a handful of text tokens (a fast decode step), written
        for the compiler: the router, then the picked experts and the shared expert (one more pick of weight
        1) as gathered dot products over the stacked weights (`ops.moe.gathered_experts`). Same routing and
        math as `forward`, other roundings (the `fast` numerics)."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self.gate(x)
        shared = torch.full_like(indices[:, :1], len(self.experts))
        indices = torch.cat([indices, shared], dim=1)  # [T, k + 1]
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
        w1, w3, w2 = stacks
        experts = moe_cpu.gathered_experts_cpu if self.cpu_expert_kernel else ops.moe.gathered_experts
        out = experts(x, weights, indices, w1, w3, w2, self.shared_experts.swiglu_limit)
        return out.to(x.dtype).view(shape)

    def _routed_sorted(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed experts' summed outputs [T, dim] fp32, without autograd: the (token, pick) pairs sorted
        by expert once, each expert run on its contiguous slice, the outputs added back in one index_add_.
        The same rows reach the same expert GEMMs as in the per-expert loop, and each token's outputs are
        added in ascending expert order (the sort is stable, index_add_ walks its index in order), so the
        result is that loop's bit for bit, with a handful of ops per step instead of a handful per expert."""
        k = indices.size(-1)
        flat = indices.flatten()  # [T * k]
        order = flat.argsort(stable=True)
        token = order // k  # [T * k] the token of each sorted pick
        xs, ws = x[token], weights.flatten()[order].unsqueeze(-1)
        ys = torch.empty(flat.numel(), x.size(-1), dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if count:
                ys[start : start + count] = self.experts[e](xs[start : start + count], ws[start : start + count])
                start += count
        return torch.zeros_like(x, dtype=torch.float32).index_add_(0, token, ys)
