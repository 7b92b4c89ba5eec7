"""Which GEMM `fast` numerics should run a bf16 linear layer with on this machine, chosen by measurement.

A CPU with bf16 instructions (AVX512-BF16, AMX) multiplies bf16 matrices natively; one without them (an
AVX2 CPU) runs ATen's bf16 GEMM as a per-row fallback several times slower than an fp32 GEMM of the same
(exactly upcast) values. Even with native bf16, a one-row decode GEMM can be faster in fp32 (oneDNN's bf16
path has a fixed cost). `fast` numerics promise no bits, so a bf16 layer may run as x.float() @ W32^T over
an fp32 copy of its weight made once, rounded back to bf16: the value of the exact product, rounded once,
as close to the reference as the bf16 GEMM is.

The choice is a probe, never a CPU's name: both GEMMs are timed at the model's decode shapes, for each
batch bucket, and the answer (the largest row count for which fp32 is faster) is kept on disk per torch
version, CPU capability, bf16 support, thread count and shapes, so later processes skip the probe.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F

ROWS = (1, 2, 4, 8, 16, 32)  # decode batch buckets probed
MARGIN = 0.85  # fp32 must take at most this share of bf16's time to be chosen
COLD_BYTES = 64 << 20  # bf16 weight bytes a probe pass reads (past the caches of these CPUs)


def cache_file() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dsv41", "gemm_choice.json")


def machine_key(shapes: list[tuple[int, int]], threads: int) -> str:
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    parts = [torch.__version__, torch.backends.cpu.get_cpu_capability(), str(native), str(threads), repr(shapes)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe(shapes: list[tuple[int, int]], rows: tuple[int, ...] = ROWS, repeats: int = 3) -> int:
    """The largest row count of `rows` up to which an fp32 GEMM (fp32 weight copy, upcast input, bf16 result)
    beats the bf16 GEMM summed over `shapes` ([out, in] weights), by MARGIN at every count up to it; 0 when
    it does not even at one row."""
    g = torch.Generator().manual_seed(0)
    # enough copies of the shapes that one pass reads COLD_BYTES of bf16 weights: a decode step streams its
    # weights from memory, and the fp32 copies are twice the bytes, which a cache-resident probe would hide
    per_pass = sum(n * k * 2 for n, k in shapes)
    copies = max(1, -(-COLD_BYTES // per_pass))
    weights = [torch.randn(n, k, generator=g).bfloat16() for _ in range(copies) for n, k in shapes]
    weights32 = [w.float() for w in weights]
    best = 0
    for m in rows:
        xs = [torch.randn(m, w.size(1), generator=g).bfloat16() for w in weights]

        def run(ws, fp32: bool, xs=xs):
            for x, w in zip(xs, ws):
                F.linear(x.float(), w).bfloat16() if fp32 else F.linear(x, w)

        bf16 = _time(lambda: run(weights, False), repeats)
        fp32 = _time(lambda: run(weights32, True), repeats)
        if fp32 > MARGIN * bf16:
            break
        best = m
    return best


def fp32_rows(shapes: list[tuple[int, int]], device: str = "cpu") -> int:
    """`probe`'s answer for these shapes on this machine, from the disk cache or measured now (and kept)."""
    if device != "cpu":
        return 0  # GPUs multiply bf16 natively
    shapes = sorted(set(shapes))
    key = machine_key(shapes, torch.get_num_threads())
    path = cache_file()
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if key in known:
        return int(known[key])
    answer = probe(shapes)
    known[key] = answer
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(known, f)
        os.replace(tmp, path)
    except OSError:  # a read-only home: measured again next time
        pass
    return answer
