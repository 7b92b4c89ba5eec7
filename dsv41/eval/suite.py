"""`dsv41 eval all`: every evaluation of one model in one command (issue 16 item 1), and the table of
evaluations the CLI builds its subcommands from.

The model is loaded once and handed to each eval in turn: perplexity (only with --data/--text), passkey,
single-needle and multi-key NIAH, variable tracking, indexer recall and the bounded-replay / FP4-KV cost.
Each writes its own NAME.json / NAME.md / NAME.png into --out, as its own subcommand would; `all.json`
collects the headline figures and `all.md` every table.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from dsv41.eval.common import EvalConfig, log, prepare, write_outputs
from dsv41.eval.cost import CostConfig, run_cost
from dsv41.eval.perplexity import PerplexityConfig, run_perplexity
from dsv41.eval.recall import RecallConfig, run_recall
from dsv41.eval.retrieval import RetrievalConfig, run_retrieval


@dataclass
class SuiteConfig(EvalConfig):
    lengths: str | None = field(
        default=None,
        metadata={
            "metavar": "LIST",
            "help": (
                "context lengths of the retrieval, recall and cost evals, comma-separated, K = 1024; default: powers "
                "of two from 1K up to the model's context, less what each eval must leave free"
            ),
        },
    )
    depths: str = field(
        default="0,0.25,0.5,0.75,1",
        metadata={"metavar": "LIST", "help": ("needle depths of the retrieval evals, fractions of the filler")},
    )
    samples: int | None = field(
        default=None,
        metadata={"metavar": "N", "help": ("samples per cell / length of every eval (default: each eval's own)")},
    )
    seq_len: int = field(default=1024, metadata={"metavar": "N", "help": "perplexity: tokens of context per window"})
    max_tokens: int = field(
        default=65536, metadata={"metavar": "N", "help": ("perplexity: score at most this many held-out tokens")}
    )
    extrapolate: bool = field(
        default=False,
        metadata={"help": ("allow lengths beyond the model's max_position_embeddings (measures length extrapolation)")},
    )
    skip: str = field(
        default="",
        metadata={
            "metavar": "LIST",
            "help": ("evals to leave out, comma-separated: ppl, passkey, niah, niah_multikey, vartrack, recall, cost"),
        },
    )


SUITE = ("ppl", "passkey", "niah", "niah_multikey", "vartrack", "recall", "cost")


def run_suite(cfg: SuiteConfig, engine_overrides: dict | None = None) -> dict:
    cfg.validate()
    skip = {s.strip() for s in cfg.skip.split(",") if s.strip()}
    unknown = skip - set(SUITE)
    if unknown:
        raise ValueError(f"--skip: unknown eval {sorted(unknown)[0]!r}; the suite runs {', '.join(SUITE)}")
    common = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(EvalConfig)}
    samples = {"samples": cfg.samples} if cfg.samples else {}
    em = prepare(cfg, None)
    shared = dict(lengths=cfg.lengths, extrapolate=cfg.extrapolate, **samples)
    grid = dict(shared, depths=cfg.depths)
    runs = {
        "ppl": lambda: run_perplexity(
            PerplexityConfig(**common, seq_len=cfg.seq_len, max_tokens=cfg.max_tokens, extrapolate=cfg.extrapolate), em
        ),
        "passkey": lambda: run_retrieval(RetrievalConfig(**common, **grid, task="passkey"), engine_overrides, em),
        "niah": lambda: run_retrieval(RetrievalConfig(**common, **grid, task="niah"), engine_overrides, em),
        "niah_multikey": lambda: run_retrieval(
            RetrievalConfig(**common, **grid, task="niah", keys=4, queries=1), engine_overrides, em
        ),
        "vartrack": lambda: run_retrieval(RetrievalConfig(**common, **grid, task="vartrack"), engine_overrides, em),
        "recall": lambda: run_recall(RecallConfig(**common, **shared), em),
        "cost": lambda: run_cost(CostConfig(**common, **shared), em),
    }
    summary, tables = {"model": em.name, "evals": {}}, []
    for name in SUITE:
        if name in skip:
            continue
        if name == "ppl" and not (cfg.data or cfg.text):
            log("all: ppl skipped (it needs --data or --text)")
            continue
        t0 = time.perf_counter()
        result = runs[name]()
        summary["evals"][name] = {
            "seconds": time.perf_counter() - t0,
            "files": result.get("files"),
            **headline(name, result),
        }
        with open(result["files"]["md"], encoding="utf-8") as f:
            tables.append(f"## {name}\n\n{f.read()}")
    write_outputs(cfg.out, "all", summary, "\n".join(tables))
    return summary


def headline(name: str, result: dict) -> dict:
    """The few numbers of an eval that go in the suite's summary."""
    if name == "ppl":
        return {"ppl": result["ppl"], "nll": result["nll"], "bits_per_byte": result["bits_per_byte"]}
    if name in ("passkey", "niah", "niah_multikey", "vartrack"):
        return {"overall": result["overall"], "by_length": {b["length"]: b["accuracy"] for b in result["by_length"]}}
    if name == "recall":
        out = {}
        for j, length in enumerate(result["lengths"]):
            cells = [lay["by_length"][j] for lay in result["layers"]]
            vals = [c["mass_recall"] for c in cells if c.get("queries")]
            out[length] = sum(vals) / len(vals) if vals else None
        return {"mean_mass_recall_by_length": out}
    if name == "cost":
        return {
            "by_comparison": {
                f"{r['compare']}@{r['length']}": {k: r[k] for k in ("dnll", "kl", "agree")} for r in result["summary"]
            }
        }
    return {}


# name -> (config class, run function, takes engine options); the CLI builds `dsv41 eval NAME` from it
EVALS = {
    "ppl": (PerplexityConfig, run_perplexity, False),
    "passkey": (RetrievalConfig, run_retrieval, True),
    "niah": (RetrievalConfig, run_retrieval, True),
    "vartrack": (RetrievalConfig, run_retrieval, True),
    "recall": (RecallConfig, run_recall, False),
    "cost": (CostConfig, run_cost, False),
    "all": (SuiteConfig, run_suite, True),
}
