"""The C++ sparse attention of `fast` prefill chunks (dsv41.ops.attn_cpu) against the plain fp32 softmax written
with tensor ops (`ops.sparse_attn.dense_reference_attn`): the same math in another summation order, so equal
after the output's bf16 rounding up to a step of it. Built here with this machine's instruction set: the bf16
dot-product form where the CPU has it, the portable form elsewhere; both are checked by the same tests."""

import pytest
import torch

from dsv41.ops import attn_cpu
from dsv41.ops.sparse_attn import dense_reference_attn, sparse_attn

pytestmark = pytest.mark.skipif(attn_cpu.library() is None, reason="no C++ compiler to build the kernel")


def _case(b=2, m=9, h=3, d=64, n=50, k=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, m, k), generator=g)
    idx[torch.rand(b, m, k, generator=g) < 0.3] = -1  # unused slots anywhere in a row
    idx[0, 0] = -1  # a query with nothing to attend
    return q, kv, sink, idx


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("k", [20, 150])
def test_the_kernel_gives_the_models_attention(d, k):
    """Against `sparse_attn` (the model's attention: bf16 probabilities in blocks of 64 picks with a running
    max): equal up to a bf16 step of the output (the sums run in another order; past 64 picks the probabilities
    are rounded relative to another max); and against the plain fp32 softmax up to those probabilities'
    rounding."""
    q, kv, sink, idx = _case(d=d, k=k, n=200, seed=d + k)
    got = attn_cpu.sparse_attn_cpu(q, kv, sink, idx, d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    model = sparse_attn(q, kv, sink, idx, d**-0.5).float()
    torch.testing.assert_close(got.float(), model, rtol=2**-7, atol=2**-9)
    dense = dense_reference_attn(q, kv, sink, idx, d**-0.5)  # fp32
    torch.testing.assert_close(got.float(), dense, rtol=2**-5, atol=2**-7)
    assert (got[0, 0] == 0).all()  # no valid row: 0, like the reference


def test_the_sink_and_the_scale_are_applied():
    q, kv, sink, idx = _case(seed=3)
    base = attn_cpu.sparse_attn_cpu(q, kv, sink, idx, 0.125)
    assert not torch.equal(base, attn_cpu.sparse_attn_cpu(q, kv, sink + 2, idx, 0.125))
    assert not torch.equal(base, attn_cpu.sparse_attn_cpu(q, kv, sink, idx, 0.125 * 1.1))


def test_bad_shapes_are_refused():
    q, kv, sink, idx = _case()
    with pytest.raises(RuntimeError, match="shapes do not match"):
        attn_cpu.sparse_attn_cpu(q, kv[..., :48], sink, idx, 0.1)
    with pytest.raises(RuntimeError, match="must be bf16"):
        attn_cpu.sparse_attn_cpu(q.float(), kv, sink, idx, 0.1)
