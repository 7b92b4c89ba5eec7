"""Sandboxed execution of untrusted, model-written Python for verifiable RL rewards (training.md §8).

Post-training rolls out programs written by the policy and rewards them by running them: a program passes
its tests or it does not. Those programs are untrusted (a policy under optimisation pressure will find every
way to cheat or break the grader), so each one runs in its own throw-away process tree behind several
kernel layers, each recorded in `SandboxResult.isolation` so a caller can see what was actually in force,
and grading keeps the verdict out of the program's reach.

Layers (launcher.py applies them to itself, then forks the program):
- a cgroup per run (cgroups.py; v2, or the v1 memory, pids and cpu hierarchies): memory.max counts
  everything the run holds at once (every process, shared memory, memfds, the tmpfs work directory, TCP
  buffers), pids.max its tasks, a CPU quota of cpu_cores and an equal weight its CPU; the orchestrator
  creates it, the launcher opens it as root and the program joins it before any of its code runs (the
  launcher stays outside, out of the OOM killer's reach);
- resource limits (setrlimit): CPU seconds, address space, file size, processes, open files (a low
  RLIMIT_NOFILE), no core dumps; a wall-clock deadline enforced by the orchestrator;
- a dedicated unprivileged uid/gid per slot when the orchestrator runs as root (60000 + slot): RLIMIT_NPROC
  is enforced, files outside are protected by ordinary permissions too, and every leftover process can be
  found and killed by uid. Not root: the current user in a user namespace;
- namespaces: network (network=False: only a loopback that is down; network=True: a loopback that is up,
  so the program reaches itself and nothing else: not the host's services, not other machines), IPC
  (SysV shared memory, semaphores, message queues and POSIX queues die with the run and are invisible to
  other runs), mount, pid (the program cannot signal its launcher, and what it leaves dies and is reaped
  with the namespace's init);
- a tmpfs work directory of disk_bytes and max_files inodes (the disk cannot be filled, and nothing of a
  run survives it), and where needed a tmpfs hiding a non-traversable directory above the Python
  installation (e.g. /root) with the installation bind-mounted back read-only;
- Landlock (Linux >= 5.13): read and execute only the Python installation and the system library
  directories, read and write only the work directory; signals to processes outside and abstract unix
  sockets are denied where the kernel's ABI supports it;
- a seccomp filter (libseccomp): socket(AF_UNIX) is refused (path unix sockets, e.g. docker's or dbus's,
  are reachable through neither the network namespace nor Landlock), and so are socketpair() of any type
  but SOCK_STREAM (a datagram end can sendto() a path), flock() (a channel between runs through shared
  read-only files), io_uring, keyctl, bpf, perf_event_open, userfaultfd, unshare/setns and namespace flags
  to clone, mount, ptrace and process_vm_*;
- an audit hook (PEP 578) refusing socket operations and file access outside the allowed trees: defence in
  depth, NOT a security boundary on its own.

It fails closed: when a layer cannot be set up (no Landlock, no cgroup delegation, no libseccomp...), the
run is refused with status "error" and the reason, unless `SandboxLimits(trusted_code=True)` says the code
is trusted, in which case the missing layers are listed in `isolation["missing"]` and it runs anyway.

Process tree: the orchestrator starts the launcher, which forks the pid namespace's init, which forks the
program: when the program exits, the init hands its status to the launcher and exits, the kernel kills
and reaps what the program left, and the launcher (a subreaper too) exits the way the program did. At the wall deadline the orchestrator asks the launcher to do the same, and kills
the cgroup, the process group and the uid by force if it does not.

Grading (grading.py, planning.py): the solution runs in one sandbox and reports the values of the tests'
calls into it as plain data; the tests run on those values in a second, clean sandbox, in a process per
solution, where every comparison and method call happens. Nothing the solution can reach decides its
score or another's, and nothing it sends can raise out of the grader.

Known limits: RLIMIT_CPU is per process (wall time bounds a program that forks); /proc, /dev/shm and /tmp
outside the work directory are unavailable (multiprocessing semaphores fail).

Launchers of a SandboxPool are forked by its zygote (zygote.py), an interpreter that has imported what
they need, instead of started fresh: a sandbox then starts faster and shares most of its memory with the
others; the launcher's code and its layers are the same (docs/sandbox.md says what the zygote shares).

Modules: config.py (limits, tasks, results), orchestrator.py (`run_python`), launcher.py (the sandbox's
side, and the zygote's), zygote.py (the orchestrator's side of it), cgroups.py, pools.py (`SandboxPool`,
`RaySandboxPool`), grading.py (`grade_program(s)`,
`grade_stdio_programs`), planning.py (cutting tests into probes), and the grader's two sandbox programs,
_probe_harness.py and _test_evaluator.py.
"""

from dsv41.rl.sandbox.config import SANDBOX_STATUSES, SandboxLimits, SandboxResult, SandboxTask, sandbox_uid
from dsv41.rl.sandbox.grading import (
    GradingCache,
    GradingPlan,
    grade_program,
    grade_programs,
    grade_stdio_programs,
    grading_score,
    grading_task,
)
from dsv41.rl.sandbox.orchestrator import run_python
from dsv41.rl.sandbox.pools import RaySandboxPool, SandboxPool, _import_ray  # noqa: F401  (used by rl.trainer)

__all__ = [
    "SANDBOX_STATUSES",
    "GradingCache",
    "GradingPlan",
    "RaySandboxPool",
    "SandboxLimits",
    "SandboxPool",
    "SandboxResult",
    "SandboxTask",
    "grade_program",
    "grade_programs",
    "grade_stdio_programs",
    "grading_score",
    "grading_task",
    "run_python",
    "sandbox_uid",
]
