"""Checkpoints shipped inside the package, and how one is made compact enough to ship.

`shakespeare-chat/` is the model `dsv41 chat`, `dsv41 generate` and `dsv41 serve` run when they are given
no model and no preset: the `nano` preset (8.4M parameters, every block type of the released schedule)
trained by `dsv41 train` on Shakespeare's plays rendered as conversations in the V4.1 chat format
(`dsv41 data --format chat`). `benchmarks/make_default_checkpoint.sh` makes it; docs/text-model.md has
the run. It is an ordinary release-layout folder (`config.json`, `model.safetensors`, the tokenizer
files), loaded by `dsv41.load_model` like any other.

`pack_checkpoint` writes a trained checkpoint folder with its weight matrices stored as FP8 (e4m3) with
one UE8M0 scale per 32x32 tile, the release's own FP8 layout, which `dsv41.weights.load_weights`
dequantises on load to the dtype the config gives (bf16, or fp32 for the head): one byte a weight
instead of two or four. The config is unchanged, so the loaded model runs in bf16 as trained; only the
stored values are rounded.

    python -m dsv41.checkpoints RUN/checkpoint dsv41/checkpoints/shakespeare-chat
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

DEFAULT_CHECKPOINT = "shakespeare-chat"
# the files a packed folder keeps (the trainer's run record is kept for the served model name)
KEEP_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "dsv41_train.json",
)
FP8_MIN_EDGE = 32  # matrices with a side under one tile (the routers' gates) stay as they are


def checkpoint_path(name: str = DEFAULT_CHECKPOINT) -> str:
    """The folder of a checkpoint shipped in this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


def default_checkpoint() -> str | None:
    """The shipped default checkpoint's folder, or None when this install lacks its weights."""
    path = checkpoint_path()
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None


def pack_state(state: dict[str, torch.Tensor], param_names: set[str]) -> dict[str, torch.Tensor]:
    """Weights of a release-layout state with every float matrix named `*.weight` (both sides >= 32)
    stored as FP8 + tile scales `*.scale`; other float32 matrices (the hyper-connection mixes) as bf16,
    which the loader widens back; everything else as it is. A weight whose `.scale` name is itself a
    parameter (the Engram tables, already FP8 rows) is left alone."""
    from dsv41.ops.quant import quantize_fp8_weight

    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        scale_name = name[: -len(".weight")] + ".scale"
        if (
            name.endswith(".weight")
            and tensor.dtype in (torch.bfloat16, torch.float32)
            and tensor.dim() == 2
            and min(tensor.shape) >= FP8_MIN_EDGE
            and scale_name not in param_names
        ):
            codes, scale = quantize_fp8_weight(tensor)
            out[name] = codes.to(torch.float8_e4m3fn).contiguous()
            out[scale_name] = scale.contiguous()
        elif tensor.dtype == torch.float32 and tensor.dim() == 2:
            out[name] = tensor.to(torch.bfloat16).contiguous()
        else:
            out[name] = tensor
    return out


def pack_checkpoint(src: str, dst: str, generation: dict | None = None) -> dict:
    """Write `src` (a release-layout checkpoint folder, e.g. a `dsv41 train` run's checkpoint/) into `dst`
    with its weights packed (`pack_state`); returns {"bytes": size of dst, "files": {name: bytes}}.
    `generation` (e.g. {"temperature": 0.7, "top_p": 0.9}) is written as `generation_config.json`, the
    sampling defaults `dsv41 chat` and `generate` (and Hugging Face `generate`) then use."""
    from safetensors.torch import load_file, save_file

    from dsv41.config import ModelConfig
    from dsv41.model.transformer import Transformer

    cfg = ModelConfig.from_file(src)
    with torch.device("meta"):
        names = {n for n, _ in Transformer(cfg).named_parameters()}
    state = pack_state(load_file(os.path.join(src, "model.safetensors")), names)
    tmp = dst.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for name in KEEP_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
    if generation:
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"do_sample": True, **generation}, f, indent=2)
            f.write("\n")
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    files = {name: os.path.getsize(os.path.join(dst, name)) for name in sorted(os.listdir(dst))}
    return {"bytes": sum(files.values()), "files": files}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41.checkpoints", description=pack_checkpoint.__doc__)
    p.add_argument("src", help="a release-layout checkpoint folder (config.json + model.safetensors)")
    p.add_argument("dst", help="the packed folder to write (replaced if it exists)")
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature for generation_config.json")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling P for generation_config.json")
    p.add_argument(
        "--data",
        metavar="DIR",
        help="a `dsv41 data` folder: also score both folders on its validation split as served, "
        "the cost of the FP8 storage",
    )
    p.add_argument("--seq-len", type=int, default=512, metavar="N", help="--data: tokens per window (default: 512)")
    p.add_argument("--batches", type=int, default=8, metavar="N", help="--data: batches of 8 windows (default: 8)")
    a = p.parse_args(argv)
    generation = {k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p)) if v is not None}
    result = pack_checkpoint(a.src, a.dst, generation or None)
    if a.data:
        from dsv41.train.compare import served_val_loss

        for key, folder in (("trained", a.src), ("packed", a.dst)):
            result[f"served_val_loss_{key}"] = served_val_loss(folder, a.data, a.seq_len, 8, a.batches)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
