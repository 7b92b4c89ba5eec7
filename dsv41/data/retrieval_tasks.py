"""Long-context training data that teaches retrieval (issue 33 item 1): synthetic tasks rendered on demand
from (split, seed, index), with answer-only targets, mixed with ordinary text (`dsv41 train --mix retrieval`).

Why: in V4.1 a fact beyond the sliding window reaches a query only through the compressed cache and the
indexer's top-k (spec-v41.md §3, §4), and the indexer learns only from its KL to the attention (spec §7,
training.md §4). Plain text rarely makes a far token necessary, so nothing pushes that path to carry a
fact; these tasks make the answer depend on one far span and nothing else.

Tasks (the prompt wording is the `dsv41 eval` harness's, dsv41.eval.retrieval, so a model trained here is
measured on the format it learned; a test checks the two stay equal):
- passkey (Mohtashami & Jaggi 2023): "The pass key is K. Remember it. K is the pass key." in filler,
  answer K (3-7 digits).
- niah (RULER): 1-4 needles "One of the special magic numbers for WORD-WORD is: V."; the question asks
  for one of them (the others distract), answer its V (7 digits).
- vartrack (RULER): "VAR X1 = V." then 1-4 hops "VAR X2 = VAR X1." in order; answer every name.
- mqar (Zoology's multi-query associative recall): 4-16 pairs " KEY is VAL." spread through the filler,
  then "Recall:" and up to 8 queries " KEY is" each followed by its trained VAL, so one sample carries
  many answer targets (the densest signal for the copy-from-far mechanism the other tasks need).

Only the answer tokens (and the EOS after the last one) are trained; the prompt and filler targets are
IGNORE (-100). Filler is the harness's "The grass is green. ..." noise or a window of the split's own
text shard, the needles at uniformly drawn depths.

Held-out split by construction: every drawn value, key word pair, variable name and MQAR key is kept
only if `split_of(string)` (a hash of the string) names this split, so no answer or key of "val" can
occur in "train" (tests check it), and the text filler comes from the matching shard (`train.bin` or
`val.bin`, whose documents are split by hash, dsv41.data.shards). The random numbers are seeded by the
string (split, seed, index, row), so a sample is the same on every run and machine.

Lengths: all rows of a batch share one length L (no padding), drawn uniformly from [min_len, cap] in
steps of 8, where cap grows linearly from min_len to seq_len over `curriculum` batches (curriculum over
length) and is seq_len after. A batch is ordinary text (TokenDataset windows, every target trained) with
probability `text_fraction`, decided per batch so that the mean loss of a retrieval batch is the answers'
alone and is not drowned by the text's many targets.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100  # untrained targets (F.cross_entropy's default ignore_index)
SPLITS = ("train", "val")
TASKS = ("passkey", "niah", "vartrack", "mqar")
DEFAULT_WEIGHTS = {"passkey": 0.25, "niah": 0.25, "vartrack": 0.15, "mqar": 0.35}

# The harness's wording (dsv41.eval.retrieval; tests/data_pipeline/test_retrieval_tasks.py keeps them equal)
PASSKEY_PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
NIAH_PREFIX = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n"
)
VARTRACK_PREFIX = "Memorize and track the chain of variable assignments hidden in the following text.\n"
MQAR_PREFIX = "Memorize the value of every key hidden in the following text.\n"
GRASS_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
ADJECTIVES = (
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "kind",
    "lively",
    "merry",
    "noisy",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tidy",
    "upbeat",
    "vivid",
    "wise",
    "young",
    "zesty",
    "bitter",
    "clever",
    "damp",
    "faint",
    "golden",
)
NOUNS = (
    "apple",
    "badger",
    "candle",
    "dragon",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pepper",
    "quarry",
    "river",
    "saddle",
    "tunnel",
    "violin",
    "wagon",
    "willow",
    "yacht",
    "zebra",
    "basket",
    "copper",
    "desert",
    "forest",
    "glacier",
)
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MQAR_PAIR_CAPS = (16, 12, 8, 6, 4)  # an mqar sample's most pairs, tried in turn until it fits the length
MQAR_MIN_PAIRS = MQAR_PAIR_CAPS[-1]


def split_of(text: str) -> str:
    """The split a drawn string belongs to: the low bit of sha256's first byte (a fixed, even partition)."""
    return SPLITS[hashlib.sha256(f"dsv41-retrieval/{text}".encode()).digest()[0] & 1]


def _draw(rng: random.Random, split: str, make, avoid: Sequence[str] = ()) -> str:
    """Draw strings with `make(rng)` until one belongs to `split` and is not in `avoid`."""
    for _ in range(10_000):
        s = make(rng)
        if s not in avoid and split_of(s) == split:
            return s
    raise RuntimeError(f"could not draw a fresh {split} string (avoid has {len(avoid)} entries)")


def _number(digits: int):
    return lambda rng: str(rng.randrange(10 ** (digits - 1), 10**digits))


def _name(letters: int):
    return lambda rng: "".join(rng.choice(LETTERS) for _ in range(letters))


@dataclass
class Segment:
    """Text after the filler: the question, then alternating prompt text and trained answers."""

    text: str
    trained: bool


@dataclass
class TaskSpec:
    prefix: str
    needles: list[str]  # each goes at a uniformly drawn depth of the filler (in order for vartrack)
    ordered: bool  # needles keep their order (vartrack's chain)
    tail: list[Segment]


def task_spec(task: str, rng: random.Random, split: str, max_pairs: int = 16) -> TaskSpec:
    """The text of one sample of `task` whose values, keys and names all belong to `split` (mqar: 4 to
    `max_pairs` key-value pairs)."""
    if task == "passkey":
        key = _draw(rng, split, _number(rng.choice((3, 4, 5, 5, 5, 6, 7))))
        return TaskSpec(
            PASSKEY_PREFIX,
            [f" The pass key is {key}. Remember it. {key} is the pass key."],
            False,
            [Segment("\nWhat is the pass key? The pass key is", False), Segment(f" {key}.", True)],
        )
    if task == "niah":
        keys = rng.choice((1, 1, 2, 3, 4))
        pairs = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS if split_of(f"{a}-{n}") == split]
        names = rng.sample(pairs, keys)
        values: list[str] = []
        for _ in names:
            values.append(_draw(rng, split, _number(7), values))
        needles = [f" One of the special magic numbers for {k} is: {v}." for k, v in zip(names, values)]
        asked = rng.randrange(keys)
        q = names[asked]
        return TaskSpec(
            NIAH_PREFIX,
            needles,
            False,
            [
                Segment(
                    f"\nWhat is the special magic number for {q} mentioned in the provided text? "
                    f"The special magic number for {q} mentioned in the provided text is",
                    False,
                ),
                Segment(f" {values[asked]}.", True),
            ],
        )
    if task == "vartrack":
        hops = rng.choice((1, 2, 3, 4, 4))
        names = []
        for _ in range(hops + 1):
            names.append(_draw(rng, split, _name(5), names + ["VAR"]))
        value = _draw(rng, split, _number(5))
        needles = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
        question = (
            f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
            f"Answer: According to the chain of variable assignments in the text above, {hops + 1} "
            f"variables are assigned the value {value}, they are:"
        )
        return TaskSpec(
            VARTRACK_PREFIX, needles, True, [Segment(question, False), Segment(" " + ", ".join(names) + ".", True)]
        )
    if task == "mqar":
        n = rng.randint(4, max(4, max_pairs))
        keys: list[str] = []
        values = []
        for _ in range(n):
            keys.append(_draw(rng, split, _name(4), keys))
            values.append(_draw(rng, split, _number(3)))
        needles = [f" {k} is {v}." for k, v in zip(keys, values)]
        tail = [Segment("\nRecall:", False)]
        for i in rng.sample(range(n), min(n, 8)):
            tail += [Segment(f" {keys[i]} is", False), Segment(f" {values[i]}.", True)]
        return TaskSpec(MQAR_PREFIX, needles, False, tail)
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


@dataclass
class Sample:
    """ids: exactly the rendered length; trained[i]: ids[i] is an answer token (a target)."""

    ids: list[int]
    trained: list[bool]
    task: str
    answers: list[str]


@dataclass
class RetrievalBatch:
    """x, y [B, L] int64 (y: next-token targets, IGNORE outside the answers); images: always None (the
    trainer's batch interface, as dsv41.vision.synthetic.ImageTextBatch); tasks: each row's task."""

    x: torch.Tensor
    y: torch.Tensor
    images: list | None
    tasks: list[str]


class RetrievalTasks:
    """Renders samples of one split with `tokenizer` (the model's), filler from `text` (a token array of
    the same split, or None for the grass noise only)."""

    def __init__(self, tokenizer, split: str, text: np.ndarray | None = None, weights: dict | None = None):
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        unknown = set(weights) - set(TASKS)
        if unknown or not weights or min(weights.values()) < 0 or sum(weights.values()) <= 0:
            raise ValueError(f"weights: non-negative weights over {TASKS}, got {weights!r}")
        self.tokenizer, self.split, self.weights = tokenizer, split, weights
        specials = set(getattr(tokenizer, "special_ids", ()) or ()) | {tokenizer.bos_id, tokenizer.eos_id}
        if text is not None:
            text = np.asarray(text, dtype=np.int64)
            text = text[~np.isin(text, list(specials))]  # no document markers inside a prompt
            if text.size < 64:
                text = None
        self.text = text
        pieces = [self._enc(" " + s) for s in GRASS_FILLER]
        self.grass = np.array([t for p in pieces for t in p], dtype=np.int64)  # [cycle]
        self._min: dict[str, int] = {}  # task -> min_length (a per-instance cache of a pure function)

    def _enc(self, s: str) -> list[int]:
        return self.tokenizer.encode(s, add_bos=False)

    def _filler(self, n: int, rng: random.Random) -> np.ndarray:
        """n filler tokens: the grass cycle from a random phase, or a window of the split's text."""
        if self.text is None or rng.random() < 0.5:
            phase = rng.randrange(self.grass.size)
            return np.resize(np.roll(self.grass, -phase), n)
        start = rng.randrange(max(self.text.size - n, 0) + 1)
        return np.resize(self.text[start : start + n], n)

    def _fixed(self, spec: TaskSpec) -> int:
        """Tokens of a spec's non-filler text (BOS, instruction, needles, tail, EOS)."""
        return (
            2
            + len(self._enc(spec.prefix))
            + sum(len(self._enc(n)) for n in spec.needles)
            + sum(len(self._enc(s.text)) for s in spec.tail)
        )

    def min_length(self, task: str) -> int:
        """A length the samples of `task` fit: the longest of 64 fixed draws with this tokenizer plus 16
        filler tokens (a rarer, longer draw falls back to passkey in `sample`)."""
        if task not in self._min:  # (mqar at its fewest pairs: `render` fits the pairs to the length)
            need = max(
                self._fixed(task_spec(task, random.Random(f"dsv41-min:{i}"), self.split, max_pairs=MQAR_MIN_PAIRS))
                for i in range(64)
            )
            self._min[task] = need + 16
        return self._min[task]

    def render(self, task: str, length: int, rng: random.Random) -> Sample:
        """One sample of exactly `length` tokens: BOS, instruction, filler with the needles, the question,
        the answers and EOS. Raises ValueError when the sample's fixed text does not fit. An mqar sample
        that does not fit is redrawn with fewer pairs (16, 12, 8, 6, 4 at most), so short lengths get
        short lists rather than none (a draw that fitted before draws the same)."""
        if task == "mqar":
            state = rng.getstate()
            for cap in MQAR_PAIR_CAPS:
                rng.setstate(state)
                try:
                    return self._render(task_spec(task, rng, self.split, max_pairs=cap), task, length, rng)
                except ValueError:
                    if cap == MQAR_PAIR_CAPS[-1]:
                        raise
        return self._render(task_spec(task, rng, self.split), task, length, rng)

    def _render(self, spec: TaskSpec, task: str, length: int, rng: random.Random) -> Sample:
        prefix = [self.tokenizer.bos_id] + self._enc(spec.prefix)
        needles = [self._enc(n) for n in spec.needles]
        tail = [(self._enc(s.text), s.trained) for s in spec.tail]
        fixed = len(prefix) + sum(map(len, needles)) + sum(len(t) for t, _ in tail) + 1  # + EOS
        budget = length - fixed
        if budget < 1:
            raise ValueError(f"{task}: {length} tokens is too short for this sample ({fixed} fixed tokens)")
        filler = self._filler(budget, rng)
        at = [rng.randint(0, budget) for _ in needles]
        order = sorted(range(len(needles)), key=lambda i: (at[i], i))
        if spec.ordered:  # the chain's assignments in order of definition
            at, order = sorted(at), list(range(len(needles)))
        ids, cursor = list(prefix), 0
        for i in order:
            ids += filler[cursor : at[i]].tolist()
            cursor = at[i]
            ids += needles[i]
        ids += filler[cursor:].tolist()
        trained = [False] * len(ids)
        answers = []
        for toks, is_answer in tail:
            ids += toks
            trained += [is_answer] * len(toks)
            if is_answer:
                answers.append(self.tokenizer.decode(toks).strip(" ."))
        ids.append(self.tokenizer.eos_id)
        trained.append(True)
        assert len(ids) == length, (len(ids), length)
        return Sample(ids, trained, task, answers)

    def sample(self, length: int, index: int, seed: int = 0, row: int = 0) -> Sample:
        """Sample `row` of batch `index`: its task drawn by the weights among those that fit `length`."""
        rng = random.Random(f"dsv41-retrieval:{self.split}:{seed}:{index}:{row}")  # sha512 of the string
        fits = [t for t in TASKS if self.weights.get(t, 0) > 0 and self.min_length(t) <= length]
        if not fits:
            raise ValueError(
                f"no task fits {length} tokens (the shortest needs {min(self.min_length(t) for t in self.weights)})"
            )
        task = rng.choices(fits, weights=[self.weights[t] for t in fits])[0]
        try:
            return self.render(task, length, rng)
        except ValueError:
            if task == "passkey" or self.min_length("passkey") > length:
                raise
            return self.render("passkey", length, rng)  # a rare draw longer than min_length allows


def collate(samples: list[Sample]) -> RetrievalBatch:
    """Rows of equal length n -> x = ids[:-1], y = ids[1:] where trained, else IGNORE ([B, n - 1])."""
    ids = torch.tensor([s.ids for s in samples], dtype=torch.long)  # [B, n]
    mask = torch.tensor([s.trained for s in samples], dtype=torch.bool)  # [B, n]
    y = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))  # [B, n - 1]
    return RetrievalBatch(ids[:, :-1], y, None, [s.task for s in samples])


class RetrievalMix:
    """`dsv41 train --mix retrieval`: retrieval batches and text batches of one split, with the trainer's
    batch interface (`batch`, `sequential_batches`, as TokenDataset and SyntheticImageText)."""

    def __init__(
        self,
        text_set,
        tokenizer,
        split: str,
        text_fraction: float = 0.25,
        min_len: int = 128,
        curriculum: int = 0,
        weights: dict | None = None,
    ):
        if not 0 <= text_fraction < 1:
            raise ValueError(f"text_fraction must lie in [0, 1), got {text_fraction}")
        if curriculum < 0:
            raise ValueError(f"curriculum must be >= 0 batches, got {curriculum}")
        self.text_set, self.text_fraction = text_set, text_fraction
        self.min_len, self.curriculum = min_len, curriculum
        tokens = np.asarray(text_set.tokens) if text_set is not None and hasattr(text_set, "tokens") else None
        self.tasks = RetrievalTasks(tokenizer, split, tokens, weights)
        self.tokenizer, self.split = tokenizer, split
        shortest = min(self.tasks.min_length(t) for t, w in self.tasks.weights.items() if w > 0)
        self.min_len = max(min_len, shortest)  # below it no task fits

    def length_cap(self, index: int, seq_len: int) -> int:
        """The longest retrieval batch at batch `index`: min_len growing linearly to seq_len."""
        if self.curriculum <= 0 or index >= self.curriculum:
            return seq_len
        return int(self.min_len + (seq_len - self.min_len) * index / self.curriculum)

    def is_text(self, index: int, seed: int) -> bool:
        return random.Random(f"dsv41-mix:{self.split}:{seed}:{index}").random() < self.text_fraction

    def retrieval_batch(
        self, index: int, batch_size: int, length: int, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> RetrievalBatch:
        """Batch `index` of rows of `length` input tokens (each rendered with one more, the last target)."""
        first = (index * world_size + rank) * batch_size
        return collate([self.tasks.sample(length + 1, index, seed, first + j) for j in range(batch_size)])

    def batch(self, index: int, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        if seq_len < self.min_len:
            raise ValueError(f"--seq-len {seq_len} is below the mix's shortest length {self.min_len}")
        if self.text_set is not None and self.is_text(index, seed):
            return self.text_set.batch(index, batch_size, seq_len, seed, rank=rank, world_size=world_size)
        rng = random.Random(f"dsv41-length:{self.split}:{seed}:{index}")
        cap = self.length_cap(index, seq_len)
        length = min(seq_len, self.min_len + 8 * rng.randint(0, max(cap - self.min_len, 0) // 8))
        return self.retrieval_batch(index, batch_size, length, seed, rank, world_size)

    def sequential_batches(
        self, batch_size: int, seq_len: int, n_batches: int, rank: int = 0, world_size: int = 1
    ) -> Iterator:
        """Held-out batches, the same at every evaluation: text windows in order for a quarter of them
        (at least one when there is text), retrieval batches at the full seq_len for the rest."""
        n_text = 0 if self.text_set is None else max(1, n_batches // 4)
        if n_text:
            yield from self.text_set.sequential_batches(batch_size, seq_len, n_text, rank=rank, world_size=world_size)
        for i in range(n_batches - n_text):
            yield self.retrieval_batch(i, batch_size, seq_len, 0, rank, world_size)
