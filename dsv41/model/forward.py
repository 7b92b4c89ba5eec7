"""The model's one layer loop (spec-v41.md §2, §6): every forward of the backbone runs its blocks here.

The plain `Transformer.forward`, the engine's ragged batches (dsv41.engine.runner), the training forward
(dsv41.model.training) and the RL learner's replay of the engine (dsv41.model.replay) differ only in where
attention's sequence mixing reads and writes its keys: a contiguous `ModelCache`, the engine's paged pool,
no cache at all (whole sequences, differentiable), or a cache filled span by span. That is the
`AttentionBackend` each passes down; the blocks, Engram, hyper-connections, MoE and the DSpark capture run
the same code for all of them, so a kernel change lands once.
"""

from __future__ import annotations

import torch

from dsv41.model import dspark
from dsv41.model.attention import _trace


class AttentionBackend:
    """Where a forward's attention finds its keys. `attend` gets the block and its normed attention input
    x [B, T, dim] and returns the attention output [B, T, dim] (projections, sequence mixing, output
    projection: a backend may run the token-wise parts its own way, the engine's compiled decode regions)."""

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def token_calls(self) -> list[int] | None:
        """The token counts of the separate calls this forward stands for, when several sequences' chunks
        share it and each must get the bits of its chunk run alone (dsv41.ops.lanes); None: one call."""
        return None

    def trim(self, layer, h: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor | None:
        """Called before each block: the indices of the tokens this block and those above it still run, or
        None for all (the engine's bounded replay drops prompt positions at the decoder boundary)."""
        return None


def run_layers(
    model,
    h: torch.Tensor,
    pre_mix: torch.Tensor,
    backend: AttentionBackend,
    shared: dict,
    image_mask: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
    capture_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """h [B, T, hc, dim] bf16 (the embeddings repeated over the copies), pre_mix [B, T, hc] fp32 -> the last
    block's (h, pre_mix) and, with capture_hidden, the DSpark target layers' inputs ([B, T, dim] each, the
    stream entering the block after its Engram; empty when the model has no drafter).

    shared: the forward's per-call dict (trace, moe_aux, compiled regions); `token_calls` is set in it per
    block. image_mask [B, T] bool: image-span tokens (routed with bias_vl, dead to Engram). hash_ids
    [B, T, n_engram_layers, columns]: the Engram rows. A block that the backend trims to no tokens ends
    the loop (what it returns then has T = 0)."""
    targets = set(model.cfg.dspark_target_layer_ids) if capture_hidden and len(model.mtp) else set()
    layout = model.engram_layout
    hidden: list[torch.Tensor] = []
    for i, layer in enumerate(model.layers):
        keep = backend.trim(layer, h, pre_mix)
        if keep is not None:
            h, pre_mix = h[:, keep], pre_mix[:, keep]
            hash_ids = None if hash_ids is None else hash_ids[:, keep]
            image_mask = None if image_mask is None else image_mask[:, keep]
            hidden = [t[:, keep] for t in hidden]
            if keep.numel() == 0:
                break
        engram_ids = None if layer.engram is None else hash_ids[:, :, layout.layer_ids.index(i)]
        capture = None
        if i in targets:
            ref, into = layer.reference_numerics, hidden
            capture = lambda x, ref=ref, into=into: into.append(dspark.main_hidden(x, ref))  # noqa: E731
        shared["token_calls"] = backend.token_calls()
        # the module call (not .run): FSDP2's hooks gather a sharded block's weights, Engram's included
        h, pre_mix = layer(
            h, pre_mix, lambda x, layer=layer: backend.attend(layer, x), shared, image_mask, engram_ids, capture
        )
        _trace(shared, f"hidden.layers.{i}.out", h)
        _trace(shared, f"hidden.layers.{i}.pre_mix_out", pre_mix)
    return h, pre_mix, hidden
