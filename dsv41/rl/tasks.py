"""Verifiable tasks for RL with reasoning effort, their demonstrations and their graders (training.md §8,
spec-v41.md §10-§11).

Two families, generated from (split, seed, index) alone, so train and held-out sets are disjoint and any
sample can be rebuilt:

- `arithmetic`: "What is 4837 + 2958?". A response is `{reasoning}</think>{answer}`. Partial credit: the
  fraction of the true answer's digits that the response gets right, aligned from the last digit (0 for
  a longer number; 1.0 exactly when the answer is right). Demonstrations come in two styles: `direct`
  (no reasoning) and `scratchpad` (one line per digit position, least significant first, with its carry),
  which is longer and, for a small model, more often right: what reasoning effort has to trade.
- `program`: "Write a Python function f(x) that ...", graded by running the response's code against test
  statements in the sandbox (`dsv41.rl.sandbox.grade_programs`); partial credit = fraction of tests passed.
  Its reference solution (`Task.answer`) decides whether an int answer equals a float one (grading.py).

Tasks from public sets are first-class kinds too, built from their records rather than generated:
`humaneval` (`humaneval_task`: a prompt, a `def check(candidate)` test and an entry point; all or nothing,
as HumanEval scores it) and `stdio` (`stdio_task`: MBPP/APPS-style programs that read stdin and print, one
sandbox run per (input, expected output) case, partial credit per case).

Grading: `grade_responses(tasks, texts, pool)` grades each response. An arithmetic answer is graded in the
sandbox too when a pool is given (one test per digit position, the same score as `arithmetic_grade`), so
every reward of a run can come from the orchestrator; without a pool it is computed in-process.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsv41.tokenizer import THINK_END_TOKEN

SPLITS = ("train", "eval")
STYLES = ("direct", "scratchpad")


KINDS = ("arithmetic", "program", "humaneval", "stdio")


@dataclass(frozen=True)
class Task:
    kind: str  # one of KINDS
    uid: str  # split:seed:index for generated tasks; the record's id for the others
    question: str  # the user message
    answer: str = ""  # arithmetic: the number; program, humaneval: a reference solution ("" if none)
    tests: tuple[str, ...] = field(default_factory=tuple)  # program, humaneval: test statements
    operands: tuple[int, ...] = field(default_factory=tuple)
    prompt: str = ""  # humaneval: the code the completion continues (imports, signature, docstring)
    entry_point: str = ""  # humaneval: the function the check is called on
    cases: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # stdio: (stdin, expected stdout)

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.question}]


def _rng(split: str, seed: int, index: int, kind: str) -> random.Random:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return random.Random(f"{kind}:{split}:{seed}:{index}")


def arithmetic_task(split: str, seed: int, index: int, min_digits: int = 2, max_digits: int = 4) -> Task:
    """An addition of two numbers of min_digits..max_digits digits. The eval split draws from a disjoint
    stream (another rng key); a pair repeated across splits by chance is possible but rare."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    rng = _rng(split, seed, index, "arithmetic")
    a, b = (rng.randint(10 ** (n - 1), 10**n - 1) for n in (rng.randint(min_digits, max_digits) for _ in range(2)))
    return Task("arithmetic", f"{split}:{seed}:{index}", f"What is {a} + {b}?", str(a + b), operands=(a, b))


def scratchpad(a: int, b: int) -> str:
    """Digit-by-digit addition, least significant first: '7+8=15 c1' lines, then the answer follows."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, lines = 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total}" if carry else f"{x}+{y}={total}")
        carry = total // 10
    return "\n".join(lines)


def effort_line(effort: int) -> str:
    """The budget line a reply may open its reasoning with: the effort as three digits and a newline
    ('025\n'), the same number of tokens at every effort, so it adds no length that depends on b."""
    if not 1 <= int(effort) <= 100:
        raise ValueError(f"reasoning effort must lie in 1..100, got {effort}")
    return f"{int(effort):03d}\n"


def demonstration(task: Task, style: str, effort: int | None = None) -> str:
    """The assistant's reply after the `<think>` header: [the effort line,] reasoning, `</think>`, the answer."""
    if task.kind != "arithmetic":
        raise ValueError("demonstrations exist for arithmetic tasks only")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    reasoning = scratchpad(*task.operands) if style == "scratchpad" else ""
    budget = effort_line(effort) if effort is not None else ""
    return f"{budget}{reasoning}{THINK_END_TOKEN}{task.answer}"


def final_answer(text: str) -> str | None:
    """The content after the reasoning (`</think>`), or None when the response never closed it."""
    if THINK_END_TOKEN not in text:
        return None
    return text.split(THINK_END_TOKEN, 1)[1].strip()


EFFORT_LINE = re.compile(r"\d{3}\n")


def reasons(text: str) -> bool:
    """Whether a response wrote any reasoning before `</think>`, not counting an opening effort line
    (`effort_line`); a response that never closed the block reasons by definition: all of it is reasoning."""
    thought = text.split(THINK_END_TOKEN, 1)[0]
    line = EFFORT_LINE.match(thought)
    if THINK_END_TOKEN in text and line:
        thought = thought[line.end() :]
    return thought.strip() != ""


def arithmetic_grade(answer: str, text: str) -> float:
    """Fraction of the answer's digit positions (aligned from the last digit) that the response's leading
    integer gets right; 0 for an answer with more digits than the true one, without a closed reasoning
    block or without a number."""
    content = final_answer(text)
    m = re.match(r"-?\d+", content or "")
    got = m.group(0) if m else ""
    if len(got) > len(answer):
        return 0.0
    return sum(1 for i in range(1, len(got) + 1) if got[-i] == answer[-i]) / len(answer)


def arithmetic_tests(answer: str) -> list[str]:
    """The sandbox's version of `arithmetic_grade`: one test per digit position of the longer number, on
    ANSWER (the response's leading integer as a string, '' when there is none)."""
    tests = []
    for i in range(1, len(answer) + 1):
        tests.append(f"len(ANSWER) <= {len(answer)} and len(ANSWER) >= {i} and ANSWER[-{i}] == {answer[-i]!r}")
    return tests


PROGRAMS = (  # (description, reference, test inputs)
    ("returns x squared plus {c}", "x * x + {c}", (0, 1, 2, -3, 7)),
    ("returns {c} times x minus 1", "{c} * x - 1", (0, 1, 5, -2)),
    (
        "returns the sum of the digits of the non-negative integer x, plus {c}",
        "sum(map(int, str(x))) + {c}",
        (0, 7, 123, 4096),
    ),
    ("returns True when x is divisible by {c}, else False", "x % {c} == 0", (0, 1, 12, 35, 42)),
)


def program_task(split: str, seed: int, index: int) -> Task:
    """'Write a Python function f(x) that ...' with test statements computed from a reference."""
    rng = _rng(split, seed, index, "program")
    description, reference, inputs = PROGRAMS[rng.randrange(len(PROGRAMS))]
    c = rng.randint(2, 9)
    expr = reference.format(c=c)
    tests = tuple(f"f({x}) == {eval(expr, {}, {'x': x})!r}" for x in inputs)  # noqa: S307 - our own expression
    question = f"Write a Python function f(x) that {description.format(c=c)}. Reply with the code only."
    return Task("program", f"{split}:{seed}:{index}", question, answer=f"def f(x):\n    return {expr}\n", tests=tests)


def humaneval_task(uid: str, prompt: str, check: str, entry_point: str, reference: str = "") -> Task:
    """A HumanEval record as a task: the tests are its `check` source followed by `check(entry_point)`, one
    test, so the score is 1 or 0 as HumanEval's pass@1 counts it (two tests would give every solution
    0.5 for the definition of check alone)."""
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python name, got {entry_point!r}")
    question = f"Complete this Python function. Reply with the code only.\n\n{prompt}"
    test = f"{check.rstrip()}\n\ncheck({entry_point})\n"
    return Task("humaneval", uid, question, answer=reference, tests=(test,), prompt=prompt, entry_point=entry_point)


def stdio_task(uid: str, question: str, cases: Sequence[tuple[str, str]]) -> Task:
    """An MBPP/APPS-style task: a program that reads stdin and prints, with (input, expected output) cases."""
    cases = tuple((str(i), str(o)) for i, o in cases)
    if not cases:
        raise ValueError("a stdio task needs at least one (input, expected output) case")
    return Task("stdio", uid, question, cases=cases)


def make_task(kind: str, split: str, seed: int, index: int, **options) -> Task:
    if kind == "arithmetic":
        return arithmetic_task(split, seed, index, **options)
    if kind == "program":
        return program_task(split, seed, index)
    raise ValueError(f"unknown task kind {kind!r}; choose 'arithmetic' or 'program'")


def solution_code(text: str) -> str:
    """The code of a program response: after `</think>` if present, inside a ``` fence if there is one."""
    content = final_answer(text)
    content = text if content is None else content
    fence = re.search(r"```(?:python)?\n(.*?)```", content, re.S)
    return fence.group(1) if fence else content


def humaneval_program(task: Task, text: str) -> str:
    """The program a HumanEval response stands for: the prompt, then the response's code. A response that
    defines the entry point (a whole function) follows the prompt as a new statement and replaces its
    docstring-only function, keeping the prompt's imports and helpers; any other continues the prompt's
    body (a completion)."""
    # As solution_code, but the first line keeps its indentation: a completion starts inside the body.
    content = text.split(THINK_END_TOKEN, 1)[1] if THINK_END_TOKEN in text else text
    fence = re.search(r"```(?:python)?\n(.*?)```", content, re.S)
    code = fence.group(1) if fence else content.lstrip("\n").rstrip() + "\n"
    if re.search(rf"^\s*(async\s+)?def\s+{re.escape(task.entry_point)}\s*\(", code, re.M):
        program = task.prompt.rstrip() + "\n\n\n" + code
        try:
            ast.parse(program)  # parsed, never run, here: a prompt ending in a bare signature does not
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return code
        return program
    return task.prompt + code


def grade_responses(tasks: Sequence[Task], texts: Sequence[str], pool=None, cache=None) -> list[float]:
    """Grades in [0, 1] of each response. Program, humaneval and stdio tasks need a sandbox pool
    (`SandboxPool` or `RaySandboxPool`); arithmetic ones go through it too when one is given. `cache`: a
    `sandbox.GradingCache` kept across calls saves the runs that depend on the tasks alone."""
    from dsv41.rl import sandbox  # the sandbox module has no torch dependency; imported only when grading

    if len(tasks) != len(texts):
        raise ValueError(f"{len(tasks)} tasks, {len(texts)} responses")
    grades: list[float | None] = [None] * len(tasks)
    items, where = [], []
    stdio, stdio_where = [], []
    for i, (task, text) in enumerate(zip(tasks, texts)):
        if task.kind in ("program", "humaneval", "stdio") and pool is None:
            raise ValueError(f"{task.kind} tasks are graded by running code: give a sandbox pool")
        if task.kind == "arithmetic" and pool is None:
            grades[i] = arithmetic_grade(task.answer, text)
        elif task.kind == "arithmetic":
            content = final_answer(text)
            m = re.match(r"-?\d+", content or "")
            items.append((f"ANSWER = {(m.group(0) if m else '')!r}", arithmetic_tests(task.answer)))
            where.append(i)
        elif task.kind == "program":
            items.append((solution_code(text), list(task.tests), task.answer or None))
            where.append(i)
        elif task.kind == "humaneval":
            items.append((humaneval_program(task, text), list(task.tests), task.answer or None))
            where.append(i)
        elif task.kind == "stdio":
            stdio.append((solution_code(text), list(task.cases)))
            stdio_where.append(i)
        else:
            raise ValueError(f"unknown task kind {task.kind!r}")
    if items:
        for i, (score, _) in zip(where, sandbox.grade_programs(items, pool, cache=cache)):
            grades[i] = score
    if stdio:
        for i, score in zip(stdio_where, sandbox.grade_stdio_programs(stdio, pool)):
            grades[i] = score
    return [float(g) for g in grades]
