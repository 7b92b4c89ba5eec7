"""Optimizers of the DeepSeek-V4.1 training recipe (training.md §1; spec-v41.md §7).

- `Muon` / head-wise Muon (training.md §1.1, §1.2) with the V4 8+2 Newton-Schulz schedule and update
  RMS 0.18, for hidden 2-D matrices;
- `SinkMomentum` (training.md §1.3) for the token embedding, LM head and Engram tables;
- `torch.optim.AdamW` for the rest;
- `build_optimizers(model, OptimConfig)` assigns every trainable parameter to one group (§1.4).
"""

from dsv41.optim.groups import (
    GROUP_OPTIMIZER,
    OptimConfig,
    OptimizerSet,
    build_optimizers,
    classify_param,
    group_params,
)
from dsv41.optim.muon import MUON_RMS, Muon, muon_direction, row_blocks
from dsv41.optim.newton_schulz import KELLER_SCHEDULE, V4_HYBRID_SCHEDULE, newton_schulz, resolve_schedule
from dsv41.optim.sink import SINK_ITERS, SINK_RMS, SINK_TAU, SinkMomentum, active_rows, sinkhorn_normalize

__all__ = [
    "GROUP_OPTIMIZER",
    "KELLER_SCHEDULE",
    "MUON_RMS",
    "Muon",
    "OptimConfig",
    "OptimizerSet",
    "SINK_ITERS",
    "SINK_RMS",
    "SINK_TAU",
    "SinkMomentum",
    "V4_HYBRID_SCHEDULE",
    "active_rows",
    "build_optimizers",
    "classify_param",
    "group_params",
    "muon_direction",
    "newton_schulz",
    "resolve_schedule",
    "row_blocks",
    "sinkhorn_normalize",
]
