"""`dsv41 plan`: what each rank of a layout holds and how much KV cache is left (issue 32, item 3).

Weight bytes come from the model as this code builds it (on the meta device: no storage), parameter by
parameter at its stored size (FP4 experts two to a byte plus their scales, FP8 tables plus scales), so they
are what a rank really allocates, not a formula. A rank of an expert-parallel layout holds its
`expert_range` of every MoE layer's routed experts (the largest share when the split is uneven) and all the
rest, the Engram tables whole (what this engine does). Serving systems shard the tables' rows over the
ranks or keep them in host memory; those are planned as separate rows, marked not built. KV per token and the fixed per-sequence state come from
`dsv41.model.cache` (the pool's packed formats).

Built layouts: data parallelism with expert parallelism over the same ranks (EP = DP or 1), and each
data-parallel engine's attention heads split over T tensor-parallel ranks (D x T devices; a TP rank holds
1/T of every backbone layer's `wq_b`, `attn_sink` and `wo_a`, `dsv41.distributed.tensor_parallel`, and the
rest of its engine's share, its KV cache included: KV is replicated over the TP ranks, so a TP layout's
KV tokens are counted once per engine). T must split the output groups (`check_head_split`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig
from dsv41.distributed.expert_parallel import expert_range
from dsv41.distributed.tensor_parallel import check_head_split
from dsv41.model.cache import fixed_state_bytes_per_sequence, global_kv_bytes_per_token

_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.")
# the parameters tensor parallelism splits by heads (dsv41.distributed.tensor_parallel.slice_attention_heads)
_TP_SPLIT = re.compile(r"^layers\.\d+\.attn\.(wq_b\.weight|wq_b\.scale|attn_sink|wo_a\.weight)$")
MILLION = 1_000_000


def parse_size(text: str) -> int:
    """'141GB' (10^9), '80GiB' (2^30), '512MB', or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"{text!r} is not a size: write e.g. 141GB, 80GiB or 512MB")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(match.group(1)) * scale)


@dataclass
class WeightBytes:
    """Stored bytes of a model's parameters: the routed experts by MoE layer and expert, the Engram tables,
    and everything else."""

    experts: dict  # MoE layer name -> [bytes of expert 0, 1, ...]
    engram_tables: int
    rest: int  # everything else, head_split included
    head_split: int = 0  # the part of `rest` tensor parallelism splits over its ranks (whole row tiles)

    @classmethod
    def of(cls, cfg: ModelConfig) -> "WeightBytes":
        from dsv41.model.transformer import Transformer

        with torch.device("meta"):
            model = Transformer(cfg)
        experts: dict = {}
        engram = rest = split = 0
        for name, p in model.named_parameters():
            size = p.numel() * p.element_size()
            if _TP_SPLIT.match(name):
                split += size
            match = _EXPERT.match(name)
            if match is not None:
                layer = experts.setdefault(match.group(1), {})
                layer[int(match.group(2))] = layer.get(int(match.group(2)), 0) + size
            elif ".engram.embed." in name:
                engram += size
            else:
                rest += size
        return cls({k: [v[e] for e in sorted(v)] for k, v in experts.items()}, engram, rest, split)

    @property
    def total(self) -> int:
        return self.rest + self.engram_tables + sum(sum(v) for v in self.experts.values())

    def rank_bytes(self, rank: int, world: int, engram: str = "device", tp: int = 1) -> int:
        """What rank `rank` of `world` expert-parallel ranks holds (world 1: everything), with its engine's
        attention heads split over `tp` tensor-parallel ranks (they divide exactly). engram: "device"
        (every rank holds the whole tables: what this engine does), "sharded" (rows split evenly over the
        ranks, as vLLM moves them to their tokens' owners; not built here) or "host" (not on the device)."""
        held = sum(sum(sizes[e] for e in expert_range(len(sizes), rank, world)) for sizes in self.experts.values())
        tables = {"device": self.engram_tables, "sharded": -(-self.engram_tables // world), "host": 0}[engram]
        return self.rest - self.head_split + self.head_split // tp + tables + held


def plan(cfg: ModelConfig, devices: int, device_memory: int, utilization: float = 0.9) -> list[dict]:
    """One row per layout on `devices` devices of `device_memory` bytes, of which `utilization` may be used
    (weights + KV; the rest is left to activations and the runtime, as vLLM's gpu_memory_utilization)."""
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    if not 0 < utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {utilization}")
    weights = WeightBytes.of(cfg)
    kv_token = global_kv_bytes_per_token(cfg)["total"]
    fixed = fixed_state_bytes_per_sequence(cfg)
    fixed_seq = fixed["window_fp8"] + fixed["compressor_partial_groups"]
    usable = int(device_memory * utilization)
    layouts = [(devices, 1, 1, "device")]
    if devices > 1:
        layouts += [(devices, devices, 1, "device")]
    for tp in range(2, devices + 1):  # D x T: the attention heads of each of D engines split T ways
        try:
            check_head_split(cfg, tp)
        except ValueError:
            continue
        if devices % tp == 0:
            dp = devices // tp
            layouts += [(dp, dp, tp, "device")]
    if weights.engram_tables:
        # what serving systems do with the release's ~100 GB tables; this engine keeps them whole on every rank
        layouts += [(devices, devices, 1, "sharded"), (devices, devices, 1, "host")] if devices > 1 else [(1, 1, 1, "host")]
    rows = []
    for dp, ep, tp, engram in layouts:
        per_rank = max(weights.rank_bytes(r, ep, engram, tp) for r in range(ep))
        free = usable - per_rank
        name = f"DP={dp} EP={ep}" + (f" TP={tp}" if tp > 1 else "") + {"device": "", "sharded": ", Engram rows sharded (not built)",
                                     "host": ", Engram in host memory (not built)"}[engram]
        row = {"layout": name, "data_parallel": dp, "expert_parallel": ep, "tensor_parallel": tp, "engram": engram,
               "built": engram == "device", "weight_bytes_per_rank": per_rank, "usable_bytes_per_rank": usable,
               "fits": free > 0}
        if free > 0:
            row["kv_tokens_per_rank"] = int(free // kv_token)
            row["kv_tokens_total"] = dp * row["kv_tokens_per_rank"]
            row["sequences_1m_per_rank"] = int(free // (MILLION * kv_token + fixed_seq))
            row["sequences_1m_total"] = dp * row["sequences_1m_per_rank"]
        rows.append(row)
    return rows


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_plan(name: str, devices: int, device_memory: int, utilization: float, rows: list[dict]) -> str:
    lines = [f"{name} on {devices} x {_size(device_memory)} ({utilization:.0%} usable: weights + KV cache; KV "
             f"capacity in tokens and in concurrent 1M-token sequences)",
             f"{'layout':<52} {'weights/rank':>13} {'KV tokens/rank':>15} {'KV tokens all':>14} {'1M seqs':>8}"]
    for r in rows:
        weights = _size(r["weight_bytes_per_rank"])
        if r["fits"]:
            lines.append(f"{r['layout']:<52} {weights:>13} {r['kv_tokens_per_rank']:>15,} {r['kv_tokens_total']:>14,} "
                         f"{r['sequences_1m_total']:>8}")
        else:
            lines.append(f"{r['layout']:<52} {weights:>13}  refused: the weights exceed the "
                         f"{_size(r['usable_bytes_per_rank'])} usable per device")
    return "\n".join(lines)


def sequences_note(rows: list[dict]) -> str:
    """A line saying which layouts fit, and whether this engine can serve one of them."""
    fitting = [r["layout"] for r in rows if r["fits"]]
    note = f"{len(fitting)} of {len(rows)} layouts fit" + (f": {'; '.join(fitting)}" if fitting else "")
    if not any(r["fits"] and r["built"] for r in rows):
        note += "\nno layout this engine has built fits these devices"
    return note
