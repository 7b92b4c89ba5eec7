"""Random initialisation for from-scratch models (tests, demos, training start).

Matrices, router weights included, get N(0, 0.02^2) (quantised to their storage format when FP8/FP4),
norms 1, hyper-connection projections small so the mixes start near their biases, router biases and
attention sinks 0, Engram rows N(0, 0.02^2) in FP8 with UE8M0 row scales.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.model.engram import EngramTable
from dsv41.model.layers import Linear, RMSNorm
from dsv41.model.moe import Gate
from dsv41.ops.quant import quantize_fp4_weight, quantize_fp8_weight


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, scale=std):
        return torch.randn(shape, generator=gen) * scale

    for module in model.modules():
        if isinstance(module, Linear):
            w = normal((module.out_features, module.in_features))
            if module.fmt == "fp8":
                q, s = quantize_fp8_weight(w)
                module.weight.copy_(q)
                module.scale.copy_(s)
            elif module.fmt == "fp4":
                q, s = quantize_fp4_weight(w)
                module.weight.copy_(q)
                module.scale.copy_(s)
            else:
                module.weight.copy_(w)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, EngramTable):
            rows = normal(tuple(module.weight.shape))
            scale = torch.full_like(module.scale, 2.0**-6, dtype=torch.float32)
            module.weight.copy_((rows / 2.0**-6).clamp(-448, 448).to(torch.float8_e4m3fn))
            module.scale.copy_(scale.to(torch.float8_e8m0fnu))
        elif isinstance(module, Gate):  # a bare parameter, not a Linear: zeros would tie every score
            module.weight.copy_(normal(tuple(module.weight.shape)))
        elif isinstance(module, (nn.Embedding, nn.Linear)):
            module.weight.copy_(normal(tuple(module.weight.shape)))
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("hc_") and leaf.endswith("_fn"):
            param.copy_(normal(tuple(param.shape), 1e-3))
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            param.zero_()
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            param.fill_(1.0)
        elif leaf in ("attn_sink", "bias", "bias_vl"):
            param.zero_()
        elif leaf in ("q_weight", "k_weight"):
            param.fill_(1.0)
        elif name in ("image_start", "image_end", "image_newline"):  # like token embeddings
            param.copy_(normal(tuple(param.shape)))
    return model
