"""Sharded weight loading for expert, tensor and Engram parallelism (issue 32): each rank reads only its own
routed experts' tensors, its own attention heads' rows and its own rows of the Engram tables from the
safetensors files (plus everything every rank keeps: the rest of attention, router, shared expert, head),
and the other ranks' experts and slices are never allocated, let alone read (a slice is read with
`safe_open(...).get_slice`).

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
from dsv41.distributed.engram_parallel import engram_row_slice, split_engram
from dsv41.distributed.expert_parallel import drop_experts
from dsv41.distributed.tensor_parallel import parameter_slice, slice_attention_heads
from dsv41.model.engram import NgramHasher
from dsv41.model.transformer import Transformer
from dsv41.weights import load_weights

_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.")


def load_expert_shard(path: str | os.PathLike, rank: int, world: int) -> Transformer:
    """The model of `path` (a checkpoint folder) holding only the routed experts `expert_range(E, rank,
    world)` of every MoE layer; `model.load_report` says what was read (`bytes_read`) and how many tensors
    were left to the other ranks (`elsewhere`). Install the dispatcher with `shard_experts(model, group)`."""
    return load_shard(path, expert_rank=rank, expert_world=world)


def load_shard(
    path: str | os.PathLike,
    expert_rank: int = 0,
    expert_world: int = 1,
    tp_rank: int = 0,
    tp_world: int = 1,
    engram_rank: int = 0,
    engram_world: int = 1,
) -> Transformer:
    """The model of `path` holding only expert-parallel rank `expert_rank`'s routed experts,
    tensor-parallel rank `tp_rank`'s query heads and output groups (`head_slices`) and Engram rank
    `engram_rank`'s rows of every Engram table (`engram_parallel.row_range`); install the dispatcher
    (`shard_experts`), the gather (`install_gather`) and the Engram rounds (`install_engram`) afterwards."""
    rank, world = expert_rank, expert_world
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder")
    cfg = ModelConfig.from_file(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    others = set(drop_experts(model, rank, world))
    if tp_world > 1:
        slice_attention_heads(model, tp_rank, tp_world)  # on meta: only the slices get storage
    if engram_world > 1:
        split_engram(model, engram_rank, engram_world)
    model.to_empty(device="cpu")
    if model.engram_hash is not None:  # computed from the config at construction: build it for real
        model.engram_hash = NgramHasher(cfg, model.engram_layout)

    def elsewhere(name: str) -> bool:
        match = _EXPERT.match(name)
        return match is not None and match.group(1) in others

    def rows(name: str):
        part = parameter_slice(cfg, name, tp_rank, tp_world)
        return part if part is not None else engram_row_slice(cfg, name, engram_rank, engram_world)

    report = load_weights(model, path, elsewhere, rows if tp_world > 1 or engram_world > 1 else None)
    model.load_report = report
    return model.eval()
