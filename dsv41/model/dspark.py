"""The DSpark speculative drafter shipped under `mtp.{0,1,2}.*` (spec-v41.md §12b, §13; the golden set
`v41-dspark-fp8` README documents the reference's `forward_spec`).

What feeds it: for every backbone layer in `dspark_target_layer_ids` (ascending), the hyper-connection
stream entering that block (after the layer's own Engram), averaged over the copies in bf16, concatenated
along features -> `main_hidden` [B, S, n_targets * dim]. Stage 0's `main_proj` + `main_norm` turn it into
`main_x` [B, S, dim], handed to every stage.

Each stage is a sliding-window block (its own MoE, no compressor, indexer or Engram) whose window ring holds
only backbone ("main") rows: `kv_norm(wkv(main_x))` RoPE'd at the backbone position and FP8-rounded. A
prefill writes the prompt's last `window` main rows; every decode step writes the new backbone position's
row first and then drafts, so the drafter must run after every backbone forward.

Drafting at backbone position p: the block [last token, noise x (k-1)] at positions p+1..p+k goes through
the stages (the attention reads every filled ring slot plus all k draft keys, no causal mask inside the
block; draft keys are never stored), the last stage's norm and the shared backbone head give base logits
for the k positions; the Markov head adds a bias conditioned on the previous draft token (sequential:
token i+1 is chosen from base_logits[i] + bias(token i)); the confidence head scores each position from
[collapsed stream before the norm, Markov embedding] (fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dsv41 import ops
from dsv41.config import ModelConfig
from dsv41.model.attention import _trace
from dsv41.model.block import Block
from dsv41.model.layers import Linear, RMSNorm


class MarkovHead(nn.Module):
    """Logit bias from the previous draft token: head(embed[token]); embed bf16 [V, rank], head fp32 [V, rank]
    (bf16 on disk, promoted like the backbone head)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, dtype=torch.bfloat16)
        self.head = nn.Linear(rank, vocab, bias=False, dtype=torch.float32)


class ConfidenceHead(nn.Module):
    """Predicted acceptance of a draft position: proj([x, markov embedding]) in fp32, one logit."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(dim + rank, 1, bias=False, dtype=torch.float32)


class DSparkStage(Block):
    """`mtp.<k>`: a ratio-0 block (layer id n_layers + k); stage 0 adds `main_proj`/`main_norm`, the last
    stage `norm`, `markov_head` and `confidence_head`."""

    def __init__(self, cfg: ModelConfig, k: int, rope: ops.RotaryTable):
        super().__init__(cfg, cfg.n_layers + k, rope)
        self.stage = k
        if k == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * cfg.dim, cfg.dim, cfg.dtype)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if k == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(cfg.dim, cfg.dspark_markov_rank)

    def main_kv(self, main_x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """main_x [B, S, dim] -> this stage's ring rows [B, S, head_dim]: kv_norm(wkv(.)), RoPE, FP8 rounding."""
        attn = self.attn
        return ops.fp8_qdq(
            ops.apply_rope(attn.kv_norm(attn.wkv(main_x)), freqs, attn.rope_dim, reference=attn.reference_numerics)
        )

    def draft_attention(
        self, x: torch.Tensor, ring: torch.Tensor, ring_ids: torch.Tensor, freqs: torch.Tensor
    ) -> torch.Tensor:
        """x [B, k, dim] normed draft inputs; ring [B, W, head_dim]; ring_ids [B, n] int: the ring slots to
        read (slot order), -1 padding after them; freqs: the draft positions' rotations ([k, r] or
        [B, k, r]). Every query reads those slots and all k draft keys (after the slots)."""
        attn = self.attn
        b, k, _ = x.shape
        _, q, kv = attn.project(x, freqs)  # draft keys: the window format, never stored
        rows = torch.cat([ring, kv], dim=1)  # [B, W + k, head_dim]
        w = ring.size(1)
        keys = (w + torch.arange(k, device=x.device, dtype=ring_ids.dtype)).expand(b, k)
        ids = torch.cat([ring_ids, keys], dim=1)
        if bool((ring_ids < 0).any()):  # rows with fewer slots: the draft keys follow each row's own slots
            order = torch.sort((ids < 0).int(), dim=1, stable=True).indices
            ids = ids.gather(1, order)
        ids = ids.int().unsqueeze(1).expand(b, k, -1)
        return attn.output(
            ops.sparse_attn(
                q, rows, attn.attn_sink, ids, attn.softmax_scale, attn.reference_numerics, attn.heads_per_call
            ),
            freqs,
        )


def ring_slots(pos: torch.Tensor, first: torch.Tensor, window: int) -> torch.Tensor:
    """The ring slots holding positions max(first, pos - window + 1)..pos, in slot order, per row:
    pos, first [B] -> [B, window] int64, -1 where a slot holds nothing readable (compacted to the left
    when every row has the same count)."""
    lo = torch.maximum(first, pos - window + 1)  # [B]
    span = pos - lo + 1  # slots held
    slot = torch.arange(window, device=pos.device)
    valid = (slot.unsqueeze(0) - lo.unsqueeze(1)) % window < span.unsqueeze(1)  # [B, W]
    ids = torch.where(valid, slot, -1)
    order = torch.sort((~valid).int(), dim=1, stable=True).indices  # the readable slots first, in slot order
    ids = ids.gather(1, order)
    return ids[:, : int(span.max())]


@dataclass
class Draft:
    """One drafting call. tokens [B, k + 1]: the given first token, then the k drafted ones."""

    tokens: torch.Tensor
    logits: torch.Tensor  # [B, k, V] fp32: base + Markov bias (what token i+1 was chosen from)
    base_logits: torch.Tensor  # [B, k, V] fp32
    markov_bias: torch.Tensor  # [B, k, V] fp32
    confidence: torch.Tensor  # [B, k] fp32 logits of acceptance


def main_hidden(h: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """The drafter's view of a target layer: the stream entering the block [B, S, hc, dim] bf16 averaged
    over the copies (one bf16 rounding) -> [B, S, dim]. reference: the mean in float64."""
    if reference:
        return ops.canonical.mean(h, dim=2, dtype=h.dtype)
    return h.mean(dim=2)


def main_x(stages: nn.ModuleList, hidden: torch.Tensor) -> torch.Tensor:
    """main_hidden [B, S, n_targets * dim] bf16 -> main_x [B, S, dim] = main_norm(main_proj(.))."""
    first = stages[0]
    return first.main_norm(first.main_proj(hidden))


def prefill(stages: nn.ModuleList, hidden: torch.Tensor, start_pos: int, cache) -> None:
    """Write the main rows of positions start_pos.. (hidden [B, S, F]) into every stage's ring (the last
    `window` of them; slot = position % window). Nothing else runs."""
    b, s, _ = hidden.shape
    mx = main_x(stages, hidden)
    for stage in stages:
        w = stage.attn.window
        keep = min(s, w)
        rows = stage.main_kv(mx[:, s - keep :], stage.attn.rope(start_pos + s - keep, keep, hidden.device))
        slots = torch.arange(start_pos + s - keep, start_pos + s, device=hidden.device) % w
        cache.window_write(stage.layer_id, b, slots, rows)


def write_rows(stages: nn.ModuleList, hidden: torch.Tensor, positions: torch.Tensor, rings) -> None:
    """The main rows of any positions of any sequences in one call: hidden [N, F] (main_hidden rows),
    positions [N] int64; row i goes to slot positions[i] % window of its own ring (`rings.window_write_rows`
    with rings' slot i the row's sequence). Each row as its own batch entry, so every row is computed as in
    `prefill`, up to the GEMMs' row counts."""
    device = hidden.device
    positions = positions.to(device)
    mx = main_x(stages, hidden.unsqueeze(1))  # [N, 1, dim]
    for stage in stages:
        attn = stage.attn
        rows = stage.main_kv(mx, attn.rope.at(positions, device).unsqueeze(1))  # [N, 1, head_dim]
        rings.window_write_rows(stage.layer_id, positions % attn.window, rows)


def draft(
    model,
    first: torch.Tensor,
    hidden: torch.Tensor,
    pos: int,
    cache,
    trace: dict | None = None,
    choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Draft:
    """Draft k = dspark_block_size tokens after backbone position `pos`.

    first [B] int64: the token at pos + 1 (the backbone's choice at pos); hidden [B, 1, F]: main_hidden of
    the backbone forward at pos. Writes position pos's main row into every stage's ring first. choose:
    picks token i+1 from logits [B, V] (default argmax, the reference's temperature 0).

    pos: an int (every row at the same position; `cache` a ModelCache-like store whose rows start at 0), or
    an int64 tensor [B] of per-row positions, when `cache` also offers `window_write_rows(layer, slots [B],
    rows [B, 1, D])` and `draft_first()` -> [B] (the first position whose main row each ring holds).
    head_logits: the shared head as the caller computes it (normed [B, k, dim] bf16 -> fp32 [B, k, V]; default
    `model.logits`): an engine in `fast` mode passes the one its own forwards use.
    """
    cfg = model.cfg
    stages = model.mtp
    b = first.size(0)
    k, hc = cfg.dspark_block_size, cfg.hc_mult
    device = first.device
    shared: dict = {"trace": trace}
    mx = main_x(stages, hidden)  # [B, 1, dim]
    _trace(shared, "spec.main_x", mx[:, 0])
    ids = torch.full((b, k), cfg.dspark_noise_token_id, dtype=torch.long, device=device)
    ids[:, 0] = first
    h = model.embed(ids).unsqueeze(2).repeat(1, 1, hc, 1)  # [B, k, hc, dim]
    pre_mix = torch.zeros(b, k, hc, dtype=torch.float32, device=device)
    pre_mix[:, :, 0] = 1.0
    per_row = isinstance(pos, torch.Tensor)  # the engine: each row at its own position
    if per_row:
        pos_t = pos.to(device)
        first_pos = cache.draft_first().to(device)  # [B]: the first position with a main row, per row
        draft_pos = (pos_t.unsqueeze(1) + torch.arange(1, k + 1, device=device)).flatten()
    for stage in stages:
        attn = stage.attn
        w = attn.window
        if per_row:
            row = stage.main_kv(mx, attn.rope.at(pos_t, device).unsqueeze(1))  # [B, 1, head_dim]
            cache.window_write_rows(stage.layer_id, pos_t % w, row)
            ring_ids = ring_slots(pos_t, first_pos, w)
            freqs = attn.rope.at(draft_pos, device).view(b, k, -1)
        else:
            row = stage.main_kv(mx, attn.rope(pos, 1, device))
            cache.window_write(stage.layer_id, b, torch.tensor([pos % w], device=device), row)
            ring_ids = torch.arange(min(w, pos + 1), device=device).expand(b, -1)
            freqs = attn.rope(pos + 1, k, device)
        ring = cache.window_read(stage.layer_id, b)
        stage_trace: dict | None = {} if trace is not None else None
        h, pre_mix = stage.run(
            h,
            pre_mix,
            lambda x, s=stage, r=ring, i=ring_ids, f=freqs: s.draft_attention(x, r, i, f),
            {"trace": stage_trace},
        )
        if trace is not None:
            prefix = f"hidden.layers.{stage.layer_id}."
            for name in ("attn_out", "ffn_out"):
                trace[f"spec.stages.{stage.stage}.{name}"] = stage_trace[prefix + name]
            trace[f"spec.stages.{stage.stage}.out"] = h.clone()
            trace[f"spec.stages.{stage.stage}.pre_mix_out"] = pre_mix.clone()
    last = stages[-1]
    ref = last.reference_numerics
    xh = Block.hc_pre(h, pre_mix, ref)  # [B, k, dim] bf16, before the norm
    _trace(shared, "spec.collapsed", xh)
    normed = last.norm(xh)
    _trace(shared, "spec.final_norm", normed)
    base = (head_logits or model.logits)(normed)  # [B, k, V] fp32, the shared head
    tokens = [first]
    biases, logits, embeds = [], [], []
    for i in range(k):
        e = last.markov_head.embed(tokens[-1])  # [B, rank] bf16
        if ref:
            bias = ops.canonical.linear(e.float(), last.markov_head.head.weight)
        else:
            bias = ops.invariant_matmul(e.float(), last.markov_head.head.weight, model.row_chunk)  # [B, V] fp32
        row = base[:, i] + bias
        tokens.append(row.argmax(-1) if choose is None else choose(row))
        embeds.append(e)
        biases.append(bias)
        logits.append(row)
    embed = torch.stack(embeds, dim=1)  # [B, k, rank]
    features = torch.cat([xh, embed], dim=-1).float()
    if ref:
        confidence = ops.canonical.linear(features, last.confidence_head.proj.weight)[..., 0]
    else:
        confidence = ops.invariant_matmul(features, last.confidence_head.proj.weight, model.row_chunk)[..., 0]
    _trace(shared, "spec.markov_embed", embed)
    result = Draft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1), base, torch.stack(biases, dim=1), confidence)
    if trace is not None:
        trace.update(
            {
                "spec.base_logits": base,
                "spec.markov_bias": result.markov_bias,
                "spec.logits": result.logits,
                "spec.output_ids": result.tokens,
                "spec.confidence": confidence,
            }
        )
    return result


# ---------------------------------------------------------------------------------------- training
@dataclass
class DraftTrainOutput:
    logits: torch.Tensor  # [A, k, V] fp32: base + Markov bias of the true previous token
    confidence: torch.Tensor  # [A, k] fp32 logits, from detached features (a probe: no gradient into the blocks)


def draft_train(
    model, main_hidden: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, anchors: torch.Tensor, qat: bool = True
) -> DraftTrainOutput:
    """The drafter's training forward, differentiable in the `mtp.*` weights only (spec §12b: trained after
    pre-training with the backbone frozen; the shared embedding and head get no gradient).

    main_hidden [B, T, F]: the frozen backbone's drafter inputs over whole sequences; tokens [B, T]; for
    each of A anchors, rows[a] (a sequence) and anchors[a] = p, a backbone position with p + k < T. Each
    anchor drafts positions p+1..p+k exactly as `draft` does at inference (ring = main rows of positions
    p-W+1..p, input [token p+1, noise x (k-1)], no mask inside the block), except that the Markov bias at
    draft position i is conditioned on the true token p+1+i (teacher forcing) and the attention is a dense
    masked softmax. Roundings are straight-through fake quantisation (QAT) with `qat`."""
    from dsv41.ops import qat as qat_ops

    cfg = model.cfg
    stages = model.mtp
    k, hc = cfg.dspark_block_size, cfg.hc_mult
    device = tokens.device
    a_n = anchors.numel()
    t = main_hidden.size(1)  # backbone positions (tokens may run further: the drafted ones)
    # activations in the drafter's master dtype when it trains in fp32, else bf16 (FP8/FP4 weights)
    dtype = torch.float32 if stages[0].main_proj.weight.dtype == torch.float32 else torch.bfloat16
    mx = main_x(stages, main_hidden.to(dtype))  # [B, T, dim]
    offsets = torch.arange(k, device=device)
    ids = torch.full((a_n, k), cfg.dspark_noise_token_id, dtype=torch.long, device=device)
    ids[:, 0] = tokens[rows, anchors + 1]
    with torch.no_grad():
        h = model.embed(ids).to(dtype)
    h = h.unsqueeze(2).repeat(1, 1, hc, 1)  # [A, k, hc, dim]
    pre_mix = torch.zeros(a_n, k, hc, dtype=torch.float32, device=device)
    pre_mix[:, :, 0] = 1.0
    draft_pos = anchors.unsqueeze(1) + 1 + offsets  # [A, k]
    for stage in stages:
        attn = stage.attn
        w = attn.window
        all_rows = ops.apply_rope(attn.kv_norm(attn.wkv(mx)), attn.rope(0, t, device), attn.rope_dim)
        all_rows = qat_ops.fp8_fake_quant(all_rows) if qat else all_rows  # [B, T, head_dim]
        ring_pos = anchors.unsqueeze(1) - w + 1 + torch.arange(w, device=device)  # [A, W]
        ring_ok = ring_pos >= 0
        ring = all_rows[rows.unsqueeze(1), ring_pos.clamp_min(0)]  # [A, W, head_dim]
        freqs = attn.rope.at(draft_pos.flatten(), device).view(a_n, k, -1)

        def attend(x, attn=attn, ring=ring, ring_ok=ring_ok, freqs=freqs):
            q = ops.apply_rope(
                attn.wq_b(attn.q_norm(attn.wq_a(x))).unflatten(-1, (attn.n_heads, attn.head_dim)), freqs, attn.rope_dim
            )
            kv = ops.apply_rope(attn.kv_norm(attn.wkv(x)), freqs, attn.rope_dim)
            kv = qat_ops.fp8_fake_quant(kv) if qat else kv
            keys = torch.cat([ring, kv], dim=1).float()  # [A, W + k, head_dim]
            ok = torch.cat([ring_ok, torch.ones(a_n, k, dtype=torch.bool, device=device)], dim=1)
            logits = torch.einsum("akhd,and->akhn", q.float(), keys) * attn.softmax_scale
            logits = logits.masked_fill(~ok.view(a_n, 1, 1, -1), -torch.inf)
            # the inference kernel's numerics (ops.sparse_attn): probabilities relative to the max, rounded
            # to bf16 before they weight the rows (straight through), the sink only in the denominator
            top = logits.amax(-1, keepdim=True).clamp_min(-1e30).detach()
            probs = torch.exp(logits - top)
            denom = probs.sum(-1) + torch.exp(attn.attn_sink.float().view(1, 1, -1) - top[..., 0])
            rounded = probs + (probs.bfloat16().float() - probs).detach()
            o = (torch.einsum("akhn,and->akhd", rounded, keys) / denom.unsqueeze(-1)).to(q.dtype)
            return attn.output(o, freqs)

        h, pre_mix = stage(h, pre_mix, attend, {})
    last = stages[-1]
    xh = Block.hc_pre(h, pre_mix)  # [A, k, dim]
    base = model.logits(last.norm(xh))  # [A, k, V] fp32; the head is frozen, the gradient flows through
    prev = tokens[rows.unsqueeze(1), draft_pos]  # [A, k]: the true token at p+1+i
    embed = last.markov_head.embed(prev)  # [A, k, rank]
    bias = last.markov_head.head(embed.float())
    features = torch.cat([xh.detach(), embed.detach()], dim=-1).float()
    confidence = last.confidence_head.proj(features)[..., 0]
    return DraftTrainOutput(base + bias, confidence)
