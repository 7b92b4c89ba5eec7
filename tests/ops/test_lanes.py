"""ops.lanes.per_call: an elementwise function over many tokens computed as each token's own call would."""

import torch
import torch.nn.functional as F

from dsv41.ops.lanes import FUNCTIONS, per_call, vector_step


def _separately(fn, x, calls):
    out, at = [], 0
    for n in calls:
        out.append(fn(x[at : at + n].clone()))  # a fresh contiguous call of n tokens, as alone
        at += n
    return torch.cat(out)


def test_per_call_equals_separate_calls_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    plain_differs = set()
    for name, fn in FUNCTIONS.items():
        for width in (4, 8, 16, 24):
            calls = [1, 3, 17, 1, 6, 40, 2]
            x = torch.randn(sum(calls), width, generator=g) * 4
            want = _separately(fn, x, calls)
            assert torch.equal(per_call(name, x, calls), want), (name, width)
            if not torch.equal(fn(x), want):
                plain_differs.add(name)
    # the plain call over all tokens is not the same (the scalar tails land elsewhere): not vacuous. Which
    # other functions show it on these inputs depends on the CPU's vector width (AVX-512 machines: sigmoid
    # too; this AVX2 one: silu)
    assert "softplus" in plain_differs


def test_one_call_is_the_plain_function():
    x = torch.randn(13, 8)
    for name, fn in FUNCTIONS.items():
        assert torch.equal(per_call(name, x, None), fn(x))
        assert torch.equal(per_call(name, x, [13]), fn(x))


def test_vector_step_explains_the_kernel():
    step = vector_step("softplus", torch.float32, "cpu")
    assert step is not None and step >= 1
    x = torch.randn(3 * 64 + 5) * 4
    assert torch.equal(per_call("softplus", x.view(-1, 1), [x.numel()]), F.softplus(x).view(-1, 1))


def test_gradients_flow_through_per_call():
    x = torch.randn(10, 8, requires_grad=True)
    per_call("sigmoid", x, [3, 7]).sum().backward()
    s = torch.sigmoid(x.detach())
    torch.testing.assert_close(x.grad, s * (1 - s), atol=1e-6, rtol=0)
