"""Linear layers over bf16, FP8 and packed-FP4 weights (spec-v41.md §7 storage, §13 tensor layout).

Quantized weights take a quantized activation: before every FP8 or FP4 GEMM the activation is rounded
through FP8 E4M3 with a UE8M0 scale per 32 channels, as the reference kernels do. The product is then
computed as dequantize (exact: codes times power-of-two scales) + one matmul: an fp32 GEMM on the fast
path, one float64 dot product rounded to fp32 and then bf16 under reference numerics (the golden sets'
rule, dsv41.ops.canonical).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsv41.ops import canonical
from dsv41.ops.quant import FP8_BLOCK, dequant_fp4_weight, dequant_fp8_weight, fp8_dequant, fp8_quant

PACKED_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def is_fp8(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float8_e4m3fn


def is_fp4(weight: torch.Tensor) -> bool:
    return weight.dtype in PACKED_FP4_DTYPES


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Any stored weight -> fp32 [N, K] (bf16/fp32 weights are just upcast)."""
    if is_fp8(weight):
        return dequant_fp8_weight(weight, scale)
    if is_fp4(weight):
        return dequant_fp4_weight(weight, scale)
    return weight.float()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    row_chunk: int = 0,
    reference: bool = False,
) -> torch.Tensor:
    """y = x @ W^T.

    x: [..., K]. weight: [N, K] bf16/fp32 (plain `F.linear` in that dtype; x must match), or [N, K]
    float8_e4m3fn with `scale` [ceil(N/32), ceil(K/32)], or packed FP4 [N, K/2] with `scale` [N, K/32].
    Quantized paths return `out_dtype` (bf16 like the reference kernels). row_chunk > 0: batch-invariant
    GEMMs (`invariant_matmul`). reference: canonical numerics (`ops.canonical`): one float64 dot product
    per output, rounded to fp32 (and then to bf16 for bf16 and quantized weights).
    """
    if is_fp8(weight) or is_fp4(weight):
        if scale is None:
            raise ValueError("a quantized weight needs its block scale")
        xq, xs = fp8_quant(x, FP8_BLOCK)
        x_deq = fp8_dequant(xq, xs, FP8_BLOCK)
        if reference:
            return canonical.linear(x_deq, dequant_weight(weight, scale), dtype=out_dtype)
        return invariant_matmul(x_deq, dequant_weight(weight, scale), row_chunk).to(out_dtype)
    if reference:
        return canonical.linear(x, weight)
    return invariant_matmul(x, weight, row_chunk)


def row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T as broadcast products summed in fp32, rounded to x's dtype: written for
    the compiler, which makes it one reduction loop over the weight (the compiled decode regions' one-row
    layers, dsv41.engine.compiled). Eager, it materialises [..., N, K] products: not a fast path."""
    return (x.float().unsqueeze(-2) * weight.float()).sum(-1).to(x.dtype)


# up to this many rows a compiled graph's fp32 products with a small weight are a reduction of its own
# (`invariant_matmul` with no chunk): the compiled decode step's buckets on one thread (engine.compiled)
COMPILED_DOT_ROWS = 64


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T computed as GEMMs of exactly `chunk` rows (zero-padding the last).

    CPU GEMM libraries pick kernels, and with them the summation order, by the number of rows M, so a
    token's result can change with how many other tokens share the call. With every GEMM at exactly
    `chunk` rows a token's result no longer depends on its batch (batch invariance). chunk 0: one call.

    Every GEMM here is a plain 2-D call, never a batched one: libraries plan a batched GEMM from the batch
    count too (oneDNN's bf16 kernels on AMX pick their K blocking from a cache model of the whole problem,
    and MKL's batched GEMM is an entry point of its own), so an entry's bits could change with the number
    of chunks. Whole
    runs of `WIDE_ROWS` rows go to one call when a probe on this machine showed that call gives every row
    the bits of the `chunk`-row calls (`wide_rows_agree`; then runs of 64): a prefill chunk of 1,024
    tokens is then 4 calls, not 64, with the same result.
    """
    if not chunk:
        if torch.compiler.is_compiling() and x.dtype == torch.float32 and x.numel() <= COMPILED_DOT_ROWS * x.size(-1):
            # a few rows inside a compiled `fast` graph (the mHC mixes, the router): one reduction loop the compiler
            # writes, not a library call. MKL runs a few-row fp32 GEMM by its slower reproducible path once the
            # process asks for its strict mode (dsv41/__init__.py, for the deterministic engine): ~16 us a call
            return (x.unsqueeze(-2) * weight).sum(-1)
        return F.linear(x, weight)
    lead, k = x.shape[:-1], x.size(-1)
    flat = x.reshape(-1, k)
    n = flat.size(0)
    if n <= chunk:  # one chunk (decode): a GEMM of exactly `chunk` rows, or of the n real rows where
        # the probe showed this kernel gives those the same bits (a decode step then skips the padding). A
        # compiled graph always pads: the probe speaks of the eager kernels, not of the code the compiler
        # generates for n rows, and running it would break the graph
        if (
            n < chunk
            and not torch.compiler.is_compiling()
            and narrow_rows_agree(
                k, weight.size(0), weight.dtype, x.dtype, chunk, n, torch.get_num_threads(), weight.device.type
            )
        ):
            return F.linear(flat, weight).reshape(*lead, weight.size(0))
        return F.linear(F.pad(flat, (0, 0, 0, chunk - n)), weight)[:n].reshape(*lead, weight.size(0))
    if n % chunk:
        flat = torch.cat([flat, flat.new_zeros(chunk - n % chunk, k)])
    parts, done, rows = [], 0, flat.size(0)
    for wide in (*WIDE_ROWS, chunk):  # greedy: the widest calls that agree first, `chunk` rows last
        if wide != chunk and (
            rows - done < wide
            or not wide_rows_agree(
                k, weight.size(0), weight.dtype, chunk, wide, torch.get_num_threads(), weight.device.type
            )
        ):
            continue
        bulk = (rows - done) // wide * wide
        parts += [F.linear(part, weight) for part in flat[done : done + bulk].split(wide)]
        done += bulk
    out = torch.cat(parts)
    return out[:n].reshape(*lead, weight.size(0))


WIDE_ROWS = (256, 64)  # row counts tried before `chunk`, widest first


PROBE_TRIALS = 6  # order-revealing probe inputs per shape (each with its cancelling pair elsewhere)


def order_revealing(rows: int, k: int, n: int, trial: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x [rows, k], w [n, k] holding bf16 values whose GEMM shows its summation order in every
    output, even after a bf16 rounding: products x[:, a] w[:, a] = 2^24 w and x[:, b] w[:, b] = -2^24 w cancel
    exactly, so the exact result is the sum of the O(1) terms (|y| ~ 8), while every term an fp32
    accumulator adds while it holds the 2^24-sized partial loses its low bits (an fp32 ulp there is ~1). Two
    orders that group the terms differently around a and b give results whole units apart. On plain random
    inputs the output's bf16 rounding hides an fp32 order change on all but ~0.1% of values. The pair (a, b)
    differs per trial (trial 0: the first and last columns)."""
    g = torch.Generator().manual_seed(trial)
    x = torch.randn(rows, k, generator=g).bfloat16().float()
    w = torch.randn(n, k, generator=g).bfloat16().float()
    if k >= 2:
        a, b = (0, k - 1) if trial == 0 else sorted(torch.randperm(k, generator=g)[:2].tolist())
        x[:, a] = x[:, b] = 2.0**24
        w[:, b] = -w[:, a]
    return x, w


@functools.cache
def wide_rows_agree(k: int, n: int, dtype: torch.dtype, chunk: int, wide: int, threads: int, device: str) -> bool:
    """Does one `wide`-row GEMM [wide, k] x [k, n] give every row the same bits as `chunk`-row GEMMs?

    GEMM libraries choose a kernel, and with it the summation order, from the shapes (and thread count),
    never from the values, so comparisons on inputs that reveal the order (`order_revealing`) settle it for
    these shapes; the answer is memoised per shape, dtype, thread count and device (a pure function of the
    machine and library).
    """
    for trial in range(PROBE_TRIALS):
        x, w = (t.to(dtype=dtype, device=device) for t in order_revealing(wide, k, n, trial))
        if not torch.equal(F.linear(x, w), torch.cat([F.linear(part, w) for part in x.split(chunk)])):
            return False
    return True


@functools.cache
def narrow_rows_agree(
    k: int, n: int, dtype: torch.dtype, x_dtype: torch.dtype, chunk: int, rows: int, threads: int, device: str
) -> bool:
    """Does a `rows`-row GEMM [rows, k] x [k, n] (rows < chunk) give its rows the bits they get as the
    first rows of a `chunk`-row GEMM, whatever the other rows hold?

    The batch-invariant path pads a decode batch of B < chunk tokens to `chunk` rows; where the kernel's
    summation order does not depend on the row count (this probe says so), the padding is pure waste:
    on a CPU whose bf16 GEMM is a per-row dot product (AVX2 without AVX512-BF16), a 1-row decode pays for
    16 rows. Like `wide_rows_agree`, the answer is a function of the shapes, dtypes, thread count and
    library, never of the values, so comparisons on order-revealing inputs (`order_revealing`; with
    different companions in the padded call) settle it; memoised per process. (Plain random inputs did not:
    their bf16 outputs hid the order of oneDNN's 16-row kernel against ATen's 1-row one, and one sequence's
    log-probs changed with its batch.)
    """
    g = torch.Generator().manual_seed(rows)
    for trial in range(PROBE_TRIALS):
        x, w = order_revealing(rows, k, n, trial)
        x, w = x.to(dtype=x_dtype, device=device), w.to(dtype=dtype, device=device)
        alone = F.linear(x, w)
        for companions in (torch.zeros(chunk - rows, k), torch.randn(chunk - rows, k, generator=g) * 1e3):
            padded = torch.cat([x, companions.to(dtype=x_dtype, device=device)])
            if not torch.equal(F.linear(padded, w)[:rows], alone):
                return False
    return True


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, row_chunk: int = 0, reference: bool = False) -> torch.Tensor:
    """Block-diagonal projection: x [..., G, D] with weight [G, R, D] -> [..., G, R] (group g uses W_g).
    reference: canonical numerics (one float64 einsum, rounded once to x's dtype)."""
    if reference:
        return canonical.einsum("...gd,grd->...gr", x, weight, dtype=x.dtype)
    if not row_chunk:
        return torch.einsum("...gd,grd->...gr", x, weight)
    return torch.stack([invariant_matmul(x[..., g, :], weight[g], row_chunk) for g in range(weight.size(0))], dim=-2)
