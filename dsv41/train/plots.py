"""The trainer's plots of its run record (metrics.jsonl rows): loss, MoE routing and answer accuracy."""

from __future__ import annotations

import os


def plot_losses(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["tokens"] for h in history], [h["loss"] for h in history], label="train", alpha=0.6)
    val = [h for h in history if "val_loss" in h]
    if val:
        ax.plot([h["tokens"] for h in val], [h["val_loss"] for h in val], "o-", label="validation")
    ax.set(xlabel="tokens", ylabel="loss (nats/token)", title="dsv41 training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path + ".part.png", dpi=100)
    os.replace(path + ".part.png", path)
    plt.close(fig)


def plot_routing(history: list[dict], path: str) -> None:
    """Per MoE layer: max/mean expert load and the router input's shared-component fraction, by step."""
    rows = [h for h in history if h.get("load_ratio")]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    cmap = plt.get_cmap("viridis")
    n_layers = len(rows[0]["load_ratio"])
    for layer in range(n_layers):
        colour = cmap(layer / max(n_layers - 1, 1))
        top.plot(steps, [h["load_ratio"][layer] for h in rows], color=colour, lw=0.8, label=f"layer {layer}")
        if rows[0].get("gate_shared"):
            bottom.plot(steps, [h["gate_shared"][layer] for h in rows], color=colour, lw=0.8)
    top.axhline(1.5, color="grey", ls="--", lw=0.8)
    top.set(ylabel="max / mean expert load", yscale="log", title="MoE routing per layer (dark: first layer)")
    bottom.set(xlabel="step", ylabel="router input shared fraction", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path + ".part.png", dpi=100)
    os.replace(path + ".part.png", path)
    plt.close(fig)


def plot_accuracy(history: list[dict], path: str) -> None:
    """Held-out answer accuracy by step, overall and per task, against each task's chance level
    (image-text runs; nothing to draw otherwise)."""
    rows = [h for h in history if "val_accuracy" in h]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsv41.vision.synthetic import CHANCE

    steps = [h["step"] for h in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    tasks = sorted(k.removeprefix("val_accuracy_") for k in rows[-1] if k.startswith("val_accuracy_"))
    cmap = plt.get_cmap("tab10")
    for j, task in enumerate(tasks):
        (line,) = ax.plot(
            steps,
            [h.get(f"val_accuracy_{task}", float("nan")) for h in rows],
            "o-",
            color=cmap(j),
            lw=1,
            ms=3,
            label=task,
        )
        if task in CHANCE:
            ax.axhline(CHANCE[task], color=line.get_color(), ls=":", lw=0.8)
    ax.plot(steps, [h["val_accuracy"] for h in rows], "k-", lw=2, label="all")
    ax.set(
        xlabel="step",
        ylabel="held-out exact-answer accuracy",
        ylim=(0, 1.02),
        title="image-text training (dotted: chance per task)",
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path + ".part.png", dpi=100)
    os.replace(path + ".part.png", path)
    plt.close(fig)
