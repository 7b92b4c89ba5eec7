# The probe run's main.py (see grading.py): imports the solution as a module named "solution" (so its
# `if __name__ == "__main__":` block does not run, as a grader importing it would), evaluates each probe in
# its namespace and writes the values, as tagged JSON, on the original stdout. It runs in the sandbox with
# the solution, which can change anything here: that only changes the values it reports, never how they
# are judged (the evaluator decodes them strictly, and the orchestrator bounds their size and depth).
import builtins
import itertools
import json
import os
import sys
import types

_PLAIN = (type(None), bool, int, float, str)
_MAX_DEPTH = 64
_MAX_ITEMS = 1_000_000  # elements an iterator may yield before it counts as endless
# Iterators of the standard library whose elements are the value (a generator, map(), zip()...): reported
# as their elements, so the tests can list(), sorted() or iterate them in the evaluator.
_ITERATORS = (
    types.GeneratorType,
    map,
    filter,
    zip,
    enumerate,
    reversed,
    type(iter([])),
    type(iter(())),
    type(iter(range(0))),
    type(iter("")),
    type(iter({})),
    type({}.keys()),
    type({}.values()),
    type({}.items()),
    itertools.chain,
    itertools.islice,
)


def _encode(value, depth=0):
    """Plain data only, of exactly these types (a subclass could redefine equality)."""
    if depth > _MAX_DEPTH:
        raise ValueError("the value is nested too deeply")
    t = type(value)
    if t in _PLAIN:
        return value
    if t is complex:
        return {"complex": [value.real, value.imag]}
    if t is bytes:
        return {"bytes": value.hex()}
    if t in (list, tuple, set, frozenset):
        return {t.__name__: [_encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"dict": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    if t is range:
        return {"range": [value.start, value.stop, value.step]}
    if t in _ITERATORS:
        items = list(itertools.islice(value, _MAX_ITEMS + 1))
        if len(items) > _MAX_ITEMS:
            raise ValueError(f"the iterator yields more than {_MAX_ITEMS} items")
        return {"iter": [_encode(v, depth + 1) for v in items]}
    raise TypeError(
        f"a {t.__module__}.{t.__qualname__} cannot be graded: the tests see only None, bool, int, "
        "float, complex, str, bytes, list, tuple, dict, set, frozenset, range and iterator values"
    )


def _decode(value, depth=0):
    """Arguments of the calls the tests make (plain data, from the clean discovery run)."""
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if value is None or type(value) in (bool, int, float, str):
        return value
    ((tag, body),) = value.items()
    if tag == "complex":
        return complex(*body)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag in ("list", "tuple", "set", "frozenset"):
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](
            _decode(v, depth + 1) for v in body
        )
    if tag == "dict":
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in body}
    if tag == "range":
        return range(*body)
    raise ValueError(f"unknown tag {tag!r}")


def _answer(fn, callables=False):
    try:
        value = fn()
        if callables and callable(value) and type(value) not in _PLAIN:
            # A function (or class) the tests may call: they get a stand-in whose calls were listed by
            # the discovery run and are answered below.
            return ["ok", {"callable": getattr(value, "__qualname__", type(value).__name__)[:200]}]
        return ["ok", _encode(value)]
    except BaseException as exc:
        # The nearest builtin exception class and the exception's arguments, so that a test expecting a
        # ValueError (raised, or a subclass of it) catches it in the evaluator and can read its message.
        builtin = next(
            (c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c), "BaseException"
        )
        try:
            args = _encode(list(exc.args))
        except BaseException:
            args = None
        return ["error", f"{type(exc).__name__}: {exc}"[:500], builtin, args]


def _main():
    request = json.loads(sys.stdin.read())
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)  # the solution's prints go to stderr, away from the answer
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the request is read: a solution reading input() gets EOF, not the grader's data
    os.close(null)
    module = types.ModuleType("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module  # dataclasses and pickle look a class's module up here
    namespace = module.__dict__
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:
        print(f"solution failed to load: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)
    for name in request["modules"]:  # modules the probes' arguments may use (math.pi)
        if name not in namespace:
            try:
                namespace[name] = __import__(name)
            except ImportError:
                pass
    objects = {}  # probe index -> what it evaluated to, for the calls the tests make on it

    def probe(i, source):
        objects[i] = value = eval(compile(source, f"<probe {i}>", "eval"), namespace)
        return value

    values = [
        _answer(lambda i=i, source=source: probe(i, source), callables=True)
        for i, source in enumerate(request["probes"])
    ]

    def call(k, args, kwargs):
        if k not in objects:
            raise LookupError(f"probe {k} has no value")
        return objects[k](*_decode(args), **_decode(kwargs))

    calls = [
        _answer(lambda k=k, args=args, kwargs=kwargs: call(k, args, kwargs)) for k, args, kwargs in request["calls"]
    ]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    data = (json.dumps({"probes": values, "calls": calls}) + "\n").encode()
    while data:
        data = data[os.write(result_fd, data) :]
    os._exit(0)  # no atexit handler or finaliser of the solution's runs after the answer


_main()
