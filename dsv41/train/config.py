"""Training configuration (a dataclass; every field is also a `dsv41 train --field-name` option)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


NS_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass
class TrainConfig:
    # Each field's metadata holds its `dsv41 train --field-name` help text and metavar (dsv41.cli).
    preset: str = field(default="small", metadata={"metavar": "NAME", "help": (
        "model shape to train from scratch; the vocabulary and Engram compression come from the data's "
        "tokenizer")})
    data: Optional[str] = field(default=None, metadata={"metavar": "DIR", "help": (
        "a folder written by `dsv41 data` (train.bin, val.bin, meta.json, tokenizer) "
        "(default: a corpus of this Python's standard library, built once into ~/.cache/dsv41)")})
    out: str = field(default="runs/train", metadata={"metavar": "DIR", "help": (
        "run folder: metrics.jsonl, loss.png, checkpoint/ (loadable by `dsv41 chat --model DIR/checkpoint`) and "
        "train_state/; a run whose train_state/ exists resumes from it")})
    steps: int = field(default=1000, metadata={"metavar": "N", "help": "optimizer steps in the whole run"})
    batch_size: int = field(default=8, metadata={"metavar": "N", "help": "sequences per micro-batch and process"})
    seq_len: int = field(default=256, metadata={"metavar": "TOKENS", "help": "tokens per training sequence"})
    grad_accum: int = field(default=1, metadata={"metavar": "N", "help": (
        "micro-batches whose gradients are summed into one optimizer step")})
    lr: float = field(default=3e-3, metadata={"metavar": "LR", "help": (
        "base learning rate (reached after warm-up) of Muon, AdamW and the Sinkhorn optimizer")})
    warmup: int = field(default=100, metadata={"metavar": "STEPS", "help": (
        "steps of linear learning-rate warm-up before the cosine decay")})
    min_lr_ratio: float = field(default=0.1, metadata={"metavar": "RATIO", "help": (
        "the cosine decay ends at this fraction of --lr at the last step")})
    grad_clip: float = field(default=1.0, metadata={"metavar": "NORM", "help": (
        "clip the global gradient norm to this value")})
    use_muon: bool = field(default=True, metadata={"help": (
        "Muon for the weight matrices; --no-use-muon trains them with AdamW")})
    use_sink: bool = field(default=True, metadata={"help": (
        "the Sinkhorn-normalised momentum optimizer for embedding, head and Engram tables; "
        "--no-use-sink trains them with AdamW")})
    ns_dtype: str = field(default="bf16", metadata={"choices": tuple(NS_DTYPES), "help": (
        "precision of Muon's Newton-Schulz matmuls: bf16 (as in the reference; about 2x faster on CPUs "
        "with AVX512-bf16 and on GPUs) or fp32")})
    # bf16 keeps the orthogonalised update's singular values within 0.5% of 1
    qat: bool = field(default=True, metadata={"help": (
        "quantisation-aware training: fake-quantise the window KV, compressed KV and indexer queries/keys "
        "as the inference cache stores them (straight-through gradients)")})
    dense_attention: bool = field(default=False, metadata={"help": (
        "attend to every visible compressed entry instead of the indexer's selection (the dense variant)")})
    replay_prob: float = field(default=0.0, metadata={"metavar": "P", "help": (
        "probability per step of simulating the engine's bounded-replay prefill for the decoder layers")})
    kl_weight: float = field(default=1.0, metadata={"metavar": "W", "help": (
        "weight of the indexer's KL loss, which trains the indexer's scores towards the attention's")})
    balance_weight: float = field(default=1e-4, metadata={"metavar": "W", "help": (
        "weight of the sequence-wise MoE balance loss")})
    bias_rate: float = field(default=1e-3, metadata={"metavar": "RATE", "help": (
        "per-step size of the aux-loss-free update of the routers' selection bias")})
    eval_every: int = field(default=100, metadata={"metavar": "STEPS", "help": (
        "compute the validation loss every this many steps (and at the last)")})
    eval_batches: int = field(default=8, metadata={"metavar": "N", "help": (
        "validation batches per evaluation")})
    save_every: int = field(default=200, metadata={"metavar": "STEPS", "help": (
        "write checkpoint/ and train_state/ every this many steps (and at the last)")})
    log_every: int = field(default=1, metadata={"metavar": "STEPS", "help": (
        "append a line to metrics.jsonl every this many steps (and at every evaluation)")})
    seed: int = field(default=0, metadata={"metavar": "N", "help": (
        "seed of the initial weights and of the batch order")})
    threads: int = field(default=0, metadata={"metavar": "N", "help": (
        "torch CPU threads per process; 0 leaves torch's default (all cores). Under CPU contention fewer "
        "threads are often much faster")})
    device: str = field(default="auto", metadata={"choices": ("auto", "cpu", "cuda"), "help": (
        "'auto': CUDA when present (one GPU per process under torchrun), else CPU")})

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
