"""Cutting a task's tests into the solution's part and the evaluator's part (see grading.py).

A test is trusted Python written by the task. The orchestrator parses it and replaces each *probe*, the
smallest expression whose value only the solution can give, by `__dsv41_probe__(k, ...)`; only the
probes' source ever enters the solution's sandbox. Everything else, comparisons, method calls on what a
probe returned, conversions, the test's own names and modules, runs in the clean evaluator on plain data.

Which names are the solution's: a name the test reads but does not bind, that is not a builtin, not a
module in `TEST_MODULES`, not a standard module used as `module.attribute`, and not bound by a star
import of a standard module. Names a test makes in ways the parser cannot see (`exec`, a star import of a
module the orchestrator does not import) are caught in the evaluator: every probe carries its root name
and the original expression, and where the evaluator's namespace binds that name the test's own
expression is evaluated instead of the solution's answer.

Where a probe stops: at the first call on the solution's name (`f(3)`, `mod.f(3)`, `FUNCS[0](3)`), or at
the bare name when there is no call (`ANSWER`, then `ANSWER[-1]` in the evaluator). A method call on the
returned value (`f(3).startswith('12')`) is the evaluator's, on the plain value, so the solution cannot
answer it with an object of its own. One exception, decided by the test's text and never by the solution:
a call without arguments on a capitalised name, a class by convention, keeps one method call on the new
instance (`Solution().two_sum(nums, 9)`, LeetCode's form); `Find_Max(xs).count(1)` is cut after the call.
"""

from __future__ import annotations

import ast
import builtins
import copy
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv41.rl.sandbox.config import SandboxLimits

# Standard modules a test may use without importing them, whatever the use (they resolve in the evaluator).
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
# Any other standard module is the test's when used as `module.attribute` (json.loads(...)): a function of
# the solution that happens to share a module's name is still the solution's when called bare.
_STDLIB = frozenset(name for name in sys.stdlib_module_names if not name.startswith("_"))

# Names the rewritten tests use to reach the evaluator's helpers; a test may not use them itself.
PROBE_FN, COMPARE_FN = "__dsv41_probe__", "__dsv41_compare__"
_BUILTIN_NAMES = frozenset(dir(builtins))


def bound_names(tree: ast.AST) -> set[str]:
    """Every name `tree` binds anywhere (assignment targets, loop/comprehension/with/except targets,
    parameters, imports, def/class names, global/nonlocal declarations); star imports of standard
    modules bind their public names."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            bound |= _star_names(node)
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


def _star_names(node: ast.ImportFrom) -> set[str]:
    """The names `from M import *` binds, for a standard module M (imported here to list them; any other
    module is not imported into the trainer, and the evaluator catches its names at run time)."""
    module = node.module or ""
    if node.level or module.split(".")[0] not in _STDLIB:
        return set()
    try:
        mod = importlib.import_module(module)
    except Exception:  # a module this interpreter lacks: the test fails in the evaluator the same way
        return set()
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    return {n for n in names if isinstance(n, str)}


def free_names(tree: ast.AST) -> set[str]:
    """Names `tree` reads without binding them itself."""
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - bound_names(tree)


def _chain(node: ast.AST) -> list[ast.AST]:
    """The attribute/subscript/call chain ending at `node`, root first: `f(3).x` -> [f, f(3), f(3).x]."""
    out = [node]
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
        out.append(node)
    return out[::-1]


def _cut(chain: list[ast.AST]) -> ast.AST:
    """The probe within a chain rooted at a solution's name (see the module docstring)."""
    first_call = next((i for i, n in enumerate(chain) if isinstance(n, ast.Call)), None)
    if first_call is None:
        return chain[0]
    root = chain[0]
    if (
        first_call == 1
        and isinstance(root, ast.Name)
        and root.id[:1].isupper()
        and not chain[1].args
        and not chain[1].keywords
        and len(chain) > 2
        and isinstance(chain[2], ast.Attribute)
    ):
        return chain[3] if len(chain) > 3 and isinstance(chain[3], ast.Call) else chain[2]
    return chain[first_call]


def _is_store_target(node: ast.AST) -> bool:
    return isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))


_EQ_OPS = (ast.Eq,)


class _Rewriter(ast.NodeTransformer):
    """Replaces probes by `__dsv41_probe__(k, root, lambda: <original>)` and `==` comparisons by
    `__dsv41_compare__(left, ops, thunks)`; collects the probes' source in evaluation order."""

    def __init__(self, tree: ast.AST, test_names: set[str], probes: list[str], modules: set[str]):
        self.test_names = test_names  # bound by this test or an earlier one
        self.probes = probes
        self.modules = modules  # standard modules the tests use unimported
        self.dynamic = False  # whether the tests may call what a probe returns
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        # Standard modules this test uses as `module.attribute`: the name is the module's throughout.
        self.attribute_modules = {
            n.value.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in _STDLIB
        }

    def _is_solution_name(self, name: str, chain: list[ast.AST]) -> bool:
        if name in self.test_names or name in _BUILTIN_NAMES:
            return False
        if name in TEST_MODULES:
            self.modules.add(name)
            return False
        if name in self.attribute_modules:
            self.modules.add(name)
            return False
        return True

    def _passive(self, node: ast.AST) -> bool:
        """Whether a bare name's value is only looked at (indexed, compared, converted by a builtin), not
        possibly called by the test with values of its own (check(f), g = f): then no discovery is needed."""
        parent = self.parents.get(node)
        if isinstance(parent, (ast.Subscript, ast.Attribute)) and parent.value is node:
            return True
        if isinstance(parent, (ast.Compare, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Expr, ast.FormattedValue)):
            return True
        return (
            isinstance(parent, ast.Call)
            and node in parent.args
            and isinstance(parent.func, ast.Name)
            and parent.func.id in _BUILTIN_NAMES
            and parent.func.id not in self.test_names
        )

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Compare) and not _is_store_target(node):
            chain = _chain(node)
            root = chain[0]
            if isinstance(root, ast.Name) and isinstance(root.ctx, ast.Load):
                if self._is_solution_name(root.id, chain):
                    cut = _cut(chain)
                    if node is cut:
                        if not free_names(node) & self.test_names:
                            return self._probe(node, root.id)
                        # The call uses the test's own variables (f(x) in a loop): the callee is the probe
                        # and its calls are found by the discovery run (see grading.py).
                        self.dynamic = True
        return super().visit(node)

    def _probe(self, node: ast.expr, root: str) -> ast.expr:
        self.probes.append(ast.unparse(node))
        if not isinstance(node, ast.Call) and not self._passive(node):
            self.dynamic = True  # a bare function may be called by the test later (check(candidate))
        # The original expression rides along: where the evaluator's namespace binds `root` (an exec, a star
        # import of a module not imported here), it is the test's own name and evaluated there.
        original = ast.Lambda(_no_args(), copy.deepcopy(node))
        call = ast.Call(
            func=ast.Name(PROBE_FN, ast.Load()),
            args=[ast.Constant(len(self.probes) - 1), ast.Constant(root), original],
            keywords=[],
        )
        return ast.copy_location(call, node)

    def visit_Compare(self, node: ast.Compare) -> Any:
        node = self.generic_visit(node)
        if not any(isinstance(op, _EQ_OPS) for op in node.ops):
            return node
        # Only == is the evaluator's own (int/float per the reference, bool never a number); !=, in, not in
        # and the orderings are Python's, on plain values.
        thunks = [ast.Lambda(_no_args(), c) for c in node.comparators]
        ops = ast.Tuple([ast.Constant(_OP_NAMES[type(op)]) for op in node.ops], ast.Load())
        call = ast.Call(
            func=ast.Name(COMPARE_FN, ast.Load()), args=[node.left, ops, ast.Tuple(thunks, ast.Load())], keywords=[]
        )
        return ast.copy_location(call, node)


def _no_args() -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])


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


@dataclass(frozen=True)
class GradingPlan:
    """What the orchestrator keeps of a grading job: the rewritten tests (for the clean evaluator only)
    and the probes (the only part of the tests the solution's process ever sees)."""

    tests: tuple[tuple[str, bool], ...]  # (rewritten source, whether it is a single expression)
    probes: tuple[str, ...]  # probe sources, in evaluation order
    limits: SandboxLimits | None
    modules: tuple[str, ...] = ()  # standard modules the evaluator imports for the tests
    literals: tuple[str, ...] = ()  # the tests' string constants: the only code eval/exec may run there
    # Whether the tests may call a function the solution returns (a loop over f(x), check(candidate)):
    # then a discovery run (the tests on placeholders, no solution involved) lists those calls first.
    needs_discovery: bool = False
    calls: tuple | None = None  # discovered: ((probe index, encoded args, encoded kwargs), ...)

    @property
    def num_tests(self) -> int:
        return len(self.tests)


def plan_tests(tests: Sequence[str], limits: SandboxLimits | None = None) -> GradingPlan:
    """Split `tests` into probes and rewritten tests. Raises ValueError for tests that are not valid
    Python or that use the evaluator's reserved names (tests are the task's: a caller's error)."""
    if isinstance(tests, str):
        raise ValueError("tests must be a non-empty list of strings, got a single string")
    tests = list(tests)
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("tests must be a non-empty list of strings")
    probes: list[str] = []
    modules: set[str] = set()
    literals: set[str] = set()
    rewritten: list[tuple[str, bool]] = []
    test_names: set[str] = set()  # a test may use what an earlier one defined, as in one script
    dynamic = False
    for i, test in enumerate(tests):
        try:
            tree = ast.parse(test, filename=f"<test {i}>", mode="exec")
        except SyntaxError as exc:
            raise ValueError(f"test {i} is not valid Python: {exc.msg} ({test!r})") from None
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if names & {PROBE_FN, COMPARE_FN}:
            raise ValueError(f"test {i} uses a name reserved for the grader ({PROBE_FN}, {COMPARE_FN})")
        literals |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        test_names |= bound_names(tree)
        rewriter = _Rewriter(tree, test_names, probes, modules)
        tree = rewriter.visit(tree)
        dynamic = dynamic or rewriter.dynamic
        ast.fix_missing_locations(tree)
        is_expression = len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)
        source = ast.unparse(tree.body[0].value) if is_expression else ast.unparse(tree)
        rewritten.append((source, is_expression))
    return GradingPlan(
        tuple(rewritten),
        tuple(probes),
        limits,
        modules=tuple(sorted(modules)),
        literals=tuple(sorted(literals)),
        needs_discovery=dynamic,
    )
