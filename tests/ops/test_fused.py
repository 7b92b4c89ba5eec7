"""Fused (compiled) kernels against their eager references: bit-identical, batch-invariant, never used
where they are not (the probe must be able to say no), and no change to the model's outputs."""

import shutil

import pytest
import torch

from dsv41 import ops
from dsv41.ops import fused, indexer, mhc, sinkhorn

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="torch.compile on CPU needs a C++ compiler"
)


def _mixes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, 24, generator=g) * 3, torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (5, 1), (3, 300)])
def test_fused_sinkhorn_is_bit_identical_to_the_eager_reference(shape, monkeypatch):
    mixes, scale, base = _mixes(shape, sum(shape))
    with torch.inference_mode():
        got = ops.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
        monkeypatch.setenv("DSV41_FUSED", "0")
        want = ops.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    assert sinkhorn.fused_normalize_agrees(4, 20, 1e-6, "cpu")  # the fused path did run above
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@needs_compiler
def test_fused_sinkhorn_rows_do_not_depend_on_the_batch():
    mixes, scale, base = _mixes((40, 1), 3)
    with torch.inference_mode():
        whole = ops.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)[2]
        for i in (0, 17, 39):
            assert torch.equal(ops.hc_split_sinkhorn(mixes[i : i + 1], scale, base, 4, 20, 1e-6)[2], whole[i : i + 1])


def test_sinkhorn_under_autograd_takes_the_eager_path_and_has_gradients():
    mixes, scale, base = _mixes((2, 3), 4)
    mixes.requires_grad_(True)
    pre, post, comb = ops.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    (comb.square().sum() + pre.sum() + post.sum()).backward()
    assert mixes.grad is not None and mixes.grad[..., 8:].abs().sum() > 0
    assert torch.equal(
        comb.detach(),
        sinkhorn.sinkhorn_normalize(
            torch.exp(
                (mixes.detach()[..., 8:] * scale[2] + base[8:]).unflatten(-1, (4, 4))
                - (mixes.detach()[..., 8:] * scale[2] + base[8:]).unflatten(-1, (4, 4)).amax(-1, keepdim=True)
            ),
            20,
            1e-6,
        ),
    )


def test_the_probe_says_no_to_another_summation_order_and_to_a_kernel_that_fails():
    """A row sum paired as (c0 + c2) + (c1 + c3) (what a vectorising compiler may emit) differs from ATen's
    left-to-right sum in the last bit on some rows: `agrees` must reject it, and a fused version that
    cannot be built must fall back with a warning rather than fail the model."""

    def paired(comb, iters, eps):
        c0, c1, c2, c3 = comb.unbind(-1)
        comb = comb / ((c0 + c2) + (c1 + c3)).unsqueeze(-1) + eps
        return comb / (comb.sum(dim=-2, keepdim=True) + eps)

    def reference(comb, iters, eps):
        comb = comb / comb.sum(dim=-1, keepdim=True) + eps
        return comb / (comb.sum(dim=-2, keepdim=True) + eps)

    def broken(comb, iters, eps):
        raise RuntimeError("no compiler")

    g = torch.Generator().manual_seed(0)
    cases = [(torch.exp(torch.randn(517, 4, 4, generator=g) * 3), 1, 1e-6)]
    assert fused.agrees(sinkhorn.fused_normalize, reference, cases)  # the explicit left-to-right chain
    assert not fused.agrees(paired, reference, cases)
    with pytest.warns(UserWarning, match="eager reference"):
        assert not fused.agrees(broken, reference, cases)


@needs_compiler
@pytest.mark.parametrize("s,h,t", [(1, 8, 4096), (7, 8, 999), (64, 4, 512), (300, 16, 64)])
def test_fused_index_score_epilogue_is_bit_identical(s, h, t):
    """bf16 products with ties, zeros and negatives (ReLU), weights of both signs."""
    g = torch.Generator().manual_seed(s * t)
    per_head = (torch.randint(-6, 7, (s, h, t), generator=g) / 2 + torch.randn(s, h, t, generator=g) * 0.1).bfloat16()
    weights = torch.randn(s, h, generator=g).bfloat16()
    with torch.inference_mode():
        got = indexer._compiled_epilogue()(per_head, weights)
    assert torch.equal(got, indexer.score_epilogue(per_head, weights))
    assert torch.equal(got, per_head.clone().relu_().mul_(weights.unsqueeze(-1)).sum(dim=1))  # the in-place eager


@needs_compiler
def test_model_logits_are_the_same_with_and_without_fused_kernels(monkeypatch):
    from dsv41.config import small
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    cfg = small()
    model = init_random_weights(Transformer(cfg), seed=3).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 600), generator=torch.Generator().manual_seed(2))
    out = []
    for flag in ("1", "0"):
        monkeypatch.setenv("DSV41_FUSED", flag)
        with torch.inference_mode():
            cache = model.new_cache(2, 700)
            prefill = model(ids[:, :512], 0, cache)  # 512 queries x 256 keys: the fused epilogue's size
            decode = torch.cat([model(ids[:, i : i + 1], i, cache) for i in range(512, 520)], dim=1)
        out.append((prefill, decode))
    assert indexer.epilogue_fusion_agrees(cfg.index_n_heads, "cpu")
    assert mhc.mix_fusion_agrees(cfg.hc_mult, "cpu")  # the fused expand ran too
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def _expand_case(rows, dim, seed, hc=4):
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(1, rows, dim, generator=g) * 4).bfloat16(),
        (torch.randn(1, rows, hc, dim, generator=g) * 4).bfloat16(),
        torch.rand(1, rows, hc, generator=g) * 2,
        torch.rand(1, rows, hc, hc, generator=g) * 2,
    )


@needs_compiler
@pytest.mark.parametrize("rows,dim", [(1, 384), (9, 64), (1024, 384)])
def test_fused_mhc_expand_is_bit_identical(rows, dim):
    args = _expand_case(rows, dim, rows + dim)
    with torch.inference_mode():
        got = mhc.compiled_post()(*args)
    assert torch.equal(got, mhc.hc_post_eager(*args))


def test_the_expand_probe_says_no_to_another_summation_order():
    """The copies summed last to first differ from ATen's left-to-right sum in the last bit on some values."""

    def reversed_chain(out, residual, post, comb):
        mixed = comb[..., 3, :, None] * residual[..., 3, None, :].float()
        for i in (2, 1, 0):
            mixed = mixed + comb[..., i, :, None] * residual[..., i, None, :].float()
        return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).type_as(out)

    cases = [_expand_case(517, 384, 1)]
    assert fused.agrees(mhc.hc_post_chain, mhc.hc_post_eager, cases)
    assert not fused.agrees(reversed_chain, mhc.hc_post_eager, cases)


@needs_compiler
@pytest.mark.parametrize(
    "dtype,rows,n", [(torch.bfloat16, 1, 65536), (torch.bfloat16, 64, 4160), (torch.float16, 300, 301)]
)
def test_fused_canonical_keys_are_the_eager_keys(dtype, rows, n, monkeypatch):
    """Ties, -0.0 next to +0.0, +-inf: the same int32 keys, so the same top-k (checked against a sort)."""
    g = torch.Generator().manual_seed(n)
    scores = (torch.randint(-9, 10, (rows, n), generator=g) / 4).to(dtype)
    scores[:, ::7], scores[:, 1::11], scores[:, 2::13] = -torch.inf, -0.0, torch.inf
    with torch.inference_mode():
        got = ops.indexer.canonical_keys(scores)
        top = ops.topk_canonical(scores, 64)
        monkeypatch.setenv("DSV41_FUSED", "0")
        want = ops.indexer.canonical_keys(scores)
    assert indexer.keys16_fusion_agrees("cpu") and got.dtype == torch.int32
    assert torch.equal(got, want)
    # independent: sort by (score desc, position asc) with -0.0 == +0.0
    order = sorted(range(n), key=lambda i: (-float(scores[0, i]), i))[:64]
    assert top[0].tolist() == order


def test_a_verdict_can_be_deferred_and_settled_in_the_background():
    """Kernels built in the background never make a caller wait: until the probe is done (here it blocks
    on an event), a call answers False (the eager reference runs); then the probe's answer, computed once."""
    import threading

    release, calls = threading.Event(), []

    def probe(x):
        calls.append(x)
        release.wait(10)
        return x > 0

    verdict = fused.Verdict(probe)
    verdict.defer(5)
    assert verdict(5) is False and calls == []  # deferred: no probe, no wait
    thread = fused.settle_in_background([(verdict, (5,)), (verdict, (-1,))])
    assert verdict(5) is False and verdict.peek(5) is None  # being built: no wait either
    release.set()
    thread.join(10)
    assert verdict(5) is True and verdict(-1) is False and verdict.peek(5) is True
    assert calls == [5, -1]  # each probed once
    assert verdict(7) is True and calls[-1] == 7  # not deferred: probed on the caller's thread


@needs_compiler
def test_the_engine_serves_before_its_kernels_are_built_with_the_same_tokens():
    """fused_kernels='off' and 'background' start serving at once with the eager references; the greedy
    tokens are those of an engine whose kernels were built first ('now')."""
    from dsv41.config import preset
    from dsv41.engine import SamplingParams
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer
    from tests.engine.helpers import make, prompts

    model = init_random_weights(Transformer(preset("tiny")), seed=2).eval()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = prompts([9, 30, 70])
    verdicts = [verdict for verdict, _ in model._kernel_probes().values()]
    for verdict in verdicts:  # as in a fresh process: nothing built yet
        verdict.cache_clear()
    off = make(model, fused_kernels="off")
    assert set(off.fused_kernels.values()) == {None}
    got = {"off": [o.token_ids for o in off.generate(batch, params)]}
    assert set(model.kernel_status().values()) == {None}  # still not built: the eager references ran
    got["background"] = [o.token_ids for o in make(model, fused_kernels="background").generate(batch, params)]
    now = make(model, fused_kernels="now")
    assert all(now.fused_kernels.values())
    want = [o.token_ids for o in now.generate(batch, params)]
    assert got == {"off": want, "background": want}
    with pytest.raises(ValueError, match="fused_kernels"):
        make(model, fused_kernels="later")
