"""What the reference's pinned summation orders cost, next to the fast paths, in one run (issue 29).

    python benchmarks/bench_numerics.py [--preset small] [--out bench_out] [--quick]

Prints two tables and writes bench_out/numerics_<preset>.json and a PNG. Side by side (compare ratios;
these machines are noisy):
- the statistics alone: a mean of squares as the vectorised fp32 mean (the engine's and trainer's path)
  and pinned (fp32 squares summed left to right in fp64, rounded once: `dsv41.ops.mean_of_squares`), at the
  RMSNorm and hc-statistic shapes of a decode step and a prefill chunk, for the preset and for the release;
- the model: one prefill chunk and a few decode steps with the fast numerics, with only the RMSNorms
  pinned (the statistic that runs most often), and with full reference numerics (every pinned order:
  the golden runner's setting).
Random weights: only times mean anything here.
"""

from __future__ import annotations

import time

import torch

from bench_serve import benchmark_args, table, write_results
from dsv41.config import preset
from dsv41.model.init import init_random_weights
from dsv41.model.layers import RMSNorm
from dsv41.model.transformer import Transformer
from dsv41.ops.reductions import mean_of_squares


def best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls, in ms (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def statistic_rows(dims: dict, repeats: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for label, (tokens, width) in dims.items():
        x = torch.randn(tokens, width, generator=g).bfloat16().float()
        fast = best_of(lambda: mean_of_squares(x, False, keepdim=True), repeats)
        pinned = best_of(lambda: mean_of_squares(x, True, keepdim=True), repeats)
        rows.append({"shape": label, "tokens": tokens, "width": width, "fast_ms": fast, "pinned_ms": pinned,
                     "ratio": pinned / fast})
    return rows


def model_rows(name: str, prompt_len: int, decode_steps: int) -> list[dict]:
    model = init_random_weights(Transformer(preset(name)), seed=1).eval()
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    prompt = torch.randint(3, model.cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))

    def run() -> tuple[float, float]:
        cache = model.new_cache(1, prompt_len + decode_steps)
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = model(prompt, 0, cache, last_only=True)
            t1 = time.perf_counter()
            for t in range(decode_steps):
                logits = model(logits[:, -1:].argmax(-1), prompt_len + t, cache, last_only=True)
            t2 = time.perf_counter()
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1) / decode_steps

    def variant(label: str, setup) -> dict:
        model.set_reference_numerics(False)
        setup()
        run()  # warm-up
        # each figure its own best of three: a tuple's min would take the decode time of the run with the
        # best prefill, and one run hit by another process's burst then decides the decode column
        runs = [run() for _ in range(3)]
        prefill, decode = min(r[0] for r in runs), min(r[1] for r in runs)
        return {"variant": label, "prefill_ms": prefill, "decode_step_ms": decode}

    rows = [variant("fast (engine, trainer)", lambda: None),
            variant("RMSNorm statistics pinned", lambda: [setattr(m, "reference_numerics", True) for m in norms]),
            variant("reference numerics (all pinned)", lambda: model.set_reference_numerics(True))]
    model.set_reference_numerics(False)
    for row in rows:
        row["prefill_ratio"] = row["prefill_ms"] / rows[0]["prefill_ms"]
        row["decode_ratio"] = row["decode_step_ms"] / rows[0]["decode_step_ms"]
    return rows


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    stats = results["statistics"]
    a.bar([r["shape"] for r in stats], [r["ratio"] for r in stats])
    a.axhline(1, color="k", lw=0.8)
    a.set_ylabel("pinned / fast time")
    a.set_title("mean of squares")
    a.tick_params(axis="x", rotation=30, labelsize=7)
    rows = results["model"]
    xs = range(len(rows))
    b.bar([x - 0.2 for x in xs], [r["prefill_ratio"] for r in rows], 0.4, label="prefill")
    b.bar([x + 0.2 for x in xs], [r["decode_ratio"] for r in rows], 0.4, label="decode step")
    b.set_xticks(list(xs), [r["variant"] for r in rows], fontsize=7, rotation=15)
    b.set_yscale("log")
    b.set_ylabel("time / fast")
    b.set_title(f"{results['preset']} model")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = benchmark_args(__doc__.split("\n")[0], "small").parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, release = preset(args.preset), preset("flash")
    prefill_tokens = 64 if args.quick else 1024
    dims = {f"{args.preset} RMSNorm decode": (1, cfg.dim),
            f"{args.preset} hc stat decode": (1, cfg.hc_mult * cfg.dim),
            f"{args.preset} RMSNorm prefill": (prefill_tokens, cfg.dim),
            f"{args.preset} hc stat prefill": (prefill_tokens, cfg.hc_mult * cfg.dim),
            "flash RMSNorm decode": (1, release.dim),
            "flash hc stat prefill": (prefill_tokens, release.hc_mult * release.dim)}
    stats = statistic_rows(dims, 5 if args.quick else 20)
    print(table("mean of squares: fast (vectorised fp32) vs pinned (fp64, left to right), best of N, ms",
                ["shape", "tokens x width", "fast ms", "pinned ms", "pinned / fast"],
                [[r["shape"], f"{r['tokens']} x {r['width']}", r["fast_ms"], r["pinned_ms"], r["ratio"]]
                 for r in stats]))
    prompt_len, steps = (32, 2) if args.quick else (256, 8)
    model = model_rows(args.preset, prompt_len, steps)
    print()
    print(table(f"{args.preset}: prefill {prompt_len} tokens, then {steps} decode steps (batch 1), best of 2",
                ["numerics", "prefill ms", "x fast", "decode step ms", "x fast"],
                [[r["variant"], r["prefill_ms"], r["prefill_ratio"], r["decode_step_ms"], r["decode_ratio"]]
                 for r in model]))
    results = {"preset": args.preset, "threads": args.threads, "statistics": stats, "model": model,
               "prompt_len": prompt_len, "decode_steps": steps}
    write_results(results, args.out, f"numerics_{args.preset}", plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
