"""Hugging Face transformers integration (optional extra `hf`): `DeepseekV41Config`, `DeepseekV41ForCausalLM`
and the cache bridge `DeepseekV41Cache`.

Importing this package registers the config and model with `AutoConfig` and `AutoModelForCausalLM` under
model_type "deepseek_v41" (the release's own name), so that, with no remote code and no download,
`AutoModelForCausalLM.from_pretrained(folder)` loads a dsv41 checkpoint folder and `generate()` runs on the
model's own decode cache. `register()` does it again (harmless). Nothing else in dsv41 imports transformers.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from dsv41.config import HF_MODEL_TYPE
from dsv41.hf.configuration import DeepseekV41Config
from dsv41.hf.modeling import DeepseekV41Cache, DeepseekV41ForCausalLM


def register() -> None:
    """Register DeepseekV41Config / DeepseekV41ForCausalLM with transformers' Auto classes (idempotent)."""
    AutoConfig.register(HF_MODEL_TYPE, DeepseekV41Config, exist_ok=True)
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)


register()

__all__ = ["DeepseekV41Cache", "DeepseekV41Config", "DeepseekV41ForCausalLM", "register"]
