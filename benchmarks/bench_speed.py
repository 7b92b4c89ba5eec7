"""Engine speed against the plain model loop, in one run: decode, prefill, context scaling.

    python benchmarks/bench_speed.py [--preset small] [--out bench_out] [--quick]
    python benchmarks/bench_speed.py --prefill-curve 262144      # one long prompt: chunk time vs position

Prints tables and writes bench_out/speed_<preset>.json and a PNG. Side by side (compare ratios; these
machines are noisy):
- decode tokens/s at batch 1/8/32 x context 512/4K/32K: the engine in `fast` numerics (its default, with its
  compiled decode regions), `fast` with eager ops only, `deterministic` (compiled tiles, and eager), and the plain loop (the core model's forward + `ModelCache`, one
  batch at one position). Contexts are laid down synthetically (random values on the storage grids, the
  same state for both), so a decode step does the work it does after a real prefill;
- decode step time vs context at batch 1;
- prefill tokens/s and peak RSS at 512/4K/32K/128K (each in its own process, so the peak belongs to it):
  the engine (bounded replay, 1,024-token chunks) and the plain loop (1,024-token chunks, no replay);
- resident KV of the engine (packed pool) and the plain loop's bf16 containers;
- with the `hf` extra, transformers' DeepSeek-V4 (the predecessor architecture) at the same widths, its own
  cache and decode loop (`hf_decode`);
- the physical floor of each decode cell: the active weight bytes of a step (`active_weight_bytes`)
  divided by the copy bandwidth this run measures, and how far the engine's step is from it.
`--prefill-curve N` prefills one N-token prompt with the engine, recording each chunk's time and the
process RSS, then times decode steps at that context (the 1M-token target's measured curve).
Random weights: only speeds and sizes mean anything here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from bench_serve import (
    benchmark_args,
    machine,
    make_engine,
    random_prompts,
    synthetic_sequence,
    table,
    write_results,
)

from dsv41.config import preset
from dsv41.engine import SamplingParams
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK, fp4_qdq, fp8_qdq


def build_model(name: str) -> Transformer:
    model = init_random_weights(Transformer(preset(name)), seed=1).eval()
    model.prepare_kernels()  # compile the fused kernels before anything is timed (the engine does it too)
    return model


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    exec, so a child started by a big parent would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e6  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


# ---------------------------------------------------------------------- the physical floor
def memory_bandwidth_gb_s(mb: int = 256, repeats: int = 5) -> float:
    """This machine's copy bandwidth (bytes read + written per second, best of `repeats`), at the thread
    count in force: what a memory-bound decode step can at best stream its weights at."""
    src = torch.ones(mb << 18)  # fp32: mb MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best / 1e9


def active_weight_bytes(model: Transformer, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens must read: every parameter except the embedding
    tables (one row per token is read) and the routed experts nobody picked (expected distinct experts of
    batch x top-k uniform picks per layer)."""
    cfg = model.cfg
    n, k = cfg.n_routed_experts, cfg.n_activated_experts
    used = n * (1 - (1 - 1 / n) ** (batch * k)) if n else 0.0
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name == "embed.weight" or ".engram.embed." in name:
            size = batch * size / p.size(0)
        elif ".ffn.experts." in name:
            size *= used / n
        total += size
    return total


# ---------------------------------------------------------------------- decode
def engine_decode(model, batch: int, context: int, steps: int, **overrides) -> dict:
    # max_num_seqs = the batch: the compiled decode step builds only the buckets up to it (each bucket is a
    # few seconds of compiling, and every cell builds a fresh engine)
    settings = dict(kv_pool_tokens=batch * (context + 256) + 4096, max_model_len=context + 4096, max_num_seqs=batch)
    engine = make_engine(model, **(settings | overrides))
    for i in range(batch):
        synthetic_sequence(engine, context, seed=i)
    engine.step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - t
    return {
        "tok_s": batch * steps / seconds,
        "step_ms": seconds / steps * 1e3,
        "resident_kv_bytes": engine.resident_kv_bytes()["global_kv_bytes"],
    }


def plain_decode(model, batch: int, context: int, steps: int) -> dict:
    """The plain loop at a synthetic context: the same grid-valued state in the bf16 containers."""
    model.set_batch_invariant(0)
    cfg = model.cfg
    cache = model.new_cache(batch, context + steps + 2)
    for b in range(batch):
        g = torch.Generator().manual_seed(b)
        for layer in cfg.kv_source_layers:
            n = context // cfg.compress_ratios[layer]
            cache.compressed_kv[layer][b, :n] = fp4_qdq(
                torch.randn(n, cfg.head_dim, generator=g).bfloat16(), KV_FP4_BLOCK, "e4m3"
            )
            cache.index_k[layer][b, :n] = fp4_qdq(
                torch.randn(n, cfg.index_head_dim, generator=g).bfloat16(), FP4_BLOCK, "ue8m0"
            )
        for layer in range(cfg.n_layers):
            cache.window_kv[layer][b] = fp8_qdq(torch.randn(cfg.window_size, cfg.head_dim, generator=g).bfloat16())
    container = sum(t.numel() * t.element_size() for d in (cache.compressed_kv, cache.index_k) for t in d.values())
    token = torch.full((batch, 1), 7)
    with torch.inference_mode():
        model(token, context, cache, last_only=True)  # warm-up
        t = time.perf_counter()
        for i in range(steps):
            token = model(token, context + 1 + i, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        seconds = time.perf_counter() - t
    return {"tok_s": batch * steps / seconds, "step_ms": seconds / steps * 1e3, "container_bytes": container}


def hf_model(cfg):
    """transformers' DeepSeek-V4 (the predecessor architecture) built at the same widths as `cfg`, random
    bf16 weights, or None when the `hf` extra (transformers with DeepSeek-V4) is not installed."""
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError:
        return None
    hf_cfg = DeepseekV4Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.n_activated_experts,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        sliding_window=cfg.window_size,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim,
        num_nextn_predict_layers=0,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    torch.manual_seed(1)
    try:
        return DeepseekV4ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    except (ValueError, RuntimeError) as err:  # widths its implementation does not take
        print(f"transformers' DeepSeek-V4 cannot be built at these widths ({err}); its column is left out")
        return None


DECODE_HEADER = [
    "batch",
    "context",
    "fast tok/s",
    "fast, eager",
    "deterministic",
    "determ., eager",
    "plain loop",
    "transformers V4",
    "fast/plain",
    "fast/transformers",
    "determ./fast step",
    "floor ms/step",
    "fast step/floor",
]

HF_MAX_PREFILL = 8192  # batch x context tokens up to which the transformers column is measured


def hf_decode(model, batch: int, context: int, steps: int) -> dict:
    """transformers' own decode loop: a prefill of `context` random tokens (its cache), then greedy steps."""
    ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        out = model(token, cache=out.past_key_values, use_cache=True)  # warm-up
        t = time.perf_counter()
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, cache=out.past_key_values, use_cache=True)
        seconds = time.perf_counter() - t
    return {"tok_s": batch * steps / seconds, "step_ms": seconds / steps * 1e3}


# ---------------------------------------------------------------------- prefill (one process per point)
def prefill_point(preset_name: str, n: int, variant: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    if variant == "engine-eager":  # the engine with the eager reference kernels (no fused ones)
        os.environ["DSV41_FUSED"] = "0"
    model = build_model(preset_name)
    (prompt,) = random_prompts(1, n, model.cfg.vocab_size, seed=1)
    before = peak_rss_gb()
    if variant.startswith("engine"):
        engine = make_engine(model, kv_pool_tokens=n + 4096, max_model_len=n + 4096, max_num_batched_tokens=1024)
        engine.prompt_logits(prompt[:16])  # warm-up
        t = time.perf_counter()
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        seconds = time.perf_counter() - t
    else:
        model.set_batch_invariant(0)
        cache = model.new_cache(1, n + 1)
        ids = torch.tensor([prompt])
        t = time.perf_counter()
        with torch.inference_mode():
            for start in range(0, n, 1024):
                model(ids[:, start : start + 1024], start, cache, last_only=True)
        seconds = time.perf_counter() - t
    return {
        "prompt": n,
        "variant": variant,
        "seconds": seconds,
        "tok_s": n / seconds,
        "peak_rss_gb": peak_rss_gb(),
        "rss_before_gb": before,
    }


def run_prefill_point(args, n: int, variant: str) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--preset",
        args.preset,
        "--threads",
        str(args.threads),
        "--prefill-point",
        str(n),
        variant,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------------- the long-prompt curve
def prefill_curve(args, path: str) -> dict:
    """Writes the points so far to `path` every 32 chunks (a long run stopped early keeps its curve)."""
    torch.set_num_threads(args.threads)
    model = build_model(args.preset)
    n = args.prefill_curve
    (prompt,) = random_prompts(1, n, model.cfg.vocab_size, seed=1)
    engine = make_engine(model, kv_pool_tokens=n + 4096, max_model_len=n + 4096, max_num_batched_tokens=1024)
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True))
    seq = engine.requests["long"]
    points, t0 = [], time.perf_counter()
    while seq.in_prefill or not seq.output_ids:
        t = time.perf_counter()
        engine.step()
        points.append(
            {
                "position": seq.num_computed,
                "chunk_s": time.perf_counter() - t,
                "elapsed_s": time.perf_counter() - t0,
                "rss_gb": peak_rss_gb(),
            }
        )
        if len(points) % 32 == 0:
            with open(path, "w") as f:
                json.dump(
                    {"preset": args.preset, "threads": args.threads, "prompt": n, "partial": True, "points": points},
                    f,
                    indent=1,
                )
            p = points[-1]
            print(
                f"  {p['position']:>9} tokens  {p['elapsed_s']:8.1f} s  chunk {p['chunk_s']:.2f} s  "
                f"peak RSS {p['rss_gb']:.2f} GB",
                flush=True,
            )
    prefill_s = time.perf_counter() - t0
    steps = []
    for _ in range(5):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    kv = engine.resident_kv_bytes()
    return {
        "preset": args.preset,
        "threads": args.threads,
        "prompt": n,
        "prefill_s": prefill_s,
        "points": points,
        "decode_step_s": steps,
        "peak_rss_gb": peak_rss_gb(),
        "resident_kv_bytes": kv["global_kv_bytes"],
    }


def fit_token_cost(points: list[dict], skip_below: int) -> tuple[float, float]:
    """Least-squares fit of the seconds per prompt token as a + b * position, over the chunks that end past
    `skip_below` (never the first chunk: it carries the process's first-call costs).

    Each chunk is divided by its own token count and placed at its midpoint, so a short last chunk weighs
    as what it is rather than as a cheap full chunk. Both coefficients are held non-negative: a token
    cannot cost less than nothing, and a later token attends to at least as many keys as an earlier one,
    so a negative slope is timing noise (a two-chunk prompt can give one); the constrained fit is the
    usual two-variable non-negative least squares (try the free fit, else each single-variable one).
    """
    rows, prev = [], 0
    for p in points:
        tokens = p["position"] - prev
        if tokens > 0 and prev > 0 and p["position"] > skip_below:
            rows.append((prev + tokens / 2, p["chunk_s"] / tokens))
        prev = p["position"]
    if not rows:
        raise ValueError("the curve has no chunk past the first to fit; record a longer prompt")
    xs = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    ys = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    if len(rows) >= 2 and float(xs.max() - xs.min()) > 0:
        design = torch.stack([torch.ones_like(xs), xs], 1)
        a, b = torch.linalg.lstsq(design, ys.unsqueeze(1)).solution.squeeze(1).tolist()
        if a >= 0 and b >= 0:
            return a, b
    # the constrained optimum lies on a boundary: slope 0 (the mean) or intercept 0 (through the origin)
    flat = (float(ys.mean()), 0.0)
    through_origin = (0.0, max(0.0, float((xs * ys).sum() / (xs * xs).sum())))

    def sse(ab):
        return float(((ab[0] + ab[1] * xs - ys) ** 2).sum())

    return min(flat, through_origin, key=sse)


def extrapolate_curve(result: dict, target: int) -> dict:
    """Fit the seconds per token as a + b * position (`fit_token_cost`, over the chunks past 8K tokens or
    past a quarter of a shorter prompt) and sum it over the 1,024-token chunks of a `target`-token prompt;
    the decode step is reported as measured at the curve's context (its growth is the Full layers' scan)."""
    a, b = fit_token_cost(result["points"], min(8192, result["prompt"] // 4))
    chunk = 1024
    total = sum(min(chunk, target - p) * (a + b * (p + min(chunk, target - p) / 2)) for p in range(0, target, chunk))
    out = {
        "fit_token_s": [a, b],
        "target": target,
        "prefill_s": total,
        "measured_prefill_s": result.get("prefill_s"),
        "measured_prompt": result["prompt"],
    }
    steps = result.get("decode_step_s")
    if steps:
        out["decode_step_s_measured"] = min(steps)
    return out


def plot_curve(result: dict, fit: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    x = [p["position"] for p in pts]
    axes[0].plot(x, [p["chunk_s"] for p in pts], ".", ms=3, label="measured chunk time")
    a, b = fit["fit_token_s"]
    xs = [0, fit["target"]]
    axes[0].plot(
        xs,
        [1024 * (a + b * v) for v in xs],
        "--",
        label=f"fit 1,024 x ({a * 1e3:.2f} ms + {b * 1e9:.2f} ns x position)",
    )
    axes[0].set(xlabel="position (tokens)", ylabel="s per 1,024-token chunk", title="prefill chunk time")
    axes[0].legend()
    axes[1].plot(x, [p["elapsed_s"] / 60 for p in pts], label="elapsed (measured)")
    target = fit["target"]
    ext = list(range(0, target + 1, 8192))
    axes[1].plot(
        ext,
        [sum(min(1024, t - p) * (a + b * (p + min(1024, t - p) / 2)) for p in range(0, t, 1024)) / 60 for t in ext],
        "--",
        label=f"fit: {fit['prefill_s'] / 60:.0f} min at {target:,}",
    )
    ax2 = axes[1].twinx()
    ax2.plot(x, [p["rss_gb"] for p in pts], "k:", label="peak RSS GB")
    ax2.set_ylabel("peak RSS GB")
    ax2.set_ylim(0, max(4.0, max(p["rss_gb"] for p in pts) * 1.2))
    axes[1].set(xlabel="prompt tokens", ylabel="minutes", title="prefill time and peak RSS")
    axes[1].legend(loc="upper left")
    fig.suptitle(f"one long prompt, preset {result['preset']}, {result['threads']} threads (random weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = benchmark_args(__doc__.split("\n")[0], "small")
    ap.add_argument("--prefill-curve", type=int, default=0, metavar="N", help="prefill one N-token prompt, per chunk")
    ap.add_argument("--prefill-point", nargs=2, metavar=("N", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--plot-curve", metavar="JSON", help="fit, extrapolate to 1,048,576 tokens and plot a curve file")
    ap.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default 1 8 32; --quick 1 8)")
    ap.add_argument("--contexts", type=int, nargs="+", help="decode contexts (default 512 4096 32768; --quick 512)")
    ap.add_argument("--steps", type=int, help="timed decode steps per cell (default 6; --quick 3)")
    ap.add_argument("--decode-only", action="store_true", help="only the decode grid (no step-vs-context, no prefill)")
    args = ap.parse_args(argv)
    if args.prefill_point:
        print(json.dumps(prefill_point(args.preset, int(args.prefill_point[0]), args.prefill_point[1], args.threads)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.plot_curve:
        with open(args.plot_curve) as f:
            result = json.load(f)
        fit = extrapolate_curve(result, 1 << 20)
        result["extrapolation"] = fit
        with open(args.plot_curve, "w") as f:
            json.dump(result, f, indent=1)
        plot_curve(result, fit, args.plot_curve.replace(".json", ".png"))
        print(json.dumps(fit, indent=1))
        return 0
    if args.prefill_curve:
        path = os.path.join(args.out, f"prefill_curve_{args.preset}_{args.prefill_curve}.json")
        result = prefill_curve(args, path)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(
            f"prefill {result['prompt']} tokens: {result['prefill_s']:.0f} s, peak RSS {result['peak_rss_gb']:.2f} GB,"
            f" decode step {min(result['decode_step_s']) * 1e3:.0f} ms; wrote {path}"
        )
        return 0

    torch.set_num_threads(args.threads)
    model = build_model(args.preset)
    quick = args.quick
    results: dict = {"preset": args.preset, "threads": args.threads, "torch": torch.__version__}

    # a quick run is a smoke run: both batch kinds at one context (the step against the context is its own part)
    batches, contexts = ([1, 8], [512]) if quick else ([1, 8, 32], [512, 4096, 32768])
    batches, contexts = args.batches or batches, args.contexts or contexts
    steps = args.steps or (3 if quick else 6)
    hf = hf_model(model.cfg)
    if hf is None:
        print("transformers' DeepSeek-V4 not installed (pip install -e '.[hf]'): its column is left out")
    bandwidth = memory_bandwidth_gb_s()
    results["memory_bandwidth_gb_s"] = bandwidth
    print(f"memory bandwidth (copy, {args.threads} threads): {bandwidth:.1f} GB/s", flush=True)
    info = machine()
    print(f"CPU: {info['cpu']} ({', '.join(info['flags'])}), torch capability {info['torch_capability']}")
    results["machine"] = info
    rows, decode = [], []
    for ctx in contexts:
        for b in batches:
            # the engine's numerics modes (docs/numerics.md); `fast` as `dsv41 serve` runs it, with its compiled
            # decode regions (built before the first timed step), and with eager ops only
            eng = engine_decode(model, b, ctx, steps, compile_decode="now")
            eager = engine_decode(model, b, ctx, steps)
            # deterministic with its compiled tiles (`--compile-decode now`) and eager (its default)
            det = engine_decode(model, b, ctx, steps, numerics="deterministic", compile_decode="now")
            det_eager = engine_decode(model, b, ctx, steps, numerics="deterministic")
            plain = plain_decode(model, b, ctx, steps)
            # transformers' prefill of the synthetic context is slow past ~8K tokens in all (minutes here)
            hf_cell = hf_decode(hf, b, ctx, steps) if hf is not None and b * ctx <= HF_MAX_PREFILL else None
            floor_ms = active_weight_bytes(model, b) / (bandwidth * 1e9) * 1e3
            decode.append(
                {
                    "batch": b,
                    "context": ctx,
                    "engine_tok_s": eng["tok_s"],
                    "engine_eager_tok_s": eager["tok_s"],
                    "deterministic_tok_s": det["tok_s"],
                    "deterministic_eager_tok_s": det_eager["tok_s"],
                    "transformers_v4_tok_s": hf_cell["tok_s"] if hf_cell else None,
                    "plain_tok_s": plain["tok_s"],
                    "engine_step_ms": eng["step_ms"],
                    "deterministic_step_ms": det["step_ms"],
                    "floor_step_ms": floor_ms,
                    "engine_vs_floor": eng["step_ms"] / floor_ms,
                    "ratio": eng["tok_s"] / plain["tok_s"],
                    "ratio_transformers": eng["tok_s"] / hf_cell["tok_s"] if hf_cell else None,
                    "deterministic_cost": det["step_ms"] / eng["step_ms"],
                }
            )
            rows.append(
                [
                    b,
                    ctx,
                    eng["tok_s"],
                    eager["tok_s"],
                    det["tok_s"],
                    det_eager["tok_s"],
                    plain["tok_s"],
                    hf_cell["tok_s"] if hf_cell else "-",
                    eng["tok_s"] / plain["tok_s"],
                    eng["tok_s"] / hf_cell["tok_s"] if hf_cell else "-",
                    det["step_ms"] / eng["step_ms"],
                    floor_ms,
                    eng["step_ms"] / floor_ms,
                ]
            )
            print(table("", DECODE_HEADER, [rows[-1]]).splitlines()[-1], flush=True)
    results["decode"] = decode
    print(
        table(
            f"\n[decode tok/s] {args.preset}, {steps} steps after a warm-up, synthetic context; floor: active "
            f"weight bytes / {bandwidth:.1f} GB/s",
            DECODE_HEADER,
            rows,
        )
    )

    if args.decode_only:
        write_results(results, args.out, f"speed_{args.preset}_decode", plot_decode)
        return 0
    step_contexts = [1024, 4096] if quick else [1024, 4096, 16384, 32768, 65536]
    rows, scaling = [], []
    for ctx in step_contexts:
        eng, plain = engine_decode(model, 1, ctx, steps), plain_decode(model, 1, ctx, steps)
        scaling.append(
            {
                "context": ctx,
                "engine_step_ms": eng["step_ms"],
                "plain_step_ms": plain["step_ms"],
                "engine_resident_kv_bytes": eng["resident_kv_bytes"],
                "plain_container_bytes": plain["container_bytes"],
            }
        )
    for r in scaling:
        r["engine_vs_first"] = r["engine_step_ms"] / scaling[0]["engine_step_ms"]
        r["plain_vs_first"] = r["plain_step_ms"] / scaling[0]["plain_step_ms"]
        rows.append(
            [
                r["context"],
                r["engine_step_ms"],
                r["plain_step_ms"],
                r["engine_vs_first"],
                r["plain_vs_first"],
                r["engine_resident_kv_bytes"] / 2**20,
                r["plain_container_bytes"] / 2**20,
            ]
        )
    results["decode_step_vs_context"] = scaling
    print(
        table(
            f"\n[decode step vs context] {args.preset}, batch 1",
            [
                "context",
                "engine ms",
                "plain ms",
                f"engine / {step_contexts[0]}",
                f"plain / {step_contexts[0]}",
                "engine resident KV MiB",
                "plain bf16 containers MiB",
            ],
            rows,
        )
    )

    prompts = [512, 2048] if quick else [512, 4096, 32768, 131072]
    rows, prefill = [], []
    for n in prompts:
        eng = run_prefill_point(args, n, "engine")
        eager = run_prefill_point(args, n, "engine-eager") if n >= 32768 and not quick else None
        plain = run_prefill_point(args, n, "plain") if n <= 32768 else None
        prefill.append({"prompt": n, "engine": eng, "engine_eager_kernels": eager, "plain": plain})
        rows.append(
            [
                n,
                eng["tok_s"],
                eng["peak_rss_gb"],
                eager["tok_s"] if eager else "not run",
                plain["tok_s"] if plain else "not run",
                plain["peak_rss_gb"] if plain else "-",
                eng["tok_s"] / plain["tok_s"] if plain else "-",
            ]
        )
        print(
            table(
                "",
                ["prompt", "engine tok/s", "engine RSS", "engine eager", "plain tok/s", "plain RSS", "ratio"],
                [rows[-1]],
            ).splitlines()[-1],
            flush=True,
        )
    first = prefill[0]["engine"]["seconds"] / prompts[0]
    for p in prefill:
        p["engine_per_token_vs_first"] = p["engine"]["seconds"] / p["prompt"] / first
    results["prefill"] = prefill
    print(
        table(
            f"\n[prefill] {args.preset}, 1,024-token chunks, one process per point (peak RSS of that process)",
            [
                "prompt",
                "engine tok/s",
                "engine peak RSS GB",
                "engine (eager kernels) tok/s",
                "plain loop tok/s",
                "plain peak RSS GB",
                "engine/plain",
            ],
            rows,
        )
    )
    print(
        "engine per-token prefill time vs the first prompt: "
        + ", ".join(f"{p['prompt']}: {p['engine_per_token_vs_first']:.2f}x" for p in prefill)
    )

    write_results(results, args.out, f"speed_{args.preset}", plot)
    return 0


def _decode_bars(ax, results: dict) -> None:
    d = results["decode"]
    labels = [f"b{r['batch']}\n{r['context'] // 1024 or r['context']}{'K' if r['context'] >= 1024 else ''}" for r in d]
    x = range(len(d))
    bars = [
        ("engine_tok_s", "engine, fast"),
        ("engine_eager_tok_s", "engine, fast, eager"),
        ("deterministic_tok_s", "engine, deterministic"),
        ("deterministic_eager_tok_s", "engine, deterministic, eager"),
        ("plain_tok_s", "plain loop"),
        ("transformers_v4_tok_s", "transformers DeepSeek-V4"),
    ]
    bars = [(key, label) for key, label in bars if all(r.get(key) is not None for r in d)]
    width = 0.8 / len(bars)
    for j, (key, label) in enumerate(bars):
        ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in x], [r[key] for r in d], width, label=label)
    if all("floor_step_ms" in r for r in d):  # the weight-read limit as tokens/s
        ax.plot(
            list(x), [r["batch"] / r["floor_step_ms"] * 1e3 for r in d], "k_", markersize=20, label="weight-read floor"
        )
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set(xlabel="batch / context", ylabel="decode tokens/s", title="decode throughput")
    ax.legend(fontsize=8)


def plot_decode(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    _decode_bars(ax, results)
    fig.suptitle(
        f"dsv41 engine vs plain loop, preset {results['preset']} (random weights, {results['threads']} threads)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _decode_bars(axes[0], results)
    c = results["decode_step_vs_context"]
    axes[1].plot([r["context"] for r in c], [r["engine_step_ms"] for r in c], "o-", label="engine")
    axes[1].plot([r["context"] for r in c], [r["plain_step_ms"] for r in c], "s-", label="plain loop")
    axes[1].set_xscale("log", base=2)
    axes[1].set(xlabel="context tokens", ylabel="decode step ms (batch 1)", title="decode step vs context")
    axes[1].legend()
    p = results["prefill"]
    axes[2].plot([r["prompt"] for r in p], [r["engine"]["tok_s"] for r in p], "o-", label="engine tok/s")
    pp = [r for r in p if r["plain"]]
    axes[2].plot([r["prompt"] for r in pp], [r["plain"]["tok_s"] for r in pp], "s-", label="plain loop tok/s")
    axes[2].set_xscale("log", base=2)
    axes[2].set(xlabel="prompt tokens", ylabel="prefill tokens/s", title="prefill")
    ax2 = axes[2].twinx()
    rss = [r for r in p if r["engine"].get("peak_rss_gb") is not None]
    ax2.plot([r["prompt"] for r in rss], [r["engine"]["peak_rss_gb"] for r in rss], "k:o", label="engine peak RSS")
    ax2.set_ylabel("peak RSS GB")
    axes[2].legend(loc="lower left", fontsize=8)
    fig.suptitle(
        f"dsv41 engine vs plain loop, preset {results['preset']} (random weights, {results['threads']} threads)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
