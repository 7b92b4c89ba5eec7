"""Inference engine: paged FP4 KV, CED bounded-replay prefill, prefix caching, continuous batching."""

from dsv41.engine.async_engine import AsyncEngine, EngineBusy
from dsv41.engine.build import build_engine
from dsv41.engine.config import EngineConfig
from dsv41.engine.llm_engine import LLMEngine
from dsv41.engine.types import RequestOutput, SamplingParams, TokenLogprob

__all__ = [
    "AsyncEngine",
    "EngineBusy",
    "build_engine",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
