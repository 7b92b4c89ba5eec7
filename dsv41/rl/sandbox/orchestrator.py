"""The orchestrator side of one sandboxed run: `run_python`.

It claims a slot (an exclusive lock per slot, so two runs never share a sandbox uid or cgroup, even from
two processes), creates the run's cgroup (cgroups.py), writes the program and its files to a fresh
directory, starts the launcher (launcher.py, loaded by path by the same interpreter in isolated mode)
with a JSON config, feeds stdin, drains stdout/stderr up to a cap, enforces the wall deadline, reads the
launcher's report (the layers in force, or why it refused to run) and, whatever happened, kills every
process the run left (by cgroup, by uid, by process group) and removes its directory and cgroup.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from dsv41.rl.sandbox import launcher
from dsv41.rl.sandbox.cgroups import CgroupUnavailable, RunCgroup
from dsv41.rl.sandbox.config import MAX_SLOTS, SandboxLimits, SandboxResult, sandbox_uid
from dsv41.rl.sandbox.zygote import SpawnedLauncher, Zygote, ZygoteError, launcher_command

_TAIL_BYTES = 8192  # the end of stderr is kept apart from the (head-truncated) capture, for classification
_DRAIN_AFTER_EXIT_S = 2.0  # how long pipes are drained once the sandbox is dead (data still in the pipe)
_KILL_HELPER_BUDGET_S = 3.0
_STOP_GRACE_S = 1.0
_REAP_WAIT_S = 0.25  # a reaping pid 1 takes milliseconds; one that never reaps is not waited for longer

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
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/bin",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/dev/null",
    "/dev/zero",
    "/dev/urandom",
    "/dev/random",
    "/proc/cpuinfo",
    "/sys/devices/system/cpu",
)

_CLEAN_MARK = b"clean\n"  # a slot's lock file holds this while its last run is known to have left nothing
_IN_USE_MARK = b"inuse\n"

# Layers the tests make fail on purpose, to check that the launcher (and the orchestrator, for the cgroup)
# refuses to run untrusted code without them. Empty in normal use.
_SIMULATE_UNAVAILABLE: tuple[str, ...] = ()


def launcher_zygote() -> Zygote:
    """A zygote for `run_python(..., zygote=)`: it starts (on first use) with the environment every
    launcher starts with; each run's own (HOME, TMPDIR) is set in its fork."""
    return Zygote(os.path.abspath(launcher.__file__), _BASE_ENV)


# ------------------------------------------------------------------------------------------------------
# Slots


def _slot_lock_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"dsv41-sandbox-slots-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _lock_slot(slot: int | None) -> tuple[int, int]:
    """Hold slot `slot` (waiting while another run, in this process or another, holds it), or with None
    the first free one counting down from the top of the range, away from pools (which count up from their
    offset). Returns (slot, lock fd); the lock goes with the fd, or with the process if it dies."""
    lock_dir = _slot_lock_dir()

    def open_lock(s: int) -> int:
        return os.open(os.path.join(lock_dir, f"slot-{s}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    if slot is not None:
        fd = open_lock(slot)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return slot, fd
    for s in range(MAX_SLOTS, -1, -1):
        fd = open_lock(s)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return s, fd
    raise RuntimeError("every sandbox slot is in use")


# ------------------------------------------------------------------------------------------------------
# One run


def run_python(
    code: str,
    stdin: str = "",
    files: Mapping[str, str | bytes] | None = None,
    limits: SandboxLimits = SandboxLimits(),
    slot: int | None = None,
    zygote: Zygote | None = None,
) -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox and return what happened.

    The program runs in a new directory (its cwd and HOME, a size-capped tmpfs; `files` are written next
    to main.py, relative paths only), gone afterwards whatever happens. `slot` selects the sandbox uid and
    cgroup when running as root; a run waits while another one holds the same slot. None (the default)
    takes a free slot from the top of the range, clear of the pools' slots. Raises ValueError/TypeError for
    invalid arguments; whatever the program does comes back in the result.

    `zygote` (a `Zygote`, as SandboxPool keeps one): the launcher is forked from it instead of started as
    a fresh interpreter; the same restrictions apply, in the same order, by the same code. A zygote that
    cannot start the launcher fails the run (status "error"), it never falls back to running it otherwise.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    if zygote is not None and not isinstance(zygote, Zygote):
        raise TypeError(f"zygote must be None or a Zygote, got {type(zygote).__name__}")
    if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot <= MAX_SLOTS):
        raise ValueError(f"slot must be None or an integer in [0, {MAX_SLOTS}], got {slot!r}")
    extra = _checked_files(files)

    slot, lock_fd = _lock_slot(slot)
    try:
        return _run_in_slot(code, stdin, extra, limits, slot, zygote, lock_fd)
    finally:
        os.close(lock_fd)


def _run_in_slot(
    code: str,
    stdin: str,
    extra: dict[str, bytes],
    limits: SandboxLimits,
    slot: int,
    zygote: Zygote | None,
    lock_fd: int,
) -> SandboxResult:
    as_root = os.geteuid() == 0
    uid = gid = sandbox_uid(slot) if as_root else None
    stale_zombies = 0
    # Searching /proc for the slot's uid costs a read per process on the machine, which thousands of
    # sandboxes make slow: it is skipped where the slot's last run proved it left nothing (see below).
    if uid is not None and not _take_clean_mark(lock_fd):
        # A previous run on this slot that escaped its cleanup (a crashed trainer) must not eat this run's
        # process budget or interfere with it.
        _kill_uid(uid)
        stale_zombies = _unreaped_zombies(uid)
    cleaned = False
    cgroup, cgroup_error = None, None
    try:
        if "cgroup" in _SIMULATE_UNAVAILABLE:
            raise CgroupUnavailable("cgroup made unavailable for a test")
        # The launcher stays outside (launcher.py says why): the program's tasks are all it counts.
        # +1 task: the pid namespace's init (launcher.py), which is the sandbox's but not the program's.
        cgroup = RunCgroup.create(slot, limits.memory_bytes, limits.max_processes + 1, limits.cpu_cores)
    except (CgroupUnavailable, OSError) as exc:
        cgroup_error = f"no cgroup could be created: {exc}"
    workdir = os.path.realpath(tempfile.mkdtemp(prefix=f"dsv41-sandbox-{slot}-", dir=_staging_dir()))
    try:
        _populate_workdir(workdir, code, extra, uid, gid)
        result, cleaned = _supervise(workdir, stdin, limits, uid, gid, cgroup, cgroup_error, stale_zombies, zygote)
        result.slot = slot
        return result
    finally:
        empty = True
        if cgroup is not None:
            empty = cgroup.kill_all()
        if uid is not None and not cleaned:
            # Nothing of this sandbox may outlive the run, nor write while it is removed.
            empty = _kill_uid(uid) and empty
        if cgroup is not None:
            empty = cgroup.remove() and empty
        _remove_tree(workdir)
        if uid is not None and cleaned and empty and stale_zombies == 0:
            _put_clean_mark(lock_fd)


def _take_clean_mark(lock_fd: int) -> bool:
    """Whether the slot's previous run left nothing of its uid (its launcher killed and reaped every
    process of it, and found no zombie of an older run), clearing the mark for this run: a run that
    crashes before putting it back leaves the slot to be searched. The lock file is root's, in a
    directory only root can enter, and held while it is read or written."""
    mark = os.pread(lock_fd, len(_CLEAN_MARK), 0)
    if mark != _CLEAN_MARK:
        return False
    os.pwrite(lock_fd, _IN_USE_MARK, 0)  # same length: no metadata change, which costs ms on some disks
    return True


def _put_clean_mark(lock_fd: int) -> None:
    os.pwrite(lock_fd, _CLEAN_MARK, 0)


def _staging_dir() -> str | None:
    """Where run directories are made: /dev/shm where it is a tmpfs, else the temporary directory. A run's
    directory only stages its files (the launcher copies them into the run's own tmpfs). On a disk
    mounted with online discard (this machine's root), each removal waited for a discard of its blocks:
    with thousands of sandboxes ending at once, cleanup ran at five runs per second."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "/dev/shm" and fields[2] == "tmpfs":
                    return "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None
    except OSError:
        pass
    return None


def _checked_files(files: Mapping[str, str | bytes] | None) -> dict[str, bytes]:
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


def _populate_workdir(workdir: str, code: str, files: dict[str, bytes], uid: int | None, gid: int | None) -> None:
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
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)):
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


def _unreaped_zombies(uid: int, budget_s: float = _REAP_WAIT_S) -> int:
    """Wait (briefly) for the zombies of the slot's uid to be reaped and return how many are left. Zombies
    count against the uid's RLIMIT_NPROC until their parent reaps them: a run whose launcher died (a
    crashed trainer) leaves its processes to the host's pid 1, which reaps at once on a normal system and
    never in some containers. Those left are counted into the next run's process limit (the launcher adds
    them), so they take nothing from its program, and no run waits long for a reaping that never comes."""
    deadline = time.monotonic() + budget_s
    while True:
        zombies = len(_uid_processes(uid, zombies=True)) - len(_uid_processes(uid))
        if zombies == 0 or time.monotonic() > deadline:
            return zombies
        time.sleep(0.01)


def _kill_uid(uid: int) -> bool:
    """Kill every process of a sandbox uid. Returns True when none is left."""
    if not _uid_processes(uid):
        return True
    try:
        subprocess.run(
            [sys.executable, "-I", "-S", "-B", "-c", _KILL_HELPER, str(uid), str(uid), str(_KILL_HELPER_BUDGET_S)],
            env={"PATH": _BASE_ENV["PATH"]},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=_KILL_HELPER_BUDGET_S + 10,
            check=False,
        )
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


def _supervise(
    workdir: str,
    stdin: str,
    limits: SandboxLimits,
    uid: int | None,
    gid: int | None,
    cgroup: RunCgroup | None,
    cgroup_error: str | None,
    stale_zombies: int = 0,
    zygote: Zygote | None = None,
) -> tuple[SandboxResult, bool]:
    """The run, and whether its launcher reported that nothing of the sandbox's uid is left."""
    read_paths = _python_roots() + list(_SYSTEM_READ_PATHS)
    report_r, report_w = os.pipe()
    config = {
        "workdir": workdir,
        "uid": uid,
        "gid": gid,
        "report_fd": report_w,
        "orchestrator_pid": os.getpid(),
        "read_paths": read_paths,
        "python_roots": _python_roots(),
        "network": limits.network,
        "cpu_time_s": limits.cpu_time_s,
        "memory_bytes": limits.memory_bytes,
        "file_size_bytes": limits.file_size_bytes,
        "max_processes": limits.max_processes,
        "stale_zombies": stale_zombies,
        "disk_bytes": limits.disk_bytes,
        "max_files": limits.max_files,
        "max_open_files": limits.max_open_files,
        "trusted_code": limits.trusted_code,
        "simulate_unavailable": list(_SIMULATE_UNAVAILABLE),
        "cgroup_procs": cgroup.procs_files if cgroup is not None else [],
        "cgroup_version": cgroup.version if cgroup is not None else None,
        "cgroup_error": cgroup_error,
    }
    env = dict(_BASE_ENV, HOME=workdir, TMPDIR=workdir)
    out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
    start = time.monotonic()
    try:
        if zygote is not None:
            # Forked by the zygote, in a session of its own with the same pipes, directory and environment.
            try:
                proc = zygote.spawn(config, env, workdir, report_w)
            except ZygoteError as exc:
                os.close(report_r)
                return SandboxResult(status="error", stderr=f"sandbox setup failed: {exc}\n"), False
        else:
            # start_new_session: the sandbox is its own process group and session, killable as a whole.
            proc = subprocess.Popen(
                launcher_command(os.path.abspath(launcher.__file__), "child_main", config),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                pass_fds=(report_w,),
                close_fds=True,
            )
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)  # the launcher holds the only write end: EOF once it is done with it
    try:
        status, rusage, timed_out, exit_time, report = _pump(
            proc, stdin.encode("utf-8"), out, err, start + limits.wall_time_s, uid, cgroup, report_r
        )
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
    if cgroup is None:
        isolation.setdefault("cgroup", False)
        isolation["cgroup_error"] = cgroup_error
    leftovers_killed = True
    oom_kills, peak = 0, None
    if cgroup is not None:
        leftovers_killed = cgroup.kill_all()
        oom_kills, peak = cgroup.oom_kills(), cgroup.peak_bytes()
    if uid is not None and not report.get("cleaned"):
        leftovers_killed = _kill_uid(uid) and leftovers_killed
    if cgroup is not None or uid is not None:
        isolation["leftovers_killed"] = leftovers_killed
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
        result_status = _classify(exit_code, timed_out, cpu_s, limits, tail, oom_kills)
    result = SandboxResult(
        status=result_status,
        exit_code=exit_code if exit_code >= 0 else None,
        signal=sig_name,
        stdout=stdout_text,
        stderr=stderr_text,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        wall_s=exit_time - start,
        cpu_s=cpu_s,
        isolation=isolation,
        memory_peak_bytes=peak,
    )
    return result, bool(report.get("cleaned"))


def _kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pump(
    proc: subprocess.Popen | SpawnedLauncher,
    stdin_data: bytes,
    out: _Capture,
    err: _Capture,
    deadline: float,
    uid: int | None,
    cgroup: RunCgroup | None,
    report_fd: int,
):
    """Feed stdin, drain stdout/stderr, enforce the wall deadline and reap the launcher (wait4, for its
    CPU time). Returns (wait status, rusage, timed_out, exit time, the launcher's report)."""
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
    report: dict = {}

    def reaped(status_and_rusage) -> None:
        nonlocal wait_status, rusage, exit_time, drain_deadline, report
        _, wait_status, rusage = status_and_rusage
        if pidfd is not None and pidfd in sel.get_map():
            sel.unregister(pidfd)
        exit_time = time.monotonic()
        # Popen must not waitpid() this pid again (it could belong to someone else by then).
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        report = _read_report(report_fd)  # complete: the launcher is gone
        # Descendants may still hold the pipes open: kill them so the drain below reaches EOF.
        _kill_process_group(proc.pid)
        if cgroup is not None:
            cgroup.kill_all()
        if uid is not None and not report.get("cleaned"):
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
                        stdin_pos += os.write(stdin_fd, stdin_data[stdin_pos : stdin_pos + 65536])
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
    return wait_status, rusage, timed_out, exit_time, report


def _stop_sandbox(pid: int) -> tuple:
    """Wall deadline: ask the launcher to kill and reap the program and its descendants (it is their
    reaper, so nothing is left as a zombie for the system's init), then kill whatever is left by force
    if it does not exit promptly (the program may have stopped or killed it). Returns wait4's result."""
    try:
        os.kill(pid, launcher.STOP_SIGNAL)
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
    # One JSON line (the layers in force, or why it refused), and the cleanup line when it left nothing.
    first, _, rest = b"".join(chunks).partition(b"\n")
    try:
        report = json.loads(first or b"{}")
    except ValueError:
        return {"fatal": "the sandbox launcher wrote an unreadable report"}
    if not isinstance(report, dict):
        return {"fatal": "the sandbox launcher wrote an unreadable report"}
    report.pop("cleaned", None)  # only the line of its own says so
    if rest == launcher.CLEANED_LINE:
        report["cleaned"] = True
    return report


def _classify(
    exit_code: int, timed_out: bool, cpu_s: float, limits: SandboxLimits, stderr_tail: str, oom_kills: int = 0
) -> str:
    if timed_out:
        return "timeout"
    if oom_kills and exit_code != 0:
        return "memory_limit"  # the run's memory cgroup killed a process (the program, or one it needed)
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
    if "No space left on device" in stderr_tail or "[Errno 28]" in stderr_tail:
        return "file_size_limit"  # the work directory's tmpfs is full (disk_bytes or max_files)
    if any(m in stderr_tail for m in ("BlockingIOError", "Resource temporarily unavailable", "can't start new thread")):
        return "process_limit"  # fork/clone failing with EAGAIN under RLIMIT_NPROC (threads count too)
    return "error"
