"""Parity with the official reference's outputs (tests/data/golden, copied from shared/golden)."""

import functools
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.golden import (EXACT_ATOL, LOOSE_ARGMAX_AGREEMENT, LOOSE_DECODE_RMS_RATIO, exact_required, main,
                          run_golden)
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR, GOLDEN_FOLDERS

TINY_FP8 = os.path.join(GOLDEN_DIR, "v41-tiny-fp8")
LONG_FP8 = os.path.join(GOLDEN_DIR, "v41-long-fp8")
REAL40_FP8 = os.path.join(GOLDEN_DIR, "v41-real40-fp8")
# sets checked by their own test below instead of the plain pass/fail one: real40 is not bit-exact on
# every CPU (see test_real40_is_exact_until_its_first_rounding_flip_then_within_accumulation_tolerance)
NOT_EXACT_ON_EVERY_CPU = {REAL40_FP8}


@functools.cache
def _traced(folder):
    """run_golden with --trace, once per folder for this module (the long sets take tens of seconds)."""
    return run_golden(folder, verbose=False, trace=True)


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (torch.tensor(abs(x)).log2().floor().item() - 7)


def _assert_single_rounding_flip(result, folder):
    """The first differing decode capture is ONE entry of a block output stream (`hidden.layers.<i>.out`)
    off by one bf16 ulp: an fp32 value on (or within an ulp of) a bf16 rounding midpoint rounded the other
    way, because this CPU sums the hyper-connection fp32 statistics in another order than the machine the
    set was made on. Everything before it is bit-identical."""
    diff = result.first_decode_diff
    assert diff.name.startswith("hidden.layers.") and diff.name.endswith(".out"), str(diff)
    assert diff.n_differ == 1 and len(diff.rows) == 1, str(diff)
    expected = load_file(f"{folder}/expected.safetensors")[f"decode.{diff.name}"][diff.step]
    assert any(diff.max_abs == _bf16_ulp(v) for v in expected.float().flatten().tolist() if v), str(diff)
    assert result.identical_decode_steps == diff.step


@pytest.mark.parametrize("folder", [f for f in GOLDEN_FOLDERS if f not in NOT_EXACT_ON_EVERY_CPU],
                         ids=lambda f: f.rsplit("/", 1)[-1])
def test_golden_folder_passes(folder):
    result = _traced(folder) if folder == LONG_FP8 else run_golden(folder, verbose=False)
    assert result.passed, "\n".join(result.lines)
    if exact_required(folder):
        assert result.exact and max([result.prefill_max_abs] + result.decode_max_abs) <= EXACT_ATOL


def test_long_set_decode_trace_matches_every_step():
    """--trace on v41-long-fp8 (64 decode steps, the window ring wraps 4x, 32 ratio-2 groups complete in
    decode): every step's captures (embed, per layer engram/attn/ffn/out/pre_mix, top-k rows, candidate
    pools, final norm) and the caches after the last step match the reference.

    Where this CPU's fp32 summation order is the reference machine's (AMD EPYC) all 64 steps are
    identical. On an AMX Xeon one entry flips a bf16 rounding: step 22, `hidden.layers.8.out`, row 1, by
    one ulp (0.000488; its prefill twin is `hidden.layers.3.out`, 2.4e-7), which changes no logit by more
    than 5e-7 -- so the steps before it must be identical and the set still passes exactly."""
    result = _traced(LONG_FP8)
    assert result.decode_steps_traced == 64
    assert result.final_caches_compared == 16 and result.final_cache_diff is None, str(result.final_cache_diff)
    if result.first_decode_diff is None:
        assert result.identical_decode_steps == 64
        assert "  decode captures: all 64 steps identical (49 captures per step)" in result.lines
    else:
        _assert_single_rounding_flip(result, LONG_FP8)
        assert result.identical_decode_steps >= 16  # the ring has wrapped; ratio-2 groups have completed
    assert result.exact and result.passed


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


def test_real40_is_exact_until_its_first_rounding_flip_then_within_accumulation_tolerance():
    """v41-real40-fp8 (the released 40-layer schedule) asks for exactness, and on the machine it was made
    on (AMD EPYC) it is. On an AMX/AVX-512 Xeon it is not: at decode step 3, `hidden.layers.28.out`, row 1
    differs by one bf16 rounding (0.0078): its fp32 value 1.61328125 lies exactly on a bf16 rounding
    midpoint, and this CPU's vectorized `mean` of the squares in the hyper-connection RMS statistic
    (`Block.hc_mixes`) sums in a different order, which decides the tie the other way. The 30 Reuse/Reindex
    layers after it and the remaining 20 steps amplify that one ulp (top-k, FP4/FP8 rounding, routing are
    discontinuous) to logit differences of ~0.1, rms ratio ~0.013 and argmax agreement ~0.98.

    So: the prefill (captures and logits) must be exact, the decode must be bit-identical up to the first
    differing (step, capture) the trace finds, that difference must be a single one-ulp rounding flip, and
    the whole decode must stay within the sets' accumulation-order tolerance. Where the CPU reproduces the
    reference's summation order (no difference at all), exactness is asserted instead."""
    result = _traced(REAL40_FP8)
    assert result.first_capture_diff is None, result.first_capture_diff
    assert result.prefill_max_abs <= EXACT_ATOL
    assert result.decode_steps_traced == 24
    if result.first_decode_diff is None:
        assert result.exact and result.passed, "\n".join(result.lines)
        assert result.final_cache_diff is None
        return
    _assert_single_rounding_flip(result, REAL40_FP8)
    first_step = result.first_decode_diff.step
    assert first_step >= 1  # at least one decode step identical (step 3 on an AMX Xeon)
    assert max(result.decode_max_abs[:first_step]) <= EXACT_ATOL
    assert result.decode_rms_ratio <= LOOSE_DECODE_RMS_RATIO
    assert result.argmax_agreement >= LOOSE_ARGMAX_AGREEMENT


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
    # summation order is bit-exact depends on the CPU: it fails on an AMD EPYC and passes on AMX Xeons.)
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
    the base logits, the Markov bias and the drafted ids bit-identical; the confidence head (a 96-term
    fp32 dot product whose summation order the reference's BLAS chose) within the exact tolerance."""
    result = run_golden(DSPARK_FP8, verbose=False)
    assert result.passed, "\n".join(result.lines)
    assert result.spec_tokens_equal and result.spec_max_abs <= EXACT_ATOL
    first = result.first_spec_diff
    assert first is None or first.name in ("spec.confidence", "spec.stages.0.pre_mix_out"), str(first)
