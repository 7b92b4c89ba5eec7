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


# ---------------------------------------------------------------------------------------- a decode step's attention
def _decode_case(b=5, h=3, d=64, w=16, k=12, seed=0):
    """One decode step of b sequences: the FP8 ring as the pool holds it, the new row, selected rows, a valid mask
    with holes (row 0 sees nothing at all)."""
    from dsv41.ops.quant import fp8_quant

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, h, d, generator=g).bfloat16()
    codes, scale = fp8_quant(torch.randn(b, w, d, generator=g) * torch.randn(b, w, 1, generator=g).exp())
    bits = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    kv = (torch.randn(b, 1, d, generator=g) * 2).bfloat16()
    selected = torch.randn(b, k, d, generator=g).bfloat16() if k else None
    valid = torch.rand(b, w + 1 + k, generator=g) > 0.3
    valid[0] = False
    return q, codes, bits, kv, valid, selected, torch.randn(h, generator=g)


@pytest.mark.parametrize("k", [0, 12])
def test_the_decode_kernel_gives_the_window_attention(k):
    """Against `window_attention`'s tensor ops (its reference): the attention equal up to a bf16 step of the
    output (other summation order, probabilities rounded to bf16 for P.V as the model rounds them), the new row's
    ring codes and scales bit for bit (they are what later steps read)."""
    from dsv41.engine.batched import window_attention

    args = _decode_case(k=k, seed=k)
    want = window_attention(*args, 0.125)
    got = attn_cpu.decode_attn_cpu(*args, 0.125)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2**-6, atol=2**-8)
    assert (got[0][0] == 0).all()  # nothing valid: 0, like the reference
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(got[2], want[2])


def test_every_e4m3_code_of_the_ring_is_read_as_the_model_reads_it():
    """Ring rows holding every E4M3 code but NaN (subnormals and both zeros included; a NaN would make the whole
    row's logit NaN) under scales from 2^-22 (fp8_quant's floor) up: with one valid row and a sink of -inf
    weight, a head's output is that row as the kernel decoded it, which must be the model's dequantised bf16 row
    bit for bit."""
    d = 128
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(2, d)  # row 0: 0-127, row 1: 128-255
    codes[:, -1] = torch.tensor([0x01, 0x81], dtype=torch.uint8)  # (0x7f and 0xff are E4M3's NaNs)
    scales = torch.tensor([[105, 127, 131, 140], [118, 127, 100, 150]], dtype=torch.uint8)  # 2^(s - 127)
    want = (
        (
            codes.view(torch.float8_e4m3fn).float().unflatten(-1, (4, 32))
            * scales.view(torch.float8_e8m0fnu).float().unsqueeze(-1)
        )
        .flatten(-2)
        .bfloat16()
    )
    q = torch.ones(1, 1, 2, d).bfloat16() * 1e-3
    kv = torch.zeros(1, 1, d).bfloat16()
    for row in range(2):
        valid = torch.zeros(1, 3, dtype=torch.bool)
        valid[0, row] = True
        o = attn_cpu.decode_attn_cpu(
            q, codes.view(torch.float8_e4m3fn)[None], scales[None], kv, valid, None, torch.full((2,), -1e30), 1.0
        )[0]
        for head in range(2):
            torch.testing.assert_close(o[0, 0, head], want[row], rtol=0, atol=0, equal_nan=True)


def test_the_decode_kernels_ring_codes_are_fp8_quants_bits_at_the_edges():
    """Blocks at the scale rule's edges: all zeros (the amax floor), an amax of exactly 448 times a power of two (the
    scale stays put), just above it, values that round to ties, and negative zero."""
    from dsv41.ops.quant import fp8_quant

    d = 128
    rows = torch.zeros(6, d)
    rows[1, :32] = torch.linspace(-448.0, 448.0, 32) * 2.0**-3
    rows[1, 32:64] = torch.linspace(-1.0, 1.0, 32) * 448.0 * (1 + 2**-7)
    rows[2] = torch.randn(d) * 1e-3
    rows[3] = torch.randn(d) * 3e4
    rows[4, :32] = torch.arange(32) * 0.5 + 0.25  # halfway between E4M3 neighbours
    rows[5] = -0.0
    kv = rows.bfloat16().unsqueeze(1)
    args = list(_decode_case(b=6, d=d))
    args[3] = kv
    _, codes, bits = attn_cpu.decode_attn_cpu(*args, 0.1)
    want_codes, want_scale = fp8_quant(kv[:, 0])
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(bits, want_scale.to(torch.float8_e8m0fnu).view(torch.uint8))


def test_a_sequences_decode_attention_does_not_depend_on_the_batch():
    """Each sequence alone, in the batch, in another order and beside other rows gives the same bits; what a
    row may not see (its masked ring, new and selected rows) does not change them."""
    args = _decode_case(b=7, seed=5)
    batched = attn_cpu.decode_attn_cpu(*args, 0.1)[0]
    for i in range(7):
        alone = attn_cpu.decode_attn_cpu(*(t[i : i + 1] for t in args[:6]), args[6], 0.1)[0]
        assert torch.equal(alone, batched[i : i + 1])
    order = torch.tensor([3, 6, 0, 1, 5, 2, 4])
    shuffled = attn_cpu.decode_attn_cpu(*(t[order] for t in args[:6]), args[6], 0.1)[0]
    assert torch.equal(shuffled, batched[order])
    q, codes, bits, kv, valid, selected, sink = args
    hidden = ~valid
    noisy = codes.view(torch.uint8).clone()
    noisy[hidden[:, :16]] = torch.randint(0, 126, (int(hidden[:, :16].sum()), 64), dtype=torch.uint8)
    sel = selected.clone()
    sel[hidden[:, 17:]] = 7.0
    again = attn_cpu.decode_attn_cpu(q, noisy.view(torch.float8_e4m3fn), bits, kv, valid, sel, sink, 0.1)[0]
    assert torch.equal(again, batched)


def test_the_decode_kernel_refuses_bad_inputs():
    q, codes, bits, kv, valid, selected, sink = _decode_case()
    with pytest.raises(RuntimeError, match="shapes do not match"):
        attn_cpu.decode_attn_cpu(q, codes, bits, kv, valid[:, :-1], selected, sink, 0.1)
    with pytest.raises(RuntimeError, match="e4m3"):
        attn_cpu.decode_attn_cpu(q, codes.view(torch.uint8), bits, kv, valid, selected, sink, 0.1)


@pytest.mark.parametrize("k", [0, 12])
def test_the_in_place_decode_kernel_gives_the_gathered_ones_bits_and_writes_only_the_new_rows(k):
    """`decode_ring_attn_cpu` over a state pool of 7 slots x 3 layers (rings read where they lie, the new rows'
    codes written there) against gathering the rings, `decode_attn_cpu` and writing its codes back: the same
    attention and the same pool, bit for bit, every other ring row untouched. A new row that replaces a row its
    sequence reads is read before it is overwritten."""
    q, codes, bits, kv, valid, selected, sink = _decode_case(k=k, seed=3 + k)
    b, w, d = codes.shape
    g = torch.Generator().manual_seed(k)
    pool_codes = (torch.rand(7, 3, w, d, generator=g) * 8 - 4).to(torch.float8_e4m3fn)
    pool_bits = torch.randint(120, 134, (7, 3, w, d // 32), generator=g, dtype=torch.uint8)
    slots, layer = torch.tensor([5, 0, 3, 6, 2]), 1
    pool_codes[slots, layer], pool_bits[slots, layer] = codes, bits
    rows = torch.tensor([0, 15, 7, 3, 9])
    valid[1:, rows[1:]] = True  # the replaced rows are attended
    want_codes, want_bits = pool_codes.clone(), pool_bits.clone()
    want, new_codes, new_bits = attn_cpu.decode_attn_cpu(
        q, want_codes[slots, layer], want_bits[slots, layer], kv, valid, selected, sink, 0.125
    )
    want_codes[slots, layer, rows], want_bits[slots, layer, rows] = new_codes, new_bits
    got = attn_cpu.decode_ring_attn_cpu(q, pool_codes, pool_bits, slots, layer, rows, kv, valid, selected, sink, 0.125)
    assert torch.equal(got, want)
    assert torch.equal(pool_codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(pool_bits, want_bits)
    with pytest.raises(RuntimeError, match="out of range"):
        attn_cpu.decode_ring_attn_cpu(q, pool_codes, pool_bits, slots, layer, rows + w, kv, valid, selected, sink, 0.1)
    with pytest.raises(RuntimeError, match="contiguous"):
        attn_cpu.decode_ring_attn_cpu(
            q, pool_codes[:, :2], pool_bits[:, :2], slots, 0, rows, kv, valid, selected, sink, 0.1
        )


def _chunk_case(lengths=(1, 3, 5, 2), h=4, d=64, w=16, k=12, seed=0):
    """The tokens of chunks of the given lengths (one sequence each) for a verify forward: each sequence's FP8 ring
    as it was before its chunk, the chunk's rows, selected rows, a valid mask with holes (token 0 sees nothing)."""
    from dsv41.ops.quant import fp8_quant

    g = torch.Generator().manual_seed(seed)
    s, n, t = len(lengths), max(lengths), sum(lengths)
    codes, scale = fp8_quant(torch.randn(s, w, d, generator=g) * torch.randn(s, w, 1, generator=g).exp())
    bits = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    ring_of = torch.tensor([i for i, m in enumerate(lengths) for _ in range(m)])
    q = torch.randn(t, 1, h, d, generator=g).bfloat16()
    chunk = (torch.randn(t, n, d, generator=g) * 2).bfloat16()
    selected = torch.randn(t, k, d, generator=g).bfloat16() if k else None
    valid = torch.rand(t, w + n + k, generator=g) > 0.3
    valid[0] = False
    return q, codes, bits, ring_of, chunk, valid, selected, torch.randn(h, generator=g)


@pytest.mark.parametrize("k", [0, 12])
def test_the_chunk_kernel_gives_the_chunked_verify_attention(k):
    """Against `chunk_decode_attend`'s tensor ops (its reference: every ring decoded to fp32, then
    `dense_decode_attn` over cat(ring, chunk rows, selected)): equal up to a bf16 step of the output."""
    from dsv41 import ops
    from dsv41.ops.quant import fp8_dequant

    q, codes, bits, ring_of, chunk, valid, selected, sink = _chunk_case(k=k, seed=k + 1)
    ring = fp8_dequant(codes, bits.view(torch.float8_e8m0fnu).float())[ring_of]
    parts = [ring, chunk.float()] + ([selected.float()] if k else [])
    want = ops.dense_decode_attn(q, torch.cat(parts, dim=1), valid, sink, 0.125)
    got = attn_cpu.chunk_attn_cpu(q, codes, bits, ring_of, chunk, valid, selected, sink, 0.125)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-8)
    assert (got[0] == 0).all()  # nothing valid: 0


def test_a_tokens_chunk_attention_does_not_depend_on_the_others():
    """Each token alone (with only its own ring), in the full call and in another order gives the same bits; what
    it may not see (masked ring rows, even NaN codes, masked chunk and selected rows) does not change them."""
    q, codes, bits, ring_of, chunk, valid, selected, sink = _chunk_case(seed=7)
    full = attn_cpu.chunk_attn_cpu(q, codes, bits, ring_of, chunk, valid, selected, sink, 0.1)
    for i in range(q.size(0)):
        s = int(ring_of[i])
        alone = attn_cpu.chunk_attn_cpu(
            q[i : i + 1],
            codes[s : s + 1],
            bits[s : s + 1],
            torch.zeros(1, dtype=torch.long),
            chunk[i : i + 1],
            valid[i : i + 1],
            selected[i : i + 1],
            sink,
            0.1,
        )
        assert torch.equal(alone, full[i : i + 1])
    order = torch.randperm(q.size(0), generator=torch.Generator().manual_seed(1))
    shuffled = attn_cpu.chunk_attn_cpu(
        q[order], codes, bits, ring_of[order], chunk[order], valid[order], selected[order], sink, 0.1
    )
    assert torch.equal(shuffled, full[order])
    w, n = codes.size(1), chunk.size(1)
    noisy = codes.view(torch.uint8).clone()
    for i in range(q.size(0)):  # every ring row no token of the sequence reads: NaN codes (0x7f)
        s = int(ring_of[i])
        unread = ~valid[ring_of == s, :w].any(dim=0)
        noisy[s, unread] = 0x7F
    junk = chunk.clone()
    junk[~valid[:, w : w + n]] = float("nan")
    sel = selected.clone()
    sel[~valid[:, w + n :]] = 7.0
    again = attn_cpu.chunk_attn_cpu(q, noisy.view(torch.float8_e4m3fn), bits, ring_of, junk, valid, sel, sink, 0.1)
    assert torch.equal(again, full)


def test_the_chunk_kernel_refuses_bad_inputs():
    q, codes, bits, ring_of, chunk, valid, selected, sink = _chunk_case()
    with pytest.raises(RuntimeError, match="shapes do not match"):
        attn_cpu.chunk_attn_cpu(q, codes, bits, ring_of, chunk, valid[:, :-1], selected, sink, 0.1)
    with pytest.raises(RuntimeError, match="out of range"):
        attn_cpu.chunk_attn_cpu(q, codes, bits, ring_of + 4, chunk, valid, selected, sink, 0.1)
    with pytest.raises(RuntimeError, match="e4m3"):
        attn_cpu.chunk_attn_cpu(q, codes.view(torch.uint8), bits, ring_of, chunk, valid, selected, sink, 0.1)
