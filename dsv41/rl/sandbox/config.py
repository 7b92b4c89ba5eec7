"""What a sandboxed run may use (`SandboxLimits`), what one is asked to run (`SandboxTask`) and what came
back (`SandboxResult`). Kept apart from the orchestrator so that the pools, the grader and callers can
share these types without pulling in process management."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SANDBOX_STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "file_size_limit", "process_limit", "killed")

# Sandbox uids: 60000 + slot, below 65534 (nobody) and above the usual ranges of system and human users.
SLOT_UID_BASE = 60000
MAX_SLOTS = 65534 - SLOT_UID_BASE - 1


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
    forks gets that much per child), which wall_time_s bounds. memory_bytes caps both each process's address
    space (RLIMIT_AS) and, through a memory cgroup, everything the run holds at once: all its processes,
    shared memory, memfds and the files of its work directory (a tmpfs). disk_bytes and max_files cap that
    work directory (bytes, and files + directories); file_size_bytes caps any single file. max_processes
    counts threads too (that is how the kernel counts RLIMIT_NPROC and pids.max), the sandbox's interpreter
    included. max_open_files is RLIMIT_NOFILE. cpu_cores is the run's CPU bandwidth, whatever it forks: a
    quota of that many cores per scheduling period, and the same CPU weight as every other run, so a run
    never takes more than its share from the runs beside it (its own processes, sessions included, share
    its cgroup).

    network: False, no network at all (a private network namespace whose loopback is down, and sockets
    refused); True, a private network namespace whose loopback is up, so the program can talk to itself
    over 127.0.0.1 but reaches neither the host's services nor any other machine. Unix sockets
    (socket(AF_UNIX)) are refused either way, socketpair() works.

    trusted_code: False (the default, for untrusted code) refuses to run the program when a kernel layer
    cannot be set up (see `SandboxResult.isolation`); True runs it anyway with what could be had, for code
    you trust, e.g. on a machine without Landlock or cgroups.
    """

    cpu_time_s: float = 5.0
    wall_time_s: float = 10.0
    memory_bytes: int = 512 * 1024 * 1024
    file_size_bytes: int = 16 * 1024 * 1024
    disk_bytes: int = 64 * 1024 * 1024
    max_files: int = 4096
    max_processes: int = 32
    max_open_files: int = 64
    cpu_cores: float = 1.0
    max_output_bytes: int = 64 * 1024  # per stream (stdout, stderr); the rest is read and dropped
    network: bool = False
    trusted_code: bool = False

    def __post_init__(self) -> None:
        _check_positive("cpu_time_s", self.cpu_time_s, integer=False)
        _check_positive("wall_time_s", self.wall_time_s, integer=False)
        _check_positive("cpu_cores", self.cpu_cores, integer=False)
        for name in (
            "memory_bytes",
            "file_size_bytes",
            "disk_bytes",
            "max_files",
            "max_processes",
            "max_open_files",
            "max_output_bytes",
        ):
            _check_positive(name, getattr(self, name), integer=True)
        if self.max_open_files < 16:
            # The interpreter itself needs a handful (stdio, the report pipe, imports).
            raise ValueError(f"SandboxLimits.max_open_files must be at least 16, got {self.max_open_files}")
        for name in ("network", "trusted_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SandboxLimits.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    status: "ok" (exit 0), "error" (non-zero exit, or the sandbox could not be set up or the runner
    failed: see stderr), "timeout" (killed at the wall-clock limit), "cpu_limit", "memory_limit" (a
    MemoryError, or the run's memory cgroup killed a process), "file_size_limit", "process_limit" (the
    program failed because it could not fork: best effort, read from its stderr), "killed" (another
    signal). isolation: the protections actually applied. memory_peak_bytes: the most the run held at
    once (its memory cgroup's peak), None without a cgroup.
    """

    status: str
    exit_code: int | None = None  # None when the process was killed by a signal or never ran
    signal: str | None = None  # e.g. "SIGKILL"
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    isolation: dict = field(default_factory=dict)
    slot: int | None = None
    memory_peak_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    passed = ok  # alias, reads better in graders

    @classmethod
    def runner_error(cls, message: str, slot: int | None = None) -> SandboxResult:
        """A result for a task the orchestrator itself failed to run (never raised into a pool)."""
        return cls(status="error", stderr=f"sandbox runner failed: {message}", slot=slot)


@dataclass(frozen=True)
class SandboxTask:
    """One program for a pool: `code` becomes main.py; `files` are extra files next to it."""

    code: str
    stdin: str = ""
    files: Mapping[str, str | bytes] | None = None
    limits: SandboxLimits | None = None  # None: the pool's limits


TaskLike = SandboxTask | str | Mapping[str, Any]


def as_task(task: TaskLike) -> SandboxTask:
    if isinstance(task, SandboxTask):
        return task
    if isinstance(task, str):
        return SandboxTask(code=task)
    if isinstance(task, Mapping):
        unknown = set(task) - {"code", "stdin", "files", "limits"}
        if unknown or "code" not in task:
            raise ValueError(f"a task mapping needs 'code' and may have stdin/files/limits, got keys {sorted(task)}")
        return SandboxTask(**task)
    raise TypeError(f"a task is a SandboxTask, a code string or a mapping, got {type(task).__name__}")


def sandbox_uid(slot: int) -> int:
    """The uid (and gid) a slot's programs run as when the orchestrator is root."""
    return SLOT_UID_BASE + slot
