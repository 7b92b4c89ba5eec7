"""Run a golden reference folder and compare: `python -m dsv41.golden FOLDER [--trace] [--fast]`.

A folder holds `config.json`, `model.safetensors`, `inputs.safetensors` (`input_ids` [B, S],
`decode_ids` [B, N], optional `engram_token_map`), `expected.safetensors` (`prefill_logits` [B, V] of the
last prefill position, `decode_logits` [N, B, V], optional `hidden.*`/`debug.*` prefill captures, optional
`decode.*` per-step captures) and `meta.json`. The prefill runs at start_pos 0; decode step t feeds
`decode_ids[:, t]` at S + t.

Tolerance (from the sets' README, "Recommended tolerance"):
- exact: every logit within atol 1e-5 -- required of every set under reference numerics (the default:
  canonical float64 numerics, the same bits on any CPU; see `Transformer.set_reference_numerics`), and
  with `--fast` of sets whose noise study shows the CPU's native linear/einsum kernels leave the logits
  unchanged (`meta.json` noise `blas_linear_einsum` all zero);
- accumulation-order: prefill max |dlogit| <= 0.25, decode rms(dlogit)/rms(logit) <= 0.15 and argmax
  agreement >= 0.85 -- what `--fast` (the machine's own kernels) is judged by otherwise: a statistical
  check on a few dozen logits of a random tiny model, which ulp-level changes amplified by top-k and
  routing can miss.
Prints per-step errors, the first prefill capture that differs, and ends with PASS or FAIL and the
tolerance; exits 0 only on PASS (the verdict is on the logits; the captures only localize a difference).

`--trace` also captures every decode step (the model's `trace=`) and compares them with the set's per-step
captures (sets made with them, e.g. v41-long-fp8 and v41-real40-fp8; the tiny sets have none):
`decode.hidden.embed` / `decode.hidden.layers.<i>.{engram_out,attn_out,ffn_out,out,pre_mix_out}` /
`decode.hidden.final_norm` (the model's `hidden.final_norm_last`) [N, B, ...] and the index / candidate
sources' `decode.debug.layers.<i>.topk_idxs` [N, B, index_topk] (compared as sets of rows: sorted
ascending, -1 padding) and `candidates` [N, B, T] (a shorter step's mask padded with False). They are
compared in order of step, then layer, then position in the block, and the FIRST (step, capture) that
differs is printed with its max abs diff (the number of differing entries for int/bool) and the batch
rows that differ -- everything before it is bit-identical, so that is where the decode diverges. Then the
caches after the last step (`decode.debug.layers.<i>.{window_kv_final,compress_kv_final,index_k_final}`)
are compared with the model's `ModelCache` (window ring, compressed KV, index keys). The trace clones every
intermediate of every step, so it is off by default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from dsv41.weights import load_model

EXACT_ATOL = 1e-5
LOOSE_PREFILL_ATOL = 0.25
LOOSE_DECODE_RMS_RATIO = 0.15
LOOSE_ARGMAX_AGREEMENT = 0.85
CAPTURE_ORDER = [
    "engram_out",
    "compress_kv",
    "index_k",
    "candidates",
    "topk_idxs",
    "attn_out",
    "ffn_out",
    "out",
    "pre_mix_out",
]
DECODE_PREFIX = "decode."
FINAL_SUFFIX = "_final"
# per-step set key (after `decode.`) -> the model's trace name where they differ
DECODE_TRACE_NAMES = {"hidden.final_norm": "hidden.final_norm_last"}


@dataclass
class CaptureDiff:
    """One capture that differs: `step` is the decode step (None: the caches after the last step),
    `name` the capture (the set's key without `decode.`), `rows` the batch rows that differ."""

    step: int | None
    name: str
    rows: list[int]
    detail: str  # "max abs diff 0.0078", "3 of 128 entries differ" or a shape mismatch
    n_differ: int = 0  # differing entries (0 for a shape mismatch or a missing capture)
    max_abs: float | None = None  # float captures: the largest |mine - expected|

    def where(self) -> str:
        """`name (row 1)`: the capture and the batch rows that differ."""
        rows = f" ({'row' if len(self.rows) == 1 else 'rows'} {', '.join(map(str, self.rows))})" if self.rows else ""
        return f"{self.name}{rows}"

    def __str__(self) -> str:
        step = "final caches" if self.step is None else f"step {self.step}"
        return f"{step}, {self.where()}: {self.detail}"


@dataclass
class GoldenResult:
    name: str
    tolerance: str
    prefill_max_abs: float
    decode_max_abs: list[float]
    decode_rel: list[float]
    decode_rms_ratio: float
    argmax_agreement: float
    exact: bool
    passed: bool
    first_capture_diff: str | None = None
    lines: list[str] = field(default_factory=list)
    # --trace only (None without it, or when the set has no per-step captures):
    decode_steps_traced: int | None = None  # steps whose captures were compared
    first_decode_diff: CaptureDiff | None = None  # the first (step, capture) that differs
    identical_decode_steps: int | None = None  # leading decode steps whose captures are all identical
    final_cache_diff: CaptureDiff | None = None  # the first `*_final` cache that differs
    final_caches_compared: int = 0
    # sets with a DSpark drafter (`spec.*` expected values; None otherwise):
    spec_max_abs: float | None = None  # largest |mine - expected| over the drafter's logits and confidence
    spec_tokens_equal: bool | None = None  # every drafted id equal
    first_spec_diff: CaptureDiff | None = None  # the first (step, capture) of the drafter that differs


def _capture_key(name: str) -> tuple:
    parts = name.split(".")
    if len(parts) >= 4 and parts[1] == "layers":
        kind = parts[3]
        return (int(parts[2]), CAPTURE_ORDER.index(kind) if kind in CAPTURE_ORDER else 99)
    return (-1, 0) if name.endswith("embed") else (10**6, 0)


def first_capture_difference(expected: dict, captured: dict) -> str | None:
    """The earliest (by layer, then by position in the block) capture that differs, as a message."""
    for name in sorted((k for k in expected if k.startswith(("hidden.", "debug."))), key=_capture_key):
        if name not in captured:
            continue
        found = _difference(None, name, captured[name], expected[name])
        if found is not None:
            return f"{name}: {found.detail}"
    return None


def decode_capture_names(expected: dict) -> list[str]:
    """The set's per-step capture names (without `decode.`), in comparison order (layer, then block position)."""
    names = [k[len(DECODE_PREFIX) :] for k in expected if k.startswith(DECODE_PREFIX) and not k.endswith(FINAL_SUFFIX)]
    return sorted(names, key=_capture_key)


def _sorted_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Top-k row ids [..., k] as a set: valid ids ascending, then -1, padded with -1 to `width` columns."""
    ids = ids.long()
    big = torch.iinfo(torch.int64).max
    ids = torch.where(ids < 0, big, ids).sort(-1).values
    ids = torch.where(ids == big, -1, ids)
    if ids.size(-1) < width:
        ids = torch.nn.functional.pad(ids, (0, width - ids.size(-1)), value=-1)
    return ids


def _difference(step: int | None, name: str, mine: torch.Tensor, ref: torch.Tensor) -> CaptureDiff | None:
    """How mine differs from ref (dim 0 = batch), or None when they are identical."""
    if mine.shape != ref.shape:
        return CaptureDiff(step, name, [], f"shape {tuple(mine.shape)} vs expected {tuple(ref.shape)}")
    if ref.dtype == torch.bool or not ref.is_floating_point():
        wrong = mine.to(ref.dtype) != ref
        worst = None
    else:
        diff = (mine.float() - ref.float()).abs()
        wrong = (diff != 0) & ~(mine.float().isnan() & ref.float().isnan())
        worst = diff.nan_to_num(nan=torch.inf).max().item() if wrong.any() else 0.0
    count = int(wrong.sum().item())
    if not count:
        return None
    rows = wrong.reshape(wrong.size(0), -1).any(1).nonzero().flatten().tolist() if wrong.ndim else []
    detail = f"{count} of {ref.numel()} entries differ" if worst is None else f"max abs diff {worst:.3g}"
    return CaptureDiff(step, name, rows, detail, count, worst)


def step_capture_difference(step: int, names: list[str], expected: dict, captured: dict) -> CaptureDiff | None:
    """The first of `names` (per-step set captures, in order) whose value at `step` differs from this
    decode step's model trace `captured` (seq axis of length 1 still present)."""
    for name in names:
        ref = expected[DECODE_PREFIX + name][step]
        mine = captured.get(DECODE_TRACE_NAMES.get(name, name))
        if mine is None:
            return CaptureDiff(step, name, [], "not captured by the model")
        if mine.ndim == ref.ndim + 1 and mine.size(1) == 1:
            mine = mine.squeeze(1)  # [B, 1, ...] -> [B, ...]
        if name.endswith(".topk_idxs"):
            width = max(mine.size(-1), ref.size(-1))
            mine, ref = _sorted_ids(mine, width), _sorted_ids(ref, width)
        elif name.endswith(".candidates") and mine.ndim == ref.ndim and mine.size(-1) < ref.size(-1):
            mine = torch.nn.functional.pad(mine, (0, ref.size(-1) - mine.size(-1)), value=False)
        found = _difference(step, name, mine, ref)
        if found is not None:
            return found
    return None


def final_cache_difference(expected: dict, cache, batch: int) -> tuple[CaptureDiff | None, int, list[str]]:
    """Compare the set's caches after the last step (`decode.debug.layers.<i>.*_final`) with the model's
    `ModelCache` after it: window ring [B, W, head_dim] (slot = pos % W), compressed KV and index keys (the
    first (S+N)//ratio rows). Returns (the first difference by layer, number compared, names it lacks)."""
    names = sorted(
        (k[len(DECODE_PREFIX) :] for k in expected if k.startswith(DECODE_PREFIX) and k.endswith(FINAL_SUFFIX)),
        key=lambda n: (_capture_key(n), n),
    )
    compared, missing = 0, []
    for name in names:
        parts = name.split(".")
        layer, kind = int(parts[2]), parts[3]
        mine = None
        if kind == "window_kv_final" and hasattr(cache, "window_kv") and layer < len(cache.window_kv):
            mine = cache.window_kv[layer][:batch]
        elif kind in ("compress_kv_final", "index_k_final"):
            store = getattr(cache, "compressed_kv" if kind == "compress_kv_final" else "index_k", {})
            if layer in store:
                rows = expected[DECODE_PREFIX + name].size(1)
                mine = store[layer][:batch, :rows] if store[layer].size(1) >= rows else store[layer][:batch]
        if mine is None:
            missing.append(name)
            continue
        compared += 1
        found = _difference(None, name, mine, expected[DECODE_PREFIX + name])
        if found is not None:
            return found, compared, missing
    return None, compared, missing


def exact_required(folder: str) -> bool:
    """True when the set's noise study shows that running its linear layers and einsums through the CPU's
    native kernels (what --fast does) leaves its logits unchanged (`blas_linear_einsum` all zero)."""
    try:
        with open(os.path.join(folder, "meta.json")) as fh:
            noise = json.load(fh)["noise"]["blas_linear_einsum"]
        return all(v["max_abs"] == 0 for v in noise.values())
    except (OSError, KeyError, ValueError, TypeError):
        return True  # without a noise study, demand exactness


def spec_capture_names(n_stages: int) -> list[str]:
    """The drafter's per-step captures in the order its README checks them (each one feeds the next)."""
    stages = [
        f"spec.stages.{k}.{name}" for k in range(n_stages) for name in ("attn_out", "ffn_out", "out", "pre_mix_out")
    ]
    return (
        ["spec.main_hidden", "spec.main_x"]
        + stages
        + [
            "spec.final_norm",
            "spec.base_logits",
            "spec.markov_embed",
            "spec.markov_bias",
            "spec.logits",
            "spec.output_ids",
            "spec.confidence",
        ]
    )


SPEC_VERDICT = ("spec.base_logits", "spec.markov_bias", "spec.logits", "spec.confidence")  # judged at EXACT_ATOL


def run_golden(folder: str, reference_numerics: bool = True, verbose: bool = True, trace: bool = False) -> GoldenResult:
    """Run the folder's prefill and decode steps and compare the logits (and the prefill captures);
    with `trace`, also every decode step's captures and the final caches (see the module docstring)."""
    folder = os.fspath(folder)
    name = os.path.basename(os.path.normpath(folder))
    model = load_model(folder)
    if reference_numerics:
        model.set_reference_numerics(True)
    inputs = load_file(os.path.join(folder, "inputs.safetensors"))
    expected = load_file(os.path.join(folder, "expected.safetensors"))
    if "engram_token_map" in inputs and model.engram_hash is not None:
        model.set_engram_token_map(inputs["engram_token_map"])
    prompt, steps = inputs["input_ids"].long(), inputs["decode_ids"].long()
    b, s = prompt.shape
    vision_lines: list[str] = []
    vision_ok, inputs_embeds, token_types = True, None, inputs.get("token_types")
    if any(k.startswith("image_pixels.") for k in inputs):
        vision_ok, inputs_embeds, token_types = _vision_inputs(model, inputs, expected, vision_lines)
    n = steps.size(1)
    cache = model.new_cache(b, s + n)
    captured: dict = {}
    step_names = decode_capture_names(expected) if trace else []
    step_diffs: list[CaptureDiff | None] = []
    # the DSpark drafter runs after every backbone forward (its rings hold backbone rows)
    spec = "spec.base_logits" in expected and len(model.mtp) > 0
    drafter: dict | None = {} if spec else None
    spec_steps: list[dict] = []
    lines = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        prefill = model(
            prompt,
            0,
            cache,
            last_only=True,
            trace=captured,
            drafter_inputs=drafter,
            token_types=token_types,
            inputs_embeds=inputs_embeds,
        )[:, -1]
        if spec:
            captured["spec.main_hidden_prefill"] = drafter["main_hidden"]
            model.draft_prefill(drafter["main_hidden"], 0, cache)
        decode = []
        for t in range(n):
            step_trace = {} if step_names else None
            decode.append(
                model(steps[:, t : t + 1], s + t, cache, last_only=True, trace=step_trace, drafter_inputs=drafter)[
                    :, -1
                ]
            )
            if step_names:
                step_diffs.append(step_capture_difference(t, step_names, expected, step_trace))
            if spec:
                spec_trace = {"spec.main_hidden": drafter["main_hidden"][:, 0]}
                model.draft(inputs["spec_input_ids"][t].long(), drafter["main_hidden"], s + t, cache, trace=spec_trace)
                spec_steps.append(spec_trace)
        seconds = time.perf_counter() - t0
    ref_prefill = expected["prefill_logits"]
    prefill_err = (prefill - ref_prefill).abs().max().item()
    lines.append(
        f"{name}: batch {b}, prefill {s}, decode {n} steps, {seconds:.2f}s "
        f"({'reference' if reference_numerics else 'fast'} numerics{', traced' if step_names else ''})"
    )
    lines.append(f"  prefill   max abs {prefill_err:.3e}  rel {prefill_err / ref_prefill.abs().max().item():.3e}")
    decode_abs, decode_rel = [], []
    for t in range(n):
        ref = expected["decode_logits"][t]
        err = (decode[t] - ref).abs().max().item()
        decode_abs.append(err)
        decode_rel.append(err / ref.abs().max().item())
        step_note = ""
        if step_names:
            step_note = (
                "  captures identical" if step_diffs[t] is None else f"  first capture diff: {step_diffs[t].name}"
            )
        lines.append(f"  decode {t:2d} max abs {err:.3e}  rel {decode_rel[-1]:.3e}{step_note}")
    mine, ref = torch.stack(decode), expected["decode_logits"]
    rms_ratio = ((mine - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    agreement = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
    worst = max([prefill_err] + decode_abs)
    exact = worst <= EXACT_ATOL
    if reference_numerics or exact_required(folder):
        tolerance = f"exact: atol {EXACT_ATOL:g} on every logit"
        passed = exact
    else:
        tolerance = (
            f"accumulation-order: prefill atol {LOOSE_PREFILL_ATOL}, decode rms ratio <= "
            f"{LOOSE_DECODE_RMS_RATIO}, argmax agreement >= {LOOSE_ARGMAX_AGREEMENT}"
        )
        passed = exact or (
            prefill_err <= LOOSE_PREFILL_ATOL
            and rms_ratio <= LOOSE_DECODE_RMS_RATIO
            and agreement >= LOOSE_ARGMAX_AGREEMENT
        )
    lines.append(f"  decode rms ratio {rms_ratio:.4f}, argmax agreement {agreement:.3f}, max abs overall {worst:.3e}")
    lines.extend(vision_lines)
    passed = passed and vision_ok
    spec_result = _compare_spec(expected, captured, spec_steps, len(model.mtp), lines) if spec else None
    if spec_result is not None:
        passed = passed and spec_result[0] <= EXACT_ATOL and spec_result[1]
    first = first_capture_difference(expected, captured)
    lines.append(f"  first differing capture: {first or 'none (all captures identical)'}")
    result = GoldenResult(
        name, tolerance, prefill_err, decode_abs, decode_rel, rms_ratio, agreement, exact, passed, first, lines
    )
    if spec_result is not None:
        result.spec_max_abs, result.spec_tokens_equal, result.first_spec_diff = spec_result
    if trace and not step_names:
        lines.append("  decode captures: none in this set (no per-step decode.* captures to compare)")
    elif trace:
        result.decode_steps_traced = n
        result.first_decode_diff = next((d for d in step_diffs if d is not None), None)
        result.identical_decode_steps = n if result.first_decode_diff is None else result.first_decode_diff.step
        if result.first_decode_diff is None:
            lines.append(f"  decode captures: all {n} steps identical ({len(step_names)} captures per step)")
        else:
            same = result.identical_decode_steps
            same = f"steps 0-{same - 1} identical; " if same else ""
            differing = sum(d is not None for d in step_diffs)
            lines.append(
                f"  first differing decode capture: {result.first_decode_diff} ({same}{differing} of {n} steps differ)"
            )
        final, compared, missing = final_cache_difference(expected, cache, b)
        result.final_cache_diff, result.final_caches_compared = final, compared
        if final is not None:
            lines.append(f"  first differing final cache: {final.where()}: {final.detail}")
        elif compared:
            lines.append(f"  final caches: all {compared} identical (window rings, compressed KV, index keys)")
        if missing:
            lines.append(f"  final caches not held by the model's cache (skipped): {', '.join(missing)}")
    lines.append(f"{'PASS' if passed else 'FAIL'} ({tolerance})")
    if verbose:
        print("\n".join(lines))
    return result


def _vision_inputs(model, inputs: dict, expected: dict, lines: list[str]):
    """Preprocess the set's images, embed the prompt with their spans, and compare every vision stage
    with the set's `vision.*` values exactly (its README: bit-identical). Returns (all equal,
    inputs_embeds, token_types)."""
    from dsv41.vision.processor import IMAGE_START, ImageProcessor

    types = inputs["token_types"].long()
    starts = (types == IMAGE_START).nonzero().tolist()  # (row, start) in row-major order = image numbering
    processor = ImageProcessor.from_config(model.cfg)
    images = [(row, start, processor(inputs[f"image_pixels.{k}"])) for k, (row, start) in enumerate(starts)]
    trace: dict = {}
    with torch.inference_mode():
        embeds, built_types = model.embed_inputs(inputs["input_ids"].long(), images, trace)
    mine = {f"vision.images.{k}.patches": image.patches for k, (_, _, image) in enumerate(images)}
    mine.update(trace)
    mine["vision.embed_merged"] = embeds
    ok = torch.equal(built_types, types)
    differ = [] if ok else ["token_types (span layout)"]
    for name in sorted(n for n in expected if n.startswith("vision.")):
        got = mine.get(name)
        if got is None or got.shape != expected[name].shape or not torch.equal(got, expected[name]):
            ok = False
            detail = (
                "missing"
                if got is None
                else (
                    f"shape {tuple(got.shape)} vs {tuple(expected[name].shape)}"
                    if got.shape != expected[name].shape
                    else f"max abs {(got.float() - expected[name].float()).abs().max().item():.3e}"
                )
            )
            differ.append(f"{name} ({detail})")
    lines.append(
        f"  vision: {len(images)} images; processor / ViT / aligner / merged embedding "
        + ("all bit-identical" if ok else "DIFFER: " + ", ".join(differ))
    )
    return ok, embeds, types


def _compare_spec(
    expected: dict, captured: dict, steps: list[dict], n_stages: int, lines: list[str]
) -> tuple[float, bool, CaptureDiff | None]:
    """The drafter against the set's `spec.*` values: (max abs over its logits and confidence, drafted ids all
    equal, the first differing capture in check order)."""
    prefill = expected.get("spec.main_hidden_prefill")
    if prefill is not None and not torch.equal(captured["spec.main_hidden_prefill"], prefill):
        lines.append("  DSpark: spec.main_hidden_prefill differs")
    names = [n for n in spec_capture_names(n_stages) if n in expected]
    first = None
    for t, trace in enumerate(steps):
        for name in names:
            diff = _difference(t, name, trace[name], expected[name][t])
            if diff is not None:
                first = diff
                break
        if first is not None:
            break
    worst = max(
        (trace[n].float() - expected[n][t].float()).abs().max().item()
        for t, trace in enumerate(steps)
        for n in SPEC_VERDICT
        if n in expected
    )
    tokens = all(torch.equal(trace["spec.output_ids"], expected["spec.output_ids"][t]) for t, trace in enumerate(steps))
    lines.append(
        f"  DSpark drafter ({len(steps)} steps): logits / bias / confidence max abs {worst:.3e}, "
        f"drafted ids {'all equal' if tokens else 'DIFFER'}"
    )
    lines.append(f"  DSpark first differing capture: {first if first is not None else 'none (all identical)'}")
    return worst, tokens, first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv41.golden", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="a golden folder (config.json, model/inputs/expected.safetensors, meta.json)")
    parser.add_argument(
        "--fast",
        action="store_true",
        help="run the machine's fast kernels instead of canonical numerics (not bit-exact)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also capture every decode step and report the first (step, capture) that differs "
        "from the set's per-step captures, and compare the final caches (slower)",
    )
    args = parser.parse_args(argv)
    try:
        result = run_golden(args.folder, reference_numerics=not args.fast, trace=args.trace)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        print("FAIL (could not run the folder)")
        return 2
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
