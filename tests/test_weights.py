import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.weights import load_model

GOLDEN = "tests/data/golden/v41-tiny-fp8"


def _copy(tmp_path, edit=None):
    folder = tmp_path / "ckpt"
    folder.mkdir(parents=True)
    shutil.copy(f"{GOLDEN}/config.json", folder / "config.json")
    tensors = load_file(f"{GOLDEN}/model.safetensors")
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
