"""DeepSeek-ViT and the aligner (spec-v41.md §1.3, §12b, §13; golden `v41-vision-fp8` README "ViT",
"Aligner").

The ViT encodes one image's patches at a time: a linear (not convolutional) patch embedding of the
flattened (channel, y, x) patch, `vision_n_layers` pre-norm blocks with full bidirectional attention
over the image's patches, 2D RoPE (rotate-half form: the first half of the rotary frequencies follow the
patch row, the second half its column) and a SwiGLU MLP, then a final RMSNorm. The aligner folds each
3x3 cell of patch features into one vector (pixel-unshuffle, features ordered channel, dy, dx) and maps
it into the backbone width with a 2-layer GELU MLP, so an image of vit_h x vit_w patches becomes
ceil(vit_h/3) x ceil(vit_w/3) backbone tokens.

Numerics follow the reference: bf16 `nn.Linear` layers (with bias except the MLP), RMSNorm with fp32
weights and eps 1e-6 (not the backbone's norm_eps), `F.scaled_dot_product_attention` on 3-D bf16
tensors. Under reference numerics (`reference_numerics` on each module) every machine-dependent op is
canonical (dsv41.ops.canonical): the linears with their bias, SiLU, GELU, the RMS statistics and the whole
attention softmax(q k^T / sqrt(d)) v in float64, rounded once. The 2D RoPE tables are canonical always.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.ops import canonical
from dsv41.ops.reductions import mean_of_squares, rsqrt

VISION_NORM_EPS = 1e-6


class VisionRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight with an fp32 weight; statistics in fp32, result in x's dtype.
    reference_numerics: the mean of squares and rsqrt in float64, each rounded once (dsv41.ops.canonical)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.reference_numerics = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ref = self.reference_numerics
        xf = xf * rsqrt(mean_of_squares(xf, ref, keepdim=True) + VISION_NORM_EPS, ref)
        return (self.weight * xf).to(x.dtype)


class VisionLinear(nn.Linear):
    """nn.Linear (same parameters and names); with reference_numerics, x W^T + b in float64 (the bias added
    before the one rounding) rounded to fp32 and then x's dtype (`dsv41.ops.canonical.linear`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reference_numerics = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference_numerics:
            return canonical.linear(x, self.weight, self.bias)
        return super().forward(x)


def rope_2d_angles(vit_h: int, vit_w: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Rotation angles [vit_h * vit_w, head_dim / 2] fp32 for patches in row-major order: with
    rd = head_dim / 2, angle[j] = row * theta^(-2j/rd) for j < rd/2 and col * theta^(-2(j - rd/2)/rd)
    for the rest, so each axis gets a full frequency ladder over half of the rotary pairs."""
    rd = head_dim // 2
    exponent = -torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd
    # the pow in float64, rounded once (canonical in every mode: a table, built once per image)
    inv = torch.pow(torch.tensor(theta, dtype=torch.float64, device=device), exponent.double()).float()  # [rd/2]
    rows = torch.arange(vit_h, dtype=torch.float32, device=device).repeat_interleave(vit_w)  # [n]
    cols = torch.arange(vit_w, dtype=torch.float32, device=device).repeat(vit_h)  # [n]
    return torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)  # [n, rd]


def apply_rope_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [..., n, head_dim] pairs dimension j with j + head_dim/2 (not the backbone's
    interleaved pairs); angles [n, head_dim/2]. The cos/sin tables in float64, rounded once to fp32 (the
    same on every CPU); the rotation in fp32, returned in x's dtype."""
    half = x.size(-1) // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = angles.double().cos().float(), angles.double().sin().float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if dim % n_heads or (dim // n_heads) % 4:
            raise ValueError(f"vision_dim {dim} must split into {n_heads} heads of a multiple of 4 dims (2D RoPE)")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wqkv = VisionLinear(dim, 3 * dim, bias=True, dtype=torch.bfloat16)
        self.wo = VisionLinear(dim, dim, bias=True, dtype=torch.bfloat16)
        self.reference_numerics = False  # the attention in float64 (dsv41.ops.canonical)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x [n, dim] bf16 (one image's patches) -> [n, dim]."""
        n = x.size(0)
        q, k, v = self.wqkv(x).view(n, 3, self.n_heads, self.head_dim).permute(1, 2, 0, 3)  # each [heads, n, hd]
        q, k = apply_rope_half(q, angles), apply_rope_half(k, angles)
        # 3-D [heads, n, hd] inputs, as the reference passes them: torch's CPU dispatcher then takes the math
        # kernel (one fp32 softmax per row, one bf16 rounding). A 4-D call picks the blocked flash kernel,
        # whose online softmax rounds differently (60% of the golden's vit_out elements move by an ulp).
        if self.reference_numerics:  # scores, softmax and P.V in float64, one rounding
            scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
            probs = canonical.softmax(scores, dim=-1, dtype=torch.float64)
            out = canonical.round_to(torch.matmul(probs, v.double()), q.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v)  # [heads, n, hd]
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """w2(silu(gate) * up) with gate, up = the two halves of w1's output (no biases)."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = VisionLinear(dim, 2 * inter_dim, bias=False, dtype=torch.bfloat16)
        self.w2 = VisionLinear(inter_dim, dim, bias=False, dtype=torch.bfloat16)
        self.reference_numerics = False  # the SiLU in float64 (dsv41.ops.canonical)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        act = canonical.silu(gate, gate.dtype) if self.reference_numerics else F.silu(gate)
        return self.w2(act * up)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, inter_dim: int):
        super().__init__()
        self.norm1 = VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, n_heads)
        self.norm2 = VisionRMSNorm(dim)
        self.mlp = VisionMLP(dim, inter_dim)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), angles)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = VisionLinear(3 * patch * patch, dim, bias=True, dtype=torch.bfloat16)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [n, 3, p, p] bf16 -> [n, dim]: the flattened (channel, y, x) patch, projected."""
        return self.proj(patches.reshape(patches.size(0), -1))


class VisionTransformer(nn.Module):
    """DeepSeek-ViT: `vision.*` in the checkpoint."""

    def __init__(self, dim: int, n_layers: int, n_heads: int, inter_dim: int, patch: int, rope_theta: float):
        super().__init__()
        self.patch, self.rope_theta, self.head_dim = patch, rope_theta, dim // n_heads
        self.patch_embed = PatchEmbed(patch, dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, n_heads, inter_dim) for _ in range(n_layers))
        self.norm = VisionRMSNorm(dim)

    def forward(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """One image: patches [vit_h * vit_w, 3, p, p] bf16 in row-major order -> [vit_h * vit_w, dim] bf16."""
        if patches.size(0) != vit_h * vit_w:
            raise ValueError(f"{patches.size(0)} patches for a {vit_h}x{vit_w} grid")
        angles = rope_2d_angles(vit_h, vit_w, self.head_dim, self.rope_theta, patches.device)
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))  # bf16 (release); fp32 in training
        for block in self.blocks:
            x = block(x, angles)
        return self.norm(x)


class Aligner(nn.Module):
    """3x3 pixel-unshuffle of the ViT's patch grid, then w2(gelu(w1(.))) into the backbone width:
    `aligner.*` in the checkpoint."""

    def __init__(self, vision_dim: int, dim: int, downsample: int):
        super().__init__()
        self.downsample = downsample
        self.w1 = VisionLinear(vision_dim * downsample * downsample, dim, bias=True, dtype=torch.bfloat16)
        self.w2 = VisionLinear(dim, dim, bias=True, dtype=torch.bfloat16)
        self.reference_numerics = False  # the GELU in float64 (dsv41.ops.canonical)

    def forward(self, features: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """features [vit_h * vit_w, C] -> [ceil(vit_h/r) * ceil(vit_w/r), dim], cells in row-major order."""
        r = self.downsample
        grid = features.view(vit_h, vit_w, -1).permute(2, 0, 1)  # [C, vit_h, vit_w]
        grid = F.pad(grid, (0, -vit_w % r, 0, -vit_h % r))  # zero-pad right and bottom to multiples of r
        cells = F.unfold(grid.unsqueeze(0), kernel_size=r, stride=r)[0].transpose(0, 1)  # [cells, C*r*r] (c, dy, dx)
        hidden = self.w1(cells)
        act = canonical.gelu(hidden, hidden.dtype) if self.reference_numerics else F.gelu(hidden)
        return self.w2(act)
