"""Parameter grouping and the combined optimizer of the training recipe (training.md §1.4, §10; spec §5, §7).

Every trainable parameter of `dsv41.model.transformer.Transformer` goes to exactly one group, chosen
by name first and shape second (`classify_param`, first matching rule wins):

| rule (parameter name / shape)                                 | group           | optimizer     |
|---------------------------------------------------------------|-----------------|---------------|
| `requires_grad=False` (fp8 tables/scales, router `gate.bias`) | not optimised   | -             |
| `...engram.embed.weight` (Engram hash tables)                 | `sink_engram`   | SinkMomentum, lr × 5 (spec §5) |
| `embed.weight`, `head.weight` (token embedding, LM head)      | `sink`          | SinkMomentum  |
| 1-D (norms, `attn_sink`, `hc_*_base`/`hc_*_scale`, biases)    | `adamw`         | AdamW         |
| `engram.q_weight`, `engram.k_weight` (gating factors)         | `adamw`         | AdamW (§1.4)  |
| `hc_*_fn` (mHC mixing matrix, 2-D fp32)                       | `muon` (default) or `adamw` (`hc_fn_muon=False`): open question of §1.4 |
| `attn.wq_b` (main query, `n_heads` × `head_dim` rows)         | `muon_q`        | head-wise Muon, heads = n_heads |
| `attn.indexer.wq_b` (indexer query)                           | `muon_index_q`  | head-wise Muon, heads = index_n_heads |
| `attn.wo_a` (grouped output LoRA, `o_groups` blocks)          | `muon_wo_a`     | Muon per group block [D] |
| any other ≥2-D matrix (wq_a, wkv, wo_b, experts, gate, compressor, indexer wk/weights_proj, engram wkv) | `muon` | Muon |

Key projections: V4.1's `attn.wkv` and the indexer's `wk` each produce a single (MQA) key head, so
head-wise Muon reduces to plain Muon for them (training.md §1.2, spec §12c.8); they are in `muon`.
`wo_a` is stored as [o_groups·o_lora_rank, in/o_groups] but applied as `o_groups` independent blocks
(`ops.grouped_linear`), so the polar factor of the map it represents is the per-block one [D]; set
`grouped_wo_a=False` for plain Muon on the stacked matrix.

Defaults (`OptimConfig`): Muon μ 0.95 Nesterov, update RMS γ 0.18, V4 8+2 Newton-Schulz, wd 0.1; AdamW
β (0.9, 0.95), eps 1e-20, wd 0.1 (spec §7); SinkMomentum μ 0.95, K 11, τ 1e-3, γ 0.18, no wd (spec §7);
learning rate 3e-3 for all groups (training.md §10: AdamW 3e-3; Muon in the RMS-matched form takes
1e-3..3e-3 and shares AdamW's lr, Moonlight style); Engram tables lr × 5 (spec §5).

`build_optimizers(model, cfg)` returns an `OptimizerSet`: a list of torch optimizers (Muon,
SinkMomentum, AdamW) with one step/zero_grad/state_dict/load_state_dict, a flat `param_groups` view, and
`set_lr_scale` for warm-up/cosine schedules (each group keeps its `base_lr`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dsv41.config import ModelConfig
from dsv41.optim.muon import MUON_RMS, Muon
from dsv41.optim.sink import SINK_ITERS, SINK_RMS, SINK_TAU, SinkMomentum

GROUP_OPTIMIZER = {
    "muon": "muon",
    "muon_q": "muon",
    "muon_index_q": "muon",
    "muon_wo_a": "muon",
    "sink": "sink",
    "sink_engram": "sink",
    "adamw": "adamw",
}


@dataclass
class OptimConfig:
    """Learning rates, betas and weight decay per optimizer group (training.md §1, §10; spec §5, §7)."""

    lr: float = 3e-3  # base lr shared by Muon, AdamW and SinkMomentum
    muon_lr: float | None = None  # None -> lr
    adamw_lr: float | None = None  # None -> lr
    sink_lr: float | None = None  # None -> lr
    engram_lr_mult: float = 5.0  # Engram tables (spec §5)
    # Muon (spec §7, training.md §1.1)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_weight_decay: float = 0.1
    muon_rms: float = MUON_RMS
    ns_schedule: Any = "v4"  # "v4" (8+2 hybrid), "keller", or a list of (a, b, c)
    ns_dtype: torch.dtype = torch.float32  # Newton-Schulz matmul dtype; bf16 halves the cost (training.md §1.1)
    headwise: bool = True  # head-wise Muon for the query projections (training.md §1.2)
    grouped_wo_a: bool = True  # per-group Muon for the grouped output LoRA wo_a [D]
    hc_fn_muon: bool = True  # hc_*_fn on Muon (default, training.md §1.4) or AdamW
    # AdamW (spec §7)
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-20
    adamw_weight_decay: float = 0.1
    # SinkMomentum (spec §7, training.md §1.3)
    sink_momentum: float = 0.95  # 0 = stateless SinkGD
    sink_nesterov: bool = True
    sink_weight_decay: float = 0.0
    sink_rms: float = SINK_RMS
    sink_iters: int = SINK_ITERS
    sink_tau: float = SINK_TAU
    sink_row_mask: str = "both"
    # ablation switches (training.md §10 grid)
    use_muon: bool = True  # False: every Muon parameter goes to AdamW
    use_sink: bool = True  # False: embedding/head/Engram tables go to AdamW

    def replace(self, **changes: Any) -> OptimConfig:
        return dataclasses.replace(self, **changes)


_ENGRAM_TABLE = re.compile(r"(^|\.)engram\.embed\.weight$")
_EMBED_OR_HEAD = re.compile(r"(^|\.)(embed|head)\.weight$")
_ENGRAM_GATES = re.compile(r"(^|\.)engram\.(q_weight|k_weight)$")
_HC_FN = re.compile(r"(^|\.)hc_[a-z]+_fn$")
_INDEX_Q = re.compile(r"(^|\.)indexer\.wq_b\.weight$")
_MAIN_Q = re.compile(r"(^|\.)attn\.wq_b\.weight$")
_WO_A = re.compile(r"(^|\.)attn\.wo_a\.weight$")


def classify_param(name: str, param: torch.Tensor, cfg: OptimConfig | None = None) -> str | None:
    """The group name of a parameter (see the module table), or None when it is not trainable."""
    cfg = cfg or OptimConfig()
    if not param.requires_grad:
        return None
    if _ENGRAM_TABLE.search(name):
        return "sink_engram" if cfg.use_sink else "adamw"
    if _EMBED_OR_HEAD.search(name) and param.ndim == 2:
        return "sink" if cfg.use_sink else "adamw"
    if param.ndim < 2 or _ENGRAM_GATES.search(name) or not cfg.use_muon:
        return "adamw"
    if _HC_FN.search(name):
        return "muon" if cfg.hc_fn_muon else "adamw"
    if cfg.headwise and _INDEX_Q.search(name):
        return "muon_index_q"
    if cfg.headwise and _MAIN_Q.search(name):
        return "muon_q"
    if cfg.grouped_wo_a and _WO_A.search(name):
        return "muon_wo_a"
    return "muon"


def group_params(model: nn.Module, cfg: OptimConfig | None = None) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """{group name: [(param name, param), ...]} over the model's trainable parameters, each once."""
    cfg = cfg or OptimConfig()
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        kind = classify_param(name, p, cfg)
        if kind is not None:
            groups.setdefault(kind, []).append((name, p))
    return groups


class OptimizerSet:
    """Several torch optimizers driven as one (step, zero_grad, state_dict, load_state_dict)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.optimizers = dict(optimizers)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers.values())

    def __len__(self) -> int:
        return len(self.optimizers)

    def __getitem__(self, key: str) -> torch.optim.Optimizer:
        return self.optimizers[key]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self for g in opt.param_groups]

    def group(self, name: str) -> dict[str, Any]:
        """The param group called `name` (KeyError if absent)."""
        for g in self.param_groups:
            if g.get("name") == name:
                return g
        raise KeyError(name)

    def set_lr_scale(self, scale: float) -> None:
        """lr = base_lr × scale in every group (for warm-up / cosine schedules)."""
        for g in self.param_groups:
            g["lr"] = g["base_lr"] * scale

    @torch.no_grad()
    def step(self) -> None:
        for opt in self:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state has {sorted(state)}, this set has {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def build_optimizers(
    model: nn.Module, cfg: OptimConfig | None = None, model_cfg: ModelConfig | None = None
) -> OptimizerSet:
    """Group the model's trainable parameters (module table) and build Muon, SinkMomentum and AdamW.

    `model_cfg` defaults to `model.cfg`; it gives the head counts of the head-wise groups.
    """
    cfg = cfg or OptimConfig()
    model_cfg = model_cfg or getattr(model, "cfg", None)
    groups = group_params(model, cfg)
    if model_cfg is None and any(k in groups for k in ("muon_q", "muon_index_q", "muon_wo_a")):
        raise ValueError("build_optimizers needs model_cfg (or model.cfg) for the head-wise Muon groups")
    muon_lr = cfg.muon_lr if cfg.muon_lr is not None else cfg.lr
    adamw_lr = cfg.adamw_lr if cfg.adamw_lr is not None else cfg.lr
    sink_lr = cfg.sink_lr if cfg.sink_lr is not None else cfg.lr
    blocks = {"muon": 1}
    if model_cfg is not None:
        blocks.update(muon_q=model_cfg.n_heads, muon_index_q=model_cfg.index_n_heads, muon_wo_a=model_cfg.o_groups)
    lrs = {"muon": muon_lr, "sink": sink_lr, "sink_engram": sink_lr * cfg.engram_lr_mult, "adamw": adamw_lr}

    per_opt: dict[str, list[dict[str, Any]]] = {"muon": [], "sink": [], "adamw": []}
    for kind in ("muon", "muon_q", "muon_index_q", "muon_wo_a", "sink", "sink_engram", "adamw"):
        if kind not in groups:
            continue
        lr = lrs.get(kind, muon_lr)
        group: dict[str, Any] = {"params": groups[kind], "name": kind, "lr": lr, "base_lr": lr}
        if GROUP_OPTIMIZER[kind] == "muon":
            group["heads"] = blocks[kind]
        per_opt[GROUP_OPTIMIZER[kind]].append(group)

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if per_opt["muon"]:
        optimizers["muon"] = Muon(
            per_opt["muon"],
            lr=muon_lr,
            weight_decay=cfg.muon_weight_decay,
            momentum=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            rms=cfg.muon_rms,
            ns_schedule=cfg.ns_schedule,
            ns_dtype=cfg.ns_dtype,
        )
    if per_opt["sink"]:
        optimizers["sink"] = SinkMomentum(
            per_opt["sink"],
            lr=sink_lr,
            weight_decay=cfg.sink_weight_decay,
            momentum=cfg.sink_momentum,
            nesterov=cfg.sink_nesterov,
            rms=cfg.sink_rms,
            iters=cfg.sink_iters,
            tau=cfg.sink_tau,
            row_mask=cfg.sink_row_mask,
        )
    if per_opt["adamw"]:
        optimizers["adamw"] = torch.optim.AdamW(
            per_opt["adamw"],
            lr=adamw_lr,
            betas=cfg.adamw_betas,
            eps=cfg.adamw_eps,
            weight_decay=cfg.adamw_weight_decay,
            foreach=False,
        )
    return OptimizerSet(optimizers)
