"""Parity with the official reference's outputs (tests/data/golden, copied from shared/golden)."""

import functools
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.golden import EXACT_ATOL, exact_required, main, run_golden
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR, GOLDEN_FOLDERS

TINY_FP8 = os.path.join(GOLDEN_DIR, "v41-tiny-fp8")
TINY_BF16 = os.path.join(GOLDEN_DIR, "v41-tiny-bf16")
LONG_FP8 = os.path.join(GOLDEN_DIR, "v41-long-fp8")
REAL40_FP8 = os.path.join(GOLDEN_DIR, "v41-real40-fp8")


@functools.cache
def _traced(folder):
    """run_golden with --trace, once per folder for this module (the long sets take tens of seconds)."""
    return run_golden(folder, verbose=False, trace=True)


@pytest.mark.parametrize("folder", GOLDEN_FOLDERS, ids=lambda f: f.rsplit("/", 1)[-1])
def test_golden_folder_passes_exactly_with_every_capture_identical(folder):
    """Under reference numerics every set, bf16 ones included, matches on every logit (atol 1e-5; measured
    0 here) and every prefill capture bit for bit, on any CPU: the reductions the sets pin (means of
    squares, Engram's dot product) are summed in their order, the bf16 GEMMs in the reference's
    dot-product order, the sigmoid/softplus split like the reference's kernel (see
    Transformer.set_reference_numerics). No tolerance depends on the CPU family."""
    result = _traced(folder) if folder in (LONG_FP8, REAL40_FP8) else run_golden(folder, verbose=False)
    assert result.passed and result.exact, "\n".join(result.lines)
    assert max([result.prefill_max_abs] + result.decode_max_abs) <= EXACT_ATOL
    assert result.tolerance.startswith("exact")
    assert result.first_capture_diff is None, result.first_capture_diff


@pytest.mark.parametrize("folder", [LONG_FP8, REAL40_FP8], ids=lambda f: f.rsplit("/", 1)[-1])
def test_long_sets_match_every_decode_step_and_the_final_caches(folder):
    """--trace on the sets with per-step captures: v41-long-fp8 (64 decode steps, the window ring wraps 4x,
    32 ratio-2 groups complete in decode) and v41-real40-fp8 (the released 40-layer schedule, 24 steps).
    Every step's captures (embed, per layer engram/attn/ffn/out/pre_mix, top-k rows, candidate pools,
    final norm) and the caches after the last step are bit-identical. Before the RMS statistics were
    pinned, a vectorised fp32 mean put one value of each on the other side of a bf16 rounding midpoint on
    some CPUs (long: step 22 layer 8; real40: step 3 layer 28) and the decode drifted from there."""
    result = _traced(folder)
    steps, caches = {LONG_FP8: (64, 16), REAL40_FP8: (24, 48)}[folder]
    assert result.decode_steps_traced == steps
    assert result.first_decode_diff is None, str(result.first_decode_diff)
    assert result.identical_decode_steps == steps
    assert result.final_caches_compared == caches and result.final_cache_diff is None, str(result.final_cache_diff)
    assert result.exact and result.passed


def test_bf16_set_is_judged_exactly_under_reference_numerics(tmp_path):
    """v41-tiny-bf16's noise study says bf16 GEMM order moves its logits, so its README allows an
    accumulation-order tolerance to implementations that sum differently (what --fast gets). Under
    reference numerics we sum in the reference's order, so exactness is required: one decode logit moved
    by 1e-4 FAILs."""
    assert not exact_required(TINY_BF16)
    tampered = tmp_path / "tampered"
    shutil.copytree(TINY_BF16, tampered)
    expected = load_file(f"{TINY_BF16}/expected.safetensors")
    expected["decode_logits"][3, 0, 11] += 1e-4
    save_file(expected, str(tampered / "expected.safetensors"))
    reference = run_golden(tampered, verbose=False)
    assert reference.tolerance.startswith("exact") and not reference.passed
    assert reference.prefill_max_abs == 0 and max(reference.decode_max_abs) <= 2e-4


def test_bf16_set_fails_when_the_bf16_gemms_sum_in_the_plain_order(monkeypatch):
    """Not vacuous: with the bf16 GEMMs summed k = 0, 1, 2, ... instead of the reference's pairs (1, 0, 3,
    2, ...) the bf16 set is no longer exact."""
    from dsv41.ops import gemm

    def sequential(x, weight):
        xf, wf = x.float(), weight.float()
        acc = torch.zeros(*x.shape[:-1], weight.size(0))
        for j in range(x.size(-1)):
            acc = acc + xf[..., j, None] * wf[:, j]
        return acc.bfloat16()

    monkeypatch.setattr(gemm, "linear_bf16_pairwise", sequential)
    result = run_golden(TINY_BF16, verbose=False)
    assert not result.exact and not result.passed


def test_trace_reports_the_first_tampered_decode_capture(tmp_path, capsys):
    """A copy of v41-long-fp8 with one entry of one per-step capture changed (step 7, layer 5 attn_out,
    batch row 1) and one entry of one final cache: the CLI's --trace names exactly that step and capture
    (and that cache); the logits are untouched, so it still exits 0 with PASS. Decoys changed too, each
    first in another order: the same step's layer 5 `out` (later in the block) and layer 6 top-k (later
    layer), and step 9's embedding (earlier layer, later step)."""
    tampered = tmp_path / "tampered"
    shutil.copytree(LONG_FP8, tampered)
    expected = load_file(f"{LONG_FP8}/expected.safetensors")
    attn_out = expected["decode.hidden.layers.5.attn_out"]
    attn_out[7, 1, 3] = -4.0  # 0.167 in the set
    expected["decode.hidden.layers.5.out"][7, 0, 2, 9] += 1.0
    expected["decode.debug.layers.6.topk_idxs"][7, 0, 0] = 80
    expected["decode.hidden.embed"][9, 0, 5] += 1.0
    expected["decode.debug.layers.4.compress_kv_final"][0, 5, 2] += 0.5  # -0.703125 -> -0.203125 (exact)
    save_file(expected, str(tampered / "expected.safetensors"))
    assert main([str(tampered), "--trace"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("PASS")
    delta = (attn_out[7, 1, 3].float() - load_file(f"{LONG_FP8}/expected.safetensors")[
        "decode.hidden.layers.5.attn_out"][7, 1, 3].float()).abs().item()
    first = [line for line in lines if "first differing decode capture" in line]
    assert len(first) == 1 and first[0].startswith(
        f"  first differing decode capture: step 7, hidden.layers.5.attn_out (row 1): max abs diff {delta:.3g} "
        "(steps 0-6 identical; "), first
    steps = {line.split()[1]: line for line in lines if line.startswith("  decode ") and "max abs" in line}
    assert all(steps[str(t)].endswith("captures identical") for t in range(7))
    assert steps["7"].endswith("first capture diff: hidden.layers.5.attn_out")
    assert steps["9"].endswith("first capture diff: hidden.embed")
    assert "  first differing final cache: debug.layers.4.compress_kv_final (row 0): max abs diff 0.5" in lines


def test_fp8_set_captures_are_bit_exact_through_the_first_blocks():
    """Teacher-forced check of the README: the prefill captures of the first layers match bit for bit."""
    folder = TINY_FP8
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
    folder = TINY_FP8
    assert main([folder]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("PASS") and "decode captures" not in out
    # --trace on a set without per-step captures says so and changes nothing else
    assert main([folder, "--trace"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "  decode captures: none in this set (no per-step decode.* captures to compare)" in lines
    assert lines[-1].startswith("PASS")
    # an exact set whose expected logits are off by one ulp-sized step must FAIL. (Whether the --fast
    # summation orders are bit-exact depends on the CPU.)
    tampered = tmp_path / "tampered"
    shutil.copytree(folder, tampered)
    expected = load_file(f"{folder}/expected.safetensors")
    expected["decode_logits"][4, 1, 7] += 1e-4
    save_file(expected, str(tampered / "expected.safetensors"))
    assert main([str(tampered)]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAIL")
    assert main([str(tampered), "--trace"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAIL")
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert main([str(tmp_path / "empty"), "--trace"]) == 2


DSPARK_FP8 = os.path.join(GOLDEN_DIR, "v41-dspark-fp8")


def test_dspark_drafter_matches_the_reference_after_every_decode_step():
    """The drafter (mtp.*) after the prefill and after each decode step: backbone features, every stage,
    the base logits, the Markov bias and the drafted ids bit-identical (the stages' hc mixes too, now
    that their sigmoid is split like the reference's kernel); the confidence head (a 96-term fp32 dot
    product whose summation order the reference's BLAS chose, per MKL code path) within the exact
    tolerance."""
    result = run_golden(DSPARK_FP8, verbose=False)
    assert result.passed, "\n".join(result.lines)
    assert result.spec_tokens_equal and result.spec_max_abs <= EXACT_ATOL
    first = result.first_spec_diff
    assert first is None or first.name == "spec.confidence", str(first)
