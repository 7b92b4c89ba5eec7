"""The picked experts of a fast decode step as one C++ kernel on a CPU (moe_cpu.cpp beside this file).

`ops.moe.gathered_experts` is the reference and the compiled form: inductor makes it one loop that reads each
(token, pick) pair's expert rows and widens them to fp32. This kernel groups the pairs by expert, so a
picked expert is read once for every token that picked it, and uses the CPU's bf16 dot-product instructions
(AVX512-BF16) on the bf16 rows as they are. Measured against the compiled reference on `small`'s expert shapes
(17 stacked experts of 384 x 384, 12 layers' worth of weights so they come from memory; one thread, AMD EPYC
Zen 4), called from inside a compiled graph as the decode step calls it: 122 against 146 us a layer at 1 token,
362 against 480 at 4, 617 against 883 at 8, 1,543 against 3,237 at 32.

It is built once per machine with the machine's instruction set (`cpp_build`: `c++ -O3 -march=native -fopenmp`
against torch's headers, ~6 s, cached under ~/.cache/dsv41/kernels), and loaded as the op `torch.ops.dsv41.gathered_experts_cpu` (registered from C++, so a compiled
graph calls it through the dispatcher, with no trip through Python). It is used only where it was built with
the bf16 dot-product instructions (`available`): elsewhere (AVX2 CPUs) its widening form is no faster than
inductor's, which keeps the work.
"""

from __future__ import annotations

import functools

import torch

from dsv41.ops import cpp_build


@functools.cache
def library() -> str | None:
    """The built kernel's path, its ops registered (built now if this machine has no build of this source yet),
    or None where it cannot be built or loaded (`cpp_build.load`)."""
    path = cpp_build.load("moe_cpu")
    if path is not None:
        torch.library.register_fake("dsv41::gathered_experts_cpu")(_shape)
    return path


def _shape(x, weights, indices, w1, w3, w2, limit):
    """What the op returns, for tracing: fp32 [T, D]."""
    return x.new_empty(x.shape, dtype=torch.float32)


def available() -> bool:
    """Is the kernel built here with the bf16 dot-product instructions (the form that beats the compiled
    reference)? Builds it if needed."""
    return library() is not None and torch.ops.dsv41.gathered_experts_cpu_bf16_dot()


def fits(w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Can the kernel take these stacked expert weights: bf16 on a CPU, rows whose length is a multiple of 32
    (the dot products' width)? (The tokens are bf16 in a decode step.)"""
    return (
        w1.device.type == "cpu"
        and w1.dtype == w2.dtype == torch.bfloat16
        and w1.size(-1) % 32 == 0
        and w2.size(-1) % 32 == 0
    )


def gathered_experts_cpu(x, weights, indices, w1, w3, w2, limit: float) -> torch.Tensor:
    """`ops.moe.gathered_experts` by the C++ kernel (`library()` must have loaded it): x [T, D] bf16, weights
    [T, k] fp32, indices [T, k] into w1, w3 [E, I, D] and w2 [E, D, I] bf16 -> fp32 [T, D]. What
    `MoE.decode_forward` calls where `available()`; a compiled graph traces through to the op."""
    return torch.ops.dsv41.gathered_experts_cpu(x, weights, indices, w1, w3, w2, limit)
