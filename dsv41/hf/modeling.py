"""`DeepseekV41ForCausalLM`: the dsv41 `Transformer` behind transformers' `PreTrainedModel` + `GenerationMixin`.

The wrapper computes nothing itself: `forward` calls the same `dsv41.model.Transformer` that
`dsv41.load_model` returns (loaded by the same `dsv41.weights.load_weights`), so its logits are dsv41's
bit for bit, and `generate()` runs over the model's own decode state.

The cache bridge. V4.1 does not keep per-layer key/value tensors that grow by concatenation: its state is
window rings, compressed KV and index keys, partial compression groups and the Engram id history
(`dsv41.model.cache.ModelCache`). `DeepseekV41Cache` is a transformers `Cache` holding one `ModelCache`
and the number of positions it has seen; `forward` reads the start position from it, so `generate()`
prefills once and then feeds one token per step (its `prepare_inputs_for_generation` slices the ids
to the new ones whenever a cache is present). A `ModelCache` has a fixed capacity; the bridge grows it
(doubling, copying what the length-indexed tensors hold) when a forward would pass the end, so
generation needs no length up front. transformers 5 names the argument `cache`; `past_key_values`
(the earlier name) is accepted too.

Loading (`from_pretrained`) reads local folders only, with dsv41's own loader (safetensors, the official
tensor names, FP8/FP4 conversions and its errors); there is no Hub download and no remote code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from dsv41.hf.configuration import DeepseekV41Config
from dsv41.model.cache import ModelCache
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.weights import SINGLE_FILE, load_weights

# from_pretrained arguments of transformers' loader that mean nothing for a local dsv41 folder
_IGNORED_LOAD_ARGS = (
    "trust_remote_code",
    "adapter_kwargs",
    "_from_auto",
    "_from_pipeline",
    "revision",
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "token",
    "low_cpu_mem_usage",
    "use_safetensors",
    "attn_implementation",
    "experts_implementation",
)
# forward arguments generate() passes that need nothing here when left at their defaults
_QUIET_FORWARD_ARGS = {
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "return_dict": (None, True),
    "token_type_ids": (None,),
}


class DeepseekV41Cache(Cache):
    """A transformers `Cache` over one dsv41 `ModelCache` [batch_size rows] (see the module docstring).

    `model_cache` is the state the model reads and writes; `seen` counts the positions already in it.
    Batch rows can be selected, repeated and reordered (beam search); a V4.1 state cannot be cropped
    (window rings and compressor groups are overwritten in place)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, model: Transformer, batch_size: int, max_seq_len: int = 256):
        super().__init__(layers=[])  # no per-layer key/value objects: the state lives in model_cache
        self.model_config = model.cfg
        self.model_cache = model.new_cache(batch_size, max_seq_len)
        self.seen = 0

    # what transformers' generation code asks of a cache
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows on demand

    @property
    def is_linear(self) -> list[bool]:
        return [False]  # position-indexed like attention (generate slices the new ids by get_seq_length)

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_dummy(self) -> list[bool]:
        return [False]

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self.model_cache.batch_size

    def reset(self) -> None:
        old = self.model_cache
        self.model_cache = ModelCache.create(
            self.model_config, old.batch_size, old.max_seq_len, old.window_kv[0].device
        )
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a DeepSeek-V4.1 cache cannot be cropped: its window rings and compression "
            "groups are overwritten in place (assisted decoding is not supported)"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    # the bridge
    def reserve(self, batch_size: int, length: int) -> ModelCache:
        """The `ModelCache` to run `length` new positions of `batch_size` rows in, grown if it is too short."""
        cache = self.model_cache
        if batch_size != cache.batch_size:
            raise ValueError(f"this cache holds {cache.batch_size} sequences; the input has {batch_size} rows")
        needed = self.seen + length
        if needed > cache.max_seq_len:
            self.model_cache = _grown(self.model_config, cache, max(needed, 2 * cache.max_seq_len))
        return self.model_cache

    def _map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-row operation to every tensor of the state."""
        cache = self.model_cache
        window = [fn(t) for t in cache.window_kv]
        self.model_cache = dataclasses.replace(
            cache,
            batch_size=window[0].size(0),
            window_kv=window,
            compressed_kv={k: fn(v) for k, v in cache.compressed_kv.items()},
            index_k={k: fn(v) for k, v in cache.index_k.items()},
            group_kv={k: fn(v) for k, v in cache.group_kv.items()},
            group_score={k: fn(v) for k, v in cache.group_score.items()},
            engram_ids=None if cache.engram_ids is None else fn(cache.engram_ids),
        )


def _grown(cfg, cache: ModelCache, max_seq_len: int) -> ModelCache:
    """A copy of `cache` with room for max_seq_len positions: the length-indexed tensors (compressed KV,
    index keys [B, max/ratio, D], Engram ids [B, max]) copied into larger ones, the rest kept as is."""
    big = ModelCache.create(cfg, cache.batch_size, max_seq_len, cache.window_kv[0].device)
    for name in ("compressed_kv", "index_k"):
        for layer, old in getattr(cache, name).items():
            getattr(big, name)[layer][:, : old.size(1)] = old
    if cache.engram_ids is not None:
        big.engram_ids[:, : cache.max_seq_len] = cache.engram_ids
    big.window_kv, big.group_kv, big.group_score = cache.window_kv, cache.group_kv, cache.group_score
    return big


class DeepseekV41ForCausalLM(PreTrainedModel, GenerationMixin):
    """transformers' causal-LM interface over a dsv41 `Transformer` (`self.model`).

    `DeepseekV41ForCausalLM(config)` builds the model with dsv41's random initialisation (seed 0);
    `from_pretrained(folder)` loads a checkpoint folder; `DeepseekV41ForCausalLM(config, model)` wraps a
    model you already have (sharing its weights)."""

    config_class = DeepseekV41Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: DeepseekV41Config, model: Transformer | None = None):
        super().__init__(config)
        cfg = config.model_config
        if model is None:
            model = init_random_weights(Transformer(cfg), seed=0)
        elif model.cfg != cfg:
            raise ValueError("the model was built from another ModelConfig than `config` describes")
        self.model = model
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: dsv41 initialises (dsv41.model.init) or loads its own weights, in its own dtypes."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not make a DynamicCache: forward creates a DeepseekV41Cache

    def new_cache(self, batch_size: int, max_seq_len: int = 256) -> DeepseekV41Cache:
        """An empty cache for `batch_size` sequences (grows past max_seq_len when needed)."""
        return DeepseekV41Cache(self.model, batch_size, max_seq_len)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DeepseekV41Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: DeepseekV41Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids [B, S] at the positions after what `cache` holds -> logits [B, S, vocab] fp32 (the last
        `logits_to_keep` positions when > 0; generate() asks for 1, which runs dsv41's `last_only`).

        With a cache (or use_cache=True, which makes one) the state advances and comes back as `cache`.
        labels [B, S]: the mean next-token cross-entropy over labels != -100 (as transformers' causal LMs).
        There is no padding: attention_mask, if given, must be all ones. position_ids, if given, must
        continue the cache."""
        for name, value in kwargs.items():
            if name not in _QUIET_FORWARD_ARGS or value not in _QUIET_FORWARD_ARGS[name]:
                raise ValueError(f"DeepseekV41ForCausalLM.forward does not support {name}={value!r}")
        if past_key_values is not None:
            if cache is not None:
                raise ValueError("pass the cache as `cache` or `past_key_values`, not both")
            cache = past_key_values
        if input_ids is None:
            raise ValueError(
                "DeepseekV41ForCausalLM needs input_ids (the Engram hash reads them); "
                "inputs_embeds alone are not supported"
            )
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds are not supported: pass input_ids")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise ValueError(
                "DeepseekV41ForCausalLM has no padding support: attention_mask must be all ones "
                "(batch prompts of equal length, or run them one at a time)"
            )
        if cache is not None and not isinstance(cache, DeepseekV41Cache):
            raise TypeError(
                f"the cache must be a DeepseekV41Cache (model.new_cache(batch)), got {type(cache).__name__}"
            )
        if use_cache is None:
            use_cache = cache is not None
        if use_cache and cache is None:
            cache = self.new_cache(b, s + 256)
        start = cache.get_seq_length() if cache is not None else 0
        if position_ids is not None:
            expected = torch.arange(start, start + s, device=position_ids.device).expand(b, s)
            if position_ids.shape != (b, s) or not bool((position_ids == expected).all()):
                raise ValueError(f"position_ids must be {start}..{start + s - 1} (the positions after the cache)")
        if isinstance(logits_to_keep, int) and logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("labels need the logits of every position (logits_to_keep=0)")

        model_cache = cache.reserve(b, s) if cache is not None else None
        last_only = isinstance(logits_to_keep, int) and logits_to_keep == 1
        logits = self.model(input_ids.to(self.model.device), start, model_cache, last_only=last_only)  # [B, S|1, V]
        if cache is not None:
            cache.seen += s
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep > 1:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].to(logits.device).flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    # ------------------------------------------------------------------ loading and saving
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args: Any,
        config: DeepseekV41Config | None = None,
        **kwargs: Any,
    ) -> DeepseekV41ForCausalLM:
        """Load a dsv41 checkpoint folder (config.json + safetensors under the official names) with dsv41's
        loader. `config`: use it instead of the folder's config.json. `device_map`: one device ("cpu",
        "cuda:0", a torch.device). `dtype` must be None or "auto": the weights keep their stored dtypes."""
        path = os.fspath(pretrained_model_name_or_path)
        if model_args:
            raise TypeError("DeepseekV41ForCausalLM.from_pretrained takes no positional model arguments")
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{path}: not a folder; dsv41 loads local checkpoint folders only "
                f"(config.json + model.safetensors), nothing is downloaded"
            )
        subfolder = kwargs.pop("subfolder", "") or ""
        path = os.path.join(path, subfolder) if subfolder else path
        for name in ("dtype", "torch_dtype"):
            value = kwargs.pop(name, None)
            if value not in (None, "auto"):
                raise ValueError(
                    f"{name}={value!r}: dsv41 weights keep their stored dtypes (bf16 activations, fp32 "
                    f"head, FP8/FP4 storage); load with the default dtype"
                )
        device = kwargs.pop("device_map", None)
        one_device = (
            device is None
            or isinstance(device, torch.device)
            or (isinstance(device, str) and device not in ("auto", "balanced", "balanced_low_0", "sequential"))
        )
        if not one_device:
            raise ValueError(f"device_map={device!r}: dsv41 runs on one device; pass e.g. 'cpu' or 'cuda:0'")
        if kwargs.pop("use_safetensors", None) is False:
            raise ValueError("dsv41 loads safetensors only (pickle checkpoints run code from the file)")
        if kwargs.pop("output_loading_info", False):
            raise ValueError("output_loading_info is not supported: see model.model.load_report")
        for name in _IGNORED_LOAD_ARGS:
            kwargs.pop(name, None)
        if kwargs:
            raise TypeError(f"DeepseekV41ForCausalLM.from_pretrained: unsupported arguments {sorted(kwargs)}")
        if config is None:
            config = DeepseekV41Config.from_pretrained(path)
        cfg = config.model_config
        with torch.device("cpu"):
            net = Transformer(cfg)
        report = load_weights(net, path)  # what dsv41.load_model does, with this config
        if report.skipped:
            print(f"[dsv41] {path}: {report.summary()}")
        net.load_report = report
        net = net.to(device or "cpu").eval()
        model = cls(config, net)
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(path)
        return model.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the release layout dsv41's loaders read: config.json (with model_type), model.safetensors
        under the official names (no `model.` prefix), generation_config.json. Other files are kept; a
        folder holding other weight files (shards, an index) is refused, since the loader would prefer them."""
        from safetensors.torch import save_file

        if kwargs.get("push_to_hub"):
            raise ValueError("push_to_hub is not supported: dsv41 writes local folders only")
        folder = os.fspath(save_directory)
        os.makedirs(folder, exist_ok=True)
        stale = sorted(
            n
            for n in os.listdir(folder)
            if n.endswith(".safetensors.index.json") or (n.endswith(".safetensors") and n.startswith("model-"))
        )
        if stale:
            raise ValueError(
                f"{folder} already holds other weight files ({', '.join(stale[:4])}); save into an empty folder"
            )
        state = {name: p.detach().to("cpu").contiguous() for name, p in self.model.named_parameters()}
        save_file(state, os.path.join(folder, SINGLE_FILE), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write(json.dumps(self.config.to_diff_dict(), indent=2, sort_keys=False) + "\n")
        self.generation_config.save_pretrained(folder)
