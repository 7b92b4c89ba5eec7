"""The differentiable training forward of the V4.1 model (training.md §4, §5, §7; spec-v41.md §2.1, §3, §4, §8).

It runs the model's one layer loop (dsv41.model.forward) over whole sequences from position 0, with its own
attention backend (`TrainingAttention`, no cache), and these training-time differences:

- Attention is written as one masked softmax over [the sequence's own window KV | the compressed
  entries] (a boolean mask per query: its window, and its top-k selection), with the per-head sink in
  the denominator. This is the independent formulation of `ops.sparse_attn` and works in any dtype.
- QAT (`qat=True`): the window KV, the compressed KV and the indexer q/k go through the inference
  roundings with a straight-through gradient (dsv41.ops.qat), at the points where the cache is written.
- The indexer trains from step 0 with no dense warm-up: its inputs are detached, the top-k is taken on
  its scores, and a KL loss pulls its distribution over the selected set towards the main attention's
  (summed over heads, L1-normalised, stop-gradient). So the LM loss trains the model and the KL trains
  the indexer. `dense_indexer=True` (ablations / warm-up) attends to every visible entry and takes the
  KL over all of them.
- MoE: the routing of every layer is collected for the sequence-wise balance loss and the expert loads,
  counted separately for text tokens and image-span tokens (`token_types`), because the router keeps
  one selection bias per modality (`gate.bias`, `gate.bias_vl`, spec §7); the aux-loss-free bias
  update is applied by the trainer with `ops.moe.balance_bias_update`. Image-span tokens also shut
  the Engram gate and stop its n-gram lookback, as at inference.
- `replay_start`: simulate CED bounded replay (spec §2.1): decoder queries at or after it do not see
  window keys before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41 import ops
from dsv41.model.block import Block
from dsv41.model.forward import AttentionBackend, run_layers
from dsv41.model.moe import RoutingRecord
from dsv41.ops import qat as qat_ops
from dsv41.ops.quant import FP4_BLOCK


@dataclass
class TrainOptions:
    qat: bool = True
    qat_clip: bool = False  # clipped straight-through estimator
    dense_indexer: bool = False  # attend to every visible compressed entry (dense warm-up / ablation)
    replay_start: int | None = None  # simulate bounded replay for the decoder from this position
    # > 0: bound each expert's picks per router call to ceil(factor x tokens x k / experts), overflow moving
    # to the token's next choice (ops.moe.capacity_topk); 0: route freely, as inference does
    capacity_factor: float = 0.0


@dataclass
class TrainOutput:
    logits: torch.Tensor  # [B, S, vocab] fp32
    indexer_kl: torch.Tensor  # scalar, mean over index-source layers
    balance_loss: torch.Tensor  # scalar, mean over MoE layers of the sequence-wise balance loss
    # scalar, mean over MoE layers and sequences of the router input's shared fraction within the sequence
    # (|mean_s x|^2 / mean_s |x|^2, differentiable): what the trainer's `shared_input_weight` penalises
    shared_input_loss: torch.Tensor | None = None
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> text tokens per expert [E]
    # layer -> image-span tokens per expert [E], for the layers whose router has a `bias_vl` (zeros
    # when the batch has no image tokens, so every rank reduces the same tensors)
    expert_load_vl: dict[int, torch.Tensor] = field(default_factory=dict)
    # layer -> the gate input's first and second moments, summable over micro-batches and ranks:
    # fp64 [dim + 4] = (sum_t x, sum_t |x|^2, tokens, sum over sequences of |mean_seq x|^2, sequences)
    # (`gate_input_shared_fraction` turns them into the shared-component fractions)
    gate_stats: dict[int, torch.Tensor] = field(default_factory=dict)
    # layer -> the text tokens' router inputs [T, dim], detached (the trainer's look-ahead balancing
    # re-scores them under changed router weights)
    router_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # layer -> text tokens per expert [E] as the router picked them before the capacity bound (only with
    # TrainOptions.capacity_factor > 0; expert_load then counts the picks the experts processed)
    expert_load_natural: dict[int, torch.Tensor] = field(default_factory=dict)


def prepare_for_training(model, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """fp32 (or `dtype`) master weights everywhere, trainable Engram tables, no batch-invariant chunking."""
    for layer in model.layers:
        if layer.engram is not None:
            layer.engram.embed.make_trainable(dtype)
    model.set_batch_invariant(0)
    return model.to(dtype)


class _Context:
    """Per-forward state shared across layers: compressed entries and keys by kv source, selections by
    index source, the candidate pool, and the indexer losses."""

    def __init__(self, opts: TrainOptions, seq_len: int, device):
        self.opts, self.seq_len, self.device = opts, seq_len, device
        self.compressed: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.selected: dict[int, torch.Tensor] = {}
        self.candidates: torch.Tensor | None = None
        self.kl: list[torch.Tensor] = []


def _fq(x: torch.Tensor, kind: str, opts: TrainOptions) -> torch.Tensor:
    if not opts.qat:
        return x
    if kind == "window":
        return qat_ops.fp8_fake_quant(x)
    if kind == "kv":
        return qat_ops.kv_fake_quant(x, opts.qat_clip)
    return qat_ops.fp4_fake_quant(x, FP4_BLOCK, "ue8m0", opts.qat_clip)


def _compress(compressor, x: torch.Tensor) -> torch.Tensor:
    """Latents of the complete groups of a whole sequence: x [B, S, dim] -> [B, S // ratio, head_dim]."""
    if compressor.ratio == 1:
        return compressor.norm(compressor.wkv(x))
    ratio = compressor.ratio
    b, s, _ = x.shape
    used = s // ratio * ratio
    kv = compressor.wkv(x[:, :used].float()).unflatten(1, (-1, ratio))  # [B, G, ratio, D]
    score = compressor.wgate(x[:, :used].float()).unflatten(1, (-1, ratio))
    return compressor.norm((kv * score.softmax(dim=2)).sum(dim=2).to(x.dtype))


def _indexer_kl(attn_probs: torch.Tensor, index_logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(I)) over each query's selected set, averaged over queries with a selection.

    attn_probs [B, S, H, T] main attention on the compressed entries (detached here); index_logits
    [B, S, T] (-inf outside the visible set); selected [B, S, T] bool."""
    target = attn_probs.detach().sum(dim=2).masked_fill(~selected, 0.0)
    mass = target.sum(dim=-1, keepdim=True)
    has = (mass.squeeze(-1) > 0) & selected.any(dim=-1)
    if not bool(has.any()):
        return index_logits.sum() * 0.0
    p = target / mass.clamp_min(1e-30)
    log_q = torch.log_softmax(index_logits.masked_fill(~selected, -torch.inf), dim=-1)
    terms = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1)[has].mean()


def _compressed(
    attn, x: torch.Tensor, qr: torch.Tensor, ctx: _Context
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (compressed rows [B, T, D], selection mask [B, S, T], index logits [B, S, T] or None)."""
    opts, src, ratio = ctx.opts, attn.kv_source, attn.ratio
    s = ctx.seq_len
    if attn.compressor is not None:
        latent = _compress(attn.compressor, x)  # [B, G, D]
        g = latent.size(1)
        freqs = attn.rope.at(torch.arange(g) * ratio, x.device)  # a group is stamped with its first token
        if attn.indexer is not None:  # index keys from the detached latent: only the KL trains them
            idx = attn.indexer
            keys = ops.apply_rope(idx.k_norm(idx.wk(latent.detach())), freqs, idx.rope_dim)
            ctx.keys[src] = _fq(keys, "index", opts)
        ctx.compressed[src] = _fq(ops.apply_rope(latent, freqs, attn.rope_dim), "kv", opts)
    rows = ctx.compressed[src]
    t = rows.size(1)
    pos = torch.arange(s, device=x.device)
    visible = torch.arange(t, device=x.device).unsqueeze(0) < ((pos + 1) // ratio).unsqueeze(1)  # [S, T]
    if attn.indexer is None:
        return rows, ctx.selected[attn.index_source], None
    idx = attn.indexer
    freqs = attn.rope(0, s, x.device)
    q = idx.wq_b(qr.detach()).unflatten(-1, (idx.n_heads, idx.head_dim))
    q = _fq(ops.apply_rope(q, freqs, idx.rope_dim), "index", opts)
    weights = idx.weights_proj(x.detach()) * idx.weight_scale
    per_head = torch.einsum("bshd,btd->bsht", q, ctx.keys[src].to(q.dtype))
    logits = (per_head.relu() * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, -torch.inf)  # [B, S, T]
    n_visible = ((pos + 1) // ratio).unsqueeze(-1)
    if idx.is_candidate_source:
        ctx.candidates = ops.candidate_pool(logits.detach(), n_visible, idx.candidate_blocks, idx.candidate_block_size)
    elif idx.uses_candidates:
        logits = logits.masked_fill(~ctx.candidates, -torch.inf)
    if opts.dense_indexer or t == 0:
        selected = torch.isfinite(logits.detach()) if idx.uses_candidates else visible.expand_as(logits)
    else:
        scores = logits.detach()
        top = ops.topk_canonical(scores, min(idx.topk, t))  # the inference selection, ties included
        selected = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, scores.gather(-1, top) > -torch.inf)
    ctx.selected[attn.layer_id] = selected
    return rows, selected, logits


def attention_train(attn, x: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """One layer's attention over whole sequences: x [B, S, dim] (normed input) -> [B, S, dim]."""
    b, s, _ = x.shape
    opts = ctx.opts
    freqs = attn.rope(0, s, x.device)
    qr = attn.q_norm(attn.wq_a(x))
    q = ops.apply_rope(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)), freqs, attn.rope_dim)
    kv = _fq(ops.apply_rope(attn.kv_norm(attn.wkv(x)), freqs, attn.rope_dim), "window", opts)

    pos = torch.arange(s, device=x.device)
    window = (pos.unsqueeze(0) <= pos.unsqueeze(1)) & (pos.unsqueeze(0) > pos.unsqueeze(1) - attn.window)  # [S, S]
    start = opts.replay_start
    if start is not None and attn.layer_id >= ctx.decoder_from:
        window = window & ~((pos.unsqueeze(1) >= start) & (pos.unsqueeze(0) < start))
    rows, mask = kv, window.expand(b, s, s)
    index_logits = selected = None
    if attn.ratio:
        comp, selected, index_logits = _compressed(attn, x, qr, ctx)
        rows = torch.cat([kv, comp.to(kv.dtype)], dim=1)
        mask = torch.cat([mask, selected], dim=-1)

    # the softmax in fp32 whatever the weights' dtype, like the inference kernel
    rows32 = rows.float()
    logits = torch.einsum("bshd,bnd->bshn", q.float(), rows32) * attn.softmax_scale
    logits = logits.masked_fill(~mask.unsqueeze(2), -torch.inf)
    sink = attn.attn_sink.float().view(1, 1, -1, 1).expand(b, s, attn.n_heads, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]  # [B, S, H, N]
    o = torch.einsum("bshn,bnd->bshd", probs, rows32).to(q.dtype)
    if index_logits is not None:
        ctx.kl.append(_indexer_kl(probs[..., s:], index_logits, selected))
    return attn.output(o, freqs)


class TrainingAttention(AttentionBackend):
    """The training forward's attention backend: whole sequences from position 0, no cache, every block's
    attention by `attention_train` (differentiable, QAT roundings, the indexer's KL loss into the context)."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        return attention_train(layer.attn, x, self.ctx)


def forward_train(
    model,
    input_ids: torch.Tensor,
    opts: TrainOptions | None = None,
    token_types: torch.Tensor | None = None,
    images: list | None = None,
) -> TrainOutput:
    """input_ids [B, S] from position 0 -> logits and the auxiliary losses (see the module docstring).
    token_types: optional [B, S] bool, True for image-span tokens (VL routing bias, Engram off).
    images: optional (row, start, ImagePatches) triples (see `Transformer.embed_inputs`): their spans'
    embeddings come from the ViT + aligner (trained through them) and set token_types."""
    opts = opts or TrainOptions()
    cfg = model.cfg
    b, s = input_ids.shape
    device = input_ids.device
    embeds = None
    if images:
        if token_types is not None:
            raise ValueError("give images or token_types, not both: the images' spans define the token types")
        embeds, kinds = model.embed_inputs(input_ids, images)  # [B, S, dim], [B, S] (-1 text)
        token_types = kinds >= 0
    ctx = _Context(opts, s, device)
    ctx.decoder_from = cfg.decoder_boundary
    hash_ids = None
    if model.engram_hash is not None:
        history = torch.zeros(b, s, dtype=torch.int64, device=device)
        hash_ids = model.engram_hash(input_ids, 0, history, None if token_types is None else ~token_types)
    embeds = model.embed(input_ids) if embeds is None else embeds
    h = embeds.unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [B, S, hc, dim]
    pre_mix = torch.zeros(b, s, cfg.hc_mult, dtype=torch.float32, device=device)
    pre_mix[..., 0] = 1.0
    routing = RoutingRecord(opts.capacity_factor)  # not a list: see RoutingRecord
    shared = {"moe_aux": routing}
    h, pre_mix, _ = run_layers(model, h, pre_mix, TrainingAttention(ctx), shared, token_types, hash_ids)
    logits = model.logits(model.norm(Block.hc_pre(h, pre_mix)))

    zero = logits.sum() * 0.0
    kl = torch.stack(ctx.kl).mean() if ctx.kl else zero
    balance, loads, loads_vl = [], {}, {}
    image = None if token_types is None else token_types.reshape(-1)  # rows of the router's [B*S, k] picks
    if len(routing) != cfg.n_layers:
        raise RuntimeError(f"{len(routing)} of {cfg.n_layers} MoE layers reported their routing")
    gate_stats, router_inputs, shared_terms, natural = {}, {}, [], {}
    for layer, (scores, indices, x) in enumerate(routing.calls):
        n_experts = scores.size(-1)
        gate_stats[layer] = gate_input_moments(x.detach().view(b, s, -1))
        per_token = x.float().view(b, s, -1)
        shared_terms.append(
            (per_token.mean(1).square().sum(-1) / per_token.square().sum(-1).mean(1).clamp_min(1e-12)).mean()
        )
        router_inputs[layer] = x.detach() if image is None else x.detach()[~image]
        balance.append(ops.moe.sequence_balance_loss(scores.view(b, s, -1), indices.view(b, s, -1), n_experts))
        loads[layer] = ops.moe.expert_load(indices, n_experts, None if image is None else ~image)
        if routing.natural:
            natural[layer] = ops.moe.expert_load(routing.natural[layer], n_experts, None if image is None else ~image)
        if model.layers[layer].ffn.gate.bias_vl is not None:
            loads_vl[layer] = (
                ops.moe.expert_load(indices, n_experts, image)
                if image is not None
                else torch.zeros(n_experts, device=device)
            )
    return TrainOutput(
        logits,
        kl,
        torch.stack(balance).mean() if balance else zero,
        torch.stack(shared_terms).mean() if shared_terms else zero,
        loads,
        loads_vl,
        gate_stats,
        router_inputs,
        natural,
    )


def gate_input_moments(x: torch.Tensor) -> torch.Tensor:
    """x [B, S, dim] (a router's input) -> fp64 [dim + 4]: sum_t x, sum_t |x|^2, B*S, sum_b |mean_s x_b|^2, B."""
    x = x.double()
    per_seq = x.mean(dim=1)  # [B, dim]
    return torch.cat(
        [
            x.sum(dim=(0, 1)),
            x.square().sum().view(1),
            x.new_tensor([x.shape[0] * x.shape[1]]),
            per_seq.square().sum().view(1),
            x.new_tensor([x.shape[0]]),
        ]
    )


def gate_input_shared_fraction(moments: torch.Tensor) -> tuple[float, float]:
    """(global, per-sequence) share of the gate input's energy in a component common to its tokens:
    |mean_t x|^2 / mean_t |x|^2 over all tokens, and the same within each sequence (averaged). Near 0 for
    token-specific inputs; near 1 when every token carries the same vector and the router ranks the
    experts alike for all of them (the routing collapse of issue 11)."""
    total, sq, n, seq_sq, n_seq = (
        moments[:-4],
        float(moments[-4]),
        float(moments[-3]),
        float(moments[-2]),
        float(moments[-1]),
    )
    energy = sq / max(n, 1.0)
    if energy <= 0:
        return 0.0, 0.0
    mean = total / max(n, 1.0)
    return float(mean.square().sum()) / energy, seq_sq / max(n_seq, 1.0) / energy
