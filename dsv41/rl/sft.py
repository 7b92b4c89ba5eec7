"""Supervised warm-start for RL with reasoning effort: chat samples whose answers the trainer learns
(`dsv41 train --task arithmetic`; training.md §8, spec-v41.md §10).

Each sample is a thinking-mode V4.1 prompt at a random reasoning effort b in 1..100 (the official effort
line at index 0), an arithmetic question, and a demonstration in one of two styles drawn independently of
b: `direct` (`</think>` then the answer) or `scratchpad` (digit-by-digit lines, then `</think>` and the
answer). So the warm-started model answers in either style at any effort, and reading the effort is left
for RL to teach. Targets are the reply and its EOS only (the prompt is IGNORE).

Two options shape what the warm start knows of the effort:
- `echo` (a fraction of the samples): the user asks "What is your reasoning effort?" and the reply is the
  effort, `{b}</think>{b}`. The model then learns to *read* its effort line at the position where a reply
  starts, the position where the arithmetic replies choose their style, without being told what to do
  with it. Without this, a model warm-started on styles independent of b has no use for the effort line
  and stops reading it: its first reply token was measured b-independent to the third decimal (mini, 500
  steps), so RL cannot make the style depend on b and moves every effort the same way.
- `effort_line`: every arithmetic reply opens its reasoning by stating its effort as three digits
  (`025\n`, `effort_line`), styles still independent of b. The style is then chosen a few tokens after
  the model wrote b itself, where it is plainly visible, instead of 90 tokens after the effort line of
  the prompt; RL still has to learn what the stated budget should mean (see docs/rl-effort.md for why
  this was tried at CPU scale: a warm start whose styles depended on b, P(scratchpad) from 0.8 to 0.2,
  left the first reply token b-independent after 150 steps; with the line, a weaker tie, 0.4 to 0.7,
  was not picked up in 100 steps either, while a strong one trained from step 0, `style_slope` -0.6, was:
  P(direct after the line) 0.35 / 0.47 / 0.67 / 0.77 at b = 25 / 50 / 75 / 100 after 500 steps).
- `effort_set` / `effort_set_share`: that share of the samples takes its effort from the set (RL's efforts)
  instead of uniformly from 1..100. Uniform draws give b = 100 1% of the samples, too few for a model to
  write its three-digit line (`100`) right.
- `style_slope`: P(scratchpad | b) = 0.5 + style_slope * (b - 50.5) / 99, clipped to [0, 1]; 0 (the
  default) keeps the styles independent of b, a negative slope makes long replies *less* likely at high
  effort (a prior that RL must reverse). The interface mirrors
`dsv41.vision.synthetic.SyntheticImageText`, so the trainer's batching, evaluation (teacher-forced
exact-reply accuracy per style) and checkpointing apply unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsv41.rl.tasks import STYLES, arithmetic_task, demonstration
from dsv41.tokenizer import THINK_END_TOKEN, ByteTokenizer

IGNORE = -100
SFT_TASKS = ("arithmetic",)
ECHO_QUESTION = "What is your reasoning effort?"


@dataclass
class TextSample:
    ids: list[int]  # prompt + reply + EOS
    answer_start: int
    task: str  # the reply's style
    answer: str


@dataclass
class TextBatch:
    """x, y [B, L] (y: next-token targets, IGNORE outside the replies); tasks: each row's style."""

    x: torch.Tensor
    y: torch.Tensor
    tasks: list[str]
    images: list | None = None


class EffortTaskText:
    """The warm-start set of one split ("train" or "val", drawn from the tasks' train / eval streams)."""

    def __init__(
        self,
        split: str,
        tokenizer: ByteTokenizer,
        task: str = "arithmetic",
        min_digits: int = 2,
        max_digits: int = 4,
        echo: float = 0.0,
        style_slope: float = 0.0,
        effort_line: bool = False,
        effort_set: tuple[int, ...] = (),
        effort_set_share: float = 0.0,
    ):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if task not in SFT_TASKS:
            raise ValueError(f"task must be one of {SFT_TASKS}, got {task!r}")
        if not 0.0 <= echo < 1.0:
            raise ValueError(f"echo must be a fraction in [0, 1), got {echo}")
        if not -1.0 <= style_slope <= 1.0:
            raise ValueError(f"style_slope must lie in [-1, 1], got {style_slope}")
        self.split, self.tokenizer, self.task = split, tokenizer, task
        self.min_digits, self.max_digits = min_digits, max_digits
        if not 0.0 <= effort_set_share <= 1.0:
            raise ValueError(f"effort_set_share must be a fraction in [0, 1], got {effort_set_share}")
        if effort_set_share and not effort_set:
            raise ValueError("effort_set_share > 0 needs a non-empty effort_set")
        if any(not 1 <= int(b) <= 100 for b in effort_set):
            raise ValueError(f"efforts must lie in 1..100, got {tuple(effort_set)}")
        self.echo, self.style_slope, self.effort_line = echo, style_slope, effort_line
        self.effort_set, self.effort_set_share = tuple(int(b) for b in effort_set), effort_set_share

    def scratchpad_probability(self, effort: int) -> float:
        return min(1.0, max(0.0, 0.5 + self.style_slope * (effort - 50.5) / 99))

    def sample(self, index: int, seed: int = 0) -> TextSample:
        from dsv41.rl.rollout import chat_prompt  # the RL prompt format, token for token

        rng = random.Random(f"dsv41-effort-sft:{self.split}:{seed}:{index}")
        effort, style = rng.randint(1, 100), rng.choice(STYLES)
        if self.effort_set_share and rng.random() < self.effort_set_share:  # drawn only then, as below
            effort = rng.choice(self.effort_set)
        if self.style_slope:  # drawn only then, so the default stream is the one earlier runs trained on
            style = "scratchpad" if rng.random() < self.scratchpad_probability(effort) else "direct"
        if self.echo and rng.random() < self.echo:
            prompt = chat_prompt(self.tokenizer, [{"role": "user", "content": ECHO_QUESTION}], effort)
            reply = self.tokenizer.encode(f"{effort}{THINK_END_TOKEN}{effort}", add_bos=False)
            return TextSample(prompt + reply + [self.tokenizer.eos_id], len(prompt), "echo", str(effort))
        task = arithmetic_task(
            "train" if self.split == "train" else "eval", seed, index, self.min_digits, self.max_digits
        )
        prompt = chat_prompt(self.tokenizer, task.messages(), effort)
        reply = self.tokenizer.encode(demonstration(task, style, effort if self.effort_line else None), add_bos=False)
        reply += [self.tokenizer.eos_id]
        return TextSample(prompt + reply, len(prompt), style, task.answer)

    def collate(self, samples: list[TextSample], max_len: int | None = None) -> TextBatch:
        length = max(len(s.ids) for s in samples) - 1
        if max_len is not None and length > max_len:
            raise ValueError(f"a sample needs {length} positions, more than seq_len {max_len}")
        x = torch.full((len(samples), length), self.tokenizer.pad_id, dtype=torch.long)
        y = torch.full((len(samples), length), IGNORE, dtype=torch.long)
        for row, s in enumerate(samples):
            ids = torch.tensor(s.ids)
            x[row, : len(ids) - 1] = ids[:-1]
            y[row, s.answer_start - 1 : len(ids) - 1] = ids[s.answer_start :]
        return TextBatch(x, y, [s.task for s in samples], [])

    def batch(
        self,
        index: int,
        batch_size: int,
        seq_len: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> TextBatch:
        first = (index * world_size + rank) * batch_size
        return self.collate([self.sample(first + j, seed) for j in range(batch_size)], seq_len)

    def sequential_batches(
        self, batch_size: int, seq_len: int | None, n_batches: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[TextBatch]:
        for i in range(n_batches):
            yield self.batch(i, batch_size, seq_len, 0, rank, world_size)
