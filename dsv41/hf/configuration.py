"""`DeepseekV41Config`: a dsv41 `ModelConfig` as a Hugging Face `PreTrainedConfig` (model_type "deepseek_v41").

Why a wrapper and not a second list of fields: `ModelConfig` stays the one definition of the architecture
(names, validation, the HF-name reader, the refusal of configs that leave out a field that changes the
model). This class only carries its fields as attributes, so `AutoConfig.from_pretrained(folder)` reads a
dsv41 checkpoint's `config.json` (the flat inference form `dsv41/train/checkpoint.py` writes, or the
release's Hugging Face form with `text_config`) and `save_pretrained` writes one dsv41's loaders read.

One name clashes: `ModelConfig.dtype` ("bf16" | "fp8", how the weights are stored) and transformers'
`PreTrainedConfig.dtype` (a torch dtype the weights are cast to). Here the first is `weight_dtype` and
`dtype` keeps its transformers meaning (dsv41 weights keep their own mixed dtypes, so it stays None);
`config.json` carries the dsv41 meaning under `dtype`, as the release does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PreTrainedConfig
from transformers.utils import logging

from dsv41.config import HF_ARCHITECTURE, HF_MODEL_TYPE, ModelConfig
from dsv41.config import _looks_like_hf as looks_like_hf_config

logger = logging.get_logger(__name__)

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
# keys transformers itself owns: its dataclass fields and what its __post_init__ consumes
_HF_KEYS = frozenset(f.name for f in dataclasses.fields(PreTrainedConfig)) | {
    "name_or_path",
    "_name_or_path",
    "output_attentions",
    "attn_implementation",
    "experts_implementation",
    "num_labels",
    "torch_dtype",
    "_commit_hash",
    "per_layer_config",
}


class DeepseekV41Config(PreTrainedConfig):
    """Every `ModelConfig` field as an attribute of the same name (`ModelConfig.dtype` as `weight_dtype`);
    `model_config` gives the validated `ModelConfig`. With no arguments: the released Flash model.

    Accepts the flat inference dict or the Hugging Face one (`text_config`, `vision_config`,
    `quantization_config`), like `ModelConfig.from_dict`, and raises its ValueError naming the fields
    a checkpoint config lacks. Keys that are neither model fields nor transformers' own are kept as
    plain attributes (and written back by `save_pretrained`)."""

    model_type = HF_MODEL_TYPE
    # the names transformers' generic code reads (generation, device maps)
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"}

    def __init__(self, **kwargs: Any):
        if kwargs.get("model_type", HF_MODEL_TYPE) == HF_MODEL_TYPE:
            kwargs.pop("model_type", None)  # the class's own; a foreign one is refused by ModelConfig.from_dict
        hf = {k: kwargs.pop(k) for k in list(kwargs) if k in _HF_KEYS and k != "dtype"}
        if kwargs.get("dtype") is not None and not isinstance(kwargs["dtype"], str):
            hf["dtype"] = kwargs.pop("dtype")  # a torch.dtype: transformers' meaning
        if kwargs:
            cfg = ModelConfig.from_dict(kwargs)
            if not looks_like_hf_config(kwargs):  # the flat form: keep what is not a model field
                hf.update({k: v for k, v in kwargs.items() if k not in MODEL_FIELDS})
        else:
            cfg = ModelConfig()
        super().__init__(**hf)
        self.architectures = self.architectures or [HF_ARCHITECTURE]
        self.tie_word_embeddings = False  # embed and head are separate tensors (fp32 head)
        for name in MODEL_FIELDS:
            setattr(self, "weight_dtype" if name == "dtype" else name, getattr(cfg, name))

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> DeepseekV41Config:
        """transformers hands a requested runtime dtype (`from_pretrained(..., dtype=...)`) in here, where it
        would replace the weight format under `dtype`; it is dropped (the model's `from_pretrained`, which
        gets it too, refuses a cast: dsv41 weights keep their own dtypes)."""
        kwargs.pop("dtype", None)
        kwargs.pop("torch_dtype", None)
        return super().from_dict(dict(config_dict), **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        """The dsv41 `ModelConfig` these attributes describe (validated: an invalid edit raises here)."""
        values = {name: getattr(self, "weight_dtype" if name == "dtype" else name) for name in MODEL_FIELDS}
        return ModelConfig(**values)

    def validate(self) -> None:
        """transformers' class validators (run on save and load) with `validate_token_ids` replaced by this
        class's own: the base class collected its validators itself, so overriding one takes this."""
        for validator in PreTrainedConfig.__class_validators__:
            getattr(self, validator.__name__)()

    def validate_token_ids(self) -> None:
        """transformers' warning about special-token ids outside the vocabulary, for the ids this model uses:
        one without a vision tower or drafter keeps the release's image / noise token ids, which a smaller
        vocabulary does not reach, and never reads them."""
        vocab = getattr(self, "vocab_size", None)
        names = ["bos_token_id", "eos_token_id", "pad_token_id"]
        names += ["image_token_id"] if getattr(self, "vision_n_layers", 0) else []
        names += ["dspark_noise_token_id"] if getattr(self, "n_mtp_layers", 0) else []
        for name in names:
            value = getattr(self, name, None)
            if vocab is not None and isinstance(value, int) and not 0 <= value < vocab:
                logger.warning_once(f"DeepseekV41Config: {name} {value} lies outside the vocabulary [0, {vocab})")

    def to_dict(self) -> dict[str, Any]:
        """transformers' dict with the model fields under their `config.json` names (`dtype` = weight_dtype).
        The inherited `to_diff_dict` (what `save_pretrained` writes) drops only transformers' own defaults:
        every model field stays, since dsv41 refuses a config that leaves one out."""
        out = super().to_dict()
        out.pop("weight_dtype", None)
        out.pop("tie_word_embeddings", None)
        out.update(self.model_config.to_dict())
        return out
