"""Loading released-layout checkpoints (spec-v41.md §13; golden README "Layout rules").

A model folder holds `config.json` (inference or Hugging Face form) and one or more `*.safetensors`
files under the official tensor names (no `model.` prefix). Conversions done on load, as the
reference's convert.py does:
- `attn.wo_a` stored FP8 + 32x32 scales is dequantised to bf16 (it runs as a grouped einsum);
- bf16 tensors the model keeps in fp32 (`head.weight`, ratio-2 compressor `wkv`/`wgate`) are upcast;
- packed FP4 experts stored as int8/uint8/float4_e2m1fn_x2 are taken as int8 bytes.
Weights are read with safetensors only. Vision (`vision.*`, `aligner.*`, `image_*`) and DSpark
(`mtp.*`) tensors are not implemented yet: they are skipped and reported by name, never dropped silently.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from dsv41.config import ModelConfig
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import dequant_fp8_weight

UNIMPLEMENTED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "mtp.")


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    converted: dict[str, str] = field(default_factory=dict)  # name -> what was done
    skipped: list[str] = field(default_factory=list)  # present in the checkpoint, not used by this model

    def summary(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors, converted {len(self.converted)}"]
        if self.skipped:
            groups: dict[str, int] = {}
            for name in self.skipped:
                key = name.split(".")[0]
                groups[key] = groups.get(key, 0) + 1
            lines.append("skipped (not implemented yet): " + ", ".join(f"{k}.* ({n})" for k, n in sorted(groups.items())))
        return "; ".join(lines)


def checkpoint_files(path: str) -> list[str]:
    """The weight files of a model folder: those named by `model.safetensors.index.json` if present,
    else `model*.safetensors` (single file or shards), else every `*.safetensors`."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            try:
                weight_map = json.load(fh)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: malformed index ({exc})") from exc
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise FileNotFoundError(f"{index} names missing shards: {absent[:4]}")
        return files
    files = sorted(glob.glob(os.path.join(path, "model*.safetensors"))) or \
        sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def _convert(name: str, tensor: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None,
             report: LoadReport) -> torch.Tensor:
    """Bring one checkpoint tensor to the dtype/shape of the model parameter, or raise."""
    if target.dtype == torch.int8 and tensor.dtype in (torch.uint8, torch.float4_e2m1fn_x2):
        tensor = tensor.view(torch.int8)
    if tensor.dtype == torch.float8_e4m3fn and target.dtype in (torch.bfloat16, torch.float32):
        if scale is None:
            raise ValueError(f"{name}: FP8 tensor without its '.scale' companion")
        report.converted[name] = f"fp8 dequantised to {target.dtype}"
        tensor = dequant_fp8_weight(tensor, scale).to(target.dtype)
    elif tensor.dtype != target.dtype:
        lossless = tensor.dtype == torch.bfloat16 and target.dtype == torch.float32
        if not lossless:
            raise ValueError(f"{name}: checkpoint dtype {tensor.dtype} does not match the model's {target.dtype} "
                             f"(check config 'dtype'/'expert_dtype')")
        report.converted[name] = "bf16 upcast to fp32"
        tensor = tensor.to(target.dtype)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's "
                         f"{tuple(target.shape)}")
    return tensor


def load_weights(model: Transformer, path: str) -> LoadReport:
    """Copy every tensor of the folder's safetensors files into `model`; raise on anything malformed."""
    params = dict(model.named_parameters())
    report = LoadReport()
    handles = [safe_open(f, framework="pt", device="cpu") for f in checkpoint_files(path)]
    where: dict[str, tuple[int, str]] = {}  # tensor name -> (file, key as stored)
    for i, handle in enumerate(handles):
        for key in handle.keys():
            name = key[len("model."):] if key.startswith("model.") else key
            if name in where:
                raise ValueError(f"{path}: tensor {name!r} appears twice")
            where[name] = (i, key)

    def read(name: str) -> torch.Tensor:
        file_index, key = where[name]
        return handles[file_index].get_tensor(key)

    consumed = set()
    for name, param in params.items():
        if name not in where:
            continue
        scale = None
        if name.endswith(".weight") and param.dtype in (torch.bfloat16, torch.float32):
            scale_name = name[: -len(".weight")] + ".scale"
            if scale_name in where and scale_name not in params:
                scale = read(scale_name)
                consumed.add(scale_name)
        tensor = _convert(name, read(name), param, scale, report)
        with torch.no_grad():
            param.copy_(tensor)
        consumed.add(name)
        report.loaded.append(name)

    missing = [n for n in params if n not in consumed]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"{path}: checkpoint lacks tensors the model needs: {shown}")
    unknown = []
    for name in where:
        if name in consumed:
            continue
        if name.startswith(UNIMPLEMENTED_PREFIXES):
            report.skipped.append(name)
        else:
            unknown.append(name)
    if unknown:
        shown = ", ".join(sorted(unknown)[:8]) + (f" ... ({len(unknown)} in all)" if len(unknown) > 8 else "")
        raise ValueError(f"{path}: checkpoint has tensors this config does not describe: {shown}")
    return report


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", verbose: bool = False) -> Transformer:
    """Build the model described by `path/config.json` and load `path/*.safetensors` into it.

    The returned model is in eval mode; `model.load_report` lists conversions and skipped tensors.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder")
    cfg = ModelConfig.from_file(path)
    with torch.device("cpu"):
        model = Transformer(cfg)
    report = load_weights(model, path)
    if verbose or report.skipped:
        print(f"[dsv41] {path}: {report.summary()}")
    model.load_report = report
    return model.to(device).eval()
