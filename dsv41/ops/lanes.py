"""Elementwise functions computed as if each token's call had run alone (the engine's batch invariance,
spec-v41.md §9; the RL learner's bit-exact replay, training.md §8).

PyTorch's CPU kernels run an elementwise op over a contiguous tensor in SIMD vectors, several at a time,
and hand the last `numel % step` elements to the scalar version of the function. For exp, sqrt and
rsqrt the two agree; for sigmoid and softplus the vector (Sleef) and scalar (libm) versions differ in
the last bit on a few to tens of percent of inputs. So an element's value depends on whether it falls in
its call's tail, that is on how many other tokens share the call: one sequence's router scores, Engram
gates and mHC `pre`/`post` mixes changed with what the engine batched it with.

`per_call(name, x, calls)` computes the function as if the tokens of x (its leading dims, flattened) had
gone through it in separate calls of `calls[i]` tokens each, which is what the model computes for one
chunk of one sequence (`calls=None`: one call, the plain function, so a single-sequence forward is
unchanged bit for bit). The vector part comes from one padded call whose every element is in the vector
body; the tail of each call from the scalar kernel (a strided input always takes it). The vector step of
each function is measured once per machine (`vector_step`), not assumed from the CPU's vector width.
Calls above ATen's parallel grain (32,768 elements), whose threads add tails of their own, are not
emulated; no call of the CPU presets is that large.

The tail rule is this CPU's (ATen's loop takes two SIMD vectors per iteration: 16 elements on an AVX2 CPU,
32 on an AVX-512 one): this is batch invariance on one machine, not the same bits on every machine. Those
come from the reference mode's canonical numerics (dsv41.ops.canonical), which needs none of this.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

FUNCTIONS = {"sigmoid": torch.sigmoid, "softplus": F.softplus, "silu": F.silu}
PIECE = 1 << 14  # elements per vector call: below ATen's parallel grain, so no thread split adds a tail


def per_call(name: str, x: torch.Tensor, calls: Sequence[int] | None = None) -> torch.Tensor:
    """FUNCTIONS[name](x) as if the tokens of x [..., C] had gone through it in separate calls of
    `calls` tokens each (sum(calls) = the number of tokens; None or one call: the plain function).
    Differentiable through the function."""
    fn = FUNCTIONS[name]
    if calls is None or len(calls) <= 1:
        return fn(x)
    step = vector_step(name, x.dtype, x.device.type)
    if step is None or x.numel() == 0:  # the kernel's tail rule was not recognised: nothing better than the
        return fn(x)  # plain call
    flat = x.reshape(-1)
    tokens = sum(calls)
    if tokens <= 0 or flat.numel() % tokens:
        raise ValueError(f"calls cover {tokens} tokens; the tensor has {flat.numel()} elements")
    width = flat.numel() // tokens
    out = _vector_body(fn, flat, step)  # every element through the vector kernel
    tails, start = [], 0
    for count in calls:
        n = count * width
        body = n // step * step
        if body < n:
            tails.append(torch.arange(start + body, start + n, device=x.device))
        start += n
    if tails:
        index = torch.cat(tails)
        out = out.index_put((index,), _scalar(fn, flat[index]))
    return out.view(x.shape)


def _vector_body(fn, flat: torch.Tensor, step: int) -> torch.Tensor:
    """fn over a 1-D tensor with every element in the vector body: padded to whole steps, in pieces."""
    n = flat.numel()
    piece = max(step, PIECE // step * step)
    pad = -n % step
    if pad:
        flat = F.pad(flat, (0, pad))
    out = fn(flat) if flat.numel() <= piece else torch.cat([fn(p) for p in flat.split(piece)])
    return out[:n]


def _scalar(fn, values: torch.Tensor) -> torch.Tensor:
    """fn over a 1-D tensor through the scalar kernel (a non-contiguous input never takes the vector loop)."""
    spread = values.new_zeros(2 * values.numel())
    spread[::2] = values
    return fn(spread[::2]).contiguous()


@functools.cache
def vector_step(name: str, dtype: torch.dtype, device: str) -> int | None:
    """The number of elements the kernel of FUNCTIONS[name] handles per vector iteration here: a call of
    n elements computes the first n // step * step in vectors and the rest scalar. 1 when both versions
    agree on the probe (nothing to emulate); None when no step explains the kernel's results."""
    fn = FUNCTIONS[name]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 4).to(dtype=dtype, device=device)
    vec, sca = _vector_body(fn, x, 256), _scalar(fn, x)
    if torch.equal(vec, sca):
        return 1
    for step in (8, 16, 32, 64, 128, 256):
        if all(
            torch.equal(fn(x[:n].clone()), torch.cat([vec[: n // step * step], sca[n // step * step : n]]))
            for n in range(1, 3 * 256 + 1)
        ):  # every residue of every candidate step, three times
            return step
    return None
