"""Isolation between concurrent runs and from the host, against the second red team's attacks
(dsv41/rl/sandbox/launcher.py, cgroups.py; docs/sandbox.md's threat model). Needs root, as the rest of the
sandbox tests do. Each test failed on the code before its fix; the docstrings say how.
"""

import os
import socket
import subprocess
import sys
import tempfile
import time

from dsv41.rl.sandbox import SandboxLimits, SandboxPool, run_python, sandbox_uid

SMALL = SandboxLimits(cpu_time_s=2, wall_time_s=4, memory_bytes=256 << 20, max_processes=40)


SPINNERS = """
import os, time
for _ in range(30):
    if os.fork() == 0:
        os.setsid()  # a session, hence a scheduling autogroup, of its own
        while True:
            pass
time.sleep(60)
"""

# About 0.3 CPU-seconds of work, then the wall time it took.
HONEST = """
import time
start = time.monotonic()
while time.process_time() < 0.3:
    pass
print(round(time.monotonic() - start, 2))
"""


def test_a_run_gets_its_share_of_the_cpu_and_no_more():
    """30 children that each call setsid() and spin got 30 scheduling groups: the honest run beside them
    in SandboxPool(2) went from well under a second to its wall timeout, and the spinners took both cores
    (cpu_s about 2 x wall_s). Now each run has a CPU cgroup (a quota of `cpu_cores` and equal shares)."""
    with SandboxPool(2, limits=SMALL, slot_offset=460) as pool:
        spin, honest = pool.map([SPINNERS, HONEST])
    assert honest.ok, honest
    assert float(honest.stdout) < 2.5, honest.stdout
    assert spin.status == "timeout"
    assert spin.cpu_s <= 1.25 * spin.wall_s * SMALL.cpu_cores, (spin.cpu_s, spin.wall_s)


def test_unix_datagram_socketpairs_are_refused():
    """socketpair(AF_UNIX, SOCK_DGRAM) then sendto() a host path reached a host listener (and could have
    handed it descriptors). Only stream socketpairs are allowed now (asyncio, multiprocessing)."""
    directory = tempfile.mkdtemp(prefix="dsv41-dgram-")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "listener")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        listener.bind(path)
        os.chmod(path, 0o777)
        listener.settimeout(0.5)
        # Through libc: the audit hook refuses socket.sendto, but it is no boundary (ctypes goes around it).
        code = (
            "import ctypes, socket, struct\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"addr = struct.pack('H108s', socket.AF_UNIX, {path.encode()!r})\n"
            "for kind in (socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):\n"
            "    sv = (ctypes.c_int * 2)()\n"
            "    if libc.socketpair(socket.AF_UNIX, kind, 0, sv) != 0:\n"
            "        print('refused', ctypes.get_errno())\n"
            "        continue\n"
            "    n = libc.sendto(sv[0], b'escaped', 7, 0, addr, len(addr))\n"
            "    print('sent' if n == 7 else 'not sent')\n"
            "a, b = socket.socketpair()\n"
            "a.send(b'x'); print(b.recv(1))\n"
        )
        result = run_python(code, limits=SMALL)
        try:
            received = listener.recv(100)
        except OSError:
            received = None
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(directory)
    assert received is None
    assert result.ok, result
    assert result.stdout.splitlines() == ["refused 13", "refused 13", "b'x'"], result.stdout


TCP_FILL = """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(64)
held, total = [], 0
try:
    for _ in range(28):
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        c.connect(server.getsockname())
        s, _ = server.accept()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        held += [c, s]
        c.setblocking(False)
        chunk = b"x" * (1 << 16)
        while True:
            try:
                total += c.send(chunk)
            except BlockingIOError:
                break
except OSError as e:
    print("stopped", e.errno)
print(total >> 20)
"""


def test_loopback_tcp_buffers_count_against_the_memory_cap():
    """With network=True, data queued on loopback TCP connections is kernel memory outside the memory
    cgroup's reach unless it is accounted: 28 connections held several hundred MiB against a 96 MiB cap.
    Now the run's TCP memory is limited with its memory (v1: memory.kmem.tcp; v2 counts it)."""
    limits = SandboxLimits(cpu_time_s=4, wall_time_s=8, memory_bytes=96 << 20, network=True)
    result = run_python(TCP_FILL, limits=limits)
    held_mib = int(result.stdout.split()[-1]) if result.stdout.split() else 0
    assert held_mib <= 96, result


def test_a_program_cannot_kill_its_launcher():
    """The program used to be able to SIGKILL its launcher (same uid), leaving its processes to the
    host's pid 1, which in a container may never reap them: the slot's uid then stayed over its process
    limit. The program now runs in a pid namespace of its own, where the launcher has no pid."""
    code = (
        "import os, signal\n"
        "for i in range(4):\n"
        "    if os.fork() == 0:\n"
        "        import time\n        time.sleep(30)\n"
        "for target in (os.getppid(), -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "print('alive')\n"
    )
    result = run_python(code, limits=SMALL, slot=5200)
    assert result.ok, result
    assert result.stdout.splitlines()[-1] == "alive"
    after = run_python(
        "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')",
        limits=SMALL,
        slot=5200,
    )
    assert after.ok and after.stdout == "forked\n", after


def test_flock_is_refused():
    """flock() on a file every sandbox can read (the standard library) was a channel between concurrent
    sandboxes: one holds an exclusive lock, the other tries it. flock is refused; fcntl record locks on
    read-only files cannot be exclusive."""
    code = (
        "import fcntl, os\n"
        "fd = os.open(os.__file__, os.O_RDONLY)\n"
        "try:\n"
        "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "    print('locked')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    result = run_python(code, limits=SMALL)
    assert result.ok, result
    assert result.stdout == "refused 1\n", result.stdout


def _zombies_of(uid: int) -> int:
    """Processes of this uid in state Z (/proc/<pid>/status)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if fields.get("State", "").strip().startswith("Z") and fields.get("Uid", "").split()[:1] == [str(uid)]:
            count += 1
    return count


def test_zombies_nobody_reaps_do_not_take_a_slots_processes():
    """Where the host's pid 1 does not reap (a container's), zombies of a slot's uid stay and count
    against its RLIMIT_NPROC: the next runs on the slot failed to fork. A parent that never waits stands
    in for such a pid 1 here. The orchestrator now counts them into the run's process limit."""
    slot = 5300
    uid = sandbox_uid(slot)
    maker = (
        "import os, sys, time\n"
        "for _ in range(12):\n"
        "    if os.fork() == 0:\n"
        f"        os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
        "        os._exit(0)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"  # never waits: its children stay zombies of the slot's uid
    )
    parent = subprocess.Popen([sys.executable, "-c", maker], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "ready\n"
        # the children may still be switching uid when "ready" is printed: wait until all 12 are zombies of it
        deadline = time.monotonic() + 10
        while _zombies_of(uid) < 12 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _zombies_of(uid) == 12
        forks = (  # four children at most at once (each exits at once), well inside max_processes
            "import os\npids = []\nfor _ in range(4):\n    pid = os.fork()\n"
            "    if pid == 0:\n        os._exit(0)\n    pids.append(pid)\n"
            "for pid in pids:\n    os.waitpid(pid, 0)\nprint('forked')\n"
        )
        start = time.monotonic()
        result = run_python(forks, limits=SandboxLimits(cpu_time_s=2, wall_time_s=4, max_processes=8), slot=slot)
        assert result.ok and result.stdout == "forked\n", result
        assert time.monotonic() - start < 2.0  # and no long wait for a reaping that never comes
    finally:
        parent.kill()
        parent.wait()
