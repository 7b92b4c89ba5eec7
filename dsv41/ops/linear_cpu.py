"""bf16 linear layers of a few rows, summed and returned in fp32, as one C++ kernel on a CPU (linear_cpu.cpp
beside this file): the token-wise GEMMs of a `fast` decode step's compiled regions and its logits.

A decode step's layers multiply 1 to a few dozen rows by weights of a few hundred KB (the head: a few MB). At
those sizes a GEMM library's time is its fixed work (oneDNN's bf16 path ~17-25 us a call whatever the rows
on the machines measured; MKL's fp32 path copies the weight into its panel layout on every call: ~1 ms a step
for the fp32 head at 8 rows), and inductor's reduction loop, the compiled regions' one-row form, reads the
weight once per row. The kernel reads each block of 16 weight rows once for all the tokens, with the CPU's bf16
dot-product instructions (AVX512-BF16) on the bf16 values as they are, and keeps fp32 sums: the logits need
them (rounded to bf16, ~0.7% of the top-1 picks flip against the reference, bench_agreement.py), the layers
round them to bf16 as a bf16 GEMM does. Measured on `small`'s shapes (one process, 2 threads, AMD EPYC Zen 4,
weights hot in the caches): 3.6-4.6 against 17-24 us (oneDNN bf16) a layer at 1 row and 5-11 against 20-29
us at 8; the 8192 x 384 head 47 against 330 us (inductor's loop) at 1 row and 177 against 490 us (MKL fp32)
at 8.

It is built once per machine with the machine's instruction set (`cpp_build`: `c++ -O3 -march=native`, a few
seconds, cached) and loaded as `torch.ops.dsv41.rows_linear_cpu`, registered from C++ so that a compiled graph
calls it through the dispatcher. It serves only where it was built with the bf16 dot-product instructions
(`available`): elsewhere (AVX2 CPUs) the fp32 and inductor paths keep the work.
"""

from __future__ import annotations

import functools

import torch

from dsv41.ops import cpp_build

MAX_ROWS = 64  # past this many rows a GEMM library's blocking wins (the 8192-wide head at 48 rows is even)


@functools.cache
def library() -> str | None:
    """The built kernel's path, its ops registered (built now if this machine has no build of this source yet),
    or None where it cannot be built or loaded (`cpp_build.load`)."""
    path = cpp_build.load("linear_cpu")
    if path is not None:
        torch.library.register_fake("dsv41::rows_linear_cpu")(_shape)
    return path


def _shape(x, w):
    """What the op returns, for tracing: fp32 [T, N]."""
    return x.new_empty((x.size(0), w.size(0)), dtype=torch.float32)


def available() -> bool:
    """Is the kernel built here with the bf16 dot-product instructions? Builds it if needed."""
    return library() is not None and torch.ops.dsv41.rows_linear_cpu_bf16_dot()


def fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = MAX_ROWS) -> bool:
    """Can the kernel take this call: bf16 on a CPU, at most `max_rows` rows (None: any), rows a multiple of 32
    wide?"""
    return (
        weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.size(-1) % 32 == 0
        and (max_rows is None or x.numel() <= max_rows * x.size(-1))
    )


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 @ weight [N, K]^T bf16 -> fp32 [..., N] by the kernel (`available()` must be true)."""
    lead = x.shape[:-1]
    return torch.ops.dsv41.rows_linear_cpu(x.reshape(-1, x.size(-1)), weight).view(*lead, weight.size(0))
