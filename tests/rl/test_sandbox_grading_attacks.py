"""End-to-end attacks on grading through `grade_program(s)` and `tasks.grade_responses` with a SandboxPool,
and the honest solutions the grader must not fail (dsv41/rl/sandbox/grading.py, docs/sandbox.md).

Each attack here scored 1.0 (or, for the first, raised out of the grader) on the grader before these
changes: one evaluator process for a batch's tests, names and method calls resolved in the solution's
process; each honest solution here scored 0 (or 0.5) there. The docstrings say which; the section
numbers follow the red team's list of attack classes.
"""

import pytest

from dsv41.rl.sandbox import SandboxLimits, SandboxPool, SandboxResult, grade_program, grade_programs
from dsv41.rl.tasks import Task, grade_responses, humaneval_task, stdio_task

LIMITS = SandboxLimits(cpu_time_s=2, wall_time_s=6, memory_bytes=256 << 20, max_processes=8)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(max_workers=2, limits=LIMITS, slot_offset=400) as p:
        yield p


def score(solution, tests, **kwargs):
    return grade_program(solution, tests, limits=LIMITS, **kwargs)[0]


# ------------------------------------------------------------------------------------------------------
# 1. Nothing one solution sends can raise out of the grader.


def forged_answers():
    """Answers a solution could write in place of the probe harness's: malformed, or nested around the
    depth where the old grader, re-encoding them a few levels deeper for the evaluator, raised
    RecursionError (the whole batch's grades were lost, and the trainer's rollout step with them)."""
    for depth in range(0, 1200, 1):
        yield '{"probes": [["ok", ' + "[" * depth + "]" * depth + ']], "calls": []}'
    yield '{"probes": [["ok", {"dict": [[{"list": []}, 1]]}]], "calls": []}'
    yield '{"probes": [["error", "x", "ValueError", ' + "[" * 990 + "]" * 990 + ']], "calls": []}'
    yield '{"probes": [["ok", 1, 2]], "calls": []}'
    yield '{"probes": [["ok", 1e999]], "calls": []}'
    yield "\u0000"


def test_no_answer_a_solution_writes_raises_out_of_the_grader():
    """Raised RecursionError out of grade_programs on the old grader. A runner stands in for the sandbox
    here: it answers every probe run with a forged answer, and fails every other run."""
    answers = list(forged_answers())

    def runner(code, stdin="", files=None, limits=None):
        if files and "solution.py" in files:
            return SandboxResult(status="ok", stdout=answers[int(files["solution.py"])] + "\n")
        return SandboxResult(status="error")

    items = [(str(i), ["f(1) == 2"]) for i in range(len(answers))]
    assert [s for s, _ in grade_programs(items, runner)] == [0.0] * len(items)


def test_a_malformed_answer_costs_only_its_own_solution(pool):
    deep = "import os\nline = '{\"probes\": [[\"ok\", ' + '[' * 5000 + ']' * 5000 + ']], \"calls\": []}'\n"
    deep += "for fd in range(3, 12):\n    try:\n        os.write(fd, (line + chr(10)).encode())\n"
    deep += "    except OSError:\n        pass\nos._exit(0)\n"
    honest = "def f(x):\n    return x + 1\n"
    items = [(deep, ["f(1) == 2"]), (honest, ["f(1) == 2"])]
    assert [s for s, _ in grade_programs(items, pool)] == [0.0, 1.0]
    tasks = [Task("program", "t:0:0", "f", tests=("f(1) == 2",))] * 2
    assert grade_responses(tasks, ["</think>" + code for code, _ in items], pool) == [0.0, 1.0]


# ------------------------------------------------------------------------------------------------------
# 3. A solution decides nothing about another solution's grade (one process per solution), nor runs
# code where its own verdict is written.

# The code it returns finds the evaluator's request in its frames, learns how many solutions share the
# run, writes an "all passed" verdict for each on every descriptor and exits before the real verdict.
FORGE = """
import json, os, sys
f, verdict = sys._getframe(0), {"passed": [[True, True]] * 16}
while f is not None:
    r = f.f_locals.get("request")
    if isinstance(r, dict) and "jobs" in r:  # several solutions' tests in one evaluator
        verdict = {"passed": [[True] * len(job["tests"]) for job in r["jobs"]]}
    elif isinstance(r, dict) and "job" in r:  # one solution's
        verdict = {"passed": [True] * len(r["job"]["tests"])}
    f = f.f_back
line = (json.dumps(verdict) + chr(10)).encode()
for fd in range(3, 20):
    try:
        os.write(fd, line)
    except OSError:
        pass
os._exit(0)
"""
# Through the builtins module: the tests' own exec() refuses a string that is not one of their literals.
FORGER = f"def expr(n):\n    return '__import__(\"builtins\").exec(' + repr({FORGE!r}) + ') or 0'\n"
EXPR_TESTS = ["eval(expr(3)) == 6", "eval(expr(5)) == 10"]


def test_code_a_solution_returns_cannot_forge_verdicts(pool):
    """A test that evaluates a string the solution returned ran it inside the evaluator that held the whole
    batch's verdicts: the forger and every wrong solution beside it scored 1.0 on the old grader."""
    wrong = "def expr(n):\n    return '0'\n"
    honest = "def expr(n):\n    return f'{n} * 2'\n"
    items = [(FORGER, EXPR_TESTS)] + [(wrong, EXPR_TESTS)] * 3 + [(honest, EXPR_TESTS)]
    assert [s for s, _ in grade_programs(items, pool)] == [0.0, 0.0, 0.0, 0.0, 1.0]


# ------------------------------------------------------------------------------------------------------
# 4. Comparisons never reach the solution's process.


@pytest.mark.parametrize(
    "tests, wrong, right",
    [
        # names the tests bind without a visible assignment: a star import, an exec
        (
            ["from math import *\nassert f(16) == sqrt(16)"],
            "def sqrt(x):\n    return 0\ndef f(x):\n    return 0\n",
            "def f(x):\n    return x ** 0.5\n",
        ),
        (
            ["exec('def g(x): return x * 2')\nassert f(3) == g(3)"],
            "def g(x):\n    return 0\ndef f(x):\n    return 0\n",
            "def f(x):\n    return 2 * x\n",
        ),
        # a standard module the tests use without importing it
        (
            ["json.loads(f()) == [1, 2]"],
            "import json\njson.loads = lambda s: [1, 2]\ndef f():\n    return 'x'\n",
            "def f():\n    return '[1, 2]'\n",
        ),
        # method calls on a returned value
        (
            ["f(3).startswith('12')", "f(4).isdigit()", "f(5).issubset({1, 2})"],
            "class S:\n    def __getattr__(self, name):\n        return lambda *a: True\ndef f(x):\n    return S()\n",
            "def f(x):\n    return {3: '123', 4: '7', 5: {1}}[x]\n",
        ),
        # != and not in with Python's semantics: 0.0 and False equal 0
        (
            ["f(5) != 0", "f(6) not in (0, 1)"],
            "def f(x):\n    return 0.0 if x == 5 else False\n",
            "def f(x):\n    return x\n",
        ),
    ],
    ids=["star_import", "exec_made_name", "unimported_module", "method_chain", "ne_and_not_in"],
)
def test_comparisons_are_decided_in_the_evaluator(tests, wrong, right):
    """Each wrong solution scored 1.0 on the old grader."""
    assert score(wrong, tests) == 0.0
    assert score(right, tests) == 1.0


# ------------------------------------------------------------------------------------------------------
# 7. Honest solutions score 1.

HUMANEVAL_ADD = """

METADATA = {}


def check(candidate):
    import random

    assert candidate(0, 1) == 1
    assert candidate(5, 7) == 12
    for i in range(100):
        x, y = random.randint(0, 1000), random.randint(0, 1000)
        assert candidate(x, y) == x + y
"""


def test_humaneval_check_form_grades_one_and_zero():
    """HumanEval's own check(candidate) with random inputs: 0 for the honest solution on the old grader
    (the random calls were not those discovery listed), and 0.5 as two tests (the def counted as passed)."""
    assert score("def add(x, y):\n    return x + y\n", [HUMANEVAL_ADD + "\ncheck(add)"]) == 1.0
    prompt = 'import random\n\n\ndef add(x: int, y: int):\n    """Add two numbers x and y."""\n'
    task = humaneval_task("t:0:0", prompt, HUMANEVAL_ADD, "add")
    honest = "</think>def add(x, y):\n    return x + y\n"
    completion = "</think>    return x + y\n"  # HumanEval's own form: the body the prompt leaves open
    wrong = "</think>def add(x, y):\n    return x + y if x < 500 else 0\n"
    with SandboxPool(2, limits=LIMITS, slot_offset=420) as pool:
        assert grade_responses([task] * 3, [honest, completion, wrong], pool) == [1.0, 1.0, 0.0]


HONEST_CASES = {
    # a set argument: its iteration order differs between processes (str hashes are randomised)
    "set_argument": (
        ["def check(candidate):\n    assert candidate({'a', 'bb', 'ccc', 'dddd'}) == 'a'\ncheck(f)"],
        "def f(s):\n    return min(s)\n",
    ),
    # a loop of 3,000 calls (the answer outgrew the 64 KiB output cap)
    "many_calls": (
        ["for i in range(3000):\n    assert f(i) == i * 3"],
        "def f(x):\n    return 3 * x\n",
    ),
    "big_value": (["f() == 'x' * 100000"], "def f():\n    return 'x' * 100000\n"),
    "main_block_reads_input": (
        ["f(2) == 4"],
        "def f(x):\n    return x * 2\nif __name__ == '__main__':\n    print(f(int(input())))\n",
    ),
    "main_block_runs_unittest": (
        ["f(2) == 4"],
        "import unittest\ndef f(x):\n    return x * 2\n"
        "class T(unittest.TestCase):\n    def test(self):\n        self.assertEqual(f(1), 2)\n"
        "if __name__ == '__main__':\n    unittest.main()\n",
    ),
    "exception_message": (
        ["try:\n    f(-1)\nexcept ValueError as e:\n    assert str(e) == 'negative'\nelse:\n    assert False"],
        "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n",
    ),
    "float_for_int_by_python_equality": (["f(8) == 4"], "def f(x):\n    return x / 2\n"),
}


@pytest.mark.parametrize("name", sorted(HONEST_CASES))
def test_honest_solutions_score_one(name):
    """Each scored 0 on the old grader."""
    tests, solution = HONEST_CASES[name]
    assert score(solution, tests) == 1.0


def test_int_float_equality_follows_the_reference():
    """Where the reference returns ints, a float fails `==` (x / 2 for x // 2); where it returns floats, an
    int answer that equals it passes (Python's ==)."""
    tests = ["f(8) == 4", "f(6) == 3"]
    floats = "def f(x):\n    return x / 2\n"
    ints = "def f(x):\n    return x // 2\n"
    assert score(floats, tests, reference=ints) == 0.0
    assert score(ints, tests, reference=ints) == 1.0
    assert score(ints, tests, reference=floats) == 1.0
    assert score(floats, tests, reference=floats) == 1.0
    # bool is never a number to ==, whatever the reference
    assert score("def f(x):\n    return True\n", ["f(1) == 1"], reference="def f(x):\n    return 1\n") == 0.0


def test_stdio_tasks_compare_the_programs_output():
    """MBPP/APPS-style: the program reads stdin and prints; each case is one run, compared by tokens."""
    task = stdio_task("t:0:0", "Print the sum of two numbers.", [("1 2\n", "3\n"), ("10 -4\n", "6")])
    honest = "</think>```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "</think>a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"
    with SandboxPool(2, limits=LIMITS, slot_offset=430) as pool:
        assert grade_responses([task, task], [honest, half], pool) == [1.0, 0.5]


def test_a_class_task_keeps_one_method_call_and_only_without_constructor_arguments():
    """LeetCode's `Solution().method(...)` is one probe; a capitalised function called with arguments is
    cut after the call like any other, so its returned object cannot answer the method itself."""
    leetcode = ["Solution().two_sum([2, 7, 11], 9) == [0, 1]"]
    honest = (
        "class Solution:\n    def two_sum(self, nums, target):\n"
        "        seen = {}\n        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n                return [seen[target - x], i]\n"
        "            seen[x] = i\n"
    )
    assert score(honest, leetcode) == 1.0
    liar = "class S:\n    def startswith(self, prefix):\n        return True\ndef Find(x):\n    return S()\n"
    assert score(liar, ["Find(3).startswith('12')"]) == 0.0
    assert score("def Find(x):\n    return '123'\n", ["Find(3).startswith('12')"]) == 1.0


def test_unpickling_a_solutions_bytes_runs_nothing_in_the_evaluator():
    """A test that unpickles what the solution returned (a serialisation task) ran the solution's code in
    the evaluator (a __reduce__ calling os.write): it wrote its own "all passed" verdict and scored 1.0.
    pickle refuses to load in the evaluator; tests importing modules afterwards still work."""
    forger = (
        "import os, pickle\n"
        "class V:\n"
        "    def __reduce__(self):\n"
        "        code = ('import json, os\\nfor fd in range(3, 20):\\n    try:\\n'\n"
        "                '        os.write(fd, (json.dumps({\"passed\": [True, True]}) + chr(10)).encode())\\n'\n"
        "                '    except OSError:\\n        pass\\nos._exit(0)\\n')\n"
        "        return (exec, (code,))\n"
        "def serialize(x):\n    return pickle.dumps(V())\n"
    )
    tests = [
        "import pickle\nassert pickle.loads(serialize([1, 2])) == [1, 2]",
        "import fractions\nassert serialize(3) != b'' and fractions.Fraction(2, 4) == fractions.Fraction(1, 2) == 0.5",
    ]
    assert score(forger, tests) == 0.5


def test_code_run_by_an_unguarded_interface_reaches_no_other_solutions_verdict(pool):
    """timeit runs the string it is given, and nothing guards it: a test that times a solution's statement
    runs the solution's code where the tests run. Run in the process that writes the batch's verdict, it
    wrote "all passed" for every solution and exited (each wrong one beside it scored 1.0). Each solution's
    tests now run in a process of their own, which holds no descriptor of the verdict's and whose exit
    ends nothing but itself."""
    tests = ["import timeit\nassert timeit.timeit(stmt=code(), number=1) >= 0", "value() == 42"]
    forger = f"def code():\n    return {FORGE!r}\ndef value():\n    return 0\n"
    wrong = "def code():\n    return 'pass'\ndef value():\n    return 0\n"
    items = [(forger, tests)] + [(wrong, tests)] * 3
    assert [s for s, _ in grade_programs(items, pool)][1:] == [0.5, 0.5, 0.5]
