"""`dsv41 plan`: what each rank of a layout holds and how much KV cache is left (issue 32, item 3).

Weight bytes come from the model as this code builds it (on the meta device: no storage), parameter by
parameter at its stored size (FP4 experts two to a byte plus their scales, FP8 tables plus scales), so they
are what a rank really allocates, not a formula. A rank of an expert-parallel layout holds its
`expert_range` of every MoE layer's routed experts (the largest share when the split is uneven) and all the
rest. The Engram tables (spec-v41.md §5: ~98 GB each in the release) are planned three ways, all built
(`dsv41 serve --engram-sharding/--engram-memory`, dsv41.distributed.engram_parallel): whole on every rank's
device ("device": `--engram-sharding replicated`), their rows split over the expert-parallel ranks
("sharded": each rank its `row_range` of every table, the largest share counted; the default with expert
parallelism), or split and kept in host memory ("sharded-host", reported as host bytes per rank; "host", the
whole tables in host memory, is planned for one device only and not built there). KV per token and the
fixed per-sequence state come from `dsv41.model.cache` (the pool's packed formats).

Built layouts: data parallelism with expert parallelism over the same ranks (EP = DP or 1), and each
data-parallel engine's attention heads split over T tensor-parallel ranks (D x T devices; a TP rank holds
1/T of every backbone layer's `wq_b`, `attn_sink` and `wo_a`, `dsv41.distributed.tensor_parallel`, and the
rest of its engine's share, its KV cache included: KV is replicated over the TP ranks, so a TP layout's
KV tokens are counted once per engine; with expert parallelism the Engram rows are split over the D
engines, each engine's TP ranks holding the same share). T must split the output groups
(`check_head_split`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig
from dsv41.distributed.engram_parallel import row_range
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
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    return int(float(match.group(1)) * scale)


@dataclass
class WeightBytes:
    """Stored bytes of a model's parameters: the routed experts by MoE layer and expert, the Engram tables,
    and everything else."""

    experts: dict  # MoE layer name -> [bytes of expert 0, 1, ...]
    engram_tables: int
    rest: int  # everything else, head_split included
    head_split: int = 0  # the part of `rest` tensor parallelism splits over its ranks (whole row tiles)
    engram_rows: tuple = ()  # (rows, bytes per row: FP8 row + its scales) of each Engram table

    @classmethod
    def of(cls, cfg: ModelConfig) -> WeightBytes:
        from dsv41.model.transformer import Transformer

        with torch.device("meta"):
            model = Transformer(cfg)
        experts: dict = {}
        tables: dict = {}  # table module name -> [rows, bytes per row]
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
                table = tables.setdefault(name.rsplit(".", 1)[0], [p.shape[0], 0])
                table[1] += size // p.shape[0]
            else:
                rest += size
        return cls(
            {k: [v[e] for e in sorted(v)] for k, v in experts.items()},
            engram,
            rest,
            split,
            tuple((rows, per_row) for rows, per_row in tables.values()),
        )

    def engram_share(self, rank: int, world: int) -> int:
        """Bytes of the Engram rows rank `rank` of `world` holds when the tables are sharded (`row_range`)."""
        return sum(len(row_range(rows, rank, world)) * per_row for rows, per_row in self.engram_rows)

    @property
    def total(self) -> int:
        return self.rest + self.engram_tables + sum(sum(v) for v in self.experts.values())

    def rank_bytes(self, rank: int, world: int, engram: str = "device", tp: int = 1) -> int:
        """Device bytes of rank `rank` of `world` expert-parallel ranks (world 1: everything), with its
        engine's attention heads split over `tp` tensor-parallel ranks (they divide exactly). engram: "device"
        (every rank holds the whole tables), "sharded" (rank `rank` of `world`'s rows, `row_range`), "host" or
        "sharded-host" (in host memory: `host_bytes`)."""
        held = sum(sum(sizes[e] for e in expert_range(len(sizes), rank, world)) for sizes in self.experts.values())
        tables = {"device": self.engram_tables, "sharded": self.engram_share(rank, world)}.get(engram, 0)
        return self.rest - self.head_split + self.head_split // tp + tables + held

    def host_bytes(self, rank: int, world: int, engram: str) -> int:
        """Host-memory bytes of rank `rank` of `world` (its Engram rows when they are kept there)."""
        return {"host": self.engram_tables, "sharded-host": self.engram_share(rank, world)}.get(engram, 0)


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
        # the tables' rows split over the expert-parallel ranks, on the device or in host memory (the whole
        # tables in every rank's host memory are not listed: eight copies of ~196 GB per node)
        layouts += [
            (dp, ep, tp, engram) for dp, ep, tp, _ in list(layouts) if ep > 1 for engram in ("sharded", "sharded-host")
        ]
        if devices == 1:
            layouts += [(1, 1, 1, "host")]
    rows = []
    for dp, ep, tp, engram in layouts:
        per_rank = max(weights.rank_bytes(r, ep, engram, tp) for r in range(ep))
        host = max(weights.host_bytes(r, ep, engram) for r in range(ep))
        free = usable - per_rank
        built = devices > 1 or engram == "device"  # serve builds host placement for multi-rank serves only
        name = (
            f"DP={dp} EP={ep}"
            + (f" TP={tp}" if tp > 1 else "")
            + {
                "device": ", Engram whole" if weights.engram_tables else "",
                "sharded": ", Engram rows sharded",
                "sharded-host": f", Engram rows sharded in host ({_size(host)}/rank)",
                "host": ", Engram in host memory",
            }[engram]
            + ("" if built else " (not built)")
        )
        flags = (
            [f"--data-parallel-size {dp}"]
            + ([f"--expert-parallel-size {ep}"] if ep > 1 else [])
            + ([f"--tensor-parallel-size {tp}"] if tp > 1 else [])
            + (
                {
                    "device": ["--engram-sharding replicated"] if ep > 1 else [],
                    "sharded": [],
                    "sharded-host": ["--engram-memory host"],
                    "host": ["--engram-memory host"],
                }[engram]
                if weights.engram_tables
                else []
            )
        )
        row = {
            "layout": name,
            "data_parallel": dp,
            "expert_parallel": ep,
            "tensor_parallel": tp,
            "engram": engram,
            "built": built,
            "serve_flags": " ".join(flags) if devices > 1 else "",
            "weight_bytes_per_rank": per_rank,
            "host_bytes_per_rank": host,
            "usable_bytes_per_rank": usable,
            "fits": free > 0,
        }
        if free <= 0:
            row["over_bytes_per_rank"] = -free
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
    lines = [
        f"{name} on {devices} x {_size(device_memory)} ({utilization:.0%} usable: weights + KV cache; KV "
        f"capacity in tokens and in concurrent 1M-token sequences)",
        f"{'layout':<60} {'weights/rank':>13} {'KV tokens/rank':>15} {'KV tokens all':>14} {'1M seqs':>8}",
    ]
    for r in rows:
        weights = _size(r["weight_bytes_per_rank"])
        if r["fits"]:
            lines.append(
                f"{r['layout']:<60} {weights:>13} {r['kv_tokens_per_rank']:>15,} {r['kv_tokens_total']:>14,} "
                f"{r['sequences_1m_total']:>8}"
            )
        else:
            lines.append(
                f"{r['layout']:<60} {weights:>13}  refused: the weights exceed the "
                f"{_size(r['usable_bytes_per_rank'])} usable per device by {_size(r['over_bytes_per_rank'])}"
            )
    return "\n".join(lines)


def sequences_note(rows: list[dict]) -> str:
    """A line saying which layouts fit, and whether this engine can serve one of them."""
    fitting = [r["layout"] for r in rows if r["fits"]]
    note = f"{len(fitting)} of {len(rows)} layouts fit" + (f": {'; '.join(fitting)}" if fitting else "")
    if not any(r["fits"] and r["built"] for r in rows):
        note += "\nno layout this engine has built fits these devices"
    else:
        best = max((r for r in rows if r["fits"] and r["built"]), key=lambda r: r["kv_tokens_total"])
        if best["serve_flags"]:
            note += f"\nmost KV cache: dsv41 serve MODEL {best['serve_flags']}"
    return note
