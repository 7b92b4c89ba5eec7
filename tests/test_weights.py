import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv41.weights
from dsv41.weights import load_model

GOLDEN = "tests/data/golden/v41-tiny-fp8"


def _copy(tmp_path, edit=None, golden=GOLDEN):
    folder = tmp_path / "ckpt"
    folder.mkdir(parents=True)
    shutil.copy(f"{golden}/config.json", folder / "config.json")
    tensors = load_file(f"{golden}/model.safetensors")
    if edit:
        edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_loads_official_layout_with_conversions():
    model = load_model(GOLDEN)
    report = model.load_report
    assert "layers.0.attn.wo_a.weight" in report.converted  # fp8 -> bf16 like convert.py
    assert model.layers[0].attn.wo_a.weight.dtype == torch.bfloat16
    assert model.head.weight.dtype == torch.float32
    assert model.layers[0].ffn.experts[0].w1.weight.dtype == torch.int8
    assert not report.skipped


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    with pytest.raises(ValueError, match="layers.3.attn.wq_a.weight"):
        load_model(_copy(tmp_path / "a", lambda t: t.pop("layers.3.attn.wq_a.weight")))

    def bad_shape(t):
        t["norm.weight"] = torch.ones(65, dtype=torch.bfloat16)

    with pytest.raises(ValueError, match="norm.weight"):
        load_model(_copy(tmp_path / "b", bad_shape))

    def unknown(t):
        t["layers.0.attn.mystery"] = torch.ones(3)

    with pytest.raises(ValueError, match="mystery"):
        load_model(_copy(tmp_path / "c", unknown))


def test_unimplemented_components_are_reported_not_dropped_silently(tmp_path, capsys):
    def add(t):
        t["mtp.0.main_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
        t["vision.patch_embed.weight"] = torch.ones(4, 4)

    model = load_model(_copy(tmp_path, add))
    assert sorted(model.load_report.skipped) == ["mtp.0.main_norm.weight", "vision.patch_embed.weight"]
    assert "skipped" in capsys.readouterr().out


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(open(f"{GOLDEN}/config.json").read())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


# ------------------------------------------------------------------ issue 9 item 10: config before model
def test_incomplete_config_fails_before_any_model_is_built(tmp_path, monkeypatch):
    def no_build(cfg):
        raise AssertionError(f"a model was built from an incomplete config ({cfg.dim=})")

    monkeypatch.setattr(dsv41.weights, "Transformer", no_build)
    folder = _copy(tmp_path)
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="dim"):
        load_model(folder)
    config = json.loads(open(f"{GOLDEN}/config.json").read())
    del config["window_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="window_size"):
        load_model(folder)


# ------------------------------------------------------------------ issue 9 item 12: scales
@pytest.mark.parametrize(
    "name,shape",
    [
        ("layers.0.attn.wo_a.scale", (3, 4)),  # one tile row too many: used to be sliced away silently
        ("layers.0.attn.wo_a.scale", (2, 3)),  # one tile column too few: used to die in a broadcast
        ("layers.0.attn.wo_a.scale", (8,)),
        ("layers.0.attn.wkv.scale", (3, 2)),
        ("layers.0.ffn.experts.0.w1.scale", (32, 3)),
    ],
)
def test_every_scale_shape_is_checked_and_named(tmp_path, name, shape):
    def bad_scale(t):
        t[name] = torch.ones(shape).to(torch.float8_e8m0fnu)

    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(_copy(tmp_path, bad_scale))


@pytest.mark.parametrize(
    "golden,name",
    [
        ("tests/data/golden/v41-tiny-bf16", "layers.0.attn.wo_a.scale"),  # bf16 wo_a: a scale has nothing to scale
        (GOLDEN, "norm.scale"),
    ],
)
def test_stray_scale_next_to_a_bf16_weight_is_unknown(tmp_path, golden, name):
    def stray(t):
        t[name] = torch.ones(2, 4).to(torch.float8_e8m0fnu)

    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(_copy(tmp_path, stray, golden=golden))


# ------------------------------------------------------------------ issue 9 item 13: weight files
@pytest.mark.parametrize("damage", ["truncated", "not_safetensors"])
def test_unreadable_weight_file_is_named(tmp_path, damage):
    folder = _copy(tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"PK\x03\x04 not a tensor file" * 8)
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        load_model(folder)


def test_only_weight_files_are_read(tmp_path):
    # a golden folder as shipped (inputs/expected next to the weights) loads from model.safetensors only
    folder = tmp_path / "golden"
    shutil.copytree(GOLDEN, folder)
    assert load_model(folder).load_report.loaded
    # without model.safetensors, inputs.safetensors and expected.safetensors are not weight shards
    os.remove(folder / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors") as err:
        load_model(folder)
    assert "inputs.safetensors" in str(err.value)  # says what it found and did not take


def test_unindexed_shards_load_and_must_be_complete(tmp_path):
    tensors = load_file(f"{GOLDEN}/model.safetensors")
    names = sorted(tensors)
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(f"{GOLDEN}/config.json", folder / "config.json")
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    assert load_model(folder).load_report.loaded == load_model(GOLDEN).load_report.loaded
    os.remove(folder / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(folder)


def test_pickle_checkpoint_is_refused_with_the_reason(tmp_path):
    shutil.copy(f"{GOLDEN}/config.json", tmp_path / "config.json")
    torch.save({"norm.weight": torch.ones(64)}, tmp_path / "pytorch_model.bin")
    with pytest.raises((ValueError, FileNotFoundError), match="pytorch_model.bin") as err:
        load_model(tmp_path)
    message = str(err.value)
    assert "pickle" in message and "safetensors" in message and "code" in message
