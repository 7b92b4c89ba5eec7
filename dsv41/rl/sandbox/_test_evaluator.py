# The evaluation run's main.py (see grading.py): a clean interpreter, in which no code of the solution has
# run, evaluates each solution's tests on the values its probes reported, decoded into plain data, each
# solution in a process of its own (`_run_apart`). `==` is
# the grader's (bool is never a number; int and float per the reference), every other operator and every
# method call is Python's on those plain values. It writes one verdict line on the original stdout. In
# discovery mode (no solution at all) it runs the tests on placeholders and lists the calls they make on
# the probes.
import builtins
import importlib
import json
import operator
import os
import random
import select
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
    if tag == "range" and type(body) is list and len(body) == 3 and all(type(x) is int for x in body):
        return range(*body)
    if tag == "iter" and type(body) is list:
        return iter([_decode(v, depth + 1) for v in body])
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
    if t in (list, tuple):
        return {t.__name__: [_encode(v, depth + 1) for v in value]}
    if t in (set, frozenset):
        # Sorted by encoding: a set's iteration order differs between processes (str hashes are salted per
        # interpreter), and discovery's key for a call must be the evaluation's.
        items = [_encode(v, depth + 1) for v in value]
        return {t.__name__: sorted(items, key=lambda e: json.dumps(e, sort_keys=True))}
    if t is dict:
        return {"dict": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    if t is range:
        return {"range": [value.start, value.stop, value.step]}
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


def _key(value, int_float):
    """A type-tagged canonical form: equal keys <=> equal values of equal types, recursively; with
    `int_float`, an int and a float are one type ("num"), compared by value as Python does. bool is
    never a number here: True for 1 is the classic wrong answer that Python's == would let through."""
    t = type(value)
    if t in (list, tuple):
        return (t.__name__, tuple(_key(v, int_float) for v in value))
    if t in (set, frozenset):
        return (t.__name__, frozenset(_key(v, int_float) for v in value))
    if t is dict:
        return ("dict", frozenset((_key(k, int_float), _key(v, int_float)) for k, v in value.items()))
    if int_float and t in (int, float):
        return ("num", value)
    if value is None or t in (bool, int, float, complex, str, bytes, range):
        return (t.__name__, value)
    return ("other", _Opaque(value))


_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict, range)


def _ops(int_float):
    def equal(a, b):
        if type(a) not in _PLAIN_TYPES or type(b) not in _PLAIN_TYPES:
            # A value the tests made themselves (a Fraction, a Decimal, their own class): the solution's
            # values are all plain, so this is the tests' own equality, trusted, and Python's.
            return a == b
        return _key(a, int_float) == _key(b, int_float)

    # Only == is the grader's own; every other operator is Python's, on plain values only: no object of
    # the solution ever reaches here, so `f(5) != 0` fails for 0.0 and False as Python says.
    return {
        "==": equal,
        "!=": operator.ne,
        "in": lambda a, b: operator.contains(b, a),
        "not in": lambda a, b: not operator.contains(b, a),
        "<": operator.lt,
        "<=": operator.le,
        ">": operator.gt,
        ">=": operator.ge,
        "is": operator.is_,
        "is not": operator.is_not,
    }


def _comparer(int_float):
    ops = _ops(int_float)

    def compare(left, names, thunks):
        for op, thunk in zip(names, thunks):
            right = thunk()
            if not ops[op](left, right):
                return False
            left = right
        return True

    return compare


def _answer_value(entry):
    """A probe's or a call's answer: the decoded value, or its exception re-raised."""
    if type(entry) is not list or not entry:
        raise ProbeFailed("the solution reported a malformed answer")
    status, payload = entry[0], entry[1] if len(entry) > 1 else None
    if status != "ok":
        # Re-raised as the builtin class the solution's exception derives from, with its arguments, so a
        # test can expect it (try/except ValueError) and read its message; never SystemExit & co., which
        # are not Exceptions, nor StopIteration, which would end the test's own iteration early
        # (all(map(f, ...)) of nothing is True).
        cls = getattr(builtins, entry[2], None) if len(entry) > 2 and type(entry[2]) is str else None
        exc = ProbeFailed(payload)
        if (
            isinstance(cls, type)
            and issubclass(cls, Exception)
            and not issubclass(cls, (StopIteration, StopAsyncIteration))
        ):
            try:
                args = _decode(entry[3]) if len(entry) > 3 and entry[3] is not None else [payload]
                exc = cls(*args) if type(args) is list else cls(payload)
            except Exception:  # a class whose constructor wants other arguments (UnicodeDecodeError)
                pass
        raise exc
    try:
        return _decode(payload)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ProbeFailed(f"the solution reported a value that is not plain data: {exc}") from None


class _TestTimeout(BaseException):
    pass


def _isolated_eval(real_eval, source, globals_=None, locals_=None):
    """eval() of a string the tests did not write themselves (a solution's answer): it is the solution's
    code, so it runs in a child process that holds no descriptor but its answer pipe, and only the plain
    value it reports comes back, decoded as strictly as a probe's. The child can kill this process, which
    fails this solution's grading and nothing else."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.closerange(0, w)  # stdio and the verdict's descriptor among them
            os.closerange(w + 1, 1 << 16)
            try:
                entry = ["ok", _encode_answer(real_eval(source, globals_, locals_))]
            except BaseException as exc:
                entry = ["error", f"{type(exc).__name__}: {exc}"[:500], _builtin_name(exc), None]
            data = json.dumps(entry).encode()
            while data:
                data = data[os.write(w, data) :]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        entry = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise ProbeFailed("code the solution returned reported nothing readable") from None
    return _answer_value(entry)


def _encode_answer(value):
    # What eval() of a solution's string returned, encoded as a probe's answer would be; an iterator over
    # a list (iter([...])) is the one non-plain value the evaluator makes of a reported iterator.
    try:
        return _encode(value)
    except TypeError:
        if type(value) is type(iter([])):
            return {"iter": [_encode(v) for v in value]}
        raise


def _builtin_name(exc):
    return next((c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c), "BaseException")


def _guarded_builtins(literals, discover):
    """The tests' builtins: eval, exec and compile run the tests' own string literals as Python would;
    a string from anywhere else came from the solution: eval() runs it apart (`_isolated_eval`), exec()
    and compile() refuse it (their effects could not be brought back as plain data)."""
    real_eval, real_exec, real_compile = builtins.eval, builtins.exec, builtins.compile
    allowed = frozenset(literals)

    def own(source):
        return not isinstance(source, (str, bytes)) or source in allowed

    def scope(globals_, locals_):
        # Without a namespace, eval and exec use their caller's: the test's frame, not this function's.
        if globals_ is None:
            frame = sys._getframe(2)
            return frame.f_globals, frame.f_locals if locals_ is None else locals_
        return globals_, locals_

    def guarded_eval(source, globals_=None, locals_=None):
        globals_, locals_ = scope(globals_, locals_)
        if own(source) or discover:
            return real_eval(source, globals_, locals_)
        return _isolated_eval(real_eval, source, globals_, locals_)

    def guarded_exec(source, globals_=None, locals_=None, **kwargs):
        globals_, locals_ = scope(globals_, locals_)
        if not own(source) and not discover:
            raise ProbeFailed("the tests may not exec() code the solution returned")
        return real_exec(source, globals_, locals_, **kwargs)

    def guarded_compile(source, *args, **kwargs):
        if not own(source) and not discover:
            raise ProbeFailed("the tests may not compile() code the solution returned")
        if not isinstance(source, (str, bytes)) and not discover and type(source).__module__ == "ast":
            raise ProbeFailed("the tests may not compile() a syntax tree (it may hold the solution's code)")
        return real_compile(source, *args, **kwargs)

    table = dict(vars(builtins))
    table.update(eval=guarded_eval, exec=guarded_exec, compile=guarded_compile)
    return table


def _run_job(job, modules, discover):
    answer = job.get("answer") or {"probes": [], "calls": []}
    values = answer["probes"]
    int_float = bool(job.get("int_float", True))
    calls = {}  # discovery: the calls found; evaluation: call key -> answer
    if not discover:
        for (k, args, kwargs), value in zip(job.get("calls", []), answer["calls"]):
            calls[json.dumps([k, args, kwargs])] = value
    namespace = {}

    def probe(k, root, original):
        if root in namespace:
            # The tests bound this name themselves in a way the orchestrator could not see (an exec, a
            # star import): it is theirs, evaluated here, whatever the solution answered.
            return original()
        if discover:
            return _Unknown(calls, k)
        entry = values[k]
        if type(entry) is list and entry[:1] == ["ok"] and type(entry[1]) is dict and set(entry[1]) == {"callable"}:
            return _Proxy(k, calls, _answer_value)
        return _answer_value(entry)

    def discovery_compare(left, ops, thunks):
        for thunk in thunks:
            thunk()  # the comparators may call the solution too
        return True  # and whatever the values, keep going to find the calls that follow

    # One solution per evaluator process (grading.py): nothing here is shared with another solution.
    namespace.update(
        {
            "__builtins__": _guarded_builtins(job.get("literals", []), discover),
            "__name__": "__test__",
            "__dsv41_probe__": probe,
            "__dsv41_compare__": discovery_compare if discover else _comparer(int_float),
            **modules,
        }
    )
    passed = []
    for i, (source, is_expression) in enumerate(job["tests"]):
        # The same pseudo-random draws in discovery and evaluation: a test that calls the solution on
        # random inputs asks the calls discovery listed.
        random.seed(f"dsv41-test-{i}")
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


def _refuse_loading_code():
    """pickle turns bytes into running code (a pickle's __reduce__ calls anything): bytes from the
    solution, unpickled by a test, would run the solution's code where its verdict is written. Loading is
    refused here, before any test runs; dumping still works. (marshal.loads is left alone: the import
    system reads every .pyc with it, and it makes code objects without running them.)"""
    import pickle

    def refuse(*args, **kwargs):
        raise ProbeFailed("the tests may not unpickle data in the grader (unpickling may run code)")

    class Unpickler:
        def __init__(self, *args, **kwargs):
            refuse()

    pickle.loads = pickle.load = pickle._loads = pickle._load = refuse
    pickle.Unpickler = pickle._Unpickler = Unpickler


def _on_alarm(signum, frame):
    raise _TestTimeout()


_MAX_REPLY = 64 << 20  # a job's reply (its verdict, or discovery's calls) larger than this is a failure


def _run_apart(job, modules, discover, result_fd):
    """One solution's tests in a child process of their own: the child holds no descriptor of this
    process's but its reply pipe (not the verdict's), so nothing that happens there, even code of the
    solution run by a test through an interface nobody guarded, can write another solution's verdict or
    this process's. Once the child has exited, kill(-1) ends whatever it left (every process of this
    sandbox but this one and the pid namespace's init), so the next solution starts clean. Returns the
    child's reply, or None when it did not give one."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.close(result_fd)
            data = json.dumps(_run_job(job, modules, discover)).encode()
            while data:
                data = data[os.write(w, data) :]
        finally:
            os._exit(0)
    os.close(w)
    chunks, size, exited = [], 0, False
    while True:
        if not exited and os.waitpid(pid, os.WNOHANG)[0]:
            exited = True
            _kill_leftovers()  # a leftover holding the pipe open would keep the read below waiting
        if not select.select([r], [], [], 0.05)[0]:
            continue
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        size += len(chunk)
        if size > _MAX_REPLY:
            chunks = None
            break
        chunks.append(chunk)
    os.close(r)
    if not exited:
        os.waitpid(pid, 0)
    _kill_leftovers()
    try:
        return json.loads(b"".join(chunks)) if chunks is not None else None
    except (ValueError, RecursionError):
        return None


def _kill_leftovers():
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass  # nothing left to signal


def _main():
    # The work directory is not a place to import from: code run apart by _isolated_eval could leave a
    # module there for a later `import` of the tests.
    here = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", here)]
    request = json.loads(sys.stdin.read())
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)  # the tests' own prints go to stderr, away from the verdict
    modules = {}
    for name in request["modules"]:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:
            pass  # the test that uses it fails with a NameError, as it would anywhere
    discover = request.get("discover", False)
    _refuse_loading_code()
    signal.signal(signal.SIGALRM, _on_alarm)
    replies = []
    for j, job in enumerate(request["jobs"]):
        if len(request["jobs"]) > 1:
            print(f"job {j}:", file=sys.stderr, flush=True)
        replies.append(_run_apart(job, modules, discover, result_fd))
    sys.stderr.flush()
    answer = {"calls": replies[0] or []} if discover else {"passed": replies}
    data = (json.dumps(answer) + "\n").encode()
    while data:
        data = data[os.write(result_fd, data) :]
    os._exit(0)


_main()
