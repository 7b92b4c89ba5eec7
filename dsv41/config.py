"""Model configuration for DeepSeek-V4.1-Flash (spec-v41.md §1, §2).

`ModelConfig` uses the inference `config.json` field names (the reference `ModelArgs`, spec §1.4).
`ModelConfig.from_file` also reads the Hugging Face `config.json` (top level + `text_config` +
`vision_config`, spec §1.1-§1.3) through `HF_RENAMES`.

Derived facts about the layer schedule (which layer owns a compressor, which layer's cache and top-k a
layer reads, spec §2 and §3.2) are computed here once, so the model code never re-derives them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# CSA2 keeps only ratio 1 and ratio 2 compression (V4's HCA ratio 128 and ratio 4 are gone, spec §3.1);
# 0 means a sliding-window-only layer.
KNOWN_COMPRESS_RATIOS = (0, 1, 2)
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
WEIGHT_DTYPES = ("bf16", "fp8")
EXPERT_DTYPES = (None, "fp4")

# Fields a checkpoint's config.json may leave out. The reference fixes `gate_temp` and `norm_topk_prob`
# in code (the released inference config.json has neither, spec §1.4); the token ids and the context
# length belong to the tokenizer and the server and do not change the network. Every other field
# changes the model, so a config that lacks one is refused rather than completed with the Flash value.
OPTIONAL_FIELDS = (
    "gate_temp",
    "norm_topk_prob",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
)
# Fields that describe an optional part of the model, keyed by the field saying whether the part exists:
# they are required only when it does (a text-only model need not describe a vision tower).
PART_FIELDS = MappingProxyType(
    {
        "vision_n_layers": (
            "vision_dim",
            "vision_n_heads",
            "vision_inter_dim",
            "vision_patch_size",
            "vision_rope_theta",
            "vision_downsample_ratio",
            "vision_max_n_token",
            "vision_min_pixels",
            "vision_max_wh_ratio",
            "image_token_id",
        ),
        "n_mtp_layers": (
            "dspark_block_size",
            "dspark_noise_token_id",
            "dspark_target_layer_ids",
            "dspark_markov_rank",
            "dspark_n_routed_experts",
            "dspark_n_activated_experts",
        ),
        "engram_layer_ids": (
            "engram_num_embeddings",
            "engram_max_ngram_size",
            "engram_vocab_size",
            "engram_n_heads",
            "engram_head_dim",
            "engram_pad_id",
            "engram_compressed_vocab_size",
        ),
    }
)
# What a checkpoint's config.json says about itself for Hugging Face transformers (the release's own names,
# spec §1.1): AutoConfig picks the config class by `model_type` (dsv41.hf registers it). `to_json` writes
# them and `from_dict` skips them, so folders written before they were added still load.
HF_MODEL_TYPE = "deepseek_v41"
HF_ARCHITECTURE = "DeepseekV41ForCausalLM"
CHECKPOINT_METADATA_KEYS = ("model_type", "architectures", "transformers_version")
# What an absent DSpark drafter's fields mean: no drafter (the Flash target layers 37-39 would not even
# be valid layer ids of a smaller model).
DSPARK_OFF = MappingProxyType(
    {
        "dspark_block_size": 0,
        "dspark_noise_token_id": 0,
        "dspark_target_layer_ids": (),
        "dspark_n_routed_experts": 0,
        "dspark_n_activated_experts": 0,
    }
)


@dataclass
class ModelConfig:
    """Architecture of a DeepSeek-V4.1 model. Defaults are the released Flash model (spec §1)."""

    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    # MoE (spec §7)
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention (spec §3)
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    # RoPE: plain theta on ratio-0 layers, YaRN on `compress_rope_theta` elsewhere (spec §3)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # indexer and hierarchical candidate pool (spec §4)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # hyper-connections (spec §6)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram (spec §5)
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # weight storage (spec §1.1, §7)
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    # vision (spec §1.3, §12b); vision_n_layers == 0 disables it
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: float | None = None
    image_token_id: int = 129264
    # DSpark drafter stored under mtp.* (spec §12b)
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # special tokens and context (HF top level, spec §1.1, §11)
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    max_position_embeddings: int = 1048576

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                setattr(self, f.name, tuple(value))
        self.validate()

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ValueError naming the offending field when the config cannot describe a model."""

        def fail(name: str, why: str) -> None:
            raise ValueError(f"ModelConfig.{name}: {why} (got {getattr(self, name)!r})")

        for name in (
            "vocab_size",
            "dim",
            "moe_inter_dim",
            "n_layers",
            "n_heads",
            "q_lora_rank",
            "head_dim",
            "o_groups",
            "o_lora_rank",
            "window_size",
            "hc_mult",
            "hc_sinkhorn_iters",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                fail(name, "must be a positive integer")
        if self.n_mtp_layers < 0:
            fail("n_mtp_layers", "must be >= 0")
        if self.rope_head_dim <= 0 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            fail("rope_head_dim", "must be even, positive and at most head_dim")
        if self.head_dim % 32:
            fail("head_dim", "must be a multiple of 32 (fp8 window-KV blocks)")
        if self.n_heads % self.o_groups:
            fail("o_groups", "must divide n_heads")
        if self.score_func not in SCORE_FUNCS:
            fail("score_func", f"must be one of {SCORE_FUNCS}")
        if self.dtype not in WEIGHT_DTYPES:
            fail("dtype", f"must be one of {WEIGHT_DTYPES}")
        if self.expert_dtype not in EXPERT_DTYPES:
            fail("expert_dtype", f"must be one of {EXPERT_DTYPES}")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            fail("n_activated_experts", "must be in 1..n_routed_experts")
        if self.n_shared_experts != 1:
            fail("n_shared_experts", "V4.1 has exactly one shared expert")

        # Float hyper-parameters: NaN/inf are never meaningful (JSON readers accept `NaN`), and a value out
        # of range does not crash but silently computes another model (or NaN logits). Each range is
        # what the op using the field needs: (name, lowest, lowest allowed?, below, why).
        for name, low, low_ok, high, why in (
            ("gate_temp", 0.0, False, math.inf, "it divides the router logits"),
            ("route_scale", 0.0, False, math.inf, "it scales the routing weights"),
            # ops.clamped_swiglu: 0 means "no clamp"; a negative limit would silently mean the same
            ("swiglu_limit", 0.0, True, math.inf, "0 disables the clamp"),
            # RMSNorm adds it under rsqrt: 0 turns an all-zero row into NaN, >= 1 is no longer an epsilon
            ("norm_eps", 0.0, False, 1.0, "an epsilon under rsqrt"),
            # Sinkhorn adds it to probabilities and their sums (which are > 0 already, so 0 is fine)
            ("hc_eps", 0.0, True, 1.0, "an epsilon added to probabilities"),
            # frequencies are base^(-2i/d): a base <= 1 makes them grow (or, for YaRN, divides by log 1)
            ("rope_theta", 1.0, False, math.inf, "a RoPE base"),
            ("compress_rope_theta", 1.0, False, math.inf, "a RoPE base"),
            ("vision_rope_theta", 1.0, False, math.inf, "a RoPE base"),
            # YaRN divides the long-wavelength frequencies by it: < 1 would shrink the context instead
            ("rope_factor", 1.0, True, math.inf, "the YaRN context extension factor"),
        ):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (number and (value >= low if low_ok else value > low) and value < high):
                bounds = f"{'[' if low_ok else '('}{low:g}, {high:g})"
                fail(name, f"must be a finite number in {bounds}: {why}")
        ratio = self.vision_max_wh_ratio
        if ratio is not None and not (
            isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio) and ratio >= 1
        ):
            fail("vision_max_wh_ratio", "must be null (no limit) or a finite aspect ratio >= 1 (long / short side)")

        n_all = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_all:
            fail("compress_ratios", f"needs one entry per layer, n_layers + n_mtp_layers = {n_all}")
        for i, r in enumerate(self.compress_ratios):
            if r not in KNOWN_COMPRESS_RATIOS:
                fail("compress_ratios", f"entry {i} is an unknown ratio {r}; CSA2 knows {KNOWN_COMPRESS_RATIOS}")
        for i in range(self.n_layers, n_all):
            if self.compress_ratios[i] != 0:
                fail("compress_ratios", f"DSpark layer {i} must be sliding-window only (ratio 0)")

        for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)):
                fail(name, "must be sorted and unique")
            for i in ids:
                if not 0 <= i < self.n_layers:
                    fail(name, f"layer {i} is out of range 0..{self.n_layers - 1}")
        for name in ("kv_source_layers", "index_source_layers"):
            for i in getattr(self, name):
                if self.compress_ratios[i] == 0:
                    fail(name, f"layer {i} has compress ratio 0 and cannot be a source")
        for layer in range(self.n_layers):
            ratio = self.compress_ratios[layer]
            if ratio == 0:
                continue
            kv_src = self._latest(self.kv_source_layers, layer)
            if kv_src is None or self.compress_ratios[kv_src] != ratio:
                fail("kv_source_layers", f"layer {layer} (ratio {ratio}) has no earlier kv source of the same ratio")
            idx_src = self._latest(self.index_source_layers, layer)
            if idx_src is None or self.compress_ratios[idx_src] != ratio:
                fail(
                    "index_source_layers",
                    f"layer {layer} (ratio {ratio}) has no earlier index source of the same ratio",
                )

        if any(self.compress_ratios):
            if self.index_topk <= 0:
                fail("index_topk", "must be > 0")
            if self.index_n_heads <= 0:
                fail("index_n_heads", "must be > 0")
            if self.index_head_dim <= 0 or self.index_head_dim % 32 or self.index_head_dim < self.rope_head_dim:
                fail("index_head_dim", "must be a positive multiple of 32 and at least rope_head_dim")
            if self.original_seq_len < 0:
                fail("original_seq_len", "must be >= 0 (0 disables YaRN)")
        if self.candidate_source_layer >= 0:
            if self.candidate_source_layer not in self.index_source_layers:
                fail("candidate_source_layer", "must be an index source layer (or -1 to disable)")
            if self.candidate_topk_blocks <= 0:
                fail("candidate_topk_blocks", "must be > 0 when a candidate source is set")
            if self.candidate_block_size <= 0:
                fail("candidate_block_size", "must be > 0 when a candidate source is set")
        elif self.candidate_source_layer != -1:
            fail("candidate_source_layer", "must be a layer id or -1")

        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                fail("engram_num_embeddings", "needs one entry per engram_layer_ids entry")
            if self.engram_max_ngram_size < 2:
                fail("engram_max_ngram_size", "must be >= 2 (2-grams and up)")
            for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
                if getattr(self, name) <= 0:
                    fail(name, "must be > 0 when Engram layers are set")
            if self.engram_head_dim % 32:
                fail("engram_head_dim", "must be a multiple of 32 (fp8 table scales)")
            if not 0 <= self.engram_pad_id < self.vocab_size:
                fail("engram_pad_id", "must be a token id")
        if self.dspark_block_size and self.n_mtp_layers and not self.dspark_target_layer_ids:
            fail("dspark_target_layer_ids", "DSpark needs target layers")

    # ----------------------------------------------------------------- derived schedule
    @staticmethod
    def _latest(sources: tuple[int, ...], layer: int) -> int | None:
        earlier = [s for s in sources if s <= layer]
        return earlier[-1] if earlier else None

    @property
    def decoder_boundary(self) -> int:
        """First layer of the decoder for CED purposes (spec §2.1): the last kv source, after which no
        layer compresses, so everything before it is a function of the prompt alone. n_layers when the
        model has no compressed cache."""
        return max(self.kv_source_layers) if self.kv_source_layers else self.n_layers

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose compressed KV (and index keys) `layer` reads; None for ratio-0 layers."""
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return None
        return self._latest(self.kv_source_layers, layer)

    def index_source_of(self, layer: int) -> int | None:
        """The layer whose top-k selection `layer` uses; itself for Full and Reindex layers."""
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return None
        return self._latest(self.index_source_layers, layer)

    def attention_mode(self, layer: int) -> str:
        """'swa', 'full', 'reindex' or 'reuse' (spec §2 table, §3.2)."""
        if self.kv_source_of(layer) is None:
            return "swa"
        if layer in self.kv_source_layers:
            return "full"
        if layer in self.index_source_layers:
            return "reindex"
        return "reuse"

    @property
    def n_hash_columns(self) -> int:
        """Engram hash columns per position: (max_ngram_size - 1) orders x n_heads (spec §5)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def drafter_stages(self) -> int:
        """DSpark stages the model builds (`mtp.*`): n_mtp_layers when the drafter is configured, else 0."""
        return self.n_mtp_layers if self.dspark_block_size else 0

    def moe_shape(self, layer: int) -> tuple[int, int]:
        """(routed experts, activated experts) of a layer; DSpark blocks have their own (spec §12b)."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The checkpoint `config.json`: every field, after the Hugging Face `model_type` and `architectures`
        that let `AutoConfig` / `AutoModelForCausalLM` recognise the folder (dsv41.hf)."""
        data = {"model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE], **self.to_dict()}
        text = json.dumps(data, indent=2)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any], strict: bool = False) -> ModelConfig:
        """Build from either the flat inference dict or the Hugging Face dict (with `text_config`).

        This reads a checkpoint's config, so every field that changes the model must be present: the
        dataclass defaults are the 763B release, and completing a small config with them would build a
        different model without a word. All missing fields are named in one ValueError, before any
        model exists. Only `OPTIONAL_FIELDS` and the fields of absent parts (`PART_FIELDS`) may be left
        out. Unknown keys are ignored (the released files carry runtime keys such as `max_batch_size`)
        unless `strict`; keys of the wrong type raise ValueError naming the field. The Hugging Face
        bookkeeping keys (`CHECKPOINT_METADATA_KEYS`) are skipped even when strict; a `model_type` other
        than this model's is refused.
        """
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type", HF_MODEL_TYPE)
        if model_type != HF_MODEL_TYPE:
            raise ValueError(
                f"ModelConfig: model_type is {model_type!r}, not a DeepSeek-V4.1 model ({HF_MODEL_TYPE!r})"
            )
        data = {k: v for k, v in data.items() if k not in CHECKPOINT_METADATA_KEYS}
        hf = _looks_like_hf(data)
        flat = _hf_to_inference(data) if hf else dict(data)
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in flat.items():
            if key not in known:
                if strict:
                    raise ValueError(f"ModelConfig: unknown field {key!r}")
                continue
            kwargs[key] = _coerce(key, value, known[key])
        missing = _missing_fields(kwargs, known)
        if missing:
            spelled = {name: _hf_name(name, data) if hf else name for name in missing}
            shown = [
                hf_name if hf_name.split(".")[-1] == name else f"{hf_name} ({name})"
                for name, hf_name in spelled.items()
            ]
            raise ValueError(
                f"ModelConfig: the config lacks {len(missing)} field(s) that change the model: "
                f"{', '.join(shown)}; only {', '.join(OPTIONAL_FIELDS)} and the fields of a "
                f"vision tower, DSpark drafter or Engram the model does not have may be left out"
            )
        if kwargs["n_mtp_layers"] == 0:
            for name, value in DSPARK_OFF.items():
                kwargs.setdefault(name, value)
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelConfig:
        """Read an inference or Hugging Face `config.json` (or a folder holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        try:
            return cls.from_dict(data)
        except ValueError as exc:  # say which file is wrong (the CLI and load_model show only the message)
            raise ValueError(f"{path}: {exc}") from None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _coerce(name: str, value: Any, f: dataclasses.Field) -> Any:
    """Type-check one JSON value against the dataclass field's default, naming the field on error."""
    default = f.default
    if value is None:
        if default is None or name in ("vision_max_wh_ratio", "expert_dtype"):
            return None
        raise ValueError(f"ModelConfig.{name}: must not be null")
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ValueError(f"ModelConfig.{name}: must be a list of integers (got {value!r})")
        return tuple(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"ModelConfig.{name}: must be true or false (got {value!r})")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ValueError(f"ModelConfig.{name}: must be an integer (got {value!r})")
        return int(value)
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"ModelConfig.{name}: must be a number (got {value!r})")
        return float(value)
    if isinstance(default, str) or default is None:
        if not isinstance(value, str):
            raise ValueError(f"ModelConfig.{name}: must be a string (got {value!r})")
        return value
    return value


# Hugging Face text_config name -> inference name (spec §1.2 vs §1.4). Names equal in both are omitted.
HF_RENAMES = {
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
HF_ROPE_RENAMES = {
    "factor": "rope_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_max_position_embeddings": "original_seq_len",
}
HF_VISION_RENAMES = {
    "num_hidden_layers": "vision_n_layers",
    "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio",
    "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels",
    "max_wh_ratio": "vision_max_wh_ratio",
}


def _missing_fields(kwargs: dict[str, Any], known: dict[str, dataclasses.Field]) -> list[str]:
    """Fields a checkpoint config must give but `kwargs` lacks, in dataclass order.

    A part's fields are checked only when the field that switches the part on is given (when it is
    missing, that one field is reported and the part's own fields would be noise).
    """
    optional = set(OPTIONAL_FIELDS)
    for switch, names in PART_FIELDS.items():
        optional.update(names)
        if switch in kwargs and kwargs[switch]:
            optional.difference_update(names)
    return [name for name in known if name not in kwargs and name not in optional]


def _hf_name(name: str, data: dict[str, Any]) -> str:
    """How a Hugging Face config spells the inference field `name`, for error messages."""
    text = "text_config." if "text_config" in data else ""
    for hf_key, inference in HF_ROPE_RENAMES.items():
        if inference == name:
            return f"{text}rope_scaling.{hf_key}"
    for hf_key, inference in HF_VISION_RENAMES.items():
        if inference == name:
            return f"vision_config.{hf_key}"
    if name in ("image_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
        return name
    if name in ("dtype", "expert_dtype"):
        return "quantization_config"
    inverse = {inference: hf_key for hf_key, inference in HF_RENAMES.items()}
    return text + inverse.get(name, name)


def _looks_like_hf(data: dict[str, Any]) -> bool:
    return "text_config" in data or "hidden_size" in data or "num_hidden_layers" in data


def _hf_to_inference(data: dict[str, Any]) -> dict[str, Any]:
    text = dict(data.get("text_config", data))
    flat: dict[str, Any] = {}
    for key, value in text.items():
        if key == "rope_scaling" and isinstance(value, dict):
            for hf_key, name in HF_ROPE_RENAMES.items():
                if hf_key in value:
                    flat[name] = value[hf_key]
            continue
        flat[HF_RENAMES.get(key, key)] = value
    if text.get("num_key_value_heads", 1) != 1:
        raise ValueError("ModelConfig: num_key_value_heads must be 1 (single latent KV head, spec §3)")
    vision = data.get("vision_config")
    if isinstance(vision, dict):
        for hf_key, name in HF_VISION_RENAMES.items():
            if hf_key in vision:
                flat[name] = vision[hf_key]
    elif "vision_config" not in data:  # the HF convention: no vision_config, no vision tower
        flat.setdefault("vision_n_layers", 0)
    for key in ("image_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in data:
            flat[key] = data[key]
    quant = data.get("quantization_config")
    if isinstance(quant, dict):
        flat["dtype"] = "fp8" if quant.get("quant_method") == "fp8" else "bf16"
        flat["expert_dtype"] = quant.get("expert_dtype")
    elif "quantization_config" not in data and "dtype" not in text:
        flat.setdefault("dtype", "bf16")
        flat.setdefault("expert_dtype", None)
    if flat.get("dtype") in ("bfloat16", "float32"):
        flat["dtype"] = "bf16"
    return flat


# --------------------------------------------------------------------- presets
def flash() -> ModelConfig:
    """The released DeepSeek-V4.1-Flash exactly (spec §1)."""
    return ModelConfig()


def _cpu_scale(**fields: Any) -> ModelConfig:
    """A test/CPU preset: bf16 weights throughout, no vision tower, no MTP/DSpark drafter."""
    return ModelConfig(
        **{"n_mtp_layers": 0, "dtype": "bf16", "expert_dtype": None, "vision_n_layers": 0, **DSPARK_OFF, **fields}
    )


def tiny() -> ModelConfig:
    """The smallest config with every block type (SWA, Full r2, Reuse r2, Full r1 + candidate source,
    Reuse r1, Reindex) and two Engram layers. It equals the `v41-tiny-*` golden configs."""
    return _cpu_scale(
        vocab_size=1024,
        dim=64,
        moe_inter_dim=32,
        n_layers=10,
        n_heads=4,
        n_routed_experts=8,
        n_activated_experts=3,
        q_lora_rank=64,
        head_dim=64,
        rope_head_dim=16,
        o_groups=2,
        o_lora_rank=32,
        window_size=8,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(2, 4, 6),
        index_source_layers=(2, 4, 6, 8),
        original_seq_len=64,
        rope_factor=4.0,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=6,
        candidate_source_layer=6,
        candidate_topk_blocks=3,
        candidate_block_size=4,
        engram_layer_ids=(1, 4),
        engram_num_embeddings=(660, 864),
        engram_vocab_size=100,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_compressed_vocab_size=512,
        max_position_embeddings=4096,
    )


def small() -> ModelConfig:
    """A CPU-trainable config that keeps the released schedule's shape: a 6-layer encoder (2 SWA,
    then 'Full + Reuse' ratio-2 groups) and a 6-layer decoder (ratio-1 Full + candidate source, then
    'Reindex + Reuse'), Engram before layer 1 and before the second encoder Full layer."""
    return _cpu_scale(
        vocab_size=8192,
        dim=384,
        moe_inter_dim=384,
        n_layers=12,
        n_heads=6,
        n_routed_experts=16,
        n_activated_experts=2,
        q_lora_rank=192,
        head_dim=128,
        rope_head_dim=32,
        o_groups=2,
        o_lora_rank=192,
        window_size=64,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1),
        kv_source_layers=(2, 4, 6),
        index_source_layers=(2, 4, 6, 8, 10),
        original_seq_len=1024,
        rope_factor=4.0,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=64,
        candidate_source_layer=6,
        candidate_topk_blocks=32,
        candidate_block_size=8,
        engram_layer_ids=(1, 4),
        engram_num_embeddings=(24064, 24336),
        engram_vocab_size=4000,
        engram_n_heads=2,
        engram_head_dim=64,
        engram_compressed_vocab_size=8192,
        max_position_embeddings=8192,
    )


def mini() -> ModelConfig:
    """The text-model preset (issue 11): trains to Shakespeare-like text in minutes on 2 CPU cores at
    1,024-token sequences, where top-64 selection reads an eighth to a sixteenth of the compressed
    cache, so sparse attention is a different model from dense. Every block type of the released
    schedule in 8 layers: SWA; a ratio-2 encoder (Full, Reuse, Full); a ratio-1 decoder (Full + candidate
    source, Reuse, Reindex, Reuse); Engram before layers 1 and 3."""
    return _cpu_scale(
        vocab_size=8192,
        dim=256,
        moe_inter_dim=256,
        n_layers=8,
        n_heads=4,
        n_routed_experts=8,
        n_activated_experts=2,
        q_lora_rank=128,
        head_dim=64,
        rope_head_dim=32,
        o_groups=2,
        o_lora_rank=128,
        window_size=64,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(1, 3, 4),
        index_source_layers=(1, 3, 4, 6),
        original_seq_len=1024,
        rope_factor=4.0,
        index_n_heads=4,
        index_head_dim=64,
        index_topk=64,
        candidate_source_layer=4,
        candidate_topk_blocks=16,
        candidate_block_size=8,
        engram_layer_ids=(1, 3),
        engram_num_embeddings=(12126, 12436),
        engram_vocab_size=2000,
        engram_n_heads=2,
        engram_head_dim=64,
        engram_compressed_vocab_size=8192,
        max_position_embeddings=8192,
    )


def nano() -> ModelConfig:
    """The shipped default checkpoint's shape (`dsv41/checkpoints/shakespeare-chat`, docs/text-model.md):
    `mini` cut down to fit 10 MB stored as FP8 (8.4M parameters) and to train in about half an hour on
    2 shared CPU cores. Every block type of the released schedule in 6 layers: SWA; a ratio-2 encoder
    (Full, Reuse); a ratio-1 decoder (Full + candidate source, Reindex, Reuse); Engram before layers 1
    and 3. Width 256, 4 experts (top-2) + the shared one, vocabulary 4,096 (the data's BPE)."""
    return _cpu_scale(
        vocab_size=4096,
        dim=256,
        moe_inter_dim=128,
        n_layers=6,
        n_heads=4,
        n_routed_experts=4,
        n_activated_experts=2,
        q_lora_rank=128,
        head_dim=64,
        rope_head_dim=32,
        o_groups=2,
        o_lora_rank=128,
        window_size=64,
        compress_ratios=(0, 2, 2, 1, 1, 1),
        kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 4),
        original_seq_len=1024,
        rope_factor=4.0,
        index_n_heads=4,
        index_head_dim=64,
        index_topk=64,
        candidate_source_layer=3,
        candidate_topk_blocks=16,
        candidate_block_size=8,
        engram_layer_ids=(1, 3),
        engram_num_embeddings=(6126, 6332),
        engram_vocab_size=1000,
        engram_n_heads=2,
        engram_head_dim=64,
        engram_compressed_vocab_size=4096,
        max_position_embeddings=8192,
    )


def recall() -> ModelConfig:
    """The long-context retrieval preset (issue 33): the smallest model in which every far fact must go
    through the compressed path, sized so 2 shared CPU cores run thousands of steps in an hour. Two
    layers, the minimal induction/associative-recall circuit (Olsson et al. 2022; Zoology's MQAR):
    a sliding-window layer writes each token's local context into its state (which key a value
    follows), then a ratio-1 Full layer (kv and index source, spec §3.2) whose indexer picks 8 entries
    of the compressed cache for each query. The window is 32 tokens: a multi-key NIAH question names
    its key 11-20 BPE-1024 tokens before the answer ("... for sad-cat mentioned in the provided text
    is"), and with two layers the query knows only what the first layer's window saw, so an 8-token
    window cannot tell the keys apart (4-key NIAH 0.45 at 8). At 320 tokens 90% of the context is still
    reachable only through the indexer's top-8. Per-op overhead, not FLOPs, sets the
    step time on CPU, so it is wider than tiny (128) but has 2 layers instead of 10 (step time 1.9 s
    vs 3.6 s for 4 layers, batch 8 x 192, measured together), 4 experts, no Engram, no candidate pool."""
    return _cpu_scale(
        vocab_size=1024,
        dim=128,
        moe_inter_dim=128,
        n_layers=2,
        n_heads=4,
        n_routed_experts=4,
        n_activated_experts=2,
        q_lora_rank=64,
        head_dim=64,
        rope_head_dim=16,
        o_groups=2,
        o_lora_rank=64,
        window_size=32,
        compress_ratios=(0, 1),
        kv_source_layers=(1,),
        index_source_layers=(1,),
        original_seq_len=0,
        rope_factor=1.0,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        candidate_source_layer=-1,
        engram_layer_ids=(),
        engram_num_embeddings=(),
        max_position_embeddings=4096,
    )


def recall3() -> ModelConfig:
    """`recall` with a second sliding-window layer before the Full layer (compress ratios 0, 0, 1, the
    released schedule's opening: two SWA layers first, spec §3.2). Issue 33's 2-layer misses were the
    model's, not the indexer's (the dense baseline misses the same prompts): four-key NIAH answers
    another needle's value, and a passkey like 90002 is copied as 992. With one window layer the query
    knows its key only through one attention step over the last 32 tokens, and the copy's 'which digit
    comes next' through one previous-token step; a second window layer composes the two (find the word
    after 'for', then carry it; the previous two tokens) before the lookup. Same width, window and
    top-8; a window layer costs far less than the Full layer (32 keys instead of the whole cache)."""
    return dataclasses.replace(
        recall(), n_layers=3, compress_ratios=(0, 0, 1), kv_source_layers=(2,), index_source_layers=(2,)
    )


PRESETS = {
    "flash": flash,
    "tiny": tiny,
    "small": small,
    "mini": mini,
    "nano": nano,
    "recall": recall,
    "recall3": recall3,
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
