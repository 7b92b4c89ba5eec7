"""Grading cannot be faked (issue 31, defect 1): the solution's code never runs where the expected values,
the tests' logic and the verdict live (dsv41/rl/sandbox/grading.py).

Every attack below scored 1.0 on the old grader, which ran the solution and the tests in one interpreter
(checked by running this file against it), except where a comment says otherwise. Each must score 0.0 through
`grade_program` and through `grade_responses` with a `SandboxPool`, while an honest solution scores 1.0.
"""

import pytest

from dsv41.rl.sandbox import SandboxLimits, SandboxPool, grade_program, grade_programs
from dsv41.rl.tasks import Task, grade_responses

LIMITS = SandboxLimits(cpu_time_s=2, wall_time_s=6, memory_bytes=256 << 20, max_processes=8)
TESTS = ["assert add(1, 2) == 3", "add(2, 2) == 4", "assert add(-1, 5) == 4"]
HONEST = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "\ndef add(a, b):\n    return 0\n"

ATTACKS = {
    "replace_eval_and_exec": "import builtins\nbuiltins.eval = lambda *a, **k: True\n"
    "builtins.exec = lambda *a, **k: None\n" + WRONG_ADD,
    "replace_compile": "import builtins\n_c = builtins.compile\n"
    "builtins.compile = lambda s, f, m, *a, **k: _c('True' if m == 'eval' else 'pass', f, m)\n" + WRONG_ADD,
    "always_equal_object": "class E:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
    "    def __bool__(self): return True\n    def __hash__(self): return 0\n"
    "def add(a, b):\n    return E()\n",
    "always_equal_int_subclass": "class E(int):\n    def __eq__(self, other): return True\n"
    "    __hash__ = int.__hash__\n"
    "def add(a, b):\n    return E(0)\n",
    "rewrite_tests_through_frames": "import sys\nf = sys._getframe(0)\nwhile f is not None:\n"
    "    for v in list(f.f_locals.values()):\n"
    "        if isinstance(v, list) and v and all(isinstance(t, str) for t in v):\n"
    "            v[:] = ['True'] * len(v)\n"
    "    f = f.f_back\n" + WRONG_ADD,
    "read_expected_value_from_caller_code": "import sys\ndef add(a, b):\n"
    "    consts = [c for c in sys._getframe(1).f_code.co_consts\n"
    "              if isinstance(c, int) and c not in (a, b)]\n"
    "    return consts[-1] if consts else 0\n",
    "forge_verdict_line_with_marker_from_frames": "import json, os, sys\nf = sys._getframe(0)\nfound = {}\nwhile f is not None:\n"
    "    found.update({k: v for k, v in f.f_locals.items() if k in ('marker', 'tests', 'result_fd')})\n"
    "    f = f.f_back\n"
    "line = json.dumps({'marker': found.get('marker', ''), 'passed': len(found.get('tests', [0, 0, 0])),\n"
    "                   'total': len(found.get('tests', [0, 0, 0])), 'probes': []})\n"
    "os.write(found.get('result_fd', 1), (line + '\\n').encode())\nos._exit(0)\n",
    "write_forged_answers_to_every_fd": "import json, os\n"
    "line = (json.dumps({'probes': [['ok', 3], ['ok', 4], ['ok', 4]]}) + '\\n').encode()\n"
    "for fd in range(1, 20):\n    try:\n        os.write(fd, line)\n"
    "    except OSError:\n        pass\n" + WRONG_ADD,
    "monkeypatch_harness_json": "import json\n_d = json.dumps\n"
    "def dumps(o, *a, **k):\n"
    "    if isinstance(o, dict) and 'total' in o:\n        o = dict(o, passed=o['total'])\n"
    "    return _d(o, *a, **k)\n"
    "json.dumps = dumps\n" + WRONG_ADD,
    "exit_early_with_0": "import os\nos._exit(0)\n",
    # A StopIteration re-raised inside map() would end the test's own iteration: all() of nothing is True.
    "stop_iteration_ends_the_tests_loop": "def add(a, b):\n    raise StopIteration\n",
    "sys_exit_0_at_load": "import sys\nsys.exit(0)\n",
    # Scored 0.0 on the old grader too (its per-test `except BaseException` counted a SystemExit as a
    # failure, and it refused a second verdict line):
    "system_exit_inside_a_test": "def add(a, b):\n    raise SystemExit(0)\n",
    "print_fake_verdicts": "import json\nfor m in ('', 'x'):\n"
    "    print(json.dumps({'marker': m, 'passed': 3, 'total': 3, 'probes': [3, 4, 0]}))\n" + WRONG_ADD,
}


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(max_workers=2, limits=LIMITS, slot_offset=300) as p:
        yield p


def program_task(tests):
    return Task("program", "test:0:0", "Write add(a, b).", tests=tuple(tests))


def test_honest_solution_scores_one_and_wrong_one_zero():
    assert grade_program(HONEST, TESTS, limits=LIMITS)[0] == 1.0
    assert grade_program(WRONG_ADD, TESTS, limits=LIMITS)[0] == 0.0


# The same checks written the other usual ways: a loop, and a check(candidate) function (HumanEval's
# style). The tests call the solution's function with values of their own: a clean discovery run lists
# those calls first (grading.py).
DYNAMIC_TESTS = [
    "for a, b in [(1, 2), (2, 2)]:\n    assert add(a, b) == a + b",
    "def check(candidate):\n    assert candidate(-1, 5) == 4\n    assert candidate(0, 0) == 0\ncheck(add)",
    "all(map(lambda x: add(x, 1) == x + 1, range(3)))",
]


@pytest.mark.parametrize("tests", [TESTS, DYNAMIC_TESTS], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero_through_grade_program(name, tests):
    score, result = grade_program(ATTACKS[name], tests, limits=LIMITS)
    assert score == 0.0, (name, result)


def test_loops_and_check_functions_grade_honest_and_wrong_solutions():
    assert grade_program(HONEST, DYNAMIC_TESTS, limits=LIMITS)[0] == 1.0
    assert grade_program(WRONG_ADD, DYNAMIC_TESTS, limits=LIMITS)[0] == 0.0
    # Right on positive numbers only: the loop test and the check pass, the range(3) one (0 + 1) too;
    # a solution wrong at add(0, 0) fails the check only.
    zero_wrong = "def add(a, b):\n    return 1 if (a, b) == (0, 0) else a + b\n"
    assert grade_program(zero_wrong, DYNAMIC_TESTS, limits=LIMITS)[0] == pytest.approx(2 / 3)
    # A call whose arguments come from the solution's own answer cannot be listed in advance: that test
    # fails, with a message saying why, and the others still count.
    chained = DYNAMIC_TESTS + ["y = add(1, 1)\nassert add(y, y) == 4"]
    score, _ = grade_program(HONEST, chained, limits=LIMITS)
    assert score == pytest.approx(3 / 4)


def test_attacks_score_zero_through_grade_responses_with_a_pool(pool):
    names = sorted(ATTACKS)
    texts = ["</think>```python\n" + ATTACKS[n] + "```" for n in names] + ["</think>" + HONEST]
    for tests in (TESTS, DYNAMIC_TESTS):
        grades = grade_responses([program_task(tests)] * len(texts), texts, pool)
        assert dict(zip(names + ["honest"], grades)) == {**{n: 0.0 for n in names}, "honest": 1.0}


def test_expected_values_never_reach_the_solutions_process():
    """The solution looks through everything its interpreter holds for the expected value; on the old
    grader it found it (the test list lived in the harness's frame), now only the probes' source is there."""
    sentinel = 918273645
    spy = (
        "import gc, sys\n"
        "def scan():\n"
        f"    needle = str(int('{sentinel - 1}') + 1)\n"  # not a literal: the solution's own code is in memory
        "    for o in gc.get_objects():\n"
        "        if isinstance(o, (list, dict, tuple)) and needle in repr(o):\n"
        "            return True\n"
        "    f = sys._getframe(1)\n"
        "    while f is not None:\n"
        "        if needle in repr(f.f_locals):\n"
        "            return True\n"
        "        f = f.f_back\n"
        "    return False\n"
        "print('FOUND' if scan() else 'CLEAN', file=sys.stderr)\n"
        "def f(x):\n    return x\n"
    )
    score, result = grade_program(spy, [f"f(1) == {sentinel}"], limits=LIMITS)
    assert score == 0.0
    assert "CLEAN" in result.stderr and "FOUND" not in result.stderr, result.stderr


def test_equality_is_type_strict_where_python_would_hide_a_wrong_type():
    """`==` never takes a bool for a number, and takes a float for an int only where the reference returns
    floats (or no reference is given, as in HumanEval's graders); `!=` and `in` are Python's on plain data."""
    tests = ["assert f(1) == 2", "f(2) == 3"]
    reference = "def f(x):\n    return x + 1\n"
    assert grade_program("def f(x):\n    return x + 1\n", tests, limits=LIMITS, reference=reference)[0] == 1.0
    assert grade_program("def f(x):\n    return float(x + 1)\n", tests, limits=LIMITS, reference=reference)[0] == 0.0
    assert grade_program("def f(x):\n    return float(x + 1)\n", tests, limits=LIMITS)[0] == 1.0
    bools = ["is_even(2) == True", "is_even(3) == False", "is_even(4) in (True,)"]
    assert grade_program("def is_even(x):\n    return x % 2 == 0\n", bools, limits=LIMITS)[0] == 1.0
    # 1 in (True,) is Python's answer; == refuses 1 for True
    assert grade_program("def is_even(x):\n    return 1 - x % 2\n", bools, limits=LIMITS)[0] == pytest.approx(1 / 3)
    nested = ["g() == (1, [2.5, 'x'], {3: b'y'}, {4}, frozenset({5}), 1j, None)", "g()[1] != [2.5, 'x', 0]"]
    good = "def g():\n    return (1, [2.5, 'x'], {3: b'y'}, {4}, frozenset({5}), 1j, None)\n"
    assert grade_program(good, nested, limits=LIMITS)[0] == 1.0
    bad = "def g():\n    return (True, [2.5, 'x'], {3: b'y'}, {4}, frozenset({5}), 1j, None)\n"
    assert grade_program(bad, nested, limits=LIMITS)[0] == 0.5


def test_tests_keep_their_expressiveness():
    tests = [
        "x = f(3)\nassert x == 9 and x > 8",
        "len(WORDS) == 2 and WORDS[0] == 'a'",
        "import math\nassert math.isclose(h(0.1), 0.2)",
        "math.isclose(h(0.2), 0.4)",
        "sorted(k(3)) == [0, 1, 2]",
        "all(v == 9 for v in [f(3), f(-3)])",
        "assert f(f(1)) == 1",
    ]
    solution = (
        "WORDS = ['a', 'b']\ndef f(x):\n    return x * x\ndef h(x):\n    return 2 * x\n"
        "def k(n):\n    return list(range(n))[::-1]\n"
    )
    assert grade_program(solution, tests, limits=LIMITS)[0] == 1.0
    # A generator is not plain data: a test that compares it as it is fails; sorted() of it is computed
    # with the solution, and works.
    gen = solution.replace("return list(range(n))[::-1]", "return (i for i in range(n))")
    assert grade_program(gen, tests + ["k(3) == [0, 1, 2]"], limits=LIMITS)[0] == pytest.approx(7 / 8)


def test_bad_tests_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="not valid Python"):
        grade_program(HONEST, ["assert add(1, 2) =="], limits=LIMITS)
    with pytest.raises(ValueError, match="non-empty list"):
        grade_program(HONEST, "assert add(1, 2) == 3", limits=LIMITS)
    with pytest.raises(ValueError, match="reserved"):
        grade_program(HONEST, ["__dsv41_probe__(0)"], limits=LIMITS)


def test_a_value_that_makes_a_test_blow_up_costs_only_its_own_solution(pool):
    """The tests run in a sandbox of their own, several solutions' per run: a reported value that makes a
    test huge ('x' * n) or endless (a loop over range(n)) scores its solution 0 and not the others (a
    failed shared evaluator run is redone one solution per run)."""
    huge, endless = ["len('x' * n()) == 3"], ["sum((1 for _ in range(n()))) == 3"]
    items = [
        ("def n():\n    return 10 ** 12\n", huge),
        ("def n():\n    return 3\n", huge),
        ("def n():\n    return 10 ** 12\n", endless),
        ("def n():\n    return 3\n", endless),
    ]
    quick = SandboxLimits(cpu_time_s=1, wall_time_s=2, memory_bytes=256 << 20, max_processes=8)
    assert [s for s, _ in grade_programs(items, pool, limits=quick)] == [0.0, 1.0, 0.0, 1.0]


def test_expected_exceptions_and_conversions():
    """Tests may expect the solution to raise (a builtin exception class, or a subclass of one), and may
    convert what it returns with a one-argument builtin (list(), sorted(), len()...) before comparing."""
    tests = [
        "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no ValueError')",
        "list(g(3)) == [0, 1, 2]",
        "sorted(d().keys()) == ['a', 'b']",
        "len(g(4)) == 4",
    ]
    honest = (
        "class Negative(ValueError):\n    pass\n"
        "def f(x):\n    if x < 0:\n        raise Negative(x)\n    return x\n"
        "def g(n):\n    return range(n)\n"
        "def d():\n    return {'b': 1, 'a': 2}\n"
    )
    assert grade_program(honest, tests, limits=LIMITS)[0] == 1.0
    no_raise = honest.replace("raise Negative(x)", "return 0")
    assert grade_program(no_raise, tests, limits=LIMITS)[0] == 0.75
    # SystemExit is not an Exception: the evaluator never re-raises it (the test fails instead).
    assert grade_program(honest.replace("raise Negative(x)", "raise SystemExit(0)"), tests, limits=LIMITS)[0] == 0.75
