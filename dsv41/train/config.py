"""Training configuration (a dataclass; every field is also a `dsv41 train --field-name` option)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


NS_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass
class TrainConfig:
    preset: str = "small"  # model shape; vocab and Engram compression come from the data's tokenizer
    data: Optional[str] = None  # a `dsv41 data` folder; None: a small corpus built on first use (see trainer)
    out: str = "runs/train"
    steps: int = 1000
    batch_size: int = 8  # sequences per micro-batch and rank
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 3e-3  # base learning rate of Muon, AdamW and the Sinkhorn optimizer (training.md §10)
    warmup: int = 100
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of lr
    grad_clip: float = 1.0
    use_muon: bool = True
    use_sink: bool = True
    ns_dtype: str = "bf16"  # Muon's Newton-Schulz matmuls: bf16 (as in the reference Muons; 2x faster on
    # AVX512-bf16 CPUs and GPUs, singular values within 0.5% of 1) or fp32
    qat: bool = True  # fake-quantise window KV, compressed KV and indexer q/k (straight-through)
    dense_attention: bool = False  # attend to every visible compressed entry (the dense-attention variant)
    replay_prob: float = 0.0  # probability per step of simulating bounded replay for the decoder
    kl_weight: float = 1.0  # indexer KL
    balance_weight: float = 1e-4  # sequence-wise balance loss (spec §7)
    bias_rate: float = 1e-3  # aux-loss-free bias update per step
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 200
    log_every: int = 1
    seed: int = 0
    threads: int = 0  # torch threads (0: leave as is)
    device: str = "auto"  # "auto" (CUDA when present, one GPU per process under torchrun), "cpu" or "cuda"

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches", "save_every",
                     "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.warmup < 0 or self.lr <= 0:
            raise ValueError("TrainConfig.warmup must be >= 0 and lr > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"TrainConfig.device must be auto, cpu or cuda, got {self.device!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"TrainConfig.ns_dtype must be one of {sorted(NS_DTYPES)}, got {self.ns_dtype!r}")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.replay_prob <= 1:
            raise ValueError("TrainConfig.min_lr_ratio and replay_prob must lie in [0, 1]")

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)
