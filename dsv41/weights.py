"""Loading released-layout checkpoints (spec-v41.md §13; golden README "Layout rules").

A model folder holds `config.json` (inference or Hugging Face form) and its weights under the
official tensor names (no `model.` prefix) in `model.safetensors` or shards
`model-00001-of-000NN.safetensors` (with or without `model.safetensors.index.json`), the names
Hugging Face transformers writes and reads; other `*.safetensors` files (a golden folder's inputs and
expected outputs) are not weights. Conversions done on load, as the
reference's convert.py does:
- `attn.wo_a` stored FP8 + 32x32 scales is dequantised to bf16 (it runs as a grouped einsum);
- bf16 tensors the model keeps in fp32 (`head.weight`, ratio-2 compressor `wkv`/`wgate`) are upcast;
- packed FP4 experts stored as int8/uint8/float4_e2m1fn_x2 are taken as int8 bytes.
Weights are read with safetensors only: pickle checkpoints (`pytorch_model.bin`) are refused, since
unpickling runs whatever code the file holds. Vision (`vision.*`, `aligner.*`, `image_*`) tensors are used
only when the config describes the vision tower (vision_n_layers > 0), and DSpark (`mtp.*`) tensors only
when it describes the drafter (n_mtp_layers and dspark_block_size): otherwise they are skipped and
reported by name, never dropped silently. The drafter's stages have no `embed`/`head` of their own (the release ties them to the backbone's).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open

from dsv41.config import ModelConfig
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import FP8_BLOCK, dequant_fp8_weight

OPTIONAL_PART_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "mtp.")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")
# weight files in formats that are read with pickle (torch.load), refused by name
PICKLE_PATTERNS = ("pytorch_model*.bin",)


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    converted: dict[str, str] = field(default_factory=dict)  # name -> what was done
    skipped: list[str] = field(default_factory=list)  # present in the checkpoint, not used by this model
    elsewhere: int = 0  # tensors another rank loads (a sharded load's `elsewhere`): never read here
    bytes_read: int = 0  # bytes of the tensors read from the files, as stored

    def summary(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors, converted {len(self.converted)}"]
        if self.skipped:
            groups: dict[str, int] = {}
            for name in self.skipped:
                key = name.split(".")[0]
                groups[key] = groups.get(key, 0) + 1
            lines.append(
                "skipped (parts the config leaves out): " + ", ".join(f"{k}.* ({n})" for k, n in sorted(groups.items()))
            )
        return "; ".join(lines)


def checkpoint_files(path: str) -> list[str]:
    """The weight files of a model folder: those named by `model.safetensors.index.json` if present,
    else `model.safetensors`, else a complete set of shards `model-XXXXX-of-YYYYY.safetensors`.

    Only these names are weights: any other `*.safetensors` (a golden folder's `inputs.safetensors`)
    would otherwise be read as a shard. Raises FileNotFoundError naming what is missing, and
    ValueError for a pickle checkpoint or an ambiguous set of shards.
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as fh:
            try:
                weight_map = json.load(fh)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: malformed index ({exc})") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: malformed index ('weight_map' must map tensor names to file names)")
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(f"{index} names missing shards: {absent[:4]}")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    shards: dict[int, dict[int, str]] = {}  # shard count -> {shard number: file name}
    for name in sorted(os.listdir(path)):
        match = SHARD_NAME.fullmatch(name)
        if match and os.path.isfile(os.path.join(path, name)):
            number, total = int(match.group(1)), int(match.group(2))
            if number in shards.setdefault(total, {}):
                raise ValueError(f"{path}: {shards[total][number]} and {name} are the same shard")
            shards[total][number] = name
    if len(shards) > 1:
        raise ValueError(
            f"{path}: shards of {len(shards)} different checkpoints (of {sorted(shards)} files); "
            f"keep one set or add {INDEX_FILE}"
        )
    if shards:
        ((total, present),) = shards.items()
        absent = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1) if i not in present]
        if absent:
            raise FileNotFoundError(
                f"{path}: incomplete sharded checkpoint, missing {', '.join(absent[:4])}"
                + (f" ... ({len(absent)} in all)" if len(absent) > 4 else "")
            )
        stray = [n for i, n in present.items() if not 1 <= i <= total]
        if stray:
            raise ValueError(f"{path}: shard numbers out of range 1..{total}: {', '.join(stray)}")
        return [os.path.join(path, present[i]) for i in range(1, total + 1)]
    pickles = sorted(
        {os.path.basename(f) for pattern in PICKLE_PATTERNS for f in glob.glob(os.path.join(path, pattern))}
    )
    if pickles:
        raise ValueError(
            f"{path}: {', '.join(pickles)}: pickle checkpoints are not loaded, because unpickling "
            f"runs any code the file holds; convert it to {SINGLE_FILE} (safetensors) where you "
            f"trust it, e.g. with safetensors.torch.save_file"
        )
    others = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
    found = f"; {', '.join(others)} are not weight files" if others else ""
    raise FileNotFoundError(
        f"{path}: no weights: expected {SINGLE_FILE}, shards model-00001-of-000NN.safetensors or {INDEX_FILE}{found}"
    )


def _open(file: str):
    """safe_open that names the file: safetensors' own errors ("header too large") do not."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc


def _convert(
    name: str, tensor: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None, report: LoadReport
) -> torch.Tensor:
    """Bring one checkpoint tensor to the dtype/shape of the model parameter, or raise."""
    if target.dtype == torch.int8 and tensor.dtype in (torch.uint8, torch.float4_e2m1fn_x2):
        tensor = tensor.view(torch.int8)
    if tensor.dtype == torch.float8_e4m3fn and target.dtype in (torch.bfloat16, torch.float32):
        if scale is None:
            raise ValueError(f"{name}: FP8 tensor without its '.scale' companion")
        scale_name = name[: -len(".weight")] + ".scale"  # load_weights pairs scales with `.weight`s only
        # one scale per 32x32 tile of the weight as stored; dequant_fp8_weight would slice extra tiles
        # away silently and fail on missing ones with a bare broadcast error
        tiles = tuple(-(-n // FP8_BLOCK) for n in tensor.shape)
        if tensor.dim() != 2 or tuple(scale.shape) != tiles:
            raise ValueError(
                f"{scale_name}: checkpoint shape {tuple(scale.shape)} does not match the "
                f"{FP8_BLOCK}x{FP8_BLOCK} tiles of {name} {tuple(tensor.shape)}: expected {tiles}"
            )
        if not scale.is_floating_point():
            raise ValueError(f"{scale_name}: checkpoint dtype {scale.dtype} is not a scale dtype")
        report.converted[name] = f"fp8 dequantised to {target.dtype}"
        tensor = dequant_fp8_weight(tensor, scale).to(target.dtype)
    elif tensor.dtype != target.dtype:
        lossless = tensor.dtype == torch.bfloat16 and target.dtype == torch.float32
        if not lossless:
            raise ValueError(
                f"{name}: checkpoint dtype {tensor.dtype} does not match the model's {target.dtype} "
                f"(check config 'dtype'/'expert_dtype')"
            )
        report.converted[name] = "bf16 upcast to fp32"
        tensor = tensor.to(target.dtype)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
        )
    return tensor


def load_weights(
    model: Transformer,
    path: str,
    elsewhere: Callable[[str], bool] | None = None,
    rows: Callable[[str], slice | None] | None = None,
) -> LoadReport:
    """Copy every tensor of the folder's safetensors files into `model`; raise on anything malformed.
    `elsewhere(name)`: True for the tensors another rank holds (expert parallelism): they are neither read
    nor reported as unknown; only their names, from the file headers, are looked at. `rows(name)`: the
    first-dimension slice of that tensor this rank holds (tensor parallelism), read alone (`get_slice`), or
    None for the whole tensor."""
    params = dict(model.named_parameters())
    report = LoadReport()
    files = checkpoint_files(path)
    handles = [_open(f) for f in files]
    where: dict[str, tuple[int, str]] = {}  # tensor name -> (file, key as stored)
    for i, handle in enumerate(handles):
        for key in handle.keys():
            name = key[len("model.") :] if key.startswith("model.") else key
            if name in where:
                raise ValueError(f"{path}: tensor {name!r} appears twice")
            where[name] = (i, key)

    def read(name: str) -> torch.Tensor:
        file_index, key = where[name]
        part = rows(name) if rows is not None else None
        try:
            tensor = handles[file_index].get_tensor(key) if part is None else handles[file_index].get_slice(key)[part]
        except SafetensorError as exc:
            raise ValueError(f"{files[file_index]}: cannot read {key!r} ({exc})") from exc
        report.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    consumed = set()
    for name, param in params.items():
        if name not in where:
            continue
        tensor, scale = read(name), None
        # only an FP8 tensor stored for a bf16/fp32 parameter has a companion scale; a `.scale` next to
        # anything else describes nothing here and is left to be reported as unknown
        if tensor.dtype == torch.float8_e4m3fn and param.dtype in (torch.bfloat16, torch.float32):
            scale_name = name[: -len(".weight")] + ".scale"
            if name.endswith(".weight") and scale_name in where and scale_name not in params:
                scale = read(scale_name)
                consumed.add(scale_name)
        tensor = _convert(name, tensor, param, scale, report)
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
        if elsewhere is not None and elsewhere(name):
            report.elsewhere += 1
        elif name.startswith(OPTIONAL_PART_PREFIXES):
            report.skipped.append(name)
        else:
            unknown.append(name)
    if unknown:
        shown = ", ".join(sorted(unknown)[:8]) + (f" ... ({len(unknown)} in all)" if len(unknown) > 8 else "")
        raise ValueError(f"{path}: checkpoint has tensors this config does not describe: {shown}")
    return report


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", verbose: bool = False) -> Transformer:
    """Build the model described by `path/config.json` and load its weight files into it.

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


RUN_FILE = "dsv41_train.json"  # written by the trainer into its checkpoint/: training step and model name


def checkpoint_run_info(folder: str) -> dict:
    """A trained checkpoint's `RUN_FILE` ({} for a folder without one, e.g. a release or an older run's)."""
    try:
        with open(os.path.join(folder, RUN_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
