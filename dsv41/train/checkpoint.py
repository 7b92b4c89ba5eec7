"""Checkpoints, written atomically and read with safetensors only (no pickle).

A run folder holds:
- `checkpoint/`: the model in the release layout (`config.json`, `model.safetensors`, `tokenizer.json`):
  `dsv41.load_model`, `dsv41 serve` and `dsv41 chat --model` read it directly. Weights are cast to the
  inference dtypes; the Engram tables are re-quantised to FP8 rows with UE8M0 scales.
- `train_state/`: what resuming needs bit for bit: fp32 master weights (training names), the optimizer
  state (tensors in safetensors, the rest in JSON) and the step.
Each folder is written next to its final place and swapped in with a rename, so a kill never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from dsv41.config import ModelConfig
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import fp8_quant


def _swap_in(tmp: str, final: str) -> None:
    """Replace `final` by the finished folder `tmp` (old copy removed only after the rename)."""
    old = final + ".old"
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    if os.path.exists(old):
        shutil.rmtree(old)


def _fresh_tmp(final: str) -> str:
    tmp = final + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def inference_state(model: Transformer, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The training model's weights under the release names and dtypes."""
    with torch.device("meta"):
        target = Transformer(cfg)
    wanted = dict(target.named_parameters())
    have = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, ref in wanted.items():
        if name.endswith("engram.embed.scale"):
            continue  # written together with its table below
        value = host_copy(have[name])
        if name.endswith("engram.embed.weight") and ref.dtype == torch.float8_e4m3fn:
            codes, scale = fp8_quant(value.float())
            out[name] = codes.contiguous()
            out[name[: -len("weight")] + "scale"] = scale.to(torch.float8_e8m0fnu).contiguous()
        else:
            out[name] = value.to(ref.dtype).contiguous()
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded (FSDP2 DTensor) one."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of a (possibly sharded, possibly GPU) tensor, for safetensors."""
    return full_tensor(t).detach().to("cpu", copy=True).contiguous()


def save_checkpoint(folder: str, model: Transformer, cfg: ModelConfig, tokenizer_file: Optional[str],
                    state: Optional[dict] = None) -> None:
    """Write the release-layout folder (`state`: a precomputed `inference_state`, e.g. gathered on all
    ranks of a sharded run)."""
    tmp = _fresh_tmp(folder)
    save_file(state if state is not None else inference_state(model, cfg), os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    cfg.to_json(os.path.join(tmp, "config.json"))
    if tokenizer_file:
        shutil.copy(tokenizer_file, os.path.join(tmp, "tokenizer.json"))
    _swap_in(tmp, folder)


# ---------------------------------------------------------------------- training state
def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Nested dicts/lists with tensors -> a JSON tree whose tensors are replaced by references."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "root"
        tensors[key] = host_copy(obj)
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_key(k), _flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a training state")


def _key(k: Any) -> Any:
    return {"int": k} if isinstance(k, int) else k


def _unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__dtype__" in tree:
            return getattr(torch, tree["__dtype__"])
        if "__dict__" in tree:
            return {(k["int"] if isinstance(k, dict) else k): _unflatten(v, tensors) for k, v in tree["__dict__"]}
        if "__list__" in tree:
            items = [_unflatten(v, tensors) for v in tree["__list__"]]
            return tuple(items) if tree.get("tuple") else items
    return tree


def train_state_payload(model: torch.nn.Module, optimizer) -> tuple[dict, dict, Any]:
    """(fp32 weights, optimizer tensors, optimizer JSON tree), as full tensors. Under FSDP2 every rank must
    call this (it gathers shards in a fixed order); only one rank writes."""
    weights = {name: host_copy(p) for name, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(optimizer.state_dict(), "opt", tensors)
    return weights, tensors, tree


def save_train_state(folder: str, model: torch.nn.Module, optimizer, step: int, extra: dict,
                     payload: Optional[tuple] = None) -> None:
    weights, tensors, tree = payload if payload is not None else train_state_payload(model, optimizer)
    tmp = _fresh_tmp(folder)
    save_file(weights, os.path.join(tmp, "weights.safetensors"))
    save_file(tensors, os.path.join(tmp, "optimizer.safetensors"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"step": step, "optimizer": tree, **extra}, f)
    _swap_in(tmp, folder)


def load_train_state(folder: str, model: torch.nn.Module, optimizer) -> dict:
    """Restore weights and optimizer state in place; returns the JSON state (with "step")."""
    for name in ("weights.safetensors", "optimizer.safetensors", "state.json"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(f"{folder}: incomplete training state (no {name})")
    weights = load_file(os.path.join(folder, "weights.safetensors"))
    params = dict(model.named_parameters())
    if set(weights) != set(params):
        raise ValueError(f"{folder}: the saved weights do not match this model "
                         f"(missing {sorted(set(params) - set(weights))[:4]}, extra {sorted(set(weights) - set(params))[:4]})")
    with torch.no_grad():
        for name, p in params.items():
            _copy_into(p, weights[name])
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    optimizer.load_state_dict(_unflatten(state.pop("optimizer"), load_file(os.path.join(folder, "optimizer.safetensors"))))
    return state


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(param, "device_mesh"):  # FSDP2: keep this rank's shard of the full tensor
        from torch.distributed.tensor import distribute_tensor

        param.copy_(distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements))
    else:
        param.copy_(full)
