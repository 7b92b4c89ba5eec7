"""Compare training runs side by side: validation loss against steps and tokens, from their metrics.jsonl.

    python -m dsv41.train.compare runs/recipe runs/dense runs/noqat [--names ...] [--out docs/benchmarks/train]

Prints one markdown table (validation loss at every evaluated step that all runs share, then the final
train loss averaged over the last 10 logged steps, tokens/s and the worst expert-load ratio), then, for
runs that logged per-layer routing, a routing table from step `--balanced-from` on (the worst max/mean
load of any layer, the mean over steps of the worst layer's, the share of (step, layer) pairs above 1.5,
the mean router-input shared fraction) and writes OUT.json and OUT.png (validation and smoothed train
loss against tokens, and the worst layer's max/mean load per step).

With `--served`, each run's final `checkpoint/` is also scored as it is served: loaded and set up by the
engine's own builder, run through the inference forward (FP8 window KV, FP4 compressed KV and index keys
in the cache, the indexer's top-k), on the run's validation windows. The training log's validation
loss uses each run's own training forward (dense attention, or no quantisation, for those variants),
so only the served column says what a user of the checkpoint gets.
"""

from __future__ import annotations

import argparse
import json
import os


def read_metrics(run: str) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run}: no metrics.jsonl (is it a `dsv41 train --out` folder?)")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not JSON ({err})") from None
    latest: dict[int, dict] = {}
    for row in rows:  # a resumed run may repeat steps: keep the last record of each
        latest[row["step"]] = row
    return [latest[s] for s in sorted(latest)]


def load_runs(runs: list[str], names: list[str] | None = None) -> dict[str, list[dict]]:
    """{label: metrics rows}; labels default to the folder names."""
    names = names or [os.path.basename(os.path.normpath(r)) for r in runs]
    if len(names) != len(runs):
        raise ValueError("give one name per run")
    return {name: read_metrics(run) for name, run in zip(names, runs)}


def routing_summary(rows: list[dict], start: int) -> dict | None:
    """Routing from step `start` on, for runs that logged per-layer load ratios (None otherwise)."""
    rows = [r for r in rows if r["step"] >= start and r.get("load_ratio")]
    if not rows:
        return None
    worst = [max(r["load_ratio"]) for r in rows]
    pairs = [x for r in rows for x in r["load_ratio"]]
    shared = [x for r in rows for x in r.get("gate_shared", [])]
    return {
        "from_step": start,
        "steps": len(rows),
        "worst_load_ratio": max(worst),
        "mean_worst_layer_load_ratio": sum(worst) / len(worst),
        "mean_load_ratio": sum(pairs) / len(pairs),
        "share_above_1_5": sum(x > 1.5 for x in pairs) / len(pairs),
        "mean_gate_shared": sum(shared) / len(shared) if shared else None,
        "natural": _natural_summary(rows),
    }


def _natural_summary(rows: list[dict]) -> dict | None:
    """Under --capacity-factor: the router's own picks before the bound (None for runs without one)."""
    pairs = [x for r in rows for x in r.get("load_ratio_natural", [])]
    if not pairs:
        return None
    return {
        "worst_load_ratio": max(pairs),
        "mean_load_ratio": sum(pairs) / len(pairs),
        "share_above_1_5": sum(x > 1.5 for x in pairs) / len(pairs),
    }


def summarize(metrics: dict[str, list[dict]], balanced_from: int = 50) -> dict:
    evals = {name: {r["step"]: r for r in rows if "val_loss" in r} for name, rows in metrics.items()}
    shared = sorted(set.intersection(*(set(e) for e in evals.values()))) if evals else []
    summary = {"runs": {}, "eval_steps": shared}
    for name, rows in metrics.items():
        tail = rows[-10:]
        summary["runs"][name] = {
            "val_loss": [evals[name][s]["val_loss"] for s in shared],
            "tokens": [evals[name][s]["tokens"] for s in shared],
            "final_train_loss_last10": sum(r["loss"] for r in tail) / max(len(tail), 1),
            "tokens_per_s_median": sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2] if rows else 0.0,
            "max_load_ratio_last": rows[-1].get("max_load_ratio") if rows else None,
            "steps": rows[-1]["step"] if rows else 0,
            "routing": routing_summary(rows, balanced_from),
        }
    return summary


def served_val_loss(checkpoint: str, data: str, seq_len: int, batch_size: int, batches: int) -> dict:
    """Mean next-token loss of `checkpoint` on the first `batches` x `batch_size` validation windows of
    `seq_len` tokens of the `dsv41 data` folder `data` (those the trainer evaluates), through the model
    the engine serves: `build_engine`'s weights, tokenizer and Engram map, the inference forward with
    its quantised KV cache, one prefill per window."""
    import torch
    import torch.nn.functional as F

    from dsv41.data import TokenDataset
    from dsv41.engine.build import build_engine

    net = build_engine(checkpoint).model
    if seq_len > net.cfg.max_position_embeddings:
        raise ValueError(f"{checkpoint}: seq_len {seq_len} exceeds the model's {net.cfg.max_position_embeddings}")
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in TokenDataset.from_dir(data, "val").sequential_batches(batch_size, seq_len, batches):
            logits = net(x)  # [B, S, vocab] fp32, a fresh cache per call
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
    if not count:
        raise ValueError(f"{data}: no validation window of {seq_len} tokens")
    return {"served_val_loss": total / count, "served_tokens": count}


def add_served(summary: dict, runs: list[str], names: list[str], batches: int) -> None:
    """Score every run's checkpoint as served (`served_val_loss`) with its own data, sequence length and
    evaluation batch size from its saved training config."""
    for name, run in zip(names, runs):
        from dsv41.train.checkpoint import read_train_state_json

        state = os.path.join(run, "train_state")
        try:
            cfg = read_train_state_json(state)["config"]
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"{run}: cannot read the run's config from {state}/state.json ({err})") from None
        if not cfg.get("data"):
            raise ValueError(
                f"{run}: trained on the default corpus (no --data folder recorded); --served needs "
                "a run trained with --data"
            )
        summary["runs"][name].update(
            served_val_loss(os.path.join(run, "checkpoint"), cfg["data"], cfg["seq_len"], cfg["batch_size"], batches)
        )


def markdown_table(summary: dict) -> str:
    steps = summary["eval_steps"]
    served = all("served_val_loss" in r for r in summary["runs"].values())
    head = (
        "| run | "
        + " | ".join(f"val @ {s}" for s in steps)
        + " | train (last 10) | tok/s | max/mean load |"
        + (" val as served |" if served else "")
    )
    lines = [head, "|" + "---|" * (len(steps) + 4 + served)]
    for name, r in summary["runs"].items():
        vals = " | ".join(f"{v:.3f}" for v in r["val_loss"])
        lines.append(
            f"| {name} | {vals} | {r['final_train_loss_last10']:.3f} | {r['tokens_per_s_median']:.0f} | "
            f"{r['max_load_ratio_last']:.2f} |" + (f" {r['served_val_loss']:.3f} |" if served else "")
        )
    routed = {name: r["routing"] for name, r in summary["runs"].items() if r.get("routing")}
    if routed:
        start = next(iter(routed.values()))["from_step"]
        lines += [
            "",
            f"| run (steps >= {start}) | worst layer max/mean, worst step | mean over steps | "
            "mean of all layers | (step, layer) > 1.5 | router input shared | before the capacity bound: "
            "worst, mean, > 1.5 |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in routed.items():
            shared = "-" if r["mean_gate_shared"] is None else f"{r['mean_gate_shared']:.2f}"
            n = r.get("natural")
            natural = (
                "-"
                if n is None
                else (f"{n['worst_load_ratio']:.2f}, {n['mean_load_ratio']:.2f}, {100 * n['share_above_1_5']:.1f}%")
            )
            lines.append(
                f"| {name} | {r['worst_load_ratio']:.2f} | {r['mean_worst_layer_load_ratio']:.2f} | "
                f"{r['mean_load_ratio']:.2f} | {100 * r['share_above_1_5']:.1f}% | {shared} | {natural} |"
            )
    return "\n".join(lines)


def plot(summary: dict, runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routed = any(r.get("load_ratio") for rows in runs.values() for r in rows)
    fig, axes = plt.subplots(1, 3 if routed else 2, figsize=(16 if routed else 11, 4))
    left, right = axes[0], axes[1]
    for name, rows in runs.items():
        tokens = [r["tokens"] / 1e3 for r in rows]
        losses = [r["loss"] for r in rows]
        smooth, acc = [], None
        for x in losses:  # exponential moving average, as training dashboards show it
            acc = x if acc is None else 0.8 * acc + 0.2 * x
            smooth.append(acc)
        left.plot(tokens, smooth, label=name)
        r = summary["runs"][name]
        right.plot([t / 1e3 for t in r["tokens"]], r["val_loss"], marker="o", label=name)
        if routed:
            logged = [row for row in rows if row.get("load_ratio")]
            axes[2].plot(
                [row["step"] for row in logged], [max(row["load_ratio"]) for row in logged], lw=0.8, label=name
            )
    left.set(title="train loss (EMA 0.8)", xlabel="tokens (thousands)", ylabel="loss")
    right.set(title="validation loss", xlabel="tokens (thousands)", ylabel="loss")
    if routed:
        axes[2].axhline(1.5, color="grey", ls="--", lw=0.8)
        axes[2].set(title="worst layer's max/mean expert load", xlabel="step", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compare dsv41 training runs")
    parser.add_argument("runs", nargs="+", help="run folders (dsv41 train --out)")
    parser.add_argument("--names", nargs="+", help="labels, one per run (default: folder names)")
    parser.add_argument("--out", help="write OUT.json and OUT.png")
    parser.add_argument(
        "--balanced-from",
        type=int,
        default=50,
        metavar="STEP",
        help="the routing table covers steps from this one on (default 50)",
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="also score each run's checkpoint/ through the inference forward, as served",
    )
    parser.add_argument(
        "--served-batches",
        type=int,
        default=8,
        metavar="N",
        help="validation batches for --served (default 8, the trainer's default)",
    )
    args = parser.parse_args(argv)
    metrics = load_runs(args.runs, args.names)
    summary = summarize(metrics, args.balanced_from)
    if args.served:
        add_served(summary, args.runs, list(metrics), args.served_batches)
    print(markdown_table(summary))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        plot(summary, metrics, args.out + ".png")
        print(f"wrote {args.out}.json and {args.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
