"""Curves of a `dsv41 train --mix retrieval` run (issue 33): training loss and indexer KL by step, and the
held-out loss of the text batches and of each task's answers (nats per trained token) at each evaluation.

    python benchmarks/plot_long_context.py RUN/metrics.jsonl OUT.png

Runs side by side (the baselines table's runs: same data, steps and seed), one panel per task with each
run's held-out answer accuracy and loss by step:

    python benchmarks/plot_long_context.py --compare OUT.png recipe=A/metrics.jsonl dense=B/metrics.jsonl ...
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str, out: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    left.plot(steps, [r["loss"] for r in rows], lw=0.8, label="training loss (text and answer batches)")
    kl = left.twinx()
    kl.plot(steps, [r["indexer_kl"] for r in rows], color="tab:red", lw=0.8, alpha=0.6)
    kl.set_ylabel("indexer KL (red)")
    left.set(xlabel="step", ylabel="nats / trained token", title="training")
    left.legend(fontsize=8)
    evals = [r for r in rows if "val_loss" in r]
    names = sorted({k for r in evals for k in r if k.startswith("val_loss_")})
    for name in names:
        pts = [(r["step"], r[name]) for r in evals if name in r]
        right.plot(*zip(*pts), "o-", label=name.removeprefix("val_loss_"))
    right.set(xlabel="step", ylabel="held-out nats / trained token", title="held-out (answers only for tasks)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def compare(out: str, runs: list[str]) -> None:
    named = []
    for spec in runs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"give each run as NAME=METRICS.jsonl, not {spec!r}")
        named.append((name, [r for r in map(json.loads, open(path)) if "val_loss" in r]))
    tasks = sorted(
        {k.removeprefix("val_accuracy_") for _, rows in named for r in rows for k in r if k.startswith("val_accuracy_")}
    )
    fig, axes = plt.subplots(2, len(tasks) + 1, figsize=(3.2 * (len(tasks) + 1), 6), squeeze=False)
    for col, task in enumerate(tasks + ["text"]):
        for name, rows in named:
            for row, key in ((0, f"val_accuracy_{task}"), (1, f"val_loss_{task}")):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    axes[row][col].plot(*zip(*pts), "o-", ms=3, label=name)
        axes[0][col].set(title=task, ylim=(-0.05, 1.05), ylabel="answer accuracy" if col == 0 else None)
        axes[1][col].set(xlabel="step", ylabel="held-out nats / token" if col == 0 else None)
    axes[0][-1].axis("off")  # text has a loss, no answer accuracy
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3:])
    else:
        main(*sys.argv[1:3])
