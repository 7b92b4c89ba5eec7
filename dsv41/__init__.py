"""dsv41: an open PyTorch implementation of DeepSeek-V4.1-Flash."""

from dsv41.config import ModelConfig, flash, preset, small, tiny
from dsv41.model.cache import ModelCache
from dsv41.model.transformer import Transformer
from dsv41.weights import load_model

__all__ = ["ModelConfig", "ModelCache", "Transformer", "flash", "load_model", "preset", "small", "tiny"]
__version__ = "0.1.0"
