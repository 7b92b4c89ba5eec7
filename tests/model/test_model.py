"""Behaviour of the full model beyond parity: causality, decode == prefill, chunked prefill, caches."""

import copy

import pytest
import torch

import dsv41
from dsv41.accounting import account, dspark_params, vision_params
from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.layers import Linear
from dsv41.model.transformer import Transformer
from tests.conftest import pin_routing


def _ids(b, s, seed=0, vocab=1024):
    return torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_causality_through_compressor_indexer_and_candidate_pool(tiny_model):
    ids = _ids(2, 40)
    base = tiny_model(ids)
    for t in (5, 17, 31, 39):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 7) % 1024
        out = tiny_model(changed)
        assert torch.equal(out[:, :t], base[:, :t]), f"logits before {t} moved"
        assert not torch.equal(out[:, t:], base[:, t:]), "the change had no effect at all"


def _assert_same_up_to_bf16_noise(got, want, rms=0.01):
    rms_ratio = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert (got - want).abs().max() < 0.1 and rms_ratio < rms and agreement > 0.97, (rms_ratio, agreement)


def _decode_steps(model, ids, prompt_len):
    cache = model.new_cache(ids.size(0), ids.size(1))
    steps = [model(ids[:, :prompt_len], 0, cache)]
    steps += [model(ids[:, p : p + 1], p, cache) for p in range(prompt_len, ids.size(1))]
    return torch.cat(steps, dim=1)


@torch.inference_mode()
def test_decode_equals_prefill_when_selection_cannot_flip():
    """With top-k and the candidate pool wide enough to keep every compressed entry, no discrete choice
    depends on ulp-level noise, so step-by-step decode must reproduce the prefill logits across window
    wrap-around (window 8), ratio-2 group boundaries and candidate blocks, up to bf16 accumulation noise
    (GEMM and attention-list shapes differ between the two paths; measured max |dlogit| ~0.03, rms
    ratio ~0.003). A wrong ring slot, group position or visibility rule moves logits far more."""
    cfg = tiny().replace(index_topk=56, candidate_topk_blocks=64)
    model = pin_routing(init_random_weights(Transformer(cfg), seed=1, std=0.1).eval())  # MoE cannot flip either
    ids = _ids(2, 37, seed=3)
    full = model(ids)
    for prompt_len in (1, 4, 7, 20):
        _assert_same_up_to_bf16_noise(_decode_steps(model, ids, prompt_len), full)


def _selected(trace, key, b, t):
    return sorted(i for i in trace[key][b, t].tolist() if i >= 0)


def _first_selection_flips(model, ids, prompt_len):
    """Per batch row, the first position whose top-k selection (any layer) differs between step-by-step
    decode and one prefill, or the sequence length if none does."""
    full = {}
    model(ids, trace=full)
    keys = [k for k in full if k.endswith(".topk_idxs")]
    cache = model.new_cache(ids.size(0), ids.size(1))
    flips = [ids.size(1)] * ids.size(0)
    spans = [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, ids.size(1))]
    for a, b in spans:
        step = {}
        model(ids[:, a:b], a, cache, trace=step)
        for row in range(ids.size(0)):
            for t in range(a, b):
                if t < flips[row] and any(_selected(step, k, row, t - a) != _selected(full, k, row, t) for k in keys):
                    flips[row] = t
    return flips


@torch.inference_mode()
def test_decode_tracks_prefill_with_sparse_selection():
    """Default tiny config (top-6 of up to 36 entries, 3 candidate blocks): a near-tie in the bf16 index
    scores can pick a different entry in decode than in prefill (different GEMM shapes). Where that first
    happens depends on the CPU's accumulation order (position 25 on an AMD EPYC, 22 and 24 on an AMX Xeon),
    so it is measured from the selections themselves: until then decode must equal prefill up to bf16
    noise, and in distribution overall (MoE routing pinned: this is about the attention selection)."""
    model = pin_routing(init_random_weights(Transformer(tiny()), seed=1, std=0.1).eval())
    ids = _ids(2, 37, seed=3)
    full = model(ids)
    got = _decode_steps(model, ids, 4)
    flips = _first_selection_flips(model, ids, 4)
    assert min(flips) >= 12, flips  # enough decode steps before the first flip for the check to mean much
    for row, flip in enumerate(flips):
        _assert_same_up_to_bf16_noise(got[row, :flip], full[row, :flip])
    rms_ratio = (got - full).pow(2).mean().sqrt() / full.pow(2).mean().sqrt()
    # after a flip the two paths attend to different entries: measured rms 0.063 / argmax 0.97 (EPYC),
    # 0.082 / 0.93 (AMX Xeon); a wrong ring slot or visibility rule gives rms ~1
    assert rms_ratio < 0.15 and (got.argmax(-1) == full.argmax(-1)).float().mean() > 0.85


@torch.inference_mode()
def test_chunked_prefill_matches_one_prefill():
    cfg = tiny().replace(index_topk=56, candidate_topk_blocks=64)
    model = pin_routing(init_random_weights(Transformer(cfg), seed=4, std=0.1).eval())
    ids = _ids(1, 29, seed=5)
    full = model(ids)
    cache = model.new_cache(1, 29)
    parts = [model(ids[:, a:b], a, cache) for a, b in ((0, 5), (5, 14), (14, 15), (15, 29))]
    # chunking changes each query's attention layout (fresh window vs ring, the width of the selection
    # list), hence its fp32 reduction order, which later bf16 roundings amplify: measured rms ratio 0.0129
    # on an Intel Xeon (AMX) host, under 0.01 on the AMD host this test was written on. The bit-exact
    # reproduction of a chunked computation is tested in tests/model/test_replay.py.
    _assert_same_up_to_bf16_noise(torch.cat(parts, 1), full, rms=0.02)


@torch.inference_mode()
def test_last_only_equals_last_row(tiny_model):
    ids = _ids(2, 12)
    torch.testing.assert_close(tiny_model(ids, last_only=True)[:, -1], tiny_model(ids)[:, -1], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_bad_calls_raise_clear_errors(tiny_model):
    ids = _ids(1, 4)
    with pytest.raises(ValueError, match="cache"):
        tiny_model(ids, start_pos=3)
    cache = tiny_model.new_cache(1, 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_model(_ids(1, 9), 0, cache)
    with pytest.raises(ValueError, match="token ids"):
        tiny_model(torch.tensor([[5, 2000]]))
    with pytest.raises(ValueError, match="batch"):
        tiny_model(_ids(2, 4), 0, cache)


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes -> values, from the format's definition (sign, 2 exponent bits with bias 1, 1
    mantissa bit; exponent 0 is subnormal), written apart from dsv41.ops.quant's lookup table."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = torch.where(exp == 0, 0.5 * man, 2.0 ** (exp - 1) * (1 + 0.5 * man))
    return torch.where(sign == 1, -mag, mag)


def _decode_stored_weight(lin) -> torch.Tensor:
    """A quantized Linear's stored bytes -> fp32 [out, in]: packed FP4 (even element in the low nibble)
    times one UE8M0 scale per 32 inputs, or E4M3 times one UE8M0 scale per 32x32 tile (spec §13)."""
    if lin.fmt == "fp4":
        byte = lin.weight.view(torch.uint8).long()
        values = torch.stack([_e2m1(byte & 15), _e2m1(byte >> 4)], -1).flatten(-2)
        return (values.unflatten(-1, (-1, 32)) * lin.scale.float().unsqueeze(-1)).flatten(-2)
    n, k = lin.weight.shape
    return lin.weight.float() * lin.scale.float().repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]


@torch.inference_mode()
def test_quantized_storage_model_runs_and_tracks_bf16():
    """fp8 dense + fp4 experts, built from the same random weights as a bf16 model, stays close.

    The logits alone are a weak check: ten layers compound the rounding (and flip routing picks), so the
    healthy rms ratio is 0.29-0.43 over seeds 0-3 while FP4 experts that output nothing give 0.57-0.69.
    So each layer's MoE is also fed the quantized model's own input, where the gate (bf16 in both) picks
    the same experts, and checked two ways:
    - against the bf16 layer: the routed part (MoE output minus shared expert) differs only by the
      storage rounding, rms ratio 0.18-0.23 over seeds 0-2; FP4 experts that output nothing give exactly
      1.0, swapped nibbles 1.26-1.71, flipped signs 1.47-1.99, doubled scales 7.7-8.2;
    - against a bf16 MoE holding the stored weights decoded here (exact in bf16): only the FP8 rounding of
      the activations remains (E4M3, ~3.6% rms per value), measured 0.042-0.057 per layer; decoding the
      FP8 tiles at the wrong size gave 0.28-0.44."""
    cfg16 = tiny()
    cfg8 = cfg16.replace(dtype="fp8", expert_dtype="fp4")
    m16 = init_random_weights(Transformer(cfg16), seed=2, std=0.1).eval()
    m8 = init_random_weights(Transformer(cfg8), seed=2, std=0.1).eval()
    assert m8.layers[0].ffn.experts[0].w1.fmt == "fp4" and m8.layers[0].ffn.shared_experts.w1.fmt == "fp8"

    def rel(want, got):
        return ((want.float() - got.float()).pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt()).item()

    seen = []  # (layer, MoE input, MoE output) of the quantized model
    hooks = [
        block.ffn.register_forward_hook(lambda mod, args, out, i=i: seen.append((i, args[0], out)))
        for i, block in enumerate(m8.layers)
    ]
    ids = _ids(1, 20)
    a, b = m16(ids), m8(ids)
    for hook in hooks:
        hook.remove()
    assert torch.isfinite(b).all()
    assert len(seen) == cfg16.n_layers
    for i, x, out8 in seen:
        moe16, moe8 = m16.layers[i].ffn, m8.layers[i].ffn
        out16 = moe16(x)
        routed16 = out16.float() - moe16.shared_experts(x).float()
        routed = rel(routed16, out8.float() - moe8.shared_experts(x).float())
        assert routed < 0.4, f"layer {i}: routed experts vs bf16, rms ratio {routed:.3f}"
        whole = rel(out16, out8)
        assert whole < 0.3, f"layer {i}: MoE vs bf16, rms ratio {whole:.3f}"

        decoded = copy.deepcopy(moe16)
        stored = dict(moe8.named_modules())
        for name, lin in decoded.named_modules():
            if isinstance(lin, Linear):
                w = _decode_stored_weight(stored[name])
                lin.weight.copy_(w.to(torch.bfloat16))
                assert torch.equal(lin.weight.float(), w), name  # the decoded values fit bf16 exactly
        exact = rel(decoded(x), out8)
        assert exact < 0.1, f"layer {i}: MoE vs its decoded weights in bf16, rms ratio {exact:.3f}"
    assert rel(a, b) < 0.5, f"logits vs bf16, rms ratio {rel(a, b):.3f}"


def test_flash_builds_on_meta_and_matches_accounting():
    cfg = dsv41.flash()
    with torch.device("meta"):
        model = Transformer(cfg)
    logical = sum(
        p.numel() * (2 if p.dtype == torch.int8 else 1) for n, p in model.named_parameters() if not n.endswith(".scale")
    )
    acc = account(cfg)
    # the module tree holds backbone + Engram tables + the DSpark drafter + the vision tower
    assert logical == acc["params_total"]
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("vision.", "aligner.", "image_")))
    assert vision == vision_params(cfg) and 0.4e9 < vision < 0.5e9
    drafter = sum(
        p.numel() * (2 if p.dtype == torch.int8 else 1)
        for n, p in model.mtp.named_parameters()
        if not n.endswith(".scale")
    )
    assert drafter == dspark_params(cfg) and 14.0e9 < drafter < 14.4e9  # "~14.2B DSpark" (spec §12)
    assert acc["params_total"] == 763_205_315_794  # HF safetensors.total of the release (spec §12)
    assert acc["kv_bytes_per_token"] == 890
    assert model.layers[20].attn.compressor is not None and model.layers[21].attn.compressor is None
    assert [i for i, b in enumerate(model.layers) if b.attn.indexer is not None] == list(cfg.index_source_layers)


def test_random_init_leaves_no_matrix_at_zero_and_routes_tokens_apart():
    """A from-scratch model must start with every weight matrix random: a zero router ties every score,
    so all tokens pick the same experts (the collapse this test guards against)."""
    cfg = tiny()
    model = init_random_weights(Transformer(cfg), seed=0)
    for name, p in model.named_parameters():
        if p.ndim == 2 and p.dtype.is_floating_point and "hc_" not in name:
            assert p.float().abs().max() > 0, name
    gate = model.layers[0].ffn.gate
    x = torch.randn(64, cfg.dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    _, picks = gate(x)
    assert torch.unique(picks).numel() == cfg.n_routed_experts


@torch.inference_mode()
def test_chunking_and_decode_are_bit_identical_under_engine_numerics():
    """On the released 40-layer schedule (the real40 golden config, random weights): with batch-invariant
    GEMMs and canonical top-k ties (`Transformer.numerics(16)`, what the engine runs), a prefill in
    chunks of 7, in two chunks, or one token at a time (positions 12-31, across the 8-slot window, the top-k
    and candidate-block counts, then 60-71, across original_seq_len 64) gives exactly the logits of one
    prefill. (Under the reference numerics the same runs differ by rms ratio ~0.2 and argmax ~0.7, measured
    at 120 tokens: tie flips and row-count-dependent GEMM orders.)"""
    from dsv41.config import ModelConfig

    cfg = ModelConfig.from_file("tests/data/golden/v41-real40-fp8/config.json")
    model = init_random_weights(Transformer(cfg), seed=3).eval()
    n = 72
    ids = _ids(1, n, seed=0, vocab=cfg.vocab_size)

    def run(chunks):
        cache, outs, start = model.new_cache(1, n), [], 0
        for size in chunks:
            outs.append(model(ids[:, start : start + size], start, cache))
            start += size
        return torch.cat(outs, 1)

    with model.numerics(16):
        one = run([n])
        for chunks in ([7] * 10 + [2], [40, 32], [12] + [1] * 20 + [28] + [1] * 12):
            assert torch.equal(run(chunks), one), chunks
