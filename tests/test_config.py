import json

import pytest

from dsv41.accounting import account
from dsv41.config import HF_RENAMES, ModelConfig, flash, mini, nano, preset, small, tiny


def test_flash_is_the_released_model():
    cfg = flash()
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.window_size) == (5120, 40, 64, 512, 128)
    assert len(cfg.compress_ratios) == 43 and cfg.compress_ratios[20] == 1 and cfg.compress_ratios[19] == 2
    modes = [cfg.attention_mode(i) for i in range(40)]
    assert modes.count("swa") == 2 and modes.count("full") == 4 and modes.count("reindex") == 4
    assert modes.count("reuse") == 30
    assert cfg.kv_source_of(27) == 20 and cfg.index_source_of(27) == 24 and cfg.index_source_of(13) == 8


def test_small_keeps_the_schedule_and_is_cpu_sized():
    cfg = small()
    modes = [cfg.attention_mode(i) for i in range(cfg.n_layers)]
    assert modes[:2] == ["swa", "swa"] and "reindex" in modes and "reuse" in modes
    assert cfg.candidate_source_layer == cfg.n_layers // 2
    assert 20e6 <= account(cfg)["params_active_decode"] <= 50e6


def test_mini_has_every_block_type_and_selects_at_1024_tokens():
    """The text-model preset: every attention mode, and at its 1,024-token training length every
    compressed layer holds more entries than the indexer selects (so sparse differs from dense)."""
    cfg = mini()
    modes = [cfg.attention_mode(i) for i in range(cfg.n_layers)]
    assert set(modes) == {"swa", "full", "reindex", "reuse"} and cfg.engram_layer_ids
    ratios = {r for r in cfg.compress_ratios if r}
    assert ratios == {1, 2} and all(1024 // r >= 8 * cfg.index_topk for r in ratios)
    assert 5e6 <= account(cfg)["params_active_decode"] <= account(cfg)["params_total"] <= 30e6


def test_nano_has_every_block_type_and_fits_10_mb_as_fp8():
    """The shipped default checkpoint's shape: every attention mode and Engram, and few enough
    parameters that one byte each (FP8) stays under 10 MB with the tokenizer."""
    cfg = nano()
    modes = [cfg.attention_mode(i) for i in range(cfg.n_layers)]
    assert set(modes) == {"swa", "full", "reindex", "reuse"} and cfg.engram_layer_ids
    assert {r for r in cfg.compress_ratios if r} == {1, 2} and cfg.candidate_source_layer >= 0
    assert 5e6 <= account(cfg)["params_total"] <= 9e6


@pytest.mark.parametrize("name", ["flash", "tiny", "small", "mini", "nano"])
def test_json_round_trip(tmp_path, name):
    cfg = preset(name)
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert ModelConfig.from_file(path) == cfg
    assert ModelConfig.from_file(tmp_path) == cfg


def test_checkpoint_config_names_its_hugging_face_model_type(tmp_path):
    """config.json carries model_type / architectures for transformers' AutoConfig (dsv41.hf); the loader
    skips them (strict too), still reads folders written without them, and refuses another model's."""
    path = tmp_path / "config.json"
    tiny().to_json(path)
    data = json.loads(path.read_text())
    assert data["model_type"] == "deepseek_v41" and data["architectures"] == ["DeepseekV41ForCausalLM"]
    assert ModelConfig.from_dict(data, strict=True) == tiny()
    del data["model_type"], data["architectures"]
    assert ModelConfig.from_dict(data, strict=True) == tiny()
    with pytest.raises(ValueError, match="deepseek_v4'"):
        ModelConfig.from_dict({**data, "model_type": "deepseek_v4"})


def test_reads_golden_inference_config():
    cfg = ModelConfig.from_file("tests/data/golden/v41-tiny-fp8/config.json")
    assert cfg == tiny().replace(dtype="fp8", expert_dtype="fp4", max_position_embeddings=cfg.max_position_embeddings)


def test_reads_hugging_face_config(tmp_path):
    flat = flash().to_dict()
    inverse = {v: k for k, v in HF_RENAMES.items()}
    text = {
        inverse.get(k, k): v
        for k, v in flat.items()
        if not k.startswith("vision_")
        and k
        not in ("rope_factor", "beta_fast", "beta_slow", "original_seq_len", "dtype", "expert_dtype", "image_token_id")
    }
    text["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    }
    text["num_key_value_heads"] = 1
    hf = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"},
        "text_config": text,
        "vision_config": {
            "num_hidden_layers": 32,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "intermediate_size": 2816,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": 1024,
            "min_pixels": 295936,
            "max_wh_ratio": None,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert ModelConfig.from_file(tmp_path) == flash()


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(kv_source_layers=(2, 8, 14, 45)), "kv_source_layers"),
        (dict(compress_ratios=(0,) * 40 + (4, 0, 0)), "compress_ratios"),
        (dict(compress_ratios=(0, 0, 3) + (2,) * 17 + (1,) * 20 + (0, 0, 0)), "compress_ratios"),
        (dict(index_topk=0), "index_topk"),
        (dict(compress_ratios=(0, 0, 2)), "compress_ratios"),
        (dict(engram_num_embeddings=(1, 2, 3)), "engram_num_embeddings"),
        (dict(candidate_source_layer=21), "candidate_source_layer"),
        (dict(n_activated_experts=500), "n_activated_experts"),
        (dict(index_source_layers=(8, 14, 20)), "index_source_layers"),
    ],
)
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        flash().replace(**change)


def test_malformed_json_and_types(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ValueError, match="dim"):
        ModelConfig.from_dict({"dim": "big"})
    with pytest.raises(ValueError, match="kv_source_layers"):
        ModelConfig.from_dict({"kv_source_layers": "2,8"})


# ------------------------------------------------------------------ issue 9 item 10: no silent Flash defaults
GOLDEN_CONFIG = "tests/data/golden/v41-tiny-fp8/config.json"


def _golden_config(**changes):
    data = json.load(open(GOLDEN_CONFIG))
    for key, value in changes.items():
        if value is ...:
            data.pop(key)
        else:
            data[key] = value
    return data


def test_checkpoint_config_missing_model_fields_is_an_error(tmp_path):
    for missing in ("window_size", "index_topk", "dtype", "compress_ratios", "hc_eps", "vision_n_layers"):
        with pytest.raises(ValueError, match=missing):
            ModelConfig.from_dict(_golden_config(**{missing: ...}))
    # every missing field is named in one message, and the file is named too
    (tmp_path / "config.json").write_text(json.dumps(_golden_config(window_size=..., index_topk=...)))
    with pytest.raises(ValueError, match="config.json") as err:
        ModelConfig.from_file(tmp_path)
    assert "window_size" in str(err.value) and "index_topk" in str(err.value)
    # `{}` names the model's shape instead of describing the 763B release
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({})
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "window_size", "compress_ratios", "dtype"):
        assert name in str(err.value)


def test_hugging_face_config_missing_model_fields_is_an_error():
    text = {"hidden_size": 64, "num_hidden_layers": 10, "vocab_size": 1024}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({"text_config": text})
    for name in ("sliding_window", "rope_scaling", "index_topk", "num_attention_heads"):
        assert name in str(err.value)


def test_fields_outside_the_text_model_may_be_absent():
    """The released inference config has no gate_temp/norm_topk_prob (the reference fixes them) and no
    token ids; a text-only model need not describe a vision tower, nor a model without MTP a drafter."""
    gone = {k: ... for k in _golden_config() if k.startswith(("vision_", "dspark_")) and k != "vision_n_layers"}
    cfg = ModelConfig.from_dict(_golden_config(image_token_id=..., **gone))
    assert not cfg.vision_enabled and cfg.n_mtp_layers == 0
    assert cfg.window_size == 8 and cfg.index_topk == 6 and cfg.gate_temp == 1.0 and cfg.norm_topk_prob
    # ... but a model that has the part must describe it
    with pytest.raises(ValueError, match="vision_dim"):
        ModelConfig.from_dict(_golden_config(vision_n_layers=2, vision_dim=...))
    with pytest.raises(ValueError, match="engram_head_dim"):
        ModelConfig.from_dict(_golden_config(engram_head_dim=...))


def test_presets_are_unaffected_by_required_fields():
    assert ModelConfig() == flash()
    assert preset("tiny") == tiny() and preset("small") == small()


# ------------------------------------------------------------------ issue 9 item 11: float ranges
@pytest.mark.parametrize(
    "field,value",
    [
        ("rope_theta", -10000.0),
        ("rope_theta", 1.0),
        ("compress_rope_theta", 0.0),
        ("vision_rope_theta", -1.0),
        ("swiglu_limit", -10.0),
        ("swiglu_limit", float("nan")),
        ("route_scale", -1.5),
        ("route_scale", 0.0),
        ("route_scale", float("inf")),
        ("norm_eps", -1e-20),
        ("norm_eps", 0.0),
        ("norm_eps", 1.0),
        ("hc_eps", -1e-6),
        ("hc_eps", 1.0),
        ("gate_temp", float("nan")),
        ("rope_factor", 0.5),
        ("rope_factor", float("inf")),
        ("vision_max_wh_ratio", -2.0),
    ],
)
def test_float_fields_are_range_checked(field, value):
    with pytest.raises(ValueError, match=field):
        flash().replace(**{field: value})
    with pytest.raises(ValueError, match=field):
        tiny().replace(**{field: value})


def test_float_conventions_stay_valid(tmp_path):
    # swiglu_limit 0 means "no clamp" (ops.clamped_swiglu), hc_eps 0 keeps Sinkhorn finite (softmax rows > 0)
    assert tiny().replace(swiglu_limit=0.0, hc_eps=0.0).swiglu_limit == 0.0
    assert tiny().replace(vision_max_wh_ratio=None).vision_max_wh_ratio is None
    (tmp_path / "config.json").write_text(json.dumps(_golden_config(rope_theta=-10000.0)))
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_golden_config()).replace('"hc_eps": 1e-06', '"hc_eps": NaN'))
    with pytest.raises(ValueError, match="hc_eps"):
        ModelConfig.from_file(tmp_path)


def test_the_recall_preset_routes_far_facts_through_the_compressed_cache():
    """Issue 33's preset (README "Long context"): a window-only layer, then a ratio-1 Full layer that is
    its own kv and index source, a 32-token window (wide enough for a NIAH question's key to reach the
    answer position through the first layer) and top-8 selection, so beyond 32 tokens a fact reaches a
    query only through the indexer's choice."""
    from dsv41.config import recall

    cfg = preset("recall")
    assert cfg == recall()
    assert cfg.n_layers == 2 and cfg.compress_ratios == (0, 1) and cfg.window_size == 32 and cfg.index_topk == 8
    assert cfg.kv_source_layers == (1,) and cfg.index_source_layers == (1,) and cfg.candidate_source_layer == -1


def test_the_recall3_preset_adds_a_window_layer_before_the_lookup():
    """`recall3`: two sliding-window layers, then the ratio-1 Full layer that is the only compressed
    one, with recall's width, window and top-8 unchanged, so the two presets differ by the layer alone."""
    cfg = preset("recall3")
    base = preset("recall")
    assert cfg.n_layers == 3 and cfg.compress_ratios == (0, 0, 1)
    assert cfg.kv_source_layers == (2,) and cfg.index_source_layers == (2,)
    assert cfg.replace(n_layers=2, compress_ratios=(0, 1), kv_source_layers=(1,), index_source_layers=(1,)) == base
