"""dsv41: an open PyTorch implementation of DeepSeek-V4.1-Flash."""

import os

# MKL's strict conditional numerical reproducibility, for the engine's batch invariance only (golden
# parity does not need it: reference numerics are canonical float64). Without it an fp32 GEMM with few
# rows splits its K reduction across threads when it is alone in a call but not inside a batched call, so
# a token's mHC mixes, router scores and head logits changed with what it was batched with (measured at 2
# threads: the mHC mix projection, K = 4 x 384, by one ulp). MKL reads the variable at its first call, so
# it must be set before any matmul runs. A value the user set is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from dsv41.config import ModelConfig, flash, preset, small, tiny
from dsv41.model.cache import ModelCache
from dsv41.model.transformer import Transformer
from dsv41.weights import load_model

__all__ = ["ModelConfig", "ModelCache", "Transformer", "flash", "load_model", "preset", "small", "tiny"]
__version__ = "0.1.0"
