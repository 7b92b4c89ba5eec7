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
    raise TypeError(f"a {t.__module__}.{t.__qualname__} cannot be graded: the tests see only None, bool, int, "
                    "float, complex, str, bytes, list, tuple, dict, set and frozenset values")


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
    values = []
    for i, (probe, modules) in enumerate(request["probes"]):
        try:
            for name in modules:
                if name not in namespace:
                    namespace[name] = __import__(name)
            value = eval(compile(probe, f"<probe {i}>", "eval"), namespace)
            values.append(["ok", _encode(value)])
        except BaseException as exc:
            # The nearest builtin exception class, so that a test expecting e.g. a ValueError (raised, or a
            # subclass of it) can catch it in the evaluator; the evaluator accepts only Exception subclasses.
            builtin = next((c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c),
                           "BaseException")
            values.append(["error", f"{type(exc).__name__}: {exc}"[:500], builtin])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    data = (json.dumps({"probes": values}) + "\n").encode()
    while data:
        data = data[os.write(result_fd, data):]
    os._exit(0)  # no atexit handler or finaliser of the solution's runs after the answer


_main()
