"""Training configuration (a dataclass; every field is also a `dsv41 train --field-name` option)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

NS_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
BIAS_UPDATES = ("sign", "proportional", "lookahead")

# --balance: the defaults of the four routing options it covers. "recipe" is what docs/moe-balancing.md
# chose and measured at our scale; "release" is V4.1's own rule, kept as the flash preset's default so a
# release-scale run trains as published. --bias-rate is left out: both rules use 1e-3 (the look-ahead sets
# the text bias outright; the rate still moves the image-span bias).
BALANCE_RULES = {
    "recipe": {"embed_init_std": 1.0, "bias_update": "lookahead", "decorrelate_router": True, "capacity_factor": 1.5},
    "release": {"embed_init_std": 0.02, "bias_update": "sign", "decorrelate_router": False, "capacity_factor": 0.0},
}
RELEASE_PRESETS = ("flash",)  # presets whose --balance default is "release"


@dataclass
class TrainConfig:
    # Each field's metadata holds its `dsv41 train --field-name` help text and metavar (dsv41.cli).
    preset: str = field(
        default="small",
        metadata={
            "metavar": "NAME",
            "help": (
                "model shape to train from scratch; the vocabulary and Engram compression come from the data's "
                "tokenizer"
            ),
        },
    )
    data: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR",
            "help": (
                "a folder written by `dsv41 data` (train.bin, val.bin, meta.json, tokenizer) "
                "(default: a corpus of this Python's standard library, built once into ~/.cache/dsv41)"
            ),
        },
    )
    images: str | None = field(
        default=None,
        metadata={
            "choices": ("synthetic",),
            "help": (
                "train on image-text samples instead of --data: 'synthetic' renders shapes, colours, counts, "
                "seven-segment digits and two-image comparisons with their answers (dsv41.vision.synthetic), gives "
                "the preset a small ViT (4 layers, width 128) and logs held-out answer accuracy at each evaluation"
            ),
        },
    )
    mix: str | None = field(
        default=None,
        metadata={
            "choices": ("retrieval",),
            "help": (
                "a named training mix over --data: 'retrieval' renders long-context retrieval tasks on demand "
                "(dsv41.data.retrieval_tasks: passkey, RULER-style single/multi-key needles and variable tracking, "
                "MQAR associative recall over key-value lists) in the harness's prompt format, answer-only targets, "
                "grass-noise or text filler, values and keys split train/val by hash, lengths from --mix-min-len up "
                "to --seq-len; a --mix-text-fraction of the batches are ordinary text windows so the model still "
                "writes; logs held-out answer accuracy per task at each evaluation"
            ),
        },
    )
    mix_weights: str | None = field(
        default=None,
        metadata={
            "metavar": "TASK=W,...",
            "help": (
                "--mix retrieval: the training tasks' relative weights, e.g. 'mqar=0.6,passkey=0.2,niah=0.2' "
                "(tasks left out get 0; held-out batches keep the default mix so per-task losses stay comparable) "
                "(default: passkey=0.25,niah=0.25,vartrack=0.15,mqar=0.35)"
            ),
        },
    )
    mix_text_fraction: float = field(
        default=0.25,
        metadata={
            "metavar": "P",
            "help": ("--mix retrieval: probability per batch of an ordinary text batch instead of a retrieval one"),
        },
    )
    mix_min_len: int = field(
        default=128,
        metadata={
            "metavar": "TOKENS",
            "help": ("--mix retrieval: the shortest retrieval sample (raised to what the shortest task needs)"),
        },
    )
    curriculum_steps: int = field(
        default=0,
        metadata={
            "metavar": "STEPS",
            "help": (
                "--mix retrieval: the longest retrieval sample grows linearly from --mix-min-len to --seq-len over "
                "these steps (a curriculum over length); 0: every length from the start"
            ),
        },
    )
    dense_steps: int = field(
        default=0,
        metadata={
            "metavar": "STEPS",
            "help": (
                "the first STEPS steps attend to every visible compressed entry and train the indexer's KL over all "
                "of them (the dense warm-up of training.md §4, as --dense-attention), then the indexer's top-k"
            ),
        },
    )
    out: str = field(
        default="runs/train",
        metadata={
            "metavar": "DIR",
            "help": (
                "run folder: metrics.jsonl, loss.png, checkpoint/ (loadable by `dsv41 chat --model DIR/checkpoint`) and "
                "train_state/; a run whose train_state/ exists resumes from it"
            ),
        },
    )
    steps: int = field(default=1000, metadata={"metavar": "N", "help": "optimizer steps in the whole run"})
    batch_size: int = field(default=8, metadata={"metavar": "N", "help": "sequences per micro-batch and process"})
    seq_len: int = field(default=256, metadata={"metavar": "TOKENS", "help": "tokens per training sequence"})
    grad_accum: int = field(
        default=1,
        metadata={"metavar": "N", "help": ("micro-batches whose gradients are summed into one optimizer step")},
    )
    lr: float = field(
        default=3e-3,
        metadata={
            "metavar": "LR",
            "help": ("base learning rate (reached after warm-up) of Muon, AdamW and the Sinkhorn optimizer"),
        },
    )
    warmup: int | None = field(
        default=None,
        metadata={
            "metavar": "STEPS",
            "help": (
                "steps of linear learning-rate warm-up before the cosine decay (default: auto, a tenth of --steps "
                "capped at 100 and at least 1: min(100, max(1, steps // 10)))"
            ),
        },
    )
    min_lr_ratio: float = field(
        default=0.1,
        metadata={"metavar": "RATIO", "help": ("the cosine decay ends at this fraction of --lr at the last step")},
    )
    grad_clip: float = field(
        default=1.0, metadata={"metavar": "NORM", "help": ("clip the global gradient norm to this value")}
    )
    use_muon: bool = field(
        default=True, metadata={"help": ("Muon for the weight matrices; --no-use-muon trains them with AdamW")}
    )
    use_sink: bool = field(
        default=True,
        metadata={
            "help": (
                "the Sinkhorn-normalised momentum optimizer for embedding, head and Engram tables; "
                "--no-use-sink trains them with AdamW"
            )
        },
    )
    ns_dtype: str | None = field(
        default=None,
        metadata={
            "choices": tuple(NS_DTYPES),
            "help": (
                "precision of Muon's Newton-Schulz matmuls: bf16 (as in the reference; fast on GPUs and CPUs with "
                "AVX512-bf16/AMX) or fp32 (default: bf16 on CUDA, fp32 on CPU, where a bf16 matmul without those "
                "instructions runs ~17x slower than fp32: 0.10 s vs 0.006 s per 128x128 Newton-Schulz measured here)"
            ),
        },
    )
    # bf16 keeps the orthogonalised update's singular values within 0.5% of 1
    qat: bool = field(
        default=True,
        metadata={
            "help": (
                "quantisation-aware training: fake-quantise the window KV, compressed KV and indexer queries/keys "
                "as the inference cache stores them (straight-through gradients)"
            )
        },
    )
    dense_attention: bool = field(
        default=False,
        metadata={
            "help": ("attend to every visible compressed entry instead of the indexer's selection (the dense variant)")
        },
    )
    swa_only: bool = field(
        default=False,
        metadata={
            "help": (
                "baseline: every layer sliding-window only (compress ratio 0, no indexer, no compressed cache), so a "
                "query sees only the preset's window_size tokens; the checkpoint serves as such"
            )
        },
    )
    replay_prob: float = field(
        default=0.0,
        metadata={
            "metavar": "P",
            "help": ("probability per step of simulating the engine's bounded-replay prefill for the decoder layers"),
        },
    )
    kl_weight: float = field(
        default=1.0,
        metadata={
            "metavar": "W",
            "help": ("weight of the indexer's KL loss, which trains the indexer's scores towards the attention's"),
        },
    )
    balance: str | None = field(
        default=None,
        metadata={
            "choices": tuple(BALANCE_RULES),
            "help": (
                "the MoE routers' balancing, the default of --embed-init-std, --bias-update, --decorrelate-router and "
                "--capacity-factor (each of which, given, wins): 'recipe' (embedding std 1.0, look-ahead bias, "
                "decorrelated routers, capacity 1.5) keeps every expert's load near the mean at the scale trained "
                "here, where the release's rule collapses the routing within ten steps (docs/moe-balancing.md); "
                "'release' (embedding std 0.02, sign bias at --bias-rate, no decorrelation, no capacity bound) is "
                "V4.1's published rule, made for million-token batches and a 2,000-step warm-up (default: 'release' "
                "for the flash preset, 'recipe' for every other)"
            ),
        },
    )
    balance_weight: float = field(
        default=1e-4, metadata={"metavar": "W", "help": ("weight of the sequence-wise MoE balance loss")}
    )
    bias_rate: float = field(
        default=1e-3,
        metadata={
            "metavar": "RATE",
            "help": ("per-step size of the aux-loss-free update of the routers' selection bias"),
        },
    )
    bias_update: str | None = field(
        default=None,
        metadata={
            "choices": BIAS_UPDATES,
            "help": (
                "how the routers' selection bias follows the expert loads: 'sign' adds --bias-rate * sign(mean - "
                "load) after each step (the release's rule); 'proportional' adds --bias-rate * (mean - load) / mean; "
                "'lookahead' routes a probe batch with the weights the step will use and sets the text bias to the "
                "one that balances it (see dsv41.train.balance) (default: from --balance: lookahead under 'recipe', "
                "sign under 'release')"
            ),
        },
    )
    probe_sequences: int | None = field(
        default=None,
        metadata={
            "metavar": "N",
            "help": (
                "sequences (per process) of the look-ahead probe batch (default: --batch-size). A larger probe fits "
                "a bias that transfers better to the step's own batch, at the cost of a longer no-grad forward"
            ),
        },
    )
    capacity_factor: float | None = field(
        default=None,
        metadata={
            "metavar": "F",
            "help": (
                "bound every expert's tokens in a training step to F x the mean load (per router call: "
                "ceil(F x tokens x top-k / experts)); a token over the bound goes to its next choice. 0 (the "
                "release's way) routes freely. Training only: inference always routes freely (default: from "
                "--balance: 1.5 under 'recipe', 0 under 'release')"
            ),
        },
    )
    embed_init_std: float | None = field(
        default=None,
        metadata={
            "metavar": "STD",
            "help": (
                "standard deviation of the token embedding's initial values (the other matrices start at 0.02). "
                "At 0.02 the blocks' outputs (window averages) soon outweigh the token in the residual stream and "
                "the MoE routers see one shared vector; 1.0 keeps the router inputs token-specific (default: from "
                "--balance: 1.0 under 'recipe', 0.02 under 'release')"
            ),
        },
    )
    shared_input_weight: float = field(
        default=0.0,
        metadata={
            "metavar": "W",
            "help": (
                "weight of a loss on every MoE router input's component shared by the tokens of a sequence "
                "(its fraction of the input's energy), which otherwise grows until all tokens pick the same experts"
            ),
        },
    )
    decorrelate_router: bool | None = field(
        default=None,
        metadata={
            "help": (
                "remove from every router matrix its response to the mean router input (of the probe batch under "
                "'lookahead', else of the step), so a component shared by all tokens cannot rank the experts alike "
                "for all of them (default: from --balance: on under 'recipe', off under 'release')"
            )
        },
    )
    eval_every: int = field(
        default=100,
        metadata={"metavar": "STEPS", "help": ("compute the validation loss every this many steps (and at the last)")},
    )
    eval_batches: int = field(default=8, metadata={"metavar": "N", "help": ("validation batches per evaluation")})
    save_every: int = field(
        default=200,
        metadata={
            "metavar": "STEPS",
            "help": ("write checkpoint/ and train_state/ every this many steps (and at the last)"),
        },
    )
    log_every: int = field(
        default=1,
        metadata={
            "metavar": "STEPS",
            "help": ("append a line to metrics.jsonl every this many steps (and at every evaluation)"),
        },
    )
    seed: int = field(
        default=0, metadata={"metavar": "N", "help": ("seed of the initial weights and of the batch order")}
    )
    threads: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": (
                "torch CPU threads per process; 0 leaves torch's default (all cores). Under CPU contention fewer "
                "threads are often much faster"
            ),
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "choices": ("auto", "cpu", "cuda"),
            "help": ("'auto': CUDA when present (one GPU per process under torchrun), else CPU"),
        },
    )
    allow_config_change: bool = field(
        default=False, metadata={"help": ("resume even if flags that change the run differ from the saved run's")}
    )

    @property
    def balance_rule(self) -> str:
        """--balance as given, else the preset's: the release's rule for the release preset, the recipe for
        the presets small enough to train here (with the release's rule they collapse: moe-balancing.md)."""
        if self.balance is not None:
            return self.balance
        return "release" if self.preset in RELEASE_PRESETS else "recipe"

    def resolved(self) -> TrainConfig:
        """A copy with --balance and every option it covers filled in (options given explicitly keep their
        value). The trainer runs and saves this copy, so a resume compares concrete values: a run saved
        under one rule refuses to continue under the other."""
        if self.balance not in (None, *BALANCE_RULES):
            raise ValueError(
                f"TrainConfig.balance must be one of {sorted(BALANCE_RULES)} or None, got {self.balance!r}"
            )
        rule = self.balance_rule
        filled = {name: value for name, value in BALANCE_RULES[rule].items() if getattr(self, name) is None}
        if self.ns_dtype is None:
            filled["ns_dtype"] = "bf16" if self._on_cuda() else "fp32"
        return dataclasses.replace(self, balance=rule, **filled)

    def _on_cuda(self) -> bool:
        if self.device == "cuda":
            return True
        if self.device != "auto":
            return False
        import torch

        return torch.cuda.is_available()

    def validate(self) -> None:
        self = self.resolved()  # the balancing options as the trainer will use them
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "eval_every",
            "eval_batches",
            "save_every",
            "log_every",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)}")
        if (self.warmup is not None and self.warmup < 0) or self.lr <= 0:
            raise ValueError("TrainConfig.warmup must be >= 0 and lr > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"TrainConfig.device must be auto, cpu or cuda, got {self.device!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"TrainConfig.ns_dtype must be one of {sorted(NS_DTYPES)}, got {self.ns_dtype!r}")
        if self.bias_update not in BIAS_UPDATES:
            raise ValueError(
                f"TrainConfig.bias_update must be sign, proportional or lookahead, got {self.bias_update!r}"
            )
        if self.capacity_factor != 0 and self.capacity_factor < 1:
            raise ValueError(f"TrainConfig.capacity_factor must be 0 (off) or >= 1, got {self.capacity_factor}")
        if self.probe_sequences is not None and self.probe_sequences <= 0:
            raise ValueError(f"TrainConfig.probe_sequences must be > 0, got {self.probe_sequences}")
        if self.embed_init_std <= 0 or self.shared_input_weight < 0 or self.balance_weight < 0 or self.bias_rate < 0:
            raise ValueError(
                "TrainConfig.embed_init_std must be > 0; shared_input_weight, balance_weight and bias_rate must be >= 0"
            )
        if self.images not in (None, "synthetic"):
            raise ValueError(f"TrainConfig.images must be None or 'synthetic', got {self.images!r}")
        if self.mix not in (None, "retrieval"):
            raise ValueError(f"TrainConfig.mix must be None or 'retrieval', got {self.mix!r}")
        if self.mix and self.images:
            raise ValueError("--mix retrieval is a text mix; it does not combine with --images")
        if self.mix_weights is not None:
            parse_mix_weights(self.mix_weights)
        if not 0 <= self.mix_text_fraction < 1 or self.mix_min_len <= 0:
            raise ValueError("TrainConfig.mix_text_fraction must lie in [0, 1) and mix_min_len be > 0")
        if self.curriculum_steps < 0 or self.dense_steps < 0:
            raise ValueError("TrainConfig.curriculum_steps and dense_steps must be >= 0")
        if self.images and self.data:
            raise ValueError("give --data (text) or --images (image-text), not both")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.replay_prob <= 1:
            raise ValueError("TrainConfig.min_lr_ratio and replay_prob must lie in [0, 1]")

    @property
    def warmup_steps(self) -> int:
        """The warm-up in steps: --warmup, else a tenth of the run capped at 100 (a fixed 100 would keep a
        30-step smoke run below the peak learning rate to its end)."""
        return self.warmup if self.warmup is not None else _auto_warmup(self.steps)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def parse_mix_weights(text: str) -> dict[str, float]:
    """'mqar=0.6,passkey=0.4' -> {"mqar": 0.6, "passkey": 0.4}; a clear ValueError on anything else."""
    from dsv41.data.retrieval_tasks import TASKS

    weights: dict[str, float] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        try:
            weight = float(value) if eq else -1.0
        except ValueError:
            weight = -1.0
        if name not in TASKS or weight < 0 or name in weights:
            raise ValueError(
                f"TrainConfig.mix_weights: expected TASK=W,... with each TASK once among "
                f"{', '.join(TASKS)} and W >= 0, got {text!r}"
            )
        weights[name] = weight
    if sum(weights.values()) <= 0:
        raise ValueError(f"TrainConfig.mix_weights: the weights must not all be 0, got {text!r}")
    return weights


def _auto_warmup(steps: int) -> int:
    return min(100, max(1, steps // 10))


# Fields a resume may change freely: they say where the run writes, how often it logs, evaluates and
# saves, and on what it computes, not what it trains. Every other field, including ones added later,
# counts as changing the run (a new field is unsafe until someone decides otherwise).
RESUME_SAFE_FIELDS = (
    "out",
    "eval_every",
    "eval_batches",
    "save_every",
    "log_every",
    "threads",
    "device",
    "allow_config_change",
)


def run_changes(saved: dict, now: dict, saved_world: int = 1, world: int = 1) -> list[str]:
    """The "name: old -> new" of every run-changing field set differently in the saved run's config and
    in this one. Only fields present in both are compared (a field this version lacks or the saved run
    predates says nothing). `batch_size` is per process, so with another process count the global batch
    is compared; the warm-up is compared as resolved, so an explicit --warmup equal to the automatic one
    is no change."""
    changes = []
    for name in saved:
        if name in RESUME_SAFE_FIELDS or name not in now:
            continue
        old, new = saved[name], now[name]
        if name == "batch_size" and saved_world != world:
            if old * saved_world != new * world:
                changes.append(f"batch_size x processes: {old} x {saved_world} -> {new} x {world}")
            continue
        if name == "warmup" and "steps" in saved and "steps" in now:
            old_steps = saved["warmup"] if saved["warmup"] is not None else _auto_warmup(saved["steps"])
            new_steps = now["warmup"] if now["warmup"] is not None else _auto_warmup(now["steps"])
            if old_steps != new_steps:
                changes.append(f"warmup: {_shown(old, old_steps)} -> {_shown(new, new_steps)}")
            continue
        if old != new:
            changes.append(f"{name}: {old} -> {new}")
    return changes


def _shown(warmup: int | None, steps: int) -> str:
    return str(steps) if warmup is not None else f"auto ({steps})"
