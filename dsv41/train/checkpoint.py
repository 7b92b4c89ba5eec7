"""Checkpoints, written atomically and read with safetensors only (no pickle).

A run folder holds:
- `checkpoint/`: the model in the release layout (`config.json`, `model.safetensors`, `tokenizer.json`):
  `dsv41.load_model`, `dsv41 serve` and `dsv41 chat --model` read it directly. Weights are cast to the
  inference dtypes; the Engram tables are re-quantised to FP8 rows with UE8M0 scales.
- `train_state/`: what resuming needs bit for bit: fp32 master weights (training names), the optimizer
  state (tensors in safetensors, the rest in JSON) and the step.
Each folder is written next to its final place (`NAME.tmp`), its files fsynced and a `COMPLETE` marker
written last, then swapped in with two renames (`NAME` -> `NAME.old`, `NAME.tmp` -> `NAME`). A kill never
leaves a half-written folder in place, and one between the renames leaves `NAME.old` and a complete
`NAME.tmp`, which `recover_folder` (run when a trainer starts) puts back. `checkpoint/` also holds
`dsv41_train.json` (`RUN_FILE`): the training step it was written at and the model's name.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dsv41.config import ModelConfig
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import fp8_quant
from dsv41.weights import RUN_FILE

COMPLETE = "COMPLETE"  # written last into a .tmp folder, after everything else is on disk
TRAIN_STATE_FILES = ("weights.safetensors", "optimizer.safetensors", "state.json")
CHECKPOINT_FILES = ("config.json", "model.safetensors")


def _fsync(path: str, directory: bool = False) -> None:
    """Flush a file, or a folder's entries, to disk: without it a power loss after the rename can leave the
    renamed folder with empty files. Some systems cannot fsync a folder; that is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _finish(tmp: str) -> None:
    """Mark the written folder `tmp` complete: its files on disk first, then the marker, so a .tmp with
    the marker is known whole."""
    for name in sorted(os.listdir(tmp)):
        _fsync(os.path.join(tmp, name))
    with open(os.path.join(tmp, COMPLETE), "w") as f:
        f.write("complete\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp, directory=True)


def _swap_in(tmp: str, final: str) -> None:
    """Replace `final` by the finished folder `tmp`. The previous copy is removed only after the second
    rename; one left by an earlier kill (`final.old` with no `final`) is kept until then too."""
    old = final + ".old"
    if os.path.exists(final):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(os.path.dirname(os.path.abspath(final)), directory=True)
    if os.path.exists(old):
        shutil.rmtree(old)


def recover_folder(final: str, required: tuple[str, ...]) -> str | None:
    """Undo a kill during a save of `final`: make the newest complete copy `final` and drop the others.

    A `.tmp` is complete only with its marker (its files may be cut short otherwise); `final` and `.old`
    only ever come from renaming a complete folder, and rmtree removes whole files, so they are complete
    when all `required` files are there (folders written before the marker existed have none). A
    complete `.tmp` is always the newest: it is written after `final` and renamed away before the next
    save starts. Returns what was done, for the log, or None when there was nothing to do.
    """
    tmp, old = final + ".tmp", final + ".old"

    def complete(folder: str, marker: bool) -> bool:
        return (
            os.path.isdir(folder)
            and all(os.path.isfile(os.path.join(folder, n)) for n in required)
            and (not marker or os.path.isfile(os.path.join(folder, COMPLETE)))
        )

    name = os.path.basename(final)
    if complete(tmp, True):
        _swap_in(tmp, final)
        return f"recovered {final} from {name}.tmp, written completely before a kill stopped the save"
    if complete(final, False):
        stale = [p for p in (tmp, old) if os.path.exists(p)]
        for path in stale:
            shutil.rmtree(path)
        return f"removed {', '.join(stale)} left by a killed save" if stale else None
    if not os.path.exists(final) and complete(old, False):
        os.replace(old, final)
        _fsync(os.path.dirname(os.path.abspath(final)), directory=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        return f"recovered {final} from {name}.old: a kill stopped the save that was replacing it"
    return None


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
        if name.endswith("engram.embed.weight") and value.dtype == torch.float8_e4m3fn:
            out[name] = value  # an inference model's table (an RL policy): already FP8 rows with its scales
            out[name[: -len("weight")] + "scale"] = host_copy(have[name[: -len("weight")] + "scale"])
        elif name.endswith("engram.embed.weight") and ref.dtype == torch.float8_e4m3fn:
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


def save_checkpoint(
    folder: str,
    model: Transformer,
    cfg: ModelConfig,
    tokenizer_file: str | None,
    state: dict | None = None,
    run_info: dict | None = None,
) -> None:
    """Write the release-layout folder (`state`: a precomputed `inference_state`, e.g. gathered on all
    ranks of a sharded run; `run_info`: written as `RUN_FILE`, e.g. the training step and model name)."""
    tmp = _fresh_tmp(folder)
    save_file(
        state if state is not None else inference_state(model, cfg),
        os.path.join(tmp, "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg.to_json(os.path.join(tmp, "config.json"))
    if tokenizer_file:
        shutil.copy(tokenizer_file, os.path.join(tmp, "tokenizer.json"))
        _write_tokenizer_config(tmp, tokenizer_file)
    else:  # the byte or DeepSeek tokenizer it is served with, as files, so AutoTokenizer loads every checkpoint
        from dsv41.tokenizer_files import write_model_tokenizer_files

        write_model_tokenizer_files(tmp, cfg.vocab_size)
    if run_info is not None:
        with open(os.path.join(tmp, RUN_FILE), "w") as f:
            json.dump(run_info, f, indent=2)
    _finish(tmp)
    _swap_in(tmp, folder)


def _write_tokenizer_config(folder: str, tokenizer_file: str) -> None:
    """tokenizer_config.json (BOS/EOS/PAD as the tokenizer resolves them, the chat template) and
    special_tokens_map.json next to the copied tokenizer.json, so `transformers.AutoTokenizer` loads the
    checkpoint folder; fields of the source's own tokenizer_config.json are kept."""
    from dsv41.chat.hf_template import write_hf_tokenizer_files
    from dsv41.tokenizer import HFTokenizer

    source_config = os.path.join(os.path.dirname(os.path.abspath(tokenizer_file)), "tokenizer_config.json")
    write_hf_tokenizer_files(
        folder, HFTokenizer.from_file(tokenizer_file), source_config if os.path.isfile(source_config) else None
    )


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
        return {
            "__list__": [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
            "tuple": isinstance(obj, tuple),
        }
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


def save_train_state(
    folder: str, model: torch.nn.Module, optimizer, step: int, extra: dict, payload: tuple | None = None
) -> None:
    weights, tensors, tree = payload if payload is not None else train_state_payload(model, optimizer)
    tmp = _fresh_tmp(folder)
    save_file(weights, os.path.join(tmp, "weights.safetensors"))
    save_file(tensors, os.path.join(tmp, "optimizer.safetensors"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"step": step, "optimizer": tree, **extra}, f)
    _finish(tmp)
    _swap_in(tmp, folder)


def read_train_state_json(folder: str) -> dict:
    """state.json without loading any tensor (the step, the saved config), to check before a load."""
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    state.pop("optimizer", None)
    return state


def load_train_state(folder: str, model: torch.nn.Module, optimizer) -> dict:
    """Restore weights and optimizer state in place; returns the JSON state (with "step")."""
    for name in TRAIN_STATE_FILES:
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(f"{folder}: incomplete training state (no {name})")
    weights = load_file(os.path.join(folder, "weights.safetensors"))
    params = dict(model.named_parameters())
    if set(weights) != set(params):
        raise ValueError(
            f"{folder}: the saved weights do not match this model "
            f"(missing {sorted(set(params) - set(weights))[:4]}, extra {sorted(set(weights) - set(params))[:4]})"
        )
    with torch.no_grad():
        for name, p in params.items():
            _copy_into(p, weights[name])
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    optimizer.load_state_dict(
        _unflatten(state.pop("optimizer"), load_file(os.path.join(folder, "optimizer.safetensors")))
    )
    return state


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(param, "device_mesh"):  # FSDP2: keep this rank's shard of the full tensor
        from torch.distributed.tensor import distribute_tensor

        param.copy_(distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements))
    else:
        param.copy_(full)
