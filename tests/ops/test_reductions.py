"""The reference's pinned reductions (dsv41.ops.reductions, ops.linear_bf16_pairwise, the per_call step rule)
against independent formulations: Python floats (IEEE fp64) and numpy float32 scalars, summed in the
order the golden sets' README names. Each test also shows another order gives other bits on the same
data, so an implementation that summed differently would fail it."""

import math

import numpy as np
import torch

from dsv41 import ops
from dsv41.ops.lanes import REFERENCE_VECTOR_STEP, _scalar, per_call, reference_step, vector_step
from dsv41.ops.reductions import (_sum_columns_in_order, linear_fp64_accumulate, mean_of_squares,
                                  sum_fp32_terms, sum_fp64_in_order)


def _spread(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values over ~40 binary orders of magnitude, so fp64 sums of their squares round at every
    step and the summation order shows in the last bits."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, n), generator=g).float()))


def _python_sum(values) -> float:
    total = 0.0
    for v in values:  # Python floats are IEEE doubles: left to right, one rounding per add
        total += float(v)
    return total


def test_sum_fp64_in_order_is_a_left_to_right_double_sum():
    x = _spread(64, 257)
    got = sum_fp64_in_order(x)
    want = torch.tensor([_python_sum(row.tolist()) for row in x], dtype=torch.float64)
    assert torch.equal(got, want)
    assert torch.equal(_sum_columns_in_order(x.double()), want)  # the any-device path, same order
    # the right-to-left order gives other bits on this data: the check can fail
    backwards = torch.tensor([_python_sum(row.tolist()[::-1]) for row in x], dtype=torch.float64)
    assert not torch.equal(backwards, want)


def test_pinned_mean_of_squares_matches_the_readme_recipe():
    """fp32 squares, exact to fp64, summed left to right, divided by n in fp64, rounded once to fp32."""
    x = _spread(96, 320, seed=1)
    got = mean_of_squares(x, pinned=True)
    want = []
    for row in x.numpy():
        squares = [float(np.float32(v) * np.float32(v)) for v in row]  # fp32 products, then exact to fp64
        want.append(np.float32(_python_sum(squares) / len(squares)))
    assert torch.equal(got, torch.from_numpy(np.array(want, dtype=np.float32)))
    assert torch.equal(mean_of_squares(x, pinned=True, keepdim=True), got.unsqueeze(-1))
    # bf16 input: the statistic is of its fp32 values
    xb = x.bfloat16()
    assert torch.equal(mean_of_squares(xb, pinned=True), mean_of_squares(xb.float(), pinned=True))
    # the fast path is the vectorised fp32 mean, and it is not this order on these rows
    assert torch.equal(mean_of_squares(x), x.square().mean(-1))
    fp32_sequential = torch.tensor([np.float32(sum(np.float32(v) * np.float32(v) for v in row) / np.float32(len(row)))
                                    for row in x.numpy()[:16]])
    assert not torch.equal(fp32_sequential, got[:16])


def test_pinned_dot_product_sums_its_fp32_terms_in_fp64():
    g = torch.Generator().manual_seed(2)
    h, w, k = (torch.randn(40, 64, generator=g) for _ in range(3))
    terms = h * w * k  # fp32, evaluated (h * w) * k like Engram's gate
    got = sum_fp32_terms(terms, pinned=True)
    want = torch.tensor([np.float32(_python_sum(row.tolist())) for row in terms])
    assert torch.equal(got, want)
    assert torch.equal(sum_fp32_terms(terms), terms.sum(-1))


def _pairwise_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per output: one float32 accumulator fed x[k] * w[k] for k = 1, 0, 3, 2, ... (numpy scalars)."""
    out = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    order = [j for i in range(0, x.shape[1], 2) for j in ((i + 1, i) if i + 1 < x.shape[1] else (i,))]
    for r in range(x.shape[0]):
        for c in range(w.shape[0]):
            acc = np.float32(0)
            for j in order:
                acc = np.float32(acc + np.float32(x[r, j]) * np.float32(w[c, j]))
            out[r, c] = acc
    return out


def test_bf16_pairwise_linear_is_the_dot_product_instruction_order():
    g = torch.Generator().manual_seed(3)
    for k in (64, 37):  # even and odd K (the last term alone)
        x = (torch.randn(6, k, generator=g) * 3).bfloat16()
        w = torch.randn(24, k, generator=g).bfloat16()
        got = ops.linear_bf16_pairwise(x, w)
        want = torch.from_numpy(_pairwise_reference(x.float().numpy(), w.float().numpy())).bfloat16()
        assert torch.equal(got, want), k
        assert ops.linear_bf16_pairwise(x.view(2, 3, k), w).shape == (2, 3, 24)
    # routed through ops.linear / grouped_linear only under reference numerics and only for bf16
    assert torch.equal(ops.linear(x, w, reference=True), got)
    assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, w))
    grouped = ops.grouped_linear(x.view(6, 1, k).expand(6, 2, k), torch.stack([w[:12], w[12:]]), reference=True)
    assert torch.equal(grouped.flatten(-2), got)


def test_bf16_pairwise_order_is_not_the_plain_sequential_order():
    """On outputs whose fp32 sum lands near a bf16 rounding midpoint the order shows: summing k = 0, 1, 2, ...
    instead gives other bf16 values on a few of 65,536 outputs (3-6 for these seeds)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(128, 64, generator=g) * torch.exp2(torch.randint(-8, 9, (128, 64), generator=g).float())).bfloat16()
    w = torch.randn(512, 64, generator=g).bfloat16()
    pairwise = ops.linear_bf16_pairwise(x, w)
    acc = torch.zeros(128, 512)
    for j in range(64):
        acc = acc + x.float()[:, j, None] * w.float()[:, j]
    assert not torch.equal(acc.bfloat16(), pairwise)


def test_fp64_accumulated_linear_rounds_the_exact_sum_once():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 96, generator=g).bfloat16()
    w = torch.randn(16, 96, generator=g).bfloat16()
    b = torch.randn(16, generator=g).bfloat16()
    got = linear_fp64_accumulate(x, w, b)
    exact = [[math.fsum([float(a) * float(c) for a, c in zip(row, col)] + [float(bias)])
              for col, bias in zip(w.float().tolist(), b.float().tolist())] for row in x.float().tolist()]
    assert torch.equal(got, torch.tensor(exact, dtype=torch.float64).bfloat16())
    assert got.dtype == torch.bfloat16


def test_step_rule_emulates_a_kernel_split():
    """per_call(step=s) takes the vector kernel's value for the first n // s * s elements of a call and the
    scalar kernel's for the rest. With this CPU's own step it is the plain call, bit for bit (so emulating
    another CPU's step is the same rule with another number)."""
    here = vector_step("sigmoid", torch.float32, "cpu")
    assert reference_step(True) == REFERENCE_VECTOR_STEP and reference_step(False) is None
    g = torch.Generator().manual_seed(6)
    for n in (1, 15, 16, 33, 100, 376, 1000):
        x = torch.randn(n, generator=g) * 4
        assert torch.equal(per_call("sigmoid", x, None, here), torch.sigmoid(x)), n
        for step in (8, 16, 32, 64):
            got = per_call("sigmoid", x.view(-1, 4) if n % 4 == 0 else x, None, step).reshape(-1)
            body = n // step * step
            vector = torch.sigmoid(torch.cat([x, x.new_zeros(-n % 64 + 64)]))[:n]  # all in the vector body
            assert torch.equal(got[:body], vector[:body]), (n, step)
            assert torch.equal(got[body:], _scalar(torch.sigmoid, x[body:].contiguous())), (n, step)
    # and the rule is visible: on random inputs some element differs between the two kernels here
    x = torch.randn(4096, generator=g) * 4
    if here != 1:
        assert not torch.equal(_scalar(torch.sigmoid, x), torch.sigmoid(torch.cat([x, x.new_zeros(64)]))[:4096])
