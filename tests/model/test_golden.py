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
    """Under reference numerics every set matches on every logit (atol 1e-5; measured 0) and every prefill
    capture bit for bit, on any CPU: every machine-dependent op is computed in float64 and rounded once
    at the reference's rounding points (dsv41.ops.canonical). No tolerance depends on the CPU family."""
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
    final norm) and the caches after the last step are bit-identical."""
    result = _traced(folder)
    steps, caches = {LONG_FP8: (64, 16), REAL40_FP8: (24, 48)}[folder]
    assert result.decode_steps_traced == steps
    assert result.first_decode_diff is None, str(result.first_decode_diff)
    assert result.identical_decode_steps == steps
    assert result.final_caches_compared == caches and result.final_cache_diff is None, str(result.final_cache_diff)
    assert result.exact and result.passed


def test_a_tampered_logit_fails_the_exact_tolerance(tmp_path):
    """One decode logit moved by 1e-4 FAILs under reference numerics, and only that step differs."""
    tampered = tmp_path / "tampered"
    shutil.copytree(TINY_BF16, tampered)
    expected = load_file(f"{TINY_BF16}/expected.safetensors")
    expected["decode_logits"][3, 0, 11] += 1e-4
    save_file(expected, str(tampered / "expected.safetensors"))
    reference = run_golden(tampered, verbose=False)
    assert reference.tolerance.startswith("exact") and not reference.passed
    assert reference.prefill_max_abs == 0 and max(reference.decode_max_abs) <= 2e-4
    assert [t for t, err in enumerate(reference.decode_max_abs) if err] == [3]
    # the fast kernels are not exact on these sets: their noise study says so, and --fast is judged loosely
    assert not exact_required(TINY_BF16)


@pytest.mark.parametrize("op", ["linear", "einsum", "sum", "exp"])
def test_the_sets_fail_when_one_canonical_op_runs_in_fp32(monkeypatch, op):
    """Not vacuous: with one canonical op computed by the CPU's fp32 kernels instead of float64 (the GEMMs,
    the einsums of the indexer and attention, the sums, or the exps), some set is no longer exact."""
    from dsv41.ops import canonical

    fp32 = {
        "linear": lambda x, weight, bias=None, dtype=None: torch.nn.functional.linear(
            x.float(), weight.float(), None if bias is None else bias.float()
        ).to(x.dtype if dtype is None else dtype),
        "einsum": lambda eq, *ops, dtype=torch.float32: torch.einsum(eq, *(o.float() for o in ops)).to(dtype),
        "sum": lambda x, dim=-1, keepdim=False, dtype=torch.float32: x.float().sum(dim, keepdim=keepdim).to(dtype),
        "exp": lambda x: x.float().exp(),
    }[op]
    monkeypatch.setattr(canonical, op, fp32)
    results = [run_golden(folder, verbose=False) for folder in (TINY_FP8, TINY_BF16)]
    assert not all(r.exact and r.first_capture_diff is None for r in results), op


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
    delta = (
        (
            attn_out[7, 1, 3].float()
            - load_file(f"{LONG_FP8}/expected.safetensors")["decode.hidden.layers.5.attn_out"][7, 1, 3].float()
        )
        .abs()
        .item()
    )
    first = [line for line in lines if "first differing decode capture" in line]
    assert len(first) == 1 and first[0].startswith(
        f"  first differing decode capture: step 7, hidden.layers.5.attn_out (row 1): max abs diff {delta:.3g} "
        "(steps 0-6 identical; "
    ), first
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
        if (
            name.startswith(
                ("hidden.layers.0.", "hidden.layers.1.", "hidden.layers.2.", "debug.layers.2.", "debug.layers.6.")
            )
            or name == "hidden.embed"
        ):
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
    the base logits, the Markov bias, the confidence and the drafted ids, all bit-identical."""
    result = run_golden(DSPARK_FP8, verbose=False)
    assert result.passed, "\n".join(result.lines)
    assert result.spec_tokens_equal and result.spec_max_abs == 0
    assert result.first_spec_diff is None, str(result.first_spec_diff)
