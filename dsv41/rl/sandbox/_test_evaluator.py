# The evaluation run's main.py (see grading.py): a clean interpreter, in which no code of the solution has
# run, evaluates the tests on the values the solution's probes reported, decoded into plain data, with
# type-strict ==, !=, in and not in. It writes one verdict line on the original stdout. In discovery mode
# (no solution at all) it runs the tests on placeholders and lists the calls they make on the probes.
import builtins
import importlib
import json
import operator
import os
import signal
import sys

_MAX_DEPTH = 64


class ProbeFailed(Exception):
    """The solution's probe raised, or reported something that is not plain data."""


def _decode(value, depth=0):
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is not dict or len(value) != 1:
        raise ValueError(f"not a tagged value: {type(value).__name__}")
    ((tag, body),) = value.items()
    if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
        return complex(body[0], body[1])
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag in ("list", "tuple", "set", "frozenset") and type(body) is list:
        items = [_decode(v, depth + 1) for v in body]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(body) is list and all(type(kv) is list and len(kv) == 2 for kv in body):
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in body}
    raise ValueError(f"unknown tag {tag!r}")


def _encode(value, depth=0):
    """Arguments of a call on the solution's function, as plain data (the key of the call's answer)."""
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    t = type(value)
    if value is None or t in (bool, int, float, str):
        return value
    if t is complex:
        return {"complex": [value.real, value.imag]}
    if t is bytes:
        return {"bytes": value.hex()}
    if t in (list, tuple, set, frozenset):
        return {t.__name__: [_encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"dict": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"a {t.__name__} cannot be passed to the solution (plain data only)")


def _call_key(k, args, kwargs):
    return json.dumps([k, _encode(list(args)), _encode(dict(kwargs))])


class _Unknown:
    """Discovery's stand-in for every value of the solution: callable, absorbing every operation, true,
    empty when iterated. Calls on a probe's stand-in with plain-data arguments are recorded."""

    def __init__(self, calls=None, k=None):
        self._calls, self._k = calls, k

    def __call__(self, *args, **kwargs):
        if self._k is not None:
            try:
                key = _call_key(self._k, args, kwargs)
            except (TypeError, ValueError):
                pass  # an argument that is itself unknown: that call cannot be listed
            else:
                self._calls.setdefault(key, [self._k, _encode(list(args)), _encode(dict(kwargs))])
        return _Unknown()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unknown()

    def __bool__(self):
        return True

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __index__(self):
        return 0

    __int__ = __index__

    def __float__(self):
        return 0.0

    def __hash__(self):
        return 0

    def __repr__(self):
        return "<unknown>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _absorb(self, *args, **kwargs):
    return _Unknown()


for _name in (
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "add",
    "radd",
    "sub",
    "rsub",
    "mul",
    "rmul",
    "truediv",
    "rtruediv",
    "floordiv",
    "rfloordiv",
    "mod",
    "rmod",
    "pow",
    "rpow",
    "neg",
    "pos",
    "abs",
    "invert",
    "and",
    "rand",
    "or",
    "ror",
    "xor",
    "rxor",
    "lshift",
    "rlshift",
    "rshift",
    "rrshift",
    "getitem",
    "contains",
    "round",
    "matmul",
    "rmatmul",
):
    setattr(_Unknown, f"__{_name}__", _absorb)


class _Proxy:
    """A function of the solution in the final evaluation: its calls are answered from the probe run's
    answers to the calls discovery listed; any other call fails the test."""

    def __init__(self, k, answers, decode_answer):
        self._k, self._answers, self._decode_answer = k, answers, decode_answer

    def __call__(self, *args, **kwargs):
        try:
            key = _call_key(self._k, args, kwargs)
        except (TypeError, ValueError) as exc:
            raise ProbeFailed(f"cannot call the solution with these arguments: {exc}") from None
        if key not in self._answers:
            raise ProbeFailed(
                "this call was not found by the discovery run (its arguments depend on what the solution returned)"
            )
        return self._decode_answer(self._answers[key])

    def __repr__(self):
        return f"<the solution's function #{self._k}>"


class _Opaque:
    """Equality for a value the test itself made (not plain data): same type and ==."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is _Opaque and type(self.value) is type(other.value) and self.value == other.value

    def __hash__(self):
        return 0


def _key(value):
    """A type-tagged canonical form: equal keys <=> equal values of equal types, recursively."""
    t = type(value)
    if t in (list, tuple):
        return (t.__name__, tuple(_key(v) for v in value))
    if t in (set, frozenset):
        return (t.__name__, frozenset(_key(v) for v in value))
    if t is dict:
        return ("dict", frozenset((_key(k), _key(v)) for k, v in value.items()))
    if value is None or t in (bool, int, float, complex, str, bytes):
        return (t.__name__, value)
    return ("other", _Opaque(value))


def _strict_eq(a, b):
    return _key(a) == _key(b)


def _strict_in(item, container):
    if type(container) in (str, bytes):
        return type(item) is type(container) and item in container
    if type(container) is dict:
        container = container.keys()
    elif type(container) not in (list, tuple, set, frozenset):
        return item in container  # something the test built itself (a range, a generator)
    k = _key(item)
    return any(_key(x) == k for x in container)


_OPS = {
    "==": _strict_eq,
    "!=": lambda a, b: not _strict_eq(a, b),
    "in": _strict_in,
    "not in": lambda a, b: not _strict_in(a, b),
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "is": operator.is_,
    "is not": operator.is_not,
}


def _compare(left, ops, thunks):
    for op, thunk in zip(ops, thunks):
        right = thunk()
        if not _OPS[op](left, right):
            return False
        left = right
    return True


def _answer_value(entry):
    """A probe's or a call's answer: the decoded value, or its exception re-raised."""
    status, payload = entry[:2]
    if status != "ok":
        # Re-raised as the builtin class the solution's exception derives from, so a test can expect it
        # (try/except ValueError); never SystemExit & co., which are not Exceptions, nor StopIteration.
        cls = getattr(builtins, entry[2], None)
        exc = ProbeFailed(payload)
        # StopIteration would end the test's own iteration early (all(map(f, ...)) of nothing is True).
        if (
            isinstance(cls, type)
            and issubclass(cls, Exception)
            and not issubclass(cls, (StopIteration, StopAsyncIteration))
        ):
            try:
                exc = cls(payload)
            except Exception:  # a class whose constructor wants more (UnicodeDecodeError)
                pass
        raise exc
    try:
        return _decode(payload)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ProbeFailed(f"the solution reported a value that is not plain data: {exc}") from None


class _TestTimeout(BaseException):
    pass


def _run_job(job, modules, discover):
    values = job["values"]
    calls = {}  # discovery: the calls found; evaluation: call key -> answer
    if not discover:
        for k, args, kwargs, answer in job.get("calls", []):
            calls[json.dumps([k, args, kwargs])] = answer

    def probe(k):
        if discover:
            return _Unknown(calls, k)
        entry = values[k]
        if entry[0] == "ok" and type(entry[1]) is dict and set(entry[1]) == {"callable"}:
            return _Proxy(k, calls, _answer_value)
        return _answer_value(entry)

    def discovery_compare(left, ops, thunks):
        for thunk in thunks:
            thunk()  # the comparators may call the solution too
        return True  # and whatever the values, keep going to find the calls that follow

    # A namespace per job: one solution's tests never see another's.
    namespace = {
        "__builtins__": builtins,
        "__name__": "__test__",
        "__dsv41_probe__": probe,
        "__dsv41_compare__": discovery_compare if discover else _compare,
        **modules,
    }
    passed = []
    for i, (source, is_expression) in enumerate(job["tests"]):
        if discover:
            # Placeholders are always true: a `while f(x):` would never end. A second per test is plenty.
            signal.setitimer(signal.ITIMER_REAL, 1.0)
        try:
            code = _without_asserts(source, is_expression) if discover else source
            if is_expression:
                ok = bool(eval(compile(code, f"<test {i}>", "eval"), namespace))
            else:
                exec(compile(code, f"<test {i}>", "exec"), namespace)
                ok = True
            if not ok and not discover:
                print(f"test {i} failed: the expression is false", file=sys.stderr)
        except BaseException as exc:
            if not discover:
                print(f"test {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            ok = False
        finally:
            if discover:
                signal.setitimer(signal.ITIMER_REAL, 0)
        passed.append(ok)
    return list(calls.values()) if discover else passed


def _without_asserts(source, is_expression):
    """Discovery runs every assert's condition but never stops at one (a loop of asserts goes on)."""
    import ast

    tree = ast.parse(source, mode="eval" if is_expression else "exec")

    class Unassert(ast.NodeTransformer):
        def visit_Assert(self, node):
            return ast.copy_location(ast.Expr(self.visit(node.test)), node)

    return ast.fix_missing_locations(Unassert().visit(tree))


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _main():
    request = json.loads(sys.stdin.read())
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)  # the tests' own prints go to stderr, away from the verdict
    modules = {name: importlib.import_module(name) for name in request["modules"]}
    discover = request.get("discover", False)
    signal.signal(signal.SIGALRM, _on_alarm)
    passed = []
    for j, job in enumerate(request["jobs"]):
        if len(request["jobs"]) > 1:
            print(f"job {j}:", file=sys.stderr)
        passed.append(_run_job(job, modules, discover))
    sys.stderr.flush()
    answer = {"calls": passed[0]} if discover else {"passed": passed}
    data = (json.dumps(answer) + "\n").encode()
    while data:
        data = data[os.write(result_fd, data) :]
    os._exit(0)


_main()
