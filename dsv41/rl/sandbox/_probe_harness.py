# The probe run's main.py (see grading.py): runs the solution, evaluates each probe in its namespace and
# writes the values, as tagged JSON, on the original stdout. It runs in the sandbox with the solution,
# which can change anything here: that only changes the values it reports, never how they are judged.
import builtins
import json
import os
import sys

_PLAIN = (type(None), bool, int, float, str)
_MAX_DEPTH = 64


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
    raise TypeError(
        f"a {t.__module__}.{t.__qualname__} cannot be graded: the tests see only None, bool, int, "
        "float, complex, str, bytes, list, tuple, dict, set and frozenset values"
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
        # The nearest builtin exception class, so that a test expecting e.g. a ValueError (raised, or a
        # subclass of it) can catch it in the evaluator; the evaluator accepts only Exception subclasses.
        builtin = next(
            (c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c), "BaseException"
        )
        return ["error", f"{type(exc).__name__}: {exc}"[:500], builtin]


def _main():
    request = json.loads(sys.stdin.read())
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)  # the solution's prints go to stderr, away from the answer
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:
        print(f"solution failed to load: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)
    objects = {}  # probe index -> what it evaluated to, for the calls the tests make on it

    def probe(i, source, modules):
        for name in modules:
            if name not in namespace:
                namespace[name] = __import__(name)
        objects[i] = value = eval(compile(source, f"<probe {i}>", "eval"), namespace)
        return value

    values = [
        _answer(lambda i=i, source=source, modules=modules: probe(i, source, modules), callables=True)
        for i, (source, modules) in enumerate(request["probes"])
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
