# The evaluation run's main.py (see grading.py): a clean interpreter, in which no code of the solution has
# run, evaluates the tests on the values the solution's probes reported, decoded into plain data, with
# type-strict ==, !=, in and not in. It writes one verdict line on the original stdout.
import builtins
import importlib
import json
import operator
import os
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
    (tag, body), = value.items()
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


_OPS = {"==": _strict_eq, "!=": lambda a, b: not _strict_eq(a, b), "in": _strict_in,
        "not in": lambda a, b: not _strict_in(a, b), "<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge, "is": operator.is_, "is not": operator.is_not}


def _compare(left, ops, thunks):
    for op, thunk in zip(ops, thunks):
        right = thunk()
        if not _OPS[op](left, right):
            return False
        left = right
    return True


def _run_job(job, modules):
    values = job["values"]

    def probe(k):
        status, payload = values[k][:2]
        if status != "ok":
            # Re-raised as the builtin class the solution's exception derives from, so a test can expect it
            # (try/except ValueError); never SystemExit & co., which are not Exceptions.
            cls = getattr(builtins, values[k][2], None)
            exc = ProbeFailed(payload)
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    exc = cls(payload)
                except Exception:  # a class whose constructor wants more (UnicodeDecodeError)
                    pass
            raise exc
        try:
            return _decode(payload)
        except (ValueError, TypeError, RecursionError) as exc:
            raise ProbeFailed(f"the solution reported a value that is not plain data: {exc}") from None

    # A namespace per job: one solution's tests never see another's.
    namespace = {"__builtins__": builtins, "__name__": "__test__", "__dsv41_probe__": probe,
                 "__dsv41_compare__": _compare, **modules}
    passed = []
    for i, (source, is_expression) in enumerate(job["tests"]):
        try:
            if is_expression:
                ok = bool(eval(compile(source, f"<test {i}>", "eval"), namespace))
            else:
                exec(compile(source, f"<test {i}>", "exec"), namespace)
                ok = True
            if not ok:
                print(f"test {i} failed: the expression is false", file=sys.stderr)
        except BaseException as exc:
            print(f"test {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            ok = False
        passed.append(ok)
    return passed


def _main():
    request = json.loads(sys.stdin.read())
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)  # the tests' own prints go to stderr, away from the verdict
    modules = {name: importlib.import_module(name) for name in request["modules"]}
    passed = []
    for j, job in enumerate(request["jobs"]):
        if len(request["jobs"]) > 1:
            print(f"job {j}:", file=sys.stderr)
        passed.append(_run_job(job, modules))
    sys.stderr.flush()
    data = (json.dumps({"passed": passed}) + "\n").encode()
    while data:
        data = data[os.write(result_fd, data):]
    os._exit(0)


_main()
