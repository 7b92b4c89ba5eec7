"""Compiled token-wise regions of a `fast` decode step, one graph per batch bucket (docs/engine-speed.md).

A decode step of a small batch is bound by dispatch, not by arithmetic: each block runs ~150 small eager
ops (the hyper-connection RMS statistic, mix projection, sigmoids and 20 Sinkhorn iterations, the
collapse and expand sums, norms, the q/kv projections and RoPE, FP8 rounding), a few microseconds each.
Under `fast` numerics nothing asks for those ops' exact roundings, so each run of them between the
sequence-mixing attention and the MoE's data-dependent expert dispatch is compiled into one graph
(torch.compile, inductor's C++ backend on a CPU) with static shapes:

- `pre_attention`: the attention sublayer's mixes (RMS, projection, Sinkhorn) and its normed input;
- `project`: the attention's q/kv projections, norms, RoPE and the window KV's FP8 rounding;
- `output`: the inverse RoPE and the grouped output projection;
- `post_attention`: the attention sublayer's expand (`hc_post`), the FFN sublayer's mixes and normed input.

The functions take the block or attention module as an argument, so one graph serves every layer of the
same shape (the compiler treats the modules' weights as inputs). A batch of B decode tokens is padded to the
next bucket (1, 2, 4, 8, 16, 32 rows; token-wise math, so the padding rows never touch the real ones);
larger batches and prefill chunks stay eager. Compiling a bucket takes seconds (tens on a cold compiler
cache; inductor's on-disk caches make later processes faster), so buckets are built on a background thread
or before the first request (`EngineConfig.fused_kernels`), and until a bucket is built its steps run eager.
"""

from __future__ import annotations

import logging
import threading

import torch

from dsv41.model.block import Block

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32)


def pre_attention(block: Block, h: torch.Tensor, pre_mix: torch.Tensor):
    """h [1, T, hc, dim] bf16, pre_mix [1, T, hc] -> ((pre, post, comb) of the attention sublayer, normed x)."""
    mixes = block.hc_mixes(h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base)
    return mixes, block.attn_input(h, pre_mix)


def project(attn, x: torch.Tensor, freqs: torch.Tensor):
    """`Attention.project`: x [1, T, dim] -> (qr, q, kv)."""
    return attn.project(x, freqs)


def output(attn, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`Attention.output`: o [1, T, H, D] -> [1, T, dim]."""
    return attn.output(o, freqs)


def post_attention(block: Block, x, residual, post, comb, attn_pre):
    """The attention sublayer's expand, then the FFN sublayer's mixes and normed input:
    -> (h [1, T, hc, dim], (pre, post, comb) of the FFN, normed FFN input [1, T, dim])."""
    h = block.hc_post(x, residual, post, comb)
    mixes = block.hc_mixes(h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base)
    return h, mixes, block.ffn_norm(block.hc_pre(h, attn_pre))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad dim 1 (tokens) of t with zeros to `rows`."""
    extra = rows - t.size(1)
    if not extra:
        return t
    return torch.cat([t, t.new_zeros(t.size(0), extra, *t.shape[2:])], dim=1)


def _cut(value, n: int):
    """Every tensor in a (nested) tuple cut back to its first n tokens (dim 1)."""
    if isinstance(value, tuple):
        return tuple(_cut(v, n) for v in value)
    return value[:, :n]


class CompiledDecode:
    """The compiled regions of one model's decode steps, bucket by bucket. `regions(n)` gives an object with
    the four functions for a decode batch of n tokens once that bucket is built, else None (run eager)."""

    def __init__(self, model, buckets: tuple[int, ...] = BUCKETS):
        self.model, self.buckets = model, buckets
        self.ready: set[int] = set()
        self.failed = False
        self._compiled = {
            name: torch.compile(fn, dynamic=False) for name, fn in self._functions().items()
        }  # one compile cache per process; graphs are keyed by the padded shapes
        self._thread: threading.Thread | None = None

    @staticmethod
    def _functions() -> dict:
        return {"pre_attention": pre_attention, "project": project, "output": output, "post_attention": post_attention}

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def regions(self, n: int) -> _Regions | None:
        b = self.bucket(n)
        if b is None or b not in self.ready or self.failed:
            return None
        return _Regions(self._compiled, n, b)

    # ---------------------------------------------------------------- building
    def build(self, buckets: tuple[int, ...] | None = None) -> None:
        """Compile the given buckets now (each traced on every layer shape the model has)."""
        for b in buckets or self.buckets:
            if self.failed or b in self.ready:
                continue
            try:
                self._warm(b)
            except Exception as err:  # noqa: BLE001 - no compiler, an op it cannot take: the eager ops serve
                log.warning("compiled decode regions unavailable (%s: %s); decoding eager", type(err).__name__, err)
                self.failed = True
                return
            self.ready.add(b)

    def build_in_background(self) -> threading.Thread:
        """Compile every bucket on a daemon thread, smallest first; steps run eager until theirs is built."""
        self._thread = threading.Thread(target=self.build, name="dsv41-compile-decode", daemon=True)
        self._thread.start()
        return self._thread

    @torch.inference_mode()
    def _warm(self, rows: int) -> None:
        """Run each region on every layer at `rows` tokens on stand-in inputs: the first layer compiles, the
        others check that they reuse its graphs (a layer that needed its own would compile here, not inside
        a request)."""
        cfg, model = self.model.cfg, self.model
        dev = model.device
        h = torch.zeros(1, rows, cfg.hc_mult, cfg.dim, dtype=torch.bfloat16, device=dev)
        pre = torch.full((1, rows, cfg.hc_mult), 1.0 / cfg.hc_mult, device=dev)
        positions = torch.arange(rows, device=dev)
        regions = _Regions(self._compiled, rows, rows)
        with model.numerics(0):
            for block in model.layers:
                attn = block.attn
                freqs = attn.rope.at(positions, dev)
                (a_pre, a_post, a_comb), x = regions.pre_attention(block, h, pre)
                qr, q, kv = regions.project(attn, x, freqs)
                o = regions.output(attn, q, freqs)
                regions.post_attention(block, o, h, a_post, a_comb, a_pre)


class _Regions:
    """The compiled regions for one decode step of n tokens, padded to `rows`."""

    def __init__(self, compiled: dict, n: int, rows: int):
        self.compiled, self.n, self.rows = compiled, n, rows

    def _call(self, name: str, module, *tensors):
        padded = [_pad_rows(t, self.rows) for t in tensors]
        out = self.compiled[name](module, *padded)
        return out if self.rows == self.n else _cut(out, self.n)

    def pre_attention(self, block, h, pre_mix):
        return self._call("pre_attention", block, h, pre_mix)

    def _freqs(self, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE rows [T, rope/2] complex64 (tokens on dim 0) padded with the identity rotation."""
        if self.rows == self.n:
            return freqs
        return torch.cat([freqs, freqs.new_ones(self.rows - self.n, *freqs.shape[1:])])

    def project(self, attn, x, freqs):
        out = self.compiled["project"](attn, _pad_rows(x, self.rows), self._freqs(freqs))
        return out if self.rows == self.n else _cut(out, self.n)

    def output(self, attn, o, freqs):
        out = self.compiled["output"](attn, _pad_rows(o, self.rows), self._freqs(freqs))
        return out if self.rows == self.n else out[:, : self.n]

    def post_attention(self, block, x, residual, post, comb, attn_pre):
        return self._call("post_attention", block, x, residual, post, comb, attn_pre)
