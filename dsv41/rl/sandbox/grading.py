"""Grading "small programs with tests" so that a solution cannot fake its own score.

A test is a Python statement or expression written by the task ("assert add(1, 2) == 3", "f(3) == 6",
"len(ANSWER) <= 4 and ANSWER[-1] == '7'"). Running it in the solution's interpreter, as a grader
naturally would, hands the verdict to the solution: it can replace eval/exec or any builtin, return an
object equal to everything, rewrite the test list through the caller's frame, print a verdict, exit
early, or write to the verdict's channel. So the solution's code never runs where the expected values,
the test logic and the verdict live:

1. The orchestrator parses each test (trusted input) and cuts out its *probes*: the maximal expressions
   rooted at a name the test does not define itself (a name of the solution), e.g. `add(1, 2)`,
   `ANSWER`, `f(g(3)).real`, extended through a one-argument conversion (`list(g())`, `len(ANSWER)`).
   Only the probes' source goes into the sandbox, never a comparison, an expected value or the test.
2. Probe run (sandbox, `_probe_harness.py`): the solution runs, each probe is evaluated in its namespace
   and the values come back as plain data (None, bool, int, float, complex, str, bytes, list, tuple,
   dict, set, frozenset, of exactly those types: a subclass, say an int whose __eq__ is always true, is
   refused) in a tagged JSON encoding, never pickle; an exception as its message and nearest builtin
   class. Whatever the solution does to that process can only change the values it reports, which is
   what returning other values would do.
3. Evaluation run (a second, clean sandbox, `_test_evaluator.py`): the tests, with each probe replaced by
   its reported value, run on plain data only; `==`, `!=`, `in` and `not in` are type-strict there
   (1 != 1.0 != True; containers compared element by element the same way). No code of the solution has
   ever run in that process, so nothing the solution can reach decides its score. It is a sandbox rather
   than the orchestrator because a reported value can still make a test slow or large ("x" * f(2)).
   Up to EVAL_BATCH solutions share one evaluator run, a namespace each; a run that fails as a whole is
   redone one solution per run, so such a value costs only its own solution.
4. Score = passed / total, from the evaluator's verdict; 0.0 if either run did not finish cleanly or
   the probe run's answer is malformed (a second line, a missing value...).

Calls the tests make with values of their own (`for x in range(5): assert f(x) == x * x`, or HumanEval's
`def check(candidate): ...; check(add)`) cannot be cut out of the source: there the probe is the function
itself (`f`, `add`), and a **discovery run** (a clean sandbox, no solution at all) first runs the tests
with every probe a placeholder (callable, absorbing, true; asserts do not stop it) and lists the calls
made on the probes with plain-data arguments. The probe run then answers those calls too, and in the
evaluation a probe that is a function becomes a stand-in that answers exactly those calls. Discovery
depends on the tests alone (it is cached per test list), so the solution learns nothing from which calls
it is asked; a call whose arguments come from the solution's own answers (`f(f(x))` with x the test's)
cannot be listed in advance, and the test that makes it fails, saying so.

What tests may contain: any Python. Names a test binds itself (assignments, loop and comprehension
variables, imports, defs) and the builtins are the test's own; the modules in `TEST_MODULES` are
available to tests without an import; every other name is the solution's. A probe whose value is not
plain data (a generator, an instance of the solution's class) fails the tests that use it. A name that
is also a builtin (`sum`, `len`) always means the builtin in a test. Each probe is evaluated once, in
order, so a stateful solution sees the calls in the order the tests make them. A chain of calls is one
probe (`Stack().push(1).size()`), but an object of the solution kept in a test's variable is data by
then: `s = Stack()` then `s.push(1)` fails.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv41.rl.sandbox.config import SandboxLimits, SandboxResult, SandboxTask
from dsv41.rl.sandbox.orchestrator import run_python

# Standard modules a test may use without importing them (they resolve in the clean evaluator).
TEST_MODULES = (
    "math",
    "cmath",
    "re",
    "string",
    "itertools",
    "functools",
    "operator",
    "collections",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "decimal",
)

# Solutions whose tests share one clean evaluator run in grade_programs.
EVAL_BATCH = 16

_HERE = os.path.dirname(os.path.abspath(__file__))


def _program(name: str) -> str:
    with open(os.path.join(_HERE, name), encoding="utf-8") as f:
        return f.read()


_PROBE_HARNESS = _program("_probe_harness.py")
_TEST_EVALUATOR = _program("_test_evaluator.py")

# Names the rewritten tests use to reach the evaluator's helpers; a test may not use them itself.
_PROBE_FN, _COMPARE_FN = "__dsv41_probe__", "__dsv41_compare__"
_STRICT_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
_OP_NAMES = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}
_BUILTIN_NAMES = frozenset(dir(builtins))


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name `tree` binds anywhere (assignment targets, loop/comprehension/with/except targets,
    parameters, imports, def/class names, global/nonlocal declarations)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
    return bound


def _free_names(tree: ast.AST) -> set[str]:
    """Names `tree` reads without binding them itself."""
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - _bound_names(tree)


# Builtins that, applied to a probe alone, extend it: `list(f(3))` or `sorted(g())` are computed in the
# solution's process, so that a generator or a dict view, not plain data itself, can still be tested. Only
# one-argument calls: a second argument could carry an expected value into the solution's process
# (max(f(1), 5) == 5), and the value of a one-argument conversion is a claim about the solution's own value
# and nothing else.
_CONVERSIONS = frozenset(
    {
        "list",
        "tuple",
        "set",
        "frozenset",
        "sorted",
        "dict",
        "str",
        "repr",
        "len",
        "sum",
        "min",
        "max",
        "abs",
        "int",
        "float",
        "bool",
        "bytes",
        "reversed",
    }
)


def _chain_root(node: ast.AST) -> ast.Name | None:
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call) and _is_conversion(node):
            node = node.args[0]
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            break
    return node if isinstance(node, ast.Name) else None


def _is_conversion(node: ast.Call) -> bool:
    return (
        isinstance(node.func, ast.Name)
        and node.func.id in _CONVERSIONS
        and len(node.args) == 1
        and not node.keywords
        and not isinstance(node.args[0], ast.Starred)
    )


class _Rewriter(ast.NodeTransformer):
    """Replaces probes by `__dsv41_probe__(k)` and comparisons with a type-strict operator by
    `__dsv41_compare__(left, ops, thunks)`; collects the probes' source in evaluation order."""

    def __init__(self, test_names: set[str], index: int, probes: list[tuple[str, list[str]]]):
        self.test_names = test_names  # bound by this test or an earlier one
        self.index = index
        self.probes = probes
        self.dynamic = False  # whether the tests may call what a probe returns

    def _is_solution_name(self, name: str) -> bool:
        return name not in self.test_names and name not in _BUILTIN_NAMES and name not in TEST_MODULES

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Compare):
            root = _chain_root(node)
            if (
                root is not None
                and isinstance(root.ctx, ast.Load)
                and self._is_solution_name(root.id)
                and not _is_store_target(node)
            ):
                if not _free_names(node) & self.test_names:
                    return self._probe(node)
                # The chain uses the test's own variables (f(x) in a loop): only its closed part, e.g. `f`,
                # is a probe; the calls on it are found by the discovery run (see GradingPlan).
                self.dynamic = True
        return super().visit(node)

    def _probe(self, node: ast.expr) -> ast.expr:
        source = ast.unparse(node)
        if isinstance(node, (ast.Name, ast.Attribute)):
            self.dynamic = True  # a bare function may be called by the test later (check(candidate))
        modules = sorted(n for n in _free_names(node) if n in TEST_MODULES)
        self.probes.append((source, modules))
        call = ast.Call(func=ast.Name(_PROBE_FN, ast.Load()), args=[ast.Constant(len(self.probes) - 1)], keywords=[])
        return ast.copy_location(call, node)

    def visit_Compare(self, node: ast.Compare) -> Any:
        node = self.generic_visit(node)
        if not any(isinstance(op, _STRICT_OPS) for op in node.ops):
            return node
        thunks = [
            ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]), body=c)
            for c in node.comparators
        ]
        ops = ast.Tuple([ast.Constant(_OP_NAMES[type(op)]) for op in node.ops], ast.Load())
        call = ast.Call(
            func=ast.Name(_COMPARE_FN, ast.Load()), args=[node.left, ops, ast.Tuple(thunks, ast.Load())], keywords=[]
        )
        return ast.copy_location(call, node)


def _is_store_target(node: ast.AST) -> bool:
    return isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))


@dataclass(frozen=True)
class GradingPlan:
    """What the orchestrator keeps of a grading job: the rewritten tests (for the clean evaluator only)
    and the probes (the only part of the tests the solution's process ever sees)."""

    tests: tuple[tuple[str, bool], ...]  # (rewritten source, whether it is a single expression)
    probes: tuple[tuple[str, tuple[str, ...]], ...]  # (probe source, test modules it uses)
    limits: SandboxLimits | None
    # Whether the tests may call a function the solution returns (a loop over f(x), check(candidate)):
    # then a discovery run (the tests on placeholders, no solution involved) lists those calls first.
    needs_discovery: bool = False
    calls: tuple | None = None  # discovered: ((probe index, encoded args, encoded kwargs), ...)

    @property
    def num_tests(self) -> int:
        return len(self.tests)


def plan_tests(tests: Sequence[str], limits: SandboxLimits | None = None) -> GradingPlan:
    """Split `tests` into probes and rewritten tests. Raises ValueError for tests that are not valid
    Python or that use the evaluator's reserved names."""
    if isinstance(tests, str):
        raise ValueError("tests must be a non-empty list of strings, got a single string")
    tests = list(tests)
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("tests must be a non-empty list of strings")
    probes: list[tuple[str, list[str]]] = []
    rewritten: list[tuple[str, bool]] = []
    test_names: set[str] = set()  # a test may use what an earlier one defined, as in one script
    dynamic = False
    for i, test in enumerate(tests):
        try:
            tree = ast.parse(test, filename=f"<test {i}>", mode="exec")
        except SyntaxError as exc:
            raise ValueError(f"test {i} is not valid Python: {exc.msg} ({test!r})") from None
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if names & {_PROBE_FN, _COMPARE_FN}:
            raise ValueError(f"test {i} uses a name reserved for the grader ({_PROBE_FN}, {_COMPARE_FN})")
        test_names |= _bound_names(tree)
        rewriter = _Rewriter(test_names, i, probes)
        tree = rewriter.visit(tree)
        dynamic = dynamic or rewriter.dynamic
        ast.fix_missing_locations(tree)
        is_expression = len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)
        source = ast.unparse(tree.body[0].value) if is_expression else ast.unparse(tree)
        rewritten.append((source, is_expression))
    return GradingPlan(tuple(rewritten), tuple((s, tuple(m)) for s, m in probes), limits, needs_discovery=dynamic)


def discovery_task(plan: GradingPlan) -> SandboxTask:
    """The clean sandbox task that runs the tests with every probe a placeholder (callable, absorbing every
    operation, true) and lists the calls the tests make on the probes with plain-data arguments. It sees
    no solution, so the calls it finds depend on the tests alone: the solution learns nothing from them."""
    request = json.dumps(
        {
            "discover": True,
            "jobs": [{"tests": [list(t) for t in plan.tests], "values": []}],
            "modules": list(TEST_MODULES),
        }
    )
    return SandboxTask(code=_TEST_EVALUATOR, stdin=request, limits=plan.limits)


def _discovered_calls(result: SandboxResult) -> tuple:
    """The calls a discovery run found; none when it failed (the tests that needed them then fail)."""
    if result.status != "ok" or len(result.stdout.splitlines()) != 1:
        return ()
    try:
        calls = json.loads(result.stdout)["calls"]
    except (ValueError, KeyError, TypeError):
        return ()
    if not isinstance(calls, list) or not all(
        isinstance(c, list) and len(c) == 3 and isinstance(c[0], int) for c in calls
    ):
        return ()
    return tuple(tuple(c) for c in calls)


_DISCOVERY_CACHE: dict[tuple, tuple] = {}  # tests -> calls: discovery depends on the tests alone
_DISCOVERY_CACHE_SIZE = 4096


def discover(plans: Sequence[GradingPlan], pool_or_runner: Any = None) -> list[GradingPlan]:
    """Plans with their calls discovered (one discovery run per distinct test list not seen before)."""
    todo: dict[tuple, GradingPlan] = {}
    for plan in plans:
        if plan.needs_discovery and plan.calls is None and plan.tests not in _DISCOVERY_CACHE:
            todo.setdefault(plan.tests, plan)
    results = _run_tasks([discovery_task(plan) for plan in todo.values()], pool_or_runner)
    for tests, result in zip(todo, results):
        calls = _discovered_calls(result)
        if result.status == "ok":  # a failed run (overloaded machine) is not remembered
            if len(_DISCOVERY_CACHE) >= _DISCOVERY_CACHE_SIZE:
                _DISCOVERY_CACHE.pop(next(iter(_DISCOVERY_CACHE)))
            _DISCOVERY_CACHE[tests] = calls
        todo[tests] = dataclasses.replace(todo[tests], calls=calls)
    out = []
    for plan in plans:
        if plan.needs_discovery and plan.calls is None:
            calls = _DISCOVERY_CACHE.get(plan.tests, todo[plan.tests].calls if plan.tests in todo else ())
            plan = dataclasses.replace(plan, calls=calls)
        out.append(plan)
    return out


def _probe_task(solution_code: str, plan: GradingPlan) -> SandboxTask:
    request = json.dumps(
        {"probes": [[s, list(m)] for s, m in plan.probes], "calls": [list(c) for c in plan.calls or ()]}
    )
    return SandboxTask(code=_PROBE_HARNESS, stdin=request, files={"solution.py": solution_code}, limits=plan.limits)


def grading_task(
    solution_code: str, tests: Sequence[str], limits: SandboxLimits | None = None, pool_or_runner: Any = None
) -> tuple[SandboxTask, GradingPlan]:
    """The sandbox task that runs `solution_code` and reports its probes' values, and the plan that
    `grading_score` needs to finish the grading (it holds the tests; the task does not). Tests that call
    what the solution returns need a discovery run first, through `pool_or_runner`."""
    if not isinstance(solution_code, str):
        raise TypeError(f"solution_code must be a str, got {type(solution_code).__name__}")
    (plan,) = discover([plan_tests(tests, limits)], pool_or_runner)
    return _probe_task(solution_code, plan), plan


def probe_values(result: SandboxResult, plan: GradingPlan) -> dict | None:
    """The probe run's answer ({"probes": [...], "calls": [...]}), checked for shape (the values
    themselves are decoded by the evaluator); None when the run did not finish cleanly or the answer is
    malformed: the solution scores 0."""
    if result.status != "ok" or result.stdout_truncated:
        return None
    lines = result.stdout.splitlines()
    if len(lines) != 1:
        return None
    try:
        answer = json.loads(lines[0])
    except (ValueError, RecursionError):
        return None
    if not isinstance(answer, dict) or set(answer) != {"probes", "calls"}:
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
            if not (v[0] == "error" and len(v) == 3 and isinstance(v[1], str) and isinstance(v[2], str)):
                return None
    return answer


def evaluation_task(jobs: Sequence[tuple[GradingPlan, dict]], limits: SandboxLimits | None = None) -> SandboxTask:
    """The clean sandbox task that runs each job's tests on its reported values (from `probe_values`).
    Several solutions' tests can share one evaluator: no code of any of them runs there, each job gets a
    namespace of its own, and a run that fails as a whole is redone one job per run (`grade_programs`), so
    a value that makes its tests blow up costs its own solution only."""
    request = json.dumps(
        {
            "jobs": [
                {
                    "tests": [list(t) for t in plan.tests],
                    "values": values["probes"],
                    "calls": [[*call, value] for call, value in zip(plan.calls or (), values["calls"])],
                }
                for plan, values in jobs
            ],
            "modules": list(TEST_MODULES),
        }
    )
    return SandboxTask(code=_TEST_EVALUATOR, stdin=request, limits=limits)


def evaluation_scores(plans: Sequence[GradingPlan], evaluation: SandboxResult) -> list[float] | None:
    """Each job's fraction of tests passed, from the clean evaluator's verdict; None when the run failed
    or its verdict is out of shape."""
    if evaluation.status != "ok":
        return None
    lines = evaluation.stdout.splitlines()
    if len(lines) != 1:
        return None
    try:
        verdict = json.loads(lines[0])
    except ValueError:
        return None
    passed = verdict.get("passed") if isinstance(verdict, dict) else None
    if not isinstance(passed, list) or len(passed) != len(plans):
        return None
    scores = []
    for plan, job in zip(plans, passed):
        if not isinstance(job, list) or len(job) != plan.num_tests or not all(p is True or p is False for p in job):
            return None
        scores.append(sum(job) / plan.num_tests)
    return scores


def grading_score(
    result: SandboxResult, plan: GradingPlan, num_tests: int | None = None, pool_or_runner: Any = None
) -> float:
    """Finish grading a probe run from `grading_task`: run the tests in a clean sandbox (through
    `pool_or_runner`, as in grade_program) and return the fraction passed."""
    if not isinstance(plan, GradingPlan):
        raise TypeError("grading_score needs the GradingPlan that grading_task returned with the task")
    if num_tests is not None and num_tests != plan.num_tests:
        raise ValueError(f"num_tests={num_tests} but the plan has {plan.num_tests} tests")
    values = probe_values(result, plan)
    if values is None:
        return 0.0
    (evaluation,) = _run_tasks([evaluation_task([(plan, values)], plan.limits)], pool_or_runner)
    scores = evaluation_scores([plan], evaluation)
    return scores[0] if scores is not None else 0.0


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


def grade_program(
    solution_code: str, tests: Sequence[str], pool_or_runner: Any = None, limits: SandboxLimits | None = None
) -> tuple[float, SandboxResult]:
    """Run the solution in a sandbox and its tests in another; return (fraction passed, the solution's run).

    pool_or_runner: None (run here with `run_python`), a SandboxPool, a RaySandboxPool (anything with
    `map`), or a callable with run_python's signature. limits: None uses the pool's (or the defaults).
    The solution's probes run in order in one process: one that hangs the process costs all of them (the
    run times out and scores 0.0).
    """
    ((score, result),) = grade_programs([(solution_code, tests)], pool_or_runner, limits)
    return score, result


def grade_programs(
    items: Sequence[tuple[str, Sequence[str]]], pool_or_runner: Any = None, limits: SandboxLimits | None = None
) -> list[tuple[float, SandboxResult]]:
    """`grade_program` for a batch of (solution_code, tests): all probe runs through the pool at once,
    then the tests in clean evaluator runs of up to EVAL_BATCH solutions each (a failed one is redone one
    solution per run)."""
    plans = discover([plan_tests(tests, limits) for _, tests in items], pool_or_runner)
    built = [(_probe_task(code, plan), plan) for (code, _), plan in zip(items, plans)]
    probe_results = _run_tasks([task for task, _ in built], pool_or_runner)
    scores = [0.0] * len(built)
    jobs = []
    for i, ((_, plan), result) in enumerate(zip(built, probe_results)):
        values = probe_values(result, plan)
        if values is not None:
            jobs.append((i, plan, values))
    batches = [jobs[k : k + EVAL_BATCH] for k in range(0, len(jobs), EVAL_BATCH)]
    evaluations = _run_tasks([evaluation_task([(p, v) for _, p, v in b], limits) for b in batches], pool_or_runner)
    redo = []
    for batch, evaluation in zip(batches, evaluations):
        batch_scores = evaluation_scores([p for _, p, _ in batch], evaluation)
        if batch_scores is None:
            redo.extend(batch if len(batch) > 1 else [])
            continue
        for (i, _, _), score in zip(batch, batch_scores):
            scores[i] = score
    evaluations = _run_tasks([evaluation_task([(p, v)], limits) for _, p, v in redo], pool_or_runner)
    for (i, plan, _), evaluation in zip(redo, evaluations):
        single = evaluation_scores([plan], evaluation)
        scores[i] = single[0] if single is not None else 0.0
    return list(zip(scores, probe_results))
