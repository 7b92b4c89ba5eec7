"""Inference engine: paged FP4 KV, CED bounded-replay prefill, prefix caching, continuous batching."""

from dsv41.engine.config import EngineConfig
from dsv41.engine.llm_engine import LLMEngine
from dsv41.engine.types import RequestOutput, SamplingParams, TokenLogprob

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprob"]
