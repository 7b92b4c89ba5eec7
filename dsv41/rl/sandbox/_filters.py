"""The launcher's kernel filters, kept apart from its process management (launcher.py): the Landlock
ruleset, the seccomp filter and the audit hook. Loaded by path by the launcher, inside the sandbox's
interpreter, before any restriction applies; like the launcher it imports only the standard library and
libseccomp's bindings, and its module-level code only defines things."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
from collections.abc import Callable, Sequence
from typing import Any


def _check(ret: int, what: str) -> int:
    # The launcher's own _check, repeated: this file is loaded standalone, without the package.
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


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


# Kernel interfaces a program has no use for and that widen the kernel's attack surface (io_uring, keys,
# BPF, perf, userfaultfd, namespaces and mounts, module loading, reading other processes' memory). Refused
# with EPERM; clone() is refused only with a namespace flag, and clone3() (whose flags seccomp cannot see)
# with ENOSYS, which makes the C library fall back to clone().
_DENIED_SYSCALLS = (
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "open_by_handle_at",
    "name_to_handle_at",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "personality",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "quotactl",
    "lookup_dcookie",
    # Every sandbox can open the same read-only files (the standard library), and flock() needs no write
    # access: an exclusive lock held by one run and tried by another is a channel between them. fcntl()
    # record locks stay (sqlite in the work directory): on a read-only descriptor they cannot be exclusive.
    "flock",
)

# Audit events that modify the filesystem: their path arguments must lie in the sandbox directory.
_WRITE_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
}
_READ_EVENTS = {"os.listdir": (0,), "os.scandir": (0,), "os.listxattr": (0,), "os.getxattr": (0,)}
_EXEC_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.startfile")
_CTYPES_EVENTS = (
    "ctypes.call_function",
    "ctypes.dlsym",
    "ctypes.dlsym/handle",
    "ctypes.cdata",
    "ctypes.cdata/buffer",
    "ctypes.addressof",
    "ctypes.string_at",
    "ctypes.wstring_at",
)


class _LandlockRulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _LandlockPathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def import_seccomp():
    """libseccomp's bindings: Debian's `seccomp` module, or `pyseccomp` (the same API over ctypes)."""
    try:
        import seccomp
    except ImportError:
        import pyseccomp as seccomp
    return seccomp


def seccomp_filter(seccomp, namespace_flags: Sequence[int]) -> None:
    """Allow everything except the calls above, namespace flags to clone(), socket() of any family but
    AF_INET and AF_INET6 (a path unix socket is reachable whatever the network namespace and Landlock say,
    and so is the hypervisor through AF_VSOCK: neither is namespaced), and socketpair() of any type but
    SOCK_STREAM: a datagram pair's end can still sendto() a host socket's path, and pass it descriptors;
    a stream pair is connected for good (asyncio and multiprocessing use those).

    An allowlist on purpose: the kernel reads the family as a 32-bit int, so socket(0x1_00000001) is an
    AF_UNIX socket that an `== AF_UNIX` rule on the 64-bit register would let through; anything above
    AF_INET6 (10), upper bits included, is refused."""
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    deny_socket = seccomp.ERRNO(errno.EACCES)
    for family in range(socket.AF_INET6):
        if family != socket.AF_INET:
            f.add_rule(deny_socket, "socket", seccomp.Arg(0, seccomp.EQ, family))
    f.add_rule(deny_socket, "socket", seccomp.Arg(0, seccomp.GT, socket.AF_INET6))
    # The type's low 4 bits (SOCK_NONBLOCK and SOCK_CLOEXEC are flags above them); the kernel reads an int,
    # so the mask also drops whatever a caller puts in the register's upper half.
    for kind in range(16):
        if kind != socket.SOCK_STREAM:
            f.add_rule(deny_socket, "socketpair", seccomp.Arg(1, seccomp.MASKED_EQ, 0xF, kind))
    for name in _DENIED_SYSCALLS:
        try:
            f.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (OSError, RuntimeError, ValueError):
            # A name this libseccomp does not know (an older release): that syscall does not exist for it.
            continue
    for flag in namespace_flags:
        f.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    f.load()


def landlock_restrict(
    libc: ctypes.CDLL, read_paths: Sequence[str], write_paths: Sequence[str], restrict_tcp: bool
) -> int:
    """Restrict this process (and its future children) to reading `read_paths` and reading+writing
    `write_paths`. Only access rights the running kernel's ABI knows are handled. Returns the ABI."""
    abi = libc.syscall(
        ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET),
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION),
    )
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
    ruleset = _check(
        libc.syscall(
            ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET),
            ctypes.byref(attr),
            ctypes.c_size_t(attr_size),
            ctypes.c_uint32(0),
        ),
        "landlock_create_ruleset",
    )
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
                _check(
                    libc.syscall(
                        ctypes.c_long(_SYS_LANDLOCK_ADD_RULE),
                        ctypes.c_int(ruleset),
                        ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    ),
                    f"landlock_add_rule({path})",
                )
            finally:
                os.close(fd)
        _check(
            libc.syscall(ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
            "landlock_restrict_self",
        )
    finally:
        os.close(ruleset)
    return abi


def make_audit_hook(
    read_roots: Sequence[str], write_roots: Sequence[str], block_network: bool, strict: bool, socketpairs: bool = False
) -> Callable[[str, tuple], None]:
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
        raise PermissionError(errno.EACCES, f"sandbox: {what} is not permitted", None if path is None else str(path))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & write_flags)
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
            if socketpairs and event == "socket.__new__" and len(args) > 1 and args[1] == socket.AF_UNIX:
                return  # the seccomp filter refuses socket(AF_UNIX): this wraps a socketpair() end
            deny(f"network access ({event})")
        elif strict and (event.startswith(_EXEC_EVENTS) or event in _CTYPES_EVENTS):
            deny(f"{event} without kernel isolation")

    return hook
