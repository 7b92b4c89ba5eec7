"""Pre-training: `TrainConfig`, `Trainer` / `train` (see dsv41.train.trainer)."""

from dsv41.train.config import TrainConfig
from dsv41.train.trainer import Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
