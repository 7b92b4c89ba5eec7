"""Indexer recall: how much of the attention a layer would pay to the compressed cache its top-k selection
captures, per layer and context length (issue 16 item 1; spec-v41.md §3 steps 3-4, §4).

Why: CSA2 attends to at most `index_topk` compressed entries per query, chosen by the lightning indexer
(Full and Reindex layers score, Reuse layers take the latest index source's picks, Reindex layers only
score inside the candidate pool of the candidate source). Whatever attention the layer's own queries
would give to entries left out is lost. This measures that loss directly, independently of any task.

How, for a query at position p of layer l (kv source s = kv_source_of(l), ratio r):
- the dense distribution: p_h(t) = softmax over every visible compressed entry t < (p+1)//r of
  scale * q_h . kv_t, per head h, with q the layer's own queries (post-RoPE, as the layer computes them)
  and kv the stored (FP4-rounded, post-RoPE) entries of s's cache; the window and the sink are left out,
  so this is the attention over the compressed cache alone;
- the selection S: the entries the model actually picked for that query in that layer (the index
  source's top-k, read from the inference forward);
- captured mass = mean_h sum_{t in S} p_h(t), in [0, 1]; 1 when every visible entry is selected;
- oracle mass: the most any k = min(index_topk, visible) entries shared by the heads could capture (the
  k largest of mean_h p_h), and top-k overlap = |S cap oracle set| / k.
Queries: the last `queries` positions before each context length L (their contexts are L-queries+1 .. L
tokens), from one chunked prefill of the longest length per sample (a query's causal context is the same
whatever comes after it, so one pass serves every length). The prefill runs the plain inference forward
over a `ModelCache`; forward hooks on the indexers and attention modules read each chunk's selections
and the layers' inputs, from which the queries are recomputed with the layer's own projection.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv41.eval.common import (
    EvalConfig,
    EvalModel,
    Panel,
    fmt_length,
    held_out,
    index_topk,
    log,
    markdown_table,
    plot_panels,
    positive,
    prepare,
    resolve_lengths,
    sequences,
    write_outputs,
)


@dataclass
class RecallConfig(EvalConfig):
    lengths: str | None = field(
        default=None,
        metadata={
            "metavar": "LIST",
            "help": (
                "context lengths in tokens, comma-separated, K = 1024 (e.g. 1K,4K,16K); default: powers of two from "
                "1K up to the model's context"
            ),
        },
    )
    queries: int = field(
        default=8,
        metadata={"metavar": "N", "help": ("query positions measured per length: the last N positions before it")},
    )
    samples: int = field(
        default=1,
        metadata={"metavar": "N", "help": ("sequences (held-out windows at drawn offsets, or the filler) per length")},
    )
    chunk: int = field(default=512, metadata={"metavar": "N", "help": "prefill chunk size in tokens"})
    extrapolate: bool = field(
        default=False,
        metadata={"help": ("allow lengths beyond the model's max_position_embeddings (measures length extrapolation)")},
    )

    def validate(self) -> None:
        super().validate()
        for name in ("queries", "samples", "chunk"):
            positive(name, getattr(self, name))


def captured_mass(
    q: torch.Tensor, rows: torch.Tensor, visible: int, selected: torch.Tensor, scale: float, k: int
) -> dict:
    """One query. q [H, D] (the layer's post-RoPE query); rows [>= visible, D] (the stored compressed
    entries); selected int [K] entry ids (-1: none); k the selection budget. Returns captured mass (mean
    over heads), its minimum over heads, oracle mass and top-k overlap (see the module docstring)."""
    logits = torch.einsum("hd,td->ht", q.float(), rows[:visible].float()) * scale  # [H, T]
    probs = torch.softmax(logits, dim=-1)
    picked = selected[selected >= 0].long()
    if picked.numel() and int(picked.max()) >= visible:
        raise RuntimeError(f"a selected entry ({int(picked.max())}) is not visible to the query ({visible} entries)")
    per_head = probs[:, picked].sum(dim=-1)  # [H]
    k = min(k, visible)
    mean = probs.mean(dim=0)
    best = torch.topk(mean, k).indices
    return {
        "mass": float(per_head.mean()),
        "mass_min_head": float(per_head.min()),
        "oracle": float(mean[best].sum()),
        "overlap": float(np.isin(best.cpu().numpy(), picked.cpu().numpy()).sum()) / k,
        "visible": visible,
        "picked": int(picked.numel()),
    }


class RecallProbe:
    """Forward hooks that, during a chunked prefill driven by `run`, measure `captured_mass` at chosen
    positions for every layer with a compressed cache. The caller sets `start` (the chunk's first
    position) before each forward; results accumulate in `rows` as dicts with layer and position."""

    def __init__(self, model, positions: list[int]):
        self.model, self.cfg = model, model.cfg
        self.topk = index_topk(model)  # the selection budget k of the oracle
        self.positions = sorted(set(positions))
        self.start = 0
        self.selected: dict[int, torch.Tensor] = {}  # index source -> [n, k] entry ids of this chunk's rows
        self.rows: list[dict] = []
        self._handles = []

    def _local(self, length: int) -> tuple[list[int], list[int]]:
        """(rows in the chunk, positions) of the wanted positions inside start .. start + length - 1."""
        pos = [p for p in self.positions if self.start <= p < self.start + length]
        return [p - self.start for p in pos], pos

    def attach(self) -> RecallProbe:
        for layer in self.model.layers:
            attn = layer.attn
            if attn.indexer is not None:
                self._handles.append(attn.indexer.register_forward_hook(self._on_indexer))
            if attn.ratio:
                self._handles.append(attn.register_forward_hook(self._on_attention))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_indexer(self, module, args, output) -> None:
        # Indexer.forward(x, qr, cache, source, n_keys, freqs, visible, offset, shared) -> ids + offset
        offset = args[7]
        local, _ = self._local(output.size(1))
        ids = output[0, local].long()  # [n, k]
        self.selected[module.layer_id] = torch.where(ids >= 0, ids - offset, -1)

    @torch.inference_mode()
    def _on_attention(self, module, args, output) -> None:
        x, start_pos, cache = args[0], args[1], args[2]
        if start_pos != self.start:
            raise RuntimeError(f"RecallProbe.start is {self.start} but the forward runs from {start_pos}")
        local, pos = self._local(x.size(1))
        if not local:
            return
        ratio = module.ratio
        visible = [(p + 1) // ratio for p in pos]
        if max(visible) == 0:
            return
        freqs = module.rope.at(torch.tensor(pos), x.device)
        _, q, _ = module.project(x[:, local], freqs)  # [1, n, H, D], as the layer computed its queries
        rows = cache.read_compressed(module.kv_source, 1, max(visible))[0]  # [T, D]
        selected = self.selected.get(module.index_source)
        for j, (p, vis) in enumerate(zip(pos, visible)):
            if vis == 0:
                continue
            sel = selected[j] if selected is not None else torch.empty(0, dtype=torch.long)
            m = captured_mass(q[0, j], rows, vis, sel, module.softmax_scale, self.topk)
            self.rows.append({"layer": module.layer_id, "position": p, **m})


@torch.inference_mode()
def measure(model, tokens: np.ndarray, positions: list[int], chunk: int) -> list[dict]:
    """Prefill `tokens` (int64 [N]) in chunks through the inference forward and measure every compressed
    layer at `positions` (< N). Returns one dict per (layer, position)."""
    probe = RecallProbe(model, positions).attach()
    try:
        n = tokens.size
        ids = torch.from_numpy(tokens.astype(np.int64)).unsqueeze(0).to(model.device)
        cache = model.new_cache(1, n)
        for a in range(0, n, chunk):
            probe.start, probe.selected = a, {}
            model(ids[:, a : a + chunk], a, cache, last_only=True)
    finally:
        probe.detach()
    return probe.rows


def indexer_recall(em: EvalModel, seqs: list[np.ndarray], lengths: list[int], queries: int, chunk: int) -> dict:
    """Measure every sequence (each at least max(lengths) long) at the last `queries` positions before each
    length; returns the per-layer, per-length summary and the raw rows."""
    cfg = em.cfg
    wanted = {L: list(range(max(0, L - queries), L)) for L in lengths}
    positions = sorted({p for ps in wanted.values() for p in ps})
    rows = []
    t0 = time.perf_counter()
    for s, seq in enumerate(seqs):
        for r in measure(em.model, seq[: max(lengths)], positions, chunk):
            rows.append({**r, "sample": s})
        log(f"recall: sample {s + 1}/{len(seqs)} measured ({time.perf_counter() - t0:.1f}s)")
    layers = []
    for layer in range(cfg.n_layers):
        if not cfg.compress_ratios[layer]:
            continue
        by_length = []
        for L in lengths:
            sel = [r for r in rows if r["layer"] == layer and r["position"] in wanted[L]]
            if not sel:
                by_length.append({"length": L, "queries": 0})
                continue
            mass = np.array([r["mass"] for r in sel])
            oracle = np.array([r["oracle"] for r in sel])
            by_length.append(
                {
                    "length": L,
                    "queries": len(sel),
                    "mass_recall": float(mass.mean()),
                    "mass_recall_min": float(mass.min()),
                    "mass_recall_min_head": float(min(r["mass_min_head"] for r in sel)),
                    "oracle_mass": float(oracle.mean()),
                    "relative_recall": float((mass / np.maximum(oracle, 1e-12)).mean()),
                    "topk_overlap": float(np.mean([r["overlap"] for r in sel])),
                    "visible": float(np.mean([r["visible"] for r in sel])),
                    "picked": float(np.mean([r["picked"] for r in sel])),
                }
            )
        layers.append(
            {
                "layer": layer,
                "mode": cfg.attention_mode(layer),
                "ratio": cfg.compress_ratios[layer],
                "kv_source": cfg.kv_source_of(layer),
                "index_source": cfg.index_source_of(layer),
                "by_length": by_length,
            }
        )
    return {
        "eval": "recall",
        "model": em.name,
        "lengths": lengths,
        "queries": queries,
        "samples": len(seqs),
        "index_topk": index_topk(em.model),
        "layers": layers,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }


def table(result: dict) -> str:
    lengths = result["lengths"]
    header = ["layer", "mode (index source)"] + [fmt_length(n) for n in lengths]

    def cell(b):
        if not b.get("queries"):
            return "-"
        return f"{b['mass_recall']:.3f} ({b['oracle_mass']:.3f})"

    rows = [
        [lay["layer"], f"{lay['mode']} ({lay['index_source']})"] + [cell(b) for b in lay["by_length"]]
        for lay in result["layers"]
    ]
    mean = []
    for j in range(len(lengths)):
        vals = [lay["by_length"][j]["mass_recall"] for lay in result["layers"] if lay["by_length"][j].get("queries")]
        mean.append(f"{np.mean(vals):.3f}" if vals else "-")
    rows.append(["mean", ""] + mean)
    return (
        f"indexer recall of {result['model']}: attention mass over the compressed cache captured by the "
        f"selected top-{result['index_topk']} (in brackets: the best any {result['index_topk']} entries could "
        f"capture); last {result['queries']} queries before each length, {result['samples']} sample(s)\n\n"
        + markdown_table(header, rows)
    )


def run_recall(cfg: RecallConfig, em: EvalModel | None = None) -> dict:
    """`dsv41 eval recall`: measure, print the table, write recall.json / recall.md / recall.png."""
    cfg.validate()
    em = prepare(cfg, em)
    if not any(em.cfg.compress_ratios[: em.cfg.n_layers]):
        raise ValueError(f"{em.name} has no compressed-attention layer: there is no indexer to measure")
    lengths = resolve_lengths(cfg.lengths, em.cfg, 0, cfg.extrapolate)
    held = held_out(em, cfg.data, cfg.text)
    seqs, wrapped = sequences(em, held, max(lengths), cfg.samples, cfg.seed)
    source = held.source if held else "filler (the grass is green)"
    log(f"recall: {em.name}, lengths {', '.join(fmt_length(n) for n in lengths)}, {source}")
    result = indexer_recall(em, seqs, lengths, cfg.queries, cfg.chunk)
    result.update(source=source, wrapped=wrapped, seed=cfg.seed)
    text = table(result)
    print(text)
    series = {
        f"L{lay['layer']} {lay['mode']}": (
            [b["length"] for b in lay["by_length"] if b.get("queries")],
            [b["mass_recall"] for b in lay["by_length"] if b.get("queries")],
        )
        for lay in result["layers"]
    }
    overlap = {
        k: (xs, [b["topk_overlap"] for b in lay["by_length"] if b.get("queries")])
        for (k, (xs, _)), lay in zip(series.items(), result["layers"])
    }
    png = plot_panels(
        os.path.join(cfg.out, "recall.png"),
        [
            Panel(
                "captured attention mass (compressed cache)",
                "context length (tokens)",
                "mass in the selected top-k",
                series,
                ylim=(0, 1.02),
            ),
            Panel(
                "overlap with the best top-k",
                "context length (tokens)",
                "|selected ∩ best| / k",
                overlap,
                ylim=(0, 1.02),
            ),
        ],
        suptitle=f"{em.name}: indexer recall",
    )
    result["files"] = {**write_outputs(cfg.out, "recall", result, text), "png": png}
    return result
