"""Sharded weight loading for expert parallelism (issue 32): each rank reads only its own routed experts'
tensors from the safetensors files (plus everything every rank keeps: attention, router, shared expert,
Engram, head), and the other ranks' experts are never allocated, let alone read.

The model is built on the meta device (no storage), the other ranks' experts are replaced by placeholders
(`drop_experts`), the rest is given real CPU storage (`to_empty`), and `dsv41.weights.load_weights` fills it
tensor by tensor through `safe_open`, skipping the other ranks' expert tensors by name: safetensors reads a
tensor's bytes only when asked for it (`get_tensor`), so those bytes stay on disk. The buffers the model
computes from its config (the Engram hasher's tables) are rebuilt, since `to_empty` leaves them undefined.
"""

from __future__ import annotations

import os
import re

import torch

from dsv41.config import ModelConfig
from dsv41.distributed.expert_parallel import drop_experts
from dsv41.model.engram import NgramHasher
from dsv41.model.transformer import Transformer
from dsv41.weights import load_weights

_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.")


def load_expert_shard(path: str | os.PathLike, rank: int, world: int) -> Transformer:
    """The model of `path` (a checkpoint folder) holding only the routed experts `expert_range(E, rank,
    world)` of every MoE layer; `model.load_report` says what was read (`bytes_read`) and how many tensors
    were left to the other ranks (`elsewhere`). Install the dispatcher with `shard_experts(model, group)`."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder")
    cfg = ModelConfig.from_file(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    others = set(drop_experts(model, rank, world))
    model.to_empty(device="cpu")
    if model.engram_hash is not None:  # computed from the config at construction: build it for real
        model.engram_hash = NgramHasher(cfg, model.engram_layout)

    def elsewhere(name: str) -> bool:
        match = _EXPERT.match(name)
        return match is not None and match.group(1) in others

    report = load_weights(model, path, elsewhere)
    model.load_report = report
    return model.eval()
