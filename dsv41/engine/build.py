"""Build an engine from a preset name (random weights) or a checkpoint folder."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from dsv41.config import PRESETS, preset
from dsv41.engine.config import EngineConfig
from dsv41.engine.llm_engine import LLMEngine
from dsv41.engram_map import build_engram_token_map
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.tokenizer import ByteTokenizer, load_tokenizer


def build_engine(
    model: str, engine_config: EngineConfig | None = None, seed: int = 0, device: str | torch.device = "cpu"
) -> LLMEngine:
    """`model`: a preset name (tiny, small, ...: random weights drawn from `seed`) or a checkpoint folder.

    The tokenizer is the folder's own, else the DeepSeek tokenizer for the full 129,280-id vocabulary,
    else a byte tokenizer. With a real tokenizer the Engram token map is derived from it (spec §5).
    """
    net, tokenizer, name = build_model(model, seed, device)
    # the engine owns this model: in training mode every step would switch it to eval and back
    # (Transformer.numerics; ~7 ms per step at `tiny`, a fifth of its decode step)
    net.eval()
    return LLMEngine(net, tokenizer, engine_config, model_name=name, seed=seed)


def build_model(
    model: str, seed: int = 0, device: str | torch.device = "cpu", load: Callable[[str], Transformer] | None = None
) -> tuple[Transformer, object, str]:
    """(model, tokenizer, served name) for a preset name or a checkpoint folder, as `build_engine` uses them.
    `load(folder)`: how a checkpoint folder's weights are read (default `dsv41.weights.load_model`; an
    expert-parallel rank reads only its share, dsv41.distributed.sharded_load)."""
    if model in PRESETS:
        cfg = preset(model)
        with torch.device(device):
            net = Transformer(cfg)
        init_random_weights(net, seed=seed)
        tokenizer = load_tokenizer(None, cfg.vocab_size)
        name = f"dsv41-{model}"
    elif os.path.isdir(model):
        from dsv41.weights import checkpoint_run_info, load_model

        net = load_model(model, device) if load is None else load(model).to(device)
        cfg = net.cfg
        tokenizer = load_tokenizer(model, cfg.vocab_size)
        # a trained checkpoint records its run's name: its folder is always called "checkpoint"
        name = checkpoint_run_info(model).get("name") or os.path.basename(os.path.normpath(model))
    else:
        raise ValueError(f"{model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a model folder")
    if net.engram_hash is not None and not isinstance(tokenizer, ByteTokenizer):
        token_map, size = build_engram_token_map(tokenizer)
        if size == cfg.engram_compressed_vocab_size and token_map.numel() == cfg.vocab_size:
            net.set_engram_token_map(token_map)
    return net, tokenizer, name
