"""Expert parallelism for the MoE layers (issue 32; spec-v41.md §7; ../shared/docs/serving-at-scale.md).

The routed experts of every MoE layer are split over the ranks of a process group in contiguous ranges
(rank r owns experts [r * E / W, (r + 1) * E / W)); the router, the shared expert, attention and Engram
(unless its table rows are sharded too) stay on every rank, which serves its own tokens (data-parallel attention, as vLLM and SGLang deploy
DeepSeek models). A layer's routed part for the T tokens of this rank:

1. the router picks (weights, expert ids) locally, as on one device;
2. each (token, pick) pair goes to its expert's owner: a header exchange (all_to_all_single of [W]
   counts and tags), then one all_to_all_single of the items as bytes (the bf16 row, its fp32 routing
   weight and int64 expert id packed side by side: gloo has no bf16, and bytes cannot be rounded), sorted
   by destination;
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
sent -1 in the same round. The rounds also carry the lookups of sharded Engram tables (`dsv41.distributed.engram_parallel`), tagged like
a layer. Collectives cost a round trip per layer; on CPU (gloo) that is the price of a
layout that fits the released model's 384 experts on eight devices.
"""

from __future__ import annotations

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


def as_dtype(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte columns [n, k * itemsize] (a slice of a wider byte row) -> [n, k] of `dtype`, the same bits: copied
    to a fresh tensor first, since a slice's offset and row stride need not be multiples of the itemsize."""
    out = torch.empty(columns.shape, dtype=torch.uint8, device=columns.device)
    out.copy_(columns)
    return out.view(dtype)


class ExpertParallel:
    """The `MoE.dispatcher` of one rank: owns `expert_range(E, rank, world)` of every MoE layer it is
    installed on (`shard_experts`), and exchanges rows with the other ranks of `group`. The same rounds also
    carry the lookups of Engram tables whose rows are sharded over the group
    (`dsv41.distributed.engram_parallel`): every kind of remote work a forward needs from the other ranks
    must share one round protocol, or a rank waiting in one kind of collective would deadlock against a rank
    waiting in another."""

    DONE = -1  # the layer index a rank sends once it has finished its own work for the step

    def __init__(self, group: dist.ProcessGroup | None = None, row_dtype: torch.dtype = torch.bfloat16):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.row_dtype = row_dtype  # the hidden states' dtype: the MoE rows on the wire
        # what this dispatcher serves, in model order: the MoE layers (`add_layer`) and the sharded Engram
        # tables (`add_server`); an entry's index is its name on the wire (its "tag"), the same on every rank
        # because every rank shards the same model structure in the same order
        self.layers: list[nn.Module] = []
        self._index: dict[int, int] = {}
        self.last_kinds: set = set()
        self.served = {"moe": 0, "engram": 0}  # rounds served for others in end_step, by the kind they carried

    def add_layer(self, moe: nn.Module) -> None:
        self._index[id(moe)] = len(self.layers)
        self.layers.append(moe)

    def add_server(self, module: nn.Module) -> int:
        """Serve `module`'s requests (an object with `kind`, `in_bytes`, `out_bytes` and `serve(items)`; see
        `dsv41.distributed.engram_parallel.ShardedEngramTable`). Returns its tag."""
        self.add_layer(module)
        return len(self.layers) - 1

    def owner_of(self, n_experts: int) -> torch.Tensor:
        """[E] int64: the rank that owns each expert."""
        return torch.cat(
            [
                torch.full((len(expert_range(n_experts, r, self.world)),), r, dtype=torch.int64)
                for r in range(self.world)
            ]
        )

    # -- the wire format of one request kind: a fixed number of bytes per item each way ------------------------
    def _is_moe(self, tag: int) -> bool:
        return not hasattr(self.layers[tag], "serve")

    def _in_bytes(self, tag: int) -> int:
        """Bytes per item a sender with `tag` sends: an MoE row, its routing weight and expert id."""
        if tag == self.DONE:
            return 0
        if self._is_moe(tag):
            return self.layers[tag].dim * self.row_dtype.itemsize + 4 + 8
        return self.layers[tag].in_bytes

    def _out_bytes(self, tag: int) -> int:
        if tag == self.DONE:
            return 0
        if self._is_moe(tag):
            return self.layers[tag].dim * self.row_dtype.itemsize
        return self.layers[tag].out_bytes

    def _serve_moe(self, moe: nn.Module, items: torch.Tensor) -> torch.Tensor:
        """items [R, in_bytes] uint8 (rows | routing weight | expert id) -> outputs [R, out_bytes] uint8, each
        row through its expert (this rank owns it), one expert at a time."""
        width = moe.dim * self.row_dtype.itemsize
        rows = as_dtype(items[:, :width], self.row_dtype)  # [R, dim]
        route = as_dtype(items[:, width : width + 4], torch.float32)  # [R, 1]
        ids = as_dtype(items[:, width + 4 :], torch.int64).flatten()  # [R]
        out_rows = torch.zeros_like(rows)
        for e in expert_range(len(moe.experts), self.rank, self.world):
            at = (ids == e).nonzero().flatten()
            if at.numel():
                out_rows[at] = moe.experts[e](rows[at], route[at])
        return out_rows.view(torch.uint8)

    def _round(self, tag: int, payload: torch.Tensor, send_counts: torch.Tensor) -> torch.Tensor | None:
        """One round: send `payload` [n, in_bytes(tag)] uint8 (items sorted by destination, `send_counts` [W]
        per rank) for `tag` (DONE: none), serve what the others sent for their tags, and return this rank's
        items' answers [n, out_bytes(tag)] uint8; None when every rank sent DONE (the step is over). Three
        collectives: a header (counts and tags), the items, the answers back along the reverse splits. Bytes
        travel unchanged (gloo has no bf16), so no transport can round anything."""
        header = torch.stack([send_counts, torch.full_like(send_counts, tag)], dim=1)  # [W, 2]
        got = torch.empty_like(header)
        dist.all_to_all_single(got, header, group=self.group)
        recv_counts, tags = got[:, 0].tolist(), got[:, 1].tolist()
        if all(at == self.DONE for at in tags):
            return None
        # what this round carried (for `served`): "moe" and/or a server's kind ("engram")
        self.last_kinds = {"moe" if self._is_moe(t) else self.layers[t].kind for t in tags if t != self.DONE}
        send_counts = send_counts.tolist()
        in_bytes, out_bytes = self._in_bytes(tag), self._out_bytes(tag)
        recv_in = [n * self._in_bytes(t) for n, t in zip(recv_counts, tags)]
        recv_out = [n * self._out_bytes(t) for n, t in zip(recv_counts, tags)]
        got_items = payload.new_empty(sum(recv_in))
        dist.all_to_all_single(
            got_items, payload.contiguous().flatten(), recv_in, [n * in_bytes for n in send_counts], group=self.group
        )
        chunks = got_items.split(recv_in)
        answers: list[torch.Tensor | None] = [None] * self.world
        for at in sorted({t for t, n in zip(tags, recv_counts) if n}):
            # every sender at the same tag in one call (one GEMM per expert), in sender order
            senders = [r for r in range(self.world) if tags[r] == at and recv_counts[r]]
            items = torch.cat([chunks[r].view(recv_counts[r], -1) for r in senders])
            server = self.layers[at]
            done = self._serve_moe(server, items) if self._is_moe(at) else server.serve(items)
            for r, part in zip(senders, done.split([recv_counts[r] for r in senders])):
                answers[r] = part.flatten()
        back_send = torch.cat([a if a is not None else payload.new_empty(0) for a in answers])
        back = payload.new_empty(sum(send_counts) * out_bytes)
        dist.all_to_all_single(back, back_send, [n * out_bytes for n in send_counts], recv_out, group=self.group)
        return back.view(-1, out_bytes) if out_bytes else back.view(sum(send_counts), 0)

    def request(self, tag: int, items: torch.Tensor, send_counts: torch.Tensor) -> torch.Tensor:
        """Send `items` [n, in_bytes] uint8 (sorted by destination; `send_counts` [W]) to the ranks that serve
        `tag` and return their answers [n, out_bytes] uint8 (a forward's call; every rank of the group must be
        in a forward or in `end_step`)."""
        out = self._round(tag, items, send_counts)
        if out is None:
            raise RuntimeError("a request round found every rank done (a bug: this rank sent a request)")
        return out

    def __call__(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, dim] bf16, weights [T, k] fp32, indices [T, k] -> the routed outputs summed per token in
        expert order, fp32 [T, dim] (what `MoE.forward` computes before adding the shared expert)."""
        layer = self._index.get(id(moe))
        if layer is None:
            raise RuntimeError("this MoE layer is not served by this dispatcher (shard_experts installs it)")
        if x.dtype != self.row_dtype:
            raise RuntimeError(f"expert parallelism carries {self.row_dtype} rows, got {x.dtype}")
        t, k = indices.shape
        n_experts = len(moe.experts)
        owner = self.owner_of(n_experts).to(indices.device)
        # every (token, pick) pair, grouped by destination rank (then expert, then token: stable)
        expert = indices.reshape(-1)  # [T*k]
        token = torch.arange(t, device=x.device).repeat_interleave(k)
        order = torch.argsort(owner[expert] * n_experts + expert, stable=True)
        expert, token = expert[order], token[order]
        send_counts = torch.bincount(owner[expert], minlength=self.world)
        items = torch.cat(
            [
                x[token].view(torch.uint8),  # [T*k, dim * 2 + 4 + 8]: row | weight | expert id
                weights.reshape(-1)[order].float().contiguous().view(-1, 1).view(torch.uint8),
                expert.contiguous().view(-1, 1).view(torch.uint8),
            ],
            dim=1,
        )
        back = self.request(layer, items, send_counts).view(self.row_dtype)  # [T*k, dim]

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
        and Engram rows it owns) until every rank has finished too. Call it under the numerics the forwards use
        (the rows computed here are other ranks' tokens). Returns the number of rounds served for others
        (`served` counts them by the kind of work they carried)."""
        if not self.layers:
            raise RuntimeError("end_step: nothing is sharded over this dispatcher")
        device = next(iter(self.layers[0].parameters()), torch.empty(0)).device
        nothing = torch.zeros(self.world, dtype=torch.int64, device=device)
        served = 0
        while self._round(self.DONE, torch.empty(0, 0, dtype=torch.uint8, device=device), nothing) is not None:
            served += 1
            for kind in self.last_kinds:
                self.served[kind] = self.served.get(kind, 0) + 1
        return served


class _AbsentExpert(nn.Module):
    """The place of an expert another rank owns: no weights, and an error if it is ever run here."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise RuntimeError(f"expert {self.index} lives on another rank (expert parallelism)")


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None = None) -> ExpertParallel:
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


def dispatcher_of(model: nn.Module) -> ExpertParallel | None:
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
