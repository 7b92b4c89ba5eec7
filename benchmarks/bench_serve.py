"""Serving benchmark: the engine against a plain loop over the core model's forward and simple cache.

    python benchmarks/bench_serve.py [--preset tiny] [--out bench_out] [--quick]

Prints one table per measurement and writes bench_out/serve_<preset>.json and a PNG plot. Measured
side by side in one run (these machines are noisy; compare the ratios):
- decode tokens/s at batch 1, 8 and 32;
- time to first token and prefill tokens/s: engine with bounded replay, engine with full prefill, baseline;
- decode step time at context 1K, 16K and 64K (the context is laid down synthetically: random values on
  the storage grids, so the step does the same work as after a real prefill, without the prefill);
- resident KV bytes per token: the engine's packed pool (measured) vs the analytic figure vs the
  baseline's bf16 containers;
- structured outputs (with the `structured` extra): decode step time under a JSON-schema mask against
  unconstrained sampling, and the mask work alone per step.
Random weights: only speeds and sizes mean anything here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dsv41.config import preset
from dsv41.engine import EngineConfig, LLMEngine, SamplingParams
from dsv41.engine.sequence import Sequence, SequenceCache, Status
from dsv41.generate import generate
from dsv41.model.cache import global_kv_bytes_per_token
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK, fp4_qdq, fp8_qdq
from dsv41.tokenizer import ByteTokenizer


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def make_engine(model, **overrides) -> LLMEngine:
    settings = dict(
        block_size=64,
        kv_pool_tokens=1 << 18,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        prefill_chunk_size=1024,
        enable_prefix_caching=False,
    )
    settings.update(overrides)
    return LLMEngine(model, ByteTokenizer(model.cfg.vocab_size), EngineConfig(**settings))


# ---------------------------------------------------------------------- decode throughput
def engine_decode_rate(model, batch: int, prompt_len: int, new_tokens: int, **overrides) -> float:
    engine = make_engine(model, **overrides)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, prompt_len, model.cfg.vocab_size)):
        engine.add_request(f"r{i}", p, params)
    return timed_decode(engine)["tok_s"]


def timed_decode(engine: LLMEngine) -> dict:
    """Run the engine's requests to the end, timing only the steps in which every request decodes:
    mean ms per step, tokens/s, and the number of such steps."""
    tokens, seconds, steps = 0, 0.0, 0
    while engine.has_unfinished():
        decoding = all(not s.in_prefill for s in engine.running) and not engine.waiting
        t = time.perf_counter()
        outs = engine.step()
        if decoding:
            seconds += time.perf_counter() - t
            steps += 1
            tokens += sum(len(o.new_token_ids) for o in outs)
    return {"step_ms": 1e3 * seconds / max(steps, 1), "tok_s": tokens / max(seconds, 1e-9), "steps": steps}


# a schema that keeps random weights writing for the whole budget (a long string), so both runs time the
# same number of steps
JSON_BENCH_SCHEMA = {
    "type": "object",
    "required": ["notes"],
    "additionalProperties": False,
    "properties": {"notes": {"type": "string", "minLength": 4096}},
}


def decode_steps(model, batch: int, prompt_len: int, new_tokens: int, structured: bool) -> dict:
    """Decode steps of `batch` sampled requests (temperature 1, seeded), unconstrained or under
    JSON_BENCH_SCHEMA: mean ms per step and tokens/s over the steps where every request decodes."""
    engine = make_engine(model)
    spec = None
    if structured:
        from dsv41.engine.types import GrammarSpec

        spec = GrammarSpec(engine.grammar_compiler.json_schema(JSON_BENCH_SCHEMA))
    for i, p in enumerate(random_prompts(batch, prompt_len, model.cfg.vocab_size)):
        engine.add_request(
            f"r{i}",
            p,
            SamplingParams(temperature=1.0, seed=i, max_tokens=new_tokens, ignore_eos=not structured, structured=spec),
        )
    return timed_decode(engine)


def mask_cost(vocab: int, batch: int, steps: int) -> float:
    """ms per step of the grammar work alone for `batch` requests under JSON_BENCH_SCHEMA: the batched
    mask, applying it to a logits row per request, and advancing each matcher by one token."""
    from dsv41.engine.grammar import GrammarCompiler
    from dsv41.engine.types import GrammarSpec

    tok = ByteTokenizer(vocab)
    compiler = GrammarCompiler(tok, vocab)
    spec = GrammarSpec(compiler.json_schema(JSON_BENCH_SCHEMA))
    grammars = [compiler.matcher(spec) for _ in range(batch)]
    doc = tok.encode('{"notes":"' + "abcdefghij" * (steps // 10 + 1), add_bos=False)[:steps]
    logits = torch.randn(batch, vocab)  # [B, vocab]
    t = time.perf_counter()
    for k, token in enumerate(doc):
        compiler.prefetch(grammars)
        for row, g in enumerate(grammars):
            logits[row].masked_fill(~g.allowed(doc[:k]), -torch.inf)
            g.advance(token)
    return 1e3 * (time.perf_counter() - t) / len(doc)


def baseline_decode_rate(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    model.set_batch_invariant(0)
    prompt = torch.tensor(random_prompts(batch, prompt_len, model.cfg.vocab_size))
    cache = model.new_cache(batch, prompt_len + new_tokens)
    with torch.inference_mode():
        logits = model(prompt, 0, cache, last_only=True)[:, -1]
        token = logits.argmax(-1)
        t = time.perf_counter()
        for step in range(new_tokens - 1):
            token = model(token.view(batch, 1), prompt_len + step, cache, last_only=True)[:, -1].argmax(-1)
        seconds = time.perf_counter() - t
    return batch * (new_tokens - 1) / seconds


# ---------------------------------------------------------------------- prefill
def engine_ttft(model, prompt: list[int], mode: str) -> float:
    engine = make_engine(model, prefill_mode=mode)
    engine.prompt_logits(prompt[:16])  # warm-up
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - t


def replay_gap(model, prompt: list[int]) -> dict:
    """Last-position logits of bounded replay vs full prefill (same engine, same chunking)."""
    full = make_engine(model, prefill_mode="full").prompt_logits(prompt)
    bounded = make_engine(model, prefill_mode="bounded").prompt_logits(prompt)
    diff = bounded - full
    return {
        "max_abs": float(diff.abs().max()),
        "rms": float(diff.pow(2).mean().sqrt()),
        "logit_rms": float(full.pow(2).mean().sqrt()),
        "argmax_agrees": bool(full.argmax() == bounded.argmax()),
    }


def multi_turn(model, turns: int, first_len: int, user_len: int, reply_len: int, **overrides) -> dict:
    """A conversation: each turn's prompt is the previous prompt + reply + a new user message."""
    engine = make_engine(model, **overrides)
    params = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
    users = random_prompts(turns, user_len, model.cfg.vocab_size, seed=5)
    prompt = random_prompts(1, first_len, model.cfg.vocab_size, seed=4)[0]
    t = time.perf_counter()
    ttfts, reply = [], []
    for turn in range(turns):
        if turn:
            prompt = prompt + reply + users[turn]
        start = time.perf_counter()
        engine.add_request(f"turn{turn}", prompt, params)
        first, done = None, False
        while not done:
            for o in engine.step():
                first = first or time.perf_counter()
                done, reply = o.finished, o.token_ids
        ttfts.append(first - start)
    m = engine.metrics()
    return {
        "seconds": time.perf_counter() - t,
        "ttft_s": ttfts,
        "hit_rate": m["prefix_cache_hit_rate"],
        "hit_tokens": m["prefix_cache_hit_tokens"],
        "queried_tokens": m["prefix_cache_queried_tokens"],
        "snapshot_hits": m["prefix_cache_snapshot_hits"],
        "window_rebuilds": m["window_rebuilds"],
    }


def baseline_ttft(model, prompt: list[int]) -> float:
    model.set_batch_invariant(0)
    t = time.perf_counter()
    generate(model, torch.tensor([prompt]), 1)
    return time.perf_counter() - t


# ---------------------------------------------------------------------- long-context decode
def synthetic_sequence(engine: LLMEngine, context: int, seed: int = 0) -> Sequence:
    """A running sequence whose cache holds `context` positions of grid-valued random state."""
    cfg, pool = engine.model_config, engine.pool
    g = torch.Generator().manual_seed(seed)
    seq = Sequence(
        f"ctx{context}",
        [5] * context,
        SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True),
        engine._arrivals,
    )
    engine._arrivals += 1
    cache = SequenceCache(cfg, pool, engine.states, engine.states.acquire())
    cache.set_blocks([engine.allocator.allocate() for _ in range(-(-(context + 64) // pool.block_size))])
    for layer, lay in pool.sources.items():
        n = context // lay.ratio
        for first in range(0, n, 8192):
            m = min(8192, n - first)
            kv = fp4_qdq(torch.randn(m, cfg.head_dim, generator=g).bfloat16(), KV_FP4_BLOCK, "e4m3")
            keys = fp4_qdq(torch.randn(m, cfg.index_head_dim, generator=g).bfloat16(), FP4_BLOCK, "ue8m0")
            pool.write(layer, cache.table, first, kv, keys)
    for layer in range(cfg.n_layers):
        slots = torch.arange(cfg.window_size)
        cache.window_write(
            layer, 1, slots, fp8_qdq(torch.randn(1, cfg.window_size, cfg.head_dim, generator=g).bfloat16())
        )
    seq.cache, seq.num_computed, seq.prefill_target = cache, context, context
    seq.output_ids = [7]
    seq.status = Status.RUNNING
    engine.requests[seq.request_id] = seq
    engine.running.append(seq)
    return seq


def engine_step_time(model, context: int, steps: int, **overrides) -> float:
    engine = make_engine(model, kv_pool_tokens=context + 4096, max_model_len=context + 4096, **overrides)
    synthetic_sequence(engine, context)
    engine.step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t) / steps


def baseline_step_time(model, context: int, steps: int) -> float:
    model.set_batch_invariant(0)
    cfg = model.cfg
    cache = model.new_cache(1, context + steps + 2)
    g = torch.Generator().manual_seed(0)
    for layer in cfg.kv_source_layers:  # same synthetic state in the reference's bf16 containers
        n = context // cfg.compress_ratios[layer]
        cache.compressed_kv[layer][0, :n] = fp4_qdq(
            torch.randn(n, cfg.head_dim, generator=g).bfloat16(), KV_FP4_BLOCK, "e4m3"
        )
        cache.index_k[layer][0, :n] = fp4_qdq(
            torch.randn(n, cfg.index_head_dim, generator=g).bfloat16(), FP4_BLOCK, "ue8m0"
        )
    with torch.inference_mode():
        token = torch.tensor([[7]])
        model(token, context, cache)
        t = time.perf_counter()
        for i in range(steps):
            model(token, context + 1 + i, cache)
        return (time.perf_counter() - t) / steps


# ---------------------------------------------------------------------- sizes
def kv_bytes(model, context: int) -> dict:
    engine = make_engine(model, kv_pool_tokens=context + 4096, max_model_len=context + 4096)
    synthetic_sequence(engine, context)
    measured = engine.resident_kv_bytes()
    cfg = model.cfg
    baseline = model.new_cache(1, context)
    container = sum(
        t.numel() * t.element_size() for d in (baseline.compressed_kv, baseline.index_k) for t in d.values()
    )
    return {
        "context": context,
        "engine_measured_bytes_per_token": measured["global_kv_bytes_per_token"],
        "engine_allocated_bytes_per_token": measured["allocated_block_bytes"] / context,
        "analytic_bytes_per_token": global_kv_bytes_per_token(cfg)["total"],
        "baseline_bf16_bytes_per_token": container / context,
        "engine_fixed_state_bytes": measured["fixed_state_bytes"],
        "baseline_window_bytes": sum(t.numel() * t.element_size() for t in baseline.window_kv),
    }


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    return "\n".join(lines)


def benchmark_args(description: str, preset_name: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --preset, --out, --quick, --threads."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", default=preset_name)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main(argv=None) -> int:
    args = benchmark_args(__doc__.split("\n")[0], "tiny").parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    model = init_random_weights(Transformer(cfg), seed=1).eval()
    quick = args.quick
    results: dict = {"preset": args.preset, "threads": args.threads, "torch": torch.__version__}

    batches = [1, 8] if quick else [1, 8, 32]
    prompt_len, new_tokens = (32, 8) if quick else (128, 32)
    rows = []
    for b in batches:
        eng = engine_decode_rate(model, b, prompt_len, new_tokens)
        det = engine_decode_rate(model, b, prompt_len, new_tokens, numerics="deterministic")
        base = baseline_decode_rate(model, b, prompt_len, new_tokens)
        rows.append([b, eng, det, base, eng / base, det / base])
    results["decode"] = [
        dict(
            zip(
                [
                    "batch",
                    "engine_tok_s",
                    "engine_deterministic_tok_s",
                    "baseline_tok_s",
                    "ratio",
                    "ratio_deterministic",
                ],
                r,
            )
        )
        for r in rows
    ]
    print(
        table(
            f"\n[decode] {args.preset}, prompt {prompt_len}, {new_tokens} new tokens each",
            [
                "batch",
                "engine tok/s (fast)",
                "engine (deterministic) tok/s",
                "baseline tok/s",
                "engine/baseline",
                "deterministic/baseline",
            ],
            rows,
        )
    )

    try:  # structured outputs (optional extra): the JSON-schema mask's cost per decode step
        rows = []
        for b in batches:
            free = decode_steps(model, b, prompt_len, new_tokens, structured=False)
            con = decode_steps(model, b, prompt_len, new_tokens, structured=True)
            rows.append(
                [
                    b,
                    free["step_ms"],
                    con["step_ms"],
                    con["step_ms"] / free["step_ms"],
                    mask_cost(cfg.vocab_size, b, new_tokens),
                ]
            )
        results["structured_decode"] = [
            dict(zip(["batch", "free_step_ms", "json_schema_step_ms", "ratio", "mask_only_ms_per_step"], r))
            for r in rows
        ]
        print(
            table(
                f"\n[structured outputs] {args.preset}: decode step with a JSON-schema mask vs unconstrained "
                f"(temperature 1)",
                ["batch", "free ms/step", "JSON schema ms/step", "ratio", "mask alone ms/step"],
                rows,
            )
        )
    except ImportError as exc:  # GrammarUnavailable is a ValueError; a missing llguidance ends here too
        print(f"\n[structured outputs] skipped: {exc}")
    except ValueError as exc:
        print(f"\n[structured outputs] skipped: {exc}")

    prefill_lens = [256] if quick else [512, 2048]
    rows = []
    for n in prefill_lens:
        (prompt,) = random_prompts(1, n, cfg.vocab_size, seed=1)
        bounded, full, base = (
            engine_ttft(model, prompt, "bounded"),
            engine_ttft(model, prompt, "full"),
            baseline_ttft(model, prompt),
        )
        rows.append([n, bounded, full, base, n / bounded, n / full, n / base, full / bounded])
    keys = [
        "prompt",
        "ttft_bounded_s",
        "ttft_full_s",
        "ttft_baseline_s",
        "prefill_bounded_tok_s",
        "prefill_full_tok_s",
        "prefill_baseline_tok_s",
        "bounded_speedup_vs_full",
    ]
    results["prefill"] = [dict(zip(keys, r)) for r in rows]
    print(
        table(
            f"\n[prefill / time to first token] {args.preset}",
            [
                "prompt",
                "TTFT bounded s",
                "TTFT full s",
                "TTFT baseline s",
                "bounded tok/s",
                "full tok/s",
                "baseline tok/s",
                "full/bounded",
            ],
            rows,
        )
    )
    gaps = []
    for n in prefill_lens:
        (prompt,) = random_prompts(1, n, cfg.vocab_size, seed=1)
        gaps.append({"prompt": n, **replay_gap(model, prompt)})
    results["bounded_replay_gap"] = gaps
    print(
        table(
            f"\n[bounded replay vs full prefill, last-position logits] {args.preset} (random weights)",
            ["prompt", "max |diff|", "rms diff", "rms logit", "same argmax"],
            [[g["prompt"], g["max_abs"], g["rms"], g["logit_rms"], g["argmax_agrees"]] for g in gaps],
        )
    )

    turns, first_len, user_len, reply_len = (3, 200, 20, 8) if quick else (6, 1500, 60, 24)
    variants = {
        "prefix cache (exact reuse)": {},
        "prefix cache, approximate reuse": {"exact_prefix_reuse": False},
        "approximate reuse, rings expired": {"exact_prefix_reuse": False, "window_ttl_s": 0.0},
        "no prefix cache": {"enable_prefix_caching": False},
    }
    rows, conv = [], {}
    for name, overrides in variants.items():
        r = multi_turn(model, turns, first_len, user_len, reply_len, **{"enable_prefix_caching": True, **overrides})
        conv[name] = r
    base_s = conv["no prefix cache"]["seconds"]
    for name, r in conv.items():
        rows.append(
            [
                name,
                r["seconds"],
                base_s / r["seconds"],
                sum(r["ttft_s"][1:]) / max(turns - 1, 1),
                r["hit_rate"],
                r["snapshot_hits"],
                r["window_rebuilds"],
            ]
        )
    results["multi_turn"] = {
        "turns": turns,
        "first_prompt": first_len,
        "user_tokens": user_len,
        "reply_tokens": reply_len,
        "variants": conv,
    }
    print(
        table(
            f"\n[multi-turn conversation] {args.preset}: {turns} turns, first prompt {first_len}, "
            f"+{user_len} user tokens and {reply_len}-token replies per turn",
            ["variant", "total s", "speedup", "mean TTFT turns 2+ s", "hit rate", "snapshot hits", "window rebuilds"],
            rows,
        )
    )

    contexts = [1024, 4096] if quick else [1024, 16384, 65536]
    steps = 3 if quick else 5
    rows = []
    for ctx in contexts:
        eng, base = engine_step_time(model, ctx, steps), baseline_step_time(model, ctx, steps)
        rows.append([ctx, eng * 1e3, base * 1e3])
    first = rows[0]
    for r in rows:
        r += [r[1] / first[1], r[2] / first[2]]
    results["long_context_decode"] = [
        dict(zip(["context", "engine_step_ms", "baseline_step_ms", "engine_vs_first", "baseline_vs_first"], r))
        for r in rows
    ]
    print(
        table(
            f"\n[decode step time vs context] {args.preset}, batch 1",
            ["context", "engine ms", "baseline ms", f"engine / {contexts[0]}", f"baseline / {contexts[0]}"],
            rows,
        )
    )

    sizes = kv_bytes(model, contexts[-1])
    results["kv_bytes"] = sizes
    print(
        table(
            f"\n[resident KV] {args.preset}, context {contexts[-1]}",
            ["quantity", "value"],
            [[k, float(v)] for k, v in sizes.items() if k != "context"],
        )
    )

    write_results(results, args.out, f"serve_{args.preset}", plot)
    return 0


def machine() -> dict:
    """The CPU these figures come from: model name, the flags that pick kernels, torch's capability."""
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "cpu": name,
        "flags": [f for f in wanted if f in flags],
        "cores": os.cpu_count(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def write_results(results: dict, out: str, stem: str, plot_fn) -> str:
    """out/stem.json with the results and out/stem.png drawn by plot_fn(results, path)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    plot_fn(results, os.path.join(out, f"{stem}.png"))
    print(f"\nwrote {path} and the plot")
    return path


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    d = results["decode"]
    x = range(len(d))
    axes[0].bar([i - 0.2 for i in x], [r["engine_tok_s"] for r in d], 0.4, label="engine")
    axes[0].bar([i + 0.2 for i in x], [r["baseline_tok_s"] for r in d], 0.4, label="baseline loop")
    axes[0].set_xticks(list(x), [str(r["batch"]) for r in d])
    axes[0].set(xlabel="batch", ylabel="decode tokens/s", title="decode throughput")
    axes[0].legend()
    p = results["prefill"]
    x = range(len(p))
    for off, key, label in (
        (-0.27, "prefill_bounded_tok_s", "bounded replay"),
        (0, "prefill_full_tok_s", "full"),
        (0.27, "prefill_baseline_tok_s", "baseline"),
    ):
        axes[1].bar([i + off for i in x], [r[key] for r in p], 0.27, label=label)
    axes[1].set_xticks(list(x), [str(r["prompt"]) for r in p])
    axes[1].set(xlabel="prompt tokens", ylabel="prefill tokens/s", title="prefill")
    axes[1].legend()
    c = results["long_context_decode"]
    axes[2].plot([r["context"] for r in c], [r["engine_step_ms"] for r in c], "o-", label="engine")
    axes[2].plot([r["context"] for r in c], [r["baseline_step_ms"] for r in c], "s-", label="baseline loop")
    axes[2].set_xscale("log", base=2)
    axes[2].set(xlabel="context tokens", ylabel="decode step ms", title="decode step vs context")
    axes[2].legend()
    fig.suptitle(f"dsv41 serving, preset {results['preset']} (random weights, {results['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
