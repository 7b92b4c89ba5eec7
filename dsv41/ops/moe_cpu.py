"""The picked experts of a fast decode step as one C++ kernel on a CPU (moe_cpu.cpp beside this file).

`ops.moe.gathered_experts` is the reference and the compiled form: inductor makes it one loop that reads each
(token, pick) pair's expert rows and widens them to fp32. This kernel groups the pairs by expert, so a
picked expert is read once for every token that picked it, and uses the CPU's bf16 dot-product instructions
(AVX512-BF16) on the bf16 rows as they are. Measured against the compiled reference on `small`'s expert shapes
(17 stacked experts of 384 x 384, 12 layers' worth of weights so they come from memory; one thread, AMD EPYC
Zen 4), called from inside a compiled graph as the decode step calls it: 548 against 618 us a layer at 4 tokens,
786 against 1,039 at 8, 1,735 against 3,651 at 32; at 1 token the call's own cost (the custom op's dispatch to
Python and back, ~60 us) makes it slower (205 against 175 us), so the decode step uses it from `MIN_ROWS`.

It is built once per machine with the machine's instruction set (`c++ -O3 -march=native -fopenmp`, ~1 s),
cached under ~/.cache/dsv41/kernels keyed by the source and the compiler, and loaded with ctypes. It is used
only where it was built with the bf16 dot-product instructions (`available`): elsewhere (AVX2 CPUs) the
widening form is no faster than inductor's, which keeps the work. The engine's compiled decode step calls it
through the custom op `torch.ops.dsv41.gathered_experts_cpu`, so it sits inside the compiled graph.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(__file__), "moe_cpu.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
MIN_ROWS = 4  # tokens from which a decode step's MoE runs by this kernel


def _compiler() -> str | None:
    return os.environ.get("CXX") or next((shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def _cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsv41", "kernels")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel (built now if this machine has no build of this source yet), or None where it cannot
    be built (no C++ compiler, a compiler error)."""
    cxx = _compiler()
    if cxx is None:
        return None
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + "\0".join((cxx, *FLAGS)).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"moe_cpu-{key}.so")
    if not os.path.exists(path):
        tmp = None
        try:  # built beside the target, then renamed: a process never loads another's half-written file
            os.makedirs(_cache_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
            os.close(fd)
            subprocess.run([cxx, *FLAGS, SOURCE, "-o", tmp], check=True, capture_output=True, timeout=300)
            os.replace(tmp, path)
        except (OSError, subprocess.SubprocessError):  # no writable cache, a compiler error: not available
            return None
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gathered_experts.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, i64]
    lib.gathered_experts.restype = None
    lib.bf16_dot.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Is the kernel built here with the bf16 dot-product instructions (the form that beats the compiled
    reference)?"""
    lib = library()
    return lib is not None and lib.bf16_dot() == 1


def fits(w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Can the kernel take these stacked expert weights: bf16 on a CPU, rows whose length is a multiple of 32
    (the dot products' width)? (The tokens are bf16 in a decode step.)"""
    return (
        w1.device.type == "cpu"
        and w1.dtype == w2.dtype == torch.bfloat16
        and w1.size(-1) % 32 == 0
        and w2.size(-1) % 32 == 0
    )


@torch.library.custom_op("dsv41::gathered_experts_cpu", mutates_args=())
def gathered_experts_cpu(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """`ops.moe.gathered_experts` by the C++ kernel: x [T, D] bf16, weights [T, k] fp32, indices [T, k] into
    w1, w3 [E, I, D] and w2 [E, D, I] bf16 -> fp32 [T, D]."""
    x, weights, indices = x.contiguous(), weights.float().contiguous(), indices.to(torch.int64).contiguous()
    w1, w3, w2 = w1.contiguous(), w3.contiguous(), w2.contiguous()  # views of the stacks: no copies
    out = torch.empty(x.size(0), w2.size(1), dtype=torch.float32)
    _launch(x, weights, indices, w1, w3, w2, out, limit)
    return out


def _launch(x, weights, indices, w1, w3, w2, out, limit: float) -> None:
    """The kernel on contiguous tensors, writing `out`."""
    lib = library()
    if lib is None:
        raise RuntimeError("the C++ expert kernel could not be built on this machine (dsv41.ops.moe_cpu)")
    (t, k), (e, i, d) = indices.shape, w1.shape
    ptrs = (a.data_ptr() for a in (x, weights, indices, w1, w3, w2, out))
    lib.gathered_experts(*ptrs, t, k, e, d, i, float(limit), torch.get_num_threads())


@gathered_experts_cpu.register_fake
def _(x, weights, indices, w1, w3, w2, limit):
    return x.new_empty(x.shape, dtype=torch.float32)
