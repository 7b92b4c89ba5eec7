"""Perplexity on held-out text (issue 16 item 1), through the inference forward as served: compressed
sparse attention over the FP4 KV cache (spec-v41.md §3, §4, §8), prefilled in chunks over the model's own
cache.

Why this way: it is the number users compare first, and it must be the served model's number, not the
training forward's (masked softmax, QAT straight-through), which is why it runs `Transformer.forward`.

How: the held-out stream is tiled with non-overlapping windows of seq_len + 1 tokens (window i covers
tokens i*seq_len .. i*seq_len + seq_len: seq_len inputs and their next-token targets, the rule of the
trainer's validation, so exp(val_loss) of a run and this agree); every target is scored once, with the
context its window gives it (1 .. seq_len tokens). A window is prefilled in chunks of `chunk` tokens over
one `ModelCache`, so memory does not grow with seq_len beyond the cache. Every layer runs over every token:
perplexity needs the logits of every position, which bounded replay does not compute (its cost is
measured by `dsv41.eval.cost`).

Reported: mean NLL (nats/token), perplexity exp(NLL), bits per token and bits per UTF-8 byte of the scored
text (comparable across tokenizers), and the NLL by position in the window. For a model that uses its
context the NLL falls with position; where the curve flattens, more context stops helping.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from dsv41.eval.common import (
    EvalConfig,
    EvalModel,
    Panel,
    held_out,
    index_topk,
    log,
    markdown_table,
    plot_panels,
    positive,
    prepare,
    write_outputs,
)


@dataclass
class PerplexityConfig(EvalConfig):
    seq_len: int = field(
        default=1024,
        metadata={
            "metavar": "N",
            "help": ("tokens of context per window: each window of the held-out text is scored from position 0 to N-1"),
        },
    )
    max_tokens: int = field(
        default=65536,
        metadata={
            "metavar": "N",
            "help": (
                "score at most this many tokens (whole windows, at least one), from the start of the held-out text"
            ),
        },
    )
    batch_size: int = field(default=1, metadata={"metavar": "N", "help": "windows run side by side in one forward"})
    chunk: int = field(
        default=512,
        metadata={
            "metavar": "N",
            "help": (
                "prefill chunk size in tokens: each window runs as consecutive chunks over one cache (bounds memory)"
            ),
        },
    )
    buckets: int = field(
        default=16, metadata={"metavar": "N", "help": ("position buckets of the NLL-by-position table and plot")}
    )
    extrapolate: bool = field(
        default=False,
        metadata={
            "help": ("allow --seq-len beyond the model's max_position_embeddings (measures length extrapolation)")
        },
    )

    def validate(self) -> None:
        super().validate()
        for name in ("seq_len", "max_tokens", "batch_size", "chunk", "buckets"):
            positive(name, getattr(self, name))
        if not (self.data or self.text):
            raise ValueError("perplexity needs held-out text: give --data DIR (a `dsv41 data` folder) or --text FILE")


@torch.inference_mode()
def window_nll(model, windows: torch.Tensor, batch_size: int, chunk: int) -> torch.Tensor:
    """windows int64 [N, L + 1] -> NLL float64 [N, L] of each next-token target (position p predicts p+1)."""
    n, length = windows.size(0), windows.size(1) - 1
    out = torch.empty(n, length, dtype=torch.float64)
    device = model.device
    for i in range(0, n, batch_size):
        batch = windows[i : i + batch_size].to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        b = x.size(0)
        cache = model.new_cache(b, length)
        for a in range(0, length, chunk):
            e = min(length, a + chunk)
            logits = model(x[:, a:e], a, cache)  # [b, e - a, vocab] fp32
            nll = F.cross_entropy(logits.flatten(0, 1).float(), y[:, a:e].flatten(), reduction="none")
            out[i : i + b, a:e] = nll.view(b, e - a).double().cpu()
    return out


def perplexity(
    em: EvalModel,
    tokens: np.ndarray,
    seq_len: int,
    max_tokens: int,
    batch_size: int = 1,
    chunk: int = 512,
    buckets: int = 16,
) -> dict:
    """Score the held-out stream `tokens` (int64 [N]); see the module docstring. Returns the result dict."""
    available = (tokens.size - 1) // seq_len
    if available == 0:
        raise ValueError(
            f"the held-out text has {tokens.size} tokens; a window of --seq-len {seq_len} needs "
            f"{seq_len + 1}: lower --seq-len"
        )
    n = max(1, min(available, max_tokens // seq_len))
    starts = np.arange(n) * seq_len
    windows = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int64))
    t0 = time.perf_counter()
    nll = window_nll(em.model, windows, batch_size, chunk)  # [n, seq_len]
    seconds = time.perf_counter() - t0
    total = float(nll.sum())
    count = nll.numel()
    mean = total / count
    scored_text = em.tokenizer.decode(tokens[1 : n * seq_len + 1].tolist(), skip_special_tokens=True)
    n_bytes = len(scored_text.encode("utf-8"))
    edges = sorted(set(int(round(x)) for x in np.linspace(0, seq_len, min(buckets, seq_len) + 1)))
    by_position = []
    for a, b in zip(edges[:-1], edges[1:]):
        part = float(nll[:, a:b].mean())
        by_position.append({"from": a, "to": b - 1, "nll": part, "ppl": math.exp(part)})
    per_window = nll.mean(dim=1)
    return {
        "eval": "ppl",
        "model": em.name,
        "seq_len": seq_len,
        "windows": n,
        "tokens": count,
        "nll": mean,
        "ppl": math.exp(mean),
        "bits_per_token": mean / math.log(2),
        "bits_per_byte": total / math.log(2) / n_bytes if n_bytes else None,
        "bytes": n_bytes,
        "nll_stderr": float(per_window.std() / math.sqrt(n)) if n > 1 else None,
        "nll_by_position": by_position,
        "nll_per_window": per_window.tolist(),
        "seconds": seconds,
        "tokens_per_s": count / seconds if seconds > 0 else None,
    }


def table(result: dict) -> str:
    bpb = result["bits_per_byte"]
    head = markdown_table(
        ["model", "tokens scored", "windows x context", "NLL (nats/token)", "perplexity", "bits/byte"],
        [
            [
                result["model"],
                result["tokens"],
                f"{result['windows']} x {result['seq_len']}",
                f"{result['nll']:.4f}",
                f"{result['ppl']:.3f}",
                "-" if bpb is None else f"{bpb:.4f}",
            ]
        ],
    )
    rows = [[f"{b['from']}-{b['to']}", f"{b['nll']:.4f}", f"{b['ppl']:.3f}"] for b in result["nll_by_position"]]
    return head + "\n\n" + markdown_table(["positions", "NLL", "perplexity"], rows)


def run_perplexity(cfg: PerplexityConfig, em: EvalModel | None = None) -> dict:
    """`dsv41 eval ppl`: score, print the table, write ppl.json / ppl.md / ppl.png into cfg.out."""
    cfg.validate()
    em = prepare(cfg, em)
    if cfg.seq_len > em.cfg.max_position_embeddings and not cfg.extrapolate:
        raise ValueError(
            f"--seq-len {cfg.seq_len} exceeds the model's context of {em.cfg.max_position_embeddings} "
            "tokens (max_position_embeddings); pass --extrapolate to measure beyond it"
        )
    held = held_out(em, cfg.data, cfg.text)
    log(f"ppl: {em.name} on {held.source}, windows of {cfg.seq_len} tokens")
    result = perplexity(em, held.tokens, cfg.seq_len, cfg.max_tokens, cfg.batch_size, cfg.chunk, cfg.buckets)
    result.update(source=held.source, index_topk=index_topk(em.model))
    text = table(result)
    print(text)
    mids = [(b["from"] + b["to"]) / 2 + 1 for b in result["nll_by_position"]]
    png = plot_panels(
        os.path.join(cfg.out, "ppl.png"),
        [
            Panel(
                f"{em.name}: NLL by position (mean {result['nll']:.3f}, ppl {result['ppl']:.2f})",
                "position in the window (tokens of context)",
                "NLL (nats/token)",
                {"held-out": (mids, [b["nll"] for b in result["nll_by_position"]])},
                logx=True,
                hline=result["nll"],
            )
        ],
    )
    result["files"] = {**write_outputs(cfg.out, "ppl", result, text), "png": png}
    return result
