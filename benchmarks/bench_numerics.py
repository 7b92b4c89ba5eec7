"""What reference (canonical float64) numerics cost next to the fast forward, in one run.

    python benchmarks/bench_numerics.py [--presets tiny,small] [--out bench_out] [--quick]

Reference numerics (`Transformer.set_reference_numerics`, what `python -m dsv41.golden` runs) compute every
machine-dependent op in float64 and round once (dsv41.ops.canonical): the same bits on every CPU. The fast
forward runs the machine's own kernels (what the engine and trainer run). Prints two tables and writes
bench_out/numerics.json and a PNG, side by side in one process (compare ratios; these machines are noisy):
- ops: each canonical op against its fast kernel, at a decode step's and a prefill chunk's shapes;
- the model: one prefill chunk and a few decode steps (batch 1) per preset, fast and reference.
Random weights: only times mean anything here. The CPU is named in the output.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_serve import machine, table, write_results

from dsv41.config import preset
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.ops import canonical


def best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls, in ms (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def op_rows(name: str, tokens: int, repeats: int) -> list[dict]:
    """Canonical vs fast for the ops a block runs most, at `tokens` rows of preset `name`'s widths."""
    cfg = preset(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, cfg.dim, generator=g).bfloat16()
    w = (torch.randn(cfg.q_lora_rank, cfg.dim, generator=g) * cfg.dim**-0.5).bfloat16()
    flat = torch.randn(tokens, cfg.hc_mult * cfg.dim, generator=g)
    hc_fn = torch.randn((2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim, generator=g) * 0.01
    gate = torch.randn(tokens, cfg.moe_inter_dim, generator=g)
    ops = {
        "mean of squares": (lambda: x.float().square().mean(-1), lambda: canonical.mean_of_squares(x)),
        "bf16 linear (wq_a)": (lambda: F.linear(x, w), lambda: canonical.linear(x, w)),
        "fp32 linear (hc mix)": (lambda: F.linear(flat, hc_fn), lambda: canonical.linear(flat, hc_fn)),
        "SiLU (expert)": (lambda: F.silu(gate), lambda: canonical.silu(gate)),
    }
    rows = []
    for op, (fast, ref) in ops.items():
        f, r = best_of(fast, repeats), best_of(ref, repeats)
        rows.append({"preset": name, "op": op, "tokens": tokens, "fast_ms": f, "reference_ms": r, "ratio": r / f})
    return rows


def model_rows(name: str, prompt_len: int, decode_steps: int) -> list[dict]:
    model = init_random_weights(Transformer(preset(name)), seed=1).eval()
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

    def variant(label: str, reference: bool) -> dict:
        model.set_reference_numerics(reference)
        run()  # warm-up
        # each figure its own best of three: a tuple's min would take the decode time of the run with the
        # best prefill, and one run hit by another process's burst then decides the decode column
        runs = [run() for _ in range(3)]
        return {
            "preset": name,
            "variant": label,
            "prefill_ms": min(r[0] for r in runs),
            "decode_step_ms": min(r[1] for r in runs),
        }

    rows = [variant("fast (engine, trainer)", False), variant("reference (canonical float64)", True)]
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
    ops = results["ops"]
    labels = [f"{r['preset']} {r['op']}\n{r['tokens']} rows" for r in ops]
    a.bar(range(len(ops)), [r["ratio"] for r in ops])
    a.set_xticks(range(len(ops)), labels, fontsize=6, rotation=60)
    a.axhline(1, color="k", lw=0.8)
    a.set_yscale("log")
    a.set_ylabel("reference / fast time")
    a.set_title("ops")
    refs = [r for r in results["model"] if r["variant"].startswith("reference")]
    xs = range(len(refs))
    b.bar([x - 0.2 for x in xs], [r["prefill_ratio"] for r in refs], 0.4, label="prefill")
    b.bar([x + 0.2 for x in xs], [r["decode_ratio"] for r in refs], 0.4, label="decode step")
    b.set_xticks(list(xs), [r["preset"] for r in refs])
    b.axhline(1, color="k", lw=0.8)
    b.set_ylabel("reference / fast time")
    b.set_title(f"model ({results['machine']['cpu']})", fontsize=8)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,small", help="comma-separated presets (default tiny,small)")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    presets = [p for p in args.presets.split(",") if p]
    host = machine()
    print(f"CPU: {host['cpu']} ({', '.join(host['flags'])}; torch {host['torch_capability']}), {args.threads} threads")
    prefill_tokens = 64 if args.quick else 1024
    repeats = 5 if args.quick else 20
    ops = [row for name in presets for tokens in (1, prefill_tokens) for row in op_rows(name, tokens, repeats)]
    print(
        table(
            "ops: fast kernel vs canonical float64, best of N, ms",
            ["preset", "op", "rows", "fast ms", "reference ms", "reference / fast"],
            [[r["preset"], r["op"], r["tokens"], r["fast_ms"], r["reference_ms"], r["ratio"]] for r in ops],
        )
    )
    prompt_len, steps = (32, 2) if args.quick else (256, 8)
    model = [row for name in presets for row in model_rows(name, prompt_len, steps)]
    print()
    print(
        table(
            f"model: prefill {prompt_len} tokens, then {steps} decode steps (batch 1), best of 3",
            ["preset", "numerics", "prefill ms", "x fast", "decode step ms", "x fast"],
            [
                [r["preset"], r["variant"], r["prefill_ms"], r["prefill_ratio"], r["decode_step_ms"], r["decode_ratio"]]
                for r in model
            ],
        )
    )
    results = {
        "presets": presets,
        "threads": args.threads,
        "machine": host,
        "ops": ops,
        "model": model,
        "prompt_len": prompt_len,
        "decode_steps": steps,
    }
    write_results(results, args.out, "numerics", plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
