"""Canonical numerics (dsv41.ops.canonical, the reference mode's one rule) against independent
formulations: Python floats (IEEE float64), math.fsum (the exactly rounded sum) and numpy float32
scalars. Each test also shows that the machine's own fp32 kernels or another order give other bits on
the same data, so an implementation that computed differently would fail it."""

import math

import numpy as np
import torch
import torch.nn.functional as F

from dsv41 import ops
from dsv41.ops import canonical
from dsv41.ops.reductions import mean_of_squares, sum_fp32_terms
from dsv41.ops.sparse_attn import sparse_attn


def _spread(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values over ~40 binary orders of magnitude, so float64 sums of them round at some steps and
    fp32 sums at many."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, n), generator=g).float())


def _tree_sum(values: list[float]) -> float:
    """The README's pairwise tree with Python floats: zero-pad to a power of two, add i + n/2 onto i, halve."""
    width = 1 << max(len(values) - 1, 0).bit_length()
    t = values + [0.0] * (width - len(values))
    while width > 1:
        width //= 2
        t = [t[i] + t[i + width] for i in range(width)]
    return t[0]


def test_pairwise_sum_is_the_readme_tree():
    x = _spread(32, 257)
    got = canonical.pairwise_sum(x)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.tensor([_tree_sum(row.tolist()) for row in x], dtype=torch.float64))
    # another order gives other float64 bits on this data, so the test can fail
    left_to_right = torch.tensor([sum(row.tolist()) for row in x], dtype=torch.float64)
    assert not torch.equal(left_to_right, got)
    # any dim, keepdim
    y = x.view(32, 1, 257).expand(32, 3, 257).transpose(0, 2)  # [257, 3, 32]
    assert torch.equal(canonical.pairwise_sum(y, dim=0)[0], got)
    assert canonical.pairwise_sum(y, dim=0, keepdim=True).shape == (1, 3, 32)


def test_mean_of_squares_is_fp32_squares_and_one_rounding():
    x = _spread(64, 320, seed=1)
    got = mean_of_squares(x, reference=True)
    want = [np.float32(math.fsum(float(np.float32(v) * np.float32(v)) for v in row) / len(row)) for row in x.numpy()]
    assert torch.equal(got, torch.from_numpy(np.array(want, dtype=np.float32)))
    assert torch.equal(mean_of_squares(x, reference=True, keepdim=True), got.unsqueeze(-1))
    # an fp32 accumulation (one chain) gives other bits on these rows
    chain = torch.tensor(
        [np.float32(sum(np.float32(v) * np.float32(v) for v in row) / np.float32(len(row))) for row in x.numpy()[:16]]
    )
    assert not torch.equal(chain, got[:16])
    assert torch.equal(mean_of_squares(x), x.square().mean(-1))  # the fast path is the plain kernel


def test_dot_products_round_the_exact_sum_once():
    """bf16, fp32 and dequantised FP8 operands: one float64 dot product per output, rounded to fp32 (and
    then bf16 for bf16 outputs) -- the exactly rounded sum where float64 holds the sum exactly."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(12, 96, generator=g) * torch.exp2(torch.randint(-6, 7, (12, 96), generator=g).float())).bfloat16()
    w = torch.randn(40, 96, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    exact = torch.tensor(
        [[math.fsum([a * c for a, c in zip(row, col)]) for col in w.float().tolist()] for row in x.float().tolist()],
        dtype=torch.float64,
    )
    got = ops.linear(x, w, reference=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact.float().bfloat16())
    with_bias = canonical.linear(x, w, b)
    exact_b = torch.tensor(
        [
            [
                math.fsum([a * c for a, c in zip(row, col)] + [bias])
                for col, bias in zip(w.float().tolist(), b.float().tolist())
            ]
            for row in x.float().tolist()
        ]
    )
    assert torch.equal(with_bias, exact_b.double().float().bfloat16())
    # fp32 weights: fp32 result
    assert torch.equal(ops.linear(x.float(), w.float(), reference=True), exact.float())
    # grouped: each group its own canonical GEMM
    grouped = ops.grouped_linear(x.view(12, 1, 96).expand(12, 2, 96), torch.stack([w[:20], w[20:]]), reference=True)
    assert torch.equal(grouped.flatten(-2), got)
    # an FP8 weight: the dequantised operands, one float64 dot product, then fp32 and bf16
    q, s = ops.quant.quantize_fp8_weight(w.float())
    xq, xs = ops.fp8_quant(x)
    xd, wd = ops.quant.fp8_dequant(xq, xs), ops.dequant_weight(q, s)
    exact_q = torch.tensor(
        [[math.fsum([a * c for a, c in zip(row, col)]) for col in wd.tolist()] for row in xd.tolist()]
    )
    assert torch.equal(ops.linear(x, q, s, reference=True), exact_q.double().float().bfloat16())


def test_float32_accumulation_of_the_same_products_differs():
    """Not vacuous: summing the same bf16 products in fp32 in plain order lands on other bf16 values on a
    few outputs near a rounding midpoint."""
    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(128, 64, generator=g) * torch.exp2(torch.randint(-8, 9, (128, 64), generator=g).float())
    ).bfloat16()
    w = torch.randn(512, 64, generator=g).bfloat16()
    acc = torch.zeros(128, 512)
    for j in range(64):
        acc = acc + x.float()[:, j, None] * w.float()[:, j]
    assert not torch.equal(acc.bfloat16(), ops.linear(x, w, reference=True))


def test_transcendentals_are_float64_rounded_once():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4096, generator=g) * 6
    values = x.tolist()
    f32 = lambda vs: torch.tensor(vs, dtype=torch.float64).float()  # noqa: E731  one rounding of Python floats
    assert torch.equal(canonical.exp(x), f32([math.exp(v) for v in values]))
    assert torch.equal(canonical.sigmoid(x), f32([1 / (1 + math.exp(-v)) for v in values]))
    assert torch.equal(canonical.silu(x), f32([v / (1 + math.exp(-v)) for v in values]))
    assert torch.equal(canonical.softplus(x), f32([math.log1p(math.exp(v)) if v <= 20 else v for v in values]))
    assert torch.equal(canonical.gelu(x), f32([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in values]))
    pos = x.abs() + 1e-3
    assert torch.equal(canonical.rsqrt(pos), f32([1 / math.sqrt(v) for v in pos.tolist()]))
    assert torch.equal(canonical.silu(x, torch.bfloat16), f32([v / (1 + math.exp(-v)) for v in values]).bfloat16())
    # the fp32 vector kernels are not this: some element differs
    assert not (
        torch.equal(torch.sigmoid(x), canonical.sigmoid(x))
        and torch.equal(F.silu(x), canonical.silu(x))
        and torch.equal(torch.rsqrt(pos), canonical.rsqrt(pos))
        and torch.equal(F.gelu(x), canonical.gelu(x))
    )


def test_softmax_and_fp32_terms():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50, 7, generator=g) * 3
    want = []
    for row in x.tolist():
        e = [math.exp(v - max(row)) for v in row]
        total = _tree_sum(e)
        want.append([v / total for v in e])
    assert torch.equal(canonical.softmax(x), torch.tensor(want, dtype=torch.float64).float())
    terms = _spread(40, 64, seed=6)
    assert torch.equal(
        sum_fp32_terms(terms, reference=True), torch.tensor([math.fsum(r) for r in terms.tolist()]).float()
    )


def test_canonical_rope_rotation_is_one_float64_rounding():
    table = ops.RotaryTable(16, 160000.0, 64, 4.0)
    freqs = table(3, 5)
    x = torch.randn(2, 5, 3, 24).bfloat16()
    got = ops.apply_rope(x, freqs, 16, reference=True)
    c, s = freqs.real.double(), freqs.imag.double()
    a, b = x[..., 8::2].double(), x[..., 9::2].double()
    want = torch.stack([a * c[:, None] - b * s[:, None], a * s[:, None] + b * c[:, None]], -1).flatten(-2)
    assert torch.equal(got[..., 8:], want.float().bfloat16()) and torch.equal(got[..., :8], x[..., :8])
    inverse = ops.apply_rope(got, freqs, 16, inverse=True, reference=True)
    assert (inverse.float() - x.float()).abs().max() < 0.1
    # the table: cos / sin of the fp32 angles in float64, rounded once
    angles = torch.outer(torch.arange(8), table.freqs)
    assert torch.equal(table(0, 8).real, angles.double().cos().float())


def test_canonical_sparse_attention_matches_a_float64_formulation():
    """One index block (<= 64 entries): the online softmax is then the plain one; the canonical kernel's
    result equals a float64 formulation with the README's roundings (fp32 scores and exps, bf16
    probabilities for P.V, fp32 denominator, one final bf16 rounding)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 3, 2, 32, generator=g).bfloat16()
    kv = torch.randn(1, 10, 32, generator=g).bfloat16()
    sink = torch.randn(2, generator=g)
    ids = torch.tensor([[[0, 1, 2, -1], [3, 4, -1, -1], [5, 6, 7, 9]]], dtype=torch.int32)
    got = sparse_attn(q, kv, sink, ids, 32**-0.5, reference=True)
    scale = torch.tensor(32**-0.5)
    for m in range(3):
        rows = [i for i in ids[0, m].tolist() if i >= 0]
        k = kv[0, rows].double()
        for h in range(2):
            logits = (q[0, m, h].double() @ k.T).float() * scale
            top = logits.max()
            p = (logits - top).double().exp().float()
            pv = (p.bfloat16().double() @ k).float()
            denom = p.double().sum().float() + (sink[h] - top).double().exp().float()
            assert torch.equal(got[0, m, h], (pv / denom).bfloat16()), (m, h)
