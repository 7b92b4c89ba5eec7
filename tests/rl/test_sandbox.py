"""Containment tests of the RL sandbox orchestrator (dsv41/rl/sandbox.py, training.md §8).

Each containment test checks the kernel layer on its own where one is in force (through ctypes, which the
audit hook does not see) and the audit hook on its own (its own error message), so that losing either
layer fails a test instead of being masked by the other.
"""

import dataclasses
import json
import os
import re
import socket
import time

import pytest

from dsv41.rl.sandbox import (
    RaySandboxPool,
    SandboxLimits,
    SandboxPool,
    SandboxResult,
    SandboxTask,
    grade_program,
    grade_programs,
    run_python,
    sandbox_uid,
)

AS_ROOT = os.geteuid() == 0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = SandboxLimits(cpu_time_s=1, wall_time_s=3, memory_bytes=256 << 20, file_size_bytes=1 << 20, max_processes=8)
GRACE_S = 2.5  # wall limit + the launcher's stop grace + cleanup, on a loaded 2-core machine

INFINITE_LOOP = "while True:\n    pass\n"
# A session-escaping sleeper first (it must be killed too), then the bomb. The sleeper names itself (its
# pid is the sandbox's pid namespace's, unknown outside) and prints that name, so its end can be checked
# in /proc as any user.
FORK_BOMB = (
    "import ctypes, os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    name = f'slp{os.urandom(5).hex()}'\n"
    "    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME\n"
    "    print('sleeper', name, flush=True)\n"
    "    time.sleep(60)\n"
    "    os._exit(0)\n"
    "while True:\n"
    "    os.fork()\n"
)
MEMORY_HOG = "x = bytearray(2 * 1024 ** 3)\nprint(len(x))\n"
FILE_BOMB = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (100 << 20))\n"


def live_processes_of_uid(uid):
    """Pids whose real uid is `uid`, zombies included."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(int(entry))
                            break
            except OSError:
                pass
    return pids


def sleeper_names(result):
    """The names FORK_BOMB's sleeper gave itself, from a run's output."""
    return re.findall(r"^sleeper (slp[0-9a-f]+)$", result.stdout, re.M)


def processes_named(name):
    """(host pid, state) of the processes whose name is `name`, zombies included."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
            if comm == name:
                found.append((int(entry), rest.split()[0]))  # R, S, Z (a zombie nobody reaped), ...
    return found


def assert_no_leftovers(result):
    # in every mode: a sleeper that reported its name is gone (a zombie still has its /proc entry)
    for name in sleeper_names(result):
        for pid, state in processes_named(name):
            raise AssertionError(f"the sleeper (pid {pid}, state {state}) outlived its run")
    if AS_ROOT:
        assert result.isolation["uid"] == sandbox_uid(result.slot)
        assert live_processes_of_uid(sandbox_uid(result.slot)) == []


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(max_workers=2, limits=SMALL) as p:
        yield p


def test_limits_are_validated():
    with pytest.raises(ValueError, match="cpu_time_s"):
        SandboxLimits(cpu_time_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=-1)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=1.5)
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=float("inf"))


def test_normal_program_output_files_stdin_and_cleanup():
    code = (
        "import os, sys, helper\n"
        "print('cwd', os.getcwd())\n"
        "print(open('data/in.txt').read())\n"
        "print('helper', helper.VALUE)\n"
        "print('stdin', len(sys.stdin.read()))\n"
        "print('warn', file=sys.stderr)\n"
    )
    result = run_python(code, stdin="z" * 1_000_000, files={"data/in.txt": "hello", "helper.py": "VALUE = 7"})
    assert result.ok and result.passed and result.status == "ok" and result.exit_code == 0
    lines = result.stdout.splitlines()
    workdir = lines[0].split(" ", 1)[1]
    assert lines[1:] == ["hello", "helper 7", "stdin 1000000"]
    assert result.stderr == "warn\n"
    assert not os.path.exists(workdir), "the per-run directory must be removed"
    assert result.isolation["rlimits"] and result.isolation["audit_hook"]
    assert result.wall_s > 0 and result.cpu_s > 0


def test_invalid_arguments_raise_and_pool_turns_them_into_error_results(pool):
    with pytest.raises(ValueError, match="relative path"):
        run_python("pass", files={"/etc/evil": "x"})
    with pytest.raises(ValueError, match="reserved"):
        run_python("pass", files={"main.py": "x"})
    result = pool.submit("pass", files={"../up.txt": "x"}).result()
    assert result.status == "error" and "sandbox runner failed" in result.stderr
    assert pool.submit("print(1)").result().stdout == "1\n"


def test_infinite_loop_is_stopped_and_pool_keeps_serving(pool):
    result = pool.submit(INFINITE_LOOP).result()
    assert result.status in ("cpu_limit", "timeout")
    assert result.wall_s < SMALL.wall_time_s + GRACE_S
    assert pool.submit("print('alive')").result().stdout == "alive\n"


def test_fork_bomb_is_contained_and_leaves_nothing_behind(pool):
    start = time.monotonic()
    result = pool.submit(FORK_BOMB).result()
    assert not result.ok
    if AS_ROOT:  # RLIMIT_NPROC is only enforced for the unprivileged sandbox uid
        assert result.status == "process_limit", result
    assert time.monotonic() - start < SMALL.wall_time_s + GRACE_S
    assert len(sleeper_names(result)) == 1, result.stdout  # the check below cannot pass by default
    assert_no_leftovers(result)
    after = pool.map(["print(6 * 7)"] * 2)
    assert [r.stdout for r in after] == ["42\n", "42\n"]


def test_memory_hog_hits_memory_limit(pool):
    result = pool.submit(MEMORY_HOG).result()
    assert result.status == "memory_limit", result
    assert "MemoryError" in result.stderr


def test_file_size_bomb_hits_file_size_limit(pool):
    result = pool.submit(FILE_BOMB).result()
    assert result.status == "file_size_limit", result


def test_filesystem_outside_the_sandbox_is_denied(tmp_path):
    secret = "s3cr3t-" + os.urandom(8).hex()
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    os.chmod(tmp_path, 0o755)  # readable for everyone: only the sandbox may stop the program
    os.chmod(secret_file, 0o644)
    escape = str(tmp_path / "escaped.txt")
    targets = {
        "secret": str(secret_file),
        "readme": os.path.join(REPO_ROOT, "README.md"),
        "this_test": os.path.abspath(__file__),
    }
    code = f"""
import ctypes, json, os
targets = {targets!r}
report = {{}}
for name, path in targets.items():
    try:
        report[name] = "READ:" + open(path).read()
    except Exception as e:
        report[name] = type(e).__name__ + ": " + str(e)
for name, path in [("list_repo", {REPO_ROOT!r}), ("list_tmp", {str(tmp_path)!r}), ("list_root", "/")]:
    try:
        report[name] = "LISTED:" + ",".join(os.listdir(path))
    except Exception as e:
        report[name] = type(e).__name__ + ": " + str(e)
try:
    open({escape!r}, "w").write("out")
    report["write"] = "WROTE"
except Exception as e:
    report["write"] = type(e).__name__ + ": " + str(e)
# The same reads below the audit hook, straight through libc: only the kernel can refuse these.
try:
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("secret", "readme"):
        fd = libc.open(targets[name].encode(), os.O_RDONLY)
        report["c_" + name] = "OPENED" if fd >= 0 else "errno " + str(ctypes.get_errno())
except Exception as e:
    report["c_blocked"] = type(e).__name__ + ": " + str(e)
print(json.dumps(report))
"""
    result = run_python(code, limits=SMALL)
    assert result.ok, result
    assert secret not in result.stdout and secret not in result.stderr
    report = json.loads(result.stdout)
    for name in ("secret", "readme", "this_test", "list_repo", "list_tmp", "list_root", "write"):
        # Refused by the audit hook, whose message says so (the kernel layers are checked below).
        assert report[name].startswith("PermissionError: [Errno 13] sandbox:"), (name, report[name])
    assert not os.path.exists(escape)
    if result.isolation["landlock"]:
        assert report["c_secret"] == "errno 13" and report["c_readme"] == "errno 13", report
    else:  # fallback: the strict audit hook refuses ctypes calls altogether
        assert report["c_blocked"].startswith("PermissionError"), report


def test_network_is_denied():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.3)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.3)
    tcp_port, udp_port = listener.getsockname()[1], udp.getsockname()[1]
    code = f"""
import ctypes, json, os, socket, struct
report = {{}}
try:
    socket.create_connection(("127.0.0.1", {tcp_port}), timeout=1)
    report["connect"] = "CONNECTED"
except Exception as e:
    report["connect"] = type(e).__name__ + ": " + str(e)
try:
    socket.socket()
    report["socket"] = "CREATED"
except Exception as e:
    report["socket"] = type(e).__name__ + ": " + str(e)
# Below the audit hook: raw libc TCP connect and UDP send to the test's sockets.
try:
    libc = ctypes.CDLL(None, use_errno=True)
    def addr(port):
        return struct.pack("<HH4s8x", socket.AF_INET, socket.htons(port), bytes([127, 0, 0, 1]))
    s = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    report["c_tcp"] = libc.connect(s, addr({tcp_port}), 16)
    u = libc.socket(socket.AF_INET, socket.SOCK_DGRAM, 0)
    report["c_udp"] = libc.sendto(u, b"leak", 4, 0, addr({udp_port}), 16)
except Exception as e:
    report["c_blocked"] = type(e).__name__ + ": " + str(e)
print(json.dumps(report))
"""
    try:
        result = run_python(code, limits=SMALL)
        assert result.ok, result
        report = json.loads(result.stdout)
        assert report["connect"].startswith("PermissionError: [Errno 13] sandbox:"), report
        assert report["socket"].startswith("PermissionError: [Errno 13] sandbox:"), report
        if result.isolation["network_namespace"] and result.isolation["landlock"]:
            assert report["c_tcp"] == -1 and report["c_udp"] == -1, report
        else:
            assert "c_blocked" in report or (report["c_tcp"] == -1 and report["c_udp"] == -1), report
        with pytest.raises(socket.timeout):
            listener.accept()
        with pytest.raises(socket.timeout):
            udp.recvfrom(16)
    finally:
        listener.close()
        udp.close()


def test_network_true_is_a_private_loopback():
    """network=True gives the program sockets and a loopback of its own: it can talk to itself over
    127.0.0.1, but neither reaches the host's loopback services nor binds the host's ports (on main it
    shared the host's network: this test failed there, the connection to the host listener succeeded)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.3)
    host_port = listener.getsockname()[1]
    code = f"""
import json, socket
report = {{}}
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
client = socket.create_connection(server.getsockname(), timeout=2)
peer, _ = server.accept()
client.sendall(b"ping")
report["self"] = peer.recv(4).decode()
try:
    socket.create_connection(("127.0.0.1", {host_port}), timeout=1)
    report["host"] = "CONNECTED"
except OSError as e:
    report["host"] = type(e).__name__
print(json.dumps(report))
"""
    try:
        result = run_python(code, limits=dataclasses.replace(SMALL, network=True))
        assert result.ok, result
        assert json.loads(result.stdout) == {"self": "ping", "host": "ConnectionRefusedError"}
        assert result.isolation["network_namespace"] is True and result.isolation["loopback"] is True
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_output_is_truncated_but_drained():
    limits = SandboxLimits(max_output_bytes=64 * 1024)
    result = run_python("import sys\nsys.stdout.write('x' * 10_000_000)\nprint('done', file=sys.stderr)", limits=limits)
    assert result.status == "ok"
    assert result.stdout_truncated and not result.stderr_truncated
    assert len(result.stdout) <= limits.max_output_bytes and set(result.stdout) == {"x"}
    assert result.stderr == "done\n"


def test_pool_runs_bad_and_good_tasks_concurrently_in_order(tmp_path):
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("top-secret")
    bad = [INFINITE_LOOP, FORK_BOMB, MEMORY_HOG, f"print(open({str(secret_file)!r}).read())"]
    tasks = []
    for i in range(8):
        if i % 2:
            tasks.append(bad[i // 2])
        else:
            tasks.append(SandboxTask(code=f"import sys\nprint({i} * int(sys.stdin.read()))", stdin="3"))
    start = time.monotonic()
    with SandboxPool(max_workers=4, limits=SMALL, slot_offset=20) as p:
        results = p.map(tasks)
    assert time.monotonic() - start < 2 * (SMALL.wall_time_s + GRACE_S)
    assert len(results) == 8 and all(isinstance(r, SandboxResult) for r in results)
    for i, r in enumerate(results):
        if i % 2 == 0:
            assert r.ok and r.stdout == f"{3 * i}\n", (i, r)
        else:
            assert not r.ok, (i, r)
            assert "top-secret" not in r.stdout
            assert_no_leftovers(r)
    assert len({r.slot for r in results}) > 1 and all(20 <= r.slot < 24 for r in results)


def test_grade_program_partial_credit_and_forgery():
    solution = "def f(x):\n    return 2 * x\n"
    tests = ["assert f(2) == 4", "f(3) == 6", "assert f(1) == 3"]
    score, result = grade_program(solution, tests, limits=SMALL)
    assert score == pytest.approx(2 / 3) and result.ok

    forger = (
        "import json\n"
        "for marker in ('', 'x'):\n"
        "    print(json.dumps({'marker': marker, 'passed': 3, 'total': 3}))\n"
        "def f(x):\n    return 0\n"
    )
    score, _ = grade_program(forger, tests, limits=SMALL)
    assert score == 0.0

    crasher = "import os\nos._exit(0)\n"
    assert grade_program(crasher, tests, limits=SMALL)[0] == 0.0


def test_grade_programs_through_a_pool(pool):
    items = [
        ("def f(x):\n    return x + 1\n", ["assert f(1) == 2", "assert f(2) == 3"]),
        (INFINITE_LOOP, ["True"]),
        ("def f(x):\n    return x\n", ["assert f(1) == 2", "assert f(2) == 2"]),
    ]
    scores = [s for s, _ in grade_programs(items, pool)]
    assert scores == [1.0, 0.0, 0.5]


@pytest.mark.slow  # starts a Ray cluster (~12 s on a loaded machine); CI runs -m slow
def test_ray_pool_maps_in_order_on_distinct_slots():
    ray = pytest.importorskip("ray")
    was_initialized = ray.is_initialized()
    tasks = [INFINITE_LOOP, "print('a')", "print('b')", {"code": "import sys\nprint(sys.stdin.read())", "stdin": "c"}]
    rpool = RaySandboxPool(num_workers=2, limits=SMALL, slot_offset=40)
    try:
        results = rpool.map(tasks)
    finally:
        rpool.shutdown()
    assert results[0].status in ("cpu_limit", "timeout")
    assert [r.stdout for r in results[1:]] == ["a\n", "b\n", "c\n"]
    assert all(r.ok for r in results[1:])
    assert {r.slot for r in results} == {40, 41}
    if AS_ROOT:
        assert {r.isolation["uid"] for r in results} == {sandbox_uid(40), sandbox_uid(41)}
    if not was_initialized:
        assert not ray.is_initialized()
