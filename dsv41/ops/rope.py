"""Rotary position embedding with optional YaRN (spec-v41.md §3 "RoPE tables").

Ratio-0 layers use plain RoPE at `rope_theta`; layers with compress ratio > 0 use YaRN on
`compress_rope_theta` for everything in the layer (q, window KV, compressed latents, indexer q/k and the
inverse rotation of the output). Pairs are adjacent channels (real, imag) of the last `rope_head_dim`
channels. No YaRN attention-scale factor is applied.

The tables are the canonical ones in every numerics mode (built once, so this costs nothing per step):
the pow of the frequency ladder and the cos/sin of each angle in float64, rounded once to fp32; the YaRN
blend and the position products in fp32. So the tables are the same on every CPU whatever its math
library. Under reference numerics the rotation itself is canonical too (`apply_rope(reference=True)`).
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(
    dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0, beta_fast: int = 32, beta_slow: int = 1
) -> torch.Tensor:
    """Per-pair angular frequencies, fp32 [dim/2]. With original_seq_len > 0 applies YaRN: pairs whose
    wavelength fits the training context keep their frequency, long ones are divided by `factor`, and
    the band between beta_fast and beta_slow rotations is blended with a linear ramp."""
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    freqs = 1.0 / torch.pow(torch.tensor(base, dtype=torch.float64, device="cpu"), exponent.double()).float()  # [dim/2]
    if original_seq_len > 0:

        def pair_index_for(rotations: float) -> float:
            # the pair whose wavelength makes `rotations` turns over the original context
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(pair_index_for(beta_fast)), 0)
        high = min(math.ceil(pair_index_for(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1 = keep the original frequency, 0 = interpolate by `factor`
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


class RotaryTable:
    """Complex rotations exp(i * pos * freq) for positions [0, n), grown on demand.

    Always computed on the CPU (so every device sees the same table) and copied where asked.

    Row p does not depend on how many rows were built, so growing the table never changes a value.
    """

    def __init__(
        self,
        dim: int,
        base: float,
        original_seq_len: int = 0,
        factor: float = 1.0,
        beta_fast: int = 32,
        beta_slow: int = 1,
    ):
        self.freqs = rope_frequencies(dim, base, original_seq_len, factor, beta_fast, beta_slow)
        self.table = torch.empty(0, dim // 2, dtype=torch.complex64, device="cpu")

    def __call__(self, start: int, length: int, device=None) -> torch.Tensor:
        """complex64 [length, dim/2] for positions start..start+length-1."""
        end = start + length
        if self.table.size(0) < end:
            n = max(end, 2 * self.table.size(0), 256)
            # a normal tensor even when grown under inference_mode (the table outlives that context)
            with torch.inference_mode(False):
                angles = torch.outer(torch.arange(n, device="cpu"), self.freqs)  # [n, dim/2] fp32
                angles = angles.double()  # cos and sin in float64, rounded once (canonical)
                self.table = torch.complex(angles.cos().float(), angles.sin().float())
        rows = self.table[start:end]
        return rows if device is None else rows.to(device)

    def at(self, positions: torch.Tensor, device=None) -> torch.Tensor:
        """complex64 [len(positions), dim/2] for arbitrary positions (compressed-group stamps)."""
        if positions.numel():
            self(0, int(positions.max()) + 1)
        rows = self.table[positions.cpu()]
        return rows if device is None else rows.to(device)


def apply_rope(
    x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool = False, reference: bool = False
) -> torch.Tensor:
    """Rotate the last `rope_dim` channels of x; returns a new tensor of x's dtype.

    x: [B, S, D] or [B, S, H, D]; freqs: complex64 [S, rope_dim/2], or [B, S, rope_dim/2] when each row has
    its own positions (the engine's batched DSpark drafts). `inverse` applies the conjugate rotation (used
    to take the query's rotation back off the attention output). reference: canonical numerics, each pair
    (a, b) rotated by (c, s) as a*c - b*s, a*s + b*c in float64, rounded to fp32 and then x's dtype.
    """
    rows = freqs.size(0) if freqs.ndim == 3 else 1
    pairs = rope_dim // 2
    if x.ndim == 3:
        freqs = freqs.view(rows, x.size(1), pairs)
    else:
        freqs = freqs.view(rows, x.size(1), 1, pairs)
    if reference or torch.compiler.is_compiling():
        # in real pairs: under reference numerics in float64, rounded to fp32 and then x's dtype; inside a
        # compiled graph in fp32, because inductor generates no code for complex arithmetic (each complex op
        # would be an eager fallback inside the graph)
        dtype = torch.float64 if reference else torch.float32
        ab = x[..., -rope_dim:].to(dtype).unflatten(-1, (-1, 2))  # [..., pairs, 2]
        a, b = ab[..., 0], ab[..., 1]
        cs = torch.view_as_real(freqs.resolve_conj()).to(dtype)
        c, s = cs[..., 0], -cs[..., 1] if inverse else cs[..., 1]
        rotated = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).float().to(x.dtype)
        return torch.cat([x[..., :-rope_dim], rotated], dim=-1)
    if inverse:
        freqs = freqs.conj()
    rot = torch.view_as_complex(x[..., -rope_dim:].float().unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(rot * freqs).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)
