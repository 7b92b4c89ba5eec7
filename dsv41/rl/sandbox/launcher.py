"""The sandbox's first process (the launcher): it applies every restriction to itself, then forks the pid
namespace's init, which forks the program; the launcher reaps the init and exits the way the program did.

This file runs inside the sandbox's interpreter, which loads it by path (not through the `dsv41` package,
whose import pulls in torch) before any restriction applies: it imports only the standard library and
libseccomp's Python bindings, and its module-level code stays cheap and side-effect free. The orchestrator
(orchestrator.py) passes it one JSON config on the command line and reads one JSON report from a pipe.

Order of the layers, each recorded in the report's `isolation` (see the package docstring for what each
one stops):
1. open the run's cgroup as root (the program joins it after the fork, before any of its code runs);
2. namespaces: network (loopback down, or up for network=True), IPC (SysV shared memory, semaphores and
   message queues, POSIX message queues: gone with the run), mount, pid (for its children); without root a
   user namespace first;
3. mounts: a size- and inode-capped tmpfs over the work directory (disk use in total and the file count
   are bounded, and it all vanishes with the run), and where needed a tmpfs hiding a non-traversable
   directory above the Python installation;
4. Landlock (no_new_privs first);
5. the sandbox uid (root) or no capabilities (user namespace); parent-death signal;
6. rlimits;
7. the seccomp filter, last, since it forbids some of the calls above.
The Landlock ruleset, the seccomp filter and the audit hook are in _filters.py, loaded by path at step 1.
Unless the config says the code is trusted, a layer that cannot be had is fatal: the launcher writes the
reason to the report and exits with 125 without running the program (it fails closed).
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import resource
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

SETUP_FAILED_EXIT = 125  # the launcher's exit code when a mandatory protection could not be applied
STOP_SIGNAL = signal.SIGUSR1  # orchestrator -> launcher: the wall deadline has passed, end the program
CLEANED_LINE = b'{"cleaned": true}\n'  # the report's last line when the launcher left nothing of its uid

# Linux constants (uapi), identical on x86_64 and aarch64.
_CLONE_NEWNS = 0x00020000
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWTIME = 0x00000080
_NAMESPACE_FLAGS = (
    _CLONE_NEWNS,
    _CLONE_NEWCGROUP,
    _CLONE_NEWUTS,
    _CLONE_NEWIPC,
    _CLONE_NEWUSER,
    _CLONE_NEWPID,
    _CLONE_NEWNET,
    _CLONE_NEWTIME,
)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_SIOCSIFFLAGS, _IFF_UP = 0x8914, 0x1


def _load_filters():
    """_filters.py, next to this file, loaded by path as this file is (the package is not imported here).
    Kept in sys.modules, so a launcher forked from the zygote finds it loaded already (and shared)."""
    import importlib.util

    name = "_dsv41_sandbox_filters"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_filters.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def child_main(config_json: str) -> None:
    """The sandbox's first process, started cold (a fresh interpreter): see `launch`."""
    launch(json.loads(config_json))


def launch(cfg: dict) -> None:
    """The sandbox's first process: apply every restriction to itself, then fork the program and act as
    its reaper. Orphans of the program are re-parented here (PR_SET_CHILD_SUBREAPER), so once the program
    exits everything it left behind is killed and reaped here, and the launcher exits the way the program
    did (same exit code, or the same signal), with their CPU time in its rusage. Returns only in the
    program's process, once the program is done (its interpreter then shuts down normally)."""
    report_fd = cfg["report_fd"]
    isolation: dict[str, Any] = {}
    libc = None
    try:
        libc = _libc()
        hook, can_kill_all = _child_setup(libc, cfg, isolation)
        _check(
            libc.prctl(
                ctypes.c_int(_PR_SET_CHILD_SUBREAPER),
                ctypes.c_ulong(1),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
            ),
            "prctl(PR_SET_CHILD_SUBREAPER)",
        )
        isolation["subreaper"] = True
        # The stop request may come at any time from now on, so its handler is in place before the fork.
        children: list[int] = []

        def stop(_signum, _frame):
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        signal.signal(STOP_SIGNAL, stop)
        status_r, status_w = os.pipe()
        init = os.fork()  # pid 1 of the run's pid namespace (unshared in _child_setup)
    except BaseException as exc:  # refuse to run the untrusted program half-protected
        fatal = {"fatal": f"{type(exc).__name__}: {exc}", "isolation": isolation}
        os.write(report_fd, json.dumps(fatal).encode())
        os._exit(SETUP_FAILED_EXIT)
    if init == 0:
        os.close(report_fd)  # the program must not be able to write (forge) the report
        os.close(status_r)
        try:
            for fd in cfg["_cgroup_fds"]:
                os.write(fd, b"0")  # into the run's cgroup, before any code of the program runs
                os.close(fd)
        except OSError as exc:
            os.write(2, f"sandbox setup failed: could not join the run's cgroup: {exc}\n".encode())
            os._exit(SETUP_FAILED_EXIT)
        signal.signal(STOP_SIGNAL, signal.SIG_DFL)
        _die_with_parent(libc)  # cleared by fork; the launcher dies with the orchestrator
        program = os.fork()
        if program == 0:
            os.close(status_w)
            _die_with_parent(libc)
            sys.addaudithook(hook)
            _run_user_main(cfg["workdir"])
            return  # normal interpreter shutdown: flushes the program's output, runs its atexit handlers
        _namespace_init(program, status_w)
    os.close(status_w)
    for fd in cfg["_cgroup_fds"]:
        os.close(fd)
    isolation["kill_all_at_exit"] = can_kill_all
    os.write(report_fd, json.dumps({"isolation": isolation}).encode() + b"\n")
    os.close(0)  # stdin belongs to the program
    children.append(init)
    status = _reap_until(init)
    reported = os.read(status_r, 4)
    os.close(status_r)
    if len(reported) == 4:
        status = struct.unpack("i", reported)[0]  # the program's own; else init was killed (the deadline)
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
        # Nothing of the sandbox's uid is left (kill(-1) reached all of it, and all of it was our
        # descendants, now reaped): the orchestrator may skip its own search of /proc for them.
        os.write(report_fd, CLEANED_LINE)
    os.close(report_fd)
    # Otherwise the orchestrator kills the process group once it has reaped this process.
    if status is None or os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status) if status is not None else 1)
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be (and need not be) reset
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def _die_with_parent(libc: ctypes.CDLL) -> None:
    libc.prctl(
        ctypes.c_int(_PR_SET_PDEATHSIG),
        ctypes.c_ulong(signal.SIGKILL),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    )


def _namespace_init(program: int, status_w: int) -> None:
    """Pid 1 of the run's pid namespace: reap until the program exits, hand its wait status to the
    launcher, exit. The kernel then kills whatever the program left in the namespace and reaps it, so no
    zombie is left for the host's pid 1 (which, in a container, may never reap). The program can signal
    neither this process (signals from inside a namespace do not reach its init unless it handles them)
    nor the launcher (which has no pid in the namespace), so it cannot orphan its processes either."""
    for fd in (0, 1, 2):
        os.close(fd)  # the program's streams are the program's: EOF comes when it and its children are done
    status = None
    while status is None:
        try:
            child, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if child == program:
            status = wait_status
    if status is not None:
        os.write(status_w, struct.pack("i", status))
    os._exit(0)


def _reap_until(pid: int) -> int | None:
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


def _unavailable(cfg: dict, layer: str) -> None:
    """Tests make a layer fail on purpose (config "simulate_unavailable") to check the launcher fails
    closed; a real failure raises from the system call itself."""
    if layer in cfg.get("simulate_unavailable", ()):
        raise OSError(errno.ENOSYS, f"{layer} made unavailable for a test")


def _child_setup(libc: ctypes.CDLL, cfg: dict, isolation: dict) -> tuple[Callable[[str, tuple], None], bool]:
    """Apply the restrictions to this process (inherited by the program). Returns the program's audit
    hook and whether kill(-1) reaches only this sandbox. Raises if a mandatory protection fails."""
    import runpy  # noqa: F401  (imported while the whole filesystem is still readable)
    import traceback  # noqa: F401

    filters = _load_filters()
    as_root = os.geteuid() == 0
    workdir = cfg["workdir"]
    uid, gid = cfg["uid"], cfg["gid"]
    errors: dict[str, str] = {}  # layer -> why it is missing

    # 1. The run's cgroup. Opened here, as root; the program joins it right after the fork, before any of
    # its code runs (writing "0" through these descriptors moves the writer; the kernel checks the
    # opener's credentials). The launcher itself stays outside: were it inside, the cgroup's OOM killer
    # could pick it (socket buffers and shared memory belong to no process's RSS), and the program's
    # processes would become zombies of the system's init, eating the slot's RLIMIT_NPROC until reaped.
    isolation["cgroup"] = False
    cgroup_fds: list[int] = []
    if cfg.get("cgroup_procs"):
        try:
            _unavailable(cfg, "cgroup")
            for procs in cfg["cgroup_procs"]:
                cgroup_fds.append(os.open(procs, os.O_WRONLY | os.O_CLOEXEC))
            isolation["cgroup"] = True
            isolation["cgroup_version"] = cfg["cgroup_version"]
        except OSError as exc:
            errors["cgroup"] = str(exc)
    else:
        errors["cgroup"] = cfg.get("cgroup_error", "no cgroup was created for this run")
    cfg["_cgroup_fds"] = cgroup_fds

    try:  # loaded now: libseccomp is out of reach once Landlock applies
        seccomp = filters.import_seccomp()
    except (ImportError, OSError) as exc:
        seccomp = None
        errors["seccomp"] = f"libseccomp's Python bindings are not importable ({exc}): pip install pyseccomp"

    # 2. Namespaces. Without root, a user namespace first grants the capabilities for the others.
    in_user_ns = False
    if not as_root:
        my_uid, my_gid = os.getuid(), os.getgid()
        try:
            _check(libc.unshare(ctypes.c_int(_CLONE_NEWUSER)), "unshare(CLONE_NEWUSER)")
            in_user_ns = True
            _map_own_ids(my_uid, my_gid)
        except OSError as exc:
            errors["user_namespace"] = str(exc)
    isolation["user_namespace"] = in_user_ns
    for layer, flag in (
        ("network_namespace", _CLONE_NEWNET),
        ("ipc_namespace", _CLONE_NEWIPC),
        ("mount_namespace", _CLONE_NEWNS),
        ("pid_namespace", _CLONE_NEWPID),  # for the children: the next fork is the namespace's init
    ):
        try:
            _unavailable(cfg, layer)
            _check(libc.unshare(ctypes.c_int(flag)), f"unshare({layer})")
            isolation[layer] = True
        except OSError as exc:
            isolation[layer] = False
            errors[layer] = str(exc)
    if isolation["network_namespace"] and cfg["network"]:
        try:
            _loopback_up()
            isolation["loopback"] = True
        except OSError as exc:
            errors["loopback"] = str(exc)

    # 3. Mounts (only in our own mount namespace: never touch the host's).
    isolation["workdir_tmpfs"] = False
    if isolation["mount_namespace"]:
        # Private propagation, or the mounts below would appear in the orchestrator's namespace too.
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
        if as_root and uid is not None:
            # The Python installation must stay reachable for the sandbox uid.
            shadows = _untraversable_ancestors(cfg["python_roots"] + [workdir])
            if shadows:
                try:
                    _shadow_directories(libc, shadows, cfg["python_roots"], workdir)
                except OSError as exc:  # mandatory: the program could not even import the standard library
                    raise RuntimeError(
                        f"the Python installation is below {', '.join(shadows)}, which the sandbox uid cannot "
                        f"traverse, and no tmpfs could hide that ({exc}); make those directories "
                        "traversable (chmod o+x) or use a Python installed elsewhere"
                    ) from exc
                isolation["python_shadowed"] = True
        try:
            _unavailable(cfg, "workdir_tmpfs")
            _workdir_tmpfs(libc, workdir, cfg["disk_bytes"], cfg["max_files"], uid, gid)
            isolation["workdir_tmpfs"] = True
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                raise RuntimeError(
                    f"the task's files do not fit in disk_bytes={cfg['disk_bytes']} / "
                    f"max_files={cfg['max_files']}: {exc}"
                ) from exc
            errors["workdir_tmpfs"] = str(exc)
    else:
        errors["workdir_tmpfs"] = "no mount namespace"
        if as_root and uid is not None and _untraversable_ancestors(cfg["python_roots"] + [workdir]):
            raise RuntimeError(
                "the Python installation is not traversable for the sandbox uid and no mount "
                "namespace could be made to fix that"
            )
    os.chdir(workdir)

    # Counted now: /proc is out of reach once Landlock applies.
    user_tasks = _count_tasks_of_uid(os.getuid()) if uid is None and not in_user_ns else 0

    # 4. Landlock (needs no_new_privs, which also stops setuid binaries from regaining privileges).
    _check(
        libc.prctl(
            ctypes.c_int(_PR_SET_NO_NEW_PRIVS),
            ctypes.c_ulong(1),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        "prctl(PR_SET_NO_NEW_PRIVS)",
    )
    try:
        _unavailable(cfg, "landlock")
        # TCP rules only without a network namespace of our own; with one, there is nothing to reach.
        abi = filters.landlock_restrict(
            libc, cfg["read_paths"], [workdir], restrict_tcp=not cfg["network"] and not isolation["network_namespace"]
        )
        isolation["landlock"] = True
        isolation["landlock_abi"] = abi
    except OSError as exc:
        isolation["landlock"] = False
        errors["landlock"] = str(exc)

    # 5. Identity.
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
    _die_with_parent(libc)
    if os.getppid() != cfg["orchestrator_pid"]:
        raise RuntimeError("the orchestrator exited during sandbox setup")

    # 6. Resource limits: lowering a limit needs no privilege, and nothing above is charged to them.
    cpu = math.ceil(cfg["cpu_time_s"])
    if uid is not None or in_user_ns:
        # The sandbox uid (or the fresh user namespace) holds only this sandbox's tasks; +2: the launcher and
        # the pid namespace's init.
        # Zombies of the uid that nobody reaps still count (the orchestrator measured them): not against the
        # program.
        nproc = cfg["max_processes"] + 2 + cfg.get("stale_zombies", 0)
    else:
        nproc = user_tasks + cfg["max_processes"] + 1  # shared with the user's other processes; +1: the init
    nofile = cfg["max_open_files"]
    for name, soft, hard in (
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_FSIZE", cfg["file_size_bytes"], cfg["file_size_bytes"]),
        ("RLIMIT_NPROC", nproc, nproc),
        ("RLIMIT_NOFILE", nofile, nofile),
        ("RLIMIT_AS", cfg["memory_bytes"], cfg["memory_bytes"]),
    ):
        which = getattr(resource, name)
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:  # never try to raise a limit someone else imposed
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(which, (soft, hard))
    isolation["rlimits"] = True

    # 7. The syscall filter, last: it forbids unshare and mount, used above.
    isolation["seccomp"] = False
    if seccomp is not None:
        try:
            _unavailable(cfg, "seccomp")
            filters.seccomp_filter(seccomp, _NAMESPACE_FLAGS)
            isolation["seccomp"] = True
        except (OSError, RuntimeError, ValueError) as exc:
            errors["seccomp"] = str(exc)

    kernel_ok = isolation["landlock"] and isolation["network_namespace"]
    isolation["audit_hook"] = True
    isolation["audit_hook_strict"] = not kernel_ok
    if errors:
        isolation["missing"] = errors
        if not cfg["trusted_code"]:
            raise RuntimeError(
                "refusing to run untrusted code without "
                + "; ".join(f"{layer} ({why})" for layer, why in errors.items())
                + " (SandboxLimits(trusted_code=True) runs code you trust anyway)"
            )
    read_roots = [workdir] + [os.path.realpath(p) for p in cfg["read_paths"]] + list(cfg["read_paths"])
    # With the seccomp filter in force an AF_UNIX socket object can only wrap a socketpair() end, which
    # asyncio's event loop and multiprocessing's pipes need: the hook lets those through.
    hook = filters.make_audit_hook(
        read_roots, [workdir], block_network=not cfg["network"], strict=not kernel_ok, socketpairs=isolation["seccomp"]
    )
    signal_scoped = bool(isolation["landlock"] and isolation["landlock_abi"] >= 6)
    can_kill_all = (as_root and uid is not None) or signal_scoped
    return hook, can_kill_all


def _loopback_up() -> None:
    """Bring up `lo` in our new network namespace (CAP_NET_ADMIN there): 127.0.0.1 then works, and only
    reaches this sandbox."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        import fcntl

        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", _IFF_UP))


def _workdir_tmpfs(libc: ctypes.CDLL, workdir: str, size: int, inodes: int, uid: int | None, gid: int | None) -> None:
    """Mount a tmpfs of `size` bytes and `inodes` files over the work directory and copy the files the
    orchestrator put there into it (an O_PATH descriptor keeps the covered directory reachable)."""
    source = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        owner = f",uid={uid},gid={gid}" if uid is not None else ""
        _mount(
            libc, "tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},nr_inodes={inodes},mode=0700{owner}"
        )
        _copy_tree(f"/proc/self/fd/{source}", workdir, uid, gid)
    finally:
        os.close(source)


def _copy_tree(src: str, dst: str, uid: int | None, gid: int | None) -> None:
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(target, 0o700)
            _copy_tree(entry.path, target, uid, gid)
        elif entry.is_file(follow_symlinks=False):
            with open(entry.path, "rb") as fin, open(target, "wb") as fout:
                while True:
                    chunk = fin.read(1 << 20)
                    if not chunk:
                        break
                    fout.write(chunk)
        else:
            continue  # the orchestrator writes plain files and directories only
        if uid is not None:
            os.chown(target, uid, gid, follow_symlinks=False)


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
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")


def sum_status_field_of_uid(uid: int, field: bytes) -> int:
    """The sum of one numeric /proc/<pid>/status field (its first number, e.g. b"Threads", b"VmRSS" in kB)
    over the processes whose real uid is `uid`; processes that vanish meanwhile are skipped."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            if int(fields[b"Uid"].split()[0]) == uid:
                total += int(fields[field].split()[0])
        except (OSError, KeyError, ValueError):
            continue
    return total


def _count_tasks_of_uid(uid: int) -> int:
    return sum_status_field_of_uid(uid, b"Threads")


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


def _mount(
    libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount({source!r} -> {target!r})",
    )


def _shadow_directories(libc: ctypes.CDLL, shadows: list[str], python_roots: list[str], workdir: str) -> None:
    """In our private mount namespace, cover each directory in `shadows` with an empty tmpfs (mode 0755) and
    bind-mount back only the trees below it that the sandbox needs: the Python installation read-only and
    the sandbox directory read-write. Everything else below (e.g. the rest of /root) disappears."""
    wanted = [(os.path.realpath(p), False) for p in python_roots] + [(workdir, True)]
    for shadow in shadows:
        below = []
        for path, writable in wanted:
            if path.startswith(shadow + os.sep) and os.path.isdir(path):
                # Keep only outermost trees; a tree inside another one comes back with it.
                if not any(
                    path.startswith(other + os.sep)
                    for other, _ in wanted
                    if other != path and other.startswith(shadow + os.sep)
                ):
                    below.append((path, writable, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        _mount(libc, "tmpfs", shadow, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
        for path, writable, fd in below:
            os.makedirs(path, mode=0o755, exist_ok=True)
            # The O_PATH descriptor still names the tree hidden under the tmpfs.
            _mount(libc, f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            if not writable:
                _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
            os.close(fd)


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
# The zygote: a launcher interpreter started once, that forks a launcher per run.
#
# A cold start costs a fresh interpreter per run (about 0.045 s and its own copy of every page it writes).
# The zygote imports what a launcher and a program's interpreter need, freezes those objects out of the
# garbage collector's reach (a collection would write to every object's header and so copy every page),
# and then only forks: each fork shares the zygote's pages until it writes to them. The fork is a clone()
# with CLONE_PARENT, so the launcher is the orchestrator's child exactly as a cold one is (the
# orchestrator reaps it with its rusage, signals it, and its parent-death signal and getppid() check name
# the orchestrator), and then it runs `launch`, the same code a cold launcher runs: every restriction is
# applied by the fork, after it leaves the zygote, none by the zygote. The zygote itself runs no
# program code, holds no descriptor but its control socket, and keeps nothing of a run: each request
# carries its run's configuration and descriptors, which the zygote closes once forked.

# Modules a launcher needs (imported at the top of this file, or by _child_setup and _run_user_main) and
# modules the grader's programs and typical solutions import: shared by every fork instead of imported
# (and allocated) again by each. More costs the zygote memory once and each fork nothing until it uses
# them.
_ZYGOTE_PRELOAD = (
    "runpy",
    "pkgutil",  # imported by runpy.run_path
    "pwd",
    "traceback",
    "importlib.util",
    "fcntl",
    "gc",
    "builtins",
    "itertools",
    "types",
    "operator",
    "random",
    "select",
    "ast",
    "collections",
    "functools",
    "math",
    "re",
    "heapq",
    "bisect",
    "string",
    "typing",
    "dataclasses",
)
_CLONE_PARENT = 0x00008000
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
_ZYGOTE_REQUEST_BYTES = 1 << 18  # a run's configuration is a few KiB
_ZYGOTE_FDS = 4  # stdin, stdout, stderr, report


def zygote_main(config_json: str) -> None:
    """Serve fork requests on the control socket until the orchestrator closes it (or dies). A request is
    one datagram: JSON {"config", "env", "cwd"} with the run's stdin, stdout, stderr and report pipe ends
    attached; the reply is the new launcher's pid, or "error: why". Returns only in a forked program's
    process, when the program is done."""
    import gc
    import importlib

    cfg = json.loads(config_json)
    control = socket.socket(fileno=cfg["control_fd"])
    libc = _libc()
    _die_with_parent(libc)
    if os.getppid() != cfg["orchestrator_pid"]:
        os._exit(1)
    for name in _ZYGOTE_PRELOAD:
        importlib.import_module(name)
    try:  # a launcher that cannot have them fails closed in _child_setup, saying why
        _load_filters().import_seccomp()
    except (ImportError, OSError):
        pass
    # The PyDLL variant keeps the GIL across the call, as os.fork() does around fork().
    py_libc = ctypes.PyDLL(None, use_errno=True)
    py_libc.syscall.restype = ctypes.c_long
    clone_nr = _SYS_CLONE.get(os.uname().machine)
    gc.collect()
    gc.freeze()
    control.sendall(b"ready")
    while True:
        try:
            request, fds, flags, _ = socket.recv_fds(control, _ZYGOTE_REQUEST_BYTES, _ZYGOTE_FDS)
        except InterruptedError:
            continue
        except OSError:
            os._exit(0)
        if not request:
            os._exit(0)  # the orchestrator closed its end: nothing more to serve
        pid, error = 0, None
        if len(fds) != _ZYGOTE_FDS or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            error = "malformed request"
        elif clone_nr is None:
            error = f"no clone() number known for {os.uname().machine}"
        else:
            try:
                pid = _clone_parent(py_libc, clone_nr)
            except OSError as exc:
                error = str(exc)
        if pid == 0 and error is None:
            _zygote_child(control, request, fds)
            return  # the program's process, once its program is done: its interpreter shuts down normally
        for fd in fds:
            os.close(fd)
        del request, fds
        try:
            control.sendall(f"error: {error}".encode() if error else str(pid).encode())
        except OSError:
            os._exit(0)


def _clone_parent(py_libc: ctypes.PyDLL, clone_nr: int) -> int:
    """fork(), but the child's parent is our parent (CLONE_PARENT): 0 in the child, its pid here. The
    interpreter's own fork protocol (its locks, thread states and os.register_at_fork hooks, e.g. random's
    reseeding) runs around it as os.fork() runs it. Only the C library's fork bookkeeping is skipped: this
    process has one thread and holds no C library lock, and the launcher's own forks are ordinary ones."""
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = py_libc.syscall(
        ctypes.c_long(clone_nr),
        ctypes.c_ulong(_CLONE_PARENT | signal.SIGCHLD),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    )
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone(CLONE_PARENT): {os.strerror(err)}")
    return pid


def _zygote_child(control: socket.socket, request: bytes, fds: list[int]) -> None:
    """In the fork: become what a cold launcher is when it starts (its own session, the run's pipes as
    0, 1, 2 and 3, nothing else open, the run's directory and environment), then `launch`."""
    report = fds[3]
    try:
        control.close()  # the program must never reach the zygote: it could ask for a launcher of its own
        req = json.loads(request)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # sources are >= 3 (0-2 are the zygote's /dev/null), target 3 comes last
        report = 3
        os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        cfg = req["config"]
        cfg["report_fd"] = 3
    except BaseException as exc:
        try:
            os.write(report, json.dumps({"fatal": f"zygote fork: {type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    launch(cfg)
