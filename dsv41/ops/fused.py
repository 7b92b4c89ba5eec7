"""Compiled (fused) versions of eager reference ops, used only where they are bit-identical.

A fused kernel runs a chain of small ops in one pass (one C++ loop on a CPU), so it saves the per-op
overhead that dominates a batch-1 decode step and the memory traffic of the indexer's epilogues. The
eager function stays the reference. A fused version is written so the compiler keeps every rounding of
the reference (explicit summation order, `emulate_precision_casts` for bf16 intermediates) and is used
only after `agrees` found it bit-identical on random inputs on this machine: compiled kernels depend on
the compiler and CPU, never on the values, so one comparison per shape family settles it. Without a
working compiler, or with DSV41_FUSED=0 in the environment, the eager reference runs.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Iterable

import torch


def enabled() -> bool:
    return os.environ.get("DSV41_FUSED", "1") != "0"


def compile_fused(fn: Callable, emulate_precision_casts: bool = False) -> Callable:
    """torch.compile with dynamic shapes (one kernel for every batch and length), nothing else."""
    options = {"emulate_precision_casts": True} if emulate_precision_casts else None
    return torch.compile(fn, dynamic=True, options=options)


def agrees(fused: Callable, reference: Callable, cases: Iterable[tuple]) -> bool:
    """Does `fused(*args)` equal `reference(*args)` bit for bit (every output) on every case?
    False (with a warning) if the fused version cannot be built here. Call it once per shape family and
    cache the verdict."""
    cases = list(cases)
    try:
        # under both modes the model runs in: the compiler keys its kernels on the grad mode, so this also
        # builds both now instead of inside the first request
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                for args in cases:
                    got, want = fused(*args), reference(*args)
                    got = got if isinstance(got, tuple) else (got,)
                    want = want if isinstance(want, tuple) else (want,)
                    if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                        return False
    except Exception as err:  # no C++ compiler, an unsupported device: the eager reference is used
        warnings.warn(f"fused kernel unavailable, using the eager reference ({type(err).__name__}: {err})")
        return False
    return True
