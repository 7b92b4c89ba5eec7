"""The zygote (dsv41/rl/sandbox/zygote.py, launcher.py's zygote_main): a sandbox it forks is isolated as a
cold-started one is, one run leaves nothing for the next, and a dead or unstartable zygote is replaced or
fails the run closed. Needs root, as the rest of the sandbox tests do."""

import os
import signal
import time

import pytest

from dsv41.rl.sandbox import SandboxLimits, SandboxPool, run_python, sandbox_uid
from dsv41.rl.sandbox import orchestrator as orchestrator_module
from dsv41.rl.sandbox.orchestrator import launcher_zygote
from dsv41.rl.sandbox.zygote import Zygote

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's slots and cgroups need root")

LIMITS = SandboxLimits(cpu_time_s=2, wall_time_s=10, memory_bytes=96 << 20, max_processes=12)
# Blocks in a system call until the test sends SIGWINCH (which the launcher and the init ignore).
HOLD = "import signal, sys\nsignal.signal(signal.SIGWINCH, lambda *_: sys.exit(0))\nsignal.pause()\n"


@pytest.fixture(scope="module")
def zygote():
    with launcher_zygote() as z:
        yield z


def _program_of(uid: int, timeout_s: float = 10.0) -> int:
    """The host pid of the sandbox program (pid 2 of its namespace) running as `uid`, once it is asleep."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
            except OSError:
                continue
            if (
                int(fields["Uid"].split()[0]) == uid
                and fields["NSpid"].split()[-1] == "2"
                and fields["State"][0] == "S"
            ):
                return int(entry)
        time.sleep(0.01)
    raise AssertionError(f"no sleeping sandbox program of uid {uid}")


@pytest.mark.parametrize("mode", ["cold", "zygote"])
def test_a_zygote_sandbox_is_isolated_as_a_cold_one(mode, zygote):
    """Seen from the host while the program waits: its namespaces are not the host's, its seccomp filter
    and no_new_privs are on, it runs as the slot's uid in the slot's cgroups with the run's limits.
    Fails if the zygote's fork skipped any of launch's layers (it runs the same code as a cold start)."""
    slot = 1900 if mode == "cold" else 1901
    uid = sandbox_uid(slot)
    with SandboxPool(1, limits=LIMITS, slot_offset=slot, zygote=False) as pool:
        future = (
            pool.submit(HOLD)
            if mode == "cold"
            else pool._executor.submit(run_python, HOLD, limits=LIMITS, slot=slot, zygote=zygote)
        )
        pid = _program_of(uid)
        try:
            for ns in ("net", "ipc", "mnt", "pid"):
                assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
            assert "\nSeccomp:\t2\n" in status and "\nNoNewPrivs:\t1\n" in status
            assert f"\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n" in status
            with open(f"/proc/{pid}/cgroup") as f:
                cgroups = {line.split(":")[1]: line.split(":")[2].strip() for line in f}
            memory_dir = "/sys/fs/cgroup/memory" + cgroups["memory"]
            pids_dir = "/sys/fs/cgroup/pids" + cgroups["pids"]
            assert memory_dir.endswith(f"/dsv41-sandbox/slot-{slot}") and pids_dir.endswith(f"/slot-{slot}")
            with open(f"{memory_dir}/memory.limit_in_bytes") as f:
                assert int(f.read()) == LIMITS.memory_bytes
            with open(f"{pids_dir}/pids.max") as f:
                assert int(f.read()) == LIMITS.max_processes + 1
        finally:
            os.kill(pid, signal.SIGWINCH)
        result = future.result()
    assert result.ok, result
    layers = ("network_namespace", "ipc_namespace", "mount_namespace", "pid_namespace", "workdir_tmpfs")
    assert all(result.isolation[layer] for layer in layers + ("landlock", "seccomp", "cgroup")), result.isolation
    assert "missing" not in result.isolation


def test_the_limits_hold_in_a_zygote_sandbox(zygote):
    """The memory cap (its cgroup) and the process cap hold in a forked sandbox."""
    hog = run_python("x = bytearray(200 << 20)\n", limits=LIMITS, zygote=zygote)
    assert hog.status == "memory_limit", hog
    forks = run_python(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(5)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n",
        limits=LIMITS,
        zygote=zygote,
    )
    assert forks.ok and int(forks.stdout) < LIMITS.max_processes, forks


def test_a_program_holds_no_descriptor_of_the_zygote(zygote):
    """Only stdin, stdout and stderr are open in the program: the zygote's control socket (which would let
    a program ask the zygote, root, for a launcher of its own making) and the launcher's report pipe (a
    forged report) are not. Fails if the fork keeps the zygote's descriptors."""
    code = (
        "import os\nopen_fds = []\nfor fd in range(1024):\n    try:\n        os.fstat(fd)\n"
        "    except OSError:\n        continue\n    open_fds.append(fd)\nprint(open_fds)\n"
    )
    result = run_python(code, limits=LIMITS, zygote=zygote)
    assert result.ok, result
    assert result.stdout == "[0, 1, 2]\n"


def test_a_run_leaves_nothing_for_the_next(zygote):
    """A program that rewrites modules the zygote preloaded, builtins and sys.modules, and seeds random,
    is followed (same zygote) by one that sees none of it, draws other random numbers, and finds nothing
    of the first run's request (its working directory) among the objects it inherited from the zygote;
    the zygote itself was not replaced in between."""
    first = run_python(
        "import builtins, json, os, random, sys, types\n"
        "json.dumps = lambda *a, **k: 'forged'\n"
        "builtins.leftover = 'from the first run'\n"
        "sys.modules['planted'] = types.ModuleType('planted')\n"
        "random.seed(1234)\n"
        "print(random.random(), os.getcwd())\n",
        limits=LIMITS,
        zygote=zygote,
    )
    assert first.ok, first
    drawn_first, first_dir = first.stdout.split()
    pid = zygote.pid
    second = run_python(
        "import builtins, gc, json, random, sys\n"
        f"seen = {first_dir.encode()[::-1]!r}[::-1]\n"  # not a constant of this program's code
        "def holds(o):\n"
        "    items = o if isinstance(o, (list, tuple)) else o.values() if isinstance(o, dict) else ()\n"
        "    return any(isinstance(x, (bytes, str)) and seen in (x if isinstance(x, bytes) else x.encode())"
        " for x in items)\n"
        "found = any(holds(o) for o in gc.get_objects() if o is not globals())\n"
        "print(json.dumps([1]), hasattr(builtins, 'leftover'), 'planted' in sys.modules, random.random(), found)\n",
        limits=LIMITS,
        zygote=zygote,
    )
    assert second.ok, second
    dumped, leftover, planted, drawn, found = second.stdout.split()
    assert (dumped, leftover, planted, found) == ("[1]", "False", "False", "False"), second.stdout
    assert drawn != drawn_first
    assert zygote.pid == pid


def test_a_dead_zygote_is_replaced_and_runs_in_flight_go_on():
    """The zygote killed while a run it forked is in flight: that run finishes normally (its launcher is
    the orchestrator's child, not the zygote's), and the next run gets a new zygote. Fails if a dead
    zygote is not noticed (the next run would fail) or if launchers died with it."""
    with SandboxPool(2, limits=LIMITS, slot_offset=1902) as pool:
        assert pool.submit("pass").result().ok
        first = pool.zygote.pid
        in_flight = pool.submit("import time\ntime.sleep(1)\nprint('done')")
        time.sleep(0.3)
        os.kill(first, signal.SIGKILL)
        result = in_flight.result()
        assert result.ok and result.stdout == "done\n", result
        after = pool.submit("print('again')").result()
        assert after.ok and after.stdout == "again\n", after
        assert pool.zygote.pid != first and pool.zygote.starts == 2


def test_a_zygote_that_cannot_start_fails_the_run_closed(tmp_path):
    """No zygote (its launcher file is missing): the run is an error that says so, and the program never
    ran, not even started some other way (a cold start would have printed)."""
    broken = Zygote(str(tmp_path / "no-launcher.py"), orchestrator_module._BASE_ENV)
    try:
        result = run_python("print('ran')", limits=LIMITS, zygote=broken)
    finally:
        broken.close()
    assert result.status == "error" and "zygote did not start" in result.stderr, result
    assert result.stdout == ""


def test_a_slot_left_unclean_is_searched_again(monkeypatch, zygote):
    """After a clean run the next run on its slot skips the search of /proc for the slot's uid; after a
    run whose launcher was killed (no cleanup line in its report), the next run searches again."""
    searched = []
    real = orchestrator_module._kill_uid
    monkeypatch.setattr(orchestrator_module, "_kill_uid", lambda uid: searched.append(uid) or real(uid))
    slot = 1904
    assert run_python("pass", limits=LIMITS, slot=slot, zygote=zygote).ok
    searched.clear()
    assert run_python("pass", limits=LIMITS, slot=slot, zygote=zygote).ok
    assert searched == []
    with SandboxPool(1, limits=LIMITS, slot_offset=slot, zygote=False) as pool:
        future = pool._executor.submit(run_python, HOLD, limits=LIMITS, slot=slot, zygote=zygote)
        program = _program_of(sandbox_uid(slot))
        with open(f"/proc/{program}/status") as f:
            init = int(next(line.split()[1] for line in f if line.startswith("PPid:")))
        with open(f"/proc/{init}/status") as f:
            launcher = int(next(line.split()[1] for line in f if line.startswith("PPid:")))
        os.kill(launcher, signal.SIGKILL)
        assert future.result().status == "killed"
    searched.clear()
    assert run_python("pass", limits=LIMITS, slot=slot, zygote=zygote).ok
    assert sandbox_uid(slot) in searched


@pytest.mark.slow
def test_the_scale_benchmark_runs_small(tmp_path):
    """benchmarks/bench_sandbox.py end to end at a small scale: every section, the ramp's steps all
    reached with the hostile probes held, and nothing left after the release."""
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_sandbox.py")
    spec = importlib.util.spec_from_file_location("bench_sandbox", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out_path = tmp_path / "sandbox.json"
    bench.main(
        ["--runs", "3", "--idle", "4", "--widths", "1,2", "--gradings", "4", "--ramp", "4,8"] + ["--out", str(out_path)]
    )
    out = json.loads(out_path.read_text())
    assert out["cpu"] and set(out["start_latency"]) == {"cold", "zygote"}
    assert out["idle_memory"]["zygote"]["pss_mib"] < out["idle_memory"]["cold"]["pss_mib"]
    assert set(out["gradings_per_s"]["zygote"]) == {"1", "2"}
    ramp = out["ramp"]
    assert ramp["ceiling"] == 8 and ramp["limited_by"] is None, ramp
    assert all(step["hostile_probes"]["all_held"] for step in ramp["steps"].values()), ramp
    assert ramp["released_ok"] == ramp["released"] == 8
    assert ramp["left_after"] == {"processes": 0, "cgroups": 0}
