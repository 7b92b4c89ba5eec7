"""Retrieval over long contexts: passkey, needle-in-a-haystack (single and multi-key) and RULER-style
variable tracking, over a grid of context lengths x needle depths, with a heat map (issue 16 item 1).

Why: a long-context model is judged first by whether it can find one fact placed anywhere in a long
prompt. In V4.1 that fact reaches a decoder query only through the compressed cache, and only if the
indexer's top-k selects its entry (spec-v41.md §3, §4); bounded-replay prefill (§2.1, §9) also limits
what the decoder layers see of the prompt. These tests measure the end result of all of it, through the
engine as served (greedy decoding, `--prefill-mode bounded` by default).

Prompts (token-exact length; the tasks follow the published designs, written here from their
descriptions):
- passkey (Mohtashami & Jaggi 2023, "Landmark Attention"): an instruction, the filler, the sentence
  "The pass key is K. Remember it. K is the pass key." at the chosen depth, and "What is the pass key?
  The pass key is". K is a random number of `digits` digits (default 5).
- niah (RULER, Hsieh et al. 2024): `keys` needles "One of the special magic numbers for WORD-WORD is: V."
  with distinct keys and random values (default 7 digits); the question asks for the first `queries`
  of them. keys=1, queries=1 is the single needle; keys>1, queries=1 is RULER's multi-key test (the
  other needles distract); queries=keys asks for every value.
- vartrack (RULER "variable tracking"): "VAR X1 = V." then `hops` assignments "VAR X2 = VAR X1." ...;
  the question asks for every variable that holds V, answer: all hops+1 names.
The filler is the repeated "The grass is green. The sky is blue. ..." of the passkey test (RULER's noise
haystack), or a window of held-out text (--data/--text) with document markers removed. The first needle
goes at `depth` (a fraction of the filler: 0 = right after the instruction, 1 = right before the
question), snapped to the nearest sentence boundary; other needles of niah go at depths drawn per sample
(the same at every depth, so a row of the grid differs only by where the first needle sits), vartrack's
later assignments at drawn depths after the first, in order. Needle contents and the filler window are
drawn from (seed, task, length, sample), so each depth sees the same text.

Scoring: the answer is the greedy continuation (enough tokens for the answers plus a margin), decoded;
a sample scores the fraction of its answers found in it as whole words (case-insensitive; a number inside
a longer number does not count); accuracy is the mean score (RULER's "string match all"), `exact` the
share of samples with every answer found.

The harness talks to a `Completer` (a tokenizer and `complete(prompts, max_new_tokens) -> ids`):
`EngineCompleter` wraps `LLMEngine`; tests use scripted ones (a copier that answers from the prompt gets
1.0, one that answers noise 0.0).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dsv41.data.retrieval_tasks import ADJECTIVES, NIAH_PREFIX, NOUNS, PASSKEY_PREFIX, VARTRACK_PREFIX  # noqa: F401
from dsv41.eval.common import (
    GRASS_FILLER,
    EvalConfig,
    EvalModel,
    fmt_length,
    held_out,
    index_topk,
    log,
    markdown_table,
    parse_lengths,
    plot_heatmap,
    positive,
    prepare,
    resolve_lengths,
    stream_slice,
    without_specials,
    write_outputs,
)

TASKS = ("passkey", "niah", "vartrack")
DEFAULT_DIGITS = {"passkey": 5, "niah": 7, "vartrack": 5}

# niah keys are WORD-WORD pairs of ADJECTIVES x NOUNS (900 distinct keys)
SENTENCE_END = (".", "!", "?", "\n")
ANSWER_ROOM = 64  # tokens a prompt must leave free in the context for its answer (checked exactly later)


@dataclass
class RetrievalConfig(EvalConfig):
    task: str = field(
        default="passkey",
        metadata={
            "choices": TASKS,
            "help": ("passkey, niah (needle in a haystack) or vartrack (variable tracking); set by the subcommand"),
        },
    )
    lengths: str | None = field(
        default=None,
        metadata={
            "metavar": "LIST",
            "help": (
                "prompt lengths in tokens, comma-separated, K = 1024 (e.g. 1K,4K,16K,64K); default: powers of two "
                "from 1K up to the model's context, less room for the answer"
            ),
        },
    )
    depths: str = field(
        default="0,0.25,0.5,0.75,1",
        metadata={
            "metavar": "LIST",
            "help": (
                "where the (first) needle goes, as fractions of the filler: 0 = just after the instruction, "
                "1 = just before the question"
            ),
        },
    )
    samples: int = field(
        default=2,
        metadata={
            "metavar": "N",
            "help": ("prompts per (length, depth) cell, each with other needle values and filler"),
        },
    )
    keys: int = field(
        default=1,
        metadata={
            "metavar": "N",
            "help": ("niah: needles with distinct keys in the prompt (more than --queries: the others distract)"),
        },
    )
    queries: int = field(
        default=1,
        metadata={
            "metavar": "N",
            "help": ("niah: how many of the needles the question asks for (their values must all be recalled)"),
        },
    )
    hops: int = field(
        default=4,
        metadata={
            "metavar": "N",
            "help": ("vartrack: assignments after the first (VAR B = VAR A ...), so hops + 1 variable names to recall"),
        },
    )
    digits: int | None = field(
        default=None,
        metadata={
            "metavar": "N",
            "help": ("digits of the pass key / needle values (default: 5 for passkey and vartrack, 7 for niah)"),
        },
    )
    extrapolate: bool = field(
        default=False,
        metadata={
            "help": (
                "allow lengths beyond the model's max_position_embeddings (measures length extrapolation; the "
                "engine's context limit is raised to fit)"
            )
        },
    )

    def validate(self) -> None:
        super().validate()
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in ("samples", "keys", "queries", "hops"):
            positive(name, getattr(self, name))
        if self.queries > self.keys:
            raise ValueError(f"--queries {self.queries} asks for more needles than --keys {self.keys} places")
        if self.keys > len(ADJECTIVES) * len(NOUNS):
            raise ValueError(f"--keys {self.keys}: at most {len(ADJECTIVES) * len(NOUNS)} distinct keys")
        if self.digits is not None and not 1 <= self.digits <= 30:
            raise ValueError(f"--digits must be in [1, 30], got {self.digits}")
        parse_depths(self.depths)

    @property
    def output_name(self) -> str:
        """The stem of the files written: the task, niah with several keys or queries named by them."""
        if self.task == "niah" and (self.keys > 1 or self.queries > 1):
            return f"niah_k{self.keys}_q{self.queries}"
        return self.task


def parse_depths(text: str) -> list[float]:
    """'0,0.25,1' -> [0.0, 0.25, 1.0]: fractions in [0, 1], ascending, without repeats."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            d = float(part)
        except ValueError:
            raise ValueError(f"depths: {part!r} is not a number") from None
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depths are fractions of the filler in [0, 1], got {part}")
        values.append(d)
    if not values:
        raise ValueError(f"depths: no depth in {text!r}")
    return sorted(set(values))


# ---------------------------------------------------------------------------------------------- prompts


@dataclass
class TaskText:
    """One sample's text before placement: instruction, needle sentences with their depths, question."""

    prefix: str
    needles: list[str]
    depths: list[float]
    question: str
    answers: list[str]


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits)) if digits > 1 else str(rng.randrange(10))


def task_text(
    task: str,
    rng: random.Random,
    depth: float,
    keys: int = 1,
    queries: int = 1,
    hops: int = 4,
    digits: int | None = None,
) -> TaskText:
    """The text of one sample. rng draws contents and the free needles' depths; `depth` places the first."""
    digits = digits or DEFAULT_DIGITS[task]
    if task == "passkey":
        key = _number(rng, digits)
        return TaskText(
            PASSKEY_PREFIX,
            [f" The pass key is {key}. Remember it. {key} is the pass key."],
            [depth],
            "\nWhat is the pass key? The pass key is",
            [key],
        )
    if task == "niah":
        names = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], keys)]
        values = []
        while len(values) < keys:  # distinct values: recalling one must not count for another
            v = _number(rng, digits)
            if v not in values:
                values.append(v)
        needles = [f" One of the special magic numbers for {k} is: {v}." for k, v in zip(names, values)]
        depths = [depth] + [rng.random() for _ in range(keys - 1)]
        asked = names[:queries]
        if queries == 1:
            question = (
                f"\nWhat is the special magic number for {asked[0]} mentioned in the provided text? "
                f"The special magic number for {asked[0]} mentioned in the provided text is"
            )
        else:
            listed = ", ".join(asked[:-1]) + f" and {asked[-1]}"
            question = (
                f"\nWhat are all the special magic numbers for {listed} mentioned in the provided text? "
                f"The special magic numbers for {listed} mentioned in the provided text are"
            )
        return TaskText(NIAH_PREFIX, needles, depths, question, values[:queries])
    if task == "vartrack":
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if name not in names and name != "VAR":
                names.append(name)
        value = _number(rng, digits)
        needles = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
        depths = [depth] + sorted(depth + (1.0 - depth) * rng.random() for _ in range(hops))
        question = (
            f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
            f"Answer: According to the chain of variable assignments in the text above, {hops + 1} "
            f"variables are assigned the value {value}, they are:"
        )
        return TaskText(VARTRACK_PREFIX, needles, depths, question, names)
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


class Haystack:
    """Filler tokens of any length and the positions where a needle may go (sentence boundaries)."""

    def __init__(self, tokenizer, held: np.ndarray | None = None, source: str = "filler"):
        self.tokenizer, self.source = tokenizer, source
        if held is None:
            pieces = [tokenizer.encode(" " + s, add_bos=False) for s in GRASS_FILLER]
            self.cycle = np.array([t for p in pieces for t in p], dtype=np.int64)
            self.cycle_bounds = np.cumsum([0] + [len(p) for p in pieces])[:-1]  # sentence starts in the cycle
            self.held = None
        else:
            self.held = without_specials(held, tokenizer)
            if self.held.size == 0:
                raise ValueError(f"{source}: no text left for a haystack once BOS/EOS/PAD are removed")
            ends = [i for i in range(tokenizer.vocab_size) if _ends_sentence(tokenizer, i)]
            self.end_ids = np.array(ends, dtype=np.int64)

    def take(self, length: int, rng: random.Random) -> tuple[np.ndarray, np.ndarray, bool]:
        """(tokens int64 [length], sorted allowed insertion points in [0, length], whether held-out text wrapped)."""
        if self.held is None:
            tokens = np.resize(self.cycle, length)
            reps = length // self.cycle.size + 1
            starts = (self.cycle_bounds[None, :] + self.cycle.size * np.arange(reps)[:, None]).ravel()
            bounds = np.union1d(starts[starts <= length], [0, length])
            return tokens, bounds, False
        start = rng.randrange(max(self.held.size - length, 0) + 1)
        tokens, wrapped = stream_slice(self.held, start, length)
        after_end = np.nonzero(np.isin(tokens, self.end_ids))[0] + 1
        return tokens, np.union1d(after_end, [0, length]), wrapped


def _ends_sentence(tokenizer, token_id: int) -> bool:
    try:
        text = tokenizer.decode([token_id])
    except ValueError:
        return False
    return text.rstrip(" ").endswith(SENTENCE_END) and token_id not in tokenizer.special_ids


@dataclass
class Probe:
    """One prompt of the grid, with what it must recall."""

    task: str
    length: int
    depth: float
    sample: int
    prompt: list[int]
    answers: list[str]
    needle_at: list[int]  # token offset of each needle in the prompt, in TaskText.needles order
    wrapped: bool = False  # the held-out haystack was shorter than the filler and repeats


def build_probe(
    task: str, tokenizer, haystack: Haystack, length: int, depth: float, sample: int, seed: int = 0, **options
) -> Probe:
    """The prompt of one grid cell sample: exactly `length` tokens (BOS, instruction, filler with the
    needles in it, question). options: keys, queries, hops, digits (see `task_text`)."""
    rng = random.Random(f"{seed}/{task}/{length}/{sample}")  # str seeds hash with sha512: stable everywhere
    text = task_text(task, rng, depth, **options)
    prefix = [tokenizer.bos_id] + tokenizer.encode(text.prefix, add_bos=False)
    needles = [tokenizer.encode(n, add_bos=False) for n in text.needles]
    question = tokenizer.encode(text.question, add_bos=False)
    fixed = len(prefix) + sum(len(n) for n in needles) + len(question)
    budget = length - fixed
    if budget < 1:
        raise ValueError(
            f"{task}: a prompt of {length} tokens is too short; the instruction, needles and question "
            f"alone take {fixed} tokens with this tokenizer"
        )
    filler, bounds, wrapped = haystack.take(budget, rng)
    at = [int(bounds[np.abs(bounds - round(d * budget)).argmin()]) for d in text.depths]
    order = sorted(range(len(needles)), key=lambda i: (at[i], i))
    prompt, needle_at, cursor = list(prefix), [0] * len(needles), 0
    for i in order:
        prompt.extend(filler[cursor : at[i]].tolist())
        cursor = at[i]
        needle_at[i] = len(prompt)
        prompt.extend(needles[i])
    prompt.extend(filler[cursor:].tolist())
    prompt.extend(question)
    assert len(prompt) == length, (len(prompt), length)
    return Probe(task, length, depth, sample, prompt, text.answers, needle_at, wrapped)


def answer_budget(tokenizer, answers: list[str]) -> int:
    """Tokens to generate for these answers: their own tokens (as a comma-separated list) plus a margin."""
    return len(tokenizer.encode(" " + ", ".join(answers) + ".", add_bos=False)) + 8


def score(answers: list[str], text: str) -> float:
    """Fraction of `answers` found in `text` as whole words (case-insensitive): '71432' counts in 'is 71432.'
    but not in '714321'."""
    if not answers:
        raise ValueError("score needs at least one answer")
    found = sum(
        1 for a in answers if re.search(r"(?<![0-9A-Za-z])" + re.escape(a) + r"(?![0-9A-Za-z])", text, re.IGNORECASE)
    )
    return found / len(answers)


# ---------------------------------------------------------------------------------------------- models


class Completer(Protocol):
    """What the harness needs of a model: its tokenizer and greedy continuations of token prompts."""

    tokenizer: object

    def complete(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]: ...


class EngineCompleter:
    """Greedy continuations from an `LLMEngine` (continuous batching, prefix cache across the depths of a
    length, the engine's prefill mode)."""

    def __init__(self, engine):
        self.engine, self.tokenizer = engine, engine.tokenizer

    def complete(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from dsv41.engine.types import SamplingParams

        outs = self.engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"the engine failed a request: {failed[0].error}")
        return [o.token_ids for o in outs]


def engine_config(overrides: dict, longest: int, max_new: int, cfg, extrapolate: bool):
    """The EngineConfig of a retrieval run: the user's engine options, with the context limit raised past
    max_position_embeddings when extrapolating and the KV pool grown to hold the longest request."""
    from dsv41.engine import EngineConfig

    settings = dict(overrides)
    need = longest + max_new + 1
    if "max_model_len" not in settings and need > cfg.max_position_embeddings:
        if not extrapolate:
            raise ValueError(
                f"a {longest}-token prompt plus {max_new} answer tokens exceeds the model's context of "
                f"{cfg.max_position_embeddings}; pass --extrapolate to measure beyond it"
            )
        settings["max_model_len"] = need
    if "kv_pool_tokens" not in settings:
        block = settings.get("block_size", EngineConfig.block_size)
        settings["kv_pool_tokens"] = max(EngineConfig.kv_pool_tokens, -(-2 * need // block) * block)
    config = EngineConfig(**settings)
    config.validate()
    limit = min(config.max_model_len or cfg.max_position_embeddings, config.kv_pool_tokens)
    if need > limit:
        raise ValueError(
            f"a {longest}-token prompt plus {max_new} answer tokens does not fit the engine's context "
            f"limit of {limit} (--max-model-len / --kv-pool-tokens)"
        )
    return config


# ---------------------------------------------------------------------------------------------- the grid


def run_grid(
    completer: Completer,
    task: str,
    lengths: list[int],
    depths: list[float],
    samples: int,
    haystack: Haystack,
    seed: int = 0,
    **options,
) -> dict:
    """Every (length, depth, sample) prompt through `completer`, one batch per length; returns the result
    dict (accuracy and exact grids [depth][length], per-length timings, every sample's record)."""
    tokenizer = completer.tokenizer
    records, by_length = [], []
    acc = np.full((len(depths), len(lengths)), np.nan)
    exact = np.full_like(acc, np.nan)
    for j, length in enumerate(lengths):
        probes = [
            build_probe(task, tokenizer, haystack, length, d, s, seed, **options)
            for d in depths
            for s in range(samples)
        ]
        max_new = max(answer_budget(tokenizer, p.answers) for p in probes)
        t0 = time.perf_counter()
        outs = completer.complete([p.prompt for p in probes], max_new)
        seconds = time.perf_counter() - t0
        if len(outs) != len(probes):
            raise RuntimeError(f"the completer returned {len(outs)} answers for {len(probes)} prompts")
        scores = []
        for p, ids in zip(probes, outs):
            text = tokenizer.decode(list(ids), skip_special_tokens=True)
            s = score(p.answers, text)
            scores.append(s)
            records.append(
                {
                    "length": length,
                    "depth": p.depth,
                    "sample": p.sample,
                    "needle_at": p.needle_at,
                    "answers": p.answers,
                    "output": text,
                    "score": s,
                    "wrapped": p.wrapped,
                }
            )
        grid = np.array(scores).reshape(len(depths), samples)
        acc[:, j] = grid.mean(axis=1)
        exact[:, j] = (grid == 1.0).mean(axis=1)
        by_length.append(
            {
                "length": length,
                "accuracy": float(grid.mean()),
                "exact": float((grid == 1.0).mean()),
                "prompts": len(probes),
                "seconds": seconds,
                "seconds_per_prompt": seconds / len(probes),
                "prompt_tokens_per_s": len(probes) * length / seconds if seconds > 0 else None,
            }
        )
        log(f"{task} {fmt_length(length)}: accuracy {grid.mean():.3f} over {len(probes)} prompts in {seconds:.1f}s")
    return {
        "eval": task,
        "lengths": lengths,
        "depths": depths,
        "samples": samples,
        "options": options,
        "haystack": haystack.source,
        "accuracy": acc.tolist(),
        "exact": exact.tolist(),
        "overall": float(np.nanmean(acc)),
        "by_length": by_length,
        "records": records,
    }


def table(result: dict) -> str:
    header = ["depth \\ length"] + [fmt_length(n) for n in result["lengths"]]
    rows = [[f"{100 * d:.0f}%"] + [f"{v:.2f}" for v in row] for d, row in zip(result["depths"], result["accuracy"])]
    rows.append(["mean"] + [f"{b['accuracy']:.2f}" for b in result["by_length"]])
    rows.append(["s / prompt"] + [f"{b['seconds_per_prompt']:.2f}" for b in result["by_length"]])
    return (
        f"{result['eval']} accuracy of {result.get('model', '?')} ({result['samples']} samples per cell; "
        f"overall {result['overall']:.3f})\n\n" + markdown_table(header, rows)
    )


def run_retrieval(
    cfg: RetrievalConfig,
    engine_overrides: dict | None = None,
    em: EvalModel | None = None,
    completer: Completer | None = None,
) -> dict:
    """`dsv41 eval passkey|niah|vartrack`: the grid through the engine (or `completer`), the table printed,
    TASK.json / TASK.md / TASK.png (the heat map) written into cfg.out."""
    cfg.validate()
    options = {"digits": cfg.digits}
    if cfg.task == "niah":
        options.update(keys=cfg.keys, queries=cfg.queries)
    elif cfg.task == "vartrack":
        options.update(hops=cfg.hops)
    depths = parse_depths(cfg.depths)
    engine_info = None
    if completer is None:
        em = prepare(cfg, em)
        tokenizer, model_cfg, name = em.tokenizer, em.cfg, em.name
    else:
        tokenizer, model_cfg, name = completer.tokenizer, em.cfg if em else None, em.name if em else "completer"
    held = held_out(em, cfg.data, cfg.text) if em is not None else None
    haystack = Haystack(
        tokenizer, held.tokens if held else None, held.source if held else "filler (the grass is green)"
    )
    if model_cfg is not None:  # room for the answer: the engine's context holds prompt and output together
        lengths = resolve_lengths(cfg.lengths, model_cfg, ANSWER_ROOM, cfg.extrapolate)
    else:
        lengths = parse_lengths(cfg.lengths or "1K")
    if completer is None:
        from dsv41.engine import LLMEngine

        # the longest prompt's answer budget sizes the engine (build one probe per task shape to measure it)
        probe = build_probe(cfg.task, tokenizer, haystack, lengths[-1], depths[0], 0, cfg.seed, **options)
        config = engine_config(
            engine_overrides or {},
            lengths[-1],
            2 * answer_budget(tokenizer, probe.answers) + 16,
            model_cfg,
            cfg.extrapolate,
        )
        completer = EngineCompleter(LLMEngine(em.model, tokenizer, config, model_name=name, seed=cfg.seed))
        engine_info = dataclasses.asdict(config)
    log(
        f"{cfg.task}: {name}, lengths {', '.join(fmt_length(n) for n in lengths)}, depths {depths}, "
        f"{cfg.samples} samples per cell, haystack {haystack.source}"
    )
    result = run_grid(completer, cfg.task, lengths, depths, cfg.samples, haystack, cfg.seed, **options)
    result.update(
        eval=cfg.output_name,
        task=cfg.task,
        model=name,
        engine=engine_info,
        seed=cfg.seed,
        index_topk=index_topk(em.model) if em is not None else None,
    )
    text = table(result)
    print(text)
    stem = cfg.output_name
    png = plot_heatmap(
        os.path.join(cfg.out, f"{stem}.png"),
        np.array(result["accuracy"]),
        [f"{100 * d:.0f}%" for d in depths],
        [fmt_length(n) for n in lengths],
        f"{name}: {stem} accuracy",
        "prompt length (tokens)",
        "needle depth",
    )
    result["files"] = {**write_outputs(cfg.out, stem, result, text), "png": png}
    return result
