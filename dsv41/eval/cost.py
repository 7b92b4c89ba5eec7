"""What bounded-replay prefill and FP4 KV storage cost in quality, measured on the same prompts against
full prefill and an unquantised (bf16) KV cache (issue 16 item 1; spec-v41.md §2.1 and §9 for bounded
replay, §8 for the FP4 KV).

Why: both are approximations V4.1 makes for speed and memory. Bounded replay runs the decoder layers
only over the last `window_size` prompt tokens, so their sliding windows start there; FP4 rounds every
stored compressed-KV latent (E2M1 with an E4M3 scale per 16) and every index key (MXFP4). A user needs
to know what each costs on their text.

Variants, all through the plain inference forward (`Transformer.forward` over a `ModelCache`):
- `full`: every layer over every prompt token (as served with `--prefill-mode full`);
- `bounded`: the decoder layers' windows start at s = max(0, L - window_size) (as the engine's
  default `--prefill-mode bounded`: the same decoder start, and decoder outputs before s cannot reach
  anything after it, because the decoder's global KV is built from the encoder output; the engine test
  `test_bounded_replay_equals_masked_decoder_windows` and tests/eval check this against the engine);
- `bf16kv`: full prefill, the compressed KV latents stored unrounded in bf16 (`Attention.fp4_kv` off;
  the index keys keep MXFP4 and the window ring FP8);
- `bf16cache`: full prefill, compressed KV and index keys both stored in bf16 (`Indexer.fp4_keys` off
  too), i.e. the whole global cache unquantised.

For a prompt of L tokens followed by a continuation of C tokens (from the held-out text), each variant
gives the logits at positions L-1 .. L+C-2, which predict the continuation (teacher-forced, the way the
engine would decode it after that prefill). The prompt's first s tokens run in chunks; the rest (the last
window plus the continuation) in one forward from s, identical in every variant but for the setting
compared, so a variant compared with itself gives exactly zero.

Reported per comparison "A:B" (A measured against the reference B) and prompt length: NLL of the
continuation under each, dNLL = NLL_A - NLL_B (and the perplexity ratio exp(dNLL)), the mean KL(P_B || P_A)
over the continuation positions and at the first one (the next token after the prompt), the share of
positions whose greedy tokens agree, and the largest logit difference.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
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
from dsv41.model.cache import ModelCache


@dataclass(frozen=True)
class Variant:
    bounded: bool  # decoder windows start at max(0, L - window)
    fp4_kv: bool  # compressed KV rounded to E2M1 + E4M3/16 when stored
    fp4_keys: bool  # index keys rounded to MXFP4 when stored
    about: str


VARIANTS = {
    "full": Variant(False, True, True, "full prefill, FP4 KV (as served with --prefill-mode full)"),
    "bounded": Variant(True, True, True, "bounded-replay prefill, FP4 KV (the engine's default)"),
    "bf16kv": Variant(False, False, True, "full prefill, compressed KV stored in bf16 (index keys MXFP4)"),
    "bf16cache": Variant(False, False, False, "full prefill, compressed KV and index keys stored in bf16"),
}


@dataclass
class CostConfig(EvalConfig):
    lengths: str | None = field(
        default=None,
        metadata={
            "metavar": "LIST",
            "help": (
                "prompt lengths in tokens, comma-separated, K = 1024; bounded replay changes nothing for prompts "
                "within one window; default: powers of two from 1K up to the model's context less the "
                "continuation"
            ),
        },
    )
    samples: int = field(
        default=4,
        metadata={"metavar": "N", "help": ("prompts per length (held-out windows at drawn offsets, or the filler)")},
    )
    continuation: int = field(
        default=64,
        metadata={
            "metavar": "N",
            "help": ("tokens after each prompt scored teacher-forced (the text that follows the prompt)"),
        },
    )
    compare: str = field(
        default="bounded:full,full:bf16kv,full:bf16cache",
        metadata={
            "metavar": "A:B,...",
            "help": (
                "comparisons, each A measured against the reference B; variants: full, bounded (bounded-replay "
                "prefill), bf16kv (compressed KV unquantised), bf16cache (KV and index keys unquantised)"
            ),
        },
    )
    chunk: int = field(default=512, metadata={"metavar": "N", "help": "prefill chunk size in tokens"})
    extrapolate: bool = field(
        default=False,
        metadata={"help": ("allow lengths beyond the model's max_position_embeddings (measures length extrapolation)")},
    )

    def validate(self) -> None:
        super().validate()
        for name in ("samples", "continuation", "chunk"):
            positive(name, getattr(self, name))
        parse_comparisons(self.compare)


def parse_comparisons(text: str) -> list[tuple[str, str]]:
    """'bounded:full,full:bf16kv' -> [('bounded', 'full'), ('full', 'bf16kv')]."""
    pairs = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        names = part.split(":")
        if len(names) != 2 or any(n not in VARIANTS for n in names):
            raise ValueError(f"compare: {part!r} is not A:B with A and B among {', '.join(VARIANTS)}")
        pairs.append((names[0], names[1]))
    if not pairs:
        raise ValueError(f"compare: no comparison in {text!r}")
    return pairs


@dataclass
class DecoderStartCache(ModelCache):
    """A ModelCache whose decoder layers' windows begin at `decoder_first` (bounded replay, spec §2.1)."""

    decoder_first: int = 0
    boundary: int = 0  # first decoder layer (ModelConfig.decoder_boundary)

    def window_first(self, layer: int) -> int:
        return self.decoder_first if layer >= self.boundary else 0

    def clone(self) -> DecoderStartCache:
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        return DecoderStartCache(
            self.batch_size,
            self.max_seq_len,
            [copy(t) for t in self.window_kv],
            {k: copy(v) for k, v in self.compressed_kv.items()},
            {k: copy(v) for k, v in self.index_k.items()},
            {k: copy(v) for k, v in self.group_kv.items()},
            {k: copy(v) for k, v in self.group_score.items()},
            copy(self.engram_ids),
            self.decoder_first,
            self.boundary,
        )


@contextmanager
def kv_storage(model, fp4_kv: bool, fp4_keys: bool):
    """Within the block the model stores its compressed KV / index keys rounded to FP4 or not; the previous
    settings come back afterwards."""
    attns = [layer.attn for layer in model.layers]
    indexers = [a.indexer for a in attns if a.indexer is not None]
    before = [a.fp4_kv for a in attns], [i.fp4_keys for i in indexers]
    try:
        for a in attns:
            a.fp4_kv = fp4_kv
        for i in indexers:
            i.fp4_keys = fp4_keys
        yield model
    finally:
        for a, v in zip(attns, before[0]):
            a.fp4_kv = v
        for i, v in zip(indexers, before[1]):
            i.fp4_keys = v


@torch.inference_mode()
def continuation_logits(model, tokens: np.ndarray, prompt_len: int, variants: list[str], chunk: int) -> dict:
    """tokens int64 [L + C] (prompt then continuation) -> {variant: fp32 logits [C, vocab]} at positions
    L-1 .. L+C-2 (see the module docstring). Variants sharing a KV format share the prefill of the first s
    tokens."""
    cfg = model.cfg
    length = tokens.size
    if not 1 <= prompt_len < length:
        raise ValueError(f"prompt length {prompt_len} must leave a continuation in {length} tokens")
    s = max(0, prompt_len - cfg.window_size)  # the engine's decoder start (LLMEngine._start)
    ids = torch.from_numpy(tokens.astype(np.int64)).unsqueeze(0).to(model.device)
    out = {}
    groups: dict[tuple, list[str]] = {}
    for name in variants:
        v = VARIANTS[name]
        groups.setdefault((v.fp4_kv, v.fp4_keys), []).append(name)
    for (fp4_kv, fp4_keys), names in groups.items():
        with kv_storage(model, fp4_kv, fp4_keys):
            cache = DecoderStartCache.create(cfg, 1, length)
            cache.boundary = cfg.decoder_boundary
            for a in range(0, s, chunk):
                model(ids[:, a : min(s, a + chunk)], a, cache, last_only=True)
            for k, name in enumerate(names):
                c = cache if k == len(names) - 1 else cache.clone()
                c.decoder_first = s if VARIANTS[name].bounded else 0
                logits = model(ids[:, s : length - 1], s, c)[0]  # [length - 1 - s, vocab]
                out[name] = logits[prompt_len - 1 - s :].float()
    return out


def compare_logits(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> dict:
    """ref, test fp32 [C, vocab] (the reference and the measured variant), targets int64 [C]."""
    lp_ref, lp_test = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    nll_ref = -lp_ref.gather(-1, targets[:, None]).squeeze(-1)
    nll_test = -lp_test.gather(-1, targets[:, None]).squeeze(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_test)).sum(-1).clamp_min(0.0)  # [C]; clamp: rounding below 0
    agree = (ref.argmax(-1) == test.argmax(-1)).double()
    return {
        "nll_ref": float(nll_ref.mean()),
        "nll_test": float(nll_test.mean()),
        "dnll": float((nll_test - nll_ref).mean()),
        "kl": float(kl.mean()),
        "kl_first": float(kl[0]),
        "kl_max": float(kl.max()),
        "agree": float(agree.mean()),
        "agree_first": float(agree[0]),
        "max_abs_logit": float((ref - test).abs().max()),
    }


def kv_cost(
    em: EvalModel,
    seqs_by_length: dict[int, list[np.ndarray]],
    comparisons: list[tuple[str, str]],
    continuation: int,
    chunk: int,
) -> dict:
    """Every comparison on every (length, sample); seqs are int64 [length + continuation]."""
    variants = list(dict.fromkeys(n for pair in comparisons for n in pair))
    per_sample, summary = [], []
    t0 = time.perf_counter()
    for length, seqs in seqs_by_length.items():
        rows = {pair: [] for pair in comparisons}
        for s, seq in enumerate(seqs):
            logits = continuation_logits(em.model, seq, length, variants, chunk)
            targets = torch.from_numpy(seq[length:].astype(np.int64)).to(next(iter(logits.values())).device)
            for a, b in comparisons:
                m = compare_logits(logits[b], logits[a], targets)
                rows[(a, b)].append(m)
                per_sample.append({"compare": f"{a}:{b}", "length": length, "sample": s, **m})
        for (a, b), ms in rows.items():
            d = np.array([m["dnll"] for m in ms])
            mean = lambda key, ms=ms: float(np.mean([m[key] for m in ms]))  # noqa: E731
            summary.append(
                {
                    "compare": f"{a}:{b}",
                    "test": a,
                    "reference": b,
                    "length": length,
                    "samples": len(ms),
                    "nll_ref": mean("nll_ref"),
                    "nll_test": mean("nll_test"),
                    "dnll": float(d.mean()),
                    "dnll_stderr": float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None,
                    "ppl_ratio": math.exp(float(d.mean())),
                    "kl": mean("kl"),
                    "kl_first": mean("kl_first"),
                    "agree": mean("agree"),
                    "agree_first": mean("agree_first"),
                    "max_abs_logit": float(max(m["max_abs_logit"] for m in ms)),
                    "replay_differs": length > em.cfg.window_size,
                }
            )
        log(f"cost {fmt_length(length)}: {len(seqs)} samples ({time.perf_counter() - t0:.1f}s)")
    return {
        "eval": "cost",
        "model": em.name,
        "variants": {n: VARIANTS[n].about for n in variants},
        "window_size": em.cfg.window_size,
        "continuation": continuation,
        "summary": summary,
        "per_sample": per_sample,
        "seconds": time.perf_counter() - t0,
    }


def table(result: dict) -> str:
    header = [
        "A vs reference B",
        "prompt",
        "NLL B",
        "NLL A",
        "dNLL (± se)",
        "ppl A / B",
        "KL(B||A) mean",
        "KL first token",
        "greedy agree",
        "max |dlogit|",
    ]
    rows = []
    for r in result["summary"]:
        se = "" if r["dnll_stderr"] is None else f" ± {r['dnll_stderr']:.4f}"
        rows.append(
            [
                f"{r['test']} vs {r['reference']}",
                fmt_length(r["length"]),
                f"{r['nll_ref']:.4f}",
                f"{r['nll_test']:.4f}",
                f"{r['dnll']:+.4f}{se}",
                f"{r['ppl_ratio']:.4f}",
                f"{r['kl']:.2e}",
                f"{r['kl_first']:.2e}",
                f"{r['agree']:.3f}",
                f"{r['max_abs_logit']:.3g}",
            ]
        )
    note = (
        f"bounded replay equals full prefill for prompts up to the window ({result['window_size']} tokens); "
        f"continuation of {result['continuation']} tokens, teacher-forced"
    )
    return f"quality cost of {result['model']} ({note})\n\n" + markdown_table(header, rows)


def run_cost(cfg: CostConfig, em: EvalModel | None = None) -> dict:
    """`dsv41 eval cost`: measure, print the table, write cost.json / cost.md / cost.png."""
    cfg.validate()
    comparisons = parse_comparisons(cfg.compare)
    em = prepare(cfg, em)
    lengths = resolve_lengths(cfg.lengths, em.cfg, cfg.continuation, cfg.extrapolate)
    if lengths[0] < 1:
        raise ValueError("prompt lengths must be positive")
    held = held_out(em, cfg.data, cfg.text)
    source = held.source if held else "filler (the grass is green)"
    seqs_by_length, wrapped = {}, False
    for length in lengths:
        seqs, w = sequences(em, held, length + cfg.continuation, cfg.samples, cfg.seed)
        seqs_by_length[length], wrapped = seqs, wrapped or w
    log(
        f"cost: {em.name}, lengths {', '.join(fmt_length(n) for n in lengths)}, "
        f"{', '.join(a + ':' + b for a, b in comparisons)}, {source}"
    )
    result = kv_cost(em, seqs_by_length, comparisons, cfg.continuation, cfg.chunk)
    result.update(source=source, wrapped=wrapped, seed=cfg.seed, index_topk=index_topk(em.model))
    text = table(result)
    print(text)

    def series(key):
        out = {}
        for a, b in comparisons:
            rows = [r for r in result["summary"] if r["compare"] == f"{a}:{b}"]
            out[f"{a} vs {b}"] = ([r["length"] for r in rows], [r[key] for r in rows])
        return out

    png = plot_panels(
        os.path.join(cfg.out, "cost.png"),
        [
            Panel(
                "continuation NLL difference",
                "prompt length (tokens)",
                "dNLL = NLL(A) - NLL(B) (nats/token)",
                series("dnll"),
                hline=0.0,
            ),
            Panel("KL(B || A) per token", "prompt length (tokens)", "nats", series("kl")),
            Panel("greedy agreement", "prompt length (tokens)", "share of positions", series("agree"), ylim=(0, 1.02)),
        ],
        suptitle=f"{em.name}: cost of bounded replay and FP4 KV",
    )
    result["files"] = {**write_outputs(cfg.out, "cost", result, text), "png": png}
    return result
