"""Parity with the official reference's outputs (tests/data/golden, copied from shared/golden)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.golden import EXACT_ATOL, exact_required, main, run_golden
from dsv41.weights import load_model
from tests.conftest import GOLDEN_FOLDERS


@pytest.mark.parametrize("folder", GOLDEN_FOLDERS, ids=lambda f: f.rsplit("/", 1)[-1])
def test_golden_folder_passes(folder):
    result = run_golden(folder, verbose=False)
    assert result.passed, "\n".join(result.lines)
    if exact_required(folder):
        assert result.exact and max([result.prefill_max_abs] + result.decode_max_abs) <= EXACT_ATOL


def test_fp8_set_captures_are_bit_exact_through_the_first_blocks():
    """Teacher-forced check of the README: the prefill captures of the first layers match bit for bit."""
    folder = [f for f in GOLDEN_FOLDERS if f.endswith("fp8")][0]
    model = load_model(folder)
    model.set_reference_numerics(True)
    inputs, expected = load_file(f"{folder}/inputs.safetensors"), load_file(f"{folder}/expected.safetensors")
    model.set_engram_token_map(inputs["engram_token_map"])
    trace = {}
    with torch.inference_mode():
        model(inputs["input_ids"], 0, last_only=True, trace=trace)
    for name, ref in expected.items():
        if name.startswith(("hidden.layers.0.", "hidden.layers.1.", "hidden.layers.2.", "debug.layers.2.",
                            "debug.layers.6.")) or name == "hidden.embed":
            assert torch.equal(trace[name].to(ref.dtype), ref), name


def test_golden_cli_exit_status(tmp_path, capsys):
    folder = [f for f in GOLDEN_FOLDERS if f.endswith("fp8")][0]
    assert main([folder]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASS")
    # an exact set whose expected logits are off by one ulp-sized step must FAIL. (Whether the --fast
    # summation order is bit-exact depends on the CPU: it fails on an AMD EPYC and passes on AMX Xeons.)
    tampered = tmp_path / "tampered"
    shutil.copytree(folder, tampered)
    expected = load_file(f"{folder}/expected.safetensors")
    expected["decode_logits"][4, 1, 7] += 1e-4
    save_file(expected, str(tampered / "expected.safetensors"))
    assert main([str(tampered)]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAIL")
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
