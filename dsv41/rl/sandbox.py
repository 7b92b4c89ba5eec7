"""Sandboxed execution of untrusted, model-written Python for verifiable RL rewards (training.md §8).

Post-training rolls out programs written by the policy and rewards them by running them: a program passes
its tests or it does not. Those programs are untrusted (a policy under optimisation pressure will find every
way to cheat or break the grader), so each one runs in its own throw-away process tree, in a fresh
temporary directory, behind several layers, each recorded in `SandboxResult.isolation` so a caller can see
what was actually in force:

- resource limits (setrlimit, always): CPU seconds, address space, file size, processes, no core dumps; a
  wall-clock deadline enforced by the orchestrator, which then ends the whole sandbox;
- a dedicated unprivileged uid/gid per slot when the orchestrator runs as root (60000 + slot), so that
  RLIMIT_NPROC is actually enforced (root is exempt), files outside are protected by ordinary permissions
  too, and every leftover process of the sandbox can be found and killed by uid. Not root: the current
  user (in a user namespace where possible, so RLIMIT_NPROC still counts only the sandbox);
- a private network namespace (only an unconfigured loopback exists), created with unshare(2);
- Landlock (Linux >= 5.13): the sandbox may read and execute only the Python installation and the system
  library directories, and read and write only its own directory; TCP bind/connect, signals to processes
  outside the sandbox and abstract unix sockets are denied too where the kernel's ABI supports it;
- a private mount namespace, only where needed to keep the Python installation reachable for the
  unprivileged uid (e.g. under /root, mode 0700): a tmpfs covers the non-traversable directory, hiding the
  rest of it, and the installation is bind-mounted back read-only;
- an audit hook (PEP 578) installed before the user code runs, refusing socket operations and file access
  outside the allowed trees. It is defence in depth and the fallback where a kernel layer is missing, NOT a
  security boundary on its own: ctypes, C extensions or interpreter tricks get around it, so where
  Landlock or the network namespace is unavailable it also refuses process execution and ctypes calls,
  which narrows but does not close that gap.

Process tree: the orchestrator starts a launcher (this file, run by the same interpreter in isolated mode)
that applies the restrictions to itself, forks the program and is its reaper (PR_SET_CHILD_SUBREAPER):
when the program exits it kills and reaps everything the program left (kill(-1) reaches exactly the
sandbox: its uid, or its Landlock signal scope) and exits the way the program did. At the wall deadline
the orchestrator asks the launcher to do the same, and kills the group and the uid by force if it does not.

Known limits: disk use is capped per file (RLIMIT_FSIZE), not in total; RLIMIT_CPU is per process (wall
time bounds a program that forks); a program that kills its own launcher leaves zombies for the system's
init to reap (they count against its slot's process limit until then); without root and without
Landlock ABI >= 6, a process that left the process group (setsid) survives the run;
/proc, /dev/shm and /tmp outside the sandbox directory are unavailable (multiprocessing semaphores fail).

Entry points: `run_python` (one program), `SandboxPool` (threads, one machine), `RaySandboxPool` (Ray
actors, a cluster) and `grade_program` / `grade_programs` (solution + test statements -> fraction passed).

The child side of this module (`_child_main`) runs inside the sandbox's interpreter, which loads this file
by path (not through the `dsv41` package, whose import pulls in torch) before any restriction applies, so
module-level code must stay cheap and side-effect free.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import json
import math
import os
import queue
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

__all__ = [
    "SANDBOX_STATUSES",
    "RaySandboxPool",
    "SandboxLimits",
    "SandboxPool",
    "SandboxResult",
    "SandboxTask",
    "grade_program",
    "grade_programs",
    "grading_score",
    "grading_task",
    "run_python",
    "sandbox_uid",
]

SANDBOX_STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "file_size_limit",
                    "process_limit", "killed")

# Sandbox uids: 60000 + slot, below 65534 (nobody) and above the usual ranges of system and human users.
_SLOT_UID_BASE = 60000
_MAX_SLOTS = 65534 - _SLOT_UID_BASE - 1

_SETUP_FAILED_EXIT = 125  # the launcher's exit code when a mandatory protection could not be applied
_TAIL_BYTES = 8192  # the end of stderr is kept apart from the (head-truncated) capture, for classification
_DRAIN_AFTER_EXIT_S = 2.0  # how long pipes are drained once the sandbox is dead (data still in the pipe)
_KILL_HELPER_BUDGET_S = 3.0
_STOP_SIGNAL = signal.SIGUSR1  # orchestrator -> launcher: the wall deadline has passed, end the program
_STOP_GRACE_S = 1.0

# Minimal environment: nothing inherited from the trainer (tokens, cloud credentials, proxies).
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}

# Read-only trees (besides the Python installation) an interpreter and its C extensions may need.
_SYSTEM_READ_PATHS = (
    "/usr", "/lib", "/lib32", "/lib64", "/bin", "/etc/ld.so.cache", "/etc/localtime",
    "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/proc/cpuinfo", "/sys/devices/system/cpu",
)
# Extra read-only files a program needs for name resolution when the network is allowed.
_NETWORK_READ_PATHS = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/gai.conf")

# Linux constants (uapi), identical on x86_64 and aarch64.
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_FS_ABI1 = (1 << 13) - 1  # execute .. make_sym: everything ABI 1 handles
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV
_LL_READ_RIGHTS = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
_LL_NET_BIND_TCP, _LL_NET_CONNECT_TCP = 1 << 0, 1 << 1
_LL_SCOPE_ABSTRACT_UNIX_SOCKET, _LL_SCOPE_SIGNAL = 1 << 0, 1 << 1

# Audit events that modify the filesystem: their path arguments must lie in the sandbox directory.
_WRITE_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
}
_READ_EVENTS = {"os.listdir": (0,), "os.scandir": (0,), "os.listxattr": (0,), "os.getxattr": (0,)}
_EXEC_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.startfile")
_CTYPES_EVENTS = ("ctypes.call_function", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata",
                  "ctypes.cdata/buffer", "ctypes.addressof", "ctypes.string_at", "ctypes.wstring_at")


# ------------------------------------------------------------------------------------------------------
# Configuration and results


def _check_positive(name: str, value: Any, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"SandboxLimits.{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not value > 0 or (not integer and not math.isfinite(value)):
        raise ValueError(f"SandboxLimits.{name} must be positive and finite, got {value!r}")


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use. Frozen: shared defaults can never be mutated by a caller.

    RLIMIT_CPU has one-second resolution, so cpu_time_s is rounded up; it is per process (a program that
    forks gets that much per child), which wall_time_s bounds. memory_bytes caps the address space, which
    for Python is close to (and above) the memory actually touched. max_processes counts threads too
    (that is how the kernel counts RLIMIT_NPROC), the sandbox's interpreter included.
    """

    cpu_time_s: float = 5.0
    wall_time_s: float = 10.0
    memory_bytes: int = 512 * 1024 * 1024
    file_size_bytes: int = 16 * 1024 * 1024
    max_processes: int = 32
    max_output_bytes: int = 64 * 1024  # per stream (stdout, stderr); the rest is read and dropped
    network: bool = False  # False: private network namespace, sockets refused

    def __post_init__(self) -> None:
        _check_positive("cpu_time_s", self.cpu_time_s, integer=False)
        _check_positive("wall_time_s", self.wall_time_s, integer=False)
        for name in ("memory_bytes", "file_size_bytes", "max_processes", "max_output_bytes"):
            _check_positive(name, getattr(self, name), integer=True)
        if not isinstance(self.network, bool):
            raise ValueError(f"SandboxLimits.network must be a bool, got {self.network!r}")


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    status: "ok" (exit 0), "error" (non-zero exit, or the sandbox could not be set up or the runner
    failed: see stderr), "timeout" (killed at the wall-clock limit), "cpu_limit", "memory_limit",
    "file_size_limit", "process_limit" (the program failed because it could not fork: best effort, read
    from its stderr), "killed" (another signal). isolation: the protections actually applied.
    """

    status: str
    exit_code: Optional[int] = None  # None when the process was killed by a signal or never ran
    signal: Optional[str] = None  # e.g. "SIGKILL"
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    isolation: dict = field(default_factory=dict)
    slot: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    passed = ok  # alias, reads better in graders

    @classmethod
    def runner_error(cls, message: str, slot: Optional[int] = None) -> "SandboxResult":
        """A result for a task the orchestrator itself failed to run (never raised into a pool)."""
        return cls(status="error", stderr=f"sandbox runner failed: {message}", slot=slot)


@dataclass(frozen=True)
class SandboxTask:
    """One program for a pool: `code` becomes main.py; `files` are extra files next to it."""

    code: str
    stdin: str = ""
    files: Optional[Mapping[str, Union[str, bytes]]] = None
    limits: Optional[SandboxLimits] = None  # None: the pool's limits


TaskLike = Union[SandboxTask, str, Mapping[str, Any]]


def _as_task(task: TaskLike) -> SandboxTask:
    if isinstance(task, SandboxTask):
        return task
    if isinstance(task, str):
        return SandboxTask(code=task)
    if isinstance(task, Mapping):
        unknown = set(task) - {"code", "stdin", "files", "limits"}
        if unknown or "code" not in task:
            raise ValueError("a task mapping needs 'code' and may have stdin/files/limits, "
                             f"got keys {sorted(task)}")
        return SandboxTask(**task)
    raise TypeError(f"a task is a SandboxTask, a code string or a mapping, got {type(task).__name__}")


def sandbox_uid(slot: int) -> int:
    """The uid (and gid) a slot's programs run as when the orchestrator is root."""
    return _SLOT_UID_BASE + slot


# ------------------------------------------------------------------------------------------------------
# Orchestrator side: one run


def run_python(code: str, stdin: str = "", files: Optional[Mapping[str, Union[str, bytes]]] = None,
               limits: SandboxLimits = SandboxLimits(), slot: int = 0) -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox and return what happened.

    The program runs in a new temporary directory (its cwd and HOME; `files` are written next to main.py,
    relative paths only), removed afterwards whatever happens. `slot` selects the sandbox uid when running
    as root: concurrent runs must use distinct slots. Raises ValueError/TypeError for invalid arguments;
    whatever the program does comes back in the result.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot <= _MAX_SLOTS:
        raise ValueError(f"slot must be an integer in [0, {_MAX_SLOTS}], got {slot!r}")
    extra = _checked_files(files)

    as_root = os.geteuid() == 0
    uid = gid = sandbox_uid(slot) if as_root else None
    if uid is not None:
        # A previous run on this slot that escaped its cleanup (a crashed trainer) must not eat this run's
        # process budget or interfere with it.
        _kill_uid(uid)
    workdir = os.path.realpath(tempfile.mkdtemp(prefix=f"dsv41-sandbox-{slot}-"))
    try:
        _populate_workdir(workdir, code, extra, uid, gid)
        result = _supervise(workdir, stdin, limits, uid, gid)
        result.slot = slot
        return result
    finally:
        if uid is not None:
            _kill_uid(uid)  # nothing of this sandbox may outlive the run, nor write while it is removed
        _remove_tree(workdir)


def _checked_files(files: Optional[Mapping[str, Union[str, bytes]]]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, content in (files or {}).items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"file names must be non-empty strings, got {name!r}")
        norm = os.path.normpath(name)
        if os.path.isabs(name) or norm == "." or norm.split(os.sep)[0] == "..":
            raise ValueError(f"file name {name!r} must be a relative path inside the sandbox directory")
        if norm == "main.py":
            raise ValueError("file name 'main.py' is reserved for the program itself")
        if isinstance(content, str):
            content = content.encode("utf-8")
        elif not isinstance(content, bytes):
            raise TypeError(f"content of file {name!r} must be str or bytes, got {type(content).__name__}")
        out[norm] = content
    return out


def _populate_workdir(workdir: str, code: str, files: dict[str, bytes], uid: Optional[int],
                      gid: Optional[int]) -> None:
    for name, content in [("main.py", code.encode("utf-8")), *files.items()]:
        path = os.path.join(workdir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)
    if uid is not None:
        # The sandbox uid owns its directory (and nothing else): it can work there, others cannot look in.
        for dirpath, dirnames, filenames in os.walk(workdir):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.chown(name, uid, gid, follow_symlinks=False)
    os.chmod(workdir, 0o700)


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func, failed_path, _exc_info):
        # A program may have left a read-only directory behind; as non-root it must be made writable first.
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, 0o700)
            func(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)


def _python_roots() -> list[str]:
    roots = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(sys.executable)):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q not in roots:
                roots.append(q)
    return roots


# The kill helper runs as root, drops to the sandbox uid and signals every process it may signal (all
# processes of that uid, never itself) until /proc shows none left; zombies count until reaped, hence
# the loop and its budget. (kill(-1) itself cannot tell: it succeeds while any other process exists.)
# A separate interpreter rather than os.fork(): forking a multi-threaded trainer and running Python in
# the child can deadlock on locks held by other threads.
_KILL_HELPER = """
import os, sys, time
uid, gid, budget = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
me = str(os.getpid())
def others():
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != me:
            try:
                with open("/proc/" + pid + "/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"State:") and line.split()[1] == b"Z":
                            break  # a zombie is dead already, waiting to be reaped by its parent
                        if line.startswith(b"Uid:"):
                            if int(line.split()[1]) == uid:
                                return True
                            break
            except OSError:
                pass
    return False
deadline = time.monotonic() + budget
while True:
    try:
        os.kill(-1, 9)
    except OSError:
        pass
    if not others():
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.002)
"""


def _uid_processes(uid: int, zombies: bool = False) -> list[int]:
    """Pids whose real uid is `uid` (from /proc status: the owner of /proc/PID of a non-dumpable process
    is root, so the directory's owner is not enough). Zombies (dead, not yet reaped) only if asked."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"State:") and line.split()[1] == b"Z" and not zombies:
                        break
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(entry))
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue
    return pids


def _kill_uid(uid: int) -> bool:
    """Kill every process of a sandbox uid. Returns True when none is left."""
    if not _uid_processes(uid):
        return True
    try:
        subprocess.run([sys.executable, "-I", "-S", "-B", "-c", _KILL_HELPER, str(uid), str(uid),
                        str(_KILL_HELPER_BUDGET_S)], env={"PATH": _BASE_ENV["PATH"]}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=_KILL_HELPER_BUDGET_S + 10,
                       check=False)
    except subprocess.TimeoutExpired:
        pass
    return not _uid_processes(uid)


class _Capture:
    """One output stream: the first `limit` bytes, the last few KiB, and the total seen."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.tail += data[-_TAIL_BYTES:]
        del self.tail[:-_TAIL_BYTES]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit


def _launcher_command(config: dict) -> list[str]:
    # The launcher loads this file by path so the child does not import the dsv41 package (and torch).
    boot = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('_dsv41_sandbox_child', sys.argv[1])\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "sys.modules[spec.name] = module\n"
            "spec.loader.exec_module(module)\n"
            "module._child_main(sys.argv[2])\n")
    return [sys.executable, "-I", "-B", "-X", "utf8", "-c", boot, os.path.abspath(__file__), json.dumps(config)]


def _supervise(workdir: str, stdin: str, limits: SandboxLimits, uid: Optional[int],
               gid: Optional[int]) -> SandboxResult:
    read_paths = _python_roots() + list(_SYSTEM_READ_PATHS) + (list(_NETWORK_READ_PATHS) if limits.network else [])
    report_r, report_w = os.pipe()
    config = {
        "workdir": workdir, "uid": uid, "gid": gid, "report_fd": report_w, "orchestrator_pid": os.getpid(),
        "read_paths": read_paths, "python_roots": _python_roots(), "network": limits.network,
        "cpu_time_s": limits.cpu_time_s, "memory_bytes": limits.memory_bytes,
        "file_size_bytes": limits.file_size_bytes, "max_processes": limits.max_processes,
    }
    env = dict(_BASE_ENV, HOME=workdir, TMPDIR=workdir)
    out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
    start = time.monotonic()
    try:
        # start_new_session: the sandbox is its own process group and session, killable as a whole.
        proc = subprocess.Popen(_launcher_command(config), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=workdir, env=env, start_new_session=True,
                                pass_fds=(report_w,), close_fds=True)
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)  # the launcher holds the only write end: EOF once it is done with it
    try:
        status, rusage, timed_out, exit_time = _pump(proc, stdin.encode("utf-8"), out, err,
                                                     start + limits.wall_time_s, uid)
        report = _read_report(report_r)
    finally:
        os.close(report_r)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
        if proc.returncode is None:  # an exception above: make sure nothing keeps running
            _kill_process_group(proc.pid)
            try:
                os.waitpid(proc.pid, 0)
            except ChildProcessError:
                pass
            proc.returncode = -signal.SIGKILL

    isolation = dict(report.get("isolation", {}))
    if uid is not None:
        isolation["leftovers_killed"] = _kill_uid(uid)
    stdout_text = bytes(out.head).decode("utf-8", errors="replace")
    stderr_text = bytes(err.head).decode("utf-8", errors="replace")
    exit_code = os.waitstatus_to_exitcode(status)
    cpu_s = rusage.ru_utime + rusage.ru_stime
    sig_name = None
    if exit_code < 0:
        try:
            sig_name = signal.Signals(-exit_code).name
        except ValueError:
            sig_name = f"SIG{-exit_code}"
    if "fatal" in report:
        # The launcher refused to run the program because a mandatory protection failed.
        stderr_text = f"sandbox setup failed: {report['fatal']}\n{stderr_text}"
        result_status = "error"
    else:
        tail = bytes(err.tail).decode("utf-8", errors="replace")
        result_status = _classify(exit_code, timed_out, cpu_s, limits, tail)
    return SandboxResult(
        status=result_status, exit_code=exit_code if exit_code >= 0 else None, signal=sig_name,
        stdout=stdout_text, stderr=stderr_text, stdout_truncated=out.truncated, stderr_truncated=err.truncated,
        wall_s=exit_time - start, cpu_s=cpu_s, isolation=isolation)


def _kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pump(proc: subprocess.Popen, stdin_data: bytes, out: _Capture, err: _Capture, deadline: float,
          uid: Optional[int]):
    """Feed stdin, drain stdout/stderr, enforce the wall deadline and reap the launcher (wait4, for its
    CPU time). Returns (wait status, rusage, timed_out, exit time)."""
    sel = selectors.DefaultSelector()
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()
    stdin_pos = 0
    if stdin_data:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pidfd = None  # old kernel: poll with WNOHANG below

    wait_status = rusage = None
    timed_out = False
    exit_time = None
    drain_deadline = None

    def reaped(status_and_rusage) -> None:
        nonlocal wait_status, rusage, exit_time, drain_deadline
        _, wait_status, rusage = status_and_rusage
        if pidfd is not None and pidfd in sel.get_map():
            sel.unregister(pidfd)
        exit_time = time.monotonic()
        # Popen must not waitpid() this pid again (it could belong to someone else by then).
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        # Descendants may still hold the pipes open: kill them so the drain below reaches EOF.
        _kill_process_group(proc.pid)
        if uid is not None:
            _kill_uid(uid)
        drain_deadline = time.monotonic() + _DRAIN_AFTER_EXIT_S

    try:
        while True:
            now = time.monotonic()
            if wait_status is None:
                if now >= deadline:
                    timed_out = True
                    reaped(_stop_sandbox(proc.pid))
                    continue
                timeout = deadline - now if pidfd is not None else min(deadline - now, 0.02)
            else:
                if not any(fd in streams for fd in sel.get_map()) or now >= drain_deadline:
                    break
                timeout = drain_deadline - now
            for key, _ in sel.select(timeout):
                fd = key.fd
                if fd == pidfd:
                    reaped(os.wait4(proc.pid, 0))
                elif fd == stdin_fd:
                    try:
                        stdin_pos += os.write(stdin_fd, stdin_data[stdin_pos:stdin_pos + 65536])
                    except BrokenPipeError:
                        stdin_pos = len(stdin_data)  # the program stopped reading; fine
                    except BlockingIOError:
                        continue
                    if stdin_pos >= len(stdin_data):
                        sel.unregister(stdin_fd)
                        proc.stdin.close()
                else:
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if data:
                        streams[fd].feed(data)
                    else:
                        sel.unregister(fd)
                        del streams[fd]
            if pidfd is None and wait_status is None:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    reaped((pid, status, ru))
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return wait_status, rusage, timed_out, exit_time


def _stop_sandbox(pid: int) -> tuple:
    """Wall deadline: ask the launcher to kill and reap the program and its descendants (it is their
    reaper, so nothing is left as a zombie for the system's init), then kill whatever is left by force
    if it does not exit promptly (the program may have stopped or killed it). Returns wait4's result."""
    try:
        os.kill(pid, _STOP_SIGNAL)
    except ProcessLookupError:
        pass
    give_up = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < give_up:
        reaped = os.wait4(pid, os.WNOHANG)
        if reaped[0]:
            return reaped
        time.sleep(0.005)
    _kill_process_group(pid)
    try:
        os.kill(pid, signal.SIGKILL)  # in case it left its process group
    except ProcessLookupError:
        pass
    return os.wait4(pid, 0)


def _read_report(fd: int) -> dict:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not data:
            break
        chunks.append(data)
    try:
        return json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {"fatal": "the sandbox launcher wrote an unreadable report"}


def _classify(exit_code: int, timed_out: bool, cpu_s: float, limits: SandboxLimits, stderr_tail: str) -> str:
    if timed_out:
        return "timeout"
    cpu_limit = math.ceil(limits.cpu_time_s)
    if exit_code < 0:
        sig = -exit_code
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= cpu_limit - 0.05):
            return "cpu_limit"  # SIGXCPU at the soft limit; SIGKILL at the hard one if it was ignored
        if sig == signal.SIGXFSZ:
            return "file_size_limit"
        if "MemoryError" in stderr_tail or "Cannot allocate memory" in stderr_tail:
            return "memory_limit"  # e.g. a C library aborting on a failed allocation
        return "killed"
    if exit_code == 0:
        return "ok"
    # A Python program that hit a limit dies of the exception the failed system call raised.
    if "MemoryError" in stderr_tail or "[Errno 12]" in stderr_tail:
        return "memory_limit"
    if "File too large" in stderr_tail or "[Errno 27]" in stderr_tail:
        return "file_size_limit"  # CPython ignores SIGXFSZ, so the write fails with EFBIG instead
    if any(m in stderr_tail for m in ("BlockingIOError", "Resource temporarily unavailable",
                                       "can't start new thread")):
        return "process_limit"  # fork/clone failing with EAGAIN under RLIMIT_NPROC (threads count too)
    return "error"


# ------------------------------------------------------------------------------------------------------
# Child side: runs in the sandbox's interpreter, first as the orchestrator's user, then restricted.


class _LandlockRulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _LandlockPathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _child_main(config_json: str) -> None:
    """The sandbox's first process: apply every restriction to itself, then fork the program and act as
    its reaper. Orphans of the program are re-parented here (PR_SET_CHILD_SUBREAPER), so once the program
    exits everything it left behind is killed and reaped here, and the launcher exits the way the program
    did (same exit code, or the same signal), with their CPU time in its rusage."""
    cfg = json.loads(config_json)
    report_fd = cfg["report_fd"]
    isolation: dict[str, Any] = {}
    libc = None
    try:
        libc = _libc()
        hook, can_kill_all = _child_setup(libc, cfg, isolation)
        _check(libc.prctl(ctypes.c_int(_PR_SET_CHILD_SUBREAPER), ctypes.c_ulong(1), ctypes.c_ulong(0),
                          ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl(PR_SET_CHILD_SUBREAPER)")
        isolation["subreaper"] = True
        # The stop request may come at any time from now on, so its handler is in place before the fork.
        children: list[int] = []

        def stop(_signum, _frame):
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        signal.signal(_STOP_SIGNAL, stop)
        program = os.fork()
    except BaseException as exc:  # refuse to run the untrusted program half-protected
        fatal = {"fatal": f"{type(exc).__name__}: {exc}", "isolation": isolation}
        os.write(report_fd, json.dumps(fatal).encode())
        os._exit(_SETUP_FAILED_EXIT)
    if program == 0:
        os.close(report_fd)  # the program must not be able to write (forge) the report
        signal.signal(_STOP_SIGNAL, signal.SIG_DFL)
        # Die with the launcher (cleared by fork, so set again); the launcher dies with the orchestrator.
        libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0))
        sys.addaudithook(hook)
        _run_user_main(cfg["workdir"])
        return  # normal interpreter shutdown: flushes the program's output, runs its atexit handlers
    isolation["kill_all_at_exit"] = can_kill_all
    os.write(report_fd, json.dumps({"isolation": isolation}).encode())
    os.close(report_fd)
    os.close(0)  # stdin belongs to the program
    children.append(program)
    status = _reap_until(program)
    if can_kill_all:
        # kill(-1) reaches exactly this sandbox: the sandbox uid's processes, or (Landlock signal scope)
        # this Landlock domain's. Repeated until no child is left (orphans all come back here), in case a
        # fork raced with the signal.
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.001)
            except ChildProcessError:
                break
    # Otherwise the orchestrator kills the process group once it has reaped this process.
    if status is None or os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status) if status is not None else 1)
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be (and need not be) reset
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def _reap_until(pid: int) -> Optional[int]:
    """Reap children (the program and adopted orphans) until `pid` exits; its wait status."""
    while True:
        try:
            child, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return None
        except InterruptedError:
            continue
        if child == pid:
            return status


def _child_setup(libc: ctypes.CDLL, cfg: dict, isolation: dict) -> tuple[Callable[[str, tuple], None], bool]:
    """Apply the restrictions to this process (inherited by the program). Returns the program's audit
    hook and whether kill(-1) reaches only this sandbox. Raises if a mandatory protection fails."""
    import runpy  # noqa: F401  (imported while the whole filesystem is still readable)
    import traceback  # noqa: F401

    as_root = os.geteuid() == 0
    workdir = cfg["workdir"]
    uid, gid = cfg["uid"], cfg["gid"]
    in_user_ns = False

    # 1. Network: a new network namespace has only a loopback device, and it is down.
    isolation["network_namespace"] = False
    if not cfg["network"]:
        try:
            if as_root:
                _check(libc.unshare(ctypes.c_int(_CLONE_NEWNET)), "unshare(CLONE_NEWNET)")
            else:
                # Unprivileged: a user namespace grants the capability to create the network namespace.
                my_uid, my_gid = os.getuid(), os.getgid()
                _check(libc.unshare(ctypes.c_int(_CLONE_NEWUSER | _CLONE_NEWNET)),
                       "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
                in_user_ns = True
                _map_own_ids(my_uid, my_gid)
            isolation["network_namespace"] = True
        except OSError as exc:
            isolation["network_namespace_error"] = str(exc)
    isolation["user_namespace"] = in_user_ns

    # 2. Root dropping to a sandbox uid: the Python installation must stay reachable for that uid.
    isolation["mount_namespace"] = False
    if as_root and uid is not None:
        shadows = _untraversable_ancestors(cfg["python_roots"] + [workdir])
        if shadows:
            try:
                _shadow_directories(libc, shadows, cfg["python_roots"], workdir)
            except OSError as exc:  # mandatory: the program could not even import the standard library
                raise RuntimeError(
                    f"the Python installation is below {', '.join(shadows)}, which the sandbox uid cannot "
                    f"traverse, and no private mount namespace could hide that ({exc}); make those "
                    "directories traversable (chmod o+x) or use a Python installed elsewhere") from exc
            isolation["mount_namespace"] = True
    os.chdir(workdir)

    # Counted now: /proc is out of reach once Landlock applies.
    user_tasks = _count_tasks_of_uid(os.getuid()) if uid is None and not in_user_ns else 0

    # 3. Landlock (needs no_new_privs, which also stops setuid binaries from regaining privileges).
    _check(libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl(PR_SET_NO_NEW_PRIVS)")
    try:
        abi = _landlock_restrict(libc, cfg["read_paths"], [workdir], restrict_tcp=not cfg["network"])
        isolation["landlock"] = True
        isolation["landlock_abi"] = abi
    except OSError as exc:
        isolation["landlock"] = False
        isolation["landlock_error"] = str(exc)

    # 4. Identity.
    if as_root and uid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise RuntimeError("privileges could not be dropped: setuid(0) still succeeds")
    elif in_user_ns:
        _drop_capabilities(libc)  # the capabilities a user namespace grants are not needed past this point
    isolation["uid"] = os.getuid()
    isolation["gid"] = os.getgid()

    # Die with the orchestrator (a killed Ray actor, a crashed trainer). Set after the uid change, which
    # clears it; the getppid check closes the race with a parent that died just before.
    libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    if os.getppid() != cfg["orchestrator_pid"]:
        raise RuntimeError("the orchestrator exited during sandbox setup")

    # 5. Resource limits, last: lowering a limit needs no privilege, and nothing above is charged to them.
    cpu = math.ceil(cfg["cpu_time_s"])
    if uid is not None or in_user_ns:
        # The sandbox uid (or the fresh user namespace) holds only this sandbox's tasks; +1: the launcher.
        nproc = cfg["max_processes"] + 1
    else:
        nproc = user_tasks + cfg["max_processes"]  # the limit is shared with the user's other processes
    for name, soft, hard in (("RLIMIT_CORE", 0, 0), ("RLIMIT_CPU", cpu, cpu + 1),
                             ("RLIMIT_FSIZE", cfg["file_size_bytes"], cfg["file_size_bytes"]),
                             ("RLIMIT_NPROC", nproc, nproc),
                             ("RLIMIT_AS", cfg["memory_bytes"], cfg["memory_bytes"])):
        which = getattr(resource, name)
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:  # never try to raise a limit someone else imposed
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(which, (soft, hard))
    isolation["rlimits"] = True

    kernel_ok = isolation["landlock"] and (cfg["network"] or isolation["network_namespace"])
    isolation["audit_hook"] = True
    isolation["audit_hook_strict"] = not kernel_ok
    read_roots = [workdir] + [os.path.realpath(p) for p in cfg["read_paths"]] + list(cfg["read_paths"])
    hook = _make_audit_hook(read_roots, [workdir], block_network=not cfg["network"], strict=not kernel_ok)
    signal_scoped = bool(isolation["landlock"] and isolation["landlock_abi"] >= 6)
    can_kill_all = (as_root and uid is not None) or signal_scoped
    return hook, can_kill_all


def _map_own_ids(uid: int, gid: int) -> None:
    """In a fresh user namespace, map our own uid/gid to themselves (otherwise we would be 'nobody')."""
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError:
        pass  # unmapped ids still work for the checks that matter (the kernel uses the real ids)


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")


def _count_tasks_of_uid(uid: int) -> int:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            if int(fields[b"Uid"].split()[0]) == uid:
                total += int(fields[b"Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def _untraversable_ancestors(paths: Iterable[str]) -> list[str]:
    """The topmost directories above `paths` that others may not traverse (no o+x), e.g. /root."""
    found: list[str] = []
    for path in paths:
        parts = os.path.realpath(path).split(os.sep)[1:]
        for i in range(1, len(parts)):
            ancestor = os.sep + os.sep.join(parts[:i])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                if ancestor not in found:
                    found.append(ancestor)
                break
    # Keep only the outermost ones; the path to a nested one is recreated anyway.
    return [a for a in found if not any(a != b and a.startswith(b + os.sep) for b in found)]


def _mount(libc: ctypes.CDLL, source: Optional[str], target: str, fstype: Optional[str], flags: int,
           data: Optional[str] = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount({source!r} -> {target!r})")


def _shadow_directories(libc: ctypes.CDLL, shadows: list[str], python_roots: list[str], workdir: str) -> None:
    """In a private mount namespace, cover each directory in `shadows` with an empty tmpfs (mode 0755) and
    bind-mount back only the trees below it that the sandbox needs: the Python installation read-only and
    the sandbox directory read-write. Everything else below (e.g. the rest of /root) disappears."""
    _check(libc.unshare(ctypes.c_int(_CLONE_NEWNS)), "unshare(CLONE_NEWNS)")
    # Private propagation, or the tmpfs would appear in the orchestrator's namespace too.
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    wanted = [(os.path.realpath(p), False) for p in python_roots] + [(workdir, True)]
    for shadow in shadows:
        below = []
        for path, writable in wanted:
            if path.startswith(shadow + os.sep) and os.path.isdir(path):
                # Keep only outermost trees; a tree inside another one comes back with it.
                if not any(path.startswith(other + os.sep) for other, _ in wanted if other != path
                           and other.startswith(shadow + os.sep)):
                    below.append((path, writable, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        _mount(libc, "tmpfs", shadow, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
        for path, writable, fd in below:
            os.makedirs(path, mode=0o755, exist_ok=True)
            # The O_PATH descriptor still names the tree hidden under the tmpfs.
            _mount(libc, f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            if not writable:
                _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
            os.close(fd)


def _landlock_restrict(libc: ctypes.CDLL, read_paths: Sequence[str], write_paths: Sequence[str],
                       restrict_tcp: bool) -> int:
    """Restrict this process (and its future children) to reading `read_paths` and reading+writing
    `write_paths`. Only access rights the running kernel's ABI knows are handled. Returns the ABI."""
    abi = libc.syscall(ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    _check(abi, "landlock_create_ruleset(version)")
    handled_fs = _LL_FS_ABI1
    if abi >= 2:
        handled_fs |= _LL_REFER
    if abi >= 3:
        handled_fs |= _LL_TRUNCATE
    if abi >= 5:
        handled_fs |= _LL_IOCTL_DEV
    handled_net = (_LL_NET_BIND_TCP | _LL_NET_CONNECT_TCP) if abi >= 4 and restrict_tcp else 0
    scoped = (_LL_SCOPE_ABSTRACT_UNIX_SOCKET | _LL_SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _LandlockRulesetAttr(handled_fs, handled_net, scoped)
    attr_size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct grew with the ABI; size tells the kernel
    ruleset = _check(libc.syscall(ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(attr),
                                  ctypes.c_size_t(attr_size), ctypes.c_uint32(0)), "landlock_create_ruleset")
    try:
        rules = [(p, _LL_READ_RIGHTS) for p in read_paths] + [(p, handled_fs) for p in write_paths]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # e.g. no /lib32 on this system
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= _LL_FILE_RIGHTS  # directory rights on a file are EINVAL
                    if path.startswith("/dev/"):
                        access |= _LL_WRITE_FILE | _LL_TRUNCATE  # writing to /dev/null is harmless
                rule = _LandlockPathBeneathAttr(access & handled_fs, fd)
                _check(libc.syscall(ctypes.c_long(_SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset),
                                    ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule),
                                    ctypes.c_uint32(0)), f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        _check(libc.syscall(ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset),
                            ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def _make_audit_hook(read_roots: Sequence[str], write_roots: Sequence[str], block_network: bool,
                     strict: bool) -> Callable[[str, tuple], None]:
    """An audit hook refusing what the sandbox may not do. Not a security boundary (see the module
    docstring); `strict` adds process execution and ctypes calls, for when a kernel layer is missing."""
    read_roots = tuple(sorted(set(read_roots)))
    write_roots = tuple(sorted(set(write_roots)))
    path_types = (str, bytes, os.PathLike)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def inside(path: Any, roots: tuple) -> bool:
        if path is None:
            path = "."
        if isinstance(path, int):
            return True  # an already open descriptor: opening it was checked
        if not isinstance(path, path_types):
            return False
        full = os.path.realpath(os.path.join(os.getcwd(), os.fsdecode(os.fspath(path))))
        return any(full == r or full.startswith(r.rstrip(os.sep) + os.sep) for r in roots)

    def deny(what: str, path: Any = None) -> None:
        raise PermissionError(errno.EACCES, f"sandbox: {what} is not permitted",
                              None if path is None else str(path))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                       else bool((flags or 0) & write_flags))
            if not inside(path, write_roots if writing else read_roots + write_roots):
                deny("opening this path for writing" if writing else "opening this path", path)
        elif event in _WRITE_EVENTS:
            for i in _WRITE_EVENTS[event]:
                if i < len(args) and not inside(args[i], write_roots):
                    deny(f"{event}", args[i])
        elif event in _READ_EVENTS:
            for i in _READ_EVENTS[event]:
                if i < len(args) and not inside(args[i], read_roots + write_roots):
                    deny(f"{event}", args[i])
        elif block_network and event.startswith("socket."):
            deny(f"network access ({event})")
        elif strict and (event.startswith(_EXEC_EVENTS) or event in _CTYPES_EVENTS):
            deny(f"{event} without kernel isolation")

    return hook


def _run_user_main(workdir: str) -> None:
    import runpy
    import traceback

    main_path = os.path.join(workdir, "main.py")
    sys.argv = ["main.py"]
    sys.path.insert(0, workdir)  # as `python main.py` would: helper files are importable
    try:
        runpy.run_path(main_path, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        # Print the traceback from the program's own frames on, as `python main.py` would.
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != main_path:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)
        sys.stderr.flush()
        sys.exit(1)


# ------------------------------------------------------------------------------------------------------
# Pools


def _safe_run(task: SandboxTask, limits: SandboxLimits, slot: int) -> SandboxResult:
    try:
        return run_python(task.code, task.stdin, task.files, task.limits or limits, slot=slot)
    except Exception as exc:  # a task must never take the pool (or the trainer) down
        return SandboxResult.runner_error(f"{type(exc).__name__}: {exc}", slot=slot)


class SandboxPool:
    """Runs sandboxed programs concurrently on this machine: `max_workers` threads, each owning a slot
    (so concurrent runs never share a sandbox uid) and running one program at a time. Use distinct
    `slot_offset`s for pools that run at the same time on one machine."""

    def __init__(self, max_workers: int = 4, limits: SandboxLimits = SandboxLimits(), slot_offset: int = 0):
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive integer, got {max_workers!r}")
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if not 0 <= slot_offset or slot_offset + max_workers - 1 > _MAX_SLOTS:
            raise ValueError(f"slots {slot_offset}..{slot_offset + max_workers - 1} exceed [0, {_MAX_SLOTS}]")
        self.limits = limits
        self.slots = range(slot_offset, slot_offset + max_workers)
        self._free_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for s in self.slots:
            self._free_slots.put(s)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="dsv41-sandbox")

    def _run(self, task: SandboxTask) -> SandboxResult:
        slot = self._free_slots.get()  # never waits: as many slots as threads
        try:
            return _safe_run(task, self.limits, slot)
        finally:
            self._free_slots.put(slot)

    def submit(self, code: str, stdin: str = "", files: Optional[Mapping[str, Union[str, bytes]]] = None,
               limits: Optional[SandboxLimits] = None) -> concurrent.futures.Future:
        """Queue one program; the future's result is a SandboxResult (never an exception)."""
        return self._executor.submit(self._run, SandboxTask(code, stdin, files, limits))

    def submit_task(self, task: TaskLike) -> concurrent.futures.Future:
        try:
            task = _as_task(task)
        except (TypeError, ValueError) as exc:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(SandboxResult.runner_error(f"invalid task: {exc}"))
            return future
        return self._executor.submit(self._run, task)

    def map(self, tasks: Iterable[TaskLike]) -> list[SandboxResult]:
        """Run all tasks (SandboxTask, code string or {"code", "stdin", "files", "limits"} mapping);
        results in input order."""
        futures = [self.submit_task(t) for t in tasks]
        return [f.result() for f in futures]

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SandboxActor:
    """Body of a Ray actor: a SandboxPool over this actor's slot range, on whichever node it landed."""

    def __init__(self, limits: SandboxLimits, slot_offset: int, slots: int):
        self._pool = SandboxPool(max_workers=slots, limits=limits, slot_offset=slot_offset)

    def run(self, task: SandboxTask) -> SandboxResult:
        return self._pool.submit_task(task).result()


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("RaySandboxPool needs Ray: pip install -e '.[rl]' (or pip install ray)") from exc
    return ray


class RaySandboxPool:
    """`SandboxPool.map` over Ray actors, to spread sandboxed programs over a cluster's machines.

    Actor i owns slots slot_offset + i*slots_per_worker ... (distinct across actors, so two actors on one
    node never share a sandbox uid; the default offset keeps them clear of a default SandboxPool's) and
    runs up to slots_per_worker programs at once; tasks go to whichever actor is free. Ray is initialised
    (locally, or at `address`) only if it is not already; `shutdown()` kills the actors and shuts Ray down
    if this pool started it.
    """

    def __init__(self, num_workers: int = 2, limits: SandboxLimits = SandboxLimits(),
                 address: Optional[str] = None, slots_per_worker: int = 1, slot_offset: int = 1000,
                 cpus_per_worker: float = 1.0):
        for name, value in (("num_workers", num_workers), ("slots_per_worker", slots_per_worker)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if slot_offset < 0 or slot_offset + num_workers * slots_per_worker - 1 > _MAX_SLOTS:
            raise ValueError(f"slots {slot_offset}..{slot_offset + num_workers * slots_per_worker - 1} "
                             f"exceed [0, {_MAX_SLOTS}]")
        ray = _import_ray()
        self._ray = ray
        self.limits = limits
        self._owns_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
            if address is None:
                kwargs["num_cpus"] = max(1, math.ceil(num_workers * cpus_per_worker))
            else:
                kwargs["address"] = address
            ray.init(**kwargs)
            self._owns_ray = True
        # SPREAD: put the actors on different nodes where the cluster has several.
        actor_cls = ray.remote(_SandboxActor).options(num_cpus=cpus_per_worker, max_concurrency=slots_per_worker,
                                                      scheduling_strategy="SPREAD")
        self.slots_per_worker = slots_per_worker
        self._actors = [actor_cls.remote(limits, slot_offset + i * slots_per_worker, slots_per_worker)
                        for i in range(num_workers)]

    def map(self, tasks: Iterable[TaskLike]) -> list[SandboxResult]:
        """Run all tasks on the actors; results in input order, failures as error results."""
        ray = self._ray
        if self._actors is None:
            raise RuntimeError("RaySandboxPool.map after shutdown()")
        tasks = list(tasks)
        results: list[Optional[SandboxResult]] = [None] * len(tasks)
        pending: list[tuple[int, SandboxTask]] = []
        for i, t in enumerate(tasks):
            try:
                pending.append((i, _as_task(t)))
            except (TypeError, ValueError) as exc:
                results[i] = SandboxResult.runner_error(f"invalid task: {exc}")
        pending.reverse()  # pop() from the end keeps input order
        free = [self.slots_per_worker] * len(self._actors)
        alive = [True] * len(self._actors)
        in_flight: dict[Any, tuple[int, int]] = {}
        while pending or in_flight:
            for a, actor in enumerate(self._actors):
                while pending and alive[a] and free[a] > 0:
                    i, task = pending.pop()
                    in_flight[actor.run.remote(task)] = (i, a)
                    free[a] -= 1
            if not in_flight:  # every actor is dead: fail what is left rather than wait forever
                for i, _ in pending:
                    results[i] = SandboxResult.runner_error("no live Ray sandbox actor")
                break
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                i, a = in_flight.pop(ref)
                free[a] += 1
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:
                    if isinstance(exc, ray.exceptions.RayActorError):
                        alive[a] = False
                    results[i] = SandboxResult.runner_error(f"{type(exc).__name__}: {exc}")
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        if self._actors is not None:
            for actor in self._actors:
                try:
                    self._ray.kill(actor)
                except Exception:
                    pass
            self._actors = None
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False

    close = shutdown

    def __enter__(self) -> "RaySandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# ------------------------------------------------------------------------------------------------------
# Grading "small programs with tests"

# The harness runs as main.py. The marker arrives on stdin (it is not in any file the solution can read)
# and the tests are read, then deleted, before the solution runs. The solution's output is sent to stderr
# so that it can neither displace nor hide the result line, which goes to the original stdout.
_GRADER_HARNESS = r'''
import json, os, sys

def _grade():
    marker = sys.stdin.readline().strip()
    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    os.remove("tests.json")
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    result_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    passed = 0
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:
        print(f"solution failed to load: {type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        for i, test in enumerate(tests):
            try:
                try:
                    code = compile(test, f"<test {i}>", "eval")
                except SyntaxError:
                    exec(compile(test, f"<test {i}>", "exec"), namespace)
                else:
                    if not eval(code, namespace):
                        raise AssertionError(f"expression is false: {test}")
                passed += 1
            except BaseException as exc:
                print(f"test {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    line = json.dumps({"marker": marker, "passed": passed, "total": len(tests)})
    os.write(result_fd, (line + "\n").encode())
    os._exit(0)  # no atexit handler or finaliser of the solution's gets to run after the verdict

_grade()
'''


def grading_task(solution_code: str, tests: Sequence[str], limits: Optional[SandboxLimits] = None
                 ) -> tuple[SandboxTask, str]:
    """The sandbox task that grades `solution_code` against `tests` (statements such as
    "assert f(2) == 4", or expressions that must be true), and the marker `grading_score` needs."""
    if not isinstance(solution_code, str):
        raise TypeError(f"solution_code must be a str, got {type(solution_code).__name__}")
    tests = list(tests)
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("tests must be a non-empty list of strings")
    marker = secrets.token_hex(16)
    files = {"solution.py": solution_code, "tests.json": json.dumps(tests)}
    return SandboxTask(code=_GRADER_HARNESS, stdin=marker + "\n", files=files, limits=limits), marker


def grading_score(result: SandboxResult, marker: str, num_tests: int) -> float:
    """Fraction of tests passed from a grading run: 0.0 unless the sandbox ran cleanly and exactly one
    result line carries this run's marker (a second one means the solution forged it)."""
    if result.status != "ok":
        return 0.0
    verdicts = []
    for line in result.stdout.splitlines():
        if marker not in line:
            continue
        try:
            verdicts.append(json.loads(line))
        except ValueError:
            return 0.0
    if len(verdicts) != 1:
        return 0.0
    v = verdicts[0]
    if not isinstance(v, dict) or v.get("marker") != marker or v.get("total") != num_tests:
        return 0.0
    passed = v.get("passed")
    if isinstance(passed, bool) or not isinstance(passed, int) or not 0 <= passed <= num_tests:
        return 0.0
    return passed / num_tests


def grade_program(solution_code: str, tests: Sequence[str], pool_or_runner: Any = None,
                  limits: Optional[SandboxLimits] = None) -> tuple[float, SandboxResult]:
    """Run the solution and each test statement in a sandbox; return (fraction passed, raw result).

    pool_or_runner: None (run here with `run_python`), a SandboxPool, a RaySandboxPool (anything with
    `map`), or a callable with run_python's signature. limits: None uses the pool's (or the defaults).
    Each test runs in the solution's namespace, in order, in one process: a test that hangs the process
    costs all of them (the run times out and scores 0.0).
    """
    (score, result), = grade_programs([(solution_code, tests)], pool_or_runner, limits)
    return score, result


def grade_programs(items: Sequence[tuple[str, Sequence[str]]], pool_or_runner: Any = None,
                   limits: Optional[SandboxLimits] = None) -> list[tuple[float, SandboxResult]]:
    """`grade_program` for a batch of (solution_code, tests), run through the pool concurrently."""
    built = [grading_task(code, tests, limits) for code, tests in items]
    tasks = [task for task, _ in built]
    if pool_or_runner is None or (callable(pool_or_runner) and not hasattr(pool_or_runner, "map")):
        runner = pool_or_runner or run_python
        results = []
        for task in tasks:
            try:
                results.append(runner(task.code, stdin=task.stdin, files=task.files,
                                      limits=task.limits or SandboxLimits()))
            except Exception as exc:
                results.append(SandboxResult.runner_error(f"{type(exc).__name__}: {exc}"))
    elif hasattr(pool_or_runner, "map"):
        results = pool_or_runner.map(tasks)
    else:
        raise TypeError(f"pool_or_runner must be None, a pool with map() or a callable, got {pool_or_runner!r}")
    return [(grading_score(result, marker, len(task_tests)), result)
            for result, (_, marker), (_, task_tests) in zip(results, built, items)]
