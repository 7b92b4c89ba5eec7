"""Small engines and random prompts shared by the engine tests."""

import os

import torch

from dsv41.engine import EngineConfig, LLMEngine
from dsv41.tokenizer import ByteTokenizer


def make(model, **overrides) -> LLMEngine:
    """An engine over `model` with a small paged pool and 16-token prefill chunks, prefix caching off, under
    deterministic numerics: the engine tests compare outputs across batchings, chunkings, caches and
    speculation bit for bit, which is that mode's promise (the default `fast` mode is judged statistically:
    tests/eval/test_agreement.py). With DSV41_TEST_TILES set, a deterministic engine compiles its tiles
    (`compile_decode="now"`, dsv41.engine.tiles.CompiledTiles): tests/engine/test_deterministic_tiles.py
    reruns engine scenarios that way."""
    settings = dict(
        block_size=8,
        kv_pool_tokens=2048,
        prefill_chunk_size=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        numerics="deterministic",
    )
    settings.update(overrides)
    if os.environ.get("DSV41_TEST_TILES") and settings["numerics"] == "deterministic":
        settings.setdefault("compile_decode", "now")
    return LLMEngine(model, ByteTokenizer(model.cfg.vocab_size), EngineConfig(**settings))


def prompts(lengths, seed=0):
    """One random prompt (ids 3..999) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]
