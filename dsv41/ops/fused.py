"""Compiled (fused) versions of eager reference ops, used only where they are bit-identical.

A fused kernel runs a chain of small ops in one pass (one C++ loop on a CPU), so it saves the per-op
overhead that dominates a batch-1 decode step and the memory traffic of the indexer's epilogues. The
eager function stays the reference. A fused version is written so the compiler keeps every rounding of
the reference (explicit summation order, `emulate_precision_casts` for bf16 intermediates) and is used
only after `agrees` found it bit-identical on random inputs on this machine: compiled kernels depend on
the compiler and CPU, never on the values, so one comparison per shape family settles it. Without a
working compiler, or with DSV41_FUSED=0 in the environment, the eager reference runs.

Building the kernels takes seconds (tens on a cold compiler cache), which a short-lived process (the
README's chat one-liner) would pay before its first token. So a verdict can be settled in the background
(`Verdict.settle_in_background`): until it is known, its callers run the eager reference, which gives the
same bits, and nothing waits for the compiler.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from collections.abc import Callable, Iterable

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
        warnings.warn(
            f"fused kernel unavailable, using the eager reference ({type(err).__name__}: {err})", stacklevel=2
        )
        return False
    return True


class Verdict:
    """A memoised probe: `verdict(*args)` -> bool, computed once per argument tuple (like functools.cache).

    Arguments handed to `settle_in_background` are probed on a daemon thread; until that finishes, a
    call with them answers False at once (use the eager reference) instead of waiting for the compiler.
    Other arguments are probed on the calling thread, as before."""

    def __init__(self, probe: Callable[..., bool]):
        self.probe = probe
        self.__wrapped__ = probe
        self.__doc__ = probe.__doc__
        self.known: dict[tuple, bool] = {}
        self.pending: set[tuple] = set()
        self.lock = threading.Lock()  # one probe at a time per kernel: two threads never compile it twice

    def __call__(self, *args) -> bool:
        known = self.known.get(args)
        if known is not None:
            return known
        if args in self.pending:  # being built in the background: the eager reference meanwhile
            return False
        return self._settle(args)

    def _settle(self, args: tuple) -> bool:
        with self.lock:
            if args not in self.known:
                self.known[args] = bool(self.probe(*args))
            self.pending.discard(args)
            return self.known[args]

    def defer(self, *args) -> None:
        """Until someone settles these arguments (`settle`, `settle_in_background`), callers get False:
        the eager reference runs and nothing is compiled for them."""
        if args not in self.known:
            self.pending.add(args)

    def settle(self, *args) -> bool:
        """Probe now (waiting for the compiler if need be), even if deferred."""
        known = self.known.get(args)
        return known if known is not None else self._settle(args)

    def peek(self, *args) -> bool | None:
        """The verdict if it is known, else None (never probes)."""
        return self.known.get(args)

    def cache_clear(self) -> None:
        self.known.clear()
        self.pending.clear()


def settle_in_background(jobs: list[tuple[Verdict, tuple]]) -> threading.Thread:
    """Probe each (verdict, args) on one daemon thread, in order; callers use the eager reference until
    each verdict is in. Returns the thread (join it to wait)."""
    for verdict, args in jobs:
        verdict.defer(*args)

    stopping = threading.Event()

    def run():
        for verdict, args in jobs:
            if stopping.is_set():  # the process is exiting: build nothing more
                verdict.pending.discard(args)
                continue
            try:
                verdict._settle(args)
            except Exception as err:  # a probe that cannot even run: that kernel stays off
                verdict.known.setdefault(args, False)
                verdict.pending.discard(args)
                if not stopping.is_set():  # (at exit the compiler fails to register its own exit hooks)
                    warnings.warn(
                        f"fused kernel probe failed, using the eager reference ({type(err).__name__}: {err})",
                        stacklevel=2,
                    )

    def finish():
        # a compiler killed mid-build at interpreter exit aborts the process ("terminate called without an
        # active exception"), so exit lets the build in flight end, and starts no other
        stopping.set()
        thread.join()

    thread = threading.Thread(target=run, name="dsv41-fused-kernels", daemon=True)
    thread.start()
    atexit.register(finish)
    return thread
