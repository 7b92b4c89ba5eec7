"""dsv41.hf: a dsv41 checkpoint folder through transformers' Auto classes, logits and generation equal to
dsv41's own, the cache bridge, the config round trip, and clear errors on malformed folders."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import optional_import

transformers = optional_import("transformers")  # required under DSV41_REQUIRE_OPTIONAL (.ci/run)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import dsv41  # noqa: E402
from dsv41.config import HF_RENAMES, ModelConfig, tiny  # noqa: E402
from dsv41.generate import generate  # noqa: E402
from dsv41.hf import DeepseekV41Cache, DeepseekV41Config, DeepseekV41ForCausalLM  # noqa: E402
from dsv41.model.init import init_random_weights  # noqa: E402
from dsv41.model.transformer import Transformer  # noqa: E402
from dsv41.train.checkpoint import save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A `tiny` checkpoint written by the trainer's save_checkpoint (the release layout)."""
    path = tmp_path_factory.mktemp("hf") / "checkpoint"
    save_checkpoint(str(path), init_random_weights(Transformer(tiny()), seed=3).eval(), tiny(), None)
    return path


@pytest.fixture(scope="module")
def hf_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.fixture(scope="module")
def reference(folder):
    return dsv41.load_model(folder)


def ids(batch, length, seed=0):
    """Random ids 3..999 (no BOS/EOS/PAD) [batch, length]."""
    return torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_auto_classes_load_a_checkpoint_folder(folder, hf_model):
    assert json.loads((folder / "config.json").read_text())["model_type"] == "deepseek_v41"
    assert isinstance(hf_model, DeepseekV41ForCausalLM) and not hf_model.training
    assert hf_model.config.model_config == tiny()
    assert hf_model.config.num_hidden_layers == 10 and hf_model.config.hidden_size == 64
    assert hf_model.generation_config.eos_token_id == tiny().eos_token_id


def test_logits_equal_load_model(hf_model, reference):
    x = ids(2, 50)  # longer than the window (8) and several compression groups
    with torch.no_grad():
        assert torch.equal(hf_model(x).logits, reference(x))
        assert torch.equal(hf_model(x, logits_to_keep=1).logits, reference(x, last_only=True))


def test_cache_bridge_steps_and_grows_like_a_model_cache(hf_model, reference):
    """Pieces fed through a DeepseekV41Cache made far too short (it must grow twice) give the logits the
    model computes over the same pieces with a ModelCache sized for all of them."""
    x = ids(2, 50, seed=1)
    cache = hf_model.new_cache(2, max_seq_len=8)
    own = reference.new_cache(2, 50)
    start = 0
    with torch.no_grad():
        for end in (5, 25, 26, 50):
            out = hf_model(x[:, start:end], cache=cache)
            assert out.cache is cache and cache.get_seq_length() == end
            assert torch.equal(out.logits, reference(x[:, start:end], start, own))
            start = end
    assert cache.model_cache.max_seq_len >= 50


def test_generate_equals_dsv41_greedy_and_runs_incrementally(hf_model, reference, monkeypatch):
    """greedy generate() = dsv41.generate.generate token for token; after the prompt the model sees one
    new token per step (the cache is used, nothing is recomputed)."""
    x = ids(2, 20, seed=2)
    steps = 12
    lengths = []
    forward = hf_model.model.forward

    def spy(input_ids, *args, **kwargs):
        lengths.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(hf_model.model, "forward", spy)
    out = hf_model.generate(x, max_new_tokens=steps, do_sample=False)[:, x.size(1) :]
    monkeypatch.undo()
    eos = tiny().eos_token_id
    own = generate(reference, x, steps, eos_id=eos)
    # a row that ends is padded after its EOS, by transformers with pad_token_id, by dsv41 with EOS
    assert [until_eos(row, eos) for row in out.tolist()] == [until_eos(row, eos) for row in own.tolist()]
    assert out.shape == own.shape
    assert lengths == [x.size(1)] + [1] * (out.size(1) - 1)


def until_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_generate_returns_and_continues_its_cache(hf_model, reference):
    x = ids(1, 16, seed=4)
    first = hf_model.generate(x, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    cache = first.cache
    assert isinstance(cache, DeepseekV41Cache)
    assert cache.get_seq_length() == 16 + 5 - 1  # the last token is not fed back yet
    # continuing from the returned cache feeds only the new positions, and equals one 10-token run
    more = hf_model.generate(first.sequences, cache=cache, max_new_tokens=5, do_sample=False)
    assert torch.equal(more[:, 16:], generate(reference, x, 10))


def test_beam_reorder_moves_cache_rows(hf_model):
    """reorder_cache (beam search) permutes the sequences: after it, decoding continues as if the batch
    had been built in the new order."""
    x, nxt = ids(2, 12, seed=5), ids(2, 1, seed=6)
    cache = hf_model.new_cache(2)
    swapped = hf_model.new_cache(2)
    with torch.no_grad():
        hf_model(x, cache=cache)
        cache.reorder_cache(torch.tensor([1, 0]))
        hf_model(x.flip(0), cache=swapped)
        assert torch.equal(hf_model(nxt, cache=cache).logits, hf_model(nxt, cache=swapped).logits)
    assert len(hf_model.generate(x, num_beams=2, max_new_tokens=3, do_sample=False)[0]) == 15


def test_labels_give_the_shifted_cross_entropy(hf_model, reference):
    x = ids(2, 30, seed=7)
    labels = x.clone()
    labels[0, :10] = -100
    with torch.no_grad():
        loss = hf_model(x, labels=labels).loss
        logits = reference(x)
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert torch.allclose(loss, expected, rtol=0, atol=1e-6)


def test_autoconfig_round_trip(folder, tmp_path):
    cfg = AutoConfig.from_pretrained(folder)
    assert isinstance(cfg, DeepseekV41Config) and cfg.model_config == tiny()
    assert cfg.dtype is None and cfg.weight_dtype == "bf16"  # transformers' dtype vs the weight format
    cfg.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert again.model_config == tiny() and again.to_diff_dict() == cfg.to_diff_dict()
    assert ModelConfig.from_file(tmp_path) == tiny()  # what dsv41's own loaders read
    # the release's Hugging Face form (text_config, HF names) reaches the same config
    flat = tiny().to_dict()
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
        "factor": flat["rope_factor"],
        "beta_fast": flat["beta_fast"],
        "beta_slow": flat["beta_slow"],
        "original_max_position_embeddings": flat["original_seq_len"],
    }
    hf_form = tmp_path / "hf_form"
    hf_form.mkdir()
    (hf_form / "config.json").write_text(
        json.dumps(
            {
                "model_type": "deepseek_v41",
                "dtype": "bfloat16",
                "architectures": ["DeepseekV41ForCausalLM"],
                "text_config": text,
            }
        )
    )
    assert AutoConfig.from_pretrained(hf_form).model_config == tiny()
    # editing an attribute edits the model config, validated
    cfg.n_layers = 3
    with pytest.raises(ValueError):
        _ = cfg.model_config


def test_save_pretrained_writes_a_folder_dsv41_loads(hf_model, reference, tmp_path):
    hf_model.save_pretrained(tmp_path)
    x = ids(1, 24, seed=8)
    with torch.no_grad():
        assert torch.equal(dsv41.load_model(tmp_path)(x), reference(x))
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(x).logits, reference(x))
    assert (tmp_path / "generation_config.json").is_file()


def test_folders_without_model_type_still_load(folder, reference, tmp_path):
    """Checkpoints written before config.json carried model_type: dsv41's loaders and the model class
    read them; AutoConfig cannot tell what they are and says so."""
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    data = json.loads((old / "config.json").read_text())
    del data["model_type"], data["architectures"]
    (old / "config.json").write_text(json.dumps(data))
    x = ids(1, 20, seed=9)
    with torch.no_grad():
        assert torch.equal(dsv41.load_model(old)(x), reference(x))
        assert torch.equal(DeepseekV41ForCausalLM.from_pretrained(old)(x).logits, reference(x))
    with pytest.raises(ValueError, match="model_type"):
        AutoConfig.from_pretrained(old)


def test_malformed_folders_and_inputs_raise_clear_errors(folder, hf_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "missing", config=hf_model.config)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    data = json.loads((broken / "config.json").read_text())
    del data["dim"]
    (broken / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="dim"):
        AutoModelForCausalLM.from_pretrained(broken)
    data["dim"], data["model_type"] = 64, "deepseek_v4"  # another model's folder
    (broken / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="deepseek_v4"):
        DeepseekV41ForCausalLM.from_pretrained(broken)
    data["model_type"] = "deepseek_v41"
    (broken / "config.json").write_text(json.dumps(data))
    os.remove(broken / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no weights"):
        AutoModelForCausalLM.from_pretrained(broken)
    with pytest.raises(ValueError, match="dtype"):
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with pytest.raises(ValueError, match="attention_mask"):
        hf_model(ids(2, 5), attention_mask=torch.tensor([[1] * 5, [0] + [1] * 4]))
    with pytest.raises(TypeError, match="DeepseekV41Cache"):
        hf_model(ids(1, 5), cache=transformers.DynamicCache())


def test_core_package_does_not_import_the_optional_extras():
    """transformers and lm_eval are optional: importing dsv41's core (and its CLI) must not load them."""
    code = (
        "import sys, dsv41, dsv41.engine, dsv41.weights, dsv41.train.checkpoint, dsv41.server, dsv41.cli;"
        "print(sorted(m for m in ('transformers', 'lm_eval') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert out.stdout.strip() == "[]", out.stdout
