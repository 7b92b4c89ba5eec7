"""Verifiable tasks: generation, demonstrations, grading in-process and in the sandbox (the same grades)."""

import random

import pytest

from dsv41.rl.sandbox import SandboxPool
from dsv41.rl.tasks import (
    arithmetic_grade,
    arithmetic_task,
    demonstration,
    effort_line,
    final_answer,
    grade_responses,
    program_task,
    reasons,
    scratchpad,
)


def test_tasks_are_reproducible_and_the_splits_differ():
    a = [arithmetic_task("train", 0, i) for i in range(50)]
    assert a == [arithmetic_task("train", 0, i) for i in range(50)]
    held = {arithmetic_task("eval", 0, i).operands for i in range(50)}
    assert len(held & {t.operands for t in a}) <= 2
    for t in a:
        x, y = t.operands
        assert t.answer == str(x + y) and 10 <= x < 10_000 and 10 <= y < 10_000
    with pytest.raises(ValueError, match="split"):
        arithmetic_task("test", 0, 0)


def test_scratchpad_is_a_correct_digit_by_digit_addition():
    rng = random.Random(0)
    for _ in range(200):
        x, y = rng.randrange(1, 10_000), rng.randrange(1, 10_000)
        lines = scratchpad(x, y).split("\n")
        digits, carry = [], 0
        for line in lines:  # re-add each line independently of how it was written
            left, total = line.split("=")
            terms = [int(v) for v in left.split("+")]
            assert sum(terms) == int(total)
            assert terms[-1] == carry or (carry == 0 and len(terms) == 2)
            digits.append(int(total) % 10)
            carry = int(total) // 10
        value = int("".join(map(str, reversed(digits)))) + carry * 10 ** len(digits)
        assert value == x + y


def test_demonstrations_grade_one_and_wrong_answers_get_partial_credit():
    t = arithmetic_task("train", 0, 3)
    for style in ("direct", "scratchpad"):
        assert arithmetic_grade(t.answer, demonstration(t, style)) == 1.0
    ans = "1234"
    assert arithmetic_grade(ans, "</think>1284") == 0.75
    assert arithmetic_grade(ans, "</think>234") == 0.75  # aligned from the last digit
    assert arithmetic_grade(ans, "</think>12345") == 0.0  # too long
    assert arithmetic_grade(ans, "1234") == 0.0  # the reasoning never closed
    assert arithmetic_grade(ans, "</think> no number") == 0.0
    assert final_answer("a</think> 12 ") == "12"


def test_a_response_reasons_when_it_writes_before_closing_the_block():
    t = arithmetic_task("train", 0, 5)
    assert not reasons(demonstration(t, "direct"))
    assert reasons(demonstration(t, "scratchpad"))
    assert not reasons(" \n</think>12")  # whitespace is not reasoning
    assert reasons("7+8=15")  # never closed: all of it is reasoning
    assert reasons("x</think>")
    # an opening effort line is a budget, not reasoning
    assert effort_line(25) == "025\n" and effort_line(100) == "100\n"
    assert not reasons(demonstration(t, "direct", 25)) and reasons(demonstration(t, "scratchpad", 100))
    assert arithmetic_grade(t.answer, demonstration(t, "direct", 7)) == 1.0
    assert reasons("025\n")  # never closed
    with pytest.raises(ValueError):
        effort_line(0)


def test_sandbox_grades_equal_local_grades_and_programs_run_their_tests():
    rng = random.Random(1)
    tasks = [arithmetic_task("train", 1, i) for i in range(12)]
    texts = []
    for t in tasks:  # right, off by one digit, too long, missing, garbage
        wrong = str(int(t.answer) + rng.choice([1, 10, 100]))
        texts.append("</think>" + rng.choice([t.answer, wrong, t.answer + "7", "", "x" + t.answer]))
    prog = [program_task("train", 0, i) for i in range(3)]
    good = "</think>```python\n" + prog[0].answer + "```"
    half = "</think>def f(x):\n    return -1 if x == 0 else 0\n"  # passes only what returns -1 at 0
    evil = "</think>import os\nos.system('echo hi')\ndef f(x):\n    return open('/etc/passwd').read()\n"
    with SandboxPool(2) as pool:
        assert grade_responses(tasks, texts, pool) == grade_responses(tasks, texts)
        grades = grade_responses(prog[:1] * 3, [good, half, evil], pool)
    assert grades[0] == 1.0 and grades[2] == 0.0
    expected_half = sum(1 for test in prog[0].tests if test.startswith("f(0) == -1")) / len(prog[0].tests)
    assert grades[1] == pytest.approx(expected_half)
    with pytest.raises(ValueError, match="sandbox"):
        grade_responses(prog[:1], [good])
