"""The engine's computation replayed as one differentiable forward (training.md §8, router replay "R3";
spec-v41.md §3, §7, §9).

An RL learner needs the log-probabilities of sampled tokens under its current weights, and with the
weights the rollout used, exactly the numbers the rollout's engine produced. A plain full-sequence
forward does not give them: sparse attention reduces each query over [its window | its selection]
padded to the width of the call that computed it (a fresh prefill chunk lists min(chunk, window) window
slots, a continuing chunk or a decode step lists the whole ring with missing positions first, and the
selection is min(top-k, entries visible to the chunk's last query) wide), and a different padding is a
different fp32 reduction order. So the replay runs the token-wise work (embedding, Engram,
hyper-connection mixes, projections, MoE, head) once over every position, which is exact because those
GEMMs are batch-invariant (`Transformer.numerics`), and the sequence-mixing part of each attention layer
chunk by chunk over the spans the engine computed (prefill chunks at their fixed boundaries, then one
position per decode step), against a `ModelCache`, in order. That is the per-chunk attention the engine
runs (its batched decode path is tested equal to it), with autograd on.

Differences from inference, none of which changes a value: the roundings at cache writes pass the
gradient straight through (`ops.qat.rounded`), sparse attention runs out of place under autograd, and
the indexer (its selection is discrete) computes without gradient. Router replay: `routing` dictates
every MoE layer's expert ids (the rollout's), and the gate weights are recomputed from the current
router scores over them (`dsv41.model.moe.Gate`).

Rows of one call share the span schedule (sequences of the same prompt length, or the G samples of one
prompt); a row whose sequence is shorter is padded at the end, which no earlier position can see.
Bounded-replay prefill (decoder windows starting at the prompt's last window) is not replayed: rollouts
for a learner run with `prefill_mode="full"`.
"""

from __future__ import annotations

import torch

from dsv41.model.block import Block
from dsv41.model.forward import AttentionBackend, run_layers
from dsv41.model.moe import RoutingRecord


def check_spans(spans: list[tuple[int, int]], length: int) -> None:
    """Spans must tile positions 0..length-1 in order, each non-empty."""
    at = 0
    for a, e in spans:
        if a != at or e <= a:
            raise ValueError(f"replay spans must tile 0..{length - 1} in order; got span ({a}, {e}) at position {at}")
        at = e
    if at != length:
        raise ValueError(f"replay spans cover 0..{at - 1}, the input has {length} positions")


def decode_spans(prefill: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The prefill chunk spans, then one span per decode position up to `length` (exclusive)."""
    end = prefill[-1][1] if prefill else 0
    return list(prefill) + [(p, p + 1) for p in range(end, length)]


def prefill_spans(prompt_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """The engine's prefill chunks of a prompt computed from position 0: boundaries at multiples of
    `chunk_size` (dsv41.engine.LLMEngine._schedule)."""
    return [(a, min(prompt_len, a + chunk_size)) for a in range(0, prompt_len, chunk_size)]


def replay_forward(
    model,
    input_ids: torch.Tensor,
    spans: list[tuple[int, int]],
    routing: torch.Tensor | None = None,
    logits_from: int = 0,
    record: RoutingRecord | None = None,
) -> torch.Tensor:
    """input_ids [B, T] from position 0 -> fp32 logits [B, T - logits_from, vocab] of positions
    logits_from.., computed as the engine computed them over `spans` (see the module docstring).

    routing: optional int [B, T, n_layers, k] expert ids to replay (None: the routers pick). record: an
    optional `RoutingRecord` that receives each layer's ids (with `routing`, the replayed ones). Call it
    under `model.numerics(row_chunk)` with the engine's row_chunk for bit-equality with the engine."""
    cfg = model.cfg
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, seq], got shape {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    check_spans(spans, t)
    if not 0 <= logits_from < t:
        raise ValueError(f"logits_from must lie in [0, {t}), got {logits_from}")
    if routing is not None:
        k = cfg.n_activated_experts
        if tuple(routing.shape) != (b, t, cfg.n_layers, k):
            raise ValueError(f"routing must be [{b}, {t}, {cfg.n_layers}, {k}], got {tuple(routing.shape)}")
        replay = [routing[:, :, i].reshape(b * t, k) for i in range(cfg.n_layers)]
        record = RoutingRecord(replay=replay, ids_only=True) if record is None else record
        record.replay = replay
    device = model.device
    input_ids = input_ids.to(device)
    cache = model.new_cache(b, t)
    hash_ids = model.engram_hash(input_ids, 0, cache.engram_ids) if model.engram_hash is not None else None
    h = model.embed(input_ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [B, T, hc, dim]
    pre_mix = torch.zeros(b, t, cfg.hc_mult, dtype=torch.float32, device=device)
    pre_mix[..., 0] = 1.0
    shared = {} if record is None else {"moe_aux": record}
    h, pre_mix, _ = run_layers(model, h, pre_mix, SpanAttention(spans, b, cache), shared, None, hash_ids)
    x = model.norm(Block.hc_pre(h[:, logits_from:], pre_mix[:, logits_from:]))
    return model.logits(x)


class SpanAttention(AttentionBackend):
    """The replay's attention backend: one contiguous cache filled span by span, as the engine's chunks
    filled its pages; token-wise functions follow the chunks' calls (dsv41.ops.lanes)."""

    def __init__(self, spans: list[tuple[int, int]], rows: int, cache):
        self.spans, self.cache = spans, cache
        self.calls = [e - a for a, e in spans] * rows  # the engine ran each row's spans as separate chunks
        self.per_span: list[dict] = [{} for _ in spans]  # each chunk's selections, as the engine keeps per chunk

    def token_calls(self) -> list[int]:
        return self.calls

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        """Projections over every position, sequence mixing span by span (in order, each against the cache
        the previous spans left), inverse RoPE and output projections."""
        attn = layer.attn
        positions = torch.arange(x.size(1), device=x.device)
        freqs = attn.rope.at(positions, x.device)
        qr, q, kv = attn.project(x, freqs)
        outs = [
            attn.attend(x[:, a:e], qr[:, a:e], q[:, a:e], kv[:, a:e], a, self.cache, self.per_span[j])
            for j, (a, e) in enumerate(self.spans)
        ]
        return attn.output(torch.cat(outs, dim=1), freqs)
