"""Tensor parallelism for attention (issue 32; spec-v41.md §3 steps 1-6; ../shared/docs/serving-at-scale.md).

V4.1's attention has one shared KV head (a 512-d latent), so there is no KV head dimension to split: the
KV projection, the compressor, the indexer and the whole KV cache stay replicated on every rank of a
tensor-parallel group, and what is split is the query side and the grouped output projection (spec §3):

- rank t of T owns query heads [t*H/T, (t+1)*H/T): its rows of `wq_b` (and of its FP8 block scale), its
  `attn_sink` entries; `sparse_attn` and the inverse RoPE work per head, so a head's output is the one a
  single device computes for it;
- those heads are exactly the output groups [t*G/T, (t+1)*G/T) (a group is H/G consecutive heads), so
  rank t also owns those groups' blocks of `wo_a`; `grouped_linear` computes each group with its own GEMM
  (per-group `invariant_matmul` under the engine's numerics), independent of how many groups are in the call;
- the grouped low-rank outputs are small ([tokens, G/T, o_lora_rank] per rank), so they are all-gathered
  in group (= rank) order and `wo_b` runs replicated on the full [tokens, G*o_lora_rank] input, the same
  GEMM one device runs. No partial sums are added, so nothing is reordered: the attention output, and with
  it everything downstream, is bit-identical to one device (tests/distributed/test_tensor_parallel.py).
  Splitting `wo_b` by its input columns instead would all-reduce partial sums, whose order changes the
  bits; the gather costs G*o_lora_rank values per token per layer (8 KB bf16 at the release's 8 x 1024).

What this module leaves replicated on every rank of a TP group (every rank computes it identically from
identical inputs): embedding and head, `wq_a`/`q_norm`, `wkv`/`kv_norm`, the compressor, the indexer (its
weighted sum over index heads is a reduction whose order would change with a head split), `wo_b`, the
MoE (or its expert-parallel share, see data_parallel), Engram, the DSpark drafter stages (their attention
is not split) and the vision tower.

The gather travels as bytes (the bf16 bits reinterpreted as uint8; gloo has no bf16/int16 all-gather on
every build), so no transport can round it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dsv41.config import ModelConfig
from dsv41.ops.quant import FP8_BLOCK


def check_head_split(cfg: ModelConfig, world: int) -> None:
    """Raise a clear ValueError when `world` tensor-parallel ranks cannot split this model's attention
    exactly: every rank needs whole output groups (hence whole heads), and FP8 `wq_b` rows in whole
    32-row scale tiles."""
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world}")
    if cfg.o_groups % world or cfg.n_heads % world:
        raise ValueError(
            f"--tensor-parallel-size {world} does not divide this model's {cfg.n_heads} query heads "
            f"in {cfg.o_groups} output groups: each rank must own whole output groups, so the size "
            f"must divide {cfg.o_groups}"
        )
    rows = cfg.n_heads // world * cfg.head_dim
    if cfg.dtype == "fp8" and rows % FP8_BLOCK:
        raise ValueError(
            f"--tensor-parallel-size {world}: a rank's {rows} wq_b rows are not whole {FP8_BLOCK}-row FP8 scale tiles"
        )


def head_slices(cfg: ModelConfig, rank: int, world: int) -> dict[str, slice]:
    """The rows rank `rank` of `world` owns, per tensor kind: "wq_b" (rows of wq_b.weight), "wq_b_scale"
    (rows of its FP8 scale), "attn_sink" (heads), "wo_a" (rows of wo_a.weight: its groups' blocks)."""
    check_head_split(cfg, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    heads = cfg.n_heads // world
    groups = cfg.o_groups // world
    q_rows = heads * cfg.head_dim
    return {
        "wq_b": slice(rank * q_rows, (rank + 1) * q_rows),
        "wq_b_scale": slice(rank * q_rows // FP8_BLOCK, -(-(rank + 1) * q_rows // FP8_BLOCK)),
        "attn_sink": slice(rank * heads, (rank + 1) * heads),
        "wo_a": slice(rank * groups * cfg.o_lora_rank, (rank + 1) * groups * cfg.o_lora_rank),
    }


def split_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> the backbone's attention modules that tensor parallelism splits ("layers.<i>.attn"); the
    DSpark drafter stages' attention (under "mtp.") is left whole on every rank."""
    from dsv41.model.attention import Attention

    return {name: m for name, m in model.named_modules() if isinstance(m, Attention) and name.startswith("layers.")}


def parameter_slice(cfg: ModelConfig, name: str, rank: int, world: int) -> slice | None:
    """The first-dimension slice of checkpoint tensor `name` that TP rank `rank` reads, or None (read it
    whole). For the sharded loader: the backbone's `attn.wq_b.weight`/`.scale`, `attn.attn_sink`,
    `attn.wo_a.weight`/`.scale` (the stored FP8 scale of wo_a, one row per 32 weight rows)."""
    if world == 1 or not name.startswith("layers.") or ".attn." not in name or ".indexer." in name:
        return None
    s = head_slices(cfg, rank, world)
    leaf = name.split(".attn.", 1)[1]
    if leaf == "wq_b.weight":
        return s["wq_b"]
    if leaf == "wq_b.scale":
        return s["wq_b_scale"]
    if leaf == "attn_sink":
        return s["attn_sink"]
    if leaf == "wo_a.weight":
        return s["wo_a"]
    if leaf == "wo_a.scale":
        rows = s["wo_a"]
        if rows.start % FP8_BLOCK or rows.stop % FP8_BLOCK:
            raise ValueError(
                f"{name}: a rank's wo_a rows {rows.start}..{rows.stop} are not whole {FP8_BLOCK}-row scale tiles"
            )
        return slice(rows.start // FP8_BLOCK, rows.stop // FP8_BLOCK)
    return None


class TensorParallel:
    """The gather of a tensor-parallel group: `gather(x)` concatenates every rank's x along the last
    dimension in rank order (= head/group order)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.gathers = 0  # calls so far (a check that every rank ran the same forwards)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] (every rank the same shape) -> [..., world * n], rank r's part at [r*n, (r+1)*n)."""
        self.gathers += 1
        x = x.contiguous()
        bits = x.view(torch.uint8)  # [..., n * element size]: gloo moves bytes of any dtype unchanged
        parts = [torch.empty_like(bits) for _ in range(self.world)]
        dist.all_gather(parts, bits, group=self.group)
        return torch.cat(parts, dim=-1).view(x.dtype)

    def wo_b_pre_hook(self, module: nn.Module, args: tuple):
        """Before `wo_b`: its input [..., G/T * o_lora_rank] (this rank's groups, flattened) becomes the
        whole [..., G * o_lora_rank]."""
        return (self.gather(args[0]),) + tuple(args[1:])


def shard_attention_heads(model: nn.Module, group: dist.ProcessGroup | None = None) -> TensorParallel:
    """Keep only this rank's query heads and output groups in every backbone attention layer of `model`
    (in place) and gather the low-rank outputs before `wo_b` over `group`. Returns the gather."""
    tp = TensorParallel(group)
    slice_attention_heads(model, tp.rank, tp.world)
    install_gather(model, tp)
    return tp


def slice_attention_heads(model: nn.Module, rank: int, world: int) -> None:
    """Keep only rank `rank` of `world`'s query heads and output groups in every backbone attention layer
    (in place; also on a meta-device model, before a sharded load fills the slices)."""
    cfg = model.cfg
    s = head_slices(cfg, rank, world)
    for attn in split_attention_modules(model).values():
        if attn.n_heads != cfg.n_heads:
            raise RuntimeError("slice_attention_heads: this model's attention is already split")
        with torch.no_grad():
            attn.wq_b.weight = _kept(attn.wq_b.weight, s["wq_b"])
            if attn.wq_b.scale is not None:
                attn.wq_b.scale = _kept(attn.wq_b.scale, s["wq_b_scale"])
            attn.wq_b.out_features = s["wq_b"].stop - s["wq_b"].start
            attn.attn_sink = _kept(attn.attn_sink, s["attn_sink"])
            attn.wo_a.weight = _kept(attn.wo_a.weight, s["wo_a"])
            attn.wo_a.out_features = s["wo_a"].stop - s["wo_a"].start
        attn.n_heads = cfg.n_heads // world
        attn.n_groups = cfg.o_groups // world


def install_gather(model: nn.Module, tp: TensorParallel) -> None:
    """Gather every split layer's grouped low-rank outputs before its `wo_b` (a forward pre-hook)."""
    if tp.world == 1:
        return
    for attn in split_attention_modules(model).values():
        if attn.n_groups * tp.world != model.cfg.o_groups:
            raise RuntimeError("install_gather: the attention is not split over this group's size")
        attn.wo_b.register_forward_pre_hook(tp.wo_b_pre_hook)


def _kept(p: nn.Parameter, rows: slice) -> nn.Parameter:
    """A new parameter holding only `rows` of p (a copy: the whole tensor's storage is released)."""
    return nn.Parameter(p[rows].clone(), requires_grad=p.requires_grad)


def check_model_split(model: str, world: int) -> None:
    """`check_head_split` for a preset name or a checkpoint folder (its config.json), before any rank is
    started: a bad layout is one clear error rather than one per spawned rank."""
    import os

    from dsv41.config import PRESETS, preset

    if model in PRESETS:
        cfg = preset(model)
    elif os.path.isdir(model):
        cfg = ModelConfig.from_file(model)
    else:
        return  # build_model names the problem
    check_head_split(cfg, world)
