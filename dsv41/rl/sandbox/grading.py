"""Grading "small programs with tests" so that a solution cannot fake its own score, nor anyone else's.

A test is a Python statement or expression written by the task ("assert add(1, 2) == 3", "f(3) == 6",
HumanEval's `def check(candidate): ...` then `check(add)`). Running it in the solution's interpreter, as a
grader naturally would, hands the verdict to the solution: it can replace eval/exec or any builtin, return
an object equal to everything, rewrite the test list through the caller's frame, or write the verdict. So
the solution's code never runs where the expected values, the test logic and the verdict live:

1. The orchestrator parses the tests (trusted input) and cuts out their *probes* (planning.py): the
   smallest expressions whose value only the solution can give, e.g. `add(1, 2)`, `ANSWER`,
   `Solution().two_sum([2, 7], 9)`. Only their source enters the solution's sandbox.
2. Probe run (sandbox, `_probe_harness.py`): the solution is imported as a module, each probe is
   evaluated in its namespace and the values come back as tagged JSON of plain data (None, bool, int,
   float, complex, str, bytes, list, tuple, dict, set, frozenset, range, and an iterator's elements) of
   exactly those types; an exception as its builtin class and arguments.
3. Evaluation run (a second, clean sandbox, `_test_evaluator.py`): the tests run with each probe
   replaced by its decoded value, **each solution's in a process of its own**, forked by the evaluator,
   holding no descriptor but its reply pipe, with everything it left killed before the next solution's
   starts; up to EVAL_BATCH solutions share a run, and a run that fails as a whole is redone one solution
   per run. Method calls on those values, conversions, `!=`, `in`,
   `not in` and the orderings are Python's, on plain values; `==` is the grader's: bool is never a
   number, and an int equals a float of the same value unless the task's reference solution returns no
   float (then a float where an int is due, `x / 2` for `x // 2`, is wrong). Without a reference, Python's
   int/float equality holds, as in HumanEval's graders. A string the tests eval() that is not one of
   their own literals is the solution's code: it runs in a child process that holds no descriptor of the
   evaluator's and reports a plain value; exec() and compile() of such strings are refused.
4. Score = passed / total from the evaluator's verdict; 0.0 if a run failed or the probe run's answer is
   malformed, too large or too deep. Each solution's grading fails closed on its own: nothing one
   solution sends can raise out of `grade_programs` or change another solution's score.

Calls the tests make with values of their own (`for x in range(5): assert f(x) == x * x`, check(candidate))
cannot be cut out of the source: there the probe is the function itself, and a **discovery run** (a clean
sandbox, no solution at all) first runs the tests with every probe a placeholder and lists the calls made
with plain-data arguments (random draws are seeded per test, sets encoded in sorted order, so evaluation
asks the same calls). The probe run answers those too; in the evaluation the function is a stand-in that
answers exactly them. Discovery depends on the tests alone, so the solution learns nothing from it; a call
whose arguments come from the solution's own answers cannot be listed in advance and its test fails.

Programs that read stdin and print (MBPP/APPS style) are graded by `grade_stdio_programs`: one sandbox run
per case, the output compared with the expected one token by token in the orchestrator.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from dsv41.rl.sandbox.config import SandboxLimits, SandboxResult, SandboxTask
from dsv41.rl.sandbox.orchestrator import run_python
from dsv41.rl.sandbox.planning import TEST_MODULES, GradingPlan, plan_tests

__all__ = [
    "ANSWER_BYTES",
    "TEST_MODULES",
    "GradingCache",
    "GradingPlan",
    "grade_program",
    "grade_programs",
    "grade_stdio_programs",
    "grading_score",
    "grading_task",
    "plan_tests",
]

# The probe run's answer may be this large (a 3,000-call loop, a 100 kB string); the sandbox's default
# output cap (64 KiB) is meant for a program's prints, not for the grader's channel. It bounds what the
# trainer holds per grading too (stdout and stderr each): 1 MiB x 2 x the batch's solutions at worst.
ANSWER_BYTES = 1 << 20
# Solutions whose tests share one evaluator run (each in a process of its own there, see step 3 above).
EVAL_BATCH = 16
# JSON nesting the orchestrator accepts in an answer: the harness nests at most 64 values deep, two JSON
# levels each, plus the envelope. Deeper is forged; it is refused before anything re-encodes it.
_MAX_ANSWER_DEPTH = 2 * 64 + 8

_HERE = __file__.rsplit("/", 1)[0]


def _program(name: str) -> str:
    with open(f"{_HERE}/{name}", encoding="utf-8") as f:
        return f.read()


_PROBE_HARNESS = _program("_probe_harness.py")
_TEST_EVALUATOR = _program("_test_evaluator.py")


class GradingCache:
    """What grading learns from the tests and references alone, kept across calls by a caller that
    grades the same tasks again (a trainer's rollouts): discovered calls per test list, and whether a
    reference returns floats. Bounded; the oldest entries go first."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._entries: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, key: tuple) -> Any:
        return self._entries.get(key)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def put(self, key: tuple, value: Any) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


def _answer_limits(limits: SandboxLimits | None, pool_or_runner: Any) -> SandboxLimits:
    base = limits or getattr(pool_or_runner, "limits", None) or SandboxLimits()
    return dataclasses.replace(base, max_output_bytes=max(base.max_output_bytes, ANSWER_BYTES))


def _run_tasks(tasks: list[SandboxTask], pool_or_runner: Any) -> list[SandboxResult]:
    if not tasks:
        return []
    if pool_or_runner is None or (callable(pool_or_runner) and not hasattr(pool_or_runner, "map")):
        runner = pool_or_runner or run_python
        results = []
        for task in tasks:
            try:
                results.append(
                    runner(task.code, stdin=task.stdin, files=task.files, limits=task.limits or SandboxLimits())
                )
            except Exception as exc:
                results.append(SandboxResult.runner_error(f"{type(exc).__name__}: {exc}"))
        return results
    if hasattr(pool_or_runner, "map"):
        return pool_or_runner.map(tasks)
    raise TypeError(f"pool_or_runner must be None, a pool with map() or a callable, got {pool_or_runner!r}")


# ------------------------------------------------------------------------------------------------------
# Discovery


def _discovery_task(plan: GradingPlan, limits: SandboxLimits) -> SandboxTask:
    """The clean sandbox task that runs the tests with every probe a placeholder and lists the calls the
    tests make on the probes with plain-data arguments. It sees no solution."""
    request = {"discover": True, "jobs": [_job(plan)], "modules": list(plan.modules)}
    return SandboxTask(code=_TEST_EVALUATOR, stdin=json.dumps(request), limits=limits)


def _discovered_calls(result: SandboxResult) -> tuple:
    """The calls a discovery run found; none when it failed (the tests that needed them then fail)."""
    line = _single_line(result)
    try:
        calls = json.loads(line)["calls"] if line is not None else None
    except (ValueError, KeyError, TypeError, RecursionError):
        return ()
    if not isinstance(calls, list) or not all(
        isinstance(c, list) and len(c) == 3 and isinstance(c[0], int) for c in calls
    ):
        return ()
    return tuple(tuple(c) for c in calls)


def discover(
    plans: Sequence[GradingPlan], pool_or_runner: Any, limits: SandboxLimits, cache: GradingCache
) -> list[GradingPlan]:
    """Plans with their calls discovered (one discovery run per distinct test list not seen before)."""
    todo: dict[tuple, GradingPlan] = {}
    for plan in plans:
        if plan.needs_discovery and plan.calls is None and ("calls", plan.tests) not in cache:
            todo.setdefault(plan.tests, plan)
    results = _run_tasks([_discovery_task(plan, limits) for plan in todo.values()], pool_or_runner)
    found = {}
    for tests, result in zip(todo, results):
        found[tests] = _discovered_calls(result)
        if result.status == "ok":  # a failed run (an overloaded machine) is not remembered
            cache.put(("calls", tests), found[tests])
    out = []
    for plan in plans:
        if plan.needs_discovery and plan.calls is None:
            calls = cache.get(("calls", plan.tests)) if ("calls", plan.tests) in cache else found.get(plan.tests, ())
            plan = dataclasses.replace(plan, calls=calls)
        out.append(plan)
    return out


# ------------------------------------------------------------------------------------------------------
# Probe run


def _probe_task(solution_code: str, plan: GradingPlan, limits: SandboxLimits) -> SandboxTask:
    request = json.dumps(
        {"probes": list(plan.probes), "calls": [list(c) for c in plan.calls or ()], "modules": list(plan.modules)}
    )
    return SandboxTask(code=_PROBE_HARNESS, stdin=request, files={"solution.py": solution_code}, limits=limits)


def _single_line(result: SandboxResult) -> str | None:
    if result.status != "ok" or result.stdout_truncated:
        return None
    lines = result.stdout.splitlines()
    return lines[0] if len(lines) == 1 else None


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion (a forged answer may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
    return deepest


def probe_answer(result: SandboxResult, plan: GradingPlan) -> str | None:
    """The probe run's answer line, checked for shape, size and depth (the values themselves are decoded
    by the evaluator); None when the run did not finish cleanly or the answer is malformed: 0 for the
    solution. The line is passed on as it came, never re-encoded."""
    line = _single_line(result)
    if line is None:
        return None
    try:
        answer = json.loads(line)
    except (ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(answer, dict) or set(answer) != {"probes", "calls"} or _depth(answer) > _MAX_ANSWER_DEPTH:
        return None
    for key, expected in (("probes", len(plan.probes)), ("calls", len(plan.calls or ()))):
        values = answer[key]
        if not isinstance(values, list) or len(values) != expected:
            return None
        for v in values:
            if not isinstance(v, list) or not v:
                return None
            if v[0] == "ok" and len(v) == 2:
                continue
            if not (v[0] == "error" and len(v) == 4 and isinstance(v[1], str) and isinstance(v[2], str)):
                return None
    return line


def _returns_float(line: str | None) -> bool | None:
    """Whether a reference's answer holds a float anywhere; None when it has no usable answer."""
    if line is None:
        return None
    stack = [json.loads(line)]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            return True
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return False


# ------------------------------------------------------------------------------------------------------
# Evaluation run


def _job(plan: GradingPlan, int_float: bool = True) -> dict:
    return {
        "tests": [list(t) for t in plan.tests],
        "calls": [list(c) for c in plan.calls or ()],
        "literals": list(plan.literals),
        "int_float": int_float,
    }


def _evaluation_task(jobs: Sequence[tuple[GradingPlan, str, bool]], limits: SandboxLimits) -> SandboxTask:
    """The clean sandbox task that runs each job's tests (plan, answer line, int/float equality) on its
    answer, each job in a process of its own (`_test_evaluator._run_apart`). The answer lines go in as
    the JSON text they came as (checked by `probe_answer`), spliced into the request, never re-encoded."""
    modules = sorted({m for plan, _, _ in jobs for m in plan.modules})
    parts = [f'{json.dumps(_job(plan, int_float))[:-1]}, "answer": {line}}}' for plan, line, int_float in jobs]
    request = f'{{"modules": {json.dumps(modules)}, "jobs": [{", ".join(parts)}]}}'
    return SandboxTask(code=_TEST_EVALUATOR, stdin=request, limits=limits)


def _evaluation_scores(plans: Sequence[GradingPlan], evaluation: SandboxResult) -> list[float] | None:
    """Each job's fraction of tests passed, from the evaluator's verdict (0.0 for a job whose process
    gave no verdict); None when the run as a whole failed or its verdict is out of shape."""
    line = _single_line(evaluation)
    try:
        passed = json.loads(line)["passed"] if line is not None else None
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if not isinstance(passed, list) or len(passed) != len(plans):
        return None
    scores = []
    for plan, job in zip(plans, passed):
        if isinstance(job, list) and len(job) == plan.num_tests and all(p is True or p is False for p in job):
            scores.append(sum(job) / plan.num_tests)
        else:
            scores.append(0.0)
    return scores


# ------------------------------------------------------------------------------------------------------
# Public API


def grading_task(
    solution_code: str,
    tests: Sequence[str],
    limits: SandboxLimits | None = None,
    pool_or_runner: Any = None,
    cache: GradingCache | None = None,
) -> tuple[SandboxTask, GradingPlan]:
    """The sandbox task that runs `solution_code` and reports its probes' values, and the plan that
    `grading_score` needs to finish the grading (it holds the tests; the task does not). Tests that call
    what the solution returns need a discovery run first, through `pool_or_runner`."""
    if not isinstance(solution_code, str):
        raise TypeError(f"solution_code must be a str, got {type(solution_code).__name__}")
    run_limits = _answer_limits(limits, pool_or_runner)
    (plan,) = discover([plan_tests(tests, limits)], pool_or_runner, run_limits, cache or GradingCache())
    return _probe_task(solution_code, plan, run_limits), plan


def grading_score(
    result: SandboxResult,
    plan: GradingPlan,
    num_tests: int | None = None,
    pool_or_runner: Any = None,
    int_float: bool = True,
) -> float:
    """Finish grading a probe run from `grading_task`: run the tests in a clean sandbox (through
    `pool_or_runner`, as in grade_program) and return the fraction passed. Never raises for anything
    the probe run returned."""
    if not isinstance(plan, GradingPlan):
        raise TypeError("grading_score needs the GradingPlan that grading_task returned with the task")
    if num_tests is not None and num_tests != plan.num_tests:
        raise ValueError(f"num_tests={num_tests} but the plan has {plan.num_tests} tests")
    try:
        line = probe_answer(result, plan)
        if line is None:
            return 0.0
        task = _evaluation_task([(plan, line, int_float)], _answer_limits(plan.limits, pool_or_runner))
        (evaluation,) = _run_tasks([task], pool_or_runner)
        scores = _evaluation_scores([plan], evaluation)
        return scores[0] if scores is not None else 0.0
    except Exception:  # fail closed: whatever the solution sent, it scores 0 and nothing is raised
        return 0.0


def grade_program(
    solution_code: str,
    tests: Sequence[str],
    pool_or_runner: Any = None,
    limits: SandboxLimits | None = None,
    reference: str | None = None,
) -> tuple[float, SandboxResult]:
    """Run the solution in a sandbox and its tests in another; return (fraction passed, the solution's run).

    pool_or_runner: None (run here with `run_python`), a SandboxPool, a RaySandboxPool (anything with
    `map`), or a callable with run_python's signature. limits: None uses the pool's (or the defaults).
    reference: the task's reference solution, which decides whether an int equals a float (see above).
    The solution's probes run in order in one process: one that hangs the process costs all of them.
    """
    item = (solution_code, tests) if reference is None else (solution_code, tests, reference)
    ((score, result),) = grade_programs([item], pool_or_runner, limits)
    return score, result


def grade_programs(
    items: Sequence[tuple],
    pool_or_runner: Any = None,
    limits: SandboxLimits | None = None,
    cache: GradingCache | None = None,
) -> list[tuple[float, SandboxResult]]:
    """`grade_program` for a batch of (solution_code, tests) or (solution_code, tests, reference): the
    discovery runs, the references' probe runs and the solutions' probe runs through the pool, then clean
    evaluator runs of up to EVAL_BATCH solutions each, one process per solution there. Raises only for invalid tests or
    arguments (the task's or the caller's error), never for anything a solution did."""
    cache = cache or GradingCache()
    run_limits = _answer_limits(limits, pool_or_runner)
    for item in items:
        if not isinstance(item[0], str):
            raise TypeError(f"solution_code must be a str, got {type(item[0]).__name__}")
    plans = discover([plan_tests(item[1], limits) for item in items], pool_or_runner, run_limits, cache)

    # Whether each task's reference returns a float (None: no reference, Python's int/float equality).
    refs: dict[tuple, GradingPlan] = {}
    for item, plan in zip(items, plans):
        if len(item) > 2 and item[2] is not None and ("float", item[2], plan.tests) not in cache:
            refs.setdefault((item[2], plan.tests), plan)
    ref_results = _run_tasks([_probe_task(ref, plan, run_limits) for (ref, _), plan in refs.items()], pool_or_runner)
    for (ref, tests), plan, result in zip(refs, refs.values(), ref_results):
        floats = _returns_float(probe_answer(result, plan))
        if floats is not None:
            cache.put(("float", ref, tests), floats)

    probe_results = _run_tasks(
        [_probe_task(item[0], plan, run_limits) for item, plan in zip(items, plans)], pool_or_runner
    )
    scores = [0.0] * len(items)
    jobs = []
    for i, (item, plan, result) in enumerate(zip(items, plans, probe_results)):
        try:
            line = probe_answer(result, plan)
            if line is None:
                continue
            floats = cache.get(("float", item[2], plan.tests)) if len(item) > 2 and item[2] is not None else None
            jobs.append((i, (plan, line, floats is not False)))
        except Exception:  # fail closed, for this solution only
            continue
    # Up to EVAL_BATCH solutions per evaluator run, each in a process of its own there; a run that fails as
    # a whole (a value that makes a test endless, a job that killed the evaluator) is redone one solution
    # per run, so it costs its own solution only.
    batches = [jobs[k : k + EVAL_BATCH] for k in range(0, len(jobs), EVAL_BATCH)]
    evaluations = _run_tasks([_evaluation_task([job for _, job in b], run_limits) for b in batches], pool_or_runner)
    redo = []
    for batch, evaluation in zip(batches, evaluations):
        batch_scores = _evaluation_scores([job[0] for _, job in batch], evaluation)
        if batch_scores is None:
            redo.extend(batch if len(batch) > 1 else [])
            continue
        for (i, _), score in zip(batch, batch_scores):
            scores[i] = score
    evaluations = _run_tasks([_evaluation_task([job], run_limits) for _, job in redo], pool_or_runner)
    for (i, job), evaluation in zip(redo, evaluations):
        single = _evaluation_scores([job[0]], evaluation)
        scores[i] = single[0] if single is not None else 0.0
    return list(zip(scores, probe_results))


def grade_stdio_programs(
    items: Sequence[tuple[str, Sequence[tuple[str, str]]]],
    pool_or_runner: Any = None,
    limits: SandboxLimits | None = None,
) -> list[float]:
    """Programs that read stdin and print (MBPP/APPS style): each (code, [(input, expected output), ...])
    runs once per case as `__main__`; a case passes when the run ends cleanly, untruncated, and its
    output has the expected whitespace-separated tokens (APPS's graders compare this way: a trailing
    newline or space is no error). The comparison happens here, on the output's text: nothing the
    program prints is executed or decoded. Score = fraction of cases passed."""
    base = _answer_limits(limits, pool_or_runner)  # the output is the answer: the same 1 MiB channel
    tasks, owners = [], []
    for i, (code, cases) in enumerate(items):
        for stdin, expected in cases:
            tasks.append(SandboxTask(code=code, stdin=stdin, limits=base))
            owners.append((i, expected))
    passed = [0] * len(items)
    for (i, expected), result in zip(owners, _run_tasks(tasks, pool_or_runner)):
        if result.ok and not result.stdout_truncated and result.stdout.split() == expected.split():
            passed[i] += 1
    return [passed[i] / len(cases) if cases else 0.0 for i, (_, cases) in enumerate(items)]
