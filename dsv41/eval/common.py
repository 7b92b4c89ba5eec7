"""What every evaluation shares (issue 16; docs/eval.md): the options all of them take, the model with its
tokenizer, held-out text, context lengths, and the outputs.

Each eval prints a markdown table and writes `NAME.json` (everything measured, per sample where it helps),
`NAME.md` (the table) and `NAME.png` (matplotlib, Agg backend) into `--out`. The model is a preset (random
weights: only the plumbing means anything) or a checkpoint folder, loaded the way the engine loads it
(`dsv41.engine.build.build_model`: weights, tokenizer, Engram token map), so an eval scores the model as
served.

Held-out text is the `val.bin` of a `dsv41 data` folder (the split the trainer never trains on,
`dsv41.data.shards`), or a UTF-8 file tokenized with the model's tokenizer. A data folder must have been
tokenized with the model's tokenizer: its `tokenizer.json` is compared with the checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# the filler of the passkey test (Mohtashami & Jaggi 2023) and RULER's "noise" haystack: text that carries
# no information, so that only the needle can answer the question
from dsv41.data.retrieval_tasks import GRASS_FILLER  # noqa: E402  (the training mix's filler is the harness's)


@dataclass
class EvalConfig:
    """Options every evaluation takes (`dsv41 eval ...`: each field is an option, its help in metadata)."""

    model: str = field(
        default="tiny",
        metadata={
            "metavar": "PATH_OR_PRESET",
            "help": (
                "a checkpoint folder (config.json + *.safetensors + tokenizer.json, e.g. a `dsv41 train` run's "
                "checkpoint/) or a preset name (tiny, small, mini: random weights, for trying the plumbing)"
            ),
        },
    )
    out: str = field(
        default="eval_out",
        metadata={
            "metavar": "DIR",
            "help": ("folder receiving NAME.json (all measurements), NAME.md (the table) and NAME.png (the plot)"),
        },
    )
    data: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR",
            "help": (
                "a `dsv41 data` folder whose held-out split (val.bin) is the text: scored by ppl, the haystack of "
                "the retrieval tasks, the sequences of recall and cost; it must be tokenized with the model's "
                "tokenizer"
            ),
        },
    )
    text: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE",
            "help": ("a UTF-8 text file used like --data's held-out split, tokenized with the model's tokenizer"),
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": ("seed of a preset's random weights and of everything drawn (needle values, sample offsets)"),
        },
    )
    device: str = field(
        default="cpu",
        metadata={"metavar": "DEVICE", "help": ("torch device the model runs on: cpu, cuda, cuda:1, ...")},
    )
    index_topk: int | None = field(
        default=None,
        metadata={
            "metavar": "K",
            "help": (
                "serve with top-K selection instead of the checkpoint's index_topk (the candidate pool widened to "
                "hold K entries); K at least the longest context attends to every compressed entry, as a model "
                "trained with --dense-attention did"
            ),
        },
    )

    def validate(self) -> None:
        if self.data and self.text:
            raise ValueError("give --data or --text, not both")
        if self.model == "flash":
            raise ValueError(
                "flash has 763B parameters; random weights for it do not fit here. "
                "Give a checkpoint folder or a small preset (tiny, small, mini)"
            )
        if self.data is not None and not os.path.isdir(self.data):
            raise ValueError(f"--data {self.data}: not a folder (a `dsv41 data` output with meta.json and val.bin)")
        if self.text is not None and not os.path.isfile(self.text):
            raise ValueError(f"--text {self.text}: no such file")
        if self.index_topk is not None:
            positive("index_topk", self.index_topk)


def positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------------------------------- model


@dataclass
class EvalModel:
    """The model under evaluation, as the engine would serve it."""

    model: object  # dsv41.model.transformer.Transformer
    tokenizer: object  # dsv41.tokenizer.TokenizerLike
    name: str
    folder: str | None  # the checkpoint folder, None for a preset

    @property
    def cfg(self):
        return self.model.cfg


def load_model(spec: str, seed: int = 0, device: str = "cpu") -> EvalModel:
    """A preset name or a checkpoint folder -> EvalModel (weights, tokenizer, Engram map as the engine has them)."""
    from dsv41.engine.build import build_model

    if spec == "flash":
        raise ValueError("flash has 763B parameters; random weights for it do not fit here")
    net, tokenizer, name = build_model(spec, seed, device)
    net.eval()
    return EvalModel(net, tokenizer, name, spec if os.path.isdir(spec) else None)


def prepare(cfg: EvalConfig, em: EvalModel | None) -> EvalModel:
    """The model an eval runs: `em` when given, else the one cfg names; with cfg.index_topk its selection
    width is set (`set_index_topk`)."""
    em = em or load_model(cfg.model, cfg.seed, cfg.device)
    if cfg.index_topk is not None:
        set_index_topk(em.model, cfg.index_topk)
    return em


def set_index_topk(model, k: int) -> None:
    """Serve `model` with top-k selection of k entries in every index-source layer (spec §4), the
    candidate pool of the hierarchical indexer widened to at least k entries so Reindex layers can fill
    their k. A k at least the number of compressed entries visible to any query is dense attention over
    the compressed cache (what `dsv41 train --dense-attention` trains)."""
    positive("index_topk", k)
    for layer in model.layers:
        idx = layer.attn.indexer
        if idx is not None:
            idx.topk = k
            idx.candidate_blocks = max(idx.candidate_blocks, -(-k // idx.candidate_block_size))


def index_topk(model) -> int:
    """The selection width the model's indexers use now (the config's unless `set_index_topk` changed it)."""
    widths = {layer.attn.indexer.topk for layer in model.layers if layer.attn.indexer is not None}
    return max(widths) if widths else model.cfg.index_topk


# ---------------------------------------------------------------------------------------------- text


@dataclass
class HeldOut:
    tokens: np.ndarray  # int64 [N]
    source: str  # where they came from, for the JSON


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_data_tokenizer(data_dir: str, em: EvalModel) -> dict:
    """Refuse a data folder tokenized differently from the model; returns its meta.json."""
    from dsv41.data import read_meta

    try:
        meta = read_meta(data_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--data {data_dir}: cannot read meta.json ({exc}); build the folder with `dsv41 data`"
        ) from None
    vocab = int(meta.get("vocab_size", 0))
    if vocab > em.cfg.vocab_size:
        raise ValueError(
            f"--data {data_dir}: its tokenizer has {vocab} ids, the model's vocabulary {em.cfg.vocab_size}"
        )
    data_tok = os.path.join(data_dir, "tokenizer.json")
    model_tok = os.path.join(em.folder, "tokenizer.json") if em.folder else None
    if os.path.isfile(data_tok):
        if model_tok is None or not os.path.isfile(model_tok):
            raise ValueError(
                f"--data {data_dir} was tokenized with its own tokenizer.json, but {em.name} has none "
                f"(it reads {type(em.tokenizer).__name__} ids); use the checkpoint trained on it, "
                "or --text"
            )
        if _sha256(data_tok) != _sha256(model_tok):
            raise ValueError(
                f"--data {data_dir}: its tokenizer.json differs from {model_tok}; the ids would mean "
                "other text to the model"
            )
    return meta


def held_out(em: EvalModel, data: str | None, text: str | None) -> HeldOut | None:
    """The held-out token stream of --data (val.bin) or --text, or None when neither is given."""
    if data:
        from dsv41.data import TokenDataset

        check_data_tokenizer(data, em)
        tokens = np.asarray(TokenDataset.from_dir(data, "val").tokens, dtype=np.int64)
        source = f"{os.path.abspath(data)} (val.bin)"
    elif text:
        with open(text, encoding="utf-8") as f:
            body = f.read()
        tokens = np.asarray(em.tokenizer.encode(body, add_bos=True), dtype=np.int64)
        source = os.path.abspath(text)
    else:
        return None
    if tokens.size < 2:
        raise ValueError(f"{source}: the held-out text has {tokens.size} tokens")
    if int(tokens.max()) >= em.cfg.vocab_size:
        raise ValueError(f"{source}: token id {int(tokens.max())} is outside the model's vocabulary")
    return HeldOut(tokens, source)


def without_specials(tokens: np.ndarray, tokenizer) -> np.ndarray:
    """The stream with BOS/EOS/PAD removed (document separators in val.bin; not wanted inside a haystack)."""
    specials = np.array(sorted(tokenizer.special_ids), dtype=np.int64)
    return tokens[~np.isin(tokens, specials)]


def stream_slice(tokens: np.ndarray, start: int, length: int) -> tuple[np.ndarray, bool]:
    """`length` tokens of the stream from `start`, wrapping around to the beginning when the stream is
    shorter. Returns (tokens int64 [length], whether it wrapped)."""
    n = tokens.size
    if n == 0:
        raise ValueError("the held-out text is empty")
    idx = (start + np.arange(length)) % n
    return tokens[idx], bool(length > n or start + length > n)


def filler_stream(tokenizer, length: int) -> np.ndarray:
    """`length` tokens of the repeated GRASS_FILLER sentences (each tokenized with its leading space)."""
    pieces = [tokenizer.encode(" " + s, add_bos=False) for s in GRASS_FILLER]
    cycle = np.array([t for p in pieces for t in p], dtype=np.int64)
    return np.resize(cycle, length)


def sequences(em: EvalModel, held: HeldOut | None, length: int, count: int, seed: int) -> tuple[list[np.ndarray], bool]:
    """`count` token sequences of `length` for recall and cost: windows of the held-out stream at offsets
    drawn from `seed` (wrapping around when it is short), or the filler text after BOS. Returns
    (sequences, whether any wrapped)."""
    rng = np.random.default_rng([seed, length])
    if held is None:  # the filler, each sample starting at another point of its cycle
        body = filler_stream(em.tokenizer, length - 1 + 64)
        starts = rng.integers(0, 64, size=count)
        return [
            np.concatenate([[em.tokenizer.bos_id], body[s : s + length - 1]]).astype(np.int64) for s in starts
        ], False
    out, wrapped = [], False
    for _ in range(count):
        start = int(rng.integers(0, max(held.tokens.size - length, 0) + 1))
        seq, w = stream_slice(held.tokens, start, length)
        out.append(seq)
        wrapped |= w
    return out, wrapped


# ---------------------------------------------------------------------------------------------- lengths


def parse_lengths(text: str) -> list[int]:
    """'1K,4k,65536' -> [1024, 4096, 65536] (K = 1024), ascending, without repeats."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        scale = 1024 if part[-1] in "kK" else 1
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) <= 0:
            raise ValueError(f"lengths: {part!r} is not a positive token count (e.g. 512, 4K, 65536)")
        values.append(int(digits) * scale)
    if not values:
        raise ValueError(f"lengths: no length in {text!r}")
    return sorted(set(values))


def default_lengths(cfg, reserve: int = 0, top: int = 65536) -> list[int]:
    """Powers of two from 1K up to the model's context (max_position_embeddings) less `reserve` tokens, at
    most `top` (or the longest length that fits, when even 1K does not)."""
    limit = min(cfg.max_position_embeddings - reserve, top)
    if limit < 1:
        raise ValueError(f"the model's context of {cfg.max_position_embeddings} tokens leaves no room for a prompt")
    out, n = [], 1024
    while n <= limit:
        out.append(n)
        n *= 2
    return out or [limit]


def resolve_lengths(text: str | None, cfg, extra: int = 0, extrapolate: bool = False) -> list[int]:
    """The lengths asked for (default: `default_lengths` leaving room for `extra`), checked against the
    context: each length plus `extra` tokens (an answer, a continuation) must fit max_position_embeddings
    unless `extrapolate`."""
    lengths = parse_lengths(text) if text else default_lengths(cfg, extra)
    limit = cfg.max_position_embeddings
    too_long = [n for n in lengths if n + extra > limit]
    if too_long and not extrapolate:
        raise ValueError(
            f"length {too_long[0]} (+{extra} tokens to generate or score) exceeds the model's context of "
            f"{limit} tokens (max_position_embeddings); pass --extrapolate to measure beyond it"
        )
    return lengths


def fmt_length(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# ---------------------------------------------------------------------------------------------- outputs


def log(message: str) -> None:
    print(f"[dsv41 eval] {message}", file=sys.stderr, flush=True)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _finite(x):
    """JSON has no NaN/inf: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_outputs(out_dir: str, name: str, result: dict, table: str) -> dict:
    """Write NAME.json and NAME.md into out_dir (atomically); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "md": os.path.join(out_dir, f"{name}.md")}
    for path, body in ((paths["json"], json.dumps(_finite(result), indent=1)), (paths["md"], table + "\n")):
        with open(path + ".part", "w", encoding="utf-8") as f:
            f.write(body)
        os.replace(path + ".part", path)
    return paths


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed (pip install matplotlib): no PNG written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Panel:
    """One axes of a line plot: series label -> (xs, ys)."""

    title: str
    xlabel: str
    ylabel: str
    series: dict
    logx: bool = True
    ylim: tuple | None = None
    hline: float | None = None


def plot_panels(path: str, panels: list[Panel], suptitle: str = "") -> str | None:
    """Line plots side by side (x on a log2 scale unless the panel says otherwise) -> path, or None
    without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, (xs, ys) in panel.series.items():
            ax.plot(xs, [np.nan if y is None else y for y in ys], "o-", ms=3, lw=1.2, label=str(label))
        if panel.logx:
            ax.set_xscale("log", base=2)
        if panel.hline is not None:
            ax.axhline(panel.hline, color="grey", ls="--", lw=0.8)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.grid(alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(fontsize=7)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_heatmap(
    path: str, values: np.ndarray, row_labels: list[str], col_labels: list[str], title: str, xlabel: str, ylabel: str
) -> str | None:
    """values [rows, cols] in [0, 1] (NaN: not measured) as a red-to-green grid with the numbers written in."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(1.1 * len(col_labels) + 2.5, 0.55 * len(row_labels) + 1.8))
    image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(col_labels)), col_labels)
    ax.set_yticks(range(len(row_labels)), row_labels)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if np.isfinite(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _save(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path + ".part.png", dpi=100)
    os.replace(path + ".part.png", path)
