"""How much a model's choice of reply style depends on its reasoning effort b (spec-v41.md §10; training.md §8).

A reply to an arithmetic task either reasons (a scratchpad) before `</think>` or closes the block at once
and answers directly. With the effort line (`dsv41.rl.tasks.effort_line`) that choice is one token: the
one after the line. `direct_probabilities` reads P(`</think>` next) there, for every effort, averaged
over held-out tasks: a flat row means the model's style ignores b (the first thing graded GRPO with an
effort-dependent length penalty has to change), a row rising with b means long replies get likelier at
low effort. It is the exact probability under the model, not a sampled share, so small differences show
without sampling noise. docs/rl-effort.md uses it to judge warm starts and RL checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv41.rl.rollout import chat_prompt
from dsv41.rl.tasks import arithmetic_task, effort_line
from dsv41.tokenizer import THINK_END_TOKEN


def choice_prompt(tokenizer, task, effort: int, with_line: bool = True) -> list[int]:
    """The token ids right before the style choice: the chat prompt at `effort` (ending `<think>`), then
    the reply's effort line when the model was trained to write one."""
    ids = chat_prompt(tokenizer, task.messages(), effort)
    if with_line:
        ids = ids + tokenizer.encode(effort_line(effort), add_bos=False)
    return ids


@torch.no_grad()
def direct_probabilities(
    model,
    tokenizer,
    efforts: Sequence[int] = (1, 25, 50, 75, 100),
    prompts: int = 16,
    min_digits: int = 2,
    max_digits: int = 2,
    seed: int = 0,
    first: int = 1000,
    with_line: bool = True,
) -> dict[int, float]:
    """{b: mean over `prompts` held-out tasks (eval split, indices first..first+prompts-1) of
    P(`</think>` | prompt at effort b [+ effort line])}. The model runs one prompt at a time in eval mode."""
    if prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {prompts}")
    if any(not 1 <= int(b) <= 100 for b in efforts):
        raise ValueError(f"efforts must lie in 1..100, got {tuple(efforts)}")
    end = tokenizer.encode(THINK_END_TOKEN, add_bos=False)
    if len(end) != 1:
        raise ValueError(f"the tokenizer must encode {THINK_END_TOKEN} as one token, got {end}")
    tasks = [arithmetic_task("eval", seed, first + i, min_digits, max_digits) for i in range(prompts)]
    was_training = model.training
    model.eval()
    out = {}
    try:
        for b in efforts:
            total = 0.0
            for task in tasks:
                ids = torch.tensor([choice_prompt(tokenizer, task, int(b), with_line)])  # [1, T]
                logits = model(ids, last_only=True)[0, -1].float()  # [V]
                total += float(torch.softmax(logits, -1)[end[0]])
            out[int(b)] = total / prompts
    finally:
        model.train(was_training)
    return out
