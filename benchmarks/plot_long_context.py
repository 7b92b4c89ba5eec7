"""Curves of a `dsv41 train --mix retrieval` run (issue 33): training loss and indexer KL by step, and the
held-out loss of the text batches and of each task's answers (nats per trained token) at each evaluation.

    python benchmarks/plot_long_context.py RUN/metrics.jsonl OUT.png
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


if __name__ == "__main__":
    main(*sys.argv[1:3])
